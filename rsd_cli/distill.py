"""`rsd distill`: train an adapter layer so the target's first K layers become a good draft.

Recipe: the target's own sampled answers to varied prompts (chat template applied) are the
data; the draft is layers [0, K) + one adapter layer (initialised from layer K) + a final norm
and head (the target's, or copies the draft trains as its own); only the adapter trains,
minimising KL(p_target || q_draft) with the target's top-k probabilities as soft labels.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable

import torch

from .engine import full_vocabulary
from .models import decoder_body, early_exit_draft, final_norm_name, input_device, new_adapter
from .prompting import encode_prompt

# progress(phase, done, total)
Progress = Callable[[str, int, int], None]


@dataclass
class Recipe:
    layers: int = 3
    tokens: int = 20_000  # training tokens (answers only)
    eval_tokens: int = 2_000
    max_new_tokens: int = 160
    batch_size: int = 32  # sequences generated together (a CPU samples 32 about 4x faster than 8)
    vocab: int = 0  # draft head rows (0 = the target's whole vocabulary), as the profile's draft.vocab
    train_head: bool = False  # the draft's own final norm and head train too (vocab rows of it)
    epochs: int = 4
    lr: float = 3e-4
    schedule: str = "cosine"  # "cosine": 5% linear warm-up then cosine decay to 0; "constant"
    teacher_top_k: int = 128
    seed: int = 0


@dataclass
class Sequence:
    ids: list[int]
    answer_start: int  # first answer position
    top_probs: torch.Tensor | None = None  # (answer_len, k) teacher probabilities, float16
    top_ids: torch.Tensor | None = None  # (answer_len, k)
    hidden: torch.Tensor | None = None  # (len(ids), hidden) the target's state entering layer K, while training


@dataclass
class DistillResult:
    adapter: torch.nn.ModuleDict  # new_adapter's
    losses: list[float] = field(default_factory=list)  # mean loss per epoch
    acceptance_per_epoch: list[float] = field(default_factory=list)  # held-out, after each epoch
    acceptance_before: float = 0.0
    acceptance_after: float = 0.0
    train_tokens: int = 0
    eval_tokens: int = 0


@dataclass
class Sampled:
    """A phase's answers sampled so far, kept after each batch so that an interrupted run's next goes on
    from them: the answers, and the state of the random draws (prompts, seeds) after the last batch."""

    sequences: list[Sequence]
    state: tuple  # random.Random.getstate()

    @property
    def answer_tokens(self) -> int:
        return answer_tokens(self.sequences)


def answer_tokens(sequences: list[Sequence]) -> int:
    """The answer tokens of these sequences (their prompts left out)."""
    return sum(len(s.ids) - s.answer_start for s in sequences)


def sample_answers(target, tokenizer, prompts: list[str], budget: int, recipe: Recipe, phase: str,
                   progress: Progress, decoder=None, sampled: Sampled | None = None,
                   keep: Callable[[Sampled], None] | None = None) -> list[Sequence]:
    """The target's sampled answers (T = 1, no truncation) until `budget` answer tokens, each ending
    at the end-of-sequence token (kept) or after max_new_tokens: `batch_size` random prompts at a time,
    decoded together by `decoder` (`sampler`: rsd's runtime) or else by transformers' generate. Goes on
    from `sampled` (an earlier run's); `keep` is given what is sampled after each batch. On the runtime
    (each answer's own seed) an interrupted run and its next sample what one run does."""
    generator = random.Random(recipe.seed + len(phase))
    out: list[Sequence] = []
    if sampled is not None:
        out = list(sampled.sequences)
        generator.setstate(sampled.state)
        if decoder is None:  # (generate draws from torch's generator, seeded as the first run's was: not its draws again)
            torch.manual_seed(random.Random(f"{recipe.seed} {phase} {len(out)}").getrandbits(63))
    total = answer_tokens(out)
    progress(phase, min(total, budget), budget)
    while total < budget:
        batch = [generator.choice(prompts) for _ in range(recipe.batch_size)]
        encoded = [encode_prompt(tokenizer, p) for p in batch]
        if decoder is None:
            answers = _generated(target, tokenizer, encoded, recipe.max_new_tokens)
        else:  # (each answer's own seed: the same prompts and seeds give the same answers)
            answers = _together(decoder, encoded, recipe.max_new_tokens, [generator.getrandbits(63) for _ in batch])
        for prompt_ids, answer in zip(encoded, answers):
            if answer:
                out.append(Sequence(prompt_ids + answer, len(prompt_ids)))
                total += len(answer)
        if keep is not None:
            keep(Sampled(list(out), generator.getstate()))
        progress(phase, min(total, budget), budget)
    return out


def sampler(target, tokenizer, runtime, setting: str):
    """An `ar` Decoder of the target alone at T = 1 (no truncation) on this runtime (a
    compiled.CompiledModel, from --compile `setting`), ending answers at the tokenizer's
    end-of-sequence token as transformers' generate does here; None where answers cannot be decoded
    together on it (no runtime, a model whose attention takes no masks of rsd's)."""
    from .drafting import make_shape
    from .engine import Decoder, Runtimes
    from .models import text_config
    from .sampling import SamplingParams

    if runtime is None:
        return None
    cfg = text_config(target.config)
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    decoder = Decoder(target, None, cfg.vocab_size, make_shape("ar"), SamplingParams(temperature=1.0), eos,
                      getattr(cfg, "max_position_embeddings", None), Runtimes(runtime, None, setting))
    return decoder if decoder.limit is None else None


def _together(decoder, encoded: list[list[int]], max_new_tokens: int, seeds: list[int]) -> list[list[int]]:
    """Each prompt's answer, decoded together (Decoder.generate_together: a forward of a row per
    unfinished answer)."""
    answers: list[list[int]] = [[] for _ in encoded]
    steps = decoder.generate_together(encoded, max_new_tokens, seeds)
    try:
        for events in steps:
            for answer, event in zip(answers, events):
                if event is not None:
                    answer.extend(event.emitted)
    finally:
        steps.close()
    return answers


def _generated(target, tokenizer, encoded: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Each prompt's answer by transformers' generate, the prompts left-padded into one batch."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    width = max(map(len, encoded))
    ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
    with torch.inference_mode():
        generated = target.generate(
            input_ids=ids.to(input_device(target)), attention_mask=mask.to(input_device(target)), do_sample=True,
            temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=eos,
        )
    return [row[: row.index(eos) + 1] if eos in row else row for row in generated[:, width:].tolist()]


def teacher_labels(target, sequences: list[Sequence], top_k: int) -> None:
    """Store the target's top-k next-token probabilities at every answer position."""
    for seq in sequences:
        with torch.inference_mode():
            logits = target(torch.tensor([seq.ids], device=input_device(target)), use_cache=False).logits[0].float()
        probs = logits[seq.answer_start - 1 : len(seq.ids) - 1].softmax(-1)
        top = probs.topk(min(top_k, probs.shape[-1]), dim=-1)
        seq.top_probs, seq.top_ids = top.values.half().cpu(), top.indices.cpu()


def expected_acceptance(target, draft, sequences: list[Sequence]) -> float:
    """Mean over answer positions of sum_x min(p(x), q(x)) at temperature 1."""
    total, count = 0.0, 0
    for seq in sequences:
        ids = torch.tensor([seq.ids], device=input_device(target))
        with torch.inference_mode():
            # (without a cache: a draft of a hybrid's first layers, all with a state, has no attention's length to read)
            p = target(ids, use_cache=False).logits[0, seq.answer_start - 1 : -1].float().softmax(-1)
            q = full_vocabulary(draft(ids, use_cache=False).logits[0, seq.answer_start - 1 : -1].float(),
                                p.shape[-1]).softmax(-1)
        total += float(torch.minimum(p, q).sum(-1).sum())
        count += p.shape[0]
    return total / max(count, 1)


def learning_rate_factor(schedule: str, step: int, steps: int) -> float:
    """Multiplier of the base learning rate at optimiser step `step` (0-based) of `steps`."""
    if schedule == "constant":
        return 1.0
    warmup = max(1, steps // 20)
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def adapter_only(target, adapter: torch.nn.ModuleDict, vocab: int = 0):
    """The adapter + the final norm and head, as a causal LM fed `inputs_embeds` = the target's
    hidden states entering layer K. Training runs only this: the K frozen layers are run once
    per sequence, not once per step. Run it without a cache (use_cache=False): the adapter
    keeps its cache slot K of the real draft. (Granite's models scale `inputs_embeds` by their embedding
    multiplier, meant for the embedding's output: not for hidden states, so not here.)"""
    trainee = early_exit_draft(target, 0, adapter, vocab)
    body = decoder_body(trainee)
    if hasattr(body, "embedding_multiplier"):
        body.embedding_multiplier = 1.0
    return trainee


def hidden_entering(prefix, ids: list[int]) -> torch.Tensor:
    """(len(ids), hidden): the hidden states leaving an early-exit model's layers (the target's
    first K), caught on their way into its final norm: what the adapter layer receives."""
    caught: list[torch.Tensor] = []
    body = decoder_body(prefix)
    norm = getattr(body, final_norm_name(body))  # (Phi's and Bamba's `final_layernorm`, Mamba-2's `norm_f`, ...)
    hook = norm.register_forward_pre_hook(lambda module, args: caught.append(args[0]))
    try:
        with torch.no_grad():
            prefix(torch.tensor([ids], device=input_device(prefix)), use_cache=False, logits_to_keep=1)
    finally:
        hook.remove()
    return caught[0][0].detach()


def soft_cross_entropy(logits: torch.Tensor, top_probs: torch.Tensor, top_ids: torch.Tensor) -> torch.Tensor:
    """Mean over positions of -sum_x p(x) log q(x) (= KL(p || q) up to p's entropy).

    p is the teacher's top-k, renormalised over the tokens the draft head can propose (a reduced
    head has only the first N ids: mass outside it cannot be matched, so it is left out)."""
    log_q = logits.float().log_softmax(-1)
    kept = top_ids < logits.shape[-1]
    p = top_probs.float() * kept
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)
    return -(p * log_q.gather(-1, top_ids.clamp(max=logits.shape[-1] - 1))).sum(-1).mean()


def train(target, sequences: list[Sequence], recipe: Recipe, progress: Progress,
          eval_sequences: list[Sequence] | None = None) -> DistillResult:
    torch.manual_seed(recipe.seed)
    for p in target.parameters():
        p.requires_grad_(False)
    adapter = new_adapter(target, recipe.layers, recipe.vocab if recipe.train_head else None)
    for p in adapter.parameters():
        p.requires_grad_(True)
    draft = early_exit_draft(target, recipe.layers, adapter, recipe.vocab)
    trainee = adapter_only(target, adapter, recipe.vocab)
    prefix = early_exit_draft(target, recipe.layers, None, recipe.vocab)  # the frozen layers alone
    for i, seq in enumerate(sequences):  # the frozen layers run once per sequence, not once per step
        progress("frozen layers", i, len(sequences))
        seq.hidden = hidden_entering(prefix, seq.ids)
    progress("frozen layers", len(sequences), len(sequences))
    result = DistillResult(adapter, train_tokens=sum(len(s.ids) - s.answer_start for s in sequences))
    if eval_sequences:
        result.acceptance_before = expected_acceptance(target, prefix, eval_sequences)
        result.eval_tokens = sum(len(s.ids) - s.answer_start for s in eval_sequences)
    order = list(range(len(sequences)))
    shuffler = random.Random(recipe.seed)
    steps = recipe.epochs * len(sequences)
    optimiser = torch.optim.AdamW(adapter.parameters(), lr=recipe.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimiser, lambda step: learning_rate_factor(recipe.schedule, step, steps))
    progress("training", 0, steps)
    adapter.train()
    finished = None  # the adapter's tensors after the last whole epoch (a copy on the CPU), for an interrupted run
    try:
        for epoch in range(recipe.epochs):
            shuffler.shuffle(order)
            epoch_loss, epoch_tokens = 0.0, 0
            for i, index in enumerate(order):
                seq = sequences[index]
                logits = trainee(inputs_embeds=seq.hidden[None], use_cache=False).logits[0, seq.answer_start - 1 : -1]
                loss = soft_cross_entropy(logits, seq.top_probs.to(logits.device), seq.top_ids.to(logits.device))
                optimiser.zero_grad()
                loss.backward()
                optimiser.step()
                scheduler.step()
                epoch_loss += float(loss.detach()) * len(logits)
                epoch_tokens += len(logits)
                progress("training", epoch * len(sequences) + i + 1, steps)
            acceptances = result.acceptance_per_epoch
            if eval_sequences:  # cheap next to an epoch, and shows when more epochs stop helping
                adapter.eval()
                acceptances = [*acceptances, expected_acceptance(target, draft, eval_sequences)]
                adapter.train()
            tensors = {name: tensor.detach().to("cpu", copy=True) for name, tensor in adapter.state_dict().items()}
            # (the epoch counted in one go: no signal is taken between these stores, so an interrupted run's
            # adapter and its numbers are one epoch's)
            finished, result.losses, result.acceptance_per_epoch = (
                tensors, [*result.losses, epoch_loss / max(epoch_tokens, 1)], acceptances)
            if eval_sequences:
                progress(f"epoch {epoch + 1}: held-out acceptance {acceptances[-1]:.3f}", 1, 1)
    except KeyboardInterrupt:  # (Ctrl-C, SIGTERM: after a whole epoch, the adapter as it was then is kept)
        if finished is None:
            raise
        adapter.load_state_dict(finished)
        stopped = TrainingInterrupted(result)
    else:
        stopped = None
    adapter.eval()
    for p in adapter.parameters():
        p.requires_grad_(False)
    for seq in sequences:
        seq.hidden = None
    if eval_sequences:
        result.acceptance_after = result.acceptance_per_epoch[-1]
    if stopped:
        raise stopped
    return result


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) after a whole epoch: `result` holds the adapter as the last whole epoch left it,
    and the losses and acceptances of the epochs up to it."""

    def __init__(self, result: DistillResult):
        super().__init__()
        self.result = result
