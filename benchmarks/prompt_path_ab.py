"""Reading a prompt on the CPU: the C layers against torch's layer (each product by the kernel
small_batch measured fastest for prompts), interleaved in one process, for the embedded target
and its draft: seconds per P-token prompt, medians over rounds. Prints what this machine's
verdicts choose (`CompiledModel.prompts_in_c`) and how far the two paths' last logits are apart.
A third column times torch's layer with the prompt's attention masked (-inf added to the hidden
half of the scores, as before its attention was told it is causal: compiled.Sight). On a GPU
(no C layers there) torch's layer against the masked one only.

    .venv/bin/python benchmarks/prompt_path_ab.py [--prefixes 64,96,128,256,1000,2000] [--rounds 3]
On the GPU machine: source .device-stage/env.sh && python3 benchmarks/prompt_path_ab.py
"""

import argparse
import statistics
import time

import torch

from rsd_cli import compiled
from rsd_cli.compiled import CompiledModel, StaticLM
from rsd_cli.models import load_pair
from rsd_cli.profiles import load_profile

parser = argparse.ArgumentParser()
parser.add_argument("--profile", default="default")
parser.add_argument("--prefixes", default="64,96,128,256,1000,2000")
parser.add_argument("--rounds", type=int, default=3)
args = parser.parse_args()

profile = load_profile(args.profile)
profile.set("runtime", "compile", "off", "benchmark")
pair = load_pair(profile)
for role, model in (("target", pair.target), ("draft", pair.draft)):
    runtime = CompiledModel(model, compile=False)
    chosen, on_cpu = runtime.prompts_in_c, runtime.device.type == "cpu"
    where = ("in C" if chosen else "on torch’s layer") if on_cpu else f"on torch's layer ({runtime.device})"
    print(f"{role}: this machine's verdicts read prompts {where}", flush=True)
    for prefix in (int(p) for p in args.prefixes.split(",")):
        prompt = [100 + (i * 37) % 5000 for i in range(prefix)]
        paths = {"C": (True, compiled.lower_triangle), "torch": (False, compiled.lower_triangle),
                 "masked": (False, lambda n: torch.zeros(n, n, dtype=torch.bool))}  # (never causal)
        if not on_cpu:
            del paths["C"]
        times, last = {path: [] for path in paths}, {}
        for _ in range(args.rounds):
            for path, (in_c, causal_test) in paths.items():
                runtime.prompts_in_c, compiled.lower_triangle = in_c, causal_test
                cache = StaticLM(runtime, model.config.vocab_size, prefix + 1)
                start = time.perf_counter()
                logits = cache.extend(prompt)
                if not on_cpu:
                    torch.cuda.synchronize(runtime.device)
                times[path].append(time.perf_counter() - start)
                last[path] = torch.as_tensor(logits)[-1].float()
                cache.release()
        compiled.lower_triangle = paths["torch"][1]
        median = {path: statistics.median(seconds) for path, seconds in times.items()}
        t, m = median["torch"], median["masked"]
        against_c = ""
        if on_cpu:
            seen = last["C"].isfinite()  # (a draft's head may cover only the first ids: -inf past them)
            gap = (last["C"][seen] - last["torch"][seen]).abs().max().item()
            against_c = f"C {median['C']:.3f} s, "
        same = torch.equal(last["torch"], last["masked"])
        print(f"{role}, a {prefix}-token prompt: {against_c}torch's layer {t:.3f} s"
              + (f" (C / torch {median['C'] / t:.2f}x)" if on_cpu else "")
              + f", masked {m:.3f} s (torch / masked {t / m:.2f}x); "
              + (f"last logits within {gap:.1e}, " if on_cpu else "")
              + f"{'the same' if same else 'not the same'} masked", flush=True)
    runtime.prompts_in_c = chosen
