"""`rsd inspect-tree`: one decoding step in full, as text, JSON or SVG."""

from __future__ import annotations

import torch

from .engine import StepEvent
from .prompting import counted, token_bytes
from .render import MARKERS, STYLES, ItemsLine, draw_order, node_probs, token_label, tree_view


def optimal_root_acceptance(p: torch.Tensor, q: torch.Tensor, k: int, iid: bool) -> float | None:
    """The optimal-transport bound on P(accept a root child) for k drafts from q.

    1 + min over token sets H of [p(H) - Q(H)], Q(H) = P(all k drafts fall in H); the
    minimising H is a prefix of the tokens sorted by p/q. Cheap for one draft and for i.i.d.
    drafts (Q(H) = q(H)^k); for k > 1 drafts without replacement we return None.
    """
    if k > 1 and not iid:
        return None
    p, q = p.double(), q.double()
    ratio = torch.where(q > 0, p / q, torch.full_like(p, float("inf")))
    order = torch.argsort(ratio)
    p_h, q_h = p[order].cumsum(0), q[order].cumsum(0)
    gaps = p_h - q_h.clamp(max=1.0) ** k
    return float(1 + min(0.0, float(gaps.min())))


def token_fields(tokenizer, token: int) -> dict:
    """A token's text and bytes (exact where the text holds part of a character); None without a tokenizer."""
    if not tokenizer:
        return {"text": None, "bytes": None}
    text = tokenizer.decode([token])
    return {"text": text, "bytes": list(token_bytes(tokenizer, token, text))}


def step_record(event: StepEvent, tokenizer) -> dict:
    """Everything about a step, JSON-ready."""
    nodes = []
    for node in range(len(event.tree)):
        entry = {"id": node, "token": event.tree.tokens[node],
                 **token_fields(tokenizer, event.tree.tokens[node]),
                 "parent": event.tree.parents[node], "depth": event.tree.depths[node],
                 "status": event.status(node)}
        if node:
            q, p = node_probs(event, node)
            entry |= {"q": q, "p": p, "draw_order": draw_order(event, node)}
        nodes.append(entry)
    checks = []
    for check in event.checks:
        accept = check.plan.accept_probabilities()
        rejected = []
        for k in range(check.decision.tried):
            if check.decision.accepted == k:
                break
            residual = check.plan.residuals[k]
            top = torch.topk(residual, min(5, residual.numel()))
            rejected.append({"node": check.draws[k], "accept_probability": accept[k],
                             "residual_top": [{"token": int(t), **token_fields(tokenizer, int(t)), "probability": float(v)}
                                              for v, t in zip(top.values, top.indices)]})
        checks.append({"node": check.node, "tried": check.decision.tried, "accepted": check.decision.accepted,
                       "accept_probabilities": accept[: check.decision.tried], "rejections": rejected})
    root_draws = event.tree.draws[0]
    bound = None
    if root_draws:
        bound = optimal_root_acceptance(event.p[0], event.tree.q[0], len(root_draws),
                                        iid=event.shape.variant in ("mss", "spectr"))
    accept_here = None
    if event.checks:
        reject_all = 1.0
        for a in event.checks[0].plan.accept_probabilities():
            reject_all *= 1 - a
        accept_here = 1 - reject_all
    return {"step": event.step, "shape": event.shape.describe(), "nodes": nodes, "checks": checks,
            "path": event.path, "extra": {"kind": event.extra_kind, "token": event.extra_token,
                                          **token_fields(tokenizer, event.extra_token)},
            "emitted": event.emitted, "root_acceptance_this_tree": accept_here,
            "root_acceptance_optimal_transport_bound": bound}


