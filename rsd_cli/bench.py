"""`rsd bench`: the variants side by side on one prompt set, interleaved, against `ar` measured
in the same run (and transformers' assisted generation as the peer a user would pick)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

from .drafting import LOOKUP_NGRAM, Shape, make_shape, shape_for_budget
from .engine import Stats
from .errors import UsageError
from .generation import complete, stop_text_of
from .prompting import encode_prompt


@dataclass(frozen=True)
class Setting:
    temperature: float
    budget: int | None  # fixed target budget regime
    depth: int | None  # fixed draft length regime

    def shape(self, variant: str, width: int, ngram: int = LOOKUP_NGRAM) -> Shape:
        if variant == "ar":
            return make_shape("ar")
        if self.budget is not None:
            return shape_for_budget(variant, self.budget, ngram)
        depth = self.depth
        return make_shape(variant, draft_len=depth, branching=(width,) + (1,) * (depth - 1), beam_width=width,
                          depth=depth, num_drafts=width, ngram=ngram)


def settings_for(temperatures, budgets, depths) -> list[Setting]:
    out = []
    for t in temperatures:
        out += [Setting(t, b, None) for b in budgets] + [Setting(t, None, d) for d in depths]
    return out


def _padded_head(head, vocab_size: int):
    """A reduced draft head whose logits are padded to the whole vocabulary with -inf (q = 0),
    for transformers' assisted generation, which compares draft and target logits position by position."""
    import torch

    from .engine import full_vocabulary

    class PaddedHead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = head

        def forward(self, hidden):
            return full_vocabulary(self.head(hidden), vocab_size)

    return PaddedHead()


def _assisted(pair, ids: list[int], temperature: float, max_tokens: int, seed: int, **stopping) -> tuple[int, float]:
    """transformers' own assisted generation, same target, draft and sampling: (new tokens, seconds)."""
    head = pair.draft.get_output_embeddings()
    if head.weight.shape[0] >= pair.vocab_size:
        return _hf_generate(pair, ids, temperature, max_tokens, seed, assistant_model=pair.draft, **stopping)
    pair.draft.lm_head = _padded_head(head, pair.vocab_size)  # a reduced head: same draft, logits padded
    try:
        return _hf_generate(pair, ids, temperature, max_tokens, seed, assistant_model=pair.draft, **stopping)
    finally:
        pair.draft.lm_head = head


def _hf_static(pair, ids: list[int], temperature: float, max_tokens: int, seed: int, **stopping) -> tuple[int, float]:
    """transformers' generate with a static cache (what a GPU user would pick; it compiles the
    forward on CUDA by itself), the target alone: (new tokens, seconds)."""
    return _hf_generate(pair, ids, temperature, max_tokens, seed, cache_implementation="static", **stopping)


def _hf_generate(pair, ids: list[int], temperature: float, max_tokens: int, seed: int, min_tokens: int = 0,
                 ends: frozenset = frozenset(), **options) -> tuple[int, float]:
    """transformers' generate on the target with rsd's sampling and stop tokens: (new tokens, seconds);
    ends: the tokens that end an answer (the pair's end-of-sequence tokens where none are given);
    min_tokens: none of them before that many (transformers' min_new_tokens)."""
    import torch

    from .models import input_device

    torch.manual_seed(seed)
    ends = sorted(ends or pair.eos_ids)
    inputs = torch.tensor([ids], device=input_device(pair.target))
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False)
    if min_tokens:
        sampling["min_new_tokens"] = min(min_tokens, max_tokens)
    start = time.perf_counter()
    with torch.inference_mode():
        out = pair.target.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_tokens,
                                   eos_token_id=ends, pad_token_id=sorted(pair.eos_ids or ends)[0],
                                   **sampling, **options)
    if inputs.device.type == "cuda":
        torch.cuda.synchronize(inputs.device)
    return out.shape[1] - inputs.shape[1], time.perf_counter() - start


PEERS = {"hf-assisted": ("transformers assisted generation", lambda *args, **stopping: _assisted(*args, **stopping)),
         "hf-static": ("transformers generate, static cache", lambda *args, **stopping: _hf_static(*args, **stopping))}


