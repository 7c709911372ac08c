"""Held-out expected acceptance of draft designs rsd does not ship, trained on the same data as
the shipped adapter, to see whether another design gets near the 0.7 goal:

  eagle   an EAGLE-style head: one decoder layer fed [embedding of token t, the target's last
          hidden state at t-1] (projected), then a norm and the 8192-row head; the target's top
          features carry the context, so it needs no frozen layers
  hybrid  the shipped draft (3 frozen layers + the adapter) with the target's last hidden state
          at t-1 added to the adapter's input through a zero-initialised projection
  tv      the shipped draft fine-tuned to minimise 1 - sum_x min(p, q) (what acceptance is)
          instead of KL

Needs the sampled data of an earlier shipped adapter (80k answer tokens to the built-in
prompts; the table row "80k tokens" in docs/distill.md): run once (it caches the data)
  rsd distill --profile default --out /tmp/80k.safetensors --vocab 8192 --tokens 80000 --epochs 1
then
  .venv/bin/python benchmarks/other_drafts.py eagle --epochs 4 --lr 2e-3
  .venv/bin/python benchmarks/other_drafts.py hybrid --epochs 3 --lr 1e-3
  .venv/bin/python benchmarks/other_drafts.py tv --epochs 2 --lr 3e-4
Prints the held-out acceptance (T = 1, the evaluation `rsd distill` prints) after each epoch.
"""

import argparse
import copy
import random

import torch

from rsd_cli.distill import Recipe, hidden_entering, learning_rate_factor, soft_cross_entropy
from rsd_cli.engine import full_vocabulary
from distill_data import target_and_data
from rsd_cli.models import early_exit_draft, embedded_adapter, load_adapter
from rsd_cli.prompting import builtin_prompts

VOCAB, LAYERS = 8192, 3


class FeatureDraft(torch.nn.Module):
    """One decoder layer over inputs built from token embeddings and/or frozen-layer states plus
    a projection of the target's last hidden state one position back; norm; reduced head."""

    def __init__(self, target, design: str):
        super().__init__()
        self.target, self.design = target, design
        inner, d = target.model, target.config.hidden_size
        if design == "eagle":
            self.project = torch.nn.Linear(2 * d, d)
            with torch.no_grad():  # start as embedding + feature
                self.project.weight.copy_(torch.cat([torch.eye(d), torch.eye(d)], 1))
                self.project.bias.zero_()
            self.layer = copy.deepcopy(inner.layers[-1])
            self.norm, self.head = copy.deepcopy(inner.norm), target.lm_head.weight[:VOCAB]
        else:
            self.project = torch.nn.Linear(d, d, bias=False)
            torch.nn.init.zeros_(self.project.weight)  # starts as the shipped draft exactly
            self.project.requires_grad_(design == "hybrid")
            shipped = load_adapter(embedded_adapter(), target, LAYERS, VOCAB)
            self.layer = shipped["layer"]
            self.norm = copy.deepcopy(shipped["norm"] if "norm" in shipped else inner.norm)
            self.head = (shipped["head"] if "head" in shipped else target.lm_head).weight[:VOCAB]
        self.layer.requires_grad_(True)

    def forward(self, seq) -> torch.Tensor:
        """(len - 1, VOCAB) logits; row i predicts token i + 1."""
        inner = self.target.model
        before = torch.cat([torch.zeros_like(seq.features[:1]), seq.features[:-1]])  # feature at t-1
        if self.design == "eagle":
            x = self.project(torch.cat([inner.embed_tokens(torch.tensor(seq.ids)), before], -1))
        else:
            x = seq.hidden + self.project(before)
        x = x[None]
        positions = torch.arange(x.shape[1])[None]
        mask = torch.full((x.shape[1],) * 2, torch.finfo(x.dtype).min).triu(1)[None, None]
        h = self.layer(x, attention_mask=mask, position_ids=positions,
                       position_embeddings=inner.rotary_emb(x, positions))
        h = h[0] if isinstance(h, tuple) else h
        return (self.norm(h[0]) @ self.head.T)[:-1]


def acceptance(target, draft, sequences) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for seq in sequences:
            a = seq.answer_start
            p = target(torch.tensor([seq.ids])).logits[0, a - 1 : -1].float().softmax(-1)
            q = full_vocabulary(draft(seq)[a - 1 :], p.shape[-1]).softmax(-1)
            total += float(torch.minimum(p, q).sum())
            count += p.shape[0]
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("design", choices=["eagle", "hybrid", "tv"])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--limit", type=int, default=0, help="train on the first N sequences only (a quick look)")
    args = parser.parse_args()
    torch.manual_seed(0)

    target, train, held_out = target_and_data(builtin_prompts("train"), Recipe(tokens=80_000, batch_size=32),
                                              args.limit)
    prefix = early_exit_draft(target, LAYERS, None, VOCAB)
    for seq in train + held_out:  # the target's last hidden states, and the states entering layer 3
        with torch.no_grad():
            seq.features = target.model(torch.tensor([seq.ids]), use_cache=False).last_hidden_state[0]
        seq.hidden = hidden_entering(prefix, seq.ids)

    draft = FeatureDraft(target, args.design)
    print(f"{args.design}: held-out acceptance before training {acceptance(target, draft, held_out):.3f}", flush=True)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimiser = torch.optim.AdamW(params, lr=args.lr)
    steps = args.epochs * len(train)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimiser, lambda s: learning_rate_factor("cosine", s, steps))
    order, shuffler = list(range(len(train))), random.Random(0)
    for epoch in range(args.epochs):
        shuffler.shuffle(order)
        for index in order:
            seq = train[index]
            logits = draft(seq)[seq.answer_start - 1 :]
            if args.design == "tv":  # 1 - sum over the teacher's top-k of min(p, q)
                q = logits.softmax(-1).gather(-1, seq.top_ids.clamp(max=VOCAB - 1))
                loss = 1 - torch.minimum(seq.top_probs.float() * (seq.top_ids < VOCAB), q).sum(-1).mean()
            else:
                loss = soft_cross_entropy(logits, seq.top_probs, seq.top_ids)
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            scheduler.step()
        print(f"epoch {epoch + 1}: held-out acceptance {acceptance(target, draft, held_out):.3f}", flush=True)


if __name__ == "__main__":
    main()
