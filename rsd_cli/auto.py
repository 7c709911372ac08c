"""`--variant auto`: the tree shape that pays most on this machine, re-chosen as generation goes.

Every few steps the policy picks, among ar, sd chains and rsd-c branching vectors, the shape
maximising   expected emitted tokens / expected step time;  and on every step where the context's
end occurred before, it weighs a `lookup` chain of what followed it (no draft model: only the
target's forward of its tokens) against that shape, by the same measure. Both come from

- a **cost model** of this machine: the target's forward time for a tree of n nodes and the
  draft's for a level of w nodes, measured once per machine, model pair and runtime (~seconds,
  cached in `costs.json` in the rsd cache folder) and scaled by what this run's forwards take;
  the target's forward of n > 1 tokens also by a factor learnt from steps a step or two apart (a
  plain one and one of n tokens: the pace cancels out), so a table measured apart from generation
  that rates a 2-token forward 1.19x a plain one where generation takes 1.31x is corrected; a shape
  this run has used is timed by its own steps, as their time over the forwards in them (sampling
  and verification included);
- an **acceptance model** of this run: the probability that the draft's k-th ranked candidate
  is accepted after the ones before it were rejected, at depth d (the factors of RSD-C's block
  efficiency), counted from this run's verified nodes with a weak prior; for lookup drafts, the
  probability that the looked-up token at depth d is accepted, apart for each length n of the
  n-gram matched (a 3-token match predicts far better than a 1-token one);
- a **memory** of earlier runs with the same machine, models, runtime and sampling settings
  (`auto.json` in the rsd cache folder): a run starts from the last one's acceptance counts
  (scaled down, so its own steps soon outweigh them), scales and timed shapes, so a one-off
  `rsd generate` does not spend its first steps finding out again that drafting does (not) pay;
  with new sampling settings, from the last run's scales and timed shapes (any settings');
- what the draft has **yet to read** before it can draft (a new prompt, the tokens of plain
  steps): where that costs more than a few plain steps, drafting waits until the tokens the answer
  may still take are expected to repay it (a long prompt with a short answer stays plain).

Why the output stays exactly the target's: a step's shape is fixed from *earlier* steps (their
tokens, acceptances and timings, earlier runs', the tokens left to the answer) before the step
draws any random number or sees its target distributions. For every fixed shape, recursive
rejection sampling emits tokens whose law given everything before the step is the target's; the
shape is part of "everything before", so each token, conditioned on the whole past, is still drawn
from the target's distribution — whatever rule picked the shape. (A rule that looked at the
current step's p would break this: it could, say, draft deeper exactly when the target is
confident.) rsd-s is not searched: its block efficiency depends on how beams share parents, which
per-rank acceptance does not predict."""

from __future__ import annotations

import functools
import math
import statistics
import weakref
from dataclasses import dataclass, field
from typing import Callable

from .drafting import LOOKUP_NGRAM, Shape, make_shape

MAX_NODES = 64  # the largest tree auto drafts (a budget lowers it)
MAX_DEPTH = 8
CHOOSE_EVERY = 8  # steps between choices (a choice rates every shape: ~0.25 ms in Python)
EXPLORE_EVERY = 8  # while plain decoding pays most, every 8th step drafts anyway (and while drafting
# pays, every 8th step decodes plainly), to keep measuring what is not chosen
RARELY = 16  # ... after 128 steps once that other kind was timed and is expected clearly slower, then
# after twice as many each time it still is, up to LONGEST_GAP (drafting after plain steps first reads
# what it missed, ~0.3 ms a token for the embedded draft on 2 cores: exploring costs that much)
CLEARLY_SLOWER = 0.95  # below this fraction of the current shape's expected tokens per second
LONGEST_GAP = 1024
RARE_TIMED = 4  # timed steps in an exploration of a kind clearly slower (one in the others): enough to
# overturn an estimate that is wrong (an old run's, a slow spell's) within one exploration, where a
# single step moves it by at most MEASURED_MEMORY * (OUTLIER - 1); the first step after a switch,
# and a shape's first steps in a process, are not timed (see observe)
TARGET_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)
DRAFT_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
PRIOR = (0.5, 0.2)  # P(accept the candidate of rank k (0 = the draft's first) | the ones before
# rejected), before any data; from rank 2 on 0.3 / (k + 1) (prior()): the embedded pair at T=1
# measured 0.41, 0.15, 0.09, 0.07, then 0.05 for the 5th-6th, 0.04 for the 7th-8th, 0.03 up to the
# 12th, 0.02 up to the 16th (root children drawn without replacement: acceptance_limits.py --children)
WIDE_FANS = (7, 15)  # root children alone, a root and its children filling a forward of 8 or 16 tokens:
# where verifying them costs about what one token does (a GPU) a fan of 15 is accepted 0.71 of the time
PRIOR_WEIGHT = 2.0  # pseudo-observations behind each prior value
SCALE_MEMORY = 0.2  # how fast the cost scales follow the measured step times
MEASURED_MEMORY = 0.3  # how fast a used shape's measured time ratio follows new steps
WARM_UP_STEPS = 2  # a shape's first steps are not timed: on a 2-core EPYC the first two forwards
# of a new token count took 6-8 ms more than later ones (oneDNN sets up kernels for each new size)
OUTLIER = 1.25  # the most one step's time can move an estimate, as a ratio to it (see _bounded)
SIZE_MEMORY = 0.2  # how fast a token count's forward factor follows its paired measurements (see _learn_size)
PAIRED_WITHIN = 2  # steps apart at most for a plain step's forward and a larger one's to be compared
OPTIMISM = 0.5  # standard errors added to an acceptance rate (so wider shapes get tried)
MEMORY_TRIES = 32  # a run starts from earlier runs' acceptance counts scaled down to at most this many
# tries per rank and depth, so that its own steps soon outweigh them
MEMORY_ENTRIES = 32  # runs' memories `auto.json` keeps (machine, models, runtime and sampling settings, and
# each of those's timings), the most recently saved: the whole file is read before each answer and written
# after it (with 233, 195 KB, an answer took 3.8 ms to set up and 5.6 to save on a 2-core EPYC, with 32 2.0 and 1.5)
COST_ENTRIES = 32  # machines' measured costs `costs.json` keeps (one per CPU or device, torch, both models,
# runtime and kernels: a user meets a new one with each rsd version, model pair and runtime), the most
# recently measured; read once a process (659 kept on a development machine, 636 KB, took ~5 ms to parse)
CATCH_UP_STEPS = 4  # a draft that has this many plain steps' time or less to read before it can draft
# (what it missed: a new prompt, plain steps) drafts whenever drafting is chosen; a longer read (a long
# prompt: ~1 s for 3655 tokens on a 2-core EPYC, 130 plain steps) only where the answer's remaining
# tokens are expected to save more than it costs


