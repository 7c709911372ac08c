"""Where a decoding step's time goes, per variant: the two models' forward passes, the glue
around them (mask, tensors in, logits out), tree drafting draws, turning logits into
probabilities, verification, the bonus draw, KV-cache pruning, and the rest (tree building,
the engine's Python). Every part is timed by wrapping the function that does it; "other" is
the step's wall time minus the parts.

On a GPU the work runs after the calls return, so there every timed part synchronises the device
before and after (unless `--no-sync`): each part's time is then its own host work and GPU work,
and the step a little slower than unprofiled. The table also counts
the step's transfers to the host (`sampling.to_host`: on a GPU each one is a synchronisation).

Run on a quiet machine: .venv/bin/python benchmarks/profile_step.py [--depths 1,2] [--limit 2] [--compile auto]
On the GPU machine: source .device-stage/env.sh && python3 benchmarks/profile_step.py --compile on
Prints a table (ms per step and % of the step) and, with --json, the numbers.
"""

import argparse
import json
import time
from collections import defaultdict

import torch

from rsd_cli import compiled, drafting, engine, sampling as sampling_module, verification
from rsd_cli.bench import Setting
from rsd_cli.generation import complete
from rsd_cli.models import load_pair
from rsd_cli.profiles import load_profile
from rsd_cli.runtime import runtimes_of
from rsd_cli.prompting import builtin_prompts, encode_prompt
from rsd_cli.sampling import SamplingParams
from rsd_cli.tree import DraftTree

PARTS = ["target forward", "draft forward", "forward glue", "draws", "logits to probs", "verification",
         "bonus draw", "cache pruning", "other"]

spent: dict[str, float] = defaultdict(float)
in_step = False  # only time spent inside Decoder._step counts (not the prompt's prefill)
sync = lambda: None  # noqa: E731 - torch.cuda.synchronize on a GPU (unless --no-sync)


def timed(part: str, fn):
    def wrapper(*args, **kwargs):
        if in_step:
            sync()
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if in_step:
                sync()
                spent[part] += time.perf_counter() - start
    return wrapper


def counted(fn):
    def wrapper(*args, **kwargs):
        if in_step:
            spent["transfers"] += 1
        return fn(*args, **kwargs)
    return wrapper


def timed_step(fn):
    def wrapper(*args, **kwargs):
        global in_step
        sync()
        in_step = True
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sync()
            spent["step"] += time.perf_counter() - start
            spent["steps"] += 1
            in_step = False
    return wrapper


