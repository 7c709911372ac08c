"""Pure sampling maths on probability tensors: processing, Gumbel-top-k, stochastic beam search.

No models and no printing here. Every function takes an explicit ``torch.Generator`` so a
run is reproducible from its seed.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy: the distribution becomes one-hot on the argmax
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1 disables
    min_p: float = 0.0  # drop tokens below min_p x the likeliest token's probability; 0 disables
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the context; 1 disables
    presence_penalty: float = 0.0  # subtracted from the logit of every token in the answer so far; 0 disables
    frequency_penalty: float = 0.0  # subtracted from a token's logit once per time it is in the answer so far
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit) pairs, ids ascending; -inf bars
    min_tokens: int = 0  # the end-of-sequence tokens are barred until the answer has this many tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_context(self) -> bool:
        """Whether processing depends on the tokens before each position (it then needs `seen`,
        `counts` or `barred`: logits_to_probs)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.min_tokens > 0)


def penalise_repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's repetition penalty (as transformers applies it): a token already in the context has
    its logit divided by the penalty if positive, multiplied by it if negative. seen (..., V) bool."""
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def penalise_presence(logits: torch.Tensor, counts: torch.Tensor, presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's presence and frequency penalties (as its API and vLLM apply them): each token's logit
    less `presence` if it is in the answer so far and `frequency` times its count there (the
    prompt's tokens do not count). counts (..., V)."""
    return logits - presence * (counts > 0) - frequency * counts


