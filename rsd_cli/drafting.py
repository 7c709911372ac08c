"""Tree builders per variant. They call the draft model level by level through `expand`; the
`lookup` variant drafts without a model, from what the context already holds (NgramIndex)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import torch

from .sampling import gumbel_top_k_rows, sample_with_replacement, sample_with_replacement_rows, \
    stochastic_beam_step, top_tokens_rows
from .tree import DraftTree
from .verification import Rule

VARIANTS = ("ar", "sd", "mss", "spectr", "rsd-c", "rsd-s", "lookup", "auto")
LOOKUP_NGRAM = 3  # lookup drafts follow the context's longest matching n-gram, n = 3 down to 1 (auto's, the default)

# expand(tree, nodes) -> (len(nodes), V) draft distributions at those nodes, one draft forward
Expand = Callable[[DraftTree, list[int]], torch.Tensor]


@dataclass(frozen=True)
class Shape:
    """What one step drafts. `branching` is per depth (sd, mss, rsd-c, lookup); `width` is the
    beam width (rsd-s), the number of drafts (spectr) or the longest n-gram matched (lookup);
    `depth` is the tree depth L (lookup: the most tokens it drafts)."""

    variant: str
    branching: tuple[int, ...] = ()
    width: int = 1
    depth: int = 0

    @property
    def rule(self) -> Rule:
        return {"mss": Rule.WITH_REPLACEMENT, "spectr": Rule.KSEQ}.get(self.variant, Rule.WITHOUT_REPLACEMENT)

    @property
    def uses_draft_model(self) -> bool:
        return self.depth > 0 and self.variant != "lookup"

    @property
    def max_nodes(self) -> int:
        """Upper bound on the tokens the target verifies per step, the root included."""
        if self.variant == "auto":  # `width` holds the node limit of the shapes it chooses
            return self.width
        if self.variant in ("rsd-s", "spectr"):
            return 1 + self.width * self.depth
        nodes, level = 1, 1
        for b in self.branching:
            level *= b
            nodes += level
        return nodes

    def within(self, depth: int) -> "Shape":
        """This shape cut to at most `depth` levels (plain decoding at 0; `auto` as it is: it chooses
        its shapes itself)."""
        if self.depth <= depth or self.variant == "auto":
            return self
        if depth <= 0:
            return Shape("ar")
        return Shape(self.variant, self.branching[:depth], self.width, depth)

    def describe(self) -> str:
        if self.variant in ("ar", "auto"):
            return self.variant
        if self.variant == "sd":
            return f"sd γ={self.depth}"
        if self.variant == "lookup":
            return f"lookup γ={self.depth}"
        if self.depth == 0:  # the root alone (a budget of 1): no width drafted, none to name
            return f"{self.variant} L=0"
        if self.variant == "rsd-s":
            return f"rsd-s W={self.width} L={self.depth}"
        if self.variant == "spectr":
            return f"spectr K={self.width} L={self.depth}"
        return f"{self.variant} b=({factors_text(self.branching)})"


def factors_text(branching: tuple[int, ...]) -> str:
    """Branching factors as `--branching` takes them, "3,2,1"; past 8 levels (more than `auto`
    drafts) a run of 3 or more equal factors reads as factor×count — "3,1×332", where a budget of
    1000 nodes gives 333 levels — so a statistics line stays a line."""
    if len(branching) <= 8:
        return ",".join(map(str, branching))
    runs = [(factor, len(list(run))) for factor, run in itertools.groupby(branching)]
    return ",".join(f"{factor}×{count}" if count >= 3 else ",".join([str(factor)] * count) for factor, count in runs)


def make_shape(variant: str, *, draft_len: int = 4, branching: tuple[int, ...] = (2, 2, 1),
               beam_width: int = 3, depth: int = 4, num_drafts: int = 3, nodes: int = 0,
               ngram: int = LOOKUP_NGRAM) -> Shape:
    if variant == "ar":
        return Shape("ar")
    if variant == "sd":
        return Shape("sd", (1,) * draft_len, 1, draft_len)
    if variant == "lookup":
        return Shape("lookup", (1,) * draft_len, ngram, draft_len)
    if variant in ("mss", "rsd-c"):
        return Shape(variant, tuple(branching), 1, len(branching))
    if variant == "rsd-s":
        return Shape("rsd-s", (), beam_width, depth)
    if variant == "spectr":
        return Shape("spectr", (), num_drafts, depth)
    if variant == "auto":  # chosen step by step (auto.AutoShape), trees of at most `nodes` nodes
        from .auto import MAX_NODES

        return Shape("auto", (), nodes or MAX_NODES, 0)
    raise ValueError(f"unknown variant {variant!r}")


def shape_for_budget(variant: str, budget: int, ngram: int = LOOKUP_NGRAM) -> Shape:
    """A tree whose node count (root included) is at most `budget` (lookup: matching up to `ngram`).

    Width grows slowly with the budget (1 up to 9 nodes, 2 up to 24, then 3) and the rest goes
    into depth: every width-w shape is a root plus w chains of the same length, so all variants
    with the same budget draft the same shape and differ only in how they sample and verify.
    """
    if budget < 1:
        raise ValueError("budget must be at least 1 (the root)")
    if variant == "auto":
        return make_shape("auto", nodes=budget)
    if variant == "ar" or budget == 1:
        return Shape("ar") if variant == "ar" else make_shape(variant, draft_len=0, branching=(), depth=0, ngram=ngram)
    width = 1 if budget < 10 else 2 if budget < 25 else 3
    depth = (budget - 1) // width
    if variant in ("sd", "lookup"):
        return make_shape(variant, draft_len=budget - 1, ngram=ngram)
    return make_shape(variant, branching=(width,) + (1,) * (depth - 1), beam_width=width,
                      depth=depth, num_drafts=width)


def build_tree(shape: Shape, root: int, q_root: torch.Tensor, expand: Expand,
               generator: torch.Generator, greedy: bool = False) -> DraftTree:
    """Draft one step's tree. `greedy` (the target samples at temperature 0): draws without
    replacement take their temperature -> 0 limit, the draft's most likely tokens (top-k,
    beam search), so a root with b children still tries b distinct tokens. With a one-hot
    target p, recursive rejection accepts the first child equal to the target's argmax, and
    the correction after rejecting them all is that argmax: exact for any draft q."""
    tree = DraftTree.rooted_at(root)
    tree.q[0] = q_root
    if shape.variant == "ar" or shape.depth == 0:
        return tree
    if shape.variant == "rsd-s":
        _stochastic_beam_tree(tree, shape, expand, generator, noise=not greedy)
    elif shape.variant == "spectr":
        _independent_sequences_tree(tree, shape, expand, generator)
    else:
        _branching_tree(tree, shape, expand, generator, greedy)
    return tree


def _expand_into(tree: DraftTree, nodes: list[int], expand: Expand) -> None:
    for node, q in zip(nodes, expand(tree, nodes)):
        tree.q[node] = q


def _branching_tree(tree: DraftTree, shape: Shape, expand: Expand, gen: torch.Generator,
                    greedy: bool = False) -> None:
    """sd, rsd-c (Gumbel-top-k without replacement, top-k when greedy) and mss (i.i.d.), b_d
    children per node; a level's draws for all its nodes at once (one transfer to the host)."""
    if shape.rule is Rule.WITH_REPLACEMENT:
        draw = sample_with_replacement_rows
    else:
        draw = (lambda probs, k, _: top_tokens_rows(probs, k)) if greedy else gumbel_top_k_rows
    frontier = [0]
    for depth, b in enumerate(shape.branching, start=1):
        if not frontier:
            break
        new = []
        rows = tree.q[frontier[0]][None] if len(frontier) == 1 else torch.stack([tree.q[n] for n in frontier])
        drawn = draw(rows, b, gen)
        for node, tokens in zip(frontier, drawn):
            for token in tokens:
                child, is_new = tree.add_draw(node, token)
                if is_new:
                    new.append(child)
        if depth < shape.depth and new:
            _expand_into(tree, new, expand)
        frontier = new