def prior(rank: int) -> float:
    """P(accept candidate `rank` (0 = the draft's first) | the ones before rejected), before any data."""
    return PRIOR[rank] if rank < len(PRIOR) else 0.3 / (rank + 1)


def _bounded(ratio: float) -> float:
    """A measured / expected time ratio, limited to [1 / OUTLIER, OUTLIER]: one slow step (a page
    fault, a busy neighbour) moves an estimate a little, a lasting change in a few steps."""
    return min(max(ratio, 1 / OUTLIER), OUTLIER)


def candidates(max_nodes: int = MAX_NODES) -> list[Shape]:
    """ar, sd chains and rsd-c branching vectors (non-increasing, up to 6 at the root and 3
    below, or WIDE_FANS at the root alone) with at most max_nodes nodes, the root included."""
    return list(_candidates(max_nodes))


@functools.lru_cache(maxsize=None)
def _candidates(max_nodes: int) -> tuple[Shape, ...]:
    """candidates, made once per node limit (every answer of `auto` starts from them: ~0.2 ms)."""
    shapes = [make_shape("ar")]
    shapes += [make_shape("sd", draft_len=g) for g in range(1, min(MAX_DEPTH, max_nodes - 1) + 1)]

    def grow(prefix: tuple[int, ...], nodes: int, level: int) -> None:
        if len(prefix) == MAX_DEPTH:
            return
        for b in range(1, (min(prefix[-1], 3) if prefix else 6) + 1):
            if nodes + level * b > max_nodes:
                break
            branching = prefix + (b,)
            if max(branching) > 1:  # all ones is an sd chain
                shapes.append(make_shape("rsd-c", branching=branching))
            grow(branching, nodes + level * b, level * b)

    grow((), 1, 1)
    shapes += [make_shape("rsd-c", branching=(b,)) for b in WIDE_FANS if 1 + b <= max_nodes]
    return tuple(shapes)


def level_sizes(shape: Shape) -> list[int]:
    """Nodes at each depth 1..L of a branching shape."""
    sizes, level = [], 1
    for b in shape.branching:
        level *= b
        sizes.append(level)
    return sizes


@dataclass
class Costs:
    """Seconds per forward: target[n] for n tree nodes, draft[w] for a level of w nodes."""

    target: dict[int, float]
    draft: dict[int, float]
    # (table, n) -> seconds, worked out once: each answer of `auto` models ~120 candidates' steps from
    # these (~0.6 ms), and one process's Costs serve all its answers (_MEASURED)
    _known: dict[tuple[str, int], float] = field(default_factory=dict, init=False, repr=False, compare=False)

    def _memo(self, which: str, n: int) -> float:
        key = which, n
        if key not in self._known:
            self._known[key] = self._at(getattr(self, which), n)
        return self._known[key]

    @staticmethod
    def _at(table: dict[int, float], n: int) -> float:
        sizes = sorted(table)
        if n <= sizes[0]:
            return table[sizes[0]]
        for lo, hi in zip(sizes, sizes[1:]):
            if n <= hi:
                return table[lo] + (table[hi] - table[lo]) * (n - lo) / (hi - lo)
        lo, hi = sizes[-2], sizes[-1]  # beyond the table: the last slope
        return table[hi] + (table[hi] - table[lo]) * (n - hi) / (hi - lo)

    def target_at(self, n: int) -> float:
        return self._memo("target", n)

    def draft_at(self, n: int) -> float:
        return self._memo("draft", n) if self.draft else 0.0

    def as_json(self) -> dict:
        return {"target": {str(k): v for k, v in self.target.items()}, "draft": {str(k): v for k, v in self.draft.items()}}

    @classmethod
    def from_json(cls, data: dict) -> "Costs":
        return cls({int(k): float(v) for k, v in data["target"].items()},
                   {int(k): float(v) for k, v in data["draft"].items()})


