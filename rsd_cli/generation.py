"""`rsd generate`: consume engine events, stream text to stdout, statistics to stderr."""

from __future__ import annotations

import json
import sys
import time

from .engine import Stats, StepEvent
from .prompting import IncrementalDecoder, encode_prompt
from .render import stats_line, steps_table
from .runtime import make_decoder, seed_of, shape_of


def complete(decoder, prompt_ids: list[int], max_tokens: int, seed: int | None, on_event=None):
    """Run one completion; returns (token ids, stats, events)."""
    stats = Stats()
    events: list[StepEvent] = []
    tokens: list[int] = []
    start = time.perf_counter()
    for event in decoder.generate(prompt_ids, max_tokens, seed):
        tokens.extend(event.emitted)
        stats.add(event)
        stats.wall_seconds = time.perf_counter() - start
        events.append(event)
        if on_event:
            on_event(event)
    return tokens, stats, events


def run_generate(pair, profile, text: str, *, system=None, raw=False, samples=1, as_json=False,
                 show_stats=True, step_table=False, console=None, out=None) -> None:
    out = out or sys.stdout
    decoder = make_decoder(pair, profile)
    prompt_ids = encode_prompt(pair.tokenizer, text, system=system, raw=raw)
    base_seed = seed_of(profile)
    max_tokens = profile["sampling"]["max_tokens"]
    for index in range(samples):
        seed = None if base_seed is None else base_seed + index
        if samples > 1 and not as_json and index:
            out.write("\n---\n")
        detok = IncrementalDecoder(pair.tokenizer)

        def stream(event: StepEvent) -> None:
            if not as_json:
                out.write(detok.push(event.emitted))
                out.flush()

        tokens, stats, events = complete(decoder, prompt_ids, max_tokens, seed, stream)
        if as_json:
            record = {
                "text": pair.tokenizer.decode(tokens, skip_special_tokens=True),
                "token_ids": tokens,
                "profile": profile.name,
                "variant": decoder.shape.variant,
                "shape": decoder.shape.describe(),
                "seed": seed,
                "finish_reason": events[-1].finished if events else None,
                "stats": stats.as_dict(pair.draft_params, pair.target_params),
            }
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
        else:
            out.write(detok.flush() + "\n")
        out.flush()
        if console is not None:
            if step_table:
                console.print(steps_table(events, pair.tokenizer))
            if show_stats:
                console.print(f"[dim]{shape_of(profile).describe()} · {stats_line(stats)}[/dim]")
