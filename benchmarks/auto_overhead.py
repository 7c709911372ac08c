"""What `--variant auto` spends of its own in a generation, beside `ar` on the same prompts: its
policy's set-up each answer (auto.for_decoder: the cost key, the candidates, what earlier runs
learnt), its choice each step (Decoder._next_shape: the n-gram lookup and the policy, a full choice
every 8 steps), its learning from each step (AutoShape.observe) and its saving after each answer
(AutoShape.save), in ms per emitted token and as a share of `ar`'s time a token. Where no drafting
shape pays (a 2-core CPU on the C layers) `auto` decodes plainly on nearly every step, and these
are what separates its speed from `ar`'s.

Answers alternate between the two variants (a new decoder each, as `rsd bench` makes them), seeds
fixed. Run on a quiet machine:
    RSD_ADAPTIVE_THREADS=0 .venv/bin/python benchmarks/auto_overhead.py [--limit 8] [-n 64] [--rounds 2]
"""

import argparse
import json
import time
from collections import defaultdict

from rsd_cli import auto, engine
from rsd_cli.bench import Setting
from rsd_cli.generation import complete
from rsd_cli.models import load_pair
from rsd_cli.profiles import load_profile
from rsd_cli.prompting import builtin_prompts, encode_prompt
from rsd_cli.runtime import runtimes_of
from rsd_cli.sampling import SamplingParams

parser = argparse.ArgumentParser()
parser.add_argument("--profile", default="default")
parser.add_argument("--limit", type=int, default=8, help="how many built-in eval prompts")
parser.add_argument("-n", "--max-tokens", type=int, default=64)
parser.add_argument("--rounds", type=int, default=2)
parser.add_argument("--temperature", type=float, default=1.0)
parser.add_argument("--compile", default="auto")
parser.add_argument("--json", action="store_true")
args = parser.parse_args()

spent: dict[str, float] = defaultdict(float)
calls: dict[str, int] = defaultdict(int)
PARTS = {"set-up (for_decoder)": (auto, "for_decoder"), "choice (_next_shape)": (engine.Decoder, "_next_shape"),
         "learning (observe)": (auto.AutoShape, "observe"), "saving (save)": (auto.AutoShape, "save")}


def timed(name: str, fn):
    def wrapper(*a, **k):
        if name.startswith("choice") and a[0].shape.variant != "auto":  # (ar's: its fixed shape, not timed)
            return fn(*a, **k)
        start = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[name] += time.perf_counter() - start
            calls[name] += 1
    return wrapper


for name, (owner, attribute) in PARTS.items():
    setattr(owner, attribute, timed(name, getattr(owner, attribute)))

profile = load_profile(args.profile)
pair = load_pair(profile)
runtimes = runtimes_of(pair, args.compile)
prompts = [encode_prompt(pair.tokenizer, p) for p in builtin_prompts("eval")[: args.limit]]
sampling = SamplingParams(args.temperature, profile["sampling"]["top_k"], profile["sampling"]["top_p"])


def decoder(variant: str) -> engine.Decoder:
    return engine.Decoder(pair.target, pair.draft, pair.vocab_size, Setting(args.temperature, None, 1).shape(variant, 2),
                          sampling, pair.eos_ids, pair.context_length, runtimes)


complete(decoder("auto"), prompts[0], 8, 0)  # warm-up (and auto's costs measured, where not cached)
complete(decoder("ar"), prompts[0], 8, 0)
spent.clear()
calls.clear()
seconds, tokens, shapes = {"ar": 0.0, "auto": 0.0}, {"ar": 0, "auto": 0}, defaultdict(int)
for round_ in range(args.rounds):
    for index, ids in enumerate(prompts):
        for variant in ("ar", "auto"):
            start = time.perf_counter()
            emitted, stats, _ = complete(decoder(variant), ids, args.max_tokens, 100 * round_ + index)
            seconds[variant] += time.perf_counter() - start
            tokens[variant] += len(emitted)
            if variant == "auto":
                for shape, count in stats.shapes_used():
                    shapes[shape] += count
per_token = {v: 1e3 * seconds[v] / tokens[v] for v in seconds}
parts = {name: 1e3 * spent[name] / tokens["auto"] for name in PARTS}
result = {"runtime": runtimes.describe(), "temperature": args.temperature, "answers": args.rounds * len(prompts),
          "ms_per_token": per_token, "auto_over_ar_speed": per_token["ar"] / per_token["auto"],
          "auto_shapes": dict(shapes), "auto_parts_ms_per_token": parts,
          "auto_parts_share_of_ar_token": {name: ms / per_token["ar"] for name, ms in parts.items()},
          "calls": dict(calls)}
if args.json:
    print(json.dumps(result, indent=1))
else:
    print(f"ar {per_token['ar']:.3f} ms a token, auto {per_token['auto']:.3f} "
          f"({result['auto_over_ar_speed']:.3f}x ar's speed); auto's shapes: {dict(shapes)}")
    for name, ms in parts.items():
        print(f"  {name:<22} {ms:.3f} ms a token ({100 * ms / per_token['ar']:.1f}% of ar's), "
              f"{calls[name]} calls, {1e3 * spent[name] / max(calls[name], 1):.3f} ms each")
    print(f"  {'all four':<22} {sum(parts.values()):.3f} ms a token "
          f"({100 * sum(parts.values()) / per_token['ar']:.1f}% of ar's)")
