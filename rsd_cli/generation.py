"""`rsd generate`: consume engine events, stream text to stdout, statistics to stderr."""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from contextlib import nullcontext

import torch

from .engine import Stats, StepEvent, fresh_seed
from .prompting import IncrementalDecoder, encode_prompt
from .render import live_view, stats_line, steps_table
from .runtime import make_decoder, seed_of, stops_of


class StopText:
    """A completion's text as it grows, ended at the first stop string: the stop string and what
    follows are never released, and while streaming only the tail that could still begin a stop
    string is held back. Without stop strings it is plain incremental detokenisation."""

    def __init__(self, tokenizer, stops: list[str] = ()):
        self.detok = IncrementalDecoder(tokenizer)
        self.stops = [s for s in stops if s]
        self.text = ""  # decoded so far (past a stop only up to it)
        self.released = 0  # characters of text handed out
        self.piece = ""  # what the last push released
        self.matched: str | None = None

    def push(self, tokens: list[int]) -> tuple[int, str]:
        """One step's tokens -> (how many of them to keep, text that may be shown now). Tokens are
        decoded one by one: the one in which a stop string completes is the last kept."""
        if not self.stops:  # nothing to find: the step's text at once
            self.text += self.detok.push(tokens)
            self.piece = self._release(len(self.text))
            return len(tokens), self.piece
        for kept, token in enumerate(tokens, start=1):
            self.text += self.detok.push([token])
            if self._match():
                self.piece = self._release(len(self.text))
                return kept, self.piece
        self.piece = self._release(len(self.text) - self._held())
        return len(tokens), self.piece

    def cut(self, event: StepEvent) -> None:
        """Feed an engine event's tokens; at a stop string, end the event there (finished "stop")."""
        kept, _ = self.push(event.emitted)
        if self.matched is not None:
            event.emitted, event.finished, event.stop = event.emitted[:kept], "stop", self.matched

    def flush(self) -> str:
        """The end of generation: what is left (an incomplete character as �), up to a stop string."""
        if self.matched is None:
            self.text += self.detok.flush()
            self._match()
        return self._release(len(self.text))

    def _match(self) -> bool:
        """Find the earliest stop string in the unreleased text; cut the text there."""
        start = max(0, self.released - max((len(s) for s in self.stops), default=0))
        found = [(self.text.find(s, start), s) for s in self.stops]
        found = [(at, s) for at, s in found if at >= 0]
        if not found:
            return False
        at, self.matched = min(found)
        self.text = self.text[:at]
        return True

    def _held(self) -> int:
        """Length of the longest end of the text that begins some stop string."""
        return max((k for s in self.stops for k in range(min(len(s) - 1, len(self.text)), 0, -1)
                    if self.text.endswith(s[:k])), default=0)

    def _release(self, end: int) -> str:
        piece = self.text[self.released:end]
        self.released = max(self.released, end)
        return piece


def complete(decoder, prompt_ids: list[int], max_tokens: int, seed: int | None, on_event=None,
             keep_events: bool = False, text: StopText | None = None):
    """Run one completion; returns (token ids, stats, events). on_event(event, stats) sees each step.

    With `text` (a StopText), generation ends at its first stop string: that step's tokens are
    cut after the one completing it (the statistics count only those), the event says
    finished="stop" and which string.

    An event holds p and q over the vocabulary for every tree node (megabytes), so only the last
    one is kept unless `keep_events` (the per-step table needs them all)."""
    stats = Stats()
    events: list[StepEvent] = []
    tokens: list[int] = []
    decoder.prepare()  # (a first run's one-off measuring is not the generation's time)
    start = time.perf_counter()
    steps = decoder.generate(prompt_ids, max_tokens, seed)
    try:
        for event in steps:
            if text is not None:
                text.cut(event)
            tokens.extend(event.emitted)
            stats.add(event)
            stats.wall_seconds = time.perf_counter() - start
            if not keep_events:
                events.clear()
            events.append(event)
            if on_event:
                on_event(event, stats)
            if event.finished:
                break  # a stop string: the decoder is left mid-generation
    finally:
        steps.close()  # its caches released (or kept) now, not when the generator is collected
    return tokens, stats, events


def token_logprobs(event: StepEvent, top: int, tokenizer) -> list[dict]:
    """Each emitted token's log-probability under the processed target distribution p it was
    drawn from, and the `top` most likely tokens there (those of probability 0 left out)."""
    def entry(token: int, p) -> dict:
        prob = float(p[token])
        return {"token": token, "text": tokenizer.decode([token]), "logprob": math.log(prob) if prob > 0 else None}

    records = []
    for token, node in zip(event.emitted, event.token_sources()):
        p = event.p[node]
        best = torch.topk(p, min(top, int((p > 0).sum()))) if top else None
        records.append({**entry(token, p), "top": [entry(int(t), p) for t in best.indices] if best is not None else []})
    return records


def reading_line(count: int):
    from rich.text import Text

    return Text(f"reading the prompt ({count} tokens)…", style="dim")


READING_NOTE_DELAY = 0.5  # seconds of reading before ReadingNote draws its line


