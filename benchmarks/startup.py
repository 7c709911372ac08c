"""How long rsd takes to start: `rsd --help`, a whole one-token `rsd generate` (a process as a user or
a script starts it: imports, loading the default pair, set-up, one token), loaded light (rsd's own
Llama modules), through transformers (RSD_LIGHT_LOAD=0) and with `--compile on` (compiled graphs
traced again, their code read from the cache), alternating, and the second load of the default
pair in this process (no dequantisation).

Run on a quiet machine: .venv/bin/python benchmarks/startup.py [--runs 5]
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--runs", type=int, default=5)
args = parser.parse_args()

rsd = Path(sys.executable).with_name("rsd")


def seconds(command: list[str], **env: str) -> float:
    start = time.perf_counter()
    subprocess.run(command, capture_output=True, check=True, env={**os.environ, **env})
    return time.perf_counter() - start


times = [seconds([str(rsd), "--help"]) for _ in range(args.runs)]
print(f"rsd --help: median {statistics.median(times):.2f} s over {args.runs} runs")

generate = [str(rsd), "generate", "Hi", "-n", "1"]
compile_on = generate + ["--compile", "on"]
seconds(generate)  # caches warm: the converted model, kernels, verdicts, costs
seconds(compile_on)  # and the compiled graphs' code
runs: dict[str, list[float]] = {"loaded light": [], "loaded through transformers": [], "--compile on": []}
for _ in range(args.runs):  # alternating: a busy moment of the machine hits each
    runs["loaded light"].append(seconds(generate, RSD_LIGHT_LOAD="1"))
    runs["loaded through transformers"].append(seconds(generate, RSD_LIGHT_LOAD="0"))
    runs["--compile on"].append(seconds(compile_on))
for how, values in runs.items():
    print(f'rsd generate "Hi" -n 1, {how}: median {statistics.median(values):.2f} s '
          f"(min {min(values):.2f}, max {max(values):.2f}) over {args.runs} runs")

from rsd_cli.models import load_pair  # noqa: E402
from rsd_cli.profiles import load_profile  # noqa: E402

load_pair(load_profile("default"), light=True)  # make sure the cache exists
start = time.perf_counter()
pair = load_pair(load_profile("default"), light=True)
print(f"load of the default pair from the cache, light: {time.perf_counter() - start:.1f} s ({pair.description})")
