"""A step's maths replayed as CUDA graphs (`StepGraphs`) against launched op by op, per shape.

On a GPU (`--compile on`): tokens/s of `ar` and of each device-step shape with the maths graphed
and not (× ar: against `ar` with its maths launched op by op), and of `ar`, `sd` chains and
`rsd-c` fans with each step queued before the last one's outcome is read (the "ahead" rows: what
`rsd` runs on a GPU by default), interleaved in rounds on the same prompts and seeds (each
decoder warmed up untimed, so captures are not timed). On any machine, `--count`: the torch
operations a step issues outside the two models' forwards (each one Python and dispatcher work
on the host; on a GPU most launch a kernel) and its transfers to the host (on a GPU each one a
synchronisation), with the maths run directly and replayed through a stand-in capture that keeps
a CUDA graph's semantics: what the graphs take off the host, whatever the device; lookup chains
on the host path too.

Run: .venv/bin/python benchmarks/step_graphs_ab.py --count
On the GPU machine: source .device-stage/env.sh && python3 benchmarks/step_graphs_ab.py --compile on
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rsd_cli import compiled, engine, sampling, verification
from rsd_cli.drafting import make_shape
from rsd_cli.engine import Decoder, Runtimes, synchronise
from rsd_cli.models import load_pair
from rsd_cli.profiles import load_profile
from rsd_cli.prompting import builtin_prompts, encode_prompt, read_prompt_file
from rsd_cli.runtime import runtimes_of
from rsd_cli.sampling import SamplingParams
from rsd_cli.step_graphs import StepGraphs

# wide fans too (a root and 7 or 15 children fill a forward of 8 or 16 tokens): where verifying 16 tokens
# costs about what one does, a root's children drawn without replacement are accepted at T=1 with
# probability 0.41 (1 child), 0.55 (3), 0.65 (8), 0.71 (16) (acceptance_limits.py --children)
SHAPES = {"ar": make_shape("ar"), "sd γ=1": make_shape("sd", draft_len=1), "sd γ=2": make_shape("sd", draft_len=2),
          "rsd-c b=(2)": make_shape("rsd-c", branching=(2,)), "rsd-c b=(3)": make_shape("rsd-c", branching=(3,)),
          "rsd-c b=(7)": make_shape("rsd-c", branching=(7,)), "rsd-c b=(15)": make_shape("rsd-c", branching=(15,)),
          "auto": make_shape("auto"),  # (timed with its maths graphed only: its memory is shared by decoders)
          # each step queued before the last one's outcome is read (Decoder._plain_steps_ahead, _tree_steps_ahead:
          # what a GPU runs by default), graphed only
          "ar ahead": make_shape("ar"), "auto ahead": make_shape("auto"), "sd γ=1 ahead": make_shape("sd", draft_len=1),
          "sd γ=2 ahead": make_shape("sd", draft_len=2),
          "rsd-c b=(3) ahead": make_shape("rsd-c", branching=(3,)),
          "rsd-c b=(7) ahead": make_shape("rsd-c", branching=(7,)),
          "rsd-c b=(15) ahead": make_shape("rsd-c", branching=(15,)),
          # lookup chains (no draft model) on a prompt whose answer repeats it; `--count` only, with a row of
          # the host path (one transfer per tried node) beside the device steps' (one a step)
          "lookup γ=4": make_shape("lookup", draft_len=4), "lookup γ=7": make_shape("lookup", draft_len=7)}
LOOKUP_PROMPT = "benchmarks/grounded-prompts.txt"  # (its first: correct the spelling of a text)
ONE_ROW = {name for name in SHAPES if name == "auto" or name.endswith("ahead")}
VIEWS = {"slice", "select", "unsqueeze", "squeeze", "alias", "detach", "detach_", "view", "t", "expand",
         "as_strided", "lift_fresh"}  # no kernel: a view, or a host literal made a tensor


class Counting(TorchDispatchMode):
    """Counts the operations dispatched outside the models' forwards and the graphs' replays."""

    def __init__(self):
        super().__init__()
        self.ops, self.views, self.replays, self.muted = 0, 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.muted:
            if str(func.overloadpacket).split(".")[-1] in VIEWS:
                self.views += 1
            else:
                self.ops += 1
        return func(*args, **(kwargs or {}))

    def mute(self, fn):
        def muted(*args, **kwargs):
            self.muted += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.muted -= 1
        return muted

    def capture(self, run):
        """A stand-in for a CUDA capture: fixed output buffers, each replay one counted launch."""
        outputs = self.mute(run)()

        def replay():
            self.replays += 1
            for buffer, value in zip(outputs, self.mute(run)()):
                self.mute(buffer.copy_)(value)

        return replay, outputs


def decoder_for(pair, runtimes, shape, temperature, graphs, ahead=False, device_steps=True):
    decoder = Decoder(pair.target, pair.draft, pair.vocab_size, shape, SamplingParams(temperature), pair.eos_ids,
                      pair.context_length, runtimes)
    decoder.device_steps = device_steps
    decoder.steps_ahead = ahead  # (the "ahead" rows only)
    decoder.step_graphs = graphs
    return decoder


def count(pair, args) -> list[dict]:
    """Operations a step (after the first) outside the forwards, maths direct vs replayed."""
    runtimes = Runtimes(compiled.CompiledModel(pair.target, False, static_shapes=True),
                        compiled.CompiledModel(pair.draft, False, static_shapes=True))
    prompts = {False: encode_prompt(pair.tokenizer, builtin_prompts("eval")[0]),
               True: encode_prompt(pair.tokenizer, read_prompt_file(Path(LOOKUP_PROMPT))[0])}
    counting = Counting()
    compiled.CompiledModel.forward = counting.mute(compiled.CompiledModel.forward)
    transfers = [0]
    # each read of device values on the host (on a GPU a synchronisation; to_host_soon's read calls to_host too)
    for module in (engine, sampling, verification):
        module.to_host = (lambda real: lambda tensor: transfers.__setitem__(0, transfers[0] + 1) or real(tensor))(
            module.to_host)
    rows = []
    for name, shape in SHAPES.items():
        if name.startswith("auto"):  # (its steps are the other shapes')
            continue
        lookup = shape.variant == "lookup"
        for maths in ("host", "direct", "graphs") if lookup else ("direct", "graphs"):
            graphs = StepGraphs(torch.device("cpu"), True, capture=counting.capture) if maths == "graphs" else None
            decoder = decoder_for(pair, runtimes, shape, args.temperature, graphs, name.endswith("ahead"),
                                  device_steps=maths != "host")
            list(decoder.generate(prompts[lookup], 8, seed=0))  # (captures made here)

            def now() -> list[int]:
                return [counting.ops, counting.views, counting.replays, transfers[0]]

            kinds = {True: [0, 0, 0, 0, 0], False: [0, 0, 0, 0, 0]}  # drafted? -> ops, views, replays, transfers, steps
            with counting:
                last = now()
                for event in decoder.generate(prompts[lookup], args.max_tokens, seed=1):
                    if event.step > 1:  # (the prompt's step left out)
                        totals = kinds[len(event.tree) > 1]
                        for index, (after, before) in enumerate(zip(now(), last)):
                            totals[index] += after - before
                        totals[4] += 1
                    last = now()
            for drafted, (ops, views, replays, moved, steps) in kinds.items():
                if not steps:
                    continue
                rows.append({"shape": name, "maths": maths, "steps": "drafting" if drafted else "plain",
                             "ops": ops / steps, "views": views / steps, "replays": replays / steps,
                             "transfers": moved / steps, "count": steps})
                print(f"{name:12s} {maths:7s} {rows[-1]['ops']:6.1f} ops, {rows[-1]['views']:5.1f} views "
                      f"and host literals, {rows[-1]['replays']:.1f} graph replays, {rows[-1]['transfers']:.1f} "
                      f"transfers a {rows[-1]['steps']} step (outside the forwards; {steps} steps)", flush=True)
    return rows


def timing(pair, args) -> list[dict]:
    """tokens/s per shape, maths graphed vs direct, interleaved rounds."""
    runtimes = runtimes_of(pair, args.compile)
    device = next(pair.target.parameters()).device
    prompts = [encode_prompt(pair.tokenizer, p) for p in builtin_prompts("eval")[: args.limit]]
    jobs = [(name, graphed) for name in SHAPES if not name.startswith("lookup")  # (--count only)
            for graphed in ((True,) if name in ONE_ROW else (False, True))]
    decoders = {}
    for name, graphed in jobs:
        graphs = StepGraphs(device, graphed and device.type == "cuda")
        decoders[name, graphed] = decoder_for(pair, runtimes, SHAPES[name], args.temperature, graphs,
                                              name.endswith("ahead"))
        for seed, ids in enumerate(prompts[:2]):  # untimed: captures, compiles, buffers at the timed size
            list(decoders[name, graphed].generate(ids, args.max_tokens, seed=seed))
    rates: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        for job in jobs:
            tokens = 0
            synchronise(device)
            start = time.perf_counter()
            for seed, ids in enumerate(prompts):
                tokens += sum(len(e.emitted) for e in decoders[job].generate(ids, args.max_tokens, seed=seed))
            synchronise(device)
            rates.setdefault(job, []).append(tokens / (time.perf_counter() - start))
    ar = statistics.median(rates["ar", False])
    rows = []
    for (name, graphed), values in rates.items():
        rate = statistics.median(values)
        rows.append({"shape": name, "maths": "graphs" if graphed else "direct", "tok_s": rate, "x_ar": rate / ar,
                     "rounds": values})
        print(f"{name:12s} {rows[-1]['maths']:7s} {rate:7.1f} tok/s  {rate / ar:.2f}x ar", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", default="default")
    parser.add_argument("--compile", default="on")
    parser.add_argument("--count", action="store_true", help="count the host's operations a step instead")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--limit", type=int, default=2)
    parser.add_argument("-n", "--max-tokens", type=int, default=64)
    parser.add_argument("--json")
    args = parser.parse_args()
    pair = load_pair(load_profile(args.profile))
    rows = count(pair, args) if args.count else timing(pair, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(next(pair.target.parameters()).device), "args": vars(args), "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