@functools.cache
def bias_vector(logit_bias: tuple[tuple[int, float], ...], vocab: int, device: torch.device) -> torch.Tensor:
    """A logit bias as a (vocab,) float32 vector on the device, made once and kept: a CUDA graph
    captured after a first run reads this tensor's memory whenever it replays (step_graphs), so it
    must never be freed and made again elsewhere."""
    vector = torch.zeros(vocab, dtype=torch.float32)
    for token, bias in logit_bias:
        vector[token] = bias
    return vector.to(device)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None,
                    counts: torch.Tensor | None = None, barred: torch.Tensor | None = None) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities after the repetition penalty (seen: (..., V)
    bool, the tokens in each row's context), the presence and frequency penalties (counts: (..., V),
    how often each token is in each row's answer so far, as OpenAI counts), the logit bias, the
    tokens barred in each row (barred: (..., V) bool, the end-of-sequence tokens of a row whose
    answer is shorter than min_tokens), temperature, top-k, top-p and min-p.

    Target and draft go through this same function with the same contexts, so p and q are
    processed identically: what the output follows exactly is this processed target distribution.
    """
    logits = logits.float()
    if params.repetition_penalty != 1.0:
        if seen is None:
            raise ValueError("a repetition penalty needs the tokens seen in each row's context")
        logits = penalise_repetition(logits, seen, params.repetition_penalty)
    if params.presence_penalty or params.frequency_penalty:
        if counts is None:
            raise ValueError("a presence or frequency penalty needs the counts of each row's answer so far")
        logits = penalise_presence(logits, counts.float(), params.presence_penalty, params.frequency_penalty)
    if params.logit_bias:  # (OpenAI's logit_bias: each named token's logit plus its value; -inf bars it)
        logits = logits + bias_vector(params.logit_bias, logits.shape[-1], logits.device)
    if params.min_tokens:
        if barred is None:
            raise ValueError("min_tokens needs the tokens barred in each row")
        logits = logits.masked_fill(barred, -math.inf)
    if params.greedy:
        # one-hot on the argmax (F.one_hot would check the indices' range: a read of their values)
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    if params.temperature != 1.0:  # (x / 1 is x: no copy of the vocabulary's logits)
        logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, -math.inf)
    probs = logits.softmax(-1)
    if params.min_p > 0:  # the likeliest token always stays (its ratio is 1)
        probs = probs.masked_fill(probs < params.min_p * probs.max(-1, keepdim=True).values, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def to_host(tensor: torch.Tensor) -> list:
    """A small tensor's values as Python numbers: the one way the decoding path moves values from
    the model's device to the host (on a GPU, one synchronisation). A step makes a few such
    transfers, each of a few numbers: the drawn tokens of a draft level, each tried node's
    decision, the correction or bonus token (tests count them)."""
    return tensor.tolist()


def to_host_soon(tensor: torch.Tensor):
    """`to_host` in two halves: the copy queued now, and a function that returns the values, waiting
    then for the copy. On a GPU the copy goes into page-locked memory without waiting for the
    device, so work queued after it can run before the values are read; elsewhere the values are
    read at once."""
    if tensor.device.type != "cuda":
        read = to_host(tensor)
        return lambda: read
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(tensor.device))

    def values() -> list:
        copied.synchronize()
        return to_host(host)

    return values


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A few host integers as an (n,) tensor on the device, queued without waiting for the work
    before it (from page-locked memory on a GPU: a plain copy there waits for the device)."""
    pinned = device.type == "cuda"
    return torch.tensor(values, pin_memory=pinned).to(device, non_blocking=pinned)


def sample_rows(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token from each row of (B, V) distributions (need not be normalised), by inverting the
    CDF; (B,) indices on the rows' device, nothing moved to the host. torch.multinomial draws one
    sample through V exponentials (~2 ms for 49k tokens on a CPU); a cumulative sum and a binary
    search take ~0.3 ms. A token of zero probability is never returned (its CDF step is empty)."""
    return inverse_cdf(probs, row_uniforms(probs.shape[0], generator, probs.device))


def row_uniforms(rows: int, generator: torch.Generator, device) -> torch.Tensor:
    """(rows, 1) float64 uniforms in [0, 1): what sample_rows draws for `rows` rows."""
    return torch.rand((rows, 1), generator=generator, dtype=torch.float64, device=device)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """sample_rows with its uniforms given: u (B, 1) float64 in [0, 1), one a row. A pure function
    of tensors (what a CUDA graph can replay). scratch: a float64 tensor of probs' shape to hold the
    cumulative sums (the same numbers), kept by a caller that draws from as many rows again and again
    (completions decoded together: 32 rows of 49k tokens are 12 MB, which glibc's malloc handed back
    and faulted in afresh every step, 6 ms of a 60 ms step on a 2-core AMD EPYC)."""
    cdf = probs.double().cumsum(-1) if scratch is None else scratch.copy_(probs).cumsum_(-1)
    total = cdf[:, -1:]
    u = u * total
    # u may round up to the total (probability ~2^-53): kept below it, the token drawn has mass
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a (V,) distribution (need not be normalised): sample_rows on one row."""
    return to_host(sample_rows(probs[None], generator))[0]


def gumbel_like(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return gumbel_of(torch.rand(x.shape, generator=generator, dtype=torch.float64, device=x.device))


def gumbel_of(u: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise from float64 uniforms in [0, 1) (gumbel_like with its uniforms given)."""
    return -torch.log(-torch.log(u.clamp_min(1e-300)))


def support(probs: torch.Tensor) -> torch.Tensor | None:
    """Indices of the last dimension where some row has mass, or None when most do.

    A reduced draft head, top-k or top-p leave most of a 49k vocabulary at q = 0: on a CPU, Gumbel
    noise drawn only there costs a fraction, and zero-probability tokens can never be drawn
    anyway. On other devices None: noise over the whole row costs less there than finding the
    support (its size is a synchronisation with the host)."""
    if probs.device.type != "cpu":
        return None
    mask = probs > 0
    if mask.dim() > 1:
        mask = mask.any(0)
    if int(mask.sum()) * 2 > mask.numel():
        return None
    return mask.nonzero().squeeze(-1)


def _kept_rows(tokens: torch.Tensor, keep: torch.Tensor) -> list[list[int]]:
    """(B, k) tokens -> each row's tokens where keep is true, in order: one transfer to the host."""
    return [[t for t in row if t >= 0] for row in to_host(torch.where(keep, tokens, -1))]


def gumbel_top_k_rows(probs: torch.Tensor, k: int, generator: torch.Generator) -> list[list[int]]:
    """For each row of (B, V) probs, k tokens drawn without replacement, in draw order.

    Perturbs log q with i.i.d. Gumbel(0, 1) noise and sorts by the perturbed score: the order
    is exactly that of successive draws without replacement (Plackett-Luce). Never returns a
    token of zero probability (its score is -inf), so fewer than k tokens come back when the
    support is smaller. The noise is drawn on the rows' support only (`support`); one token is
    one draw from q (the top-1 of the perturbed scores is distributed as q). All rows come to
    the host in one transfer.
    """
    if k == 1:
        return [[token] for token in to_host(sample_rows(probs, generator))]
    kept = support(probs)
    sub = probs if kept is None else probs[:, kept]
    scores = sub.double().log() + gumbel_like(sub, generator)
    top = torch.topk(scores, min(k, sub.shape[-1]), dim=-1)
    return _kept_rows(top.indices if kept is None else kept[top.indices], torch.isfinite(top.values))


def gumbel_top_k(probs: torch.Tensor, k: int, generator: torch.Generator) -> list[int]:
    """k tokens drawn without replacement from (V,) probs, in draw order (gumbel_top_k_rows)."""
    return gumbel_top_k_rows(probs[None], k, generator)[0]


def top_tokens_rows(probs: torch.Tensor, k: int) -> list[list[int]]:
    """The k most likely tokens of each row of (B, V) probs, most likely first, never one of zero
    probability. What Gumbel-top-k becomes as the draft's temperature goes to 0: successive draws
    without replacement from q^(1/t) take q's modes in order. Drafts for a greedy target."""
    top = torch.topk(probs, min(k, probs.shape[-1]), dim=-1)
    return _kept_rows(top.indices, top.values > 0)


def top_tokens(probs: torch.Tensor, k: int) -> list[int]:
    return top_tokens_rows(probs[None], k)[0]


def sample_with_replacement_rows(probs: torch.Tensor, k: int, generator: torch.Generator) -> list[list[int]]:
    """k i.i.d. tokens from each row of (B, V) probs (one by inverting the CDF: torch.multinomial's
    single draw is the slow path); one transfer to the host."""
    if k == 1:
        return [[token] for token in to_host(sample_rows(probs, generator))]
    return to_host(torch.multinomial(probs.float(), k, replacement=True, generator=generator))


def sample_with_replacement(probs: torch.Tensor, k: int, generator: torch.Generator) -> list[int]:
    return sample_with_replacement_rows(probs[None], k, generator)[0]


def truncated_gumbel(scores: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Shift Gumbel-perturbed scores (B, V) so that each row's maximum equals bound (B,).

    Kool et al. 2019, appendix B (numerically stable form); -inf scores stay -inf.
    """
    top = scores.max(-1, keepdim=True).values
    bound = bound.unsqueeze(-1)
    gap = scores - top  # <= 0
    # log(1 - exp(gap)), with gap == 0 giving -inf
    log1mexp = torch.where(gap > -0.693, torch.log(-torch.expm1(gap)), torch.log1p(-torch.exp(gap)))
    v = bound - scores + log1mexp
    out = bound - v.clamp_min(0) - torch.log1p(torch.exp(-v.abs()))
    return torch.where(torch.isneginf(scores), scores, out)


@dataclass
class BeamLevel:
    parent: list[int]  # index of the parent beam (in the previous level) of each kept child
    token: list[int]
    log_prob: torch.Tensor  # (W,) phi: log q of the whole prefix
    score: torch.Tensor  # (W,) G: perturbed score, truncated under the parent's


def stochastic_beam_step(
    log_prob: torch.Tensor,  # (B,) phi of each beam
    score: torch.Tensor,  # (B,) G of each beam
    probs: torch.Tensor,  # (B, V) q of the next token for each beam
    width: int,
    generator: torch.Generator,
    noise: bool = True,
) -> BeamLevel:
    """One level of stochastic beam search: keep the top `width` of the B x V children.

    Children are returned sorted by descending perturbed score, so the children of one parent
    appear in their draw order (they are a Gumbel-top-k sample from that parent's q). Without
    noise (the temperature -> 0 limit, for a greedy target) it is plain beam search: the
    score is phi itself.
    """
    kept = support(probs)  # children of zero probability have score -inf: leave them out
    sub = probs if kept is None else probs[:, kept]
    child_phi = log_prob.double().unsqueeze(-1) + sub.double().log()  # (B, V) or (B, |support|)
    if noise:
        perturbed = child_phi + gumbel_like(child_phi, generator)
        child_score = truncated_gumbel(perturbed, score.double())
    else:
        child_score = child_phi
    flat = child_score.flatten()
    top = torch.topk(flat, min(width, flat.numel()))
    columns = sub.shape[-1]
    parent = top.indices // columns
    column = top.indices % columns
    token = column if kept is None else kept[column]
    parents, tokens, finite = to_host(torch.stack([parent, token, torch.isfinite(top.values).long()]))
    k = sum(finite)  # children of zero probability score -inf and come last
    return BeamLevel(parents[:k], tokens[:k], child_phi.flatten()[top.indices[:k]], top.values[:k])