def non_decreasing(table: dict[int, float]) -> dict[int, float]:
    """Each size's time at least that of every smaller size: a forward of more tokens never costs
    less, whatever a measurement caught."""
    out, most = {}, 0.0
    for n in sorted(table):
        most = max(most, table[n])
        out[n] = most
    return out


def measure(make_target: Callable, make_draft: Callable | None, prefix: int = 96, repeats: int = 3) -> Costs:
    """Time forwards on fresh caches of the engine's own kind: a `prefix`-token context, then n
    new tokens (rolled back after each), in `repeats` rounds over every size (ascending, then
    descending, ...). What `auto` weighs is how the sizes' costs compare, and the machine's pace
    may drift: each size's time over the first size's in the same round, the median over rounds,
    times the first size's fastest time; then made non-decreasing. (Measured size by size, 3
    repeats each, a 2-core Xeon under KVM, whose pace moves 1.5x within minutes, once gave 4 tokens
    9.1 ms between 3 at 11.1 and 5 at 12.3, 1 token 7.7: `auto` then drafted 4-node trees there
    and took 1.2-1.5x the time of plain decoding.)"""
    from .engine import timed_chain
    from .threads import GOVERNOR

    def table(make_cache, sizes) -> dict[int, float]:
        cache = make_cache()
        cache.extend([1] * prefix)
        timed_chain(cache, 1)  # first-call costs, untimed
        first, rounds = min(sizes), []
        for round_ in range(repeats):
            seconds = {n: timed_chain(cache, n) for n in (sorted(sizes) if round_ % 2 == 0 else sorted(sizes)[::-1])}
            rounds.append(seconds)
        cache.release()  # (a static-shape cache's buffers go back to its model)
        fastest = min(seconds[first] for seconds in rounds)
        return non_decreasing({n: fastest * statistics.median(seconds[n] / seconds[first] for seconds in rounds)
                               for n in sizes})

    with GOVERNOR.held():  # (every size on the same threads)
        return Costs(table(make_target, TARGET_SIZES), table(make_draft, DRAFT_SIZES) if make_draft else {})


def others_running() -> int:
    """Other processes' threads running on this machine's CPUs now (threads.system_load; 0 unknown)."""
    from .threads import system_load

    load = system_load()
    return load[1] if load else 0


def cached_costs(key: str, measure_now: Callable[[], Costs], notice=lambda message: None) -> Costs:
    """The costs measured for `key` (machine, models, runtime), measured now if not yet; the file keeps
    the COST_ENTRIES keys measured last. Costs measured beside busy processes are kept marked so, and
    measured again at the first run that finds the machine idle: once cached, a table is used for
    good, and one measured during a test run on a 2-core AMD EPYC rated the draft's forward 7.9 ms
    and the target's 4.0 (idle: 0.38 and 2.47), so `auto` would not draft there."""
    from .models import cache_dir, read_json_table, write_json_table

    path = cache_dir() / "costs.json"
    known = read_json_table(path)
    try:
        costs = Costs.from_json(known[key])
        if not known[key].get("busy") or others_running():
            return costs
        notice("measuring the models' forward costs on this machine again, idle now (the last time other "
               "processes were busy), for --variant auto (cached)")
    except (KeyError, ValueError, TypeError, AttributeError):
        notice("measuring the models' forward costs on this machine once, for --variant auto (cached)")
    busy = others_running()
    costs = measure_now()
    busy = max(busy, others_running())
    known.pop(key, None)  # (the file in the order measured: the most recent last)
    known[key] = {**costs.as_json(), **({"busy": busy} if busy else {})}
    for stale in list(known)[:-COST_ENTRIES]:
        del known[stale]
    write_json_table(path, known, sort_keys=False)
    return costs


