"""How long `rsd chat` takes to read each turn's prompt (the whole conversation so far), with the
last answer's KV caches kept (as chat does) and without (every turn read from the start).

Run on a quiet machine: .venv/bin/python benchmarks/chat_turns.py [--profile default] [-n 96]
Prints, per turn and per mode, how many prompt tokens the target read and how long that took.
"""

import argparse
import io
import time

from rich.console import Console

from rsd_cli.chat import ChatSession
from rsd_cli.engine import ChainExtension
from rsd_cli.models import load_pair
from rsd_cli.profiles import load_profile
from rsd_cli.runtime import apply_flags

MESSAGES = ["Tell me about the moon.", "Why does it have phases?", "And eclipses?", "How far away is it?",
            "Summarise all that in one line."]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", default="default")
    parser.add_argument("-n", "--max-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.7)
    args = parser.parse_args()
    profile = apply_flags(load_profile(args.profile), {"max_tokens": args.max_tokens, "temperature": args.temperature})
    pair = load_pair(profile)
    reads: list[tuple[int, float]] = []
    real = ChainExtension.extend

    def timed(self, tokens, *rest, **named):  # the first extend of an answer is its prompt's prefill
        start = time.perf_counter()
        out = real(self, tokens, *rest, **named)
        reads.append((len(tokens), time.perf_counter() - start))
        return out

    ChainExtension.extend = timed
    for keep in (False, True):
        session = ChatSession(pair, profile)
        session.answer("Hi", io.StringIO(), Console(file=io.StringIO()))  # (costs measured, kernels set up)
        session.history.clear()
        session.kept = None
        for turn, message in enumerate(MESSAGES, start=1):
            if not keep:
                session.kept = None
            reads.clear()
            session.answer(message, io.StringIO(), Console(file=io.StringIO()))
            tokens, seconds = reads[0] if reads else (0, 0.0)
            print(f"{'kept' if keep else 'fresh'} turn {turn}: read {tokens:4} prompt tokens in {1e3 * seconds:6.1f} ms")


if __name__ == "__main__":
    main()
