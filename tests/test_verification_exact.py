"""Exactness by enumeration: over every possible draft tree (V <= 5, depth 2), one step's output,
completed by the target, has exactly the target's joint distribution (to 1e-9)."""

from __future__ import annotations

import functools
import itertools
from collections import defaultdict

import pytest
import torch

from rsd_cli.drafting import build_tree, make_shape
from rsd_cli.tree import DraftTree
from rsd_cli.verification import Rule, kseq_rho, plan

V = 5
DEPTH = 2


def toy_dist(context: tuple, salt: int, zero_token: int | None = None) -> torch.Tensor:
    """A fixed pseudo-random distribution per context; optionally with a zero-probability token."""
    g = torch.Generator().manual_seed(hash((context, salt)) % 2**31)
    probs = (torch.randn(V, generator=g, dtype=torch.float64) * 1.2).softmax(-1)
    if zero_token is not None:
        probs[zero_token] = 0
        probs /= probs.sum()
    return probs


@functools.lru_cache(maxsize=None)
def target(ctx):
    return toy_dist(ctx, 1)


@functools.lru_cache(maxsize=None)
def draft(ctx):
    # the draft misses token 4 entirely: the residual must supply it
    return toy_dist(ctx, 2, zero_token=4)


def target_joint(length: int) -> dict[tuple, float]:
    joint = {(): 1.0}
    for _ in range(length):
        joint = {s + (y,): pr * float(target(s)[y]) for s, pr in joint.items() for y in range(V)}
    return joint


def ordered_draws(q: torch.Tensor, k: int, replacement: bool):
    """Every ordered k-tuple a draw can produce, with its probability."""
    support = [x for x in range(V) if q[x] > 0]
    tuples = itertools.product(support, repeat=k) if replacement else itertools.permutations(support, k)
    for draws in tuples:
        prob, left = 1.0, 1.0
        for x in draws:
            prob *= float(q[x]) / (1.0 if replacement else left)
            left -= float(q[x])
        yield draws, prob


def branching_trees(branching: tuple[int, ...], replacement: bool):
    """All (tree, probability) for per-depth branching drafts, built with DraftTree itself."""

    def grow(tree, frontier, depth, prob):
        if depth == len(branching) or not frontier:
            yield tree, prob
            return
        options = []
        for node in frontier:
            ctx = tuple(tree.tokens[n] for n in tree.path_to(node)[1:])
            tree.q[node] = draft(ctx)
            options.append(list(ordered_draws(tree.q[node], branching[depth], replacement)))
        for combo in itertools.product(*options):
            t = DraftTree(list(tree.tokens), list(tree.parents), list(tree.depths),
                          [list(d) for d in tree.draws], dict(tree.q))
            new, p_combo = [], prob
            for node, (draws, pr) in zip(frontier, combo):
                p_combo *= pr
                for x in draws:
                    child, is_new = t.add_draw(node, x)
                    new += [child] if is_new else []
            yield from grow(t, new, depth + 1, p_combo)

    yield from grow(DraftTree.rooted_at(0), [0], 0, 1.0)


def sequence_trees(k: int, length: int):
    """SpecTr: every tuple of k i.i.d. draft sequences, merged into a trie."""
    seqs = list(itertools.product(range(V), repeat=length))
    seq_prob = {}
    for s in seqs:
        pr = 1.0
        for d in range(length):
            pr *= float(draft(s[:d])[s[d]])
        seq_prob[s] = pr
    for combo in itertools.product(seqs, repeat=k):
        prob = 1.0
        for s in combo:
            prob *= seq_prob[s]
        if prob == 0:
            continue
        tree = DraftTree.rooted_at(0)
        nodes = [0] * k
        for d in range(length):
            for i, s in enumerate(combo):
                if d < length:
                    tree.q[nodes[i]] = draft(s[:d])
                nodes[i] = tree.add_draw(nodes[i], s[d])[0]
        yield tree, prob


def step_outcomes(tree: DraftTree, rule: Rule) -> dict[tuple, float]:
    """Exact distribution of the tokens one verification step emits for this tree."""

    def walk(node: int, ctx: tuple) -> dict[tuple, float]:
        p = target(ctx)
        out: dict[tuple, float] = defaultdict(float)
        draws = tree.draws[node]
        if not draws:
            for y in range(V):
                out[(y,)] += float(p[y])
            return out
        node_plan = plan(p, tree.q[node], [tree.tokens[c] for c in draws], rule)
        reach = 1.0
        for child, accept in zip(draws, node_plan.accept_probabilities()):
            token = tree.tokens[child]
            for seq, pr in walk(child, ctx + (token,)).items():
                out[(token,) + seq] += reach * accept * pr
            reach *= 1 - accept
        for y in range(V):
            out[(y,)] += reach * float(node_plan.residuals[-1][y])
        return out

    return walk(0, ())


