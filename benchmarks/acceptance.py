"""Expected acceptance sum_x min(p, q) of the default draft on held-out prompts at T = 1.

The answers are the target's own samples to the built-in *eval* prompts, which distillation
never trains on. Run: .venv/bin/python benchmarks/acceptance.py [--tokens 2000] [--profile P]
"""

import argparse

import torch

from rsd_cli.distill import Recipe, expected_acceptance, sample_answers
from rsd_cli.models import load_pair
from rsd_cli.profiles import load_profile
from rsd_cli.prompting import builtin_prompts

parser = argparse.ArgumentParser()
parser.add_argument("--tokens", type=int, default=2000)
parser.add_argument("--profile", default="default")
parser.add_argument("--seed", type=int, default=123)
args = parser.parse_args()

torch.manual_seed(args.seed)
pair = load_pair(load_profile(args.profile))
recipe = Recipe(seed=args.seed)
data = sample_answers(pair.target, pair.tokenizer, builtin_prompts("eval"), args.tokens, recipe, "eval",
                      lambda *a: None)
print(f"{pair.description}: expected acceptance {expected_acceptance(pair.target, pair.draft, data):.3f} "
      f"over {sum(len(s.ids) - s.answer_start for s in data)} held-out answer tokens (T=1)")
