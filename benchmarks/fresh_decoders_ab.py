"""A decoder made afresh for every answer, as a chat makes one a turn and `rsd bench` one a run, on a
GPU: the step maths' CUDA graphs (StepGraphs) made by each decoder and captured at each site's first
call ("per decoder", rsd before 2026-11-28) against shared by the decoders of a model's shared buffers
and captured at a site's third call ("shared", now). tokens/s of `ar`, `auto` and fixed shapes both
ways, interleaved in rounds on the same prompts and seeds, with the time a drafting step spent
drafting (on an H200 `rsd bench`'s `auto` spent 16-24 ms in each of its few drafting steps, where
`sd` spends ~1 ms). Each job answers the longest prompt once, untimed, first (as `rsd bench` warms
up). On a CPU the maths runs directly either way: both arms are the same.

On the GPU machine: source .device-stage/env.sh && python3 benchmarks/fresh_decoders_ab.py
"""

import argparse
import json
import statistics
import time

from rsd_cli.drafting import make_shape
from rsd_cli.engine import Decoder, synchronise
from rsd_cli.models import load_pair
from rsd_cli.profiles import load_profile
from rsd_cli.prompting import builtin_prompts, encode_prompt
from rsd_cli.runtime import runtimes_of
from rsd_cli.sampling import SamplingParams
from rsd_cli.step_graphs import StepGraphs

SHAPES = {"ar": make_shape("ar"), "auto": make_shape("auto"), "sd γ=1": make_shape("sd", draft_len=1),
          "rsd-c b=(3)": make_shape("rsd-c", branching=(3,))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="ar,auto,rsd-c b=(3)", help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--limit", type=int, default=2)
    parser.add_argument("-n", "--max-tokens", type=int, default=96)
    parser.add_argument("--compile", default="on")
    parser.add_argument("--json")
    args = parser.parse_args()
    pair = load_pair(load_profile("default"))
    runtimes = runtimes_of(pair, args.compile)
    device = next(pair.target.parameters()).device
    prompts = [encode_prompt(pair.tokenizer, p) for p in builtin_prompts("eval")[: args.limit]]
    jobs = [(name, arm) for name in args.shapes.split(",") for arm in ("per decoder", "shared")]

    def fresh(name: str, arm: str) -> Decoder:
        decoder = Decoder(pair.target, pair.draft, pair.vocab_size, SHAPES[name], SamplingParams(args.temperature),
                          pair.eos_ids, pair.context_length, runtimes)
        if arm == "per decoder":  # (graphed where the decoder's own would be)
            decoder.step_graphs = StepGraphs(device, device.type == "cuda" and getattr(runtimes.target, "compiled", False),
                                             capture_at=1)
        return decoder

    for job in jobs:  # untimed: compiles, the forwards' graphs and buffers at the timed size, auto's cost table
        list(fresh(*job).generate(max(prompts, key=len), args.max_tokens, seed=0))
    rates: dict[tuple, list[float]] = {}
    drafting: dict[tuple, list[float]] = {}  # seconds drafting, per drafting step
    for round_ in range(args.rounds):
        for job in jobs if round_ % 2 == 0 else jobs[::-1]:
            tokens = 0
            synchronise(device)
            start = time.perf_counter()
            for seed, ids in enumerate(prompts):
                for event in fresh(*job).generate(ids, args.max_tokens, seed=1000 * round_ + seed):
                    tokens += len(event.emitted)
                    if event.draft_calls:
                        drafting.setdefault(job, []).append(event.draft_seconds)
            synchronise(device)
            rates.setdefault(job, []).append(tokens / (time.perf_counter() - start))
    ar = statistics.median(rates["ar", "shared"]) if ("ar", "shared") in rates else None
    rows = []
    for (name, arm), values in rates.items():
        rate, spent = statistics.median(values), drafting.get((name, arm), [])
        rows.append({"shape": name, "maths graphs": arm, "tok_s": rate, "x_ar": rate / ar if ar else None,
                     "rounds": values, "drafting_steps": len(spent),
                     "ms_drafting_a_drafting_step": 1000 * statistics.mean(spent) if spent else None})
        ratio = f"{rate / ar:.2f}x ar" if ar else ""
        per_step = f", {rows[-1]['ms_drafting_a_drafting_step']:.2f} ms drafting a drafting step" if spent else ""
        print(f"{name:12s} {arm:11s} {rate:7.1f} tok/s  {ratio}{per_step}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
