"""What a large GGUF target costs rsd on a CPU — converting it, loading it, a forward — with a
random Llama of a 7-8B model's sizes written as a Q4_K_M file (llama.cpp's types from
k_quants.q4_k_m_type; random block bytes with small scales, no float model made: 4 GB of file,
29 GB of float32). Each stage runs in a process of its own, its peak resident memory read from
the kernel (file-backed pages of the memory-mapped weights included).

    .venv/bin/python benchmarks/big_gguf.py [--layers 32] [--hidden 4096] [--intermediate 14336]
        [--stages convert,load,generate] [--whole] [--keep DIR] [--out FILE.json]

A stage named twice runs twice (`--stages convert,load,load`: the first load keeps the blocks it
made in the cache, rsd_cli/blocks_cache.py; the second reads them).

--whole also converts through transformers' own load (the whole float32 model in memory; use it
on sizes that fit). Needs ~35 GB of disk for the default sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210}  # per 256 weights


def random_blocks(rows: int, columns: int, kind: str, rng):
    """(rows, bytes) uint8 of random `kind` blocks whose weights are about ±0.02."""
    import numpy as np

    blocks = rng.integers(0, 256, size=(rows * columns // 256, BLOCK_BYTES[kind]), dtype=np.uint8)
    if kind == "Q4_K":  # d, dmin half floats, then 6-bit scales and mins: d * sc * q - dmin * m
        blocks[:, 0:4] = np.array([1.2e-4, 6e-4], dtype=np.float16).view(np.uint8)
    else:  # Q6_K: int8 scales at 192..207, d at 208: d * scale * (q - 32)
        blocks[:, 192:208] = rng.integers(-16, 16, size=(len(blocks), 16), dtype=np.int8).view(np.uint8)
        blocks[:, 208:210] = np.array([4e-5], dtype=np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def write_model(path: Path, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int,
                vocab: int) -> int:
    """The random Q4_K_M Llama as a GGUF file (tests/tiny.py's tokenizer); returns its weight count."""
    import gguf
    import numpy as np
    from k_quants import q4_k_m_type
    from tiny import gguf_writer

    writer = gguf_writer(path, "llama", context=4096, hidden=hidden, layers=layers, intermediate=intermediate,
                         heads=heads, kv_heads=kv_heads, rope_base=500000.0, eps=1e-5, vocab=vocab)
    rng = np.random.default_rng(0)
    head_dim = hidden // heads
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,), "output.weight": (vocab, hidden)}
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                       f"blk.{i}.attn_q.weight": (hidden, hidden), f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
                       f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden),
                       f"blk.{i}.attn_output.weight": (hidden, hidden),
                       f"blk.{i}.ffn_gate.weight": (intermediate, hidden), f"blk.{i}.ffn_up.weight": (intermediate, hidden),
                       f"blk.{i}.ffn_down.weight": (hidden, intermediate)})
    weights = 0
    for name, shape in shapes.items():
        weights += int(np.prod(shape))
        kind = q4_k_m_type(name, shape[-1], layers) if len(shape) == 2 else None
        if kind is None:
            writer.add_tensor(name, np.ones(shape, dtype=np.float32))
        else:
            writer.add_tensor(name, random_blocks(*shape, kind, rng), raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


def peak_mb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def stage(name: str, gguf_file: Path, whole: bool) -> dict:
    """One stage, in this process (run by main in a process of its own)."""
    import torch
    from rsd_cli import gguf_convert, models

    if whole:
        gguf_convert.convert = lambda *args: None  # (transformers' load of the whole model instead)
    start = time.perf_counter()
    if name == "convert":
        models.gguf_to_cache(gguf_file)
        return {"seconds": round(time.perf_counter() - start, 1), "peak_mb": peak_mb()}
    if name == "load":
        from rsd_cli.compiled import CompiledModel, StaticLM
        from rsd_cli.engine import timed_chain

        model, _ = models.load_model(str(gguf_file), torch.device("cpu"), torch.float32, light=True)
        loaded = time.perf_counter() - start
        runtime = CompiledModel(model, compile=False)
        lm = StaticLM(runtime, model.config.vocab_size, 256)
        lm.extend([5] * 100)
        ms = {n: round(min(timed_chain(lm, n) for _ in range(3)) * 1000, 1) for n in (1, 2, 4)}
        return {"load_seconds": round(loaded, 1), "every_layer_in_c": runtime.all_in_c, "forward_ms": ms,
                "peak_mb": peak_mb()}
    raise ValueError(name)


def run_stage(name: str, gguf_file: Path, whole: bool, env: dict) -> dict:
    command = [sys.executable, __file__, "--stage", name, "--file", str(gguf_file)] + (["--whole"] if whole else [])
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return {"failed": done.returncode, "stderr": done.stderr.strip().splitlines()[-3:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def generate(gguf_file: Path, env: dict) -> dict:
    """`rsd generate` with the file as the target and its first 2 layers as the draft."""
    profile = gguf_file.with_suffix(".toml")
    profile.write_text(f'[target]\nsource = "{gguf_file}"\n[draft]\nkind = "early-exit"\nlayers = 2\nadapter = ""\n'
                       '[decoding]\nvariant = "ar"\n')
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "rsd_cli", "generate", "abc", "--profile", str(profile), "--raw",
                           "-n", "16", "-t", "0", "--json"], capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        return {"failed": done.returncode, "stderr": done.stderr.strip().splitlines()[-3:]}
    record = json.loads(done.stdout.strip().splitlines()[-1])
    return {"seconds": round(seconds, 1), "tokens": len(record["token_ids"]),
            "tok_s": record["stats"].get("tokens_per_second"), "runtime": record.get("runtime")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--stages", default="convert,load,generate")
    parser.add_argument("--whole", action="store_true")
    parser.add_argument("--keep", type=Path, help="a folder for the file and the cache, kept (default: a temporary one)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--stage", help=argparse.SUPPRESS)
    parser.add_argument("--file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage:
        print(json.dumps(stage(args.stage, args.file, args.whole)))
        return
    folder = args.keep or Path(tempfile.mkdtemp(prefix="rsd-big-gguf-"))
    folder.mkdir(parents=True, exist_ok=True)
    gguf_file = folder / f"random-{args.layers}x{args.hidden}.Q4_K_M.gguf"
    results = {"sizes": {key: value for key, value in vars(args).items() if key not in ("keep", "out", "stage", "file")}}
    if not gguf_file.is_file():
        start = time.perf_counter()
        results["weights"] = write_model(gguf_file, args.layers, args.hidden, args.intermediate, args.heads,
                                         args.kv_heads, args.vocab)
        print(f"wrote {gguf_file.stat().st_size / 2**30:.2f} GiB ({results['weights'] / 1e9:.2f}B weights) in "
              f"{time.perf_counter() - start:.0f} s", flush=True)
    env = {**os.environ, "RSD_CACHE_DIR": str(folder / "cache"), "PYTHONPATH": str(ROOT)}
    for i, name in enumerate(args.stages.split(",")):
        key = name if name not in results else f"{name} {i + 1}"  # (a stage run again: a second load)
        if name == "generate":
            results[key] = generate(gguf_file, env)
        else:
            results[key] = run_stage(name, gguf_file, args.whole and name == "convert", env)
        print(key, results[key], flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