def plan_jobs(profile, variants: list[str], temperatures: list[float], budgets: list[int], depths: list[int],
              width: int | None = None, vocab_size: int | None = None,
              context_length: int | None = None) -> list[tuple[str, Setting, Shape]]:
    """(variant, setting, shape) for every run on a prompt; `ar` is always there: it is the baseline.
    width: the trees' width at --depths (None: the profile's beam_width). With the models' vocabulary
    and context, every tree is one they take, as in generate (runtime.shape_of): else an error naming
    the bench flag (or the profile's setting) that set it."""
    from .runtime import larger_than_the_context, setting_error, shape_of, wider_than_the_vocabulary

    flagged_width = width is not None
    width = width if flagged_width else profile["decoding"]["beam_width"]
    jobs = [("ar", Setting(t, None, None), make_shape("ar")) for t in temperatures]
    if "auto" in variants and (budgets or depths):
        jobs += [("auto", Setting(t, None, None), shape_of(as_variant(profile, "auto"), vocab_size, context_length))
                 for t in temperatures]
    for setting in settings_for(temperatures, budgets, depths) or [Setting(t, None, None) for t in temperatures]:
        for variant in variants:
            if variant == "ar" or variant == "auto" and (setting.budget or setting.depth):
                continue  # auto ignores --depths (it picks its own) and runs once per temperature
            if setting.budget is None and setting.depth is None:  # the profile's own shape
                jobs.append((variant, setting, shape_of(as_variant(profile, variant), vocab_size, context_length)))
                continue
            shape = setting.shape(variant, width, profile["decoding"]["ngram"])
            if vocab_size is not None and (wide := wider_than_the_vocabulary(shape, vocab_size)):
                if flagged_width:
                    raise UsageError(f"--width: {wide}")
                raise setting_error(profile, "decoding", "beam_width", f"{wide} (bench's --width at --depths)")
            if large := larger_than_the_context(shape, context_length, setting.budget):
                raise UsageError(f"{'--budgets' if setting.budget is not None else '--depths'}: {large}")
            jobs.append((variant, setting, shape))
    return jobs


def as_variant(profile, variant: str):
    """A copy of the profile that decodes with `variant` (the bench's profile itself is not changed)."""
    from copy import deepcopy

    from .runtime import apply_flags

    return apply_flags(deepcopy(profile), {"variant": variant})