@dataclass
class Acceptance:
    """Counts of tried / accepted candidates by rank (0 = the draft's first) and depth (0 = the
    root's children), from this run's verified nodes."""

    tried: dict[tuple[int, int], int] = field(default_factory=dict)
    accepted: dict[tuple[int, int], int] = field(default_factory=dict)
    _rates: dict[tuple[int, int], float] = field(default_factory=dict, repr=False)  # since the last observe
    _levels: dict[tuple[int, int], float] = field(default_factory=dict, repr=False)  # likewise
    _pooled: dict[int, tuple[float, float]] = field(default_factory=dict, repr=False)  # likewise, by rank
    _expected: dict[tuple[int, ...], float] = field(default_factory=dict, repr=False)  # likewise, by branching
    version: int = field(default=0, repr=False, compare=False)  # drafting steps observed (what was worked out holds)

    def observe(self, checks) -> None:
        if not checks:  # a plain step: nothing learnt, what was worked out stands (auto re-rates every
            return      # shape every 8 steps: ~1% of a plain step's time on a 2-core EPYC, without these)
        self._rates.clear()
        self._levels.clear()
        self._pooled.clear()
        self._expected.clear()
        self.version += 1
        for depth, check in enumerate(checks):
            for rank in range(check.decision.tried):
                self.tried[rank, depth] = self.tried.get((rank, depth), 0) + 1
                if check.decision.accepted == rank:
                    self.accepted[rank, depth] = self.accepted.get((rank, depth), 0) + 1

    def as_json(self, most: int = MEMORY_TRIES) -> list[list[float]]:
        """[rank, depth, tried, accepted] per cell, each cell scaled down to at most `most` tries."""
        cells = []
        for (rank, depth), tried in sorted(self.tried.items()):
            scale = min(1.0, most / tried)
            cells.append([rank, depth, tried * scale, self.accepted.get((rank, depth), 0) * scale])
        return cells

    @classmethod
    def from_json(cls, cells: list) -> "Acceptance":
        acceptance = cls()
        for rank, depth, tried, accepted in cells:
            if not (0 <= float(accepted) <= float(tried)):
                raise ValueError("accepted more than tried")
            acceptance.tried[int(rank), int(depth)] = float(tried)
            acceptance.accepted[int(rank), int(depth)] = float(accepted)
        return acceptance

    def rate(self, rank: int, depth: int) -> float:
        """P(accept candidate `rank` | earlier ones rejected) at `depth`: the rank's rate over all
        depths (from a prior), moved towards this depth's own counts as they accumulate, plus an
        optimistic margin that shrinks as the rank is tried (so wider shapes get measured too)."""
        if (rank, depth) not in self._rates:  # (a choice rates every candidate shape: ~100 lookups each)
            self._rates[rank, depth] = self._rate(rank, depth)
        return self._rates[rank, depth]

    def _rate(self, rank: int, depth: int) -> float:
        if rank not in self._pooled:  # (the rank's counts over all depths: the same for each depth)
            self._pooled[rank] = (sum(n for (k, _), n in self.tried.items() if k == rank),
                                  sum(n for (k, _), n in self.accepted.items() if k == rank))
        all_tried, all_accepted = self._pooled[rank]
        pooled = (all_accepted + PRIOR_WEIGHT * prior(rank)) / (all_tried + PRIOR_WEIGHT)
        tried, accepted = self.tried.get((rank, depth), 0), self.accepted.get((rank, depth), 0)
        rate = (accepted + PRIOR_WEIGHT * pooled) / (tried + PRIOR_WEIGHT)
        return min(1.0, rate + OPTIMISM * math.sqrt(rate * (1 - rate) / (all_tried + PRIOR_WEIGHT)))

    def level(self, branching: int, depth: int) -> float:
        """P(one of `branching` candidates is accepted) at `depth`."""
        if (branching, depth) not in self._levels:
            rejected = 1.0
            for rank in range(branching):
                rejected *= 1 - self.rate(rank, depth)
            self._levels[branching, depth] = 1 - rejected
        return self._levels[branching, depth]


def expected_tokens(shape: Shape, acceptance: Acceptance) -> float:
    """Tokens a step emits on average: 1 (correction or bonus) + P(reaching each depth)."""
    known = acceptance._expected.get(shape.branching)
    if known is None:
        known, reach = 1.0, 1.0
        for depth, b in enumerate(shape.branching):
            reach *= acceptance.level(b, depth)
            known += reach
        acceptance._expected[shape.branching] = known
    return known


