"""Would training the draft's own copies of the target's first K layers pay? The shipped recipe
(adapter layer + own final norm and 8192-row head, KL to the target's top-128, cosine lr 2e-3,
5 epochs) with the draft's first 3 layers as trainable copies (lr 3e-4) instead of shared frozen
ones: 42 MB more memory and no precomputed hidden states, so about twice the training time.

Needs the sampled data of the `rsd distill` command for the shipped adapter (docs/distill.md; run
it once, it caches the data), then:
  .venv/bin/python benchmarks/train_first_layers.py [--epochs 5] [--layers-lr 3e-4] [--limit N]
Prints the held-out acceptance (T = 1, the evaluation `rsd distill` prints) after each epoch.
Measured on a 2-core Intel Xeon with the same recipe (an earlier, untidied form of this script):
0.353, 0.382, 0.409, 0.425, 0.428 (the shipped recipe: 0.414).
"""

import argparse
import copy
import random
import time
from pathlib import Path

import torch

from distill_data import target_and_data
from rsd_cli.distill import Recipe, expected_acceptance, learning_rate_factor, soft_cross_entropy
from rsd_cli.distill_command import _read_prompts
from rsd_cli.models import early_exit_draft, new_adapter

LAYERS, VOCAB = 3, 8192
RECIPE = Recipe(layers=LAYERS, vocab=VOCAB, tokens=240_000, batch_size=32, lr=2e-3, train_head=True)
PROMPTS = Path(__file__).parent / "distill-prompts.txt"

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--layers-lr", type=float, default=3e-4)
parser.add_argument("--limit", type=int, default=0, help="train on the first N sequences only (a quick look)")
args = parser.parse_args()
torch.manual_seed(0)

target, train, held_out = target_and_data(_read_prompts(PROMPTS), RECIPE, args.limit)

adapter = new_adapter(target, LAYERS, VOCAB)
draft = early_exit_draft(target, LAYERS, adapter, VOCAB)
first = [copy.deepcopy(layer) for layer in target.model.layers[:LAYERS]]  # the draft's own copies
draft.model.layers = torch.nn.ModuleList(first + [adapter["layer"]])
own_layers = [p for layer in first for p in layer.parameters()]
for p in [*adapter.parameters(), *own_layers]:
    p.requires_grad_(True)

steps = args.epochs * len(train)
optimiser = torch.optim.AdamW([{"params": list(adapter.parameters()), "lr": RECIPE.lr},
                               {"params": own_layers, "lr": args.layers_lr}])
scheduler = torch.optim.lr_scheduler.LambdaLR(optimiser, lambda step: learning_rate_factor("cosine", step, steps))
order, shuffler, start = list(range(len(train))), random.Random(0), time.time()
for epoch in range(args.epochs):
    draft.train()
    shuffler.shuffle(order)
    for index in order:
        seq = train[index]
        logits = draft(torch.tensor([seq.ids]), use_cache=False).logits[0, seq.answer_start - 1 : -1]
        loss = soft_cross_entropy(logits, seq.top_probs, seq.top_ids)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        scheduler.step()
    draft.eval()
    print(f"epoch {epoch + 1}: held-out acceptance {expected_acceptance(target, draft, held_out):.3f} "
          f"({time.time() - start:.0f} s)", flush=True)
