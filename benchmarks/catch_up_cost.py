"""Cost of a catch-up: a chain of n tokens that is no prompt (the draft reading the tokens of `auto`'s
plain steps before a drafting step) after a 150-token cache, on the static-shape runtime (a GPU's: CUDA
graphs), read as graphed pieces of the widest bucket (`compiled.GRAPHED_PIECES`, rsd's way) against one
forward off the graphs (GRAPHED_PIECES = 0, before), interleaved in one process, medians of --repeats.
On a CPU the static shapes run uncompiled (no graphs), so the two differ there by the padding only.

--trace 65,128 then runs one catch-up of each of those counts, each way, under torch.profiler and prints
where its time went: wall and GPU-busy ms, the CUDA calls that can stall a host (graph launches, device and
page-locked allocations, synchronisations, copies) and the operations with the most host time (on the
H200 a 65-token catch-up in graphed pieces took ~6 ms where one 64-token graph's replay should take well
under one: this names what the rest is).

Run: .venv/bin/python benchmarks/catch_up_cost.py [--tokens 32,65,128,256,512] [--repeats 9] [--trace 65,128]
     [--out FILE.json]
On the GPU machine: source .device-stage/env.sh && python3 benchmarks/catch_up_cost.py --trace 65,128
"""

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity
from torch.profiler import profile as profiled

from rsd_cli import compiled
from rsd_cli.compiled import CompiledModel, StaticLM, warm_up
from rsd_cli.engine import timed_chain
from rsd_cli.models import load_pair
from rsd_cli.profiles import load_profile

parser = argparse.ArgumentParser()
parser.add_argument("--profile", default="default")
parser.add_argument("--tokens", default="32,65,128,256,512")
parser.add_argument("--repeats", type=int, default=9)
parser.add_argument("--trace", default="", help="token counts to profile once each way, e.g. 65,128")
parser.add_argument("--top", type=int, default=10, help="operations listed by host time in a trace")
parser.add_argument("--out")
args = parser.parse_args()
counts = [int(n) for n in args.tokens.split(",")]
traced = [int(n) for n in args.trace.split(",") if n]
# CUDA calls that can hold the host up: a new device or page-locked allocation, a wait for the device
STALLS = ("cudaGraphLaunch", "cudaMalloc", "cudaFree", "cudaHostAlloc", "cudaMallocHost", "cudaFreeHost",
          "cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaMemcpy",
          "cudaLaunchKernel")

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


def traced_catch_up(cache: StaticLM, n: int, pieces: int) -> dict:
    """One catch-up of n tokens under torch.profiler: where its wall time went."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profiled(activities=activities) as trace:
        seconds = timed_catch_up(cache, n, pieces)
    events = trace.key_averages()
    gpu_us = sum(getattr(e, "self_device_time_total", 0) for e in events if e.device_type.name == "CUDA")
    host = sorted(((e.self_cpu_time_total / 1000, e.count, e.key) for e in events
                   if not e.key.startswith("Profiler")), reverse=True)
    return {"wall_ms": seconds * 1000, "gpu_busy_ms": gpu_us / 1000,
            "calls": {key: next((e.count for e in events if e.key == key), 0) for key in STALLS},
            "stall_host_ms": {key: next((e.self_cpu_time_total / 1000 for e in events if e.key == key), 0.0)
                              for key in STALLS},
            "top_host_ms": [[round(ms, 3), count, key] for ms, count, key in host[: args.top]]}


results, traces = {}, {}
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
    for n in traced:
        for way, pieces in ways.items():
            found = traces.setdefault(role, {}).setdefault(way, {})[n] = traced_catch_up(cache, n, pieces)
            print(f"\n{role}, {way}, {n} tokens traced: {found['wall_ms']:.2f} ms (profiled), GPU busy "
                  f"{found['gpu_busy_ms']:.2f} ms; " + ", ".join(f"{key} {count}x {found['stall_host_ms'][key]:.2f} ms"
                                                               for key, count in found["calls"].items() if count))
            for ms, count, key in found["top_host_ms"]:
                print(f"    {ms:8.3f} ms  {count:4d}x  {key}")
    cache.release()

print(f"\nmedian ms per catch-up after a {PREFIX}-token cache ({device}, {next(pair.target.parameters()).dtype})")
for role, table in results.items():
    print(f"\n{role}: | way | " + " | ".join(f"{n} tok" for n in counts) + " |")
    for way, by_n in table.items():
        print(f"| {way} | " + " | ".join(f"{by_n[n]:.2f}" for n in counts) + " |")
if args.out:
    with open(args.out, "w") as f:
        json.dump({"device": str(device), "prefix": PREFIX, "graphed_pieces": ways["graphed pieces"],
                   "ms": results, "traces": traces}, f, indent=1)
