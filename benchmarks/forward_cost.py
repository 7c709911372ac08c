"""Cost of one target forward for 1..N new tokens after a 150-token cache, with rsd's CPU
small-batch linear layers and with torch's default kernels, interleaved in one process.

A speculative step verifies a tree of n nodes in one forward; what it can gain depends on how
much more n rows cost than one. Run: .venv/bin/python benchmarks/forward_cost.py [--repeats 9]
(both kernels are measured whatever `rsd` would pick on this machine; `auto_layers` says how
many layers its per-machine calibration gives the small-batch kernel).
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
args = parser.parse_args()

os.environ["RSD_SMALL_BATCH_MATMUL"] = "auto"
pair = load_pair(load_profile(args.profile))
auto_layers = small_batch.installed(pair.target)
os.environ["RSD_SMALL_BATCH_MATMUL"] = "1"  # from here on: every layer the kernel could serve
small_batch.install(pair.target)
patched = [m for m in pair.target.modules() if small_batch.uses_small_batch(m)]


def use_small_batch(on: bool) -> None:
    for module in patched:
        if on:
            small_batch.install(module)
        else:
            del module.forward


torch.manual_seed(0)
lm = CachedLM(pair.target, pair.vocab_size)
lm.extend(torch.randint(0, pair.vocab_size, (150,)).tolist())
rows = [int(r) for r in args.rows.split(",")]
times: dict[tuple[int, str], list[float]] = {}
for _ in range(args.repeats):
    for n in rows:
        for kernel in ("torch", "small-batch"):
            use_small_batch(kernel == "small-batch")
            past = lm.length
            start = time.perf_counter()
            lm.forward(list(range(5, 5 + n)), list(range(past, past + n)), torch.ones(n, past + n, dtype=torch.bool))
            times.setdefault((n, kernel), []).append(time.perf_counter() - start)
            lm.cache.crop(-n)
use_small_batch(True)

median = {key: sorted(v)[len(v) // 2] * 1e3 for key, v in times.items()}
one = median[(1, "torch")]
result = [{"rows": n, "torch_ms": round(median[(n, "torch")], 1), "small_batch_ms": round(median[(n, "small-batch")], 1),
           "torch_over_one_row": round(median[(n, "torch")] / one, 2),
           "small_batch_over_one_row": round(median[(n, "small-batch")] / one, 2)} for n in rows]
print(json.dumps({"machine": small_batch.machine(), "patched_layers": len(patched), "auto_layers": auto_layers,
                  "forwards": result}, indent=1))
