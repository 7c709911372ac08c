"""A long prompt read on the static-cache runtime in one forward against in pieces (StaticLM.extend,
compiled.PROMPT_MASK_SCORES): the process's peak resident memory, the time to read it, and how far the
last row's logits of the two differ. Each (mode, length) runs in a process of its own (peak memory is a
process's), the embedded target alone on the CPU, uncompiled (`--compile auto`'s choice there); its
context is 8192 tokens. `--long`: instead a random Llama of 32768 tokens' context (4 layers, hidden
256, 4 heads, 2 key heads, float32), for prompts longer than the embedded model takes.

    .venv/bin/python benchmarks/prompt_pieces.py [--lengths 2000,4000,8000]
    .venv/bin/python benchmarks/prompt_pieces.py --long --lengths 8000,16000,32000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def long_llama(folder: Path) -> Path:
    """A random Llama of 32768 tokens' context saved in folder (with the embedded model's tokenizer)."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rsd_cli.models import resolve_source

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
                                 tie_word_embeddings=True)).save_pretrained(folder)
    embedded = Path(resolve_source("embedded")[0])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded / name, folder / name)
    return folder


def child(mode: str, length: int, out: Path, source: str) -> None:
    import resource
    import time

    import torch

    from rsd_cli import compiled
    from rsd_cli.compiled import CompiledModel, StaticLM
    from rsd_cli.models import load_model
    from rsd_cli.prompting import builtin_prompts

    if mode == "whole":
        compiled.PROMPT_MASK_SCORES = 10 ** 12
    model, tokenizer = load_model(source, torch.device("cpu"), torch.float32)
    ids = tokenizer(" ".join(builtin_prompts("eval")))["input_ids"]
    ids = (ids * (length // len(ids) + 1))[:length]
    runtime = CompiledModel(model, compile=False)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.inference_mode():
        StaticLM(runtime, model.config.vocab_size, capacity=64).extend(ids[:32], reading=True)  # (kernels set up)
        lm = StaticLM(runtime, model.config.vocab_size, capacity=length + 8)
        start = time.perf_counter()
        logits = lm.extend(ids, reading=True)
        seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch.save(logits.cpu(), out / f"{mode}-{length}.pt")
    print(json.dumps({"mode": mode, "length": length, "seconds": seconds, "forwards": lm.calls,
                      "peak_mb": peak / 1024, "growth_mb": (peak - before) / 1024}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="2000,4000,8000")
    parser.add_argument("--long", action="store_true")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, length, out, source = args.child
        child(mode, int(length), Path(out), source)
        return
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        source = str(long_llama(Path(tmp) / "long")) if args.long else "embedded"
        for length in (int(n) for n in args.lengths.split(",")):
            records = {}
            for mode in ("whole", "pieces"):
                result = subprocess.run([sys.executable, __file__, "--child", mode, str(length), tmp, source],
                                        capture_output=True, text=True, check=True)
                records[mode] = json.loads(result.stdout.strip().splitlines()[-1])
            difference = (torch.load(Path(tmp) / f"whole-{length}.pt")
                          - torch.load(Path(tmp) / f"pieces-{length}.pt")).abs().max().item()
            whole, pieces = records["whole"], records["pieces"]
            print(f"{length} tokens: one forward {whole['seconds']:.2f} s, peak {whole['peak_mb']:.0f} MB "
                  f"(+{whole['growth_mb']:.0f} reading); {pieces['forwards']} pieces {pieces['seconds']:.2f} s, "
                  f"peak {pieces['peak_mb']:.0f} MB (+{pieces['growth_mb']:.0f}); last row's logits {difference:.1e} apart")


if __name__ == "__main__":
    main()