class ReadingNote:
    """"reading the prompt (N tokens)…" on a terminal `console` while a prompt is read without
    the live view: drawn only once reading has taken READING_NOTE_DELAY (a short prompt shows
    nothing, so nothing flickers) and gone before the answer's first text is written."""

    def __init__(self, console, count: int):
        from rich.live import Live

        self.live = Live(reading_line(count), console=console, transient=True, auto_refresh=False,
                         redirect_stdout=False, redirect_stderr=False)
        self.lock = threading.Lock()
        self.done = False
        self.timer = threading.Timer(READING_NOTE_DELAY, self._show)
        self.timer.daemon = True
        self.timer.start()

    def _show(self) -> None:
        with self.lock:
            if not self.done:
                self.live.start(refresh=True)

    def stop(self) -> None:
        self.timer.cancel()
        with self.lock:
            if not self.done:
                self.done = True
                if self.live.is_started:
                    self.live.stop()


def stream_completion(pair, decoder, prompt_ids, max_tokens, seed, *, out, console=None, live=False,
                      write_text=True, keep_events=False, stops: list[str] = (), on_step=None,
                      reading_note=False):
    """One completion with text streamed to `out` and, optionally, the live view on `console`.
    Returns (token ids, stats, events, text): the text ends before a stop string.

    With the live view on and stdout on the same terminal, the text is written once at the end
    (the live region would otherwise fight with it); piped stdout still streams. Without it,
    `reading_note` shows that a long prompt is being read (see ReadingNote) on a terminal console.
    """
    from rich.live import Live

    text = StopText(pair.tokenizer, stops)
    shown: list[str] = []
    hold_text = live and getattr(out, "isatty", lambda: False)()
    view = Live(console=console, transient=True, refresh_per_second=8) if live else nullcontext()
    noted = reading_note and not live and console is not None and console.is_terminal
    unread = decoder.unread(prompt_ids) if live or noted else 0  # (a chat's kept caches hold most of its prompt)
    note = ReadingNote(console, unread) if noted else None
    with view as display:
        if display is not None:  # until the first step: a long prompt takes seconds to read
            display.update(reading_line(unread), refresh=True)

        def on_event(event: StepEvent, stats: Stats) -> None:
            if note is not None:
                note.stop()
            piece = text.piece
            shown.append(piece)
            if write_text and not hold_text and piece:
                out.write(piece)
                out.flush()
            if display is not None:
                display.update(live_view("".join(shown), event, stats, pair.tokenizer))
            if on_step is not None:
                on_step(event)

        try:
            tokens, stats, events = complete(decoder, prompt_ids, max_tokens, seed, on_event, keep_events, text)
        finally:
            if note is not None:
                note.stop()
    tail = text.flush()
    if write_text:
        out.write(("".join(shown) if hold_text else "") + tail)
        out.flush()
    whole = text.text if text.matched is not None else pair.tokenizer.decode(tokens, skip_special_tokens=True)
    return tokens, stats, events, whole


def run_generate(pair, profile, text: str, *, system=None, raw=False, samples=1, as_json=False,
                 show_stats=True, step_table=False, live=False, console=None, out=None, logprobs: int = 0) -> None:
    out = out or sys.stdout
    decoder = make_decoder(pair, profile)
    decoder.keep_caches = samples > 1  # later samples read only what the caches do not hold: not the prompt
    prompt_ids = encode_prompt(pair.tokenizer, text, system=system, raw=raw)
    base_seed = seed_of(profile)
    if base_seed is None:  # a fresh seed, drawn here so that --json can say which: --seed N reproduces the run
        base_seed = fresh_seed()
    max_tokens = profile["sampling"]["max_tokens"]
    try:  # (the caches the last sample left go back at the end)
        for index in range(samples):
            seed = base_seed + index
            if samples > 1 and not as_json and index:
                out.write("\n---\n")
            token_records: list[dict] = []
            tokens, stats, events, text_out = stream_completion(
                pair, decoder, prompt_ids, max_tokens, seed, out=out, console=console, live=live and not as_json,
                write_text=not as_json, keep_events=step_table, stops=stops_of(profile),
                on_step=(lambda event: token_records.extend(token_logprobs(event, logprobs, pair.tokenizer)))
                if logprobs else None)
            if as_json:
                record = {
                    "text": text_out,
                    "token_ids": tokens,
                    "profile": profile.name,
                    "variant": decoder.shape.variant,
                    "shape": decoder.shape.describe(),
                    "runtime": decoder.runtimes.describe(),
                    "placement": pair.placement,
                    "seed": seed,
                    "prompt_tokens": len(prompt_ids),
                    "finish_reason": events[-1].finished if events else None,
                    "stop": events[-1].stop if events else None,
                    "stats": stats.as_dict(pair.draft_params, pair.target_params),
                }
                if logprobs:
                    record["logprobs"] = token_records
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
            else:
                out.write("\n")
            out.flush()
            if console is not None:
                if step_table:
                    console.print(steps_table(events, pair.tokenizer))
                if show_stats:
                    shape = decoder.shape.describe()
                    console.print(f"[dim]{shape} · {stats_line(stats, shape)}[/dim]")
    finally:
        if decoder.kept is not None:
            decoder.kept.release()