def step_renderables(event: StepEvent, tokenizer):
    """Rich renderables for the text and SVG formats."""
    from rich.table import Table
    from rich.text import Text

    record = step_record(event, tokenizer)
    table = Table(title=f"step {event.step} · {event.shape.describe()} · {counted(len(event.tree), 'node')}",
                  title_justify="left")
    for col in ("node", "depth", "parent", "token", "tried", "q", "p", "status"):
        table.add_column(col, justify="right" if col in ("node", "depth", "parent", "tried", "q", "p") else "left")
    for n in record["nodes"]:
        status = n["status"]
        table.add_row(str(n["id"]), str(n["depth"]), str(n["parent"]) if n["parent"] >= 0 else "-",
                      token_label(tokenizer, n["token"], 20), f"#{n['draw_order']}" if n["id"] else "",
                      f"{n['q']:.3f}" if n["id"] else "", f"{n['p']:.3f}" if n["id"] else "",
                      Text(f"{MARKERS[status]} {status}", style=STYLES[status]))
    rejections = []
    for check in record["checks"]:
        for rej in check["rejections"]:
            top = [f"{token_label(tokenizer, r['token'], 12)} {r['probability']:.2f}" for r in rej["residual_top"]]
            rejections.append(ItemsLine(f"rejected node {rej['node']} (accept prob {rej['accept_probability']:.3f}); "
                                        "residual top:", top))
    lines = []
    extra = record["extra"]
    lines.append(f"{extra['kind']} token: {token_label(tokenizer, extra['token'], 20)}")
    if record["root_acceptance_this_tree"] is not None:
        lines.append(f"P(accept a root child | this tree) = {record['root_acceptance_this_tree']:.3f}")
    if record["root_acceptance_optimal_transport_bound"] is not None:
        lines.append(f"optimal-transport bound on root acceptance = "
                     f"{record['root_acceptance_optimal_transport_bound']:.3f}")
    emitted = tokenizer.decode(event.emitted) if tokenizer else str(event.emitted)
    lines.append(f"emitted: {emitted!r}")
    return [tree_view(event, tokenizer), table, *rejections, Text("\n".join(lines))]


def run_inspect(pair, profile, text: str, *, step: int, fmt: str, output, system, raw, console) -> None:
    import json
    import sys

    from rich.console import Console

    from .errors import RsdError
    from .prompting import encode_prompt
    from .generation import stop_text_of
    from .runtime import make_decoder, seed_of

    decoder = make_decoder(pair, profile)
    ids = encode_prompt(pair.tokenizer, text, system=system, raw=raw)
    seed = seed_of(profile)
    stop = stop_text_of(pair.tokenizer, profile)
    event = None
    for event in decoder.generate(ids, max_tokens=10**9, seed=0 if seed is None else seed):
        stop.cut(event)  # generation ends at a stop string, as in generate
        if event.step == step or event.finished:
            break
    if event is None or event.step != step:
        last = event.step if event else 0
        raise RsdError(f"generation ended after {counted(last, 'step')}, before step {step}")
    if fmt == "json":
        sys.stdout.write(json.dumps(step_record(event, pair.tokenizer), ensure_ascii=False) + "\n")
    elif fmt == "text":
        out = Console(highlight=False)
        for part in step_renderables(event, pair.tokenizer):
            out.print(part)
    else:
        path = output or __import__("pathlib").Path(f"rsd-step-{step}.svg")
        recorder = Console(record=True, width=110, file=open(__import__("os").devnull, "w"), highlight=False)
        for part in step_renderables(event, pair.tokenizer):
            recorder.print(part)
        try:
            recorder.save_svg(str(path), title=f"rsd inspect-tree · step {step}")
        except OSError as e:
            raise RsdError(f"cannot write {path}: {e.strerror or e}") from None
        console.print(f"wrote {path}")
    variant = profile["decoding"]["variant"]
    if len(event.tree) == 1 and variant in ("auto", "lookup"):  # a plain step: nothing was drafted to show
        why = "auto chose plain decoding for it" if variant == "auto" else "the context had no n-gram to look up"
        console.print(f"step {step} drafted nothing ({why}); -v sd, rsd-c or rsd-s shows a drafted tree",
                      highlight=False)