def completed_joint(trees, rule: Rule) -> dict[tuple, float]:
    """Average the step's output over the draft trees, then complete it with the target up to
    DEPTH + 1 tokens: exactness means this equals the target's own joint distribution."""
    unique: dict[tuple, list] = {}  # sampled trees repeat: verify each distinct one once
    for tree, prob in trees:
        key = (tuple(tree.tokens), tuple(tree.parents), tuple(map(tuple, tree.draws)))
        unique.setdefault(key, [tree, 0.0])[1] += prob
    joint: dict[tuple, float] = defaultdict(float)
    for tree, prob in unique.values():
        for seq, pr in step_outcomes(tree, rule).items():
            tails = {(): 1.0}
            for _ in range(DEPTH + 1 - len(seq)):
                tails = {t + (y,): tp * float(target(seq + t)[y]) for t, tp in tails.items() for y in range(V)}
            for t, tp in tails.items():
                joint[seq + t] += prob * pr * tp
    return joint


def max_error(joint: dict[tuple, float]) -> float:
    exact = target_joint(DEPTH + 1)
    return max(abs(joint.get(s, 0.0) - pr) for s, pr in exact.items())


CASES = {
    "sd": (lambda: branching_trees((1, 1), replacement=False), Rule.WITHOUT_REPLACEMENT),
    "rsd-c 2,2": (lambda: branching_trees((2, 2), replacement=False), Rule.WITHOUT_REPLACEMENT),
    "rsd-c 3,1": (lambda: branching_trees((3, 1), replacement=False), Rule.WITHOUT_REPLACEMENT),
    "mss 2,2": (lambda: branching_trees((2, 2), replacement=True), Rule.WITH_REPLACEMENT),
    "mss 3,1": (lambda: branching_trees((3, 1), replacement=True), Rule.WITH_REPLACEMENT),
    "spectr K=2": (lambda: sequence_trees(2, DEPTH), Rule.KSEQ),
    # rsd-s at depth 1 is a Gumbel-top-W draw, so it is enumerable; depth 2 is checked below
    "rsd-s W=3 L=1": (lambda: branching_trees((3,), replacement=False), Rule.WITHOUT_REPLACEMENT),
}


@pytest.mark.parametrize("case", list(CASES))
def test_output_distribution_is_exactly_the_target(case):
    trees, rule = CASES[case]
    total = sum(prob for _, prob in trees())
    assert total == pytest.approx(1.0, abs=1e-12)
    assert max_error(completed_joint(trees(), rule)) < 1e-9


def test_without_replacement_drafts_verified_without_renormalising_are_biased():
    trees, _ = CASES["rsd-c 2,2"]
    assert max_error(completed_joint(trees(), Rule.BIASED)) > 1e-3


def test_iid_drafts_verified_as_without_replacement_are_biased():
    trees, _ = CASES["mss 2,2"]
    assert max_error(completed_joint(trees(), Rule.WITHOUT_REPLACEMENT)) > 1e-3


def test_kseq_rho_solves_its_equation():
    p, q = target(()), draft(())
    for k in (1, 2, 3, 5):
        rho = kseq_rho(p, q, k)
        beta = float(torch.minimum(q, p / rho).sum())
        assert 1 <= rho <= k
        assert 1 - (1 - beta) ** k == pytest.approx(rho * beta, abs=1e-12)


def _sampled_trees(shape, n: int, seed: int):
    """Trees from the real drafting code (stochastic beam search has no finite enumeration)."""
    gen = torch.Generator().manual_seed(seed)

    def expand(tree, nodes):
        return torch.stack([draft(tuple(tree.tokens[m] for m in tree.path_to(x)[1:])) for x in nodes])

    for _ in range(n):
        yield build_tree(shape, 0, draft(()), expand, gen), 1.0 / n


def test_rsd_s_depth_two_is_exact_given_sampled_trees():
    """Exact verification given each tree, Monte-Carlo over 3000 stochastic-beam-search trees:
    the error is sampling noise only, and well below the bias of the wrong rule."""
    trees = list(_sampled_trees(make_shape("rsd-s", beam_width=3, depth=2), 3000, 0))
    err = max_error(completed_joint(trees, Rule.WITHOUT_REPLACEMENT))
    biased = max_error(completed_joint(trees, Rule.BIASED))
    print(f"rsd-s error {err:.5f}, biased rule {biased:.5f}")
    assert err < 0.006
    assert biased > 2 * err


