"""`rsd distill`: the command around distill.py, with progress bars and the output file."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from .distill import Recipe, Sampled, TrainingInterrupted, sample_answers, sampler, teacher_labels, train
from .engine import check_prompts
from .errors import RsdError, UsageError
from .models import (cache_dir, check_early_exit, describe_layers, exact_fingerprint, layers_per_device, load_model,
                     save_adapter, target_placement, text_config, write_whole)
from .prompting import builtin_prompts, encode_prompt, read_prompt_file


def _read_prompts(path: Path | None) -> list[str]:
    return builtin_prompts("train") if path is None else read_prompt_file(path)


def _data_cache(target, prompts: list[str], recipe: Recipe) -> Path:
    """Where the sampled training data of this target, prompt set and data recipe is kept."""
    import hashlib

    key = json.dumps([exact_fingerprint(target), prompts, recipe.tokens, recipe.eval_tokens, recipe.max_new_tokens,
                      recipe.batch_size, recipe.teacher_top_k, recipe.seed])
    return cache_dir() / "distill" / f"data-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"


def _cached_data(path: Path, console):
    """(train, eval) data sampled by an earlier run, or None: none there, or a file that cannot be read
    (written by an older rsd, damaged), which is said and then sampled over."""
    import torch

    if not path.is_file():
        return None
    try:
        data = torch.load(path, weights_only=False)
        train_data, eval_data = data
    except Exception as e:  # (a truncated zip, a pickle of classes since renamed...: all mean sampling again)
        console.print(f"rsd: the sampled data cached in {path} cannot be read ({type(e).__name__}): sampling again",
                      markup=False, highlight=False)
        return None
    console.print(f"reusing sampled data from {path}")
    return train_data, eval_data


def _kept_tokens(so_far: dict[str, Sampled]) -> int:
    return sum(sampled.answer_tokens for sampled in so_far.values())


def _sampled_so_far(path: Path, console) -> dict[str, Sampled]:
    """The answers an interrupted run of the same command kept, by phase ({} where none, or where the
    file cannot be read: said, then sampled again)."""
    import torch

    if not path.is_file():
        return {}
    try:
        kept = torch.load(path, weights_only=False)
        tokens = _kept_tokens(kept)
    except Exception as e:  # (written by an older rsd, damaged)
        console.print(f"rsd: the answers kept in {path} cannot be read ({type(e).__name__}): sampling them again",
                      markup=False, highlight=False)
        return {}
    console.print(f"going on from {tokens} answer tokens sampled before ({path})", markup=False, highlight=False)
    return kept


def _sample_data(target, tokenizer, prompts: list[str], recipe: Recipe, setting: str, cached: Path, progress,
                 console):
    """The (train, held-out) answers, kept batch by batch beside `cached` until both are sampled: Ctrl-C
    (or SIGTERM, a closed terminal) leaves them there, and the same command goes on from them."""
    import torch

    kept_file = cached.with_name(f"{cached.stem}.sampling.pt")
    so_far = _sampled_so_far(kept_file, console)

    def keeper(phase: str):
        def keep(sampled: Sampled) -> None:
            so_far[phase] = sampled
            write_whole(kept_file, lambda partial: torch.save(so_far, partial))
        return keep

    decoder = _sampler(target, tokenizer, setting, console)
    phases = (("sampling answers", prompts, recipe.tokens), ("held-out answers", builtin_prompts("eval"),
                                                             recipe.eval_tokens))
    try:
        train_data, eval_data = [sample_answers(target, tokenizer, asked, budget, recipe, phase, progress, decoder,
                                                so_far.get(phase), keeper(phase)) for phase, asked, budget in phases]
    except KeyboardInterrupt:
        if so_far:
            console.print(f"rsd: interrupted while sampling: {_kept_tokens(so_far)} answer tokens kept in {kept_file}; the same "
                          f"command goes on from them", markup=False, highlight=False)
        raise
    return train_data, eval_data, kept_file


def _sampler(target, tokenizer, setting: str, console):
    """distill.sampler on the runtime --compile `setting` gives the target (said in one line), or None:
    transformers' generate (--compile off, or a target the runtime does not take)."""
    from .compiled import runtime_for
    from .engine import runtime_name

    def notice(message: str) -> None:
        console.print(f"rsd: {message}", markup=False, highlight=False)

    runtime = runtime_for(target, setting, "target", notice=notice)
    decoder = sampler(target, tokenizer, runtime, setting)
    where = f"rsd's runtime ({runtime_name(runtime)})" if decoder is not None else "transformers' generate"
    console.print(f"sampling the target's answers on {where}")
    return decoder