class AutoShape:
    """Chooses each step's shape from past steps only (see the module's docstring)."""

    def __init__(self, costs: Costs, max_nodes: int = MAX_NODES, every: int = CHOOSE_EVERY, vocab: int | None = None,
                 memory_key: str | None = None, timing_key: str | None = None,
                 on_device: Callable[[Shape], bool] | None = None, chains_only: bool = False):
        """on_device: where steps are decided on the device (a GPU), which shapes are (see
        `for_decoder`): the candidates are then those and plain decoding. chains_only: plain decoding
        and `sd` chains only (models whose attention takes no tree, engine.limit_of)."""
        self.costs = costs
        self.shapes = [s for s in candidates(max_nodes) if (vocab is None or max(s.branching, default=1) <= vocab)
                       and (on_device is None or s.depth == 0 or on_device(s))
                       and (not chains_only or s.variant in ("ar", "sd"))]
        self.every = every
        self.acceptance = Acceptance()
        self.target_scale = self.draft_scale = 1.0
        self.size_factor: dict[int, float] = {}  # target tokens (> 1) -> its forward's time over the table's,
        # relative to a plain forward's at the same moment (1 where not learnt: see _learn_size)
        self._last_timed: tuple[int, int, float] | None = None  # (observed steps, target tokens, forward / table)
        self._observed = 0  # steps observed
        self.measured: dict[Shape, float] = {}  # shape -> its steps' time over their forwards' (moving average)
        # the mean ratio in `measured` of the drafting shapes (True) and of the lookup chains (False)
        # used, what an unused one of that kind takes: worked out again after each timed step
        self._mean_ratios: dict[bool, float] = {}
        # shape -> (draft, target) seconds before scaling and the target's tokens (the candidates' now,
        # lookup chains' once rated)
        self._modelled: dict[Shape, tuple[float, float, int]] = {s: self._modelled_seconds(s) for s in self.shapes}
        # the candidates' (branching, draft, target seconds before scaling, target tokens), for _rates
        self._candidates = [(s.branching, *self._modelled[s]) for s in self.shapes]
        self._index = {shape: i for i, shape in enumerate(self.shapes)}
        self._of_kind = {drafts: [i for i, shape in enumerate(self.shapes) if bool(shape.depth) == drafts]
                         for drafts in (False, True)}  # the candidates' indices, plain (ar) and drafting
        self._expected_all: tuple = (None, -1, [])  # (acceptance, its version, expected_tokens per candidate)
        self.uses: dict[Shape, int] = {}  # shape -> steps of it observed (after the first step)
        self.current: Shape | None = None
        self.steps = 0
        self.since_other = 0  # steps since the last one of the other kind (drafting or plain) than now
        self.burst: list[Shape] = []  # the rest of an exploration
        self.other: tuple[Shape, bool] | None = None  # the other kind's best shape, and whether clearly slower
        self._last_kind: bool | None = None  # whether the last observed step drafted
        self.rare_gap = EXPLORE_EVERY * RARELY  # steps between explorations of a kind clearly slower
        self._explored: tuple = (None, 0, self.rare_gap)  # (drafting, since_other, rare_gap) of the last run
        self.lookups = [make_shape("lookup", draft_len=g, ngram=LOOKUP_NGRAM)
                        for g in range(1, min(MAX_DEPTH, max_nodes - 1) + 1)]  # lookup chains, by length
        self.longest_lookup = len(self.lookups)
        self.lookup_acceptance = {n: Acceptance() for n in range(1, LOOKUP_NGRAM + 1)}  # by n-gram matched
        self.matched = 0  # the n-gram length behind the last next_shape's lookup chain
        self.memory_key = memory_key  # where `save` keeps what this run learnt (None: nowhere)
        self.timing_key = timing_key  # where it keeps its timings for runs with other sampling settings

    def step_seconds(self, shape: Shape) -> tuple[float, float]:
        """(draft, target) seconds predicted for one step of `shape`."""
        if shape not in self._modelled:
            self._modelled[shape] = self._modelled_seconds(shape)
        draft, target, tokens = self._modelled[shape]
        return draft * self.draft_scale, target * self.target_scale * self.size_factor.get(tokens, 1.0)

    def _modelled_seconds(self, shape: Shape) -> tuple[float, float, int]:
        """(draft, target) seconds of one step from the measured costs, unscaled, and the tokens of
        the target's forward."""
        if shape.depth == 0:
            return 0.0, self.costs.target_at(1), 1
        if not shape.uses_draft_model:  # lookup: a chain drafted without a model
            return 0.0, self.costs.target_at(1 + shape.depth), 1 + shape.depth
        sizes = level_sizes(shape)
        draft = self.costs.draft_at(1) + sum(self.costs.draft_at(n) for n in sizes[:-1])  # catch-up + levels
        return draft, self.costs.target_at(1 + sum(sizes)), 1 + sum(sizes)

    def seconds(self, shape: Shape) -> float:
        """A step's time: the cost model's forwards, scaled to this run's forward times, and for a
        shape the run has used, times what its steps took over the forwards in them (its sampling
        and verification, the host's work around the forwards). That ratio, not the time itself, is
        what a shape keeps: when the whole machine slows down or speeds up (a busy neighbour), every
        shape's estimate moves with the scales alike, whichever shape was running. A drafting shape
        not used yet takes the mean ratio of those used: what drafting costs beyond the forwards
        (draws, verification), which the forward costs leave out, is much the same for every tree,
        and where forwards are cheap it decides whether drafting pays."""
        ratio = self.measured.get(shape)
        return sum(self.step_seconds(shape)) * (self._unmeasured_ratio(shape) if ratio is None else ratio)

    def _unmeasured_ratio(self, shape: Shape) -> float:
        if shape.depth == 0:
            return 1.0
        # lookup: the lookup chains' own (no draws, no draft forwards)
        return self._mean_ratio(drafting=shape.uses_draft_model)

    def _mean_ratio(self, drafting: bool) -> float:
        """The mean ratio of the drafting shapes (else the lookup chains) used (1 before any): an
        unused one's."""
        if drafting not in self._mean_ratios:
            used = [ratio for shape, ratio in self.measured.items()
                    if (shape.uses_draft_model if drafting else shape.variant == "lookup")]
            self._mean_ratios[drafting] = sum(used) / len(used) if used else 1.0
        return self._mean_ratios[drafting]

    def rate(self, shape: Shape, matched: int = 0) -> float:
        """Expected tokens per second (a lookup chain: after an n-gram of `matched` tokens)."""
        acceptance = self.lookup_acceptance[matched] if shape.variant == "lookup" else self.acceptance
        return expected_tokens(shape, acceptance) / self.seconds(shape)

    def next_shape(self, lag: int = 0, remaining: int | None = None, lookup: tuple[int, int] = (0, 0)) -> Shape:
        """The next step's shape. lag: tokens the draft has yet to read before it can draft (a
        drafting step reads them first); remaining: at most how many tokens the answer has left
        (None: no limit); lookup: (n, count) — the context's end matched an earlier n-gram of n
        tokens followed by `count` tokens (0, 0: none). A drafting shape whose catch-up would cost
        more than it can save over those tokens gives way to plain decoding (exploration
        included: it would pay it too); a lookup chain of what followed the match replaces the
        shape where it is expected to emit more tokens a second. A step emits at most its depth + 1
        tokens: where fewer are left, a tree as deep as what is left is verified for nothing, and
        the best shape that fits is taken instead (plain decoding for the last token)."""
        shape = self._next()
        if shape.depth and not self._catch_up_pays(shape, lag, remaining):
            self.burst.clear()
            shape = self.shapes[0]  # ar
        if remaining is not None and shape.depth >= remaining:
            shape = max((s for s in self.shapes if s.depth < max(remaining, 1)),  # (ar fits always)
                        key=lambda s: self._rate_after(s, lag))
        matched, available = lookup
        self.matched = matched
        if remaining is not None:
            available = max(min(available, remaining - 1), 0)
        if available and matched:
            chains = self.lookups[:available]
            rates = [self.rate(chain, matched) for chain in chains]
            best = max(range(len(chains)), key=rates.__getitem__)
            if rates[best] > self._rate_after(shape, lag):
                return chains[best]
        return shape

    def _rate_after(self, shape: Shape, lag: int) -> float:
        """`rate`, with what the draft has to read first beyond the one token a drafting step's
        time counts (after lookup chains or plain steps: the tokens they added)."""
        if not shape.uses_draft_model or lag <= 1:
            return self.rate(shape)
        beyond = self._catch_up_seconds(lag) - self._catch_up_seconds(1)
        return expected_tokens(shape, self.acceptance) / (self.seconds(shape) + max(beyond, 0.0))

    def _catch_up_seconds(self, lag: int) -> float:
        """The draft's forward of the `lag` tokens it has yet to read, at this run's pace."""
        return self.costs.draft_at(lag) * self.draft_scale

    def _catch_up_pays(self, shape: Shape, lag: int, remaining: int | None) -> bool:
        plain = self.seconds(self.shapes[0])
        catch_up = self._catch_up_seconds(lag) if lag > 1 else 0.0
        if catch_up <= CATCH_UP_STEPS * plain or remaining is None:
            return True
        saved = plain - 1 / self.rate(shape)  # seconds a token, expected
        return saved * remaining > catch_up

    def _next(self) -> Shape:
        if self.current is None or self.steps % self.every == 0:
            self._choose()
        self.steps += 1
        self.since_other += 1
        if self.burst:
            self.since_other = 0
            return self.burst.pop()
        if self.since_other % EXPLORE_EVERY == 0:  # now and then, the best shape of the other kind
            other, clearly_slower = self.other
            if not clearly_slower:
                self.rare_gap = EXPLORE_EVERY * RARELY
            elif self.since_other < self.rare_gap:
                return self.current
            else:
                self.rare_gap = min(2 * self.rare_gap, LONGEST_GAP)
            self.since_other = 0
            # untimed steps first: the switch's, or the warm-up's where this process has not run it yet
            untimed = max(1, WARM_UP_STEPS - self.uses.get(other, 0))
            self.burst = [other] * (untimed + (RARE_TIMED if clearly_slower else 1) - 1)
            return other
        return self.current

    def _rates(self) -> list[float]:
        """`rate` of every candidate, in `shapes`' order: the same numbers, worked out from lists
        instead of a lookup by shape for each (a shape's hash is worked out afresh every time):
        a choice took 0.3 ms, 1.0 ms after a drafting step, on a 2-core Xeon, ~8% of an H100's
        plain step every 8 steps."""
        drafting = self._mean_ratio(drafting=True)
        ratios = [drafting if branching else 1.0 for branching, *_ in self._candidates]  # (as _unmeasured_ratio)
        for shape, ratio in self.measured.items():
            index = self._index.get(shape)
            if index is not None:
                ratios[index] = ratio
        acceptance, version, expected = self._expected_all
        if acceptance is not self.acceptance or version != self.acceptance.version:
            expected = [expected_tokens(shape, self.acceptance) for shape in self.shapes]
            self._expected_all = (self.acceptance, self.acceptance.version, expected)
        draft_scale, target_scale, factor = self.draft_scale, self.target_scale, self.size_factor
        return [tokens / ((draft * draft_scale + target * target_scale * factor.get(size, 1.0)) * ratio)
                for tokens, (_, draft, target, size), ratio in zip(expected, self._candidates, ratios)]

    def _choose(self) -> None:
        """Rate every shape once: the best is the current one; the best of the other kind (drafting
        or plain) is the one to explore, and whether it is clearly slower — only once steps of its
        kind were timed (a drafting shape not used takes the used ones' ratio to the model): where
        forwards are cheap, drafting's own costs can outweigh what it gains; where they are not,
        plain decoding's one token a step."""
        rates = self._rates()
        best = max(range(len(rates)), key=rates.__getitem__)  # (the first of equals, as max over shapes)
        before, self.current = self.current, self.shapes[best]
        if before is None and self._explored[0] == bool(self.current.depth):
            # the last run chose the same kind: its exploration clock goes on (else a string of
            # short answers would never reach the gap, and an old belief would never be tested)
            _, self.since_other, self.rare_gap = self._explored
        if before is not None and bool(before.depth) != bool(self.current.depth):
            self.since_other = 0  # (the other kind was just running)
            self.rare_gap = EXPLORE_EVERY * RARELY
        others = self._of_kind[not self.current.depth]
        index = max(others, key=rates.__getitem__, default=best)
        other = self.shapes[index]
        timed = any(bool(used.depth) == bool(other.depth) for used in self.measured if used.variant != "lookup")
        self.other = (other, timed and rates[index] < CLEARLY_SLOWER * rates[best])

    def observe(self, event) -> None:
        """Learn from a finished step: its verified nodes and how long its forwards took."""
        if event.shape.variant == "lookup":
            self.lookup_acceptance[self.matched].observe(event.checks)
        else:
            self.acceptance.observe(event.checks)
        # (the draft model's steps and the others: after a run of the others it first reads what it missed)
        switched = self._last_kind is not None and self._last_kind != event.shape.uses_draft_model
        self._last_kind = event.shape.uses_draft_model
        self._observed += 1
        if event.step == 1:  # its draft call also read the whole prompt: not a step's time
            return
        self.uses[event.shape] = self.uses.get(event.shape, 0) + 1
        if self.uses[event.shape] <= WARM_UP_STEPS:  # a new token count's first calls set kernels up
            return
        if switched:  # a cost of switching, not of the shape: after plain steps the draft reads what it
            return    # missed, and a plain step after drafting ones measured ~7% slower than in a run
        # the machine's pace: the forwards' times over the cost model's, whatever the shape
        draft, target = self.step_seconds(event.shape)
        draft_forward = event.draft_forward_seconds
        target_forward = event.forward_seconds - draft_forward
        if target > 0 and target_forward > 0:
            self._learn_size(event.shape, target_forward)
            pace = _bounded(target_forward / target) ** SCALE_MEMORY
            self.target_scale *= pace
            if draft == 0:  # a plain step: the machine's pace, which the draft shares (a busy neighbour slows
                self.draft_scale *= pace  # both; drafting steps time the draft's own forwards)
        if draft > 0 and draft_forward > 0:
            self.draft_scale *= _bounded(draft_forward / draft) ** SCALE_MEMORY
        if event.forward_seconds <= 0:
            return
        # the shape's own cost: its step's time over the forwards in it (draws, verification, the
        # host's work around the forwards), a ratio the machine's pace does not move: learnt against
        # the scales instead, a slow spell while one shape runs stuck to that shape's ratio and made
        # it look slow long after (plain decoding 1.43x its time for hundreds of drafting steps)
        ratio = (event.draft_seconds + event.verify_seconds) / event.forward_seconds
        # from what the shape was expected to take before (its first step too: one step can be an outlier)
        known = self.measured.get(event.shape, self._unmeasured_ratio(event.shape))
        self.measured[event.shape] = known * (1 + MEASURED_MEMORY * (_bounded(ratio / known) - 1))
        self._mean_ratios.clear()

    def _learn_size(self, shape: Shape, target_forward: float) -> None:
        """The factor of a forward of n > 1 tokens, from a timed step of n tokens and a timed plain
        step at most PAIRED_WITHIN steps apart (auto's explorations put them side by side): each one's
        forward over the table's, the one over the other. Minutes apart the machine's pace may differ
        by 1.5x; a step apart it hardly does, so the factor is what the table got wrong, not the
        pace. (Learnt from the global scale's residual instead, a slow spell during steps of one
        size would stick to that size.)"""
        _, target, tokens = self._modelled[shape]
        ratio = target_forward / target
        last, self._last_timed = self._last_timed, (self._observed, tokens, ratio)
        if last is None or self._observed - last[0] > PAIRED_WITHIN or (last[1] == 1) == (tokens == 1):
            return
        (size, sized), plain = ((tokens, ratio), last[2]) if tokens > 1 else ((last[1], last[2]), ratio)
        known = self.size_factor.get(size, 1.0)
        self.size_factor[size] = known * _bounded(sized / plain / known) ** SIZE_MEMORY

    def remembered(self) -> dict:
        """What a later run on this machine, these models and sampling settings starts from: the
        acceptance counts (scaled down), the cost model's scales and each timed shape's ratio."""
        memory = {"acceptance": self.acceptance.as_json(), "scales": [self.target_scale, self.draft_scale],
                  "ratios": {shape.describe(): ratio for shape, ratio in self.measured.items()},
                  "sizes": {str(tokens): factor for tokens, factor in self.size_factor.items()},
                  "lookup": {str(n): acceptance.as_json() for n, acceptance in self.lookup_acceptance.items()}}
        if self.current is not None:  # where the exploration of the other kind stands (see _choose)
            memory["exploring"] = [bool(self.current.depth), self.since_other, self.rare_gap]
        elif self._explored[0] is not None:  # (no step yet: as recalled)
            memory["exploring"] = list(self._explored)
        return memory

    def recall(self, memory: dict) -> None:
        """Start from what an earlier run remembered (see `remembered`; without "acceptance", only
        its timings: a run with other sampling settings); raises on a malformed one, leaving the
        policy as it was."""
        named = {shape.describe(): shape for shape in self.shapes + self.lookups}
        ratios = {named[name]: float(ratio) for name, ratio in memory["ratios"].items() if name in named}
        target_scale, draft_scale = (float(scale) for scale in memory["scales"])
        sizes = {int(tokens): float(factor) for tokens, factor in memory.get("sizes", {}).items()}
        if not all(0 < value < math.inf for value in (*ratios.values(), *sizes.values(), target_scale, draft_scale)):
            raise ValueError("a scale, ratio or size factor is not positive")
        explored = self._explored
        if "exploring" in memory:
            drafting, since_other, rare_gap = memory["exploring"]
            explored = (bool(drafting), max(0, int(since_other)),
                        min(max(int(rare_gap), EXPLORE_EVERY * RARELY), LONGEST_GAP))
        if "acceptance" in memory:
            lookup = {int(n): Acceptance.from_json(cells) for n, cells in memory.get("lookup", {}).items()}
            self.acceptance = Acceptance.from_json(memory["acceptance"])
            self.lookup_acceptance.update({n: a for n, a in lookup.items() if n in self.lookup_acceptance})
        self.measured, self.target_scale, self.draft_scale = ratios, target_scale, draft_scale
        self.size_factor = {tokens: factor for tokens, factor in sizes.items() if tokens > 1}
        self._explored = explored
        self._mean_ratios.clear()

    def save(self) -> None:
        """Keep what this run learnt for the next one (`auto.json` in the rsd cache folder): all of
        it for runs with the same sampling settings, its timings for runs with any; and of other
        runs', the most recently saved, MEMORY_ENTRIES in all (a run not seen for that long starts
        afresh)."""
        if self.memory_key is None:
            return
        from .models import read_json_table, write_json_table

        path = memory_path()
        known = read_json_table(path)
        memory = self.remembered()
        saved = {self.memory_key: memory}
        if self.timing_key is not None:
            saved[self.timing_key] = {key: value for key, value in memory.items()
                                      if key not in ("acceptance", "lookup", "exploring")}
        for key, value in saved.items():  # (the file in the order saved: the most recent last)
            known.pop(key, None)
            known[key] = value
        for stale in list(known)[:-MEMORY_ENTRIES]:
            del known[stale]
        write_json_table(path, known, sort_keys=False)

    def ranking(self, top: int = 5) -> list[tuple[str, float]]:
        """The best shapes now and their expected tokens per second (for reports and tests)."""
        rated = sorted(((self.rate(s), s.describe()) for s in self.shapes), reverse=True)[:top]
        return [(name, rate) for rate, name in rated]


