"""`rsd generate`: consume engine events, stream text to stdout, statistics to stderr."""

from __future__ import annotations

import json
import sys
import time
from contextlib import nullcontext

from .engine import Stats, StepEvent
from .prompting import IncrementalDecoder, encode_prompt
from .render import live_view, stats_line, steps_table
from .runtime import make_decoder, seed_of


def complete(decoder, prompt_ids: list[int], max_tokens: int, seed: int | None, on_event=None,
             keep_events: bool = False):
    """Run one completion; returns (token ids, stats, events). on_event(event, stats) sees each step.

    An event holds p and q over the vocabulary for every tree node (megabytes), so only the last
    one is kept unless `keep_events` (the per-step table needs them all)."""
    stats = Stats()
    events: list[StepEvent] = []
    tokens: list[int] = []
    start = time.perf_counter()
    for event in decoder.generate(prompt_ids, max_tokens, seed):
        tokens.extend(event.emitted)
        stats.add(event)
        stats.wall_seconds = time.perf_counter() - start
        if not keep_events:
            events.clear()
        events.append(event)
        if on_event:
            on_event(event, stats)
    return tokens, stats, events


def stream_completion(pair, decoder, prompt_ids, max_tokens, seed, *, out, console=None, live=False,
                      write_text=True, keep_events=False):
    """One completion with text streamed to `out` and, optionally, the live view on `console`.

    With the live view on and stdout on the same terminal, the text is written once at the end
    (the live region would otherwise fight with it); piped stdout still streams.
    """
    from rich.live import Live

    detok = IncrementalDecoder(pair.tokenizer)
    shown: list[str] = []
    hold_text = live and getattr(out, "isatty", lambda: False)()
    view = Live(console=console, transient=True, refresh_per_second=8) if live else nullcontext()
    with view as display:
        def on_event(event: StepEvent, stats: Stats) -> None:
            piece = detok.push(event.emitted)
            shown.append(piece)
            if write_text and not hold_text and piece:
                out.write(piece)
                out.flush()
            if display is not None:
                display.update(live_view("".join(shown), event, stats, pair.tokenizer))

        result = complete(decoder, prompt_ids, max_tokens, seed, on_event, keep_events)
    tail = detok.flush()
    if write_text:
        out.write(("".join(shown) if hold_text else "") + tail)
        out.flush()
    return result


def run_generate(pair, profile, text: str, *, system=None, raw=False, samples=1, as_json=False,
                 show_stats=True, step_table=False, live=False, console=None, out=None) -> None:
    out = out or sys.stdout
    decoder = make_decoder(pair, profile)
    prompt_ids = encode_prompt(pair.tokenizer, text, system=system, raw=raw)
    base_seed = seed_of(profile)
    max_tokens = profile["sampling"]["max_tokens"]
    for index in range(samples):
        seed = None if base_seed is None else base_seed + index
        if samples > 1 and not as_json and index:
            out.write("\n---\n")
        tokens, stats, events = stream_completion(pair, decoder, prompt_ids, max_tokens, seed, out=out,
                                                  console=console, live=live and not as_json,
                                                  write_text=not as_json, keep_events=step_table)
        if as_json:
            record = {
                "text": pair.tokenizer.decode(tokens, skip_special_tokens=True),
                "token_ids": tokens,
                "profile": profile.name,
                "variant": decoder.shape.variant,
                "shape": decoder.shape.describe(),
                "runtime": decoder.runtimes.describe(),
                "seed": seed,
                "finish_reason": events[-1].finished if events else None,
                "stats": stats.as_dict(pair.draft_params, pair.target_params),
            }
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
        else:
            out.write("\n")
        out.flush()
        if console is not None:
            if step_table:
                console.print(steps_table(events, pair.tokenizer))
            if show_stats:
                console.print(f"[dim]{decoder.shape.describe()} · {stats_line(stats)}[/dim]")
