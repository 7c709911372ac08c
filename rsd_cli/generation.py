"""`rsd generate`: consume engine events, stream text to stdout, statistics to stderr."""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from .engine import Stats, StepEvent, check_prompts, fresh_seed
from .prompting import IncrementalDecoder, counted, encode_prompt, token_bytes
from .render import live_view, print_table, steps_table, summary_line
from .runtime import make_decoder, seed_of
from .threads import FORWARDS


class StopText:
    """A completion's text as it grows, ended at the first stop string: the stop string (unless
    `include`, vLLM's include_stop_str_in_output: then it ends the text) and what follows are never
    released, and while streaming only the tail that could still begin a stop string is held back.
    Without stop strings it is plain incremental detokenisation. With min_tokens, a stop string ends
    the text only where it ends after the first min_tokens - 1 tokens' text (as vLLM's min_tokens:
    no stop is looked for before the answer has that many). `turn_ends` are stop strings of rsd's own
    (chat's next `User:` line for a base model): never included, whatever `include` says."""

    def __init__(self, tokenizer, stops: list[str] = (), min_tokens: int = 0, include: bool = False,
                 turn_ends: tuple[str, ...] = ()):
        self.detok = IncrementalDecoder(tokenizer)
        self.stops = [s for s in [*stops, *turn_ends] if s]
        self.min_tokens = min_tokens
        self.included = {s for s in stops if s} if include else set()  # the stops the text ends with
        self.pushed = 0  # tokens pushed
        self.floor = 0  # characters of the first min_tokens - 1 tokens' text: a stop must end past them
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
            self.pushed += 1
            if self.pushed < self.min_tokens:
                self.floor = len(self.text)
            elif self._match():
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
        found = [(self.text.find(s, max(start, self.floor - len(s) + 1)), s) for s in self.stops]
        found = [(at, s) for at, s in found if at >= 0]
        if not found:
            return False
        at, self.matched = min(found)
        self.text = self.text[: at + len(self.matched) if self.matched in self.included else at]
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
    start, forwards = time.perf_counter(), Counter(FORWARDS)
    steps = decoder.generate(prompt_ids, max_tokens, seed)
    try:
        for event in steps:
            if text is not None:
                text.cut(event)
            tokens.extend(event.emitted)
            stats.add(event)
            stats.timed(time.perf_counter() - start)
            stats.count_threads(forwards)
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
        text = tokenizer.decode([token])
        return {"token": token, "text": text, "bytes": list(token_bytes(tokenizer, token, text)),
                "logprob": math.log(prob) if prob > 0 else None}

    records = []
    for token, node in zip(event.emitted, event.token_sources()):
        p = event.p[node]
        best = torch.topk(p, min(top, int((p > 0).sum()))) if top else None
        records.append({**entry(token, p), "top": [entry(int(t), p) for t in best.indices] if best is not None else []})
    return records