def run_distill(profile, out: Path, *, layers: int, tokens: int, eval_tokens: int, epochs: int, lr: float,
                schedule: str, max_new_tokens: int, batch_size: int, vocab: int, seed: int,
                prompts_file: Path | None, console, train_head: bool | None = None) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    import torch

    if out.suffix != ".safetensors":
        raise UsageError(f"--out must name a .safetensors file (got {out})")
    if not out.parent.exists():
        raise RsdError(f"folder {out.parent} does not exist")
    prompts = _read_prompts(prompts_file)
    if schedule not in ("cosine", "constant"):
        raise UsageError(f"--schedule must be cosine or constant (got {schedule!r})")
    recipe = Recipe(layers=layers, tokens=tokens, eval_tokens=eval_tokens, epochs=epochs, lr=lr, schedule=schedule,
                    max_new_tokens=max_new_tokens, batch_size=batch_size, vocab=vocab, seed=seed,
                    train_head=bool(vocab) if train_head is None else train_head)
    torch.manual_seed(seed)
    placement, device, dtype = target_placement(profile)
    source = profile.resolve_path(profile["target"]["source"])
    console.print(f"loading target {profile['target']['source']}…")
    target, tokenizer = load_model(source, device, torch.float32 if dtype == torch.float16 else dtype,
                                   placement=placement, remote_code=profile["target"]["trust_remote_code"],
                                   notice=lambda message: console.print(message, markup=False, highlight=False))
    if placement is not None:
        console.print(f"the target's layers: {describe_layers(layers_per_device(target))}")
    check_early_exit(target)  # (before sampling: what an adapter needs, said at once)
    total_layers = target.config.num_hidden_layers
    # (flags the target cannot serve: usage errors, as generate's --branching past the vocabulary)
    if layers >= total_layers:
        raise UsageError(f"--layers {layers}: the adapter needs at least one of the target's layers after the draft's, "
                         f"and the target has {total_layers} (--layers 1 to {total_layers - 1})")
    if vocab >= target.config.vocab_size:
        raise UsageError(f"--vocab {vocab}: a reduced draft head has fewer rows than the target's vocabulary "
                         f"({target.config.vocab_size} tokens; --vocab 0 takes all of it)")
    # (training prompts are drawn in random batches: one past the context failed the run wherever its batch came)
    check_prompts([encode_prompt(tokenizer, prompt) for prompt in prompts],
                  getattr(text_config(target.config), "max_position_embeddings", None), target.config.vocab_size,
                  "--prompts" if prompts_file else "the built-in training prompts")

    with Progress(TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=not console.is_terminal) as bars:
        tasks: dict[str, int] = {}

        def progress(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bars.add_task(phase, total=total)
                if not console.is_terminal:  # a log file still learns which phase is running
                    console.print(f"{phase}…")
            bars.update(tasks[phase], completed=done, total=total)

        cached = _data_cache(target, prompts, recipe)
        data = _cached_data(cached, console)
        if data is not None:  # sampling is the slow part: a rerun with another lr or epochs reuses it
            train_data, eval_data = data
        else:
            train_data, eval_data, kept_file = _sample_data(target, tokenizer, prompts, recipe,
                                                            profile["runtime"]["compile"], cached, progress, console)
            progress("teacher labels", 0, len(train_data))
            teacher_labels(target, train_data, recipe.teacher_top_k)
            progress("teacher labels", len(train_data), len(train_data))
            write_whole(cached, lambda partial: torch.save((train_data, eval_data), partial))
            kept_file.unlink(missing_ok=True)
        try:
            result, stopped = train(target, train_data, recipe, progress, eval_data), None
        except TrainingInterrupted as e:  # (Ctrl-C or SIGTERM after a whole epoch: that epoch's adapter is written)
            result, stopped = e.result, e

    recipe_record = asdict(recipe) | {"prompts": str(prompts_file) if prompts_file else "built-in train set",
                                      "sampled_train_tokens": result.train_tokens,
                                      "sampled_eval_tokens": result.eval_tokens,
                                      "losses": result.losses,
                                      "acceptance_per_epoch": result.acceptance_per_epoch,
                                      "acceptance_before": result.acceptance_before,
                                      "acceptance_after": result.acceptance_after,
                                      "epochs_trained": len(result.losses)}
    save_adapter(result.adapter, out, target, layers, recipe_record)
    if stopped:
        done = len(result.losses)
        console.print(f"rsd: interrupted in epoch {done + 1} of {epochs}: the adapter written is the one epoch {done} left"
                      if done < epochs else "rsd: interrupted after the last epoch: the adapter written is whole",
                      markup=False, highlight=False)
    losses = " → ".join(f"{x:.3f}" for x in result.losses)
    console.print(f"loss per epoch {losses}")
    console.print(f"expected acceptance on held-out prompts (T=1): {result.acceptance_before:.3f} without the "
                  f"adapter, {result.acceptance_after:.3f} with it")
    console.print(f"wrote {out}")
    if vocab:
        why = "its own head has those rows" if recipe.train_head else "the head's other rows were not trained for it"
        console.print(f"use it with draft.vocab = {vocab} in the profile ({why})")
    if stopped:
        raise stopped
