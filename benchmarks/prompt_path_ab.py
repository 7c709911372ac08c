"""Reading a prompt on the CPU: the C layers against torch's layer (each product by the kernel
small_batch measured fastest for prompts), interleaved in one process, for the embedded target
and its draft: seconds per P-token prompt, medians over rounds. Prints what this machine's
verdicts choose (`CompiledModel.prompts_in_c`) and how far the two paths' last logits are apart.
A third column times torch's layer with the prompt's attention masked (-inf added to the hidden
half of the scores, as before its attention was told it is causal: compiled.decoder_layer).

    .venv/bin/python benchmarks/prompt_path_ab.py [--prefixes 64,96,128,256,1000,2000] [--rounds 3]
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
    chosen = runtime.prompts_in_c
    print(f"{role}: this machine's verdicts read prompts {'in C' if chosen else 'on torch’s layer'}", flush=True)
    for prefix in (int(p) for p in args.prefixes.split(",")):
        prompt = [100 + (i * 37) % 5000 for i in range(prefix)]
        paths = {"C": (True, compiled.lower_triangle), "torch": (False, compiled.lower_triangle),
                 "masked": (False, lambda n: torch.zeros(n, n, dtype=torch.bool))}  # (never causal)
        times, last = {path: [] for path in paths}, {}
        for _ in range(args.rounds):
            for path, (in_c, causal_test) in paths.items():
                runtime.prompts_in_c, compiled.lower_triangle = in_c, causal_test
                cache = StaticLM(runtime, model.config.vocab_size, prefix + 1)
                start = time.perf_counter()
                logits = cache.extend(prompt)
                times[path].append(time.perf_counter() - start)
                last[path] = torch.as_tensor(logits)[-1].float()
                cache.release()
        compiled.lower_triangle = paths["C"][1]
        c, t, m = (statistics.median(times[path]) for path in paths)
        seen = last["C"].isfinite()  # (a draft's head may cover only the first ids: -inf past them)
        gap = (last["C"][seen] - last["torch"][seen]).abs().max().item()
        same = torch.equal(last["torch"], last["masked"])
        print(f"{role}, a {prefix}-token prompt: C {c:.3f} s, torch's layer {t:.3f} s (C / torch {c / t:.2f}x), "
              f"masked {m:.3f} s (torch / masked {t / m:.2f}x); last logits within {gap:.1e}, "
              f"{'the same' if same else 'not the same'} masked", flush=True)
    runtime.prompts_in_c = chosen
