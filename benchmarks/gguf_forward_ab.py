"""A GGUF target's forward on the static-cache runtime (C layers) with this checkout's C library
against the one of an earlier commit (and variants built with extra compiler flags), interleaved
in one process: the best of 3 of an n-token forward after a 100-token cache, medians of 3 rounds.

    .venv/bin/python benchmarks/gguf_forward_ab.py FILE.gguf --before HEAD~1 [--rows 1,2,3,4,8]
        [--variant "-DSOME_FLAG=1" ...]

(FILE.gguf: e.g. the random 7B file benchmarks/big_gguf.py --keep DIR leaves in DIR, with
RSD_CACHE_DIR=DIR/cache so its conversion is reused.)
"""

import argparse
import pathlib
import re
import statistics
import subprocess
import tempfile

import torch

from rsd_cli import blocks, models
from rsd_cli.compiled import CompiledModel, StaticLM
from rsd_cli.engine import timed_chain

parser = argparse.ArgumentParser()
parser.add_argument("gguf")
parser.add_argument("--before", required=True, help="git revision whose rsd_cli/blocks.py C source to compare")
parser.add_argument("--rows", default="1,2,3,4,8")
parser.add_argument("--variant", action="append", default=[], help="extra compiler flags for another build")
args = parser.parse_args()

current = blocks.SOURCE
earlier = subprocess.run(["git", "show", f"{args.before}:rsd_cli/blocks.py"], capture_output=True, text=True,
                         check=True).stdout
blocks.SOURCE = re.search(r'SOURCE = r"""(.*?)"""', earlier, re.S).group(1)
libs = {"before": blocks.build(pathlib.Path(tempfile.mkdtemp()))}
blocks.SOURCE = current
libs["after"] = blocks.build(pathlib.Path(tempfile.mkdtemp()))
for flags in args.variant:
    libs[flags] = blocks.build(pathlib.Path(tempfile.mkdtemp()), (*blocks.FLAGS, *flags.split()))
assert all(lib is not None for lib in libs.values()), "a C library did not build"

model, _ = models.load_model(args.gguf, torch.device("cpu"), torch.float32, light=True)
runtime = CompiledModel(model, compile=False)
print(f"every layer in C: {runtime.all_in_c}", flush=True)
lm = StaticLM(runtime, model.config.vocab_size, 512)
lm.extend([5] * 100)
for n in (int(r) for r in args.rows.split(",")):
    times = {name: [] for name in libs}
    for _ in range(3):
        for name, lib in libs.items():
            blocks.library = lambda lib=lib: lib  # (the runtime looks the library up per call)
            timed_chain(lm, n)
            times[name].append(min(timed_chain(lm, n) for _ in range(3)) * 1e3)
    print(f"n={n} " + " | ".join(f"{name}: {statistics.median(t):.1f} ms" for name, t in times.items()), flush=True)
