"""Forward cost of the C layers on kept blocks (rsd_cli/blocks_cache.py: mapped from the cache's
files, q/k/v and gate/up stacked as views of them) against blocks recovered from the float32
weights (in anonymous memory, stacked copies), both loaded in one process and timed interleaved:
ms per forward of n new tokens after a 150-token cache, medians over rounds.

Run on a quiet machine: .venv/bin/python benchmarks/kept_blocks_ab.py [--source embedded] [--rows 1,2,4,8]
"""

import argparse
import statistics

import torch

from rsd_cli import blocks_cache, models
from rsd_cli.compiled import CompiledModel, StaticLM
from rsd_cli.engine import timed_chain

parser = argparse.ArgumentParser()
parser.add_argument("--source", default="embedded", help="a GGUF file (converted once into the rsd cache)")
parser.add_argument("--rows", default="1,2,4,8")
parser.add_argument("--rounds", type=int, default=7)
args = parser.parse_args()


def runtime(kept: bool) -> StaticLM:
    layout = blocks_cache.LAYOUT
    if not kept:
        blocks_cache.LAYOUT = "none"  # (the kept files are not read: blocks recovered from the weights)
    try:
        model, _ = models.load_model(args.source, torch.device("cpu"), torch.float32, light=True)
    finally:
        blocks_cache.LAYOUT = layout
    compiled = CompiledModel(model, compile=False)
    assert compiled.all_in_c, "not every layer runs in C"
    lm = StaticLM(compiled, model.config.vocab_size, 512)
    lm.extend([5] * 150)
    return lm


lms = {"kept (views of the file)": runtime(True), "recovered (copies)": runtime(False)}
rows = [int(n) for n in args.rows.split(",")]
times = {(name, n): [] for name in lms for n in rows}
for round_ in range(args.rounds):
    for name in (list(lms) if round_ % 2 == 0 else list(reversed(lms))):
        for n in rows:
            times[name, n].append(min(timed_chain(lms[name], n) for _ in range(3)) * 1000)
for name in lms:
    print(f"{name:26s}", "  ".join(f"{n} tok {statistics.median(times[name, n]):6.2f} ms" for n in rows))
