"""bfloat16 logits on the runtime against transformers' forward, and what rounding compiled graphs'
results to bfloat16 (inductor's `emulate_precision_casts`, which rsd sets when it compiles) costs.

For tiny random models of a few families (the tests' tiny.py) in bfloat16 on the device: a prompt
and a 6-node tree after it, on the uncompiled runtime and compiled (on a GPU: in CUDA graphs), each
row against transformers' forward of its path; the largest difference in logits and in bfloat16 steps
at the largest logit. Then the embedded target's compiled forward of 1 and 4 tokens after 150 (medians).
Each setting in a process of its own (`--casts on|off`; no argument: both, one after the other).

Run: .venv/bin/python benchmarks/bf16_fidelity.py [--kinds qwen3,gemma3,olmo2,granite4,mamba2] [--out FILE.json]
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--kinds", default="qwen3,gemma3,olmo2,granite4,mamba2")
parser.add_argument("--casts", choices=("on", "off"))
parser.add_argument("--repeats", type=int, default=15)
parser.add_argument("--out")
args = parser.parse_args()

if args.casts is None:  # both settings, each in a process of its own
    rows = []
    for casts in ("off", "on"):
        done = subprocess.run([sys.executable, __file__, "--kinds", args.kinds, "--casts", casts,
                               "--repeats", str(args.repeats)], capture_output=True, text=True)
        sys.stderr.write(done.stderr[-2000:] if done.returncode else "")
        rows += [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    for row in rows:
        print(json.dumps(row))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    sys.exit(0)

import os  # noqa: E402

os.environ.setdefault("RSD_ADAPTIVE_THREADS", "0")  # (a CPU's graphs on every forward: torch's fixed threads)
import torch  # noqa: E402

if args.casts == "off":  # rsd asks for it when it compiles: left out in this process
    plain_compile = torch.compile

    def compile_without_casts(fn, **settings):
        settings.pop("options", None)
        return plain_compile(fn, **settings)

    torch.compile = compile_without_casts

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from rsd_cli.compiled import CompiledModel, StaticLM  # noqa: E402
from rsd_cli.engine import CachedLM  # noqa: E402
from test_compiled import PROMPT, V, a_tree, bfloat16_steps, transformers_last  # noqa: E402
from tiny import tiny_relative  # noqa: E402

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")


tree = a_tree()  # (the tests' tree of 6 nodes)
base = len(PROMPT)
visible = torch.cat([torch.ones(len(tree), base, dtype=torch.bool), tree.ancestry()], dim=1)
paths = [[token for token, seen in zip(tree.tokens, row) if seen] for row in tree.ancestry().tolist()]
for kind in args.kinds.split(","):
    model = tiny_relative(kind, V, layers=3, seed=0).to(device=device, dtype=torch.bfloat16)
    # (MPT's token by token, as its generate reads them: its position bias depends on the forward's length)
    expected = torch.cat([transformers_last(model, PROMPT, path, token_by_token=kind == "mpt")
                          for path in paths]).float().cpu()
    read = CachedLM(model, V).extend(PROMPT).float().cpu()
    largest = max(read.abs().max().item(), expected.abs().max().item())
    for compile in (False, True):
        backend = CompiledModel(model, compile)
        ours = StaticLM(backend, V, capacity=16)
        prompt = ours.extend(PROMPT, reading=True).float().cpu()
        logits = ours.forward(tree.tokens, [base + d for d in tree.depths], visible).float().cpu()
        ours.release()
        # graphs: the token counts that ran compiled (on a CPU, where its thread governor gave the forward
        # fewer threads than the graphs were compiled for, the layers ran uncompiled: none)
        print(json.dumps({"casts": args.casts, "kind": kind, "compiled": compile, "device": device.type,
                          "graphs": sorted(backend.graphs),
                          "prompt_diff": (prompt - read).abs().max().item(),
                          "tree_diff": (logits - expected).abs().max().item(),
                          "steps": max(bfloat16_steps(prompt, read, largest),
                                       bfloat16_steps(logits, expected, largest))}),
              flush=True)

from rsd_cli.models import load_pair  # noqa: E402
from rsd_cli.profiles import load_profile  # noqa: E402

profile = load_profile("default")
profile.set("runtime", "compile", "off", "benchmark")
profile.set("target", "dtype", "bfloat16", "benchmark")
target = load_pair(profile).target
lm = StaticLM(CompiledModel(target, True), target.config.vocab_size, capacity=256)
lm.extend(torch.randint(0, 8000, (150,), generator=torch.Generator().manual_seed(0)).tolist())
for n in (1, 4):
    seen = torch.cat([torch.ones(n, 150, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], 1)
    times = []
    for repeat in range(args.repeats + 2):  # (the first two: compile or capture, then warm)
        start = time.perf_counter()
        lm.forward(list(range(5, 5 + n)), list(range(150, 150 + n)), seen)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        lm.keep(list(range(150)))
    print(json.dumps({"casts": args.casts, "target_rows": n, "device": device.type,
                      "median_ms": round(statistics.median(times[2:]) * 1e3, 3)}), flush=True)
