"""What one target forward costs on a CPU for a larger K-quant model, by rows: a random Llama of
about a billion weights (Llama 3.2 1B's layer sizes, 16 layers of 2048 wide, a 32k vocabulary),
written as a Q4_K_M GGUF file (tests/tiny.py's quantiser, llama.cpp's types: Q4_K, Q6_K for v
and down in the layers it gives more bits and for the output), loaded as rsd loads it, timed on
the static-cache runtime uncompiled (its layers in rsd's C library) after a 150-token cache;
then the same with the file's scales dropped (the float32 weights every earlier version streamed,
on the CPU kernel measured fastest for each shape). Random weights: the cost of a forward does
not depend on the values, what speculation would accept does, so only costs are measured here.

    .venv/bin/python benchmarks/k_quants_size.py [--rows 1,2,4,8] [--repeats 7] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

PREFIX = 150


def write_model(path: Path, layers: int) -> int:
    """A random Llama with Llama 3.2 1B's widths as a Q4_K_M GGUF file; returns its weight count."""
    import torch
    from k_quants import q4_k_m_type
    from tiny import tiny_config, write_tiny_gguf
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = tiny_config(32000, layers, 0.02, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, max_position_embeddings=4096)
    model = LlamaForCausalLM(config).eval()
    shapes = {name: p.shape for name, p in model.named_parameters()}
    write_tiny_gguf(path, model, lambda name: q4_k_m_type(name, 2048 if "ffn_down" not in name else 8192, layers))
    return sum(shape.numel() for shape in shapes.values())


def forward_costs(gguf_file: Path, rows: list[int], repeats: int) -> dict[int, float]:
    """Median ms of an n-token forward after a PREFIX-token cache, for each n."""
    import torch
    from rsd_cli.compiled import CompiledModel, StaticLM
    from rsd_cli.engine import timed_chain
    from rsd_cli.models import load_model

    model, _ = load_model(str(gguf_file), torch.device("cpu"), torch.float32)
    runtime = CompiledModel(model, compile=False)
    print(f"  every layer in C: {runtime.all_in_c}", flush=True)
    lm = StaticLM(runtime, model.config.vocab_size, 512)
    lm.extend([5] * PREFIX)
    times = {n: [] for n in rows}
    for _ in range(repeats):
        for n in rows:
            times[n].append(timed_chain(lm, n))
    return {n: round(statistics.median(t) * 1000, 2) for n, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = [int(n) for n in args.rows.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        gguf_file = folder / "random-1b.Q4_K_M.gguf"
        weights = write_model(gguf_file, args.layers)
        print(f"{weights / 1e9:.2f}B weights, {gguf_file.stat().st_size / 2**20:.0f} MiB file", flush=True)
        os.environ["RSD_CACHE_DIR"] = str(folder / "cache")
        results = {"weights": weights, "prefix": PREFIX, "ms": {}}
        for name in ("kept scales", "float32 (scales dropped)"):
            if name.startswith("float32"):
                for hints in (folder / "cache").glob("gguf/*/rsd-block-hints.safetensors"):
                    hints.unlink()
            print(name, flush=True)
            results["ms"][name] = forward_costs(gguf_file, rows, args.repeats)
            print(f"  ms per forward, {rows} tokens: {results['ms'][name]}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
