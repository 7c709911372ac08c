"""Cost of a catch-up: a chain of n tokens that is no prompt (the draft reading the tokens of `auto`'s
plain steps before a drafting step) after a 150-token cache, on the static-shape runtime (a GPU's: CUDA
graphs), read as graphed pieces of the widest bucket (`compiled.GRAPHED_PIECES`, rsd's way) against one
forward off the graphs (GRAPHED_PIECES = 0, before), interleaved in one process, medians of --repeats.
On a CPU the static shapes run uncompiled (no graphs), so the two differ there by the padding only.

Run: .venv/bin/python benchmarks/catch_up_cost.py [--tokens 32,65,128,256,512] [--repeats 9] [--out FILE.json]
On the GPU machine: source .device-stage/env.sh && python3 benchmarks/catch_up_cost.py
"""

import argparse
import json
import statistics
import time

import torch

from rsd_cli import compiled
from rsd_cli.compiled import CompiledModel, StaticLM, warm_up
from rsd_cli.engine import timed_chain
from rsd_cli.models import load_pair
from rsd_cli.profiles import load_profile

parser = argparse.ArgumentParser()
parser.add_argument("--profile", default="default")
parser.add_argument("--tokens", default="32,65,128,256,512")
parser.add_argument("--repeats", type=int, default=9)
parser.add_argument("--out")
args = parser.parse_args()
counts = [int(n) for n in args.tokens.split(",")]

profile = load_profile(args.profile)
profile.set("runtime", "compile", "off", "benchmark")
pair = load_pair(profile)
device = pair.target.device
PREFIX = 150
prefix = torch.randint(0, 8000, (PREFIX,), generator=torch.Generator().manual_seed(0)).tolist()
ways = {"graphed pieces": compiled.GRAPHED_PIECES, "one forward": 0}


def timed_catch_up(cache: StaticLM, n: int, pieces: int) -> float:
    """Seconds n tokens' catch-up takes on `cache` with GRAPHED_PIECES = pieces (engine.timed_chain: every
    row's logits, which a graph's replay computes anyway; the cache then cut back)."""
    compiled.GRAPHED_PIECES = pieces
    return timed_chain(cache, n)


results = {}
for role, model in (("draft", pair.draft), ("target", pair.target)):
    runtime = CompiledModel(model, compile=device.type == "cuda", static_shapes=True)
    start = time.perf_counter()
    warm_up(runtime, runtime.buckets)
    print(f"{role}: {'compiled ' if runtime.inductor else ''}buckets {runtime.buckets} in "
          f"{time.perf_counter() - start:.1f} s, graphed: {runtime.graphed}", flush=True)
    cache = StaticLM(runtime, pair.vocab_size, PREFIX + max(counts) + 64)
    cache.extend(prefix, reading=True)
    for n in counts:  # (every graph captured, every way run once, before timing)
        for pieces in ways.values():
            timed_catch_up(cache, n, pieces)
    times = {(way, n): [] for way in ways for n in counts}
    for _ in range(args.repeats):  # interleaved: each way in turn, every count
        for n in counts:
            for way, pieces in ways.items():
                times[(way, n)].append(timed_catch_up(cache, n, pieces))
    for (way, n), ts in times.items():
        results.setdefault(role, {}).setdefault(way, {})[n] = statistics.median(ts) * 1000
    cache.release()

print(f"\nmedian ms per catch-up after a {PREFIX}-token cache ({device}, {next(pair.target.parameters()).dtype})")
for role, table in results.items():
    print(f"\n{role}: | way | " + " | ".join(f"{n} tok" for n in counts) + " |")
    for way, by_n in table.items():
        print(f"| {way} | " + " | ".join(f"{by_n[n]:.2f}" for n in counts) + " |")
if args.out:
    with open(args.out, "w") as f:
        json.dump({"device": str(device), "prefix": PREFIX, "graphed_pieces": ways["graphed pieces"],
                   "ms": results}, f, indent=1)
