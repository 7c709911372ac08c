"""How fast the embedded target runs when its GGUF file is a K-quant one, as most GGUF files are.

Writes the embedded model again as llama.cpp's Q4_K_M would lay it out — Q4_K for most
weights, Q6_K for v and down in the layers llama.cpp gives more bits and for the output (here the
tied embeddings), and llama.cpp's fallbacks where a row is not made of whole 256-weight
super-blocks (SmolLM2-135M's 576-wide rows: Q5_0 for Q4_K, Q8_0 for Q6_K) — with the metadata and
tokenizer of the original, requantised from its Q4_1 values by tests/tiny.py's plain quantiser
(not llama.cpp's search for the best scales: the speed is the same, the values a little
different). Then times `rsd bench` on it (`ar`, `sd` at depth 1) in three runs, each in a cache
folder of its own: the file's scales and offsets kept (this version of rsd), the same cache
without them (what earlier versions ran: float32 weights wherever the values alone are not
blocks), and the original Q4_1 file.

    .venv/bin/python benchmarks/k_quants.py [--out benchmarks/results/amd-epyc/k-quants.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}  # llama.cpp's, for rows not of whole super-blocks


def q4_k_m_type(name: str, columns: int, layers: int) -> str | None:
    """llama.cpp's Q4_K_M choice for a tensor (None: kept as F32), with its fallback."""
    if not name.endswith(".weight") or "norm" in name:
        return None
    kind = "Q4_K"
    if name in ("output.weight", "token_embd.weight"):  # (token_embd is the output where they are tied)
        kind = "Q6_K"
    elif name.endswith(("attn_v.weight", "ffn_down.weight")):
        layer = int(name.split(".")[1])
        if layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2:
            kind = "Q6_K"
    return kind if columns % 256 == 0 else FALLBACK[kind]


def requantise(source: Path, target: Path) -> dict[str, int]:
    """Write `source` again with q4_k_m_type's types; returns how many tensors of each type."""
    import gguf
    import numpy as np
    import torch
    from tiny import quantise_k

    reader = gguf.GGUFReader(str(source))
    architecture = reader.fields["general.architecture"].contents()
    layers = reader.fields[f"{architecture}.block_count"].contents()
    writer = gguf.GGUFWriter(str(target), architecture)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        values = gguf.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        kind = q4_k_m_type(tensor.name, values.shape[-1], layers) if values.ndim == 2 else None
        counts[kind or "F32"] = counts.get(kind or "F32", 0) + 1
        if kind is None:
            writer.add_tensor(tensor.name, values)
        else:
            writer.add_tensor(tensor.name, quantise_k(torch.from_numpy(values), kind),
                              raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts


def bench(gguf_file: Path, cache: Path, drop_hints: bool, args) -> dict:
    """`rsd bench` on a profile whose target is this file (its first layers the draft), in `cache`."""
    env = {**os.environ, "RSD_CACHE_DIR": str(cache)}
    profile = cache / "profile.toml"
    cache.mkdir(parents=True, exist_ok=True)
    profile.write_text(f'[target]\nsource = "{gguf_file}"\n[draft]\nkind = "early-exit"\nadapter = ""\n')
    python = [sys.executable, "-m", "rsd_cli"]
    subprocess.run([*python, "inspect-tree", "Hi", "-p", str(profile)], env=env, check=True,
                   capture_output=True)  # (converts the file once, outside the timing)
    if drop_hints:
        for hints in cache.glob("gguf/*/rsd-block-hints.safetensors"):
            hints.unlink()
    run = subprocess.run([*python, "bench", "-p", str(profile), "--variants", "ar,sd", "--depths", "1", "--limit",
                          str(args.limit), "-n", str(args.tokens), "--repeats", str(args.repeats), "--no-assisted",
                          "--no-hf-static", "--json"], env=env, check=True, capture_output=True, text=True)
    return json.loads(run.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from rsd_cli.models import embedded_gguf

    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        k_file = folder / "SmolLM2-135M-Instruct.Q4_K_M.gguf"
        counts = requantise(embedded_gguf(), k_file)
        print("types:", counts, flush=True)
        results = {"types": counts}
        for name, (file, drop) in {"q4_k_m": (k_file, False), "q4_k_m without hints": (k_file, True),
                                   "embedded q4_1": (embedded_gguf(), False)}.items():
            found = bench(file, folder / name.replace(" ", "-"), drop, args)
            rows = {(row.get("shape") or row["variant"]): round(row["tokens_per_second"], 1)
                    for row in found["results"] if row["tokens_per_second"]}
            results[name] = rows
            print(name, rows, flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
