"""Would a lower-precision draft pay? The default draft's call cost (1 new token after a 150-token
cache, median of 30) and its expected acceptance on held-out answers at T=1, in float32, with its
adapter rounded to Q8_0 blocks (what loading does where rsd's kernel runs), with bfloat16 weights, and with torch's dynamic int8 quantisation of its linear layers (weights per
channel, activations per tensor at run time). Exactness never depends on the draft's precision;
only speed and acceptance do.

Run on a quiet machine: .venv/bin/python benchmarks/draft_precision.py [--tokens 2000]
"""

import argparse
import copy
import json
import time
import warnings

import torch

from rsd_cli import small_batch
from rsd_cli.blocks import round_to_q8_0
from rsd_cli.distill import Recipe, expected_acceptance, sample_answers
from rsd_cli.engine import CachedLM
from rsd_cli.models import early_exit_draft, embedded_adapter, load_adapter, load_pair
from rsd_cli.profiles import load_profile
from rsd_cli.prompting import builtin_prompts

parser = argparse.ArgumentParser()
parser.add_argument("--tokens", type=int, default=2000)
parser.add_argument("--seed", type=int, default=123)
args = parser.parse_args()
warnings.filterwarnings("ignore")  # torch.ao's deprecation notice

torch.manual_seed(args.seed)
profile = load_profile("default")
pair = load_pair(profile)
layers, vocab = profile["draft"]["layers"], profile["draft"]["vocab"]


def fresh_draft():
    """The default draft with its own copies of every module a variant may change."""
    draft = early_exit_draft(pair.target, layers, load_adapter(embedded_adapter(), pair.target, layers, vocab), vocab)
    draft.model.layers = torch.nn.ModuleList(copy.deepcopy(layer) for layer in draft.model.layers)
    draft.lm_head = copy.deepcopy(draft.lm_head)
    return draft


def int8(draft):
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
    from torch.ao.quantization import per_channel_dynamic_qconfig

    for module in [*draft.model.layers.modules(), draft]:
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                child.qconfig = per_channel_dynamic_qconfig
                setattr(module, name, DynamicLinear.from_float(child))
    return draft


def q8_0_adapter(draft):
    """The adapter rounded to Q8_0 blocks, as load_pair does where rsd's kernel runs it."""
    for module in (draft.model.layers[-1], draft.lm_head):
        for linear in module.modules():
            if isinstance(linear, torch.nn.Linear):
                with torch.no_grad():
                    linear.weight.copy_(round_to_q8_0(linear.weight))
    small_batch.install(draft)
    return draft


def bf16(draft):
    for module in [draft.model.layers, draft.lm_head]:
        module.to(torch.bfloat16)
    draft.model.norm = copy.deepcopy(draft.model.norm).to(torch.bfloat16)
    draft.model.embed_tokens = copy.deepcopy(draft.model.embed_tokens).to(torch.bfloat16)
    return draft


def call_ms(draft, repeats: int = 30) -> float:
    lm = CachedLM(draft, pair.vocab_size)
    lm.extend(torch.randint(0, vocab or pair.vocab_size, (150,)).tolist())
    times = []
    for _ in range(repeats):
        past = lm.length
        start = time.perf_counter()
        lm.forward([5], [past], torch.ones(1, past + 1, dtype=torch.bool))
        times.append(time.perf_counter() - start)
        lm.cache.crop(-1)
    return sorted(times)[len(times) // 2] * 1e3


answers = sample_answers(pair.target, pair.tokenizer, builtin_prompts("eval"), args.tokens, Recipe(seed=args.seed),
                         "eval", lambda *a: None)
rows = []
for name, make in (("float32", fresh_draft), ("q8_0 adapter", lambda: q8_0_adapter(fresh_draft())),
                   ("bfloat16", lambda: bf16(fresh_draft())),
                   ("int8 dynamic", lambda: int8(fresh_draft()))):
    draft = make()
    rows.append({"draft": name, "call_ms": call_ms(draft),
                 "expected_acceptance": expected_acceptance(pair.target, draft, answers)})
    print(f"{name:>13}: {rows[-1]['call_ms']:.2f} ms a call, expected acceptance {rows[-1]['expected_acceptance']:.3f}",
          flush=True)
print(json.dumps({"positions": sum(len(s.ids) - s.answer_start for s in answers), "rows": rows}))
