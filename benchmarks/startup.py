"""`rsd --help` latency and the second load of the default pair (no dequantisation).

Run: .venv/bin/python benchmarks/startup.py
"""

import statistics
import subprocess
import sys
import time
from pathlib import Path

rsd = Path(sys.executable).with_name("rsd")
times = []
for _ in range(5):
    start = time.perf_counter()
    subprocess.run([str(rsd), "--help"], capture_output=True, check=True)
    times.append(time.perf_counter() - start)
print(f"rsd --help: median {statistics.median(times):.2f} s over 5 runs")

from rsd_cli.models import load_pair  # noqa: E402
from rsd_cli.profiles import load_profile  # noqa: E402

load_pair(load_profile("default"))  # make sure the cache exists
start = time.perf_counter()
pair = load_pair(load_profile("default"))
print(f"load of the default pair from the cache: {time.perf_counter() - start:.1f} s ({pair.description})")
