"""Forward cost of the uncompiled static-cache runtime (C layers) with this checkout's C library
against the one of an earlier commit, interleaved in one process: ms per forward of n new tokens
after a cache of P tokens, and of a P-token prompt (prefill), medians over rounds.

Run on a quiet machine:
    .venv/bin/python benchmarks/c_layers_ab.py --before be392ee [--role target|draft]
        [--prefixes 150,1000,2000] [--rows 1,2,4,8,16] [--rounds 3] [--no-prefill]

The earlier commit's library runs under that commit's rule for which forwards take whole layers
in C (`--before-rule`: "rows x keys <= 1200", the rule before 2026-11-23, or "same": every
forward, as now).
"""

import argparse
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from rsd_cli import blocks
from rsd_cli.compiled import CompiledModel, StaticLM
from rsd_cli.engine import timed_chain
from rsd_cli.models import load_pair
from rsd_cli.profiles import load_profile

parser = argparse.ArgumentParser()
parser.add_argument("--before", required=True,
                    help="git revision whose rsd_cli/blocks.py C source to compare, or a blocks.py file")
parser.add_argument("--before-rule", default="rows x keys <= 1200", choices=["rows x keys <= 1200", "same"])
parser.add_argument("--role", default="target", choices=["target", "draft"])
parser.add_argument("--profile", default="default")
parser.add_argument("--prefixes", default="150,1000,2000")
parser.add_argument("--rows", default="1,2,4,8,16")
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--no-prefill", action="store_true", help="skip timing the P-token prompts")
args = parser.parse_args()

earlier = Path(args.before).read_text() if Path(args.before).is_file() else \
    subprocess.run(["git", "show", f"{args.before}:rsd_cli/blocks.py"], capture_output=True, text=True,
                   check=True).stdout
current = blocks.SOURCE
blocks.SOURCE = re.search(r'SOURCE = r"""(.*?)"""', earlier, re.S).group(1)
if "blocks_scratch" not in blocks.SOURCE:  # (before 2026-11-24 Python worked out the scratch's size)
    blocks.SOURCE += """
int64_t blocks_scratch(int n, int kv_len, const int* dims, int threads) {
  return (int64_t)n * (2 * dims[0] + (2 * dims[1] + 2 * dims[2]) * dims[3] + 3 * dims[4]) + (int64_t)threads * kv_len;
}
"""
# each library reads its own layout of the layer table (7 addresses a layer before 2026-11-24, then 8
# with Qwen2's q/k/v bias, 10 with Qwen3's head norms): the table of each is made for it
before_entries = int(re.search(r"pointers \+ \(size_t\)l \* (\d+)", blocks.SOURCE).group(1))
current_table, current_entries = blocks.native_table, blocks.TABLE_ENTRIES


def table_of(entries: int):
    def native_table(layers):
        full = current_table(layers).view(-1, current_entries)  # ln1, ln2, qkv, bias, q/k norms, o, gu, down, formats
        kept = {10: list(range(10)), 8: [0, 1, 2, 3, 6, 7, 8, 9], 7: [0, 1, 2, 6, 7, 8, 9]}[entries]
        return full[:, kept].reshape(-1).contiguous()
    return native_table


folder = Path(tempfile.mkdtemp(prefix="rsd-c-ab-"))
before_lib = blocks.build(folder / "before")
blocks.SOURCE = current
after_lib = blocks.build(folder / "after")
assert before_lib is not None and after_lib is not None, "a C library did not build"
every = lambda n, keys: True  # noqa: E731
before_rule = every if args.before_rule == "same" else (lambda n, keys: n == 1 or n * keys <= 1200)
variants = {"before": (before_lib, before_rule, before_entries), "after": (after_lib, every, blocks.TABLE_ENTRIES)}


def use(lib, entries: int) -> None:
    """Make `lib` the C library the runtime calls, with its table layout."""
    blocks.library = lambda: lib  # (NativeForward and the products look it up per call)
    blocks.native_table, blocks.TABLE_ENTRIES = table_of(entries), entries
    runtime._table = (None, None)  # (the runtime keeps the table it made last)
    import rsd_cli.compiled as compiled
    compiled.native_table = blocks.native_table


profile = load_profile(args.profile)
profile.set("runtime", "compile", "off", "benchmark")
pair = load_pair(profile)
model = pair.target if args.role == "target" else pair.draft
runtime = CompiledModel(model, compile=False)
runtime.prompts_in_c = True  # (prompts through the C library too, whatever this machine's verdicts choose)
native = runtime.native
for prefix in (int(p) for p in args.prefixes.split(",")):
    cache = StaticLM(runtime, model.config.vocab_size, prefix + 100)
    cache.extend(list(range(100, 100 + prefix)))
    line = []
    for n in (int(r) for r in args.rows.split(",")):
        times = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, (lib, in_c, entries) in variants.items():
                use(lib, entries)
                runtime.native = native if in_c(n, prefix + n) else None  # else torch's layer
                for _ in range(2):
                    timed_chain(cache, n)
                times[name].append(statistics.median(timed_chain(cache, n) for _ in range(15)) * 1e3)
        before, after = (statistics.median(times[name]) for name in variants)
        line.append(f"n={n} {before:.2f} -> {after:.2f} ({after / before:.2f}x)")
    print(f"{args.role}, {prefix} cached: " + " | ".join(line), flush=True)
    if args.no_prefill:
        continue
    times = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (lib, in_c, entries) in variants.items():
            use(lib, entries)
            runtime.native = native if in_c(prefix, prefix) else None
            fresh = StaticLM(runtime, model.config.vocab_size, prefix + 1)
            start = time.perf_counter()
            fresh.extend(list(range(100, 100 + prefix)))
            times[name].append(time.perf_counter() - start)
            fresh.release()
    before, after = (statistics.median(times[name]) for name in variants)
    print(f"{args.role}, a {prefix}-token prompt: {before:.2f} -> {after:.2f} s ({after / before:.2f}x)", flush=True)
