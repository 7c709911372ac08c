"""`--samples N` decoded together (Decoder.generate_together: one forward a step, a row per sample)
against the same samples one after the other (`ar`, Decoder.generate per seed, the prompt's caches
kept between them as `rsd generate --samples` keeps them), on the embedded pair: tokens/s of each,
interleaved in rounds, and how many samples came out token for token the same.

    .venv/bin/python benchmarks/samples_together.py [--samples 2,4,8,16] [-n 96] [--rounds 2]
        [--temperature 1] [--compile auto] [--json FILE]
"""

import argparse
import json
import statistics
import time

from rsd_cli.models import load_pair
from rsd_cli.profiles import load_profile
from rsd_cli.prompting import encode_prompt
from rsd_cli.runtime import apply_flags, make_decoder

PROMPT = "Write a short story about a robot who learns to paint."


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", default="2,4,8,16")
    parser.add_argument("-n", "--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--compile", default="auto")
    parser.add_argument("--json")
    args = parser.parse_args()
    profile = apply_flags(load_profile(None), {"variant": "ar", "temperature": args.temperature,
                                               "compile": args.compile})
    pair = load_pair(profile)
    decoder = make_decoder(pair, profile)
    ids = encode_prompt(pair.tokenizer, PROMPT)
    list(decoder.generate(ids, 8, seed=0))  # (first calls: page faults, kernel set-up)
    rows = []
    for count in (int(n) for n in args.samples.split(",")):
        seeds = list(range(10, 10 + count))
        alone_rates, together_rates, same = [], [], 0
        for _ in range(args.rounds):
            decoder.keep_caches = True
            start = time.perf_counter()
            alone = [[t for e in decoder.generate(ids, args.max_tokens, seed) for t in e.emitted] for seed in seeds]
            alone_rates.append(sum(map(len, alone)) / (time.perf_counter() - start))
            decoder.keep_caches = False
            start = time.perf_counter()
            together = [[] for _ in seeds]
            for events in decoder.generate_together([ids] * count, args.max_tokens, seeds):
                for j, event in enumerate(events):
                    if event is not None:
                        together[j] += event.emitted
            together_rates.append(sum(map(len, together)) / (time.perf_counter() - start))
            same = sum(a == b for a, b in zip(alone, together))
        row = {"samples": count, "alone_tok_s": statistics.median(alone_rates),
               "together_tok_s": statistics.median(together_rates), "rounds": [alone_rates, together_rates],
               "identical": same}
        row["x"] = row["together_tok_s"] / row["alone_tok_s"]
        rows.append(row)
        print(f"{count:3d} samples: one after the other {row['alone_tok_s']:6.1f} tok/s, together "
              f"{row['together_tok_s']:6.1f} tok/s ({row['x']:.2f}x); {same}/{count} token for token the same",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runtime": pair.runtimes.describe() if pair.runtimes else "transformers eager",
                       "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