def _independent_sequences_tree(tree: DraftTree, shape: Shape, expand: Expand, gen: torch.Generator) -> None:
    """spectr: K i.i.d. draft sequences, merged into a trie; a node with m sequences through it
    draws m i.i.d. next tokens (one per sequence)."""
    frontier = {0: shape.width}  # node -> number of sequences passing through it
    for depth in range(1, shape.depth + 1):
        new: dict[int, int] = {}
        for node, count in frontier.items():
            for token in sample_with_replacement(tree.q[node], count, gen):
                child, _ = tree.add_draw(node, token)
                new[child] = new.get(child, 0) + 1
        if depth < shape.depth:
            _expand_into(tree, list(new), expand)
        frontier = new


def _stochastic_beam_tree(tree: DraftTree, shape: Shape, expand: Expand, gen: torch.Generator,
                          noise: bool = True) -> None:
    """rsd-s: stochastic beam search; each level keeps the top-W children by perturbed score
    (by log q of the prefix without noise)."""
    beams = [0]
    log_prob = torch.zeros(1, dtype=torch.float64, device=tree.q[0].device)
    score = torch.zeros(1, dtype=torch.float64, device=tree.q[0].device)
    for depth in range(1, shape.depth + 1):
        probs = torch.stack([tree.q[b] for b in beams])
        level = stochastic_beam_step(log_prob, score, probs, shape.width, gen, noise)
        beams = [tree.add_draw(beams[parent], token)[0] for parent, token in zip(level.parent, level.token)]
        log_prob, score = level.log_prob, level.score
        if depth < shape.depth:
            _expand_into(tree, beams, expand)


