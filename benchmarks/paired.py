"""Without vs with replacement on the SAME contexts: `rsd-c` against `mss` of the same shape.

In `rsd bench` every variant generates its own text, so after the first step the variants see
different contexts and a difference of a few percent drowns in noise. Here one shared
trajectory (the target's own T=1 answer to each held-out prompt) is walked token by token.
At every position each variant drafts and verifies one step from the identical context (the
caches are copied), and we record:

- the accepted length + 1 of that step (sampled; its mean over positions is the block
  efficiency on these contexts), `--repeats` times per position and variant;
- the probability that a root child is accepted, from the root's p and q (see
  `rsd_cli.verification.root_acceptance`: exact for i.i.d. drafts, a low-variance average over `--draws`
  rejection paths for drafts without replacement).

Run: .venv/bin/python benchmarks/paired.py [--budgets 10,14,21,30] [--limit 8] [-n 48]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys

import torch

from rsd_cli.drafting import shape_for_budget
from rsd_cli.engine import CachedLM, Decoder
from rsd_cli.models import load_pair
from rsd_cli.profiles import load_profile
from rsd_cli.prompting import builtin_prompts, encode_prompt
from rsd_cli.sampling import SamplingParams
from rsd_cli.verification import root_acceptance


def clone(lm: CachedLM) -> CachedLM:
    twin = CachedLM.__new__(CachedLM)
    twin.__dict__.update(lm.__dict__)
    twin.cache = copy.deepcopy(lm.cache)
    return twin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="10,14,21,30")
    parser.add_argument("--variants", default="rsd-c,mss")
    parser.add_argument("--limit", type=int, default=8, help="held-out prompts")
    parser.add_argument("-n", "--tokens", type=int, default=48, help="trajectory length per prompt")
    parser.add_argument("--repeats", type=int, default=1, help="sampled steps per position and variant")
    parser.add_argument("--draws", type=int, default=64, help="rejection paths per position (without replacement)")
    parser.add_argument("--profile", default="default")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    pair = load_pair(load_profile(args.profile))
    sampling = SamplingParams(1.0, 0, 1.0)
    budgets = [int(b) for b in args.budgets.split(",")]
    variants = args.variants.split(",")
    decoders = {(v, b): Decoder(pair.target, pair.draft, pair.vocab_size, shape_for_budget(v, b), sampling,
                                pair.eos_ids, pair.context_length) for b in budgets for v in variants}
    ar = Decoder(pair.target, pair.draft, pair.vocab_size, shape_for_budget("ar", 1), sampling, pair.eos_ids,
                 pair.context_length)
    generator = torch.Generator().manual_seed(args.seed)
    step_tokens = {key: [] for key in decoders}
    root_exact = {key: [] for key in decoders}

    for index, prompt in enumerate(builtin_prompts("eval")[: args.limit]):
        ids = encode_prompt(pair.tokenizer, prompt)
        answer = [t for event in ar.generate(ids, args.tokens, seed=args.seed + index) for t in event.emitted]
        target, draft = CachedLM(pair.target, pair.vocab_size), CachedLM(pair.draft, pair.vocab_size)
        target.extend(ids[:-1])
        draft.extend(ids[:-1])
        seq = list(ids)
        for position, token in enumerate(answer):
            for (variant, budget), decoder in decoders.items():
                for _ in range(args.repeats):
                    event = decoder._step(0, decoder.shape, seq, clone(target), clone(draft), generator)
                    step_tokens[variant, budget].append(event.accepted + 1)
                p, q = event.p[0], event.tree.q[0]
                k = decoder.shape.branching[0]
                root_exact[variant, budget].append(
                    root_acceptance(p, q, k, decoder.shape.rule, args.draws, generator))
            # walk the shared trajectory one token on; both caches hold everything but the root
            target.extend([seq[-1]])
            draft.extend([seq[-1]])
            seq.append(token)
            print(f"\rprompt {index + 1}/{args.limit} position {position + 1}/{len(answer)}", end="",
                  file=sys.stderr)
    print(file=sys.stderr)

    rows = []
    for (variant, budget), decoder in decoders.items():
        be = torch.tensor(step_tokens[variant, budget], dtype=torch.float64)
        root = torch.tensor(root_exact[variant, budget], dtype=torch.float64)
        rows.append({"variant": variant, "budget": budget, "shape": decoder.shape.describe(),
                     "positions": len(root), "block_efficiency": float(be.mean()),
                     "block_efficiency_stderr": float(be.std() / math.sqrt(len(be))),
                     "root_acceptance": float(root.mean())})
    for budget in budgets:  # paired differences: the same positions, so their spread is what counts
        if len(variants) == 2:
            a, b = (torch.tensor(root_exact[v, budget], dtype=torch.float64) for v in variants)
            diff = a - b
            x, y = (torch.tensor(step_tokens[v, budget], dtype=torch.float64) for v in variants)
            rows.append({"compare": f"{variants[0]} - {variants[1]}", "budget": budget,
                         "root_acceptance_difference": float(diff.mean()),
                         "root_acceptance_difference_stderr": float(diff.std() / math.sqrt(len(diff))),
                         "positions_where_second_is_higher": int((diff < -1e-3).sum()),
                         "block_efficiency_difference": float((x - y).mean()),
                         "block_efficiency_difference_stderr": float((x - y).std() / math.sqrt(len(x)))})
    print(json.dumps({"results": rows, "args": vars(args)}, indent=2))


if __name__ == "__main__":
    main()
