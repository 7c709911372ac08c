"""Rich renderables and plain-text summaries built from engine events and stats. No maths here."""

from __future__ import annotations

from .engine import Stats, StepEvent
from .prompting import counted


def stats_line(stats: Stats, configured: str | None = None) -> str:
    """The one-line summary; it names the shapes drafted when they are not just `configured`."""
    per_depth = " ".join(f"{a:.2f}" for a in stats.acceptance_per_depth) or "-"
    used = stats.shapes_used()
    shapes = ""
    if len(used) > 1 or [name for name, _ in used] not in ([], [configured]):
        shapes = "shapes " + ", ".join(f"{name} ×{n}" for name, n in used[:3]) + (", …" if len(used) > 3 else "") + " · "
    if stats.target_tokens == stats.steps:  # nothing drafted (ar, or auto decoding plainly): no acceptance to tell
        return shapes + (
            f"{counted(stats.steps, 'step')} · {counted(stats.new_tokens, 'token')} · block efficiency "
            f"{stats.block_efficiency:.2f} · {stats.tokens_per_second:.1f} tok/s{after_the_prompt(stats)} · "
            f"target {stats.verify_seconds:.2f}s"
        ) + fewer_threads(stats)
    return shapes + (
        f"{counted(stats.steps, 'step')} · {counted(stats.new_tokens, 'token')} · "
        f"block efficiency {stats.block_efficiency:.2f} · "
        f"acceptance {stats.acceptance_rate:.2f} (per depth {per_depth}) · {stats.tokens_per_second:.1f} tok/s"
        f"{after_the_prompt(stats)} · draft {stats.draft_seconds:.2f}s · verify {stats.verify_seconds:.2f}s"
    ) + fewer_threads(stats)


def after_the_prompt(stats: Stats) -> str:
    """" (first token after 12.1 s, then 95.3 tok/s)" where the first token took at least half the run's
    time (a long prompt read: the rate over the whole run says little of the answer's), else nothing."""
    if stats.steps < 2 or stats.first_token_seconds < stats.wall_seconds / 2:
        return ""
    return f" (first token after {stats.first_token_seconds:.1f} s, then {stats.tokens_per_second_after_first:.1f} tok/s)"


def fewer_threads(stats: Stats) -> str:
    """" · forwards on 1 of 2 threads" where some of the run's forwards ran on fewer threads than the CPU's
    count (other processes held cores: threads.Governor), else nothing."""
    used = list(stats.forward_threads)
    if not used or min(used) >= stats.cpu_threads:
        return ""
    low, high = min(used), max(used)
    return f" · forwards on {low if low == high else f'{low}-{high}'} of {stats.cpu_threads} threads"


def token_label(tokenizer, token: int, width: int = 16) -> str:
    """A token as a short readable literal: whitespace visible, part of a character as \\xNN bytes
    (prompting.token_text_shown), never wider than `width`."""
    from .prompting import token_text_shown

    if tokenizer is None:
        shown = repr(str(token))
    else:
        text = tokenizer.decode([token])
        shown = token_text_shown(tokenizer, token, "repr", text) if text else f"<{token}>"
    return shown if len(shown) <= width else shown[: width - 1] + "…"


class ItemsLine:
    """`lead` and then `items`, separated by commas, wrapped between two items and never inside one (a
    token label such as ' the' holds a space, at which Rich's own wrapping would cut it); a continuation
    line starts two spaces in."""

    def __init__(self, lead: str, items: list[str]):
        self.lead, self.items = lead, items

    def __rich_console__(self, console, options):
        from rich.cells import cell_len
        from rich.text import Text

        line = self.lead
        for i, item in enumerate(self.items):
            piece = item + ("," if i < len(self.items) - 1 else "")
            if cell_len(f"{line} {piece}") > options.max_width:
                yield Text(line)
                line = "  " + piece
            else:
                line = f"{line} {piece}"
        yield Text(line)


PIPED_WIDTH = 200  # the most columns a table takes in a file or a pipe


def print_table(console, table_for) -> None:
    """table_for(width): a table made to fit `width` columns (fitted_table), printed on a terminal at its
    width, into a file or a pipe at the table's own width up to PIPED_WIDTH (where Rich would squeeze it
    into 80 columns and cut its cells: "corre…")."""
    if console.is_terminal:
        console.print(table_for(console.width))
        return
    width, console.width = console.width, PIPED_WIDTH
    try:
        console.print(table_for(PIPED_WIDTH))
    finally:
        console.width = width


