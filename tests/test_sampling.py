"""The one-token sampler (inverse CDF): right frequencies, never a zero-probability token."""

import torch
from scipy.stats import chisquare

from rsd_cli.sampling import sample


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