def cost_key(decoder) -> str:
    """What the measured costs depend on: machine (CPU, torch, threads), device and dtype, both
    models (architecture and layers), the runtime each runs on and the CPU kernels of their layers."""
    import hashlib

    from .compiled import verdict_key
    from .models import fingerprint
    from .small_batch import signature

    used = signature(decoder.target_model, decoder.draft_model)
    if "blocks" in used:  # a new version of rsd's C library (kernels, C layers) has costs of its own
        from .blocks import version

        used += f" | C library {version()}"
    kernels = hashlib.sha256(used.encode()).hexdigest()[:12]
    models = []
    for model in (decoder.target_model, decoder.draft_model):
        if model not in _FINGERPRINTS:
            _FINGERPRINTS[model] = fingerprint(model)
        models.append(_FINGERPRINTS[model])
    return (f"costs v5 | {verdict_key(decoder.target_model)} | target {models[0]} | "
            f"draft {models[1]} | {decoder.runtimes.describe()} | kernels {kernels}")


_MEASURED: dict[str, Costs] = {}  # this process's costs by key: chat's answers and bench rows measure once
# a loaded model's fingerprint (its architecture's names and shapes, which do not change once it is
# loaded), worked out once a process: ~1 ms for the embedded target, each answer of `auto`
_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def memory_path():
    from .models import cache_dir

    return cache_dir() / "auto.json"