def fitted_table(title: str, columns: dict[str, str], rows: list[dict[str, str]], width: int | None = None, *,
                 left: tuple[str, ...] = (), folded: str | None = None, shared: tuple[str, ...] = (),
                 spare: tuple[str, ...] = ()):
    """A Rich table of `rows` (each a cell per column key) under `columns` (key -> header; `left` ones
    left-justified, the rest right), no cell cut. With `width`, one that fits it: where it is wider,
    columns empty ("-") in every row are left out first, then a `shared` column whose cells are all one
    value is said once in the title ("rsd bench · T 1.00"), then the `spare` columns in their order,
    named in a caption. The `folded` column wraps its cells and counts at its header's width, or 12.
    Squeezed instead, Rich cut every cell to a character or two ("v…", "1.…")."""
    from rich.cells import cell_len
    from rich.table import Table

    keys, left_out = list(columns), []

    def natural(key: str) -> int:
        longest = max([cell_len(columns[key])] + [cell_len(row[key]) for row in rows])
        return min(longest, max(12, cell_len(columns[key]))) if key == folded else longest

    def fits() -> bool:  # (each column: its cells and a space each side, a rule before it; a rule after the last)
        return width is None or sum(natural(key) + 3 for key in keys) + 1 <= width

    for key in list(keys):
        if not fits() and rows and all(row[key] == "-" for row in rows):
            keys.remove(key)
    for key in shared:
        if not fits() and key in keys and rows and len({row[key] for row in rows}) == 1:
            keys.remove(key)
            title += f" · {columns[key]} {rows[0][key]}"
    for key in spare:
        if not fits() and key in keys:
            keys.remove(key)
            left_out.append(columns[key])
    caption = f"left out at this width: {', '.join(left_out)} (a wider terminal shows them)" if left_out else None
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    for key in keys:
        table.add_column(columns[key], justify="left" if key in left else "right", no_wrap=key != folded,
                         overflow="fold" if key == folded else "ellipsis")
    for row in rows:
        table.add_row(*[row[key] for key in keys])
    return table


def steps_table(events: list[StepEvent], tokenizer=None, width: int | None = None):
    """--stats: a row per step (where it is wider than `width` and every step had the same shape, that shape
    said once in the title)."""
    columns = {"step": "step", "shape": "shape", "nodes": "nodes", "accepted": "accepted", "emitted": "emitted",
               "kind": "kind", "draft": "draft ms", "verify": "verify ms", "text": "text"}
    rows = []
    for e in events:
        text = tokenizer.decode(e.emitted) if tokenizer is not None else " ".join(map(str, e.emitted))
        rows.append({"step": str(e.step), "shape": e.shape.describe(), "nodes": str(len(e.tree)),
                     "accepted": str(e.accepted), "emitted": str(len(e.emitted)), "kind": e.extra_kind,
                     "draft": f"{e.draft_seconds * 1000:.0f}", "verify": f"{e.verify_seconds * 1000:.0f}",
                     "text": repr(text)[1:-1][:40]})
    return fitted_table("per-step statistics", columns, rows, width, left=("shape", "kind", "text"), folded="text",
                        shared=("shape",), spare=("draft", "verify", "nodes", "emitted"))


MARKERS = {"root": "●", "accepted": "✓", "rejected": "✗", "not reached": "·"}
STYLES = {"root": "bold", "accepted": "bold green", "rejected": "red", "not reached": "dim"}


def node_probs(event: StepEvent, node: int) -> tuple[float, float]:
    """(q, p) of a drafted node's token at its parent."""
    parent, token = event.tree.parents[node], event.tree.tokens[node]
    return float(event.tree.q[parent][token]), float(event.p[parent][token])


def draw_order(event: StepEvent, node: int) -> int:
    """1-based position of the node among its parent's draws (its first draw if repeated)."""
    return event.tree.draws[event.tree.parents[node]].index(node) + 1


def tree_view(event: StepEvent, tokenizer=None, max_children: int | None = None):
    """The step's draft tree as a Rich Tree; markers tell the states apart without colour."""
    from rich.text import Text
    from rich.tree import Tree

    def label(node: int) -> Text:
        status = event.status(node)
        text = Text(f"{MARKERS[status]} {token_label(tokenizer, event.tree.tokens[node])}", style=STYLES[status])
        if node:
            q, p = node_probs(event, node)
            text.append(f"  #{draw_order(event, node)} q={q:.2f} p={p:.2f}", style="dim")
        return text

    def grow(branch, node: int) -> None:
        children = event.tree.children(node)
        shown = children if max_children is None else children[:max_children]
        for child in shown:
            grow(branch.add(label(child)), child)
        if len(shown) < len(children):
            branch.add(Text(f"… {len(children) - len(shown)} more", style="dim"))

    root = Tree(label(0), guide_style="dim")
    grow(root, 0)
    extra = "+" if event.extra_kind == "bonus" else "↳"
    root.add(Text(f"{extra} {event.extra_kind} {token_label(tokenizer, event.extra_token)}", style="bold cyan"))
    return root


def summary_line(stats: Stats, configured: str) -> str:
    """The statistics line after an answer: the shape asked for, then stats_line."""
    return f"{configured} · {stats_line(stats, configured)}"


def live_view(text: str, event: StepEvent | None, stats: Stats, tokenizer=None, configured: str | None = None):
    """What the live display shows during `rsd generate` on a terminal (its statistics line as the one after
    the answer, where the shape asked for is given)."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.text import Text

    parts = [Panel(Text(text[-2000:] or "…"), title="answer", title_align="left")]
    if event is not None:
        parts.append(Panel(tree_view(event, tokenizer, max_children=4), title=f"step {event.step}: "
                           f"{event.shape.describe()} draft tree "
                           f"({counted(len(event.tree), 'node')}, {event.accepted} accepted)", title_align="left"))
    parts.append(Text(summary_line(stats, configured) if configured else stats_line(stats), style="dim"))
    return Group(*parts)
