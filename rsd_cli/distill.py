"""`rsd distill`: train an adapter layer so the target's first K layers become a good draft.

Recipe: the target's own sampled answers to varied prompts (chat template applied) are the
data; the draft is layers [0, K) + one adapter layer (initialised from layer K) + the target's
final norm and head; only the adapter trains, minimising KL(p_target || q_draft) with the
target's top-k probabilities as soft labels.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

import torch

from .engine import full_vocabulary
from .models import early_exit_draft, new_adapter_layer
from .prompting import encode_prompt

# progress(phase, done, total)
Progress = Callable[[str, int, int], None]


@dataclass
class Recipe:
    layers: int = 3
    tokens: int = 20_000  # training tokens (answers only)
    eval_tokens: int = 2_000
    max_new_tokens: int = 160
    batch_size: int = 8  # sequences generated together
    epochs: int = 4
    lr: float = 3e-4
    teacher_top_k: int = 128
    seed: int = 0


@dataclass
class Sequence:
    ids: list[int]
    answer_start: int  # first answer position
    top_probs: torch.Tensor | None = None  # (answer_len, k) teacher probabilities, float16
    top_ids: torch.Tensor | None = None  # (answer_len, k)


@dataclass
class DistillResult:
    layer: torch.nn.Module
    losses: list[float] = field(default_factory=list)  # mean loss per epoch
    acceptance_before: float = 0.0
    acceptance_after: float = 0.0
    train_tokens: int = 0
    eval_tokens: int = 0


def sample_answers(target, tokenizer, prompts: list[str], budget: int, recipe: Recipe, phase: str,
                   progress: Progress) -> list[Sequence]:
    """The target's sampled answers (T = 1, no truncation) until `budget` answer tokens."""
    generator = random.Random(recipe.seed + len(phase))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    out: list[Sequence] = []
    total = 0
    progress(phase, 0, budget)
    while total < budget:
        batch = [generator.choice(prompts) for _ in range(recipe.batch_size)]
        encoded = [encode_prompt(tokenizer, p) for p in batch]
        width = max(map(len, encoded))
        ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded])
        mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
        with torch.inference_mode():
            generated = target.generate(
                input_ids=ids.to(target.device), attention_mask=mask.to(target.device), do_sample=True,
                temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=recipe.max_new_tokens,
                pad_token_id=pad, eos_token_id=eos,
            )
        for prompt_ids, row in zip(encoded, generated[:, width:].tolist()):
            answer = row[: row.index(eos) + 1] if eos in row else row
            if answer:
                out.append(Sequence(prompt_ids + answer, len(prompt_ids)))
                total += len(answer)
        progress(phase, min(total, budget), budget)
    return out


def teacher_labels(target, sequences: list[Sequence], top_k: int) -> None:
    """Store the target's top-k next-token probabilities at every answer position."""
    for seq in sequences:
        with torch.inference_mode():
            logits = target(torch.tensor([seq.ids], device=target.device)).logits[0].float()
        probs = logits[seq.answer_start - 1 : len(seq.ids) - 1].softmax(-1)
        top = probs.topk(min(top_k, probs.shape[-1]), dim=-1)
        seq.top_probs, seq.top_ids = top.values.half().cpu(), top.indices.cpu()


def expected_acceptance(target, draft, sequences: list[Sequence]) -> float:
    """Mean over answer positions of sum_x min(p(x), q(x)) at temperature 1."""
    total, count = 0.0, 0
    for seq in sequences:
        ids = torch.tensor([seq.ids], device=target.device)
        with torch.inference_mode():
            p = target(ids).logits[0, seq.answer_start - 1 : -1].float().softmax(-1)
            q = full_vocabulary(draft(ids).logits[0, seq.answer_start - 1 : -1].float(), p.shape[-1]).softmax(-1)
        total += float(torch.minimum(p, q).sum(-1).sum())
        count += p.shape[0]
    return total / max(count, 1)


def train(target, sequences: list[Sequence], recipe: Recipe, progress: Progress,
          eval_sequences: list[Sequence] | None = None) -> DistillResult:
    torch.manual_seed(recipe.seed)
    for p in target.parameters():
        p.requires_grad_(False)
    layer = new_adapter_layer(target, recipe.layers)
    for p in layer.parameters():
        p.requires_grad_(True)
    draft = early_exit_draft(target, recipe.layers, layer)
    result = DistillResult(layer, train_tokens=sum(len(s.ids) - s.answer_start for s in sequences))
    if eval_sequences:
        result.acceptance_before = expected_acceptance(target, early_exit_draft(target, recipe.layers), eval_sequences)
        result.eval_tokens = sum(len(s.ids) - s.answer_start for s in eval_sequences)
    optimiser = torch.optim.AdamW(layer.parameters(), lr=recipe.lr)
    order = list(range(len(sequences)))
    shuffler = random.Random(recipe.seed)
    steps = recipe.epochs * len(sequences)
    progress("training", 0, steps)
    layer.train()
    for epoch in range(recipe.epochs):
        shuffler.shuffle(order)
        epoch_loss, epoch_tokens = 0.0, 0
        for i, index in enumerate(order):
            seq = sequences[index]
            logits = draft(torch.tensor([seq.ids], device=target.device)).logits[0, seq.answer_start - 1 : -1]
            log_q = logits.float().log_softmax(-1)
            p_top = seq.top_probs.float().to(log_q.device)
            p_top = p_top / p_top.sum(-1, keepdim=True)
            # cross-entropy with soft labels = KL(p || q) up to p's (constant) entropy
            loss = -(p_top * log_q.gather(-1, seq.top_ids.to(log_q.device))).sum(-1).mean()
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            epoch_loss += float(loss.detach()) * len(p_top)
            epoch_tokens += len(p_top)
            progress("training", epoch * len(sequences) + i + 1, steps)
        result.losses.append(epoch_loss / max(epoch_tokens, 1))
    layer.eval()
    for p in layer.parameters():
        p.requires_grad_(False)
    if eval_sequences:
        result.acceptance_after = expected_acceptance(target, draft, eval_sequences)
    return result