def reading_line(count: int):
    from rich.text import Text

    return Text(f"reading the prompt ({counted(count, 'token')})…", style="dim")


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


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a completion, carrying what it had produced by then: its tokens, statistics,
    last event and text (run_generate still writes them, and its --json record)."""

    def __init__(self, tokens: list[int], stats: Stats, events: list[StepEvent], text: str):
        super().__init__()
        self.tokens, self.stats, self.events, self.text = tokens, stats, events, text


def stop_text_of(tokenizer, profile, turn_ends: tuple[str, ...] = ()) -> StopText:
    """A completion's StopText with the profile's stop strings, min_tokens and include_stop (and
    rsd's own `turn_ends`, never included)."""
    sampling = profile["sampling"]
    return StopText(tokenizer, sampling["stop"], sampling["min_tokens"], sampling["include_stop"], turn_ends)


def context_end_note(context_length: int, prompt_tokens: int, answer_tokens: int, max_tokens: int) -> str:
    """The line that says why an answer is shorter than max_tokens without an end-of-sequence token or
    a stop string: the model's context ended it (StepEvent.finished "context")."""
    return (f"the answer stopped at the end of the model's context of {context_length} tokens ({prompt_tokens} of the "
            f"prompt, {answer_tokens} of the answer), before max_tokens {max_tokens}")


def stream_completion(pair, decoder, prompt_ids, max_tokens, seed, *, out, console=None, live=False,
                      write_text=True, keep_events=False, stop_text: StopText | None = None,
                      on_step=None, reading_note=False):
    """One completion with text streamed to `out` and, optionally, the live view on `console`.
    Returns (token ids, stats, events, text): the text ends at a stop string (stop_text: the
    completion's StopText, stop_text_of; None: no stop strings).

    With the live view on and stdout on the same terminal, the text is written once at the end
    (the live region would otherwise fight with it); piped stdout still streams. Without it,
    `reading_note` shows that a long prompt is being read (see ReadingNote) on a terminal console.
    Ctrl-C raises Interrupted, once the text generated so far is written (held back or not).
    """
    from rich.live import Live

    text = stop_text if stop_text is not None else StopText(pair.tokenizer)
    shown: list[str] = []
    hold_text = live and getattr(out, "isatty", lambda: False)()
    view = Live(console=console, transient=True, refresh_per_second=8) if live else nullcontext()
    noted = reading_note and not live and console is not None and console.is_terminal
    unread = decoder.unread(prompt_ids) if live or noted else 0  # (a chat's kept caches hold most of its prompt)
    note = ReadingNote(console, unread) if noted else None
    so_far: tuple[list[int], Stats, list[StepEvent]] = ([], Stats(), [])  # tokens, stats, last event: for Ctrl-C
    with view as display:
        if display is not None:  # until the first step: a long prompt takes seconds to read
            display.update(reading_line(unread), refresh=True)

        def on_event(event: StepEvent, stats: Stats) -> None:
            nonlocal so_far
            so_far = (so_far[0] + event.emitted, stats, [event])
            if note is not None:
                note.stop()
            piece = text.piece
            shown.append(piece)
            if write_text and not hold_text and piece:
                out.write(piece)
                out.flush()
            if display is not None:
                display.update(live_view("".join(shown), event, stats, pair.tokenizer, decoder.shape.describe()))
            if on_step is not None:
                on_step(event)

        interrupted = False
        try:
            tokens, stats, events = complete(decoder, prompt_ids, max_tokens, seed, on_event, keep_events, text)
        except KeyboardInterrupt:
            interrupted = True
            tokens, stats, events = so_far
        finally:
            if note is not None:
                note.stop()
    tail = text.flush()
    if write_text:
        out.write(("".join(shown) if hold_text else "") + tail)
        out.flush()
    whole = text.text if text.matched is not None else pair.tokenizer.decode(tokens, skip_special_tokens=True)
    if interrupted:
        raise Interrupted(tokens, stats, events, whole)
    return tokens, stats, events, whole


TOGETHER = ("ar", "auto")  # variants whose completions (--samples, --prompts) are decoded together
TOGETHER_AT_MOST = 64  # completions a forward takes at most (more go in groups, one after the other): rsd's C
# kernels take up to 64 rows, and a GPU's largest graph as many; each row's probabilities take ~0.6 MB
TOGETHER_KEYS = 8192  # ... and as many as the answers' tokens (-n each) stay within: each row's attention
# passes over every completion's keys, most of them masked. On the 2-core Xeon (the embedded pair, -n 256)
# 16 and 32 samples together took 1.3-1.6x the tokens a second of one after the other, 64 0.86x


def together_group(max_tokens: int) -> int:
    """How many completions to decode together at most, for answers of up to max_tokens tokens."""
    return max(2, min(TOGETHER_AT_MOST, TOGETHER_KEYS // max(max_tokens, 1)))


@dataclass
class Completion:
    """One completion's outcome, as run_generate reports it."""

    prompt: int  # which of the prompts it answers
    seed: int
    tokens: list[int]
    stats: Stats
    events: list[StepEvent]  # the last one, or every one for --stats
    text: str
    logprobs: list[dict]
    finish_reason: str | None  # as StepEvent.finished, or "interrupted"
    stop: str | None


def run_generate(pair, profile, text: str | list[str], *, system=None, raw=False, samples=1, as_json=False,
                 show_stats=True, step_table=False, live=False, console=None, out=None, logprobs: int = 0) -> None:
    """Every sample's text (or --json record) on `out`, its statistics on `console`: `samples` of the
    prompt `text`, or of each prompt in a list (--prompts: prompt by prompt, each record saying
    which). Several completions of `ar` or `auto` are decoded together (run_together), others one
    after the other; completion i takes the seed --seed + i."""
    out = out or sys.stdout
    decoder = make_decoder(pair, profile)
    many = not isinstance(text, str)
    prompt_ids = [encode_prompt(pair.tokenizer, t, system=system, raw=raw) for t in (text if many else [text])]
    if many:  # (every prompt before the first answer: one past the context stopped the run there, those after it
        check_prompts(prompt_ids, decoder.context_length, decoder.vocab_size)  # never answered)
    base_seed = seed_of(profile)
    if base_seed is None:  # a fresh seed, drawn here so that --json can say which: --seed N reproduces the run
        base_seed = fresh_seed()
    asked = [k for k in range(len(prompt_ids)) for _ in range(samples)]  # each completion's prompt
    seeds = [base_seed + index for index in range(len(asked))]

    def report(completion: Completion, shape: str, together: int) -> None:
        if as_json:
            record = {
                "text": completion.text,
                "token_ids": completion.tokens,
                "profile": profile.name,
                "variant": decoder.shape.variant,
                "shape": shape,
                "runtime": decoder.runtimes.describe(),
                "placement": pair.placement,
                "seed": completion.seed,
                **({"prompt_index": completion.prompt} if many else {}),
                "prompt_tokens": len(prompt_ids[completion.prompt]),
                "samples_together": together,
                "finish_reason": completion.finish_reason,
                "stop": completion.stop,
                "stats": completion.stats.as_dict(pair.draft_params, pair.target_params),
            }
            if logprobs:
                record["logprobs"] = completion.logprobs[:len(completion.tokens)]  # (an interrupted step's: left out)
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
        else:
            out.write("\n")
        out.flush()
        if completion.finish_reason == "context":  # (else a short answer and no reason: said, --json or not)
            pair.notice(context_end_note(pair.context_length, len(prompt_ids[completion.prompt]),
                                         len(completion.tokens), profile["sampling"]["max_tokens"]))
        if console is not None:
            if step_table and completion.finish_reason != "interrupted":
                print_table(console, lambda width: steps_table(completion.events, pair.tokenizer, width))
            if show_stats and completion.stats.steps:
                console.print(f"[dim]{summary_line(completion.stats, shape)}[/dim]")

    max_tokens = profile["sampling"]["max_tokens"]
    if len(asked) > 1 and decoder.shape.variant in TOGETHER and decoder.limit is None \
            and not any(decoder.crosses_long_factors(prompt_ids[k], max_tokens) for k in asked):
        size = together_group(max_tokens)
        for first in range(0, len(asked), size):
            if first and not as_json:
                out.write("\n---\n")
            group = slice(first, first + size)
            run_together(pair, profile, decoder, [prompt_ids[k] for k in asked[group]], seeds[group], asked[group],
                         as_json=as_json, out=out, report=report, logprobs=logprobs, keep_events=step_table,
                         console=console if show_stats else None)
        return
    decoder.keep_caches = len(asked) > 1  # later samples read only what the caches do not hold (the prompt)
    try:  # (the caches the last sample left go back at the end)
        for index, (asking, seed) in enumerate(zip(asked, seeds)):
            if not as_json and index:
                out.write("\n---\n")
            token_records: list[dict] = []
            interrupted = None
            try:
                tokens, stats, events, text_out = stream_completion(
                    pair, decoder, prompt_ids[asking], max_tokens, seed, out=out, console=console,
                    live=live and not as_json, write_text=not as_json, keep_events=step_table,
                    stop_text=stop_text_of(pair.tokenizer, profile),
                    on_step=(lambda event: token_records.extend(token_logprobs(event, logprobs, pair.tokenizer)))
                    if logprobs else None)
            except Interrupted as e:  # Ctrl-C: what was generated is still reported, then rsd exits 130
                interrupted, (tokens, stats, events, text_out) = e, (e.tokens, e.stats, e.events, e.text)
            finish = "interrupted" if interrupted else events[-1].finished if events else None
            report(Completion(asking, seed, tokens, stats, events, text_out, token_records, finish,
                              events[-1].stop if events else None), decoder.shape.describe(), 1)
            if interrupted:
                raise interrupted
    finally:
        if decoder.kept is not None:
            decoder.kept.release()


def run_together(pair, profile, decoder, prompt_ids: list[list[int]], seeds: list[int], asked: list[int], *,
                 as_json: bool, out, report: Callable[[Completion, str, int], None], logprobs: int = 0,
                 keep_events: bool = False, console=None) -> None:
    """Completions of `ar` or `auto` decoded together, one per seed, of its prompt (prompt_ids; asked:
    which prompt it is, for its report) (Decoder.generate_together: a forward of one row per
    unfinished completion; `auto` decodes them plainly, since a row for another completion's token,
    always kept, pays more than a row for a draft). Reported in order, as one after the other would
    be: the first one's text streams, each next one's from where it has got to once the one before is
    reported. Ctrl-C reports every completion's tokens so far, then raises KeyboardInterrupt."""
    tokenizer, count = pair.tokenizer, len(seeds)
    texts = [stop_text_of(tokenizer, profile) for _ in seeds]
    tokens: list[list[int]] = [[] for _ in seeds]
    stats = [Stats() for _ in seeds]
    events: list[list[StepEvent]] = [[] for _ in seeds]
    token_records: list[list[dict]] = [[] for _ in seeds]
    finish: list[str | None] = [None] * count
    pending = [""] * count  # text of a completion not shown yet
    ended: set[int] = set()  # completions ended at a stop string (the engine leaves them out)
    reported = 0
    shape = "ar"

    def show(j: int, piece: str) -> None:
        if as_json:
            return
        if j == reported:
            out.write(piece)
            out.flush()
        else:
            pending[j] += piece

    def report_finished() -> None:
        nonlocal reported
        while reported < count and finish[reported] is not None:
            j = reported
            last = events[j][-1] if events[j] else None
            whole = texts[j].text if texts[j].matched is not None else tokenizer.decode(tokens[j],
                                                                                       skip_special_tokens=True)
            report(Completion(asked[j], seeds[j], tokens[j], stats[j], events[j], whole, token_records[j],
                              finish[j], last.stop if last is not None else None), shape, count)
            reported += 1
            if reported < count and not as_json:
                out.write("\n---\n" + pending[reported])
                pending[reported] = ""
                out.flush()

    max_tokens = profile["sampling"]["max_tokens"]
    start, forwards = time.perf_counter(), Counter(FORWARDS)
    steps = decoder.generate_together(prompt_ids, max_tokens, seeds, ended)  # (a prompt per completion)
    try:
        for step_events in steps:
            now = time.perf_counter() - start
            for j, event in enumerate(step_events):
                if event is None:
                    continue
                texts[j].cut(event)  # (a stop string ends the completion: finished "stop")
                tokens[j].extend(event.emitted)
                stats[j].add(event)
                stats[j].timed(now)
                stats[j].count_threads(forwards)  # (the forwards it shared with the others)
                if not keep_events:
                    events[j].clear()
                events[j].append(event)
                if logprobs:
                    token_records[j].extend(token_logprobs(event, logprobs, tokenizer))
                show(j, texts[j].piece)
                if event.finished:
                    ended.add(j)
                    show(j, texts[j].flush())
                    finish[j] = event.finished
            report_finished()
    except KeyboardInterrupt:
        for j in range(count):
            if finish[j] is None:
                show(j, texts[j].flush())
                finish[j] = "interrupted"
        report_finished()
        raise
    finally:
        steps.close()
    if console is not None and count > 1:
        total, wall = sum(len(t) for t in tokens), time.perf_counter() - start
        console.print(f"[dim]{count} completions decoded together · {counted(total, 'token')} · {wall:.2f}s · "
                      f"{total / wall if wall else 0.0:.1f} tok/s in all[/dim]")
