"""Pure verification maths: recursive rejection sampling (RRS) and SpecTr's K-SEQ.

A *plan* is deterministic: for the drafts x_1..x_K tried in order at one tree node, it gives
the probability of accepting x_k given that x_1..x_(k-1) were rejected, and the residual
distribution used after each rejection. ``decide`` turns a plan into a random outcome. The
exact-enumeration tests use the plans directly, so they check the very code the engine runs.
All maths is in float64, on the device the distributions are on: a plan is computed without
moving anything to the host; `verify` moves whether the first draft was accepted, after a
rejection which later one was (`decide`), and after rejecting them all the correction token.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from .sampling import inverse_cdf, row_uniforms, sample, to_host


class Rule(str, Enum):
    WITHOUT_REPLACEMENT = "rrs"  # drafts drawn without replacement (RSD-C, RSD-S, SD)
    WITH_REPLACEMENT = "rrs-iid"  # drafts i.i.d. (SpecInfer multi-step speculative sampling)
    KSEQ = "kseq"  # SpecTr's K-SEQ over i.i.d. drafts
    BIASED = "rrs-biased"  # without-replacement drafts verified as if i.i.d.: wrong, for tests


@dataclass
class Plan:
    accept: torch.Tensor  # (K,) float64: accept[k] = P(accept draft k | drafts before it rejected)
    residuals: list[torch.Tensor]  # residuals[k] = distribution after rejecting draft k, (V,)

    def accept_probabilities(self) -> list[float]:
        """accept on the host (for reports)."""
        return to_host(self.accept)


def _normalise_(x: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """x / x.sum() in place, or the fallback when x has (next to) no mass: such a residual can
    only be reached with probability 0 (up to rounding). Decided on the device, no value read;
    in place because fresh 49k-entry temporaries cost more than the arithmetic on a CPU."""
    total = x.sum()
    has_mass = total > 1e-12
    scale = torch.where(has_mass, total, 1.0).reciprocal() * has_mass  # 1/total, or 0
    return x.mul_(scale).addcmul_(fallback, (~has_mass).to(x.dtype))  # + fallback x (0 or 1): exact


def _acceptance(target_mass: torch.Tensor, draft_mass: torch.Tensor) -> torch.Tensor:
    """min(1, r(x) / q(x)), 1 where q(x) = 0: the probability of accepting drafts x."""
    return torch.where(draft_mass > 0, target_mass / draft_mass, 1.0).clamp(max=1.0)


def rrs_plan(p: torch.Tensor, q: torch.Tensor, drafts: list[int], rule: Rule) -> Plan:
    """Recursive rejection sampling at one node; p, q are (V,) target and draft distributions."""
    r = p.double()
    q_k = q.to(torch.float64, copy=True)
    q_k /= q.sum(dtype=torch.float64)  # what the first draft was drawn from (q has mass: it was drawn)
    target_mass, draft_mass, residuals = [], [], []  # r(x_k), q_k(x_k) for each draft
    for i, x in enumerate(drafts):
        q_x = q_k[x].clone()  # (q_k changes in place below)
        target_mass.append(r[x])
        draft_mass.append(q_x)
        r = _normalise_((r - q_k).clamp_min_(0), r)
        residuals.append(r)
        if rule is Rule.WITHOUT_REPLACEMENT and i + 1 < len(drafts):
            # q without x, renormalised: the distribution the next draft was drawn from (when x
            # held all of q's mass, the next draft had nothing left to draw: q is kept as it is)
            rest = 1.0 - q_x
            q_k.mul_(torch.where(rest > 1e-12, rest, 1.0).reciprocal())
            q_k[x] = 0
    if not drafts:
        return Plan(p.new_zeros(0, dtype=torch.float64), [])
    return Plan(_acceptance(torch.stack(target_mass), torch.stack(draft_mass)), residuals)


def _beta(p: torch.Tensor, q: torch.Tensor, rho: float) -> float:
    return float(torch.minimum(q, p / rho).sum())


def kseq_rho(p: torch.Tensor, q: torch.Tensor, k: int) -> float:
    """Solve 1 - (1 - beta(rho))^k = rho * beta(rho) for rho in [1, k] by bisection."""
    p, q = p.double(), q.double()

    def excess(rho: float) -> float:
        beta = _beta(p, q, rho)
        return 1 - (1 - beta) ** k - rho * beta

    lo, hi = 1.0, float(k)
    if excess(lo) <= 0:  # p == q on q's support, any draft is accepted
        return lo
    for _ in range(100):  # excess(lo) > 0 >= excess(hi)
        mid = (lo + hi) / 2
        if excess(mid) > 0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def kseq_plan(p: torch.Tensor, q: torch.Tensor, drafts: list[int]) -> Plan:
    """K-SEQ (Sun et al. 2023): accept x_k w.p. min(1, p/(rho q)); residual ~ (p - rho q)^+."""
    p, q = p.double(), q.double()
    rho = kseq_rho(p, q, len(drafts))
    accept = [float(min(1.0, p[x] / (rho * q[x]))) if q[x] > 0 else 1.0 for x in drafts]
    final = _normalise_((p - rho * q).clamp_min(0), p)
    return Plan(torch.tensor(accept, dtype=torch.float64, device=p.device), [final] * len(drafts))


def plan(p: torch.Tensor, q: torch.Tensor, drafts: list[int], rule: Rule) -> Plan:
    if rule is Rule.KSEQ:
        return kseq_plan(p, q, drafts)
    # the biased rule is RRS without renormalising q between draws
    return rrs_plan(p, q, drafts, Rule.WITH_REPLACEMENT if rule is Rule.BIASED else rule)


def root_acceptance(p: torch.Tensor, q: torch.Tensor, k: int, rule: Rule, draws: int,
                    generator: torch.Generator) -> float:
    """P(one of the k drafts at a node is accepted) under recursive rejection sampling.

    Given the drafts rejected so far, the next one is accepted with probability exactly
    a = sum_x min(r(x), q'(x)) (r the residual, q' the draft distribution it is drawn from), and
    it is rejected as token x with weight (q' - r)^+(x). So P = a1 + (1-a1)(a2 + (1-a2)(a3 ...)),
    averaged over rejection paths drawn from those weights. With replacement q' = q and the
    residual do not depend on the rejected tokens: one path gives the exact value. Without
    replacement the spread over paths is small (a Rao-Blackwellised estimate)."""
    paths = 1 if rule is Rule.WITH_REPLACEMENT else draws
    total = 0.0
    for _ in range(paths):
        r, q_k, reach = p.double(), q.double(), 1.0
        for i in range(k):
            a = float(torch.minimum(r, q_k).sum())
            total += reach * a
            reach *= 1.0 - a
            rejected_as = (q_k - r).clamp_min(0)
            left = (r - q_k).clamp_min(0)
            if i == k - 1 or reach <= 0 or float(rejected_as.sum()) <= 1e-12 or float(left.sum()) <= 1e-12:
                break
            x = int(torch.multinomial(rejected_as / rejected_as.sum(), 1, generator=generator))
            r = left / left.sum()
            if rule is Rule.WITHOUT_REPLACEMENT:
                q_k = q_k.clone()
                q_k[x] = 0
                if float(q_k.sum()) <= 1e-12:  # the draft has no token left to propose
                    break
                q_k = q_k / q_k.sum()
    return total / paths


@dataclass
class Decision:
    accepted: int | None  # index into drafts of the accepted one, None if all were rejected
    tried: int  # how many drafts were tried
    correction: int | None  # token sampled from the final residual when all were rejected


def decide(node_plan: Plan, generator: torch.Generator, start: int = 0) -> Decision:
    """Try the drafts in order from `start` (the ones before it already rejected): draft k is
    accepted with probability accept[k] (one uniform each, all drawn at once on the plan's device),
    the first accepted one wins; after rejecting them all the correction is drawn from the last
    residual. One transfer to the host (which draft), and one more after a rejection (the correction)."""
    accept = node_plan.accept[start:]
    k = node_plan.accept.shape[0]
    u = torch.rand(k - start, generator=generator, dtype=torch.float64, device=accept.device)
    hits = to_host((accept >= 1.0) | (u < accept))
    if True in hits:
        first = start + hits.index(True)
        return Decision(first, first + 1, None)
    return Decision(None, k, sample(node_plan.residuals[-1], generator))


def chain_decisions(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                    generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every node of a chain decided at once, on the device, nothing read: p (γ + 1, V) target
    distributions at the chain's nodes (root first), q (γ, V) the draft's at the first γ, drafts
    (γ,) the drafted tokens (draft i drawn from q[i] under node i). Returns (accepted (γ,) bool,
    corrections (γ,), bonus (1,)): node i accepts its draft with probability min(1, p(x)/q(x)) (its
    rrs_plan's accept[0]), a correction is drawn from each node's residual (p - q)^+ (its plan's
    residual), and the bonus from the last node's p. The first node that rejects ends the path
    with its correction; where none does, the bonus follows. Each node's outcome has the
    distribution `verify` gives it, with uniforms of its own: the decisions and draws past the
    first rejection are simply not used (γ uniforms, then γ corrections, then the bonus)."""
    gamma = drafts.shape[0]
    u = torch.rand(gamma, generator=generator, dtype=torch.float64, device=p.device)
    return chain_outcome(p, q, drafts, u, row_uniforms(gamma + 1, generator, p.device))


def chain_outcome(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, u: torch.Tensor,
                  u_draws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """chain_decisions with its uniforms given (a pure function of tensors, which a CUDA graph can
    replay): u (γ,) float64 for the acceptances, u_draws (γ + 1, 1) for the corrections and the bonus."""
    gamma = drafts.shape[0]
    r = p[:gamma].double()
    q = q.double() / q.sum(-1, keepdim=True, dtype=torch.float64)
    x = drafts[:, None]
    accept = _acceptance(r.gather(1, x), q.gather(1, x))[:, 0]
    accepted = (accept >= 1.0) | (u < accept)
    residual = (r - q).clamp_min_(0)
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 1e-12, residual / torch.where(total > 1e-12, total, 1.0), r)
    drawn = inverse_cdf(torch.cat([residual, p[gamma:].double()]), u_draws)  # corrections, then the bonus
    return accepted, drawn[:gamma], drawn[gamma:]


def fan_decisions(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, drawn: torch.Tensor,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A root's k drafts, drawn without replacement, decided at once on the device, nothing read:
    p (k + 1, V) target distributions at the root and at each child, q (V,) the draft's at the
    root, drafts (k,) in draw order, drawn (k,) bool whether each was drawn (a q with fewer than k
    tokens of mass yields fewer: the last ones are not, and are never accepted). Returns
    (accepted (k,) bool: whether draft i is accepted once the ones before it are rejected, with
    rrs_plan's accept[i], correction (1,) from the residual after rejecting them all, bonus (k,)
    one token from each child's p): the first accepted draft wins and its bonus follows, else the
    correction. rrs_plan's arithmetic, a uniform for each draft drawn up front; q without the
    drafts before draft i, renormalised, is q with them zeroed over 1 - their mass (what its
    successive renormalisations make, up to rounding), so only the residuals take a loop."""
    k = drafts.shape[0]
    u = torch.rand(k, generator=generator, dtype=torch.float64, device=p.device)
    return fan_outcome(p, q, drafts, drawn, u, row_uniforms(k + 1, generator, p.device))


def fan_outcome(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, drawn: torch.Tensor, u: torch.Tensor,
                u_draws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fan_decisions with its uniforms given (a pure function of tensors, which a CUDA graph can
    replay): u (k,) float64 for the acceptances, u_draws (k + 1, 1) for the correction and the bonuses."""
    k = drafts.shape[0]
    r = p[0].double()
    q = q.double() / q.sum(dtype=torch.float64)
    q_x = q.gather(0, drafts)  # (k,)
    removed = q_x.cumsum(0) - q_x  # the mass of the drafts before each one
    scales = torch.where(1.0 - removed > 1e-12, 1.0 - removed, 1.0).reciprocal()  # (k,)
    rest_q = q.clone()
    target_mass = []
    for i in range(k):  # (slices, not a 0-d index: indexing with one reads it on the host)
        x = drafts[i: i + 1]
        target_mass.append(r.gather(0, x))
        left = (r - rest_q * scales[i: i + 1]).clamp_min_(0)
        total = left.sum()
        r = torch.where(drawn[i: i + 1] & (total > 1e-12), left / torch.where(total > 1e-12, total, 1.0), r)
        if i + 1 < k:
            rest_q.scatter_(0, x, 0.0)
    accept = _acceptance(torch.cat(target_mass), q_x * scales)
    accepted = drawn & ((accept >= 1.0) | (u < accept))
    tokens = inverse_cdf(torch.cat([r[None], p[1:].double()]), u_draws)  # the correction, then each bonus
    return accepted, tokens[:1], tokens[1:]


def first_acceptance(p: torch.Tensor, q: torch.Tensor, x: int) -> torch.Tensor:
    """accept[0] of rrs_plan(p, q, [x, ...]) without its residuals: min(1, p(x) / q(x)) with q
    normalised, by the very float operations the plan makes. (1,) on p's device."""
    return _acceptance(p[x:x + 1].double(), q[x:x + 1].double() / q.sum(dtype=torch.float64))


def verify(p: torch.Tensor, q: torch.Tensor, drafts: list[int], rule: Rule,
           generator: torch.Generator) -> tuple[Decision, Plan | None]:
    """The decision at one node: `decide` on its plan, except that recursive rejection tries the
    first draft before computing any residual (it is accepted with probability min(1, p/q), which
    needs two numbers), so when it is accepted — most often — no vocabulary-sized work is done and
    no plan is returned. Otherwise the plan decides among the other drafts. The outcome has the
    same distribution either way: draft 1 is accepted with probability accept[0], then each next
    one with accept[k], each with its own uniform. K-SEQ needs its ρ first: always the full plan."""
    if rule is not Rule.KSEQ:
        u = torch.rand(1, generator=generator, dtype=torch.float64, device=p.device)
        accept = first_acceptance(p, q, drafts[0])
        if to_host((accept >= 1.0) | (u < accept))[0]:
            return Decision(0, 1, None), None
    node_plan = plan(p, q, drafts, rule)
    return decide(node_plan, generator, start=0 if rule is Rule.KSEQ else 1), node_plan
