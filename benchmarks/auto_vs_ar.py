"""`--variant auto` against `ar` as the default profile runs them (its runtime, auto's memory and
cost table in the rsd cache folder, as a user's later runs have them): rounds alternating which
goes first, each round every prompt once; per round ms a token and ms a token outside the forwards,
the shapes auto used, and auto's total time over ar's.

Run: .venv/bin/python benchmarks/auto_vs_ar.py [--rounds 4] [--limit 4] [-n 64] [--temperature 1]
(a first run on a machine, or after rsd's C library or auto's cost key changed, measures the costs
and starts auto's memory afresh: run it twice to see both)
"""

import argparse
import time

from rsd_cli.models import load_pair
from rsd_cli.profiles import load_profile
from rsd_cli.prompting import builtin_prompts, encode_prompt
from rsd_cli.runtime import apply_flags, make_decoder, runtimes_of

parser = argparse.ArgumentParser()
parser.add_argument("--rounds", type=int, default=4)
parser.add_argument("--limit", type=int, default=4, help="how many built-in eval prompts")
parser.add_argument("-n", "--max-tokens", type=int, default=64)
parser.add_argument("--temperature", type=float, default=1.0)
args = parser.parse_args()

pair = load_pair(load_profile("default"))
pair.runtimes = runtimes_of(pair, "auto")
prompts = [encode_prompt(pair.tokenizer, p) for p in builtin_prompts("eval")[: args.limit]]
decoders = {variant: make_decoder(pair, apply_flags(load_profile("default"),
                                                    {"variant": variant, "temperature": args.temperature}))
            for variant in ("ar", "auto")}
for decoder in decoders.values():  # (first calls, auto's cost table: untimed)
    list(decoder.generate(prompts[0], 8, seed=0))
per_round = {variant: [] for variant in decoders}
shapes: dict[str, int] = {}
for round_ in range(args.rounds):
    order = list(decoders.items()) if round_ % 2 else list(decoders.items())[::-1]
    for variant, decoder in order:
        start, tokens, forwards = time.perf_counter(), 0, 0.0
        for seed, ids in enumerate(prompts):
            for event in decoder.generate(ids, args.max_tokens, seed=seed):
                tokens += len(event.emitted) + (event.extra_token is not None)
                forwards += event.forward_seconds
                if variant == "auto":
                    shapes[event.shape.describe()] = shapes.get(event.shape.describe(), 0) + 1
        wall = time.perf_counter() - start
        per_round[variant].append((wall, 1000 * wall / tokens, 1000 * (wall - forwards) / tokens))
for variant, rounds in per_round.items():
    print(f"{variant:<5} ms a token {' '.join(f'{r[1]:.2f}' for r in rounds)}   outside the forwards "
          f"{' '.join(f'{r[2]:.3f}' for r in rounds)}")
print("auto's shapes:", dict(sorted(shapes.items(), key=lambda kv: -kv[1])))
print(f"auto's time over ar's: {sum(r[0] for r in per_round['auto']) / sum(r[0] for r in per_round['ar']):.3f}")