def instrument(pair, runtimes) -> None:
    """Wrap the leaves of a step (none of them calls another wrapped one, except the model
    forwards inside CachedLM.forward / StaticLM.forward, subtracted below as "forward glue")."""
    for role, model, runtime in (("target", pair.target, runtimes.target), ("draft", pair.draft, runtimes.draft)):
        if runtime is not None:
            runtime.forward = timed(f"{role} forward", runtime.forward)
        elif role == "target" or pair.draft is not pair.target:
            model.forward = timed(f"{role} forward", model.forward)
    for cache in (engine.CachedLM, compiled.StaticLM):
        cache.forward = timed("cached forward", cache.forward)
        cache.keep = timed("cache pruning", cache.keep)
    engine.logits_to_probs = timed("logits to probs", engine.logits_to_probs)
    engine.verify = timed("verification", engine.verify)  # includes a correction draw
    engine.sample = timed("bonus draw", engine.sample)
    # a plain step's draw (in device steps also each level's draft draw; where their maths is replayed
    # as a graph, a GPU's, only its capture calls these: the replays count as "other")
    engine.inverse_cdf = timed("bonus draw", engine.inverse_cdf)
    for name in ("gumbel_top_k_rows", "top_tokens_rows", "sample_with_replacement_rows", "sample_with_replacement",
                 "stochastic_beam_step"):
        setattr(drafting, name, timed("draws", getattr(drafting, name)))
    DraftTree.ancestry = timed("forward glue", DraftTree.ancestry)  # the verification mask
    for module in (sampling_module, verification, engine):  # every value moved to the host (each name bound)
        module.to_host = counted(module.to_host)
    engine.Decoder._step = timed_step(engine.Decoder._step)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", default="default")
    parser.add_argument("--variants", default="ar,sd,mss,rsd-c,rsd-s")
    parser.add_argument("--depths", default="1,2")
    parser.add_argument("--width", type=int, default=3, help="branching / beam width at the root")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--limit", type=int, default=2, help="how many built-in eval prompts")
    parser.add_argument("-n", "--max-tokens", type=int, default=48)
    parser.add_argument("--compile", default="auto", help="auto | on | off: the runtime (as rsd generate --compile)")
    parser.add_argument("--no-sync", action="store_true",
                        help="on a GPU, time the host alone (no synchronisation around the timed parts)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    global sync
    profile = load_profile(args.profile)
    pair = load_pair(profile)
    device = next(pair.target.parameters()).device
    synchronised = device.type == "cuda" and not args.no_sync
    if synchronised:
        sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
    runtimes = runtimes_of(pair, args.compile)
    instrument(pair, runtimes)
    prompts = [encode_prompt(pair.tokenizer, p) for p in builtin_prompts("eval")[: args.limit]]
    jobs = []
    for variant in args.variants.split(","):
        for depth in ([0] if variant == "ar" else [int(d) for d in args.depths.split(",")]):
            jobs.append((variant, depth, Setting(args.temperature, None, depth or None).shape(variant, args.width)))
    sampling = SamplingParams(args.temperature, profile["sampling"]["top_k"], profile["sampling"]["top_p"])

    def decoder(shape):
        made = engine.Decoder(pair.target, pair.draft, pair.vocab_size, shape, sampling, pair.eos_ids,
                              pair.context_length, runtimes)
        made.steps_ahead = False  # (its parts are timed inside Decoder._step, one step at a time)
        return made

    complete(decoder(jobs[-1][2]), prompts[0], 8, 0)  # warm-up: page faults, kernel set-up
    rows = []
    for variant, depth, shape in jobs:  # one job at a time: the wrappers' totals belong to it
        spent.clear()
        tokens = 0
        for index, ids in enumerate(prompts):
            tokens += sum(len(event.emitted) for event in decoder(shape).generate(ids, args.max_tokens, seed=index))
        wall, steps = spent["step"], int(spent["steps"])
        parts = {
            "target forward": spent["target forward"],
            "draft forward": spent["draft forward"],
            "forward glue": spent["cached forward"] - spent["target forward"] - spent["draft forward"]
            + spent["forward glue"],
            "draws": spent["draws"],
            "logits to probs": spent["logits to probs"],
            "verification": spent["verification"],
            "bonus draw": spent["bonus draw"],
            "cache pruning": spent["cache pruning"],
        }
        parts["other"] = wall - sum(parts.values())
        rows.append({"variant": variant, "shape": shape.describe(), "steps": steps, "tokens": tokens,
                     "transfers_per_step": spent["transfers"] / steps,
                     "step_ms": 1e3 * wall / steps, "ms_per_step": {k: 1e3 * v / steps for k, v in parts.items()},
                     "outside_forwards": 1 - (parts["target forward"] + parts["draft forward"]) / wall})

    if args.json:
        print(json.dumps({"temperature": args.temperature, "runtime": runtimes.describe(), "device": str(device),
                          "synchronised": synchronised,
                          "rows": rows}, indent=1))
        return
    header = f"{'variant':<18}{'step ms':>8}" + "".join(f"{p:>16}" for p in PARTS) + f"{'outside fwd':>13}{'to host':>9}"
    print(header)
    for row in rows:
        cells = "".join(f"{row['ms_per_step'][p]:>9.2f} {100 * row['ms_per_step'][p] / row['step_ms']:>4.1f}%"
                        for p in PARTS)
        print(f"{row['shape']:<18}{row['step_ms']:>8.1f}{cells}{100 * row['outside_forwards']:>12.1f}%"
              f"{row['transfers_per_step']:>9.1f}")


if __name__ == "__main__":
    main()
