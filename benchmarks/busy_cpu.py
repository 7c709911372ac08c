"""rsd generate's tokens a second beside busy processes (`python -c "while True: pass"`, one per
--hogs entry), for several settings run alternately in each round (the machine's pace drifts).

A setting is NAME=ENV (space-separated VAR=value pairs, or nothing), optionally @PATH: a checkout
of rsd to run instead of this one (git worktree add /tmp/before <commit>).

  .venv/bin/python benchmarks/busy_cpu.py --hogs 0,1,2 --rounds 3 \\
      "governed=" "fixed=RSD_ADAPTIVE_THREADS=0" "omp1=OMP_NUM_THREADS=1" "before=@/tmp/before"

Prints one line per round and hog count, then the medians (nan: the run failed or took over
--timeout seconds); --json FILE keeps every number.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_setting(text: str) -> tuple[str, dict, str | None]:
    name, _, rest = text.partition("=")
    rest, _, checkout = rest.partition("@")
    env = dict(pair.split("=", 1) for pair in rest.split())
    return name, env, checkout or None


def tokens_per_second(args, env: dict, checkout: str | None) -> float:
    command = [sys.executable, "-m", "rsd_cli", "generate", args.prompt, "-n", str(args.max_tokens),
               "-v", args.variant, "-t", str(args.temperature), "--seed", "1", "--json", "-q"]
    full_env = {**os.environ, **env}
    if checkout:
        full_env["PYTHONPATH"] = checkout
    try:
        done = subprocess.run(command, env=full_env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              cwd="/tmp" if checkout else ROOT, timeout=args.timeout)
    except subprocess.TimeoutExpired:  # (a collapsed run: less than -n / --timeout tokens a second)
        return float("nan")
    if done.returncode != 0:
        return float("nan")
    return json.loads(done.stdout)["stats"]["tokens_per_second"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("settings", nargs="+")
    parser.add_argument("--hogs", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", default="Write a story about a cat.")
    parser.add_argument("-n", "--max-tokens", type=int, default=128)
    parser.add_argument("-v", "--variant", default="ar")
    parser.add_argument("-t", "--temperature", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json")
    args = parser.parse_args()
    settings = [parse_setting(s) for s in args.settings]
    results: dict = {}
    for hogs in (int(h) for h in args.hogs.split(",")):
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
        try:
            time.sleep(1)
            for round_ in range(args.rounds):
                order = settings if round_ % 2 == 0 else settings[::-1]
                line = {name: tokens_per_second(args, env, checkout) for name, env, checkout in order}
                for name, rate in line.items():
                    results.setdefault(str(hogs), {}).setdefault(name, []).append(rate)
                print(f"hogs={hogs} round {round_ + 1}: " + "  ".join(f"{name} {line[name]:.1f}"
                                                                     for name, _, _ in settings), flush=True)
        finally:
            for process in busy:
                process.kill()
                process.wait()
    print("medians (tok/s):")
    for hogs, by_name in results.items():
        print(f"hogs={hogs}: " + "  ".join(f"{name} {statistics.median(rates):.1f}" for name, rates in by_name.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "tokens_per_second": results}, indent=1))


if __name__ == "__main__":
    main()