def run_bench(pair, profile, *, variants: list[str], temperatures: list[float], budgets: list[int],
              depths: list[int], prompts: list[str], repeats: int, max_tokens: int, seed: int,
              assisted: bool, progress=None, compiles: list[str] | None = None, hf_static: bool = False,
              runtimes: dict | None = None, refused_rows: bool = True, width: int | None = None) -> list[dict]:
    """Every job (variant x setting; width: the trees' at --depths, plan_jobs) under every --compile
    setting in `compiles` (runtimes: setting -> engine.Runtimes), interleaved prompt by prompt, plus the
    peers asked for. A job the pair takes on one runtime and not on another (a tree of an ALiBi model on
    transformers' forward: engine.pair_limit) runs where it is taken; where not, it has a row with the
    refusal as its error (`refused_rows`), or none."""
    from .engine import Decoder, Runtimes, check_prompts, pair_limit
    from .models import input_device
    from .runtime import ends_of, sampling_of

    compiles = compiles or [pair.runtimes.setting if pair.runtimes else "off"]
    runtimes = runtimes or {compiles[0]: pair.runtimes or Runtimes()}
    jobs = [(c, *job) for c in compiles for job in plan_jobs(profile, variants, temperatures, budgets, depths, width)]
    limits = {c: pair_limit(pair.target, pair.draft, runtimes[c]) for c in compiles}

    def refusal(compile: str, variant: str) -> str | None:
        found = limits[compile]
        if found is None or variant == "auto" or variant in found[0].variants:  # (auto: among what it takes)
            return None
        return found[0].refusal(variant, found[1], "--variants")

    decided = [(job, refusal(*job[:2])) for job in jobs]
    refused = [(job, reason) for job, reason in decided if reason is not None]
    jobs = [job for job, reason in decided if reason is None]
    peers = [name for name, wanted in (("hf-assisted", assisted), ("hf-static", hf_static)) if wanted]
    totals: dict[tuple, Stats] = {}  # (compile, variant, setting, shape) -> totals over prompts and repeats
    peer_totals: dict[tuple[str, float], list[float]] = {(p, t): [0, 0.0] for p in peers for t in temperatures}
    per_prompt: dict[tuple, dict[tuple, float]] = {}  # a job's or a peer's key -> (repeat, prompt) -> tokens/s
    peer_errors: dict[str, str] = {}  # a peer failing must not cost the other rows
    encoded = [encode_prompt(pair.tokenizer, p) for p in prompts]
    check_prompts(encoded, pair.context_length, pair.vocab_size)  # (before anything is measured)
    base = sampling_of(profile)  # (every row at its own temperature)
    stops = profile["sampling"]["stop"]  # completions end at them, as in generate (peers ignore them)
    min_tokens = base.min_tokens  # (peers too: no end-of-sequence token before it)
    ends = frozenset(ends_of(pair, profile))  # (the stop tokens too, for the peers as for the rows)
    runs = repeats * len(encoded) * (len(jobs) + len(peers) * len(temperatures))
    done = 0

    def decoder_for(compile: str, setting: Setting, shape: Shape) -> Decoder:
        return Decoder(pair.target, pair.draft, pair.vocab_size, shape, replace(base, temperature=setting.temperature),
                       set(ends), pair.context_length, runtimes[compile], pair.notice)

    def tick() -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, runs)

    # warm-up, untimed: the first forwards of a process pay for page faults on the weights, kernel
    # set-up and (compiled runtime, static-cache peer) compiles of shapes not yet seen, which would
    # otherwise land on whichever row runs first
    if encoded:
        for compile, _, setting, shape in jobs:
            # CUDA graphs replay on buffers sized for a generation's prompt and answer: a short warm-up
            # left the first timed rows growing them and capturing their graphs again (an H100's `ar`
            # at 131-154 tok/s in the first row of a run, 690-720 in the next): there each job is warmed
            # at the timed length on the longest prompt
            graphed = any(getattr(r, "graphed", False) for r in (runtimes[compile].target, runtimes[compile].draft))
            complete(decoder_for(compile, setting, shape), max(encoded, key=len) if graphed else encoded[0],
                     max_tokens if graphed else min(max_tokens, 8), seed)
        for name in peers:
            # transformers' static-cache generate compiles on a GPU, for its cache's length and again
            # when a second length makes it dynamic: warmed at the timed runs' length on two prompts
            # (on an H100 an 8-token warm-up left ~30 s of compiling in the first timed run)
            compiling = name == "hf-static" and input_device(pair.target).type == "cuda"
            for t in temperatures:
                try:
                    for ids in encoded[:2] if compiling else encoded[:1]:
                        PEERS[name][1](pair, ids, t, max_tokens if compiling else min(max_tokens, 8), seed,
                                       min_tokens=min_tokens, ends=ends)
                except Exception as e:  # noqa: BLE001 - a peer's failure is reported, not raised
                    peer_errors.setdefault(name, f"{type(e).__name__}: {e}".splitlines()[0])

    measured, interrupted = 0, False  # rounds (a prompt, once) every row has run: what the rows count
    try:
        for repeat in range(repeats):
            for index, ids in enumerate(encoded):
                run_seed = seed + 1000 * repeat + index
                # interleaved: every variant runs this prompt before the next prompt starts, in the opposite
                # order for every other prompt, so that no row always runs first or last (the 2-core Xeon's
                # pace drifts 1.5x within minutes, and a row run last sits furthest from `ar` run first)
                in_turn = jobs if (repeat * len(encoded) + index) % 2 == 0 else jobs[::-1]
                round_stats, round_peers, round_rates = {}, {}, {}  # (counted once every row has run the prompt)
                for compile, variant, setting, shape in in_turn:
                    text = stop_text_of(pair.tokenizer, profile) if stops else None
                    _, stats, _ = complete(decoder_for(compile, setting, shape), ids, max_tokens, run_seed, text=text)
                    round_stats[compile, variant, setting, shape] = stats
                    round_rates[compile, variant, setting, shape] = stats.tokens_per_second
                    tick()
                for name in peers:
                    for t in temperatures:
                        if name in peer_errors:
                            break
                        try:
                            n, seconds = PEERS[name][1](pair, ids, t, max_tokens, run_seed, min_tokens=min_tokens,
                                                        ends=ends)
                        except Exception as e:  # noqa: BLE001
                            peer_errors[name] = f"{type(e).__name__}: {e}".splitlines()[0]
                            break
                        round_peers[name, t] = (n, seconds)
                        round_rates[name, t] = n / seconds if seconds else 0.0
                        tick()
                for key, stats in round_stats.items():
                    totals.setdefault(key, Stats()).merge(stats)
                for key, (n, seconds) in round_peers.items():
                    peer_totals[key][0] += n
                    peer_totals[key][1] += seconds
                for key, rate in round_rates.items():
                    per_prompt.setdefault(key, {})[repeat, index] = rate
                measured += 1
    except KeyboardInterrupt:  # (Ctrl-C, SIGTERM: the rounds measured whole are reported, then rsd exits)
        if not measured:
            raise
        interrupted = True

    rows = []
    ar_rate = {(k[0], k[2].temperature): v.tokens_per_second for k, v in totals.items() if k[1] == "ar"}

    def ratio(rate, compile, t):
        base = ar_rate.get((compile, t))
        return rate / base if rate and base else None

    ar_runs = {(k[0], k[2].temperature): runs for k, runs in per_prompt.items() if len(k) == 4 and k[1] == "ar"}

    def spread(key, compile, t) -> list[float] | None:
        """[least, most] over the runs (prompt x repeat) of the row's tokens/s over `ar`'s on the same
        prompt: how far one prompt's ratio strays from the row's (a machine whose pace drifts, prompts
        that suit drafting more or less)."""
        base = ar_runs.get((compile, t), {})
        ratios = [rate / base[run] for run, rate in per_prompt.get(key, {}).items() if rate and base.get(run)]
        return [min(ratios), max(ratios)] if ratios else None

    for (compile, variant, setting, shape), stats in totals.items():
        d = stats.as_dict(pair.draft_params, pair.target_params)
        runs = len(per_prompt.get((compile, variant, setting, shape), {})) or 1  # (prompts x repeats)
        rows.append({
            "variant": variant, "compile": compile, "runtime": runtimes[compile].describe(),
            "budget": setting.budget, "depth": setting.depth, "shape": _shape_label(shape, d["shapes"]),
            "shapes_used": d["shapes"],
            "max_nodes": shape.max_nodes, "temperature": setting.temperature,
            "block_efficiency": d["block_efficiency"], "acceptance_rate": d["acceptance_rate"],
            "acceptance_per_depth": d["acceptance_per_depth"], "mbsu": d["mbsu"],
            "tokens_per_second": d["tokens_per_second"],
            # a run's time to its first token (the prompt read), on average, and the rate after it
            "first_token_seconds": d["first_token_seconds"] / runs,
            "tokens_per_second_after_first": d["tokens_per_second_after_first"],
            "speedup_vs_ar": ratio(d["tokens_per_second"], compile, setting.temperature),
            "speedup_vs_ar_range": spread((compile, variant, setting, shape), compile, setting.temperature),
            "speedup_vs_ar_off": ratio(d["tokens_per_second"], "off", setting.temperature),
            "target_tokens_per_step": d["target_tokens_per_step"], "draft_calls_per_step": d["draft_calls_per_step"],
            "draft_seconds": d["draft_seconds"], "verify_seconds": d["verify_seconds"],
            "forward_seconds": d["forward_seconds"], "overhead_seconds": d["overhead_seconds"],
            "wall_seconds": d["wall_seconds"], "new_tokens": d["new_tokens"], "steps": d["steps"],
            "forward_threads": d["forward_threads"], "cpu_threads": d["cpu_threads"],
        })
    for (compile, variant, setting, shape), error in refused if refused_rows else ():
        rows.append({
            "variant": variant, "compile": compile, "runtime": runtimes[compile].describe(), "budget": setting.budget,
            "depth": setting.depth, "shape": shape.describe(), "shapes_used": None, "max_nodes": shape.max_nodes,
            "temperature": setting.temperature, **dict.fromkeys(REFUSED_EMPTY), "error": error,
        })
    for (name, t), (n, seconds) in peer_totals.items():
        error = peer_errors.get(name)
        rate = n / seconds if seconds and error is None else None
        rows.append({
            "variant": name, "compile": None, "runtime": "transformers", "budget": None, "depth": None,
            "shape": PEERS[name][0], "shapes_used": None, "max_nodes": None, "temperature": t, "block_efficiency": None,
            "acceptance_rate": None, "acceptance_per_depth": None, "mbsu": None, "tokens_per_second": rate,
            "first_token_seconds": None, "tokens_per_second_after_first": None,
            "speedup_vs_ar": ratio(rate, compiles[0], t),
            "speedup_vs_ar_range": spread((name, t), compiles[0], t) if error is None else None,
            "speedup_vs_ar_off": ratio(rate, "off", t),
            "target_tokens_per_step": None, "draft_calls_per_step": None, "draft_seconds": None,
            "verify_seconds": None, "forward_seconds": None, "overhead_seconds": None, "wall_seconds": seconds,
            "new_tokens": n, "steps": None, "error": error,
        })
    if interrupted:
        raise Interrupted(rows, measured, repeats * len(encoded))
    return rows


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) during `rsd bench`, carrying the rows of the rounds every row ran whole:
    `measured` of the `planned` (prompts x repeats)."""

    def __init__(self, rows: list[dict], measured: int, planned: int):
        super().__init__()
        self.rows, self.measured, self.planned = rows, measured, planned


# (a refused row's numbers: none)
REFUSED_EMPTY = ("block_efficiency", "acceptance_rate", "acceptance_per_depth", "mbsu", "tokens_per_second",
                 "first_token_seconds", "tokens_per_second_after_first", "speedup_vs_ar", "speedup_vs_ar_range",
                 "speedup_vs_ar_off", "target_tokens_per_step", "draft_calls_per_step", "draft_seconds",
                 "verify_seconds", "forward_seconds", "overhead_seconds", "wall_seconds", "new_tokens", "steps",
                 "forward_threads", "cpu_threads")


def shared_cpu(rows: list[dict]) -> str | None:
    """A warning where some rows' forwards ran on fewer threads than the CPU's (the thread governor's
    answer to other processes holding cores, mostly): their numbers may be the shared machine's. None
    otherwise."""
    counts = [(int(threads), n, row["cpu_threads"]) for row in rows
              for threads, n in (row.get("forward_threads") or {}).items()]
    fewer = sum(n for threads, n, cpus in counts if threads < cpus)
    if not fewer:
        return None
    return (f"rsd: warning: {fewer} of {sum(n for _, n, _ in counts)} forwards ran on fewer threads than the CPU's "
            f"{max(cpus for _, _, cpus in counts)}, as the thread governor found faster: where other processes held "
            "cores, these numbers are the shared machine's (transformers' own rows keep their threads)")


def _shape_label(shape: Shape, used: dict[str, int]) -> str:
    """The shape, and for auto the one it used most: "auto (rsd-c b=(2) 81%)"."""
    if shape.variant != "auto" or not used:
        return shape.describe()
    name, steps = next(iter(used.items()))
    return f"{shape.describe()} ({name} {100 * steps / sum(used.values()):.0f}%)"


COLUMNS = ["variant", "compile", "budget", "depth", "shape", "temperature", "block_efficiency", "acceptance_rate", "mbsu",
           "tokens_per_second", "speedup_vs_ar", "speedup_vs_ar_range", "speedup_vs_ar_off", "target_tokens_per_step",
           "draft_seconds", "verify_seconds", "overhead_seconds", "new_tokens"]


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):  # a range
        return "-".join(f"{x:.2f}" for x in value)
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


COLUMN_NAMES = {"block_efficiency": "BE", "acceptance_rate": "accept", "tokens_per_second": "tok/s",
                "speedup_vs_ar": "× ar", "speedup_vs_ar_range": "per prompt", "speedup_vs_ar_off": "× ar off",
                "target_tokens_per_step": "nodes", "draft_seconds": "draft s", "verify_seconds": "verify s",
                "overhead_seconds": "overhead s", "new_tokens": "tokens", "temperature": "T"}
# what a narrow terminal leaves out first, in order (the variant, its shape, BE, tok/s and × ar stay)
SPARE_COLUMNS = ["overhead_seconds", "verify_seconds", "draft_seconds", "new_tokens", "target_tokens_per_step",
                 "speedup_vs_ar_off", "mbsu", "speedup_vs_ar_range", "acceptance_rate", "depth", "budget",
                 "compile", "temperature"]


# (a row that drafted nothing, as `ar`: no acceptance nor draft time to tell, shown as "-", not 0.00)
UNDRAFTED_EMPTY = ("acceptance_rate", "draft_seconds")


def results_table(rows: list[dict], width: int | None = None, title: str = "rsd bench"):
    """The rows as a Rich table; with `width`, one that fits it (render.fitted_table): the variant, its
    shape, BE, tok/s and × ar always there."""
    from .render import fitted_table

    cells = [{col: _fmt(None if col in UNDRAFTED_EMPTY and row.get("target_tokens_per_step") == 1 else row[col])
              for col in COLUMNS} for row in rows]
    return fitted_table(title, {col: COLUMN_NAMES.get(col, col) for col in COLUMNS}, cells, width,
                        left=("variant", "shape"), shared=("temperature", "compile"), spare=tuple(SPARE_COLUMNS))


def table_title(prompts: int, repeats: int, max_tokens: int, measured: int | None = None) -> str:
    """What the rows were measured on: "rsd bench · 16 prompts × 2 · up to 64 tokens"; a run interrupted
    after `measured` rounds (a prompt, once) says so."""
    from .prompting import counted

    title = f"rsd bench · {counted(prompts, 'prompt')}{f' × {repeats}' if repeats > 1 else ''} · up to {max_tokens} tokens"
    return title if measured is None else f"{title} · interrupted: {measured} of {prompts * repeats} rounds"


def write_csv(rows: list[dict], out) -> None:
    import csv

    fields = list(dict.fromkeys(k for row in rows for k in row)) or COLUMNS  # rows may add keys (error)
    writer = csv.DictWriter(out, fieldnames=fields)
    writer.writeheader()
    for row in rows:
        writer.writerow({k: (" ".join(f"{x:.4f}" for x in v) if isinstance(v, list) else v) for k, v in row.items()})


def _series_name(row: dict) -> str:
    return f"{row['variant']} T={row['temperature']:g}" + (f" compile {row['compile']}" if row.get("compile") else "")


def plot_svg(rows: list[dict], title: str = "rsd bench") -> str:
    """Block efficiency and speed-up over ar against the target budget (or depth), one line per variant."""
    xs_key = "budget" if any(r["budget"] for r in rows) else "depth"
    series: dict[str, list[tuple[float, float, float]]] = {}
    for r in rows:
        if r[xs_key] is None or r["block_efficiency"] is None:
            continue
        series.setdefault(_series_name(r), []).append(
            (r[xs_key], r["block_efficiency"], r["speedup_vs_ar"] or 0.0))
    colours = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
    width, height, pad = 420, 300, 50
    xs = sorted({x for pts in series.values() for x, _, _ in pts}) or [0, 1]
    x_lo, x_hi = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * width}" height="{height + 60}" '
             f'font-family="sans-serif" font-size="12">', f'<text x="10" y="18" font-size="14">{title}</text>']
    for panel, (metric, label) in enumerate(((1, "block efficiency"), (2, "speed-up over ar"))):
        values = [pt[metric] for pts in series.values() for pt in pts] or [0, 1]
        y_lo, y_hi = min(0.0, min(values)), max(values) * 1.1 or 1.0
        ox = panel * width

        def sx(x):
            return ox + pad + (x - x_lo) / (x_hi - x_lo) * (width - 2 * pad)

        def sy(y):
            return 30 + height - pad - (y - y_lo) / (y_hi - y_lo) * (height - 2 * pad)

        parts.append(f'<text x="{ox + pad}" y="40">{label}</text>')
        parts.append(f'<line x1="{ox + pad}" y1="{sy(y_lo)}" x2="{ox + width - pad}" y2="{sy(y_lo)}" stroke="black"/>')
        parts.append(f'<line x1="{ox + pad}" y1="{sy(y_lo)}" x2="{ox + pad}" y2="{sy(y_hi)}" stroke="black"/>')
        for x in xs:
            parts.append(f'<text x="{sx(x)}" y="{sy(y_lo) + 15}" text-anchor="middle">{x:g}</text>')
        for frac in (0, 0.5, 1):
            y = y_lo + frac * (y_hi - y_lo)
            parts.append(f'<text x="{ox + pad - 5}" y="{sy(y) + 4}" text-anchor="end">{y:.1f}</text>')
        parts.append(f'<text x="{ox + width / 2}" y="{sy(y_lo) + 30}" text-anchor="middle">{xs_key}</text>')
        for i, (name, pts) in enumerate(sorted(series.items())):
            pts = sorted(pts)
            colour = colours[i % len(colours)]
            path = " ".join(f"{sx(pt[0]):.1f},{sy(pt[metric]):.1f}" for pt in pts)
            parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
            if panel == 1:
                parts.append(f'<text x="{ox + width - pad + 5}" y="{60 + 15 * i}" fill="{colour}">{name}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def check_plot_path(path) -> None:
    """Refuse a --plot that could not be written before anything is measured (not after a run of
    minutes): its suffix, matplotlib for a PNG, its folder."""
    import importlib.util
    from pathlib import Path

    from .errors import RsdError, UsageError

    path = Path(path)
    if path.suffix.lower() not in (".svg", ".png"):
        raise UsageError(f"--plot must end in .svg or .png (got {path.name})")
    if path.suffix.lower() == ".png" and importlib.util.find_spec("matplotlib") is None:
        raise RsdError("a PNG plot needs matplotlib (pip install matplotlib); .svg works without it")
    if not path.resolve().parent.is_dir():
        raise RsdError(f"cannot write the plot to {path}: folder {path.resolve().parent} does not exist")


def write_plot(rows: list[dict], path) -> None:
    """SVG always works; PNG needs matplotlib (not a dependency of rsd)."""
    from pathlib import Path

    from .errors import RsdError

    path = Path(path)
    if path.suffix.lower() == ".svg":
        path.write_text(plot_svg(rows), encoding="utf-8")
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RsdError("a PNG plot needs matplotlib (pip install matplotlib); .svg works without it") from None
    key = "budget" if any(r["budget"] for r in rows) else "depth"
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    series: dict[str, list] = {}
    for r in rows:
        if r[key] is not None and r["block_efficiency"] is not None:
            series.setdefault(_series_name(r), []).append(
                (r[key], r["block_efficiency"], r["speedup_vs_ar"] or 0.0))
    for name, pts in sorted(series.items()):
        pts.sort()
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        axes[1].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=name)
    for ax, label in zip(axes, ("block efficiency", "speed-up over ar")):
        ax.set_xlabel(key)
        ax.set_title(label)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def current_rss_mb() -> float:
    """Resident memory of this process now (Linux; 0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def runtime_rss_mb(location: str | None = None) -> float:
    """Resident memory of the runtime alone before any weights load: Python, torch, transformers
    and, given the target's resolved location, its architecture's modeling code."""
    import torch  # noqa: F401
    import transformers  # noqa: F401

    if location is not None:
        from .models import import_model_code

        import_model_code(location)
    return current_rss_mb()


def memory_summary(pair, runtime_mb: float = 0.0) -> dict:
    """Peak resident memory of this process against the bytes of the weights it holds.

    `model_peak_over_weights` leaves out the runtime measured before the weights loaded
    (`runtime_mb`, see runtime_rss_mb): what the models, caches and activations add, over the weights."""
    import resource

    tensors = {}  # storage -> bytes: a view (a reduced draft head) shares its target's storage
    for model in (pair.target, pair.draft):
        for p in model.parameters():
            storage = p.untyped_storage()
            tensors[storage.data_ptr()] = storage.nbytes()
    # kB on Linux; the kernel's high-water mark is updated in batches, so it can trail by a few pages
    # an RSS read since (the runtime's, measured in a process whose peak came before: a test run)
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, current_rss_mb(), runtime_mb)
    weights = sum(tensors.values()) / 2**20
    return {"peak_rss_mb": peak, "runtime_rss_mb": runtime_mb, "weights_mb": weights,
            "peak_over_weights": peak / weights if weights else None,
            "model_peak_over_weights": (peak - runtime_mb) / weights if weights and runtime_mb else None}
