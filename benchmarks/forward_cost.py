"""Cost of one target forward for 1..N new tokens after a 150-token cache, with each CPU linear
kernel rsd can use (torch's `F.linear`, the transposed product, oneDNN's inner product on the
weight and on a packed copy, rsd's kernel on quantised blocks where the weights are such) in
every layer, and with what the per-machine calibration ("auto") picked per shape; interleaved
in one process, on transformers' forward.

A speculative step verifies a tree of n nodes in one forward; what it can gain depends on how
much more n rows cost than one. Run: .venv/bin/python benchmarks/forward_cost.py [--repeats 9]
"""

import argparse
import json
import os
import time

import torch

from rsd_cli import small_batch
from rsd_cli.engine import CachedLM
from rsd_cli.models import load_pair
from rsd_cli.profiles import load_profile

parser = argparse.ArgumentParser()
parser.add_argument("--profile", default="default")
parser.add_argument("--rows", default="1,2,3,4,5,6,8,12,16,32")
parser.add_argument("--repeats", type=int, default=9)
parser.add_argument("--out")
args = parser.parse_args()

os.environ["RSD_SMALL_BATCH_MATMUL"] = "auto"
pair = load_pair(load_profile(args.profile))
linears = [m for m in pair.target.modules() if isinstance(m, torch.nn.Linear)]
chosen = {id(m): small_batch.kernels_of(m) for m in linears}
os.environ["RSD_SMALL_BATCH_MATMUL"] = "1"
small_batch.install(pair.target)  # every layer patched; which kernel each uses is set below
if small_batch.onednn_available():
    small_batch._prepare(linears, "packed")  # (each kernel on its own copy of the weights)
quantised = small_batch.blocks_available()
if quantised:
    small_batch._prepare(linears, "blocks")
    quantised = all(small_batch.blocks_of(m) is not None for m in linears)


def use(kernel: str) -> None:
    for module in linears:
        module._rsd_kernels = chosen[id(module)] if kernel == "auto" else (kernel, kernel, "torch")


torch.manual_seed(0)
lm = CachedLM(pair.target, pair.vocab_size)
lm.extend(torch.randint(0, pair.vocab_size, (150,)).tolist())
rows = [int(r) for r in args.rows.split(",")]
kernels = [*small_batch.available_kernels(quantised), "auto"]
times: dict[tuple[int, str], list[float]] = {}
for _ in range(args.repeats):
    for n in rows:
        for kernel in kernels:
            use(kernel)
            past = lm.length
            start = time.perf_counter()
            lm.forward(list(range(5, 5 + n)), list(range(past, past + n)), torch.ones(n, past + n, dtype=torch.bool))
            times.setdefault((n, kernel), []).append(time.perf_counter() - start)
            lm.cache.crop(-n)
use("auto")

median = {key: sorted(v)[len(v) // 2] * 1e3 for key, v in times.items()}
one = median[(1, "torch")]
result = [{"rows": n, **{f"{k}_ms": round(median[(n, k)], 1) for k in kernels},
           **{f"{k}_over_torch_one_row": round(median[(n, k)] / one, 2) for k in kernels}} for n in rows]
report = {"machine": small_batch.machine(),
          "auto_kernels": sorted({f"{tuple(m.weight.shape)}: {chosen[id(m)]}" for m in linears}),
          "forwards": result}
print(json.dumps(report, indent=1))
if args.out:
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
