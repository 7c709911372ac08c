"""Every family the tests build (tests/tiny.py), in bfloat16 or float16 on the uncompiled static-cache
runtime, against transformers' forward on this CPU: a prompt, then the tests' 6-node tree after it; the
largest difference of the prompt's last logits and of the tree's rows (each against transformers' forward
of its path read as a chain, or with --token-by-token read a token at a time after the prompt, as its
generate reads them), and the largest logit. Each product in torch's kernel (oneDNN's rounds otherwise).

Run: .venv/bin/python benchmarks/half_precision_sweep.py [--dtype bfloat16|float16] [--kinds all|k1,k2]
     [--token-by-token] [--prompt-length N]
"""

import argparse
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("RSD_SMALL_BATCH_MATMUL", "torch")
tests = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(tests))

import torch  # noqa: E402

from rsd_cli.compiled import CompiledModel, StaticLM  # noqa: E402
from rsd_cli.engine import CachedLM  # noqa: E402
from test_compiled import PROMPT, V, a_tree, transformers_last  # noqa: E402
from tiny import tiny_relative  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
parser.add_argument("--kinds", default="all", help="all: every kind tiny_relative builds")
parser.add_argument("--token-by-token", action="store_true")
parser.add_argument("--prompt-length", type=int, help="a prompt of N tokens instead of the tests' 3")
args = parser.parse_args()

source = (tests / "tiny.py").read_text()
table = source[source.index("config, model_class = {"):]
kinds = re.findall(r'"([a-z0-9_\-]+)": \(', table[: table.index("}[kind]")]) if args.kinds == "all" \
    else args.kinds.split(",")
prompt = PROMPT if args.prompt_length is None else [(7 * i + 3) % V for i in range(args.prompt_length)]
tree = a_tree()
visible = torch.cat([torch.ones(len(tree), len(prompt), dtype=torch.bool), tree.ancestry()], dim=1)
paths = [[token for token, seen in zip(tree.tokens, row) if seen] for row in tree.ancestry().tolist()]

for kind in kinds:
    model = tiny_relative(kind, V, layers=3, seed=0).to(getattr(torch, args.dtype))
    expected = torch.cat([transformers_last(model, prompt, path, args.token_by_token) for path in paths])
    read = CachedLM(model, V).extend(prompt)
    ours = StaticLM(CompiledModel(model, False), V, capacity=len(prompt) + len(tree) + 2)
    first = ours.extend(prompt, reading=True)
    logits = ours.forward(tree.tokens, [len(prompt) + depth for depth in tree.depths], visible)
    ours.release()
    print(f"{kind:<20} prompt {(first - read).abs().max().item():.4f} tree {(logits - expected).abs().max().item():.4f}"
          f" largest {read.abs().max().item():.2f}", flush=True)
