"""Rich renderables and plain-text summaries built from engine events and stats. No maths here."""

from __future__ import annotations

from .engine import Stats, StepEvent


def stats_line(stats: Stats) -> str:
    per_depth = " ".join(f"{a:.2f}" for a in stats.acceptance_per_depth) or "-"
    return (
        f"{stats.steps} steps · {stats.new_tokens} tokens · block efficiency {stats.block_efficiency:.2f} · "
        f"acceptance {stats.acceptance_rate:.2f} (per depth {per_depth}) · {stats.tokens_per_second:.1f} tok/s · "
        f"draft {stats.draft_seconds:.2f}s · verify {stats.verify_seconds:.2f}s"
    )


def token_label(tokenizer, token: int, width: int = 16) -> str:
    """A token as a short readable literal: whitespace visible, never wider than `width`."""
    text = tokenizer.decode([token]) if tokenizer is not None else str(token)
    shown = repr(text)[1:-1]
    return shown if len(shown) <= width else shown[: width - 1] + "…"


def steps_table(events: list[StepEvent], tokenizer=None):
    from rich.table import Table

    table = Table(title="per-step statistics", title_justify="left")
    for col in ("step", "nodes", "accepted", "emitted", "kind", "draft ms", "verify ms", "text"):
        table.add_column(col, justify="right" if col not in ("kind", "text") else "left")
    for e in events:
        text = tokenizer.decode(e.emitted) if tokenizer is not None else " ".join(map(str, e.emitted))
        table.add_row(str(e.step), str(len(e.tree)), str(e.accepted), str(len(e.emitted)), e.extra_kind,
                      f"{e.draft_seconds * 1000:.0f}", f"{e.verify_seconds * 1000:.0f}", repr(text)[1:-1][:40])
    return table
