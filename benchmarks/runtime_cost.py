"""Cost of one forward of the target and of the draft for n new tokens after a 150-token cache, on
each runtime: transformers' eager forward (`--compile off`), rsd's static-cache runtime uncompiled
(what `auto` picks where compiling does not pay) and compiled (`--compile on`; on a GPU inside CUDA
graphs, beside graphs of the uncompiled layers), interleaved in one
process, medians of --repeats. This is the cost speculation has to beat.

Run: .venv/bin/python benchmarks/runtime_cost.py [--rows 1,2,4,8,16] [--repeats 9] [--out FILE.json]
"""

import argparse
import json
import statistics
import time

import torch

from rsd_cli.compiled import CompiledModel, StaticLM, warm_up
from rsd_cli.engine import CachedLM, timed_chain
from rsd_cli.models import load_pair
from rsd_cli.profiles import load_profile

parser = argparse.ArgumentParser()
parser.add_argument("--profile", default="default")
parser.add_argument("--rows", default="1,2,4,8,16")
parser.add_argument("--repeats", type=int, default=9)
parser.add_argument("--out")
args = parser.parse_args()
rows = [int(r) for r in args.rows.split(",")]

profile = load_profile(args.profile)
profile.set("runtime", "compile", "off", "benchmark")
pair = load_pair(profile)
device = pair.target.device
PREFIX = 150
prefix = torch.randint(0, 8000, (PREFIX,), generator=torch.Generator().manual_seed(0)).tolist()

runtimes = {}
for role, model in (("target", pair.target), ("draft", pair.draft)):
    compiled = CompiledModel(model, compile=True)
    start = time.perf_counter()
    warm_up(compiled, tuple(rows))
    print(f"{role}: compiled {rows} in {time.perf_counter() - start:.1f} s", flush=True)
    runtimes[role] = {
        "transformers eager": lambda m=model: CachedLM(m, pair.vocab_size),
        "static cache, uncompiled": lambda m=model: StaticLM(CompiledModel(m, compile=False), pair.vocab_size, 512),
    }
    if compiled.graphed:  # a CUDA device: graphs of the eager layers, and of the compiled ones (--compile on)
        runtimes[role]["static cache, CUDA graphs"] = \
            lambda m=model: StaticLM(CompiledModel(m, compile=True, inductor=False), pair.vocab_size, 512)
    runtimes[role]["static cache, compiled, CUDA graphs" if compiled.graphed else "static cache, compiled"] = \
        lambda c=compiled: StaticLM(c, pair.vocab_size, 512)


results = {}
for role, backends in runtimes.items():
    caches = {}
    for name, make in backends.items():
        caches[name] = make()
        caches[name].extend(prefix)
    times = {(name, n): [] for name in backends for n in rows}
    for _ in range(args.repeats):  # interleaved: each backend in turn, every size
        for n in rows:
            for name, lm in caches.items():
                times[(name, n)].append(timed_chain(lm, n))
    for (name, n), ts in times.items():
        results.setdefault(role, {}).setdefault(name, {})[n] = statistics.median(ts) * 1000

print(f"\nmedian ms per forward after a {PREFIX}-token cache ({device}, {next(pair.target.parameters()).dtype})")
for role, table in results.items():
    print(f"\n{role}: | runtime | " + " | ".join(f"{n} tok" for n in rows) + " |")
    for name, by_n in table.items():
        print(f"| {name} | " + " | ".join(f"{by_n[n]:.1f}" for n in rows) + " |")
if args.out:
    with open(args.out, "w") as f:
        json.dump({"device": str(device), "prefix": PREFIX, "ms": results}, f, indent=1)
