"""`--variant auto` against `ar` as the default profile runs them (its runtime, auto's memory and
cost table in the rsd cache folder, as a user's later runs have them): each prompt is answered by
both, one after the other (which goes first alternates), so that each pair sees the same spell of a
machine whose pace drifts by 1.5x within minutes; per pair auto's time a token over ar's. Prints
the median and quartiles of those ratios, the total times' ratio, each one's steps (ms a step, of it
outside the forwards) and the shapes auto used, with what it learnt of the forward costs.

Run: .venv/bin/python benchmarks/auto_vs_ar.py [--rounds 6] [--limit 4] [-n 64] [--temperature 1]
     [--prompts benchmarks/grounded-prompts.txt]
(a first run on a machine, or after rsd's C library or auto's cost key changed, measures the costs
and starts auto's memory afresh: run it twice to see both)
"""

import argparse
import statistics
import time
from pathlib import Path

from rsd_cli.models import load_pair
from rsd_cli.profiles import load_profile
from rsd_cli.prompting import builtin_prompts, encode_prompt
from rsd_cli.runtime import apply_flags, make_decoder, runtimes_of

parser = argparse.ArgumentParser()
parser.add_argument("--rounds", type=int, default=6)
parser.add_argument("--limit", type=int, default=4, help="how many prompts")
parser.add_argument("-n", "--max-tokens", type=int, default=64)
parser.add_argument("--temperature", type=float, default=1.0)
parser.add_argument("--prompts", type=Path, help="a file of prompts, one a line (default: the built-in eval set)")
args = parser.parse_args()

pair = load_pair(load_profile("default"))
pair.runtimes = runtimes_of(pair, "auto")
texts = ([line for line in args.prompts.read_text().splitlines() if line.strip()] if args.prompts
         else builtin_prompts("eval"))
prompts = [encode_prompt(pair.tokenizer, text) for text in texts[: args.limit]]
decoders = {variant: make_decoder(pair, apply_flags(load_profile("default"),
                                                    {"variant": variant, "temperature": args.temperature}))
            for variant in ("ar", "auto")}
for decoder in decoders.values():  # (first calls, auto's cost table: untimed)
    list(decoder.generate(prompts[0], 8, seed=0))
ratios, walls = [], {variant: 0.0 for variant in decoders}
steps = {variant: [0, 0.0, 0.0] for variant in decoders}  # steps, seconds, seconds outside the forwards
shapes: dict[str, int] = {}
for round_ in range(args.rounds):
    for index, ids in enumerate(prompts):
        per_token = {}
        for variant in (("ar", "auto") if (round_ + index) % 2 == 0 else ("auto", "ar")):
            start, tokens, forwards, count = time.perf_counter(), 0, 0.0, 0
            for event in decoders[variant].generate(ids, args.max_tokens, seed=1000 * round_ + index):
                tokens += len(event.emitted)  # (the correction or bonus token included)
                forwards += event.forward_seconds
                count += 1
                if variant == "auto":
                    shapes[event.shape.describe()] = shapes.get(event.shape.describe(), 0) + 1
            wall = time.perf_counter() - start
            walls[variant] += wall
            steps[variant] = [steps[variant][0] + count, steps[variant][1] + wall, steps[variant][2] + wall - forwards]
            per_token[variant] = wall / tokens
        ratios.append(per_token["auto"] / per_token["ar"])
for variant, (count, seconds, outside) in steps.items():
    print(f"{variant:<5} {count} steps, {1000 * seconds / count:.2f} ms a step, {1000 * outside / count:.3f} outside "
          "the forwards (the first step's prompt included)")
print("auto's shapes:", dict(sorted(shapes.items(), key=lambda kv: -kv[1])))
policy = decoders["auto"].policy
print("auto's forward factors by target tokens (over the cost table, a plain forward's at 1):",
      {tokens: round(factor, 3) for tokens, factor in sorted(policy.size_factor.items())})
quartiles = statistics.quantiles(ratios, n=4)
print(f"auto's time a token over ar's, per prompt paired: median {statistics.median(ratios):.3f} "
      f"(quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f}, {len(ratios)} pairs); total times {walls['auto'] / walls['ar']:.3f}")
