"""Device steps against the host path, per shape: the time a step spends outside the two models'
forwards (drafting draws, verification, bookkeeping) with `Decoder.device_steps` on and off, in
interleaved rounds on the same prompts and seeds (the first step of each generation, which reads
the prompt, left out). On a GPU the device path saves synchronisations; on a CPU, where a transfer
costs nothing, it computes every node's residual and bonus draw, which the host path skips.

Lookup chains draft only where the answer repeats its context: time them on prompts that do
(--prompts benchmarks/grounded-prompts.txt); their steps that find no match are plain steps either way.

Run: .venv/bin/python benchmarks/device_steps_ab.py [--compile auto] [--rounds 3] [-n 48] [--prompts FILE]
"""

import argparse
import statistics
from pathlib import Path

from rsd_cli.drafting import make_shape
from rsd_cli.engine import Decoder
from rsd_cli.models import load_pair
from rsd_cli.profiles import load_profile
from rsd_cli.prompting import builtin_prompts, encode_prompt, read_prompt_file
from rsd_cli.runtime import runtimes_of
from rsd_cli.sampling import SamplingParams

SHAPES = {"sd γ=1": make_shape("sd", draft_len=1), "sd γ=2": make_shape("sd", draft_len=2),
          "rsd-c b=(3)": make_shape("rsd-c", branching=(3,)), "lookup γ=4": make_shape("lookup", draft_len=4),
          "lookup γ=7": make_shape("lookup", draft_len=7)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", default="default")
    parser.add_argument("--compile", default="auto")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("-n", "--max-tokens", type=int, default=48)
    parser.add_argument("--prompts", default="eval", help="one per line; 'eval': the built-in evaluation prompts")
    args = parser.parse_args()
    pair = load_pair(load_profile(args.profile))
    runtimes = runtimes_of(pair, args.compile)
    texts = builtin_prompts("eval") if args.prompts == "eval" else read_prompt_file(Path(args.prompts))
    prompts = [encode_prompt(pair.tokenizer, p) for p in texts[: args.limit]]
    outside: dict[tuple, list[float]] = {}
    drafting: dict[str, list[float]] = {}  # shape -> the share of its steps that drafted (lookup: that matched)
    for _ in range(args.rounds):
        for name, shape in SHAPES.items():
            for device_steps in (True, False):
                decoder = Decoder(pair.target, pair.draft, pair.vocab_size, shape, SamplingParams(args.temperature),
                                  pair.eos_ids, pair.context_length, runtimes)
                decoder.device_steps = device_steps
                seconds = steps = drafted = 0
                for seed, ids in enumerate(prompts):
                    for event in decoder.generate(ids, args.max_tokens, seed=seed):
                        if event.step > 1:
                            steps += 1
                            drafted += len(event.tree) > 1
                            seconds += event.draft_seconds + event.verify_seconds - event.forward_seconds
                outside.setdefault((name, device_steps), []).append(1000 * seconds / steps)
                drafting.setdefault(name, []).append(drafted / steps)
    print(f"ms a step outside the forwards ({runtimes.describe()}), median of {args.rounds} rounds")
    for name in SHAPES:
        device, host = (statistics.median(outside[(name, flag)]) for flag in (True, False))
        print(f"{name:<14} device steps {device:6.2f}   host path {host:6.2f}   "
              f"({100 * statistics.mean(drafting[name]):.0f}% of steps drafted)")


if __name__ == "__main__":
    main()
