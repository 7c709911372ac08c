"""Pairs the tests' tiny models of every kind (tests/tiny.py) make beyond a model and its own kind's
draft: `--mixed`, each kind as the draft of a tiny Llama target and as the target of a tiny Llama
draft; `--short-drafts`, each kind's draft with a context of 16 positions under a target of its kind
with 256, the prompt (23 tokens) past the draft's context from the start. Every variant the pair
takes, on transformers' forward and (where it takes both models) rsd's static-cache runtime: greedy,
the same tokens as `ar`; at T = 1 (--mixed) an answer without an error. The short drafts found
GPT-Neo's attention refusing more keys than its context on transformers' forward (a draft's tables
of slots now grow: engine.slot_tables_cover).

    .venv/bin/python benchmarks/pair_sweep.py --mixed|--short-drafts [--kinds llama,gpt2,...]

Prints a line per kind and role (the runtimes, the runs, the problems found); --mixed about a
minute for every kind on a 2-core AMD EPYC, --short-drafts 20 seconds.
"""

import argparse
import warnings

import torch

from context_end_sweep import KINDS, SHAPES, V, build  # (the same kinds, makers and variants)
from rsd_cli import compiled
from rsd_cli.compiled import CompiledModel
from rsd_cli.engine import Decoder, Runtimes
from rsd_cli.sampling import SamplingParams

PROMPT = [3 + (i * 7) % (V - 3) for i in range(20)] + [3, 10, 17]  # (its last three tokens occurred: lookup drafts)


def short_draft(kind: str):
    """The kind's 1-layer draft with a context of 16 positions (None where its config names none)."""
    made = build(kind, 1, 1)
    name = next((a for a in ("max_position_embeddings", "n_positions", "max_seq_len") if hasattr(made.config, a)), None)
    if name is None:
        return None
    setattr(made.config, name, 16)
    torch.manual_seed(1)
    return type(made)(made.config).eval()


def problems_of(target, draft, context: int, temperatures, prompt) -> tuple[list[str], int, list[str]]:
    """(problems, runs, runtimes) of every variant the pair takes at these temperatures."""
    runtimes = {"transformers": None}
    if compiled.unsupported(target) is None and compiled.unsupported(draft) is None:
        runtimes["static"] = Runtimes(CompiledModel(target, False), CompiledModel(draft, False), "auto")
    problems, runs, greedy = [], 0, None
    for name, runtime in runtimes.items():
        for temperature in temperatures:
            for shape in SHAPES:
                decoder = Decoder(target, draft, V, shape, SamplingParams(temperature), {2}, context, runtime)
                if not decoder.takes(shape.variant):
                    continue
                try:
                    answer = [t for e in decoder.generate(prompt, 12, seed=0) for t in e.emitted]
                    runs += 1
                except Exception as error:
                    problems.append(f"{name} T={temperature} {shape.describe()}: {type(error).__name__}: "
                                    f"{str(error)[:140]}")
                    continue
                if temperature == 0:
                    greedy = answer if greedy is None else greedy
                    if answer != greedy:
                        problems.append(f"{name} {shape.describe()}: {answer}, ar's {greedy}")
    return problems, runs, list(runtimes)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--mixed", action="store_true", help="each kind with a tiny Llama, as its draft and target")
    mode.add_argument("--short-drafts", action="store_true", help="each kind's draft with a shorter context")
    parser.add_argument("--kinds", default=KINDS)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    for kind in args.kinds.split(","):
        if args.short_drafts:
            draft = short_draft(kind)
            pairs = [] if draft is None else [("short draft", build(kind, 0, 2), draft, (0.0,), PROMPT[:24])]
        else:
            pairs = [("draft", build("llama", 5, 2), build(kind, 1, 1), (0.0, 1.0), PROMPT),
                     ("target", build(kind, 0, 2), build("llama", 5, 1), (0.0, 1.0), PROMPT)]
        if not pairs:
            print(f"{kind}: no context in its config, left out", flush=True)
        for role, target, draft, temperatures, prompt in pairs:
            context = min(getattr(target.config, "max_position_embeddings", None) or 256, 256)
            found, runs, runtimes = problems_of(target, draft, context, temperatures, prompt)
            print(f"{kind} as {role}: {' and '.join(runtimes)}, {runs} runs, {len(found)} problems", flush=True)
            for problem in found:
                print(f"  {problem}")