def test_real_drafting_matches_the_enumeration_for_rsd_c():
    """The drafting code draws trees with the probabilities the enumeration assumes."""
    shape = make_shape("rsd-c", branching=(2, 2))
    exact = completed_joint(branching_trees((2, 2), replacement=False), Rule.WITHOUT_REPLACEMENT)
    sampled = completed_joint(_sampled_trees(shape, 3000, 1), Rule.WITHOUT_REPLACEMENT)
    assert max(abs(sampled[s] - exact[s]) for s in exact) < 0.006


def _root_acceptance_by_enumeration(p, q, k, rule):
    """Sum over every ordered draw of k drafts of P(draws) * P(one is accepted | draws)."""
    total = 0.0
    draws = itertools.product(range(V), repeat=k) if rule is Rule.WITH_REPLACEMENT else \
        itertools.permutations(range(V), k)
    for xs in draws:
        prob, left = 1.0, 1.0
        for x in xs:
            prob *= float(q[x]) / left
            if rule is Rule.WITHOUT_REPLACEMENT:
                left -= float(q[x])
        if prob == 0:
            continue
        rejected = 1.0
        for a in plan(p, q, list(xs), rule).accept_probabilities():
            rejected *= 1 - a
        total += prob * (1 - rejected)
    return total


@pytest.mark.parametrize("k", [2, 3])
def test_root_acceptance_matches_enumeration_and_never_favours_replacement(k):
    from rsd_cli.verification import root_acceptance

    generator = torch.Generator().manual_seed(0)
    for salt in range(4):
        p, q = toy_dist((salt,), 10), toy_dist((salt,), 11, zero_token=salt % V)
        iid = root_acceptance(p, q, k, Rule.WITH_REPLACEMENT, 1, generator)
        wor = root_acceptance(p, q, k, Rule.WITHOUT_REPLACEMENT, 4000, generator)
        # i.i.d.: one rejection path is the exact value
        assert iid == pytest.approx(_root_acceptance_by_enumeration(p, q, k, Rule.WITH_REPLACEMENT), abs=1e-12)
        # without replacement: a Monte-Carlo average over rejection paths, so a loose tolerance
        assert wor == pytest.approx(_root_acceptance_by_enumeration(p, q, k, Rule.WITHOUT_REPLACEMENT), abs=0.01)
        assert _root_acceptance_by_enumeration(p, q, k, Rule.WITHOUT_REPLACEMENT) >= iid - 1e-12


@pytest.mark.parametrize("rule", [Rule.WITHOUT_REPLACEMENT, Rule.WITH_REPLACEMENT, Rule.KSEQ])
def test_verify_decides_as_its_plan_says(rule):
    """The engine's `verify` (first draft tried before any residual is computed) has the outcome
    distribution the plan gives: draft k accepted with prob prod_{j<k} (1 - a_j) a_k, else the
    correction y with prod (1 - a_j) r(y). Monte-Carlo, chi-square; the plan's own numbers are the
    ones the enumeration tests above prove exact."""
    from scipy.stats import chisquare

    from rsd_cli.verification import verify

    p, q = target(()), draft(())
    drafts = [0, 2, 1] if rule is Rule.WITHOUT_REPLACEMENT else [0, 2, 0]
    node_plan = plan(p, q, drafts, rule)
    accept = node_plan.accept_probabilities()
    expected, reach = [], 1.0
    for a in accept:
        expected.append(reach * a)
        reach *= 1 - a
    expected += [reach * float(r) for r in node_plan.residuals[-1]]  # outcomes len(drafts) + y
    generator, n = torch.Generator().manual_seed(0), 20_000
    counts = [0] * len(expected)
    for _ in range(n):
        decision, _ = verify(p, q, drafts, rule, generator)
        counts[decision.accepted if decision.accepted is not None else len(drafts) + decision.correction] += 1
    observed = [c for c, e in zip(counts, expected) if e > 0]
    assert sum(c for c, e in zip(counts, expected) if e == 0) == 0
    assert chisquare(observed, [e * n for e in expected if e > 0]).pvalue > 1e-3