def for_decoder(decoder, notice=lambda message: None) -> AutoShape:
    """An AutoShape for this decoder's models and runtimes, costs measured once per machine, starting
    from what earlier runs with the same machine, models, runtime and sampling settings learnt."""
    from .models import read_json_table

    key = cost_key(decoder)
    if key not in _MEASURED:
        capacity = 96 + 2 * MAX_NODES + 1

        def measure_now() -> Costs:
            return measure(lambda: decoder._cache(decoder.target_model, decoder.runtimes.target, capacity),
                           lambda: decoder._cache(decoder.draft_model, decoder.runtimes.draft, capacity))

        _MEASURED[key] = cached_costs(key, measure_now, notice)
    memory_key, timing_key = f"{key} | {decoder.sampling}", f"{key} | timings, any sampling"
    # where `sd` chains and `rsd-c` root children are decided on the device (a GPU), those and plain
    # decoding only: a deeper tree takes the host path there, a synchronisation and a dozen kernels per
    # node, which on the H100 measured slower than both (the embedded pair, bench-gpu.json: rsd-c b=(3,1)
    # 0.67-0.75x `ar`, b=(3) 0.79-0.90x, sd γ=2 0.81-0.96x) and whose trees `auto` kept exploring there
    # (0.75-0.81x `ar`); lookup chains are weighed on every step as before
    device = decoder.target_model.get_input_embeddings().weight.device

    def on_device(shape: Shape) -> bool:
        return decoder._on_device(shape, decoder.draft_model, device) is not None

    policy = AutoShape(_MEASURED[key], decoder.shape.max_nodes, vocab=decoder.vocab_size, memory_key=memory_key,
                       timing_key=timing_key, on_device=on_device if on_device(make_shape("sd", draft_len=1)) else None,
                       chains_only=decoder.limit is not None)
    known = read_json_table(memory_path())
    # what a run with these sampling settings learnt, else the timings of one with other settings
    # (how long each shape's steps take hardly depends on them; how often drafts are accepted does)
    memory = known.get(memory_key, known.get(timing_key))
    if memory is not None:
        try:
            policy.recall(memory)
        except (KeyError, ValueError, TypeError, AttributeError):  # written by another version: start afresh
            pass
    return policy
