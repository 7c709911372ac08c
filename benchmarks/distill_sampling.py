"""`rsd distill`'s sampling of the target's answers (its slow part: 24 of the shipped adapter's 45
minutes on a 2-core Intel Xeon): transformers' generate (`--compile off`, as before) against rsd's
runtime, the answers of a batch decoded together (`--compile auto` or `on`), in interleaved rounds on
the same recipe. Answer tokens a second, and what the answers look like (mean length, share ended by
the end-of-sequence token: both samplers draw from the same distribution).

Run on a quiet machine:
    RSD_ADAPTIVE_THREADS=0 .venv/bin/python benchmarks/distill_sampling.py [--tokens 6000] [--rounds 2]
        [--compile auto] [--batch-size 32] [--max-new-tokens 160] [--json FILE]
"""

import argparse
import json
import statistics
import time

import torch

from rsd_cli.compiled import runtime_for
from rsd_cli.distill import Recipe, sample_answers, sampler
from rsd_cli.engine import runtime_name
from rsd_cli.models import load_model, target_placement
from rsd_cli.profiles import load_profile
from rsd_cli.prompting import builtin_prompts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", default="default")
    parser.add_argument("--tokens", type=int, default=6000, help="answer tokens each sampler draws a round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--compile", default="auto")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--json")
    args = parser.parse_args()

    profile = load_profile(args.profile)
    placement, device, dtype = target_placement(profile)
    target, tokenizer = load_model(profile.resolve_path(profile["target"]["source"]), device,
                                   torch.float32 if dtype == torch.float16 else dtype, placement=placement)
    runtime = runtime_for(target, args.compile, "target")
    samplers = {"transformers generate": None, f"rsd runtime ({runtime_name(runtime)})": sampler(
        target, tokenizer, runtime, args.compile)}
    prompts = builtin_prompts("train")
    quiet = lambda *a: None  # noqa: E731 - (progress)
    rates: dict[str, list[float]] = {name: [] for name in samplers}
    answers: dict[str, list[list[int]]] = {name: [] for name in samplers}
    for round_ in range(args.rounds):
        recipe = Recipe(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=round_)
        for name, decoder in (samplers.items() if round_ % 2 == 0 else reversed(samplers.items())):
            start = time.perf_counter()
            data = sample_answers(target, tokenizer, prompts, args.tokens, recipe, "sampling", quiet, decoder)
            seconds = time.perf_counter() - start
            drawn = [s.ids[s.answer_start:] for s in data]
            rates[name].append(sum(map(len, drawn)) / seconds)
            answers[name] += drawn
            print(f"round {round_ + 1} {name:<52} {rates[name][-1]:7.1f} answer tokens/s", flush=True)
    eos = tokenizer.eos_token_id
    base = statistics.median(rates["transformers generate"])
    rows = []
    for name in samplers:
        drawn = answers[name]
        rows.append({"sampler": name, "tokens_per_second": statistics.median(rates[name]), "rounds": rates[name],
                     "x_transformers": statistics.median(rates[name]) / base, "answers": len(drawn),
                     "mean_length": statistics.mean(map(len, drawn)),
                     "ended_by_eos": sum(a[-1] == eos for a in drawn) / len(drawn)})
        print(f"{name:<52} {rows[-1]['tokens_per_second']:7.1f} tok/s  {rows[-1]['x_transformers']:.2f}x  "
              f"{len(drawn)} answers, mean {rows[-1]['mean_length']:.1f} tokens, "
              f"{100 * rows[-1]['ended_by_eos']:.0f}% ended by end-of-sequence")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "threads": torch.get_num_threads(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
