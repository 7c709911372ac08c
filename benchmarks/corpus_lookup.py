"""Would a `lookup` draft from a corpus of the target's own answers pay (REST-style retrieval: the
token that most often followed the context's longest n-gram in the corpus), where drafting from the
context alone rarely matches at T=1?

A lookup draft x of one token is accepted with probability p_target(x), and a sampled answer token
equals x with that same probability: so the share of held-out answer tokens that equal the corpus's
prediction is its expected acceptance, with no logits needed. Reads answers written by `rsd generate
--json` (one object a line, `token_ids`), the corpus's and held-out ones, and prints, by the length n of
the longest match, the share of positions with a prediction and how often it was right; then the same
for predictions whose n-gram (n >= 2) was seen at least s times with one continuation at least a share
c of them (a draft confident enough to verify); and the context's own lookup (n = 3..1 within the
answer, as `--variant lookup` drafts) on the same positions.

    rsd generate --prompts corpus-prompts.txt -v ar -t 1 -n 160 --samples 4 --seed 7 --json -q > corpus.jsonl
    rsd generate --prompts rsd_cli/prompts/eval.txt -v ar -t 1 -n 160 --samples 8 --seed 11 --json -q > held-out.jsonl
    .venv/bin/python benchmarks/corpus_lookup.py corpus.jsonl held-out.jsonl

(benchmarks/results/intel-xeon-corpus-lookup/ holds the answers it was run on, gzipped: 240 of
benchmarks/distill-prompts.txt's prompts in corpus-prompts.txt, `shuf -n 240 --random-source=<(yes)`.)
"""

import argparse
import gzip
import json
from collections import Counter, defaultdict


def answers(path: str) -> list[list[int]]:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return [json.loads(line)["token_ids"] for line in f if line.strip()]


def continuations(corpus: list[list[int]], longest: int) -> dict[tuple[int, ...], Counter]:
    """n-gram (n = 1..longest) -> how often each token followed it in the corpus."""
    table: dict[tuple[int, ...], Counter] = defaultdict(Counter)
    for seq in corpus:
        for i in range(1, len(seq)):
            for n in range(1, min(longest, i) + 1):
                table[tuple(seq[i - n:i])][seq[i]] += 1
    return table


def corpus_prediction(table, seq: list[int], i: int, longest: int):
    """(n, token, times seen, share of its most common continuation) for seq[:i]'s longest match."""
    for n in range(min(longest, i), 0, -1):
        seen = table.get(tuple(seq[i - n:i]))
        if seen:
            token, count = seen.most_common(1)[0]
            total = sum(seen.values())
            return n, token, total, count / total
    return None


def context_prediction(seq: list[int], i: int, longest: int = 3):
    """(n, token): what followed the latest earlier occurrence of seq[:i]'s longest n-gram (n <= 3)."""
    for n in range(min(longest, i - 1), 0, -1):
        pattern = seq[i - n:i]
        for j in range(i - n - 1, -1, -1):
            if seq[j:j + n] == pattern:
                return n, seq[j + n]
    return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("corpus")
    parser.add_argument("held_out")
    parser.add_argument("--longest", type=int, default=6)
    args = parser.parse_args()
    corpus, held_out = answers(args.corpus), answers(args.held_out)
    table = continuations(corpus, args.longest)
    by_n, context = defaultdict(lambda: [0, 0]), defaultdict(lambda: [0, 0])
    confident = {(s, c): [0, 0] for s in (3, 10, 30) for c in (0.5, 0.7)}
    positions = 0
    for seq in held_out:
        for i in range(1, len(seq)):
            positions += 1
            found = corpus_prediction(table, seq, i, args.longest)
            if found:
                n, token, total, share = found
                by_n[n][0] += 1
                by_n[n][1] += token == seq[i]
                for (s, c), counts in confident.items():
                    if n >= 2 and total >= s and share >= c:
                        counts[0] += 1
                        counts[1] += token == seq[i]
            found = context_prediction(seq, i)
            if found:
                context[found[0]][0] += 1
                context[found[0]][1] += found[1] == seq[i]
    print(f"corpus {sum(map(len, corpus))} tokens in {len(corpus)} answers; held out {positions} positions "
          f"in {len(held_out)} answers")
    print("corpus lookup, by the longest match n: share of positions, right")
    for n in sorted(by_n):
        print(f"  n={n}  {by_n[n][0] / positions:.3f}  {by_n[n][1] / by_n[n][0]:.3f}")
    right = sum(v[1] for v in by_n.values())
    found = sum(v[0] for v in by_n.values())
    print(f"  any  {found / positions:.3f}  (right on {right / positions:.3f} of all positions)")
    print("corpus lookup, n >= 2 seen >= s times, its top continuation >= c of them: share, right")
    for (s, c), (count, hits) in confident.items():
        print(f"  s={s:<3} c={c}  {count / positions:.3f}  {hits / max(count, 1):.3f}")
    print("the context's own lookup (within the answer), by n: share, right")
    for n in sorted(context):
        print(f"  n={n}  {context[n][0] / positions:.3f}  {context[n][1] / context[n][0]:.3f}")


if __name__ == "__main__":
    main()
