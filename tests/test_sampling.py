"""The samplers: right frequencies, never a zero-probability token."""

import itertools
from collections import Counter

import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from rsd_cli import sampling
from rsd_cli.sampling import gumbel_top_k, sample


def test_frequencies_match_an_unnormalised_distribution_with_zeros():
    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 5.5, 0.0])  # sums to 10
    generator = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([sample(weights, generator) for _ in range(20_000)]), minlength=8)
    assert counts[weights == 0].sum() == 0
    support = weights > 0
    assert chisquare(counts[support].numpy(), (weights[support] / 10 * 20_000).numpy()).pvalue > 1e-3


def test_a_wrong_sampler_would_fail_the_same_check():
    weights = torch.tensor([3.0, 1.0, 0.5, 5.5])
    generator = torch.Generator().manual_seed(0)
    shifted = torch.tensor([0.5, 3.0, 1.0, 5.5])  # a sampler that used the neighbour's CDF step
    counts = torch.bincount(torch.tensor([sample(shifted, generator) for _ in range(20_000)]), minlength=4)
    assert chisquare(counts.numpy(), (weights / 10 * 20_000).numpy()).pvalue < 1e-6


def test_a_uniform_draw_rounded_up_to_the_total_gives_the_last_token_with_mass(monkeypatch):
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: torch.tensor(1.0, dtype=torch.float64))
    assert sample(torch.tensor([0.25, 0.75, 0.0, 0.0]), torch.Generator()) == 1


def test_a_draw_with_a_scratch_for_its_sums_is_the_same_draw():
    """inverse_cdf's scratch (completions decoded together keep one from step to step) holds the same
    cumulative sums as a draw without it, so every row draws the same token; one that held a step's
    sums before is overwritten."""
    generator = torch.Generator().manual_seed(0)
    scratch = torch.full((40, 4096), float("nan"), dtype=torch.float64)
    for rows in (32, 5, 1):
        probs = torch.rand(rows, 4096, generator=generator) ** 8
        probs[:, ::5] = 0.0  # (tokens without mass are never drawn either way)
        u = torch.rand(rows, 1, generator=generator, dtype=torch.float64)
        drawn = sampling.inverse_cdf(probs, u, scratch[:rows])
        assert torch.equal(drawn, sampling.inverse_cdf(probs, u)) and bool((probs.gather(1, drawn[:, None]) > 0).all())
        assert torch.equal(scratch[:rows], probs.double().cumsum(-1))


# Draws on the support only (gumbel_top_k, stochastic beam search): the same distributions as
# over the whole vocabulary. q has mass on 4 of 12 tokens, in the middle and at both ends.
Q = torch.tensor([0.1, 0, 0, 0.4, 0, 0, 0, 0.3, 0, 0, 0, 0.2], dtype=torch.float64)


def _plackett_luce(q: torch.Tensor, draws: tuple[int, ...]) -> float:
    prob, left = 1.0, 1.0
    for x in draws:
        prob *= float(q[x]) / left
        left -= float(q[x])
    return prob


@pytest.mark.parametrize("k", [1, 2, 3])
def test_gumbel_top_k_draws_in_plackett_luce_order_on_the_support(k):
    generator = torch.Generator().manual_seed(k)
    n = 20_000
    counts = Counter(tuple(gumbel_top_k(Q, k, generator)) for _ in range(n))
    assert all(Q[x] > 0 for draws in counts for x in draws)
    orders = list(itertools.permutations([0, 3, 7, 11], k))
    observed = [counts.get(o, 0) for o in orders]
    assert sum(observed) == n
    expected = [_plackett_luce(Q, o) * n for o in orders]
    assert chisquare(observed, expected).pvalue > 1e-3
    assert gumbel_top_k(Q, 6, generator) and len(gumbel_top_k(Q, 6, generator)) == 4  # only the support


def _beam_levels(restrict: bool, n: int, seed: int, monkeypatch) -> Counter:
    """(parent, token) of the kept children of two beams, with or without the support restriction."""
    if not restrict:
        monkeypatch.setattr(sampling, "support", lambda probs: None)
    other = torch.tensor([0, 0.5, 0, 0.2, 0, 0, 0, 0, 0, 0.3, 0, 0], dtype=torch.float64)
    probs = torch.stack([Q, other])
    log_prob = torch.log(torch.tensor([0.6, 0.3], dtype=torch.float64))
    score = torch.tensor([1.0, 0.2], dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    counts = Counter()
    for _ in range(n):
        level = sampling.stochastic_beam_step(log_prob, score, probs, 3, generator)
        counts[tuple(zip(level.parent, level.token))] += 1
    monkeypatch.undo()
    return counts


def test_stochastic_beam_step_on_the_support_keeps_the_same_children_distribution(monkeypatch):
    restricted = _beam_levels(True, 12_000, 0, monkeypatch)
    whole = _beam_levels(False, 12_000, 1, monkeypatch)
    assert {t for key in restricted for _, t in key} <= {0, 1, 3, 7, 9, 11}  # never a zero-q child
    keys = sorted(set(restricted) | set(whole))
    table = [[restricted.get(key, 0) for key in keys], [whole.get(key, 0) for key in keys]]
    frequent = [i for i in range(len(keys)) if table[0][i] + table[1][i] >= 20]
    assert chi2_contingency([[row[i] for i in frequent] for row in table]).pvalue > 1e-3


def test_top_tokens_are_the_modes_in_order_and_never_a_zero_probability_token():
    assert sampling.top_tokens(Q, 3) == [3, 7, 11]
    assert sampling.top_tokens(Q, 10) == [3, 7, 11, 0]  # the support only


def test_beam_step_without_noise_is_beam_search():
    """Every (parent, child) scored by log q of the whole prefix; the top 3 kept, best first."""
    other = torch.tensor([0, 0.5, 0, 0.2, 0, 0, 0, 0, 0, 0.3, 0, 0], dtype=torch.float64)
    probs = torch.stack([Q, other])
    log_prob = torch.log(torch.tensor([0.6, 0.3], dtype=torch.float64))
    level = sampling.stochastic_beam_step(log_prob, torch.zeros(2, dtype=torch.float64), probs, 3,
                                          torch.Generator().manual_seed(0), noise=False)
    # prefix probabilities: 0.6 * (0.4, 0.3, 0.2, 0.1) and 0.3 * (0.5, 0.3, 0.2)
    assert list(zip(level.parent, level.token)) == [(0, 3), (0, 7), (1, 1)]
    assert torch.allclose(level.log_prob.exp(), torch.tensor([0.24, 0.18, 0.15], dtype=torch.float64))