def test_chain_decisions_give_each_node_its_plan_s_acceptance_and_residual():
    """verification.chain_decisions decides a whole chain on the device: node i accepts its draft
    with its rrs plan's accept[0] and otherwise corrects from the plan's first residual, each node
    with draws of its own, and the bonus comes from the last node's p. Checked on a long chain
    whose nodes alternate between two (p, q, draft) triples — the second's draft where q is below
    p (always accepted), the first's where it is not, and a token the draft cannot propose that
    only corrections supply — against the plans (counts within 4.5 standard deviations, and a
    chi-square fit of the corrections)."""
    from scipy.stats import chisquare

    from rsd_cli.verification import chain_decisions

    contexts = [(0,), (1, 2)]
    drafts = []
    for ctx in contexts:
        p, q = target(ctx), draft(ctx)
        drafts.append(int((q - p).argmax()) if ctx == (0,) else int((p - q).argmax()))  # q(x) > p(x): may reject
    n = 6000
    p = torch.stack([target(contexts[i % 2]) for i in range(n + 1)])
    q = torch.stack([draft(contexts[i % 2]) for i in range(n)])
    x = torch.tensor([drafts[i % 2] for i in range(n)])
    accepted, corrections, bonus = chain_decisions(p, q, x, torch.Generator().manual_seed(0))
    assert accepted.shape == corrections.shape == (n,) and bonus.shape == (1,)
    for parity, ctx in enumerate(contexts):
        node_plan = plan(target(ctx), draft(ctx), [drafts[parity]], Rule.WITHOUT_REPLACEMENT)
        a = float(node_plan.accept[0])
        rate = accepted[parity::2].double().mean().item()
        assert abs(rate - a) <= 4.5 * (a * (1 - a) / (n / 2)) ** 0.5 + 1e-12, (ctx, rate, a)
        if a < 1:
            residual = node_plan.residuals[0]
            counts = torch.bincount(corrections[parity::2], minlength=V).double()
            assert counts[residual == 0].sum() == 0  # never a token the residual lacks
            keep = residual > 0
            expected = residual[keep] * counts.sum()
            assert chisquare(counts[keep].numpy(), expected.numpy()).pvalue > 1e-3
            assert residual[4] > 0  # the token the draft lacks comes from corrections
        else:
            assert rate == 1.0


@pytest.mark.parametrize("drawn", [(True, True, True), (True, True, False)], ids=["3 drawn", "2 of 3 drawn"])
def test_fan_decisions_try_root_children_as_the_plan_does(drawn):
    """verification.fan_decisions decides a root's children (drawn without replacement) at once on
    the device: the first accepted child is child i with probability prod_{j<i}(1 - a_j) a_i (a
    the plan's accept), none with prod(1 - a_j), the correction then follows the plan's last
    residual, and a child not drawn (a q with fewer tokens of mass than children) is never
    accepted nor counted. 4000 decisions of one fan against the plan (chi-square fits)."""
    from scipy.stats import chisquare

    from rsd_cli.verification import fan_decisions

    ctx = (0,)
    p_root, q = target(ctx), draft(ctx)
    # the draft's likeliest first (as Gumbel-top-k most often draws them): the second one's acceptance
    # is 0.471 with q renormalised without the first (1.0 without renormalising), the third's 1.0
    drafts = [int(t) for t in q.argsort(descending=True)[:3]]
    tried = drafts[: sum(drawn)]
    node_plan = plan(p_root, q, tried, Rule.WITHOUT_REPLACEMENT)
    a = node_plan.accept.tolist()
    expected = []
    for i in range(len(tried)):
        expected.append(torch.tensor([1 - a_j for a_j in a[:i]]).prod().item() * a[i])
    expected.append(1 - sum(expected))  # none accepted
    p = torch.stack([p_root] + [target(ctx + (t,)) for t in drafts])
    generator = torch.Generator().manual_seed(1)
    outcomes, corrections = torch.zeros(len(tried) + 1), torch.zeros(V)
    for _ in range(4000):
        accepted, correction, bonus = fan_decisions(p, q, torch.tensor(drafts), torch.tensor(drawn), generator)
        assert bonus.shape == (3,) and not accepted[len(tried):].any()
        hits = accepted.nonzero().flatten().tolist()
        first = hits[0] if hits else len(tried)
        outcomes[first] += 1
        if not hits:
            corrections[int(correction)] += 1
    expected = torch.tensor(expected) * 4000
    keep = expected > 0
    assert chisquare(outcomes[keep].numpy(), expected[keep].numpy()).pvalue > 1e-3, (outcomes, expected)
    if expected[-1] > 50:  # (with all three drawn the third is always accepted: no correction)
        residual = node_plan.residuals[-1]
        assert corrections[residual == 0].sum() == 0
        assert chisquare(corrections[residual > 0].numpy(),
                         (residual[residual > 0] * corrections.sum()).numpy()).pvalue > 1e-3
