"""This checkout's C library against an earlier commit's on whole forwards of the embedded pair (all
layers in one call, then the final norm and head), the two alternating call by call in one process
(which goes first alternates too) so that both see the same spells of a machine whose speed drifts
by 1.5x within minutes: per row count, each library's median and the median of the paired ratios
(after / before; below 1: faster now).

Run on a quiet machine:
    .venv/bin/python benchmarks/c_library_paired_ab.py --before HEAD [--rows 1,2,3,4] [--calls 120] [--cached 150]
"""

import argparse
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from rsd_cli import blocks
from rsd_cli.models import load_pair
from rsd_cli.profiles import load_profile
from rsd_cli.runtime import runtimes_of
from rsd_cli.small_batch import blocks_of

parser = argparse.ArgumentParser()
parser.add_argument("--before", required=True, help="git revision whose rsd_cli/blocks.py C source to compare")
parser.add_argument("--rows", default="1,2,3,4")
parser.add_argument("--calls", type=int, default=120, help="forwards per library and row count")
parser.add_argument("--cached", type=int, default=150, help="tokens already in the cache")
args = parser.parse_args()

earlier = subprocess.run(["git", "show", f"{args.before}:rsd_cli/blocks.py"], capture_output=True, text=True,
                         check=True).stdout
now_source = blocks.SOURCE
blocks.SOURCE = re.search(r'SOURCE = r"""(.*?)"""', earlier, re.S).group(1)
before_lib = blocks.build(Path(tempfile.mkdtemp()))
blocks.SOURCE = now_source
after_lib = blocks.library()
assert before_lib is not None and after_lib is not None, "no C compiler"

pair = load_pair(load_profile("default"))
runtimes = runtimes_of(pair, "auto")
for role in ("target", "draft"):
    runtime = getattr(runtimes, role)
    assert runtime.all_in_c, f"the {role} does not run every layer in C here"
    table = runtime._native_table(runtime.native)
    heads, kv_heads, head_dim, scaling, eps = runtime.dims
    size = runtime.model.config.hidden_size
    layers = len(runtime.layers)
    keys = torch.zeros(layers, kv_heads, args.cached + 64, head_dim)
    values = torch.zeros_like(keys)
    head = blocks_of(runtime.model.lm_head)
    norm = runtime.model.model.norm.weight

    def forward(lib, n: int) -> float:
        """Seconds of one forward of n new tokens (random hidden states) on library `lib`."""
        x = torch.randn(n, size) * 0.1
        positions = torch.arange(args.cached - n, args.cached)
        run = blocks.NativeForward(runtime.cos[positions], runtime.sin[positions], torch.zeros(n, args.cached),
                                   (size, heads, kv_heads, head_dim, runtime.intermediate, scaling, eps))
        run.lib = lib
        rows = torch.arange(n)
        start = time.perf_counter()
        blocks.native_head(run.layers(table, x, keys, values), rows, norm, runtime.norm_eps, head, lib=lib)
        return time.perf_counter() - start

    for n in (int(part) for part in args.rows.split(",")):
        before, after = [], []
        for call in range(args.calls):
            for lib in ((before_lib, after_lib) if call % 2 else (after_lib, before_lib)):
                (before if lib is before_lib else after).append(forward(lib, n))
        ratio = statistics.median(b / a for a, b in zip(before, after))
        print(f"{role} {n} token(s) after {args.cached}: before {1000 * statistics.median(before):.2f} ms, "
              f"after {1000 * statistics.median(after):.2f} ms, paired after/before {ratio:.3f}", flush=True)
