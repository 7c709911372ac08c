"""What the host does in a decoding step, per variant: torch operations launched, host-device
copies and synchronisations, and (on a GPU) how much of the step's wall time the device was busy.
A step's host work is what a small model's speculative step waits on where a forward is cheap (a
GPU: the device idles while Python prepares the next launch and waits for a transfer).

Runs a few generations per variant under torch.profiler (each variant's first generation untimed)
and prints, per step: wall ms, GPU busy ms (kernels and copies), torch operations, host<-device
and host->device copies, stream synchronisations, and the operations that took the most host time.

Run: .venv/bin/python benchmarks/trace_step.py [--variants ar,sd,rsd-c] [--compile auto]
On the GPU machine: source .device-stage/env.sh && python3 benchmarks/trace_step.py --compile on
"""

import argparse
import json
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from rsd_cli import engine
from rsd_cli.bench import Setting
from rsd_cli.generation import complete
from rsd_cli.models import load_pair
from rsd_cli.profiles import load_profile
from rsd_cli.prompting import builtin_prompts, encode_prompt
from rsd_cli.runtime import runtimes_of
from rsd_cli.sampling import SamplingParams

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", default="default")
    parser.add_argument("--variants", default="ar,sd,rsd-c")
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--width", type=int, default=3)
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("-n", "--max-tokens", type=int, default=48)
    parser.add_argument("--compile", default="auto")
    parser.add_argument("--top", type=int, default=12, help="operations listed by host time")
    parser.add_argument("--by-count", action="store_true", help="list the operations called most instead")
    parser.add_argument("--json")
    args = parser.parse_args()

    profile_ = load_profile(args.profile)
    pair = load_pair(profile_)
    device = next(pair.target.parameters()).device
    runtimes = runtimes_of(pair, args.compile)
    prompt = encode_prompt(pair.tokenizer, builtin_prompts("eval")[0])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    results = []
    jobs = [(float(t), v) for t in args.temperatures.split(",") for v in args.variants.split(",")]
    for temperature, variant in jobs:
        sampling = SamplingParams(temperature, profile_["sampling"]["top_k"], profile_["sampling"]["top_p"])
        depth = None if variant == "ar" else args.depth
        shape = Setting(temperature, None, depth).shape(variant, args.width)
        decoder = engine.Decoder(pair.target, pair.draft, pair.vocab_size, shape, sampling, pair.eos_ids,
                                 pair.context_length, runtimes)
        complete(decoder, prompt, args.max_tokens, 0)  # untimed: graphs captured at the timed buffers' size
        steps = 0
        with profile(activities=activities) as trace:
            start = time.perf_counter()
            for event in decoder.generate(prompt, args.max_tokens, seed=1):
                steps += 1
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            wall = time.perf_counter() - start
        events = trace.key_averages()
        calls = Counter({e.key: e.count for e in events})
        host_ms = {e.key: e.self_cpu_time_total / 1000 for e in events}
        aten = sum(n for key, n in calls.items() if key.startswith("aten::"))
        gpu_ms = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
                     for e in events if e.device_type.name == "CUDA") / 1000 if device.type == "cuda" else None
        row = {
            "variant": shape.describe(), "temperature": temperature, "steps": steps, "wall_ms_per_step": 1000 * wall / steps,
            "gpu_busy_ms_per_step": None if gpu_ms is None else gpu_ms / steps,
            "aten_ops_per_step": aten / steps,
            "item_per_step": calls["aten::_local_scalar_dense"] / steps,
            "copies_per_step": calls["aten::copy_"] / steps,
            "memcpy_per_step": sum(n for k, n in calls.items() if k.startswith("cudaMemcpy")) / steps,
            "syncs_per_step": sum(calls[k] for k in SYNCS) / steps,
            "graph_replays_per_step": calls["cudaGraphLaunch"] / steps,
            "launches_per_step": calls["cudaLaunchKernel"] / steps,
            "top_host_ms_per_step": dict(sorted(((k, v / steps) for k, v in host_ms.items() if not k.startswith("Profiler")),
                                                key=lambda kv: -kv[1])[: args.top]),
        }
        results.append(row)
        print(f"\n{row['variant']} T={temperature:g}: {steps} steps, {row['wall_ms_per_step']:.2f} ms a step"
              + ("" if gpu_ms is None else f", GPU busy {row['gpu_busy_ms_per_step']:.2f} ms"), flush=True)
        print("  per step: " + ", ".join(f"{k.removesuffix('_per_step')} {row[k]:.1f}" for k in
                                         ("aten_ops_per_step", "item_per_step", "copies_per_step", "memcpy_per_step",
                                          "syncs_per_step", "graph_replays_per_step", "launches_per_step")))
        listed = [key for key, _ in calls.most_common(args.top)] if args.by_count else row["top_host_ms_per_step"]
        for key in listed:
            print(f"    {host_ms[key] / steps:7.3f} ms  {calls[key] / steps:5.1f}x  {key}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "runtime": runtimes.describe(), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
