"""How far can a draft's expected acceptance go on the embedded target at T = 1? Two probes on
the target's own sampled answers to the held-out prompts (as benchmarks/acceptance.py):

1. the shipped draft with its q sharpened or flattened by a draft temperature t (q ~ q^(1/t);
   any q keeps recursive rejection exact, so this would be a free knob if it paid): the single
   draw's sum_x min(p, q) and P(a root child is accepted) with 2 and 3 children drawn without
   replacement, and the t -> 0 limit (the draft's top-k tokens);
2. the target's own first k layers + its final norm and head, no adapter (what an early exit
   sees before any training), up to 29 of its 30 layers.

Run: .venv/bin/python benchmarks/acceptance_limits.py [--tokens 1500] [--positions 400]
How wide a fan pays where verifying more children is nearly free (a GPU):
     .venv/bin/python benchmarks/acceptance_limits.py --draft-temperatures 1 --children 1,2,3,4,6,8,12,16
"""

import argparse
import json

import torch

from rsd_cli.distill import Recipe, sample_answers
from rsd_cli.engine import full_vocabulary
from rsd_cli.models import load_pair
from rsd_cli.profiles import load_profile
from rsd_cli.prompting import builtin_prompts
from rsd_cli.verification import Rule, root_acceptance

parser = argparse.ArgumentParser()
parser.add_argument("--profile", default="default")
parser.add_argument("--tokens", type=int, default=1500)
parser.add_argument("--positions", type=int, default=400, help="positions for the (slower) root acceptance")
parser.add_argument("--seed", type=int, default=123)
parser.add_argument("--children", default="2,3", help="root children (drawn without replacement) to rate")
parser.add_argument("--draft-temperatures", default="1.25,1,0.85,0.7,0.55,0.4,0.25")
args = parser.parse_args()

torch.manual_seed(args.seed)
pair = load_pair(load_profile(args.profile))
data = sample_answers(pair.target, pair.tokenizer, builtin_prompts("eval"), args.tokens, Recipe(seed=args.seed),
                      "eval", lambda *a: None)
target = pair.target
exits = (3, 6, 12, 18, 24, 27, 28, 29)
target_logits, draft_logits = [], []
exit_overlap = {k: 0.0 for k in exits}
for seq in data:
    ids = torch.tensor([seq.ids], device=target.device)
    answer = slice(seq.answer_start - 1, len(seq.ids) - 1)
    with torch.inference_mode():
        out = target(ids, output_hidden_states=True)
        logits = out.logits[0, answer].float()
        p = logits.softmax(-1)
        for k in exits:
            q = target.lm_head(target.model.norm(out.hidden_states[k][0, answer])).float().softmax(-1)
            exit_overlap[k] += float(torch.minimum(p, q).sum())
        draft = full_vocabulary(pair.draft(ids).logits[0, answer].float(), logits.shape[-1])
    target_logits.append(logits)
    draft_logits.append(draft)
p = torch.cat(target_logits).softmax(-1)
z = torch.cat(draft_logits)
n = p.shape[0]
sample = torch.randperm(n, generator=torch.Generator().manual_seed(0))[: args.positions].tolist()
gen = torch.Generator().manual_seed(1)
rows = []
for t in (float(x) for x in args.draft_temperatures.split(",")):
    q = (z / t).softmax(-1)
    row = {"draft_temperature": t, "single": float(torch.minimum(p, q).sum(-1).mean())}
    for k in (int(x) for x in args.children.split(",")):
        row[f"root_k{k}"] = sum(root_acceptance(p[i], q[i], k, Rule.WITHOUT_REPLACEMENT, 2, gen)
                                for i in sample) / len(sample)
    rows.append(row)
top = z.topk(3, -1).indices
limit = {f"top{k}": float(p.gather(-1, top[:, :k]).sum(-1).mean()) for k in (1, 2, 3)}
print(json.dumps({
    "positions": n,
    "draft_temperature": rows,
    "draft_temperature_to_0": limit,
    "target_top_k_mass": {f"top{k}": float(p.topk(k, -1).values.sum(-1).mean()) for k in (1, 3)},
    "early_exit_without_adapter": {str(k): exit_overlap[k] / n for k in exits},
}, indent=1))
