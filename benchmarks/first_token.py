"""Time to the first token of plain decoding (`ar`) for prompts of several lengths: the prompt's
prefill plus one step, after the models are loaded.

Run on a quiet machine: .venv/bin/python benchmarks/first_token.py [--lengths 30,60,120,250,500]
"""

import argparse
import time

from rsd_cli.models import load_pair
from rsd_cli.profiles import load_profile
from rsd_cli.prompting import builtin_prompts
from rsd_cli.runtime import apply_flags, make_decoder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", default="default")
    parser.add_argument("--lengths", default="30,60,120,250,500")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    profile = apply_flags(load_profile(args.profile), {"variant": "ar", "temperature": 1.0})
    pair = load_pair(profile)
    text = " ".join(builtin_prompts("eval"))
    ids = pair.tokenizer(text)["input_ids"]
    lengths = [int(n) for n in args.lengths.split(",")]
    ids = ids * (max(lengths) // len(ids) + 1)
    next(iter(make_decoder(pair, profile).generate(ids[:8], 2, seed=0)))  # (kernels set up)
    cells = []
    for n in lengths:
        times = []
        for repeat in range(args.repeats):
            steps = make_decoder(pair, profile).generate(ids[:n], 4, seed=repeat)
            start = time.perf_counter()
            next(steps)
            times.append(time.perf_counter() - start)
            steps.close()
        cells.append(f"{n}: {1e3 * min(times):.0f} ms")
    print("time to the first token, by prompt length:", ", ".join(cells))


if __name__ == "__main__":
    main()
