"""The embedded target and the sampled data `rsd distill` cached for it: what the experiments on
draft designs (other_drafts.py, train_first_layers.py) train and evaluate on."""

import torch

from rsd_cli.distill import Recipe
from rsd_cli.distill_command import _data_cache
from rsd_cli.models import load_model, resolve_source


def target_and_data(prompts: list[str], recipe: Recipe, limit: int = 0):
    """(frozen target, training sequences (the first `limit` if given), held-out sequences)."""
    target, _ = load_model(resolve_source("embedded")[0], torch.device("cpu"), torch.float32)
    target.requires_grad_(False)
    cached = _data_cache(target, prompts, recipe)
    if not cached.is_file():
        raise SystemExit(f"no sampled data at {cached}: run the `rsd distill` command the script's docstring names")
    train, held_out = torch.load(cached, weights_only=False)
    return target, train[: limit or None], held_out