class NgramIndex:
    """Where each n-gram (n = 1..longest) of a growing token sequence last occurred with a token
    after it: prompt lookup decoding's draft (Saxena 2023; transformers' prompt_lookup_num_tokens,
    vLLM's ngram). Answers that repeat their context (a corrected text, edited code, a summary
    quoting its source, a list) get long drafts at no model cost."""

    def __init__(self, longest: int):
        self.longest = longest
        self.after: dict[tuple[int, ...], int] = {}  # n-gram -> where the token after its latest occurrence is
        self.indexed = 0  # n-grams ending before this position are in `after`

    def continuation(self, seq: list[int], count: int) -> list[int]:
        """Up to `count` tokens that followed the latest earlier occurrence of the longest n-gram
        ending `seq` (the longest n that occurred before); [] when not even its last token did."""
        return self.match(seq, count)[1]

    def match(self, seq: list[int], count: int) -> tuple[int, list[int]]:
        """(n, continuation): the n of that longest n-gram (0 when none occurred) and the tokens."""
        stop = len(seq) - 1  # an n-gram ending at `end` < stop is followed by seq[end + 1]
        if stop == self.indexed + 1 and stop > self.longest:  # one token more (a decoding step): its n-grams
            end = stop - 1
            for n in range(1, self.longest + 1):
                self.after[tuple(seq[end - n + 1: stop])] = stop
        else:
            for n in range(1, self.longest + 1):
                first = max(self.indexed, n - 1)  # (the first end with n tokens up to it)
                if first < stop:  # each n-gram ending at first..stop-1, as a tuple -> end + 1; later ones win
                    columns = [seq[first - n + 1 + k: stop - n + 1 + k] for k in range(n)]
                    self.after.update(zip(zip(*columns), range(first + 1, stop + 1)))
        self.indexed = max(self.indexed, stop)
        for n in range(min(self.longest, len(seq)), 0, -1):
            start = self.after.get(tuple(seq[-n:]))
            if start is not None:
                return n, seq[start: start + count]
        return 0, []


def lookup_tree(root: int, continuation: list[int], vocab_size: int, device) -> DraftTree:
    """A chain of the looked-up tokens, each drafted with certainty: q is one-hot, so recursive
    rejection accepts token x with probability p(x) and after a rejection draws from p without x
    (renormalised) — exactly the target's distribution, like any draft whose q is known."""
    tree = DraftTree.rooted_at(root)
    node = 0
    for token in continuation:
        q = torch.zeros(vocab_size, device=device)
        q[token] = 1.0
        tree.q[node] = q
        node, _ = tree.add_draw(node, token)
    return tree
