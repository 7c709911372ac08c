"""Random combinations of `rsd generate`'s flags on the tests' tiny pair (tests/tiny.py), run as a
user runs them (in-process, through the CLI): each case draws a prompt, -n, the runtime, zero to two
sampling or ending controls (top-k/p, min-p, penalties, a logit bias, --min-tokens, --stop with and
without --include-stop, --stop-token, --ignore-eos) and one or two samples, at T = 0 with --json and
--logprobs, under every variant. Checked: exit 0; per record, at most -n tokens, one logprobs entry
and one counted token per token, "length" only at -n, no "eos" with --ignore-eos, no end before
--min-tokens; and every variant's records equal to `ar`'s (greedy equivalence through the whole CLI).

    .venv/bin/python benchmarks/cli_sweep.py [--seed 0] [--cases 30]

Prints a line per case and the problems found (none, 2026-12-01: 30 cases x 9 variants, ~2 minutes on
a 2-core Intel Xeon).
"""

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

os.environ["RSD_CONFIG_DIR"] = tempfile.mkdtemp()  # (no user profile or cache of the machine's in the way)
os.environ["RSD_CACHE_DIR"] = tempfile.mkdtemp()
os.environ["RSD_TARGET_DEVICE"] = "cpu"

from typer.testing import CliRunner  # noqa: E402

from rsd_cli.cli import app  # noqa: E402
from tiny import save_tiny_pair  # noqa: E402

VARIANTS = [["-v", "ar"], ["-v", "sd", "--draft-len", "3"], ["-v", "mss", "--branching", "2,2"],
            ["-v", "spectr", "--num-drafts", "2", "--depth", "2"], ["-v", "rsd-c", "--branching", "3,2"],
            ["-v", "rsd-s", "--beam-width", "2", "--depth", "3"], ["-v", "lookup", "--draft-len", "3"],
            ["-v", "auto"], ["-v", "rsd-c", "--budget", "6"]]
CONTROLS = [["--top-k", "5"], ["--top-p", "0.8"], ["--min-p", "0.1"], ["--repetition-penalty", "1.3"],
            ["--presence-penalty", "0.5"], ["--frequency-penalty", "0.4"],
            ["--logit-bias", "5=3", "--logit-bias", "7=-inf"], ["--min-tokens", "6"], ["--stop", "e"],
            ["--stop", "ab", "--include-stop"], ["--stop-token", "10"], ["--ignore-eos"]]
PROMPTS = ["hello there", "abc abc abc abc ab", "the cat sat on the mat. the cat"]


def problems_of(records: list[dict], n: int, controls: list[str]) -> list[str]:
    """What a variant's records break of the invariants above."""
    found = []
    for record in records:
        tokens, finish = record["token_ids"], record["finish_reason"]
        if len(tokens) > n or len(record["logprobs"]) != len(tokens) or record["stats"]["new_tokens"] != len(tokens):
            found.append(f"{len(tokens)} tokens, {len(record['logprobs'])} logprobs, "
                         f"{record['stats']['new_tokens']} counted (-n {n})")
        if finish == "length" and len(tokens) != n:
            found.append(f"length after {len(tokens)} of {n}")
        if "--ignore-eos" in controls and finish == "eos":
            found.append("eos with --ignore-eos")
        if "--min-tokens" in controls and finish in ("eos", "stop") and len(tokens) < 6:
            found.append(f"{finish} after {len(tokens)} tokens with --min-tokens 6")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", type=int, default=30)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    save_tiny_pair(root)
    profile = root / "pair.toml"
    profile.write_text(f'[target]\nsource = "{root / "target"}"\n[draft]\nkind = "model"\nsource = "{root / "draft"}"\n')
    runner, draw, problems = CliRunner(), random.Random(args.seed), []
    for case in range(args.cases):
        controls = sum(draw.sample(CONTROLS, draw.choice([0, 1, 2])), [])
        n = draw.choice([1, 5, 17])
        flags = ["--raw", "-n", str(n), "-t", "0", "--json", "--logprobs", "2", "--seed", "3",
                 "--compile", draw.choice(["off", "auto"]), *controls, *draw.choice([[], ["--samples", "2"]])]
        prompt = draw.choice(PROMPTS)
        answers = {}
        for variant in VARIANTS:
            command = ["generate", prompt, "-p", str(profile), *flags, *variant]
            result = runner.invoke(app, command, input="")
            if result.exit_code != 0:
                problems.append((command, f"exit {result.exit_code}: {result.stderr.strip()[-300:]}"))
                continue
            records = [json.loads(line) for line in result.stdout.splitlines()]
            problems += [(command, found) for found in problems_of(records, n, controls)]
            answers[" ".join(variant)] = [(r["token_ids"], r["text"], r["finish_reason"]) for r in records]
        differ = [variant for variant, answer in answers.items() if answer != answers.get("-v ar")]
        problems += [(["generate", prompt, *flags, variant], "not ar's greedy answer") for variant in differ]
        print(case, repr(prompt), " ".join(flags), "differ: " + ", ".join(differ) if differ else "ok", flush=True)
    print(f"{len(problems)} problems")
    for command, found in problems:
        print(" ".join(command), "->", found)


if __name__ == "__main__":
    main()
