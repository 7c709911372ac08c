"""Block efficiency lookup drafts would reach on the target's own greedy answers, by n-gram length
and chain length γ, without timing anything: each prompt is answered once (`ar`, T=0), then
replayed step by step — `drafting.NgramIndex` drafts up to γ tokens, accepted while they equal
the answer's (exactly what greedy verification accepts), plus one token a step; then, at every
answer position, how often a match of n tokens predicts the next ones. Where verifying
γ more tokens costs the target little (a GPU) this is close to the speed-up; on a 2-core CPU
each extra token costs 15-25% of a forward (see docs/variants.md, lookup).

  .venv/bin/python benchmarks/lookup_offline.py [--prompts benchmarks/grounded-prompts.txt] [--limit 8] [-n 128]
"""

import argparse

from rsd_cli.drafting import NgramIndex
from rsd_cli.generation import complete
from rsd_cli.models import load_pair
from rsd_cli.profiles import load_profile
from rsd_cli.prompting import builtin_prompts, encode_prompt
from rsd_cli.runtime import apply_flags, make_decoder


def agreeing(chain: list[int], answer: list[int], at: int) -> int:
    """How many of the chain's tokens equal the answer's from position `at` on, in a row (what
    greedy verification accepts)."""
    right = 0
    while right < len(chain) and at + right < len(answer) and chain[right] == answer[at + right]:
        right += 1
    return right


def replay(prompt: list[int], answer: list[int], longest: int, gamma: int) -> tuple[int, int]:
    """(steps, tokens the target verifies) to emit `answer` with lookup chains of up to gamma."""
    index, seq, done, steps, verified = NgramIndex(longest), list(prompt), 0, 0, 0
    while done < len(answer):
        chain = index.continuation(seq, gamma)
        accepted = agreeing(chain, answer, done)
        emitted = min(accepted + 1, len(answer) - done)
        seq += answer[done: done + emitted]
        done, steps, verified = done + emitted, steps + 1, verified + 1 + len(chain)
    return steps, verified


def by_match(prompt: list[int], answer: list[int], longest: int, gamma: int, table: dict) -> None:
    """At every position of the answer where the context's end matches an earlier n-gram: into
    table[n] (steps, first token right, tokens right of a chain of up to gamma). A step-by-step
    view, not a replay: the positions are every answer token's, whatever a chain accepted before."""
    index, seq = NgramIndex(longest), list(prompt)
    for i, token in enumerate(answer):
        n, chain = index.match(seq, gamma)
        if chain:
            right = agreeing(chain, answer, i)
            cells = table.setdefault(n, [0, 0, 0])
            cells[0], cells[1], cells[2] = cells[0] + 1, cells[1] + (chain[0] == token), cells[2] + right
        seq.append(token)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", default="benchmarks/grounded-prompts.txt", help="one per line; 'eval': built-in")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("-n", "--max-tokens", type=int, default=128)
    parser.add_argument("--ngrams", default="1,2,3,4,8")
    parser.add_argument("--gammas", default="1,2,4,8")
    args = parser.parse_args()

    profile = apply_flags(load_profile("default"), {"variant": "ar", "temperature": 0.0})
    pair = load_pair(profile, light=True)
    texts = builtin_prompts("eval") if args.prompts == "eval" else \
        [line.strip() for line in open(args.prompts, encoding="utf-8") if line.strip()]
    answered = []
    for text in texts[: args.limit]:
        ids = encode_prompt(pair.tokenizer, text)
        answer, _, _ = complete(make_decoder(pair, profile), ids, args.max_tokens, 0)
        answered.append((ids, answer))
    tokens = sum(len(answer) for _, answer in answered)
    print(f"{len(answered)} answers, {tokens} tokens")
    for longest in (int(n) for n in args.ngrams.split(",")):
        cells = []
        for gamma in (int(g) for g in args.gammas.split(",")):
            steps = verified = 0
            for ids, answer in answered:
                s, v = replay(ids, answer, longest, gamma)
                steps, verified = steps + s, verified + v
            cells.append(f"γ={gamma}: BE {tokens / steps:.2f}, {verified / steps:.2f} verified a step")
        print(f"ngram {longest}: " + " | ".join(cells))
    # how well a match predicts by its length (what `auto` learns per n; `-v lookup` drafts on any)
    table: dict[int, list[int]] = {}
    for ids, answer in answered:
        by_match(ids, answer, 3, 4, table)
    print("by n-gram matched (longest 3), at every answer position with a match: " + " | ".join(
        f"n={n}: {steps} positions, first token right {first / steps:.2f}, right of 4 {right / steps:.2f}"
        for n, (steps, first, right) in sorted(table.items())))


if __name__ == "__main__":
    main()
