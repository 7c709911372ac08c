"""`--variant auto`: the shapes it searches, its cost and acceptance models, the choice they
make, and that its output is still exactly the target's (greedy and Monte-Carlo) while the
shape changes from step to step."""

from __future__ import annotations

import json
import weakref

import pytest
import torch
from typer.testing import CliRunner

from rsd_cli import auto
from rsd_cli.auto import Acceptance, AutoShape, Costs, candidates, expected_tokens
from rsd_cli.cli import app
from rsd_cli.drafting import NgramIndex, make_shape
from rsd_cli.engine import CachedLM, Decoder
from rsd_cli.sampling import SamplingParams
from rsd_cli.verification import Decision
from test_engine import N_SAMPLES, PROMPT, REPEATING, V, chi_square_pvalue, exact_joint, plain_greedy
from tiny import tiny_model


@pytest.fixture(scope="module")
def pair():
    return tiny_model(V, layers=2, seed=0, scale=0.1), tiny_model(V, layers=1, seed=1, scale=0.1)


def flat(target: float, draft: float = 0.0) -> Costs:
    """Costs that do not grow with the number of tokens."""
    return Costs({1: target, 64: target}, {1: draft, 32: draft})


def test_candidates_are_exact_shapes_within_the_node_limit():
    shapes = candidates(16)
    names = [s.describe() for s in shapes]
    assert len(names) == len(set(names)) and names[0] == "ar" and "sd γ=3" in names and "rsd-c b=(3,2)" in names
    assert all(s.variant in ("ar", "sd", "rsd-c") and s.max_nodes <= 16 for s in shapes)
    assert all(list(s.branching) == sorted(s.branching, reverse=True) for s in shapes)
    assert max(s.max_nodes for s in candidates()) <= auto.MAX_NODES
    assert [s.describe() for s in candidates(2)] == ["ar", "sd γ=1", "rsd-c b=(1)"] or \
        [s.describe() for s in candidates(2)] == ["ar", "sd γ=1"]
    assert all(max(s.branching, default=1) <= 2 for s in AutoShape(flat(1.0), vocab=2).shapes)


def test_costs_interpolate_between_and_extrapolate_beyond_the_measured_sizes():
    costs = Costs({1: 1.0, 4: 2.5, 8: 4.0}, {1: 0.1, 2: 0.2})
    assert costs.target_at(1) == 1.0 and costs.target_at(2) == pytest.approx(1.5)
    assert costs.target_at(16) == pytest.approx(7.0) and costs.draft_at(3) == pytest.approx(0.3)
    assert Costs.from_json(json.loads(json.dumps(costs.as_json()))) == costs


def check(tried: int, accepted: int | None):
    from rsd_cli.engine import NodeCheck

    return NodeCheck(0, list(range(1, tried + 1)), Decision(accepted, tried, None), ())


def test_costs_are_measured_as_the_sizes_compare_while_the_machine_s_pace_drifts(monkeypatch):
    """The machine's pace changes while the table is measured (here it halves two thirds of the way
    through, and one call of one size catches a moment three times faster): the sizes still compare
    as their true costs do, and a larger forward never costs less than a smaller one."""
    from rsd_cli import engine

    true = {n: 1.0 + 0.3 * (n - 1) for n in auto.TARGET_SIZES}  # each further token 0.3 of the first
    calls = []

    def timed_chain(cache, n):
        calls.append(n)
        pace = 1.0 if len(calls) < 2 * len(auto.TARGET_SIZES) else 0.5
        blip = 1 / 3 if len(calls) == 5 else 1.0  # (the 4th size of the first round)
        return true[n] * pace * blip

    class Cache:
        def extend(self, tokens):
            pass

        def release(self):
            pass

    monkeypatch.setattr(engine, "timed_chain", timed_chain)
    costs = auto.measure(Cache, None)
    assert costs.draft == {}
    for n in auto.TARGET_SIZES:
        assert costs.target[n] == pytest.approx(0.5 * true[n]), n  # (the fastest pace, every size alike)
    assert auto.non_decreasing({1: 2.0, 2: 1.0, 4: 3.0, 8: 2.5}) == {1: 2.0, 2: 2.0, 4: 3.0, 8: 3.0}


def test_acceptance_counts_each_rank_given_the_ones_before_were_rejected():
    acceptance = Acceptance()
    acceptance.observe([check(2, 1), check(1, 0)])  # depth 0: rank 0 rejected, rank 1 accepted; depth 1: rank 0
    acceptance.observe([check(3, None)])  # depth 0: all three rejected
    assert acceptance.tried == {(0, 0): 2, (1, 0): 2, (2, 0): 1, (0, 1): 1}
    assert acceptance.accepted == {(1, 0): 1, (0, 1): 1}
    many = Acceptance()
    for _ in range(2000):
        many.observe([check(1, 0)])
        many.observe([check(1, None)])
    assert many.rate(0, 0) == pytest.approx(0.5, abs=0.02)
    chain = make_shape("sd", draft_len=3)
    assert expected_tokens(chain, many) == pytest.approx(1 + 0.5 + 0.25 + 0.125, abs=0.05)


def test_a_shape_used_is_timed_by_its_own_steps():
    policy = AutoShape(flat(1.0, 0.1))
    shape = make_shape("rsd-c", branching=(3,))
    before = policy.seconds(shape)
    assert before == pytest.approx(1.1)

    class Step:  # the forwards at the model's pace; the rest of the step is the shape's own
        step, checks, draft_seconds, verify_seconds = 1, [check(3, 0)], 5.0, 0.45
        forward_seconds, draft_forward_seconds = 5.0, 4.9

    Step.shape = shape
    policy.observe(Step)  # the first step's draft call read the prompt too: its time is not learnt
    assert policy.seconds(shape) == before
    Step.step, Step.draft_seconds, Step.forward_seconds, Step.draft_forward_seconds = 2, 0.05, 0.45, 0.045

    Step.shape = shape
    for _ in range(auto.WARM_UP_STEPS):  # a shape's first steps set kernels up: not learnt either
        policy.observe(Step)
    assert policy.seconds(shape) == before

    class Plain:
        step, checks, shape, draft_seconds, verify_seconds = 3, [], make_shape("ar"), 0.0, 1.0
        forward_seconds, draft_forward_seconds = 0.9, 0.0

    policy.observe(Plain)
    Step.draft_seconds, Step.draft_forward_seconds = 0.5, 0.495  # after plain steps: the draft read the tokens
    Step.forward_seconds = 0.9                                        # it missed
    policy.observe(Step)
    assert policy.seconds(shape) == before  # a cost of switching, not of the shape: not learnt
    Step.draft_seconds, Step.forward_seconds, Step.draft_forward_seconds = 0.05, 0.45, 0.045
    policy.observe(Step)
    assert 0.5 < policy.seconds(shape) < before  # measured: used from now on (one step moves it a little)
    for _ in range(40):
        policy.observe(Step)
    assert policy.seconds(shape) == pytest.approx(0.5, rel=0.01)
    assert policy.seconds(make_shape("sd", draft_len=1)) < before  # the model, scaled towards what was measured


def test_a_used_shape_s_estimate_follows_the_machine_s_speed():
    """A shape timed while the machine was fast must not look cheap for ever once it slows down
    (a busy neighbour): what a shape keeps is its time over the scaled model's."""
    policy = AutoShape(flat(1.0, 0.1))
    tree, chain = make_shape("rsd-c", branching=(3,)), make_shape("sd", draft_len=1)

    class Step:
        step, checks, shape, draft_seconds, verify_seconds = 2, [check(3, 0)], tree, 0.1, 1.0
        forward_seconds, draft_forward_seconds = 1.1, 0.1

    policy.observe(Step)
    assert policy.seconds(tree) == pytest.approx(1.1)
    Step.shape, Step.draft_seconds, Step.verify_seconds = chain, 0.2, 2.0  # everything now takes twice as long
    Step.forward_seconds, Step.draft_forward_seconds = 2.2, 0.2
    for _ in range(40):
        policy.observe(Step)
    assert policy.seconds(tree) == pytest.approx(2.2, rel=0.02)
    assert policy.seconds(chain) == pytest.approx(2.2, rel=0.02)


def test_plain_steps_tell_the_machine_s_pace_to_drafting_shapes_too():
    """While plain decoding runs, a slowdown of the whole machine must not make drafting look
    relatively cheaper: plain steps move the draft's scale along with the target's."""
    policy = AutoShape(flat(1.0, 0.5))
    chain, plain = make_shape("sd", draft_len=1), make_shape("ar")
    for shape, draft, verify in ((chain, 0.5, 1.0), (plain, 0.0, 1.0)):
        class Step:
            step, checks, draft_seconds, verify_seconds = 2, [check(1, 0)] if shape.depth else [], draft, verify
            forward_seconds, draft_forward_seconds = draft + verify, draft
        Step.shape = shape
        for _ in range(auto.WARM_UP_STEPS + 2):
            policy.observe(Step)
    ratio = policy.seconds(chain) / policy.seconds(plain)
    Step.verify_seconds = Step.forward_seconds = 2.0  # plain steps now take twice as long
    for _ in range(60):
        policy.observe(Step)
    assert policy.seconds(plain) == pytest.approx(2.0, rel=0.02)
    assert policy.seconds(chain) / policy.seconds(plain) == pytest.approx(ratio, rel=0.02)


def test_a_slow_spell_during_plain_steps_does_not_stick_to_plain_decoding():
    """The machine slows down while plain decoding runs (a busy neighbour), then speeds up again
    while drafting runs: plain decoding's estimate follows the drafting steps' forwards back down,
    though no plain step ran since. (Learnt as a ratio to the scaled model, the spell stuck to
    plain decoding's ratio: it looked 1.43x slower than it was for hundreds of drafting steps.)"""
    policy = AutoShape(Costs({1: 1.0, 2: 1.2, 64: 3.0}, {1: 0.2, 32: 0.5}))
    plain, chain = make_shape("ar"), make_shape("sd", draft_len=1)

    def run(shape, steps: int, forward: float, draft_forward: float = 0.0, overhead: float = 0.1):
        class Step:
            checks = [check(1, 0)] if shape.depth else []
            draft_seconds = draft_forward + (0.05 if shape.depth else 0.0)
            verify_seconds = forward - draft_forward + overhead
            forward_seconds, draft_forward_seconds = forward, draft_forward
        Step.step, Step.shape = 2, shape
        for _ in range(steps):
            policy.observe(Step)

    run(plain, auto.WARM_UP_STEPS + 30, 1.0)  # 1.1 s a plain step: 1.0 of forward
    assert policy.seconds(plain) == pytest.approx(1.1, rel=0.02)
    run(plain, 6, 2.0, overhead=0.2)  # a slow spell: everything takes twice as long
    run(chain, auto.WARM_UP_STEPS + 40, 1.4, 0.2)  # drafting, at the first pace again
    assert policy.seconds(plain) == pytest.approx(1.1, rel=0.03)
    assert policy.seconds(chain) == pytest.approx(1.55, rel=0.03)


def test_a_forward_of_more_tokens_costs_what_generation_takes_as_the_machine_s_pace_drifts():
    """The cost table, measured apart from generation, rates a 2-token forward 1.19x a plain one where
    generation takes 1.31x (the embedded target on a 2-core Xeon): learnt from plain and 2-token steps
    a step or two apart, the factor is corrected while the machine's pace grows 1.5x, and a later run
    starts from it."""
    policy = AutoShape(Costs({1: 1.0, 2: 1.19, 64: 5.0}, {1: 0.1, 32: 0.5}))
    plain, chain = make_shape("ar"), make_shape("sd", draft_len=1)
    steps = 0

    def observe(shape) -> None:
        nonlocal steps
        steps += 1
        pace = 1.5 ** (steps / 480)
        target = pace * (1.31 if shape.depth else 1.0)

        class Step:
            checks = [check(1, 0)] if shape.depth else []
            draft_forward_seconds = 0.1 * pace if shape.depth else 0.0
            draft_seconds = draft_forward_seconds + (0.05 if shape.depth else 0.0)
            verify_seconds, forward_seconds = target + 0.1, target + draft_forward_seconds
        Step.step, Step.shape = 2, shape
        policy.observe(Step)

    for _ in range(60):  # plain decoding, and now and then an exploration (its first step a switch's)
        for shape in [plain] * 6 + [chain] * 2:
            observe(shape)
    assert policy.size_factor[2] == pytest.approx(1.31 / 1.19, rel=0.02)
    assert policy.step_seconds(chain)[1] / policy.step_seconds(plain)[1] == pytest.approx(1.31, rel=0.02)
    assert policy.step_seconds(plain)[1] == pytest.approx(1.5 ** (steps / 480), rel=0.05)  # the pace as before
    later = AutoShape(policy.costs)
    later.recall(json.loads(json.dumps(policy.remembered())))
    assert later.step_seconds(chain) == pytest.approx(policy.step_seconds(chain))
    with pytest.raises(ValueError):
        later.recall({**policy.remembered(), "sizes": {"2": -1.0}})


def test_one_slow_step_moves_an_estimate_only_a_little():
    policy = AutoShape(flat(1.0))
    plain = make_shape("ar")

    class Step:
        step, checks, shape, draft_seconds, verify_seconds = 2, [], plain, 0.0, 1.0
        forward_seconds, draft_forward_seconds = 1.0, 0.0

    for _ in range(auto.WARM_UP_STEPS + 5):
        policy.observe(Step)
    before = policy.seconds(plain)
    Step.verify_seconds = Step.forward_seconds = 50.0  # a page fault, a busy neighbour
    policy.observe(Step)
    assert before < policy.seconds(plain) <= before * (1 + auto.MEASURED_MEMORY * (auto.OUTLIER - 1)) * 1.05
    Step.verify_seconds = Step.forward_seconds = 2.0  # a lasting change is followed within a few dozen steps
    for _ in range(40):
        policy.observe(Step)
    assert policy.seconds(plain) == pytest.approx(2.0, rel=0.02)


def slow_drafting_policy(memory_key=None) -> AutoShape:
    """A policy whose drafting, as modelled, pays but whose timed drafting steps take twice the
    model's time; every second first draft accepted, never a later one."""
    policy = AutoShape(Costs({1: 1.0, 2: 1.05, 64: 3.0}, {1: 0.1, 32: 0.5}), memory_key=memory_key)
    assert policy.next_shape().depth > 0  # a policy that knows nothing drafts first
    chain = make_shape("sd", draft_len=1)

    class Step:
        step, checks, shape, draft_seconds, verify_seconds = 2, [check(1, 0)], chain, 1.3, 1.1
        forward_seconds, draft_forward_seconds = 1.15, 0.1  # the forwards as modelled, the rest the step's own

    for index in range(60):
        Step.checks = [check(1, 0)] if index % 2 else [check(6, None)]
        policy.observe(Step)
    return policy


def test_what_auto_learnt_is_where_the_next_run_starts():
    policy = slow_drafting_policy(memory_key="this machine | these models | T=1")
    assert policy.ranking(1)[0][0] == "ar"
    policy.save()
    stored = json.loads(auto.memory_path().read_text())["this machine | these models | T=1"]
    assert max(cell[2] for cell in stored["acceptance"]) == auto.MEMORY_TRIES  # 60 tries kept as 32
    later = AutoShape(policy.costs)
    later.recall(json.loads(json.dumps(stored)))
    assert later.acceptance.rate(0, 0) == pytest.approx(policy.acceptance.rate(0, 0), abs=0.02)
    for shape in later.shapes[:10]:
        assert later.seconds(shape) == pytest.approx(policy.seconds(shape))
    assert later.next_shape().describe() == "ar"  # no drafting steps to find out again
    with pytest.raises(ValueError):
        later.recall({**stored, "scales": [0.0, 1.0]})
    with pytest.raises(KeyError):
        later.recall({"ratios": {}})


def test_auto_s_memory_keeps_the_runs_saved_most_recently():
    """auto.json is read before each answer and written after it: it keeps the MEMORY_ENTRIES runs
    saved last (a run's memory and its timings), not every machine, model and sampling setting ever
    used; a run saved again moves to the newest, whatever order the file had."""
    policy = slow_drafting_policy()
    names = [f"run {index}" for index in range(auto.MEMORY_ENTRIES + 5)]
    for name in names:
        policy.memory_key, policy.timing_key = name, f"{name} | timings"
        policy.save()
    kept = list(json.loads(auto.memory_path().read_text()))
    assert len(kept) == auto.MEMORY_ENTRIES and kept[-2:] == [names[-1], f"{names[-1]} | timings"]
    assert names[0] not in kept and names[-auto.MEMORY_ENTRIES // 2] in kept
    oldest = kept[0]  # saved again: now the newest, and the one after it the oldest
    policy.memory_key, policy.timing_key = oldest, None
    policy.save()
    again = list(json.loads(auto.memory_path().read_text()))
    assert again[-1] == oldest and again[:-1] == kept[1:] and len(again) == auto.MEMORY_ENTRIES
    later = AutoShape(policy.costs)
    later.recall(json.loads(auto.memory_path().read_text())[oldest])
    assert later.remembered()["acceptance"] == policy.remembered()["acceptance"]


def test_runs_with_the_same_machine_models_and_sampling_share_what_auto_learnt_others_its_timings(pair):
    def decoder(temperature: float) -> Decoder:
        return Decoder(pair[0], pair[1], V, make_shape("auto"), SamplingParams(temperature=temperature), set())

    first = decoder(1.0)
    list(first.generate(PROMPT, 48, seed=1))
    assert first.policy.measured and first.policy.acceptance.tried  # (it drafted and timed some steps)
    assert any(a.tried for a in first.policy.lookup_acceptance.values())  # (and looked some up)
    later = auto.for_decoder(decoder(1.0))  # where a later run starts
    assert later.remembered() == json.loads(json.dumps(first.policy.remembered()))
    other = auto.for_decoder(decoder(0.5))  # other sampling settings: acceptance learnt afresh, timings kept
    assert other.acceptance.tried == {} and other.remembered()["acceptance"] == []
    assert all(a.tried == {} for a in other.lookup_acceptance.values())
    assert "exploring" not in other.remembered()  # (how far exploring has gone: with the acceptance it weighs)
    assert other.remembered() == {**{k: v for k, v in later.remembered().items() if k != "exploring"},
                                  "acceptance": [], "lookup": other.remembered()["lookup"]}
    auto.memory_path().write_text("{not json")  # a damaged file: a fresh start, no error
    assert auto.for_decoder(decoder(1.0)).acceptance.tried == {}
    key = f"{auto.cost_key(decoder(1.0))} | {SamplingParams(temperature=1.0)}"
    auto.memory_path().write_text(json.dumps({key: {"ratios": 3}}))  # written by another version
    assert auto.for_decoder(decoder(1.0)).acceptance.tried == {}
    list(decoder(1.0).generate(PROMPT, 4, seed=2))  # and overwritten by this one
    saved = json.loads(auto.memory_path().read_text())
    assert set(saved[key]) == {"acceptance", "scales", "ratios", "sizes", "lookup", "exploring"}
    assert set(saved[f"{auto.cost_key(decoder(1.0))} | timings, any sampling"]) == {"scales", "ratios", "sizes"}


def test_where_steps_are_decided_on_the_device_auto_weighs_only_those_shapes_and_plain_decoding(pair):
    """On a GPU `sd` chains and `rsd-c` root children run on the device and deeper trees on the host
    path, which measured slower there than both: auto leaves those trees out. On a CPU (the host path
    for every tree) and where the sampling reads each position's context (no device path), it weighs
    them all, as before."""
    def policy(device_steps: bool | None, sampling=SamplingParams(temperature=1.0)) -> AutoShape:
        decoder = Decoder(pair[0], pair[1], V, make_shape("auto"), sampling, set())
        decoder.device_steps = device_steps
        return auto.for_decoder(decoder)

    everything = {s.describe() for s in candidates() if max(s.branching, default=1) <= V}  # (V tokens to draw from)
    on_device = {s.describe() for s in policy(True).shapes}
    assert on_device == {name for name in everything if name == "ar" or name.startswith("sd") or "," not in name}
    assert {"ar", "sd γ=1", "sd γ=8", "rsd-c b=(2)", "rsd-c b=(6)"} <= on_device
    assert "rsd-c b=(3,1)" in everything and "rsd-c b=(3,1)" not in on_device
    assert {s.describe() for s in policy(None).shapes} == everything  # (on a CPU: the host path for all)
    assert {s.describe() for s in policy(False).shapes} == everything
    penalised = SamplingParams(temperature=1.0, repetition_penalty=1.2)
    assert {s.describe() for s in policy(True, penalised).shapes} == everything
    decoder = Decoder(pair[0], pair[1], V, make_shape("auto"), SamplingParams(temperature=1.0), set())
    decoder.device_steps = True
    shapes = set()
    for event in decoder.generate(PROMPT, 40, seed=3):
        shapes.add(event.shape.describe())
    assert shapes - {"lookup γ=%d" % g for g in range(1, 9)} <= on_device


def test_a_lookup_chain_replaces_the_shape_where_its_match_predicts_well():
    """Each step, where the context's end matched an earlier n-gram, a chain of what followed it
    (no draft model) is weighed against the chosen shape by expected tokens a second, with its
    acceptance learnt apart for each match length n; what it accepts teaches the draft nothing."""
    from types import SimpleNamespace

    policy = AutoShape(Costs({1: 1.0, 2: 1.1, 4: 1.3, 8: 4.0, 64: 40.0}, {1: 5.0, 32: 5.0}))  # the draft never pays
    for _ in range(200):  # 3-token matches are followed by what came after them; 1-token ones are not
        policy.lookup_acceptance[3].observe([check(1, 0)] * 4)
        policy.lookup_acceptance[1].observe([check(1, None)])
    plain = policy.next_shape()
    assert plain.variant == "ar"
    chain = policy.next_shape(lookup=(3, 6))
    assert chain.variant == "lookup" and not chain.uses_draft_model and 2 <= chain.depth <= 6
    assert policy.next_shape(lookup=(3, 2)).depth == 2  # no longer than what followed the match
    assert policy.next_shape(lookup=(1, 6)).variant == "ar"  # a 1-token match predicts nothing here
    assert policy.next_shape(lookup=(0, 0)).variant == "ar"
    policy.next_shape(lookup=(3, 6))
    tried = dict(policy.lookup_acceptance[3].tried)
    step = SimpleNamespace(shape=chain, checks=[check(1, 0), check(1, None)], step=5, draft_seconds=0.0,
                           verify_seconds=1.2, forward_seconds=1.1, draft_forward_seconds=0.0)
    policy.observe(step)
    assert policy.lookup_acceptance[3].tried[0, 1] == tried[0, 1] + 1 and policy.acceptance.tried == {}
    assert policy.step_seconds(chain)[0] == 0  # no draft forwards in its time


def test_no_tree_deeper_than_the_tokens_left_is_drafted():
    """A step emits at most depth + 1 tokens: with r left, the shape (a lookup chain too) is at most
    r - 1 deep, the best of those that fit; the last token is drawn plainly."""
    policy = AutoShape(flat(1.0))
    for _ in range(200):
        policy.acceptance.observe([check(1, 0)] * 8)
    assert policy.next_shape(remaining=100).describe() == "sd γ=8"
    assert policy.next_shape(remaining=4).describe() == "sd γ=3"  # the best that fits: the longest chain
    assert policy.next_shape(remaining=1).describe() == "ar"
    looking = AutoShape(Costs({1: 1.0, 64: 1.0}, {1: 5.0, 32: 5.0}))  # the draft never pays, lookups do
    for _ in range(200):
        looking.lookup_acceptance[3].observe([check(1, 0)] * 8)
    assert looking.next_shape(lookup=(3, 6)).describe() == "lookup γ=6"
    assert looking.next_shape(remaining=3, lookup=(3, 6)).describe() == "lookup γ=2"
    assert looking.next_shape(remaining=1, lookup=(3, 6)).describe() == "ar"


def test_a_lookup_chain_is_weighed_against_drafting_with_what_the_draft_must_read_first():
    """After lookup chains the draft has their tokens to read before it drafts: a drafting shape
    that wins with nothing to read can lose to a lookup chain then."""
    policy = AutoShape(Costs({1: 1.0, 2: 1.02, 64: 2.0}, {1: 0.1, 32: 3.2}), max_nodes=2)  # a draft token: 0.1
    for _ in range(200):
        policy.acceptance.observe([check(1, 0)] * 1)  # the draft's token is always accepted
        policy.lookup_acceptance[2].observe([check(1, 0) if _ % 5 else check(1, None)])  # lookup: 0.8
    drafting = policy.next_shape()
    assert drafting.uses_draft_model
    assert policy.next_shape(lag=1, lookup=(2, 4)) == drafting
    chain = policy.next_shape(lag=12, lookup=(2, 4))  # 11 more tokens to read: ~1.1 s
    assert chain.variant == "lookup"
    assert policy._rate_after(drafting, 12) < policy.rate(chain, 2) < policy.rate(drafting)


def test_expected_tokens_are_worked_out_again_only_after_drafting_steps():
    """What a choice works out from acceptance is kept through plain steps (they teach it nothing)
    and worked out again after a drafting step: the same values as from the counts afresh."""
    acceptance = auto.Acceptance()
    chain = make_shape("sd", draft_len=2)
    before = auto.expected_tokens(chain, acceptance)
    acceptance.observe([])  # a plain step
    assert acceptance._expected == {chain.branching: before}
    for _ in range(50):
        acceptance.observe([check(1, 0), check(1, 0)])
    after = auto.expected_tokens(chain, acceptance)
    assert after > before + 0.5
    assert after == auto.expected_tokens(chain, auto.Acceptance.from_json(acceptance.as_json(most=10**6)))


def test_a_choice_rates_every_shape_as_rate_does():
    """A choice works its rates out from lists (a shape's hash costs); they must be rate's, bit for
    bit, whatever was learnt: acceptance counts, scales, measured and unmeasured shapes."""
    policy = AutoShape(Costs({1: 1.0, 2: 1.1, 8: 2.0, 64: 9.0}, {1: 0.2, 8: 0.4, 32: 1.1}))
    chain, tree = make_shape("sd", draft_len=2), make_shape("rsd-c", branching=(3, 1))

    def same() -> None:
        assert policy._rates() == [policy.rate(shape) for shape in policy.shapes]

    same()
    for index in range(30):
        policy.acceptance.observe([check(3, index % 3 if index % 4 else None), check(1, 0)])
        same()
    policy.target_scale, policy.draft_scale = 1.3, 0.7
    policy.measured = {make_shape("ar"): 1.1, chain: 1.4, tree: 0.9}
    policy._mean_ratios.clear()
    same()
    policy.acceptance = auto.Acceptance.from_json(policy.acceptance.as_json(most=5))  # (as recall does)
    same()
    policy._choose()
    assert policy.current == max(policy.shapes, key=policy.rate)


def test_the_choice_follows_costs_and_acceptance():
    confident = AutoShape(flat(1.0))
    for _ in range(200):
        confident.acceptance.observe([check(1, 0)] * 8)
    assert confident.next_shape().describe() == "sd γ=8"  # free drafting, everything accepted: the longest chain
    hopeless = AutoShape(Costs({1: 1.0, 64: 64.0}, {1: 0.3, 32: 0.3}))
    for _ in range(200):
        hopeless.acceptance.observe([check(6, None)])
    assert hopeless.next_shape().describe() == "ar"  # nodes cost, drafts never accepted: plain decoding
    assert hopeless.ranking(3)[0][0] == "ar"
    chosen = [hopeless.next_shape().describe() for _ in range(14)]  # steps 2..15
    # but every 8th step drafts, so acceptance is still measured: for three steps while the shape has
    # not run in this process (its first two are not timed), then for two (the switch's is not)
    assert chosen.count("ar") == 11 and "ar" not in chosen[6:9]


# P(accept a root child | the ones before rejected), by rank: the embedded pair at T=1 (acceptance_limits.py)
MEASURED_RANKS = (0.41, 0.15, 0.09, 0.07, 0.055, 0.055, 0.04, 0.04, 0.03, 0.03, 0.03, 0.03, 0.02, 0.02, 0.02)


def test_wide_fans_are_chosen_where_verifying_more_tokens_costs_no_more():
    """Where a forward of 16 tokens costs what one does (a GPU), a root with 15 children drawn without
    replacement (accepted 0.71 of the time with the ranks above) pays most; where each verified token
    costs (a CPU), plain decoding does. Before any data, the prior's later ranks fade as measured."""
    measured = [[rank, 0, 1000, 1000 * rate] for rank, rate in enumerate(MEASURED_RANKS)]
    gpu_like = AutoShape(flat(1.0, 0.25))
    gpu_like.acceptance = Acceptance.from_json(measured)
    assert gpu_like.next_shape().describe() == "rsd-c b=(15)"
    cpu_like = AutoShape(Costs({1: 1.0, 2: 1.25, 4: 1.8, 8: 2.6, 16: 4.2, 64: 14.0}, {1: 0.2, 32: 2.0}))
    cpu_like.acceptance = Acceptance.from_json(measured)
    assert cpu_like.next_shape().describe() == "ar"
    assert [auto.prior(rank) for rank in (0, 1, 2)] == pytest.approx([0.5, 0.2, 0.1])  # (as before)
    assert auto.prior(7) == pytest.approx(MEASURED_RANKS[7], abs=0.005)
    assert auto.prior(14) == pytest.approx(MEASURED_RANKS[14], abs=0.005)
    assert {"rsd-c b=(7)", "rsd-c b=(15)"} <= {s.describe() for s in candidates()}
    assert "rsd-c b=(15)" not in {s.describe() for s in candidates(8)}  # (a budget of 8 nodes)


def test_a_drafting_shape_timed_and_found_slower_is_tried_rarely():
    """Where drafting's own step costs outweigh its gain (measured, not just modelled), plain decoding
    drafts after 128 steps instead of every 8th (a few steps, so that one such exploration can
    overturn an estimate that was wrong), then after twice as many while it stays slower; a
    drafting shape not timed yet takes the timed ones' ratio to the model."""
    policy = AutoShape(Costs({1: 1.0, 2: 1.05, 64: 3.0}, {1: 0.1, 32: 0.5}))
    for _ in range(100):  # (steps) two thirds of first drafts accepted, never a later one
        for step in ([check(6, None)], [check(1, 0)], [check(1, 0)]):
            policy.acceptance.observe(step)
    chain, tree = make_shape("sd", draft_len=1), make_shape("rsd-c", branching=(2,))
    assert policy.rate(chain) > policy.rate(make_shape("ar"))  # as modelled: drafting pays

    class Step:
        step, checks, shape, draft_seconds, verify_seconds = 2, [], chain, 1.55, 1.05  # 2.6 s, modelled 1.15
        forward_seconds, draft_forward_seconds = 2.55, 1.5  # the draft's forward 1.5 s, modelled 0.1

    for _ in range(auto.WARM_UP_STEPS + 80):  # (the draft's scale moves at most 1.25 ** 0.2 a step)
        policy.observe(Step)
    assert policy.seconds(tree) == pytest.approx(policy.seconds(chain) * sum(policy.step_seconds(tree))
                                                  / sum(policy.step_seconds(chain)))
    assert max(policy.rate(s) for s in policy.shapes if s.depth) < auto.CLEARLY_SLOWER * policy.rate(make_shape("ar"))
    chosen = [policy.next_shape().describe() for _ in range(400)]
    drafted = [i for i, name in enumerate(chosen) if name != "ar"]
    gap = auto.EXPLORE_EVERY * auto.RARELY
    # after `gap` plain steps: the switch's step and RARE_TIMED timed ones; then after twice as many
    burst = 1 + auto.RARE_TIMED
    assert drafted == [*range(gap - 1, gap - 1 + burst), *range(3 * gap + burst - 2, 3 * gap + 2 * burst - 2)]


def test_short_runs_go_on_exploring_where_the_last_one_left_off():
    """A belief remembered from earlier runs must not lock itself in: where plain decoding looks
    clearly slower (an old timing) it is tried after 128 steps, then 256... — counted across runs,
    not afresh in each, so a string of short answers (60 steps each) does try it and, finding it
    faster after all, turns to it."""
    costs = Costs({1: 1.0, 2: 1.2, 64: 3.0}, {1: 0.2, 32: 0.5})
    chain, plain = make_shape("sd", draft_len=1), make_shape("ar")
    memory = {"acceptance": [[0, 0, 32.0, 10.0]], "scales": [1.0, 1.0], "ratios": {"ar": 1.3, "sd γ=1": 1.0}}
    plain_share = []
    for _ in range(20):
        policy = AutoShape(costs, max_nodes=2)
        policy.recall(json.loads(json.dumps(memory)))
        assert policy.shapes == [plain, chain]
        chosen = []
        for step in range(1, 61):  # every sixth first draft accepted: drafting pays 0.83x plain decoding
            shape = policy.next_shape()
            chosen.append(shape)

            class Step:
                checks = [check(1, 0 if step % 6 == 0 else None)] if shape.depth else []
                draft_seconds, verify_seconds = (0.2, 1.2) if shape.depth else (0.0, 1.0)
                forward_seconds, draft_forward_seconds = (1.4, 0.2) if shape.depth else (1.0, 0.0)

            Step.step, Step.shape = step, shape
            policy.observe(Step)
        memory = policy.remembered()
        plain_share.append(chosen.count(plain) / len(chosen))
    assert plain_share[:2] == [0, 0] and min(plain_share[3:]) > 0.8, plain_share  # tried after 128 steps


def test_a_draft_far_behind_drafts_only_where_the_answer_left_repays_its_catch_up():
    """Before it can draft, the draft reads what it has not seen (a new prompt, the tokens of plain
    steps): a long prompt costs it ~1 s on a 2-core EPYC, ~130 plain steps. A drafting shape then
    gives way to plain decoding (its explorations too) unless the tokens the answer may still take
    are expected to save more than that; a short catch-up, or no limit, drafts as before."""
    policy = AutoShape(Costs({1: 1.0, 2: 1.05, 64: 3.0}, {1: 0.1, 32: 0.5}))  # a token of catch-up: ~0.016 s
    for _ in range(100):
        policy.acceptance.observe([check(1, 0)])  # every first draft accepted
    chain = make_shape("sd", draft_len=1)
    best = policy.next_shape()
    assert best.depth > 0 and policy.rate(best) > policy.rate(make_shape("ar"))  # drafting pays
    saved = policy.seconds(make_shape("ar")) - 1 / policy.rate(best)  # seconds a token
    catch_up = policy.costs.draft_at(3000)
    assert catch_up > auto.CATCH_UP_STEPS * policy.seconds(make_shape("ar"))
    too_few = int(catch_up / saved) - 1
    assert policy.next_shape(lag=3000, remaining=too_few).describe() == "ar"
    assert policy.next_shape(lag=3000, remaining=too_few + 2) == best
    assert policy.next_shape(lag=3000) == best  # (no limit)
    assert policy.next_shape(lag=40, remaining=best.depth + 1) == best  # a short catch-up: as before
    assert policy.next_shape(lag=1, remaining=best.depth + 1) == best  # (the root, read by every drafting step)
    # plain decoding chosen, its explorations of drafting wait for a catch-up that pays too
    hopeless = AutoShape(Costs({1: 1.0, 64: 64.0}, {1: 0.3, 32: 0.5}))
    for _ in range(200):
        hopeless.acceptance.observe([check(6, None)])
    assert {hopeless.next_shape(lag=3000 + i, remaining=10).describe() for i in range(40)} == {"ar"}
    explored = {hopeless.next_shape(lag=40, remaining=10).describe() for i in range(40)}  # (a short catch-up)
    assert explored != {"ar"} and chain in hopeless.shapes


def test_auto_does_not_draft_on_a_long_prompt_for_a_short_answer(pair):
    """End to end: with costs where drafting pays, a prompt the draft would need longer to read
    than a short answer can repay is answered by plain steps, the draft never called; a short
    prompt drafts."""
    class Pays(AcceptanceOnly):
        pass

    def policy() -> AutoShape:
        made = Pays(Costs({1: 1.0, 2: 1.05, 64: 3.0}, {1: 0.02, 32: 2.0}))  # a 200-token catch-up: ~13 s
        for _ in range(100):
            made.acceptance.observe([check(1, 0)])
        return made

    long_prompt = (PROMPT * 40)[:200]
    sampling = SamplingParams(temperature=1.0)
    decoder = Decoder(pair[0], pair[1], V, make_shape("auto"), sampling, set())
    decoder.policy = policy()
    events = list(decoder.generate(long_prompt, 6, 0))
    # (the prompt repeats itself: lookup chains, which need no draft, may be chosen)
    assert not any(e.shape.uses_draft_model for e in events) and sum(e.draft_calls for e in events) == 0
    decoder.policy = policy()
    events = list(decoder.generate(PROMPT, 6, 0))
    assert all(e.shape.depth > 0 for e in events) and sum(e.draft_calls for e in events) > 0


def run(pair, decoder_shape, sampling, max_tokens, seed, policy=None, warm_up_seed=None):
    """Tokens and events of one generation; with warm_up_seed, after an earlier (random) one on
    the same decoder, whose steps the policy has learnt from."""
    decoder = Decoder(pair[0], pair[1], V, decoder_shape, sampling, set())
    decoder.policy = policy
    if warm_up_seed is not None:
        list(decoder.generate(PROMPT, 6, warm_up_seed))
    events = list(decoder.generate(PROMPT, max_tokens, seed))
    return [t for e in events for t in e.emitted], events


def test_greedy_auto_equals_plain_greedy(pair):
    tokens, events = run(pair, make_shape("auto"), SamplingParams(temperature=0), 25, seed=0)
    assert tokens == plain_greedy(pair[0], 25)
    assert all(e.shape.variant in ("ar", "sd", "rsd-c", "lookup") for e in events)


class AcceptanceOnly(AutoShape):
    """auto learning from acceptance alone: the tiny models' real step times would swamp the
    made-up costs below, which are chosen so that acceptance decides."""

    def observe(self, event) -> None:
        looked_up = event.shape.variant == "lookup"
        (self.lookup_acceptance[self.matched] if looked_up else self.acceptance).observe(event.checks)


def switching_policy() -> AutoShape:
    """Re-chooses every step between shapes that are close in value, so what earlier steps
    accepted changes the later steps' shapes."""
    return AcceptanceOnly(Costs({1: 1.0, 2: 1.3, 3: 1.45, 64: 20.0}, {1: 0.05, 32: 0.5}), max_nodes=3, every=1)


def test_auto_follows_the_target_distribution_while_its_shape_changes(pair):
    """Each sample's policy first learns from an earlier random generation, so the shapes of its
    steps depend on random past outcomes (as in chat's later answers and any long answer)."""
    sampling = SamplingParams(temperature=1.0)
    counts = torch.zeros(V, V)
    shapes = set()
    for seed in range(N_SAMPLES):
        # (3 tokens: a step drafts no deeper than the tokens left, and the first two are what is counted)
        tokens, events = run(pair, make_shape("auto", nodes=3), sampling, 3, seed, switching_policy(),
                             warm_up_seed=10**6 + seed)
        counts[tokens[0], tokens[1]] += 1
        shapes.add(tuple(e.shape.describe() for e in events))
    assert len({first for first, *_ in shapes}) > 1  # the test exercises history-dependent choices
    assert any(name.startswith("lookup") for names in shapes for name in names)  # lookup chains among them
    assert chi_square_pvalue(counts, exact_joint(pair[0], sampling) * N_SAMPLES) > 1e-3


def test_costs_are_measured_once_per_machine_and_kept(pair, tmp_path, monkeypatch):
    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(auto, "_MEASURED", {})
    measured = []
    real = auto.measure
    monkeypatch.setattr(auto, "measure", lambda *a, **k: measured.append(1) or real(*a, **k))
    notices = []
    decoder = Decoder(pair[0], pair[1], V, make_shape("auto", nodes=8), SamplingParams(temperature=1.0), set(),
                      notice=notices.append)
    events = list(decoder.generate(PROMPT, 12, seed=1))
    assert measured == [1] and len(notices) == 1 and "once" in notices[0]
    assert all(len(e.tree) <= 8 for e in events)  # the budget caps auto's trees
    assert len(json.loads((tmp_path / "costs.json").read_text())) == 1
    monkeypatch.setattr(auto, "_MEASURED", {})  # a new process: reads the file
    list(Decoder(pair[0], pair[1], V, make_shape("auto"), SamplingParams(), set()).generate(PROMPT, 4, seed=1))
    assert measured == [1]


def test_costs_json_keeps_the_keys_measured_last(tmp_path, monkeypatch):
    """costs.json is read whole by each process that runs `auto`: it keeps the COST_ENTRIES keys
    measured last (each rsd version, model pair and runtime adds one), a re-measured key among them."""
    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path))
    path = tmp_path / "costs.json"
    names = [f"machine {index}" for index in range(auto.COST_ENTRIES + 3)]
    path.write_text(json.dumps({name: flat(1.0, 0.1).as_json() for name in names}))
    assert auto.cached_costs(names[0], lambda: pytest.fail("measured a key it has")) == flat(1.0, 0.1)
    measured = Costs({1: 2.0, 64: 3.0}, {1: 0.2, 32: 0.4})
    assert auto.cached_costs("a new machine", lambda: measured) == measured
    kept = list(json.loads(path.read_text()))
    assert len(kept) == auto.COST_ENTRIES and kept[-1] == "a new machine"
    assert kept[:-1] == names[-(auto.COST_ENTRIES - 1):]  # the oldest gone, the order kept
    table = json.loads(path.read_text())
    table[kept[0]] = "written by another version"
    path.write_text(json.dumps(table))
    assert auto.cached_costs(kept[0], lambda: measured) == measured  # measured again: the newest now
    again = list(json.loads(path.read_text()))
    assert again == kept[1:] + [kept[0]]
    assert auto.cached_costs(kept[0], lambda: pytest.fail("measured again")) == measured


def test_costs_measured_beside_busy_processes_are_measured_again_once_the_machine_is_idle(tmp_path, monkeypatch):
    """A table measured beside busy processes (a test run, a build) is far off — on a 2-core AMD EPYC one
    rated the draft's forward 7.9 ms and the target's 4.0, where idle they take 0.38 and 2.47 — and was
    used for good: it is kept marked busy, used while the machine stays busy, and measured again at the
    first run that finds it idle."""
    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path))
    busy, notices = [2], []
    monkeypatch.setattr(auto, "others_running", lambda: busy[0])
    slow, fast = Costs({1: 4.0e-3, 64: 0.14}, {1: 7.9e-3, 32: 0.024}), Costs({1: 2.5e-3, 64: 0.1}, {1: 4e-4, 32: 0.01})
    assert auto.cached_costs("machine", lambda: slow, notices.append) == slow
    assert json.loads((tmp_path / "costs.json").read_text())["machine"]["busy"] == 2
    assert auto.cached_costs("machine", lambda: pytest.fail("measured while still busy")) == slow
    busy[0] = 0
    assert auto.cached_costs("machine", lambda: fast, notices.append) == fast
    assert "busy" not in json.loads((tmp_path / "costs.json").read_text())["machine"]
    assert auto.cached_costs("machine", lambda: pytest.fail("measured again, idle")) == fast
    busy[0] = 1
    assert auto.cached_costs("machine", lambda: pytest.fail("an idle table measured again")) == fast
    assert "once" in notices[0] and "again, idle now" in notices[1] and len(notices) == 2


def test_an_answer_s_set_up_fingerprints_each_model_once_a_process(pair, monkeypatch):
    """Each answer of `auto` starts from the cost key, which names both models' architectures: worked
    out once per loaded model (each answer ~1 ms before), anew for another model, the key the same."""
    from rsd_cli import models

    counted = []
    real = models.fingerprint
    monkeypatch.setattr(models, "fingerprint", lambda model: counted.append(model) or real(model))
    monkeypatch.setattr(auto, "_FINGERPRINTS", weakref.WeakKeyDictionary())
    decoder = Decoder(pair[0], pair[1], V, make_shape("auto"), SamplingParams(temperature=1.0), set())
    first = auto.cost_key(decoder)
    assert counted == [pair[0], pair[1]]
    assert auto.cost_key(Decoder(pair[0], pair[1], V, make_shape("auto"), SamplingParams(), set())) == first
    assert counted == [pair[0], pair[1]]  # (a new decoder of the same models: none again)
    other = tiny_model(V, layers=3, seed=5, scale=0.1)  # another loaded model, of another architecture
    assert auto.cost_key(Decoder(other, pair[1], V, make_shape("auto"), SamplingParams(), set())) != first
    assert counted == [pair[0], pair[1], other]
    assert f"target {real(pair[0])} | draft {real(pair[1])}" in first
    costs = Costs({1: 1.0, 4: 2.0, 8: 5.0}, {1: 0.5, 2: 0.75})
    assert [costs.target_at(n) for n in (1, 2, 6, 12, 6)] == [1.0, 1.0 + 1 / 3, 3.5, 8.0, 3.5]  # (kept once worked out)
    assert costs.draft_at(3) == pytest.approx(1.0) and costs == Costs({1: 1.0, 4: 2.0, 8: 5.0}, {1: 0.5, 2: 0.75})


def test_a_first_run_s_statistics_leave_out_measuring_the_costs(pair, tmp_path, monkeypatch):
    """The forward costs a first `auto` run on a machine measures (seconds) are set-up, not the
    answer's time: the rate on the summary line, `--json` and bench is the generation's."""
    import time
    from types import SimpleNamespace

    from rsd_cli import generation

    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(auto, "_MEASURED", {})
    late = [0.0]  # the generation module's clock: measuring the costs takes 100 s by it
    monkeypatch.setattr(generation, "time", SimpleNamespace(perf_counter=lambda: time.perf_counter() + late[0]))
    real = auto.measure
    monkeypatch.setattr(auto, "measure", lambda *a, **k: late.__setitem__(0, late[0] + 100.0) or real(*a, **k))
    decoder = Decoder(pair[0], pair[1], V, make_shape("auto", nodes=8), SamplingParams(temperature=1.0), set())
    tokens, stats, _ = generation.complete(decoder, PROMPT, 12, seed=1)
    assert late[0] == 100.0 and len(tokens) == 12  # measured (once), in this call
    assert stats.wall_seconds < 100.0  # (the generation alone: milliseconds)


def test_auto_as_a_user_runs_it(tiny_profile):
    runner = CliRunner()
    result = runner.invoke(app, ["generate", "hello", "-p", str(tiny_profile), "-v", "auto", "--json", "-n", "20"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["variant"] == "auto" and record["shape"] == "auto"
    assert sum(record["stats"]["shapes"].values()) == record["stats"]["steps"]
    result = runner.invoke(app, ["generate", "hello", "-p", str(tiny_profile), "-v", "auto", "--stats", "-n", "20"])
    assert result.exit_code == 0 and "shape" in result.stderr and "auto ·" in result.stderr
    result = runner.invoke(app, ["inspect-tree", "hello", "-p", str(tiny_profile), "-v", "auto", "-f", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["shape"] != "auto"  # the step's own shape
    result = runner.invoke(app, ["bench", "-p", str(tiny_profile), "--variants", "ar,auto", "--limit", "1", "-n", "8",
                                 "--temperatures", "1", "--no-assisted", "--no-hf-static", "--json"])
    assert result.exit_code == 0, result.output
    rows = [row for row in json.loads(result.stdout)["results"] if row["variant"] == "auto"]
    assert len(rows) == 1 and rows[0]["shape"].startswith("auto (") and rows[0]["shapes_used"]


def test_chat_answers_go_on_from_what_earlier_answers_taught_auto(tiny_profile):
    import io

    from rsd_cli.chat import ChatSession
    from rsd_cli.models import load_pair
    from rsd_cli.profiles import load_profile
    from rsd_cli.runtime import apply_flags

    profile = apply_flags(load_profile(str(tiny_profile)), {"variant": "auto", "max_tokens": 10})
    session = ChatSession(load_pair(profile), profile)
    console = __import__("rich.console", fromlist=["Console"]).Console(file=io.StringIO())
    session.answer("hello", io.StringIO(), console)
    first = session.learnt[2]
    steps = first.steps
    session.answer("and again", io.StringIO(), console)
    assert session.learnt[2] is first and first.steps > steps
    session.profile.set("sampling", "temperature", 0.0, "/set")  # other sampling: learnt afresh
    session.answer("once more", io.StringIO(), console)
    assert session.learnt[2] is not first


class Scripted:
    """A stand-in for auto's policy that plays a fixed list of shapes, one per step, in order (and
    then `ar`), whatever happened: the same shapes one step at a time and queued ahead."""

    longest_lookup = 0

    def __init__(self, shapes):
        self.shapes, self.asked = list(shapes), []

    def next_shape(self, lag, remaining=None, lookup=(0, 0)):
        self.asked.append((lag, remaining))
        return self.shapes.pop(0) if self.shapes else make_shape("ar")

    def observe(self, event) -> None:
        pass

    def save(self) -> None:
        pass


AR, SD, FAN = make_shape("ar"), make_shape("sd", draft_len=2), make_shape("rsd-c", branching=(2,))
SCRIPT = [AR, AR, AR, SD, AR, FAN, FAN, AR, AR, SD, SD, AR, AR, AR]


@pytest.mark.parametrize("sampling", [SamplingParams(1.0), SamplingParams(0.0)], ids=str)
def test_auto_queues_its_plain_steps_ahead_with_the_events_of_one_step_at_a_time(pair, sampling, monkeypatch):
    """On a GPU `auto`'s plain steps are queued from the token before them, before it is read, and
    the step after a plain one gets its shape before that token is known (Decoder._plain_steps_ahead).
    With the same shapes step after step (a scripted policy), the events equal those of one step at
    a time, bit for bit, over answers that end at their length and at an end-of-sequence token, and
    what a chat keeps holds what it says; a plain step's successor is queued before its token is
    read, and the draft's lag and the tokens left are worked out one token ahead."""
    from rsd_cli import engine

    reads = []
    real_soon = engine.to_host_soon
    monkeypatch.setattr(engine, "to_host_soon", lambda tensor: (lambda read: lambda: reads.append(1) or read())(
        real_soon(tensor)))
    for eos, seed in [((), 3)] + [((0,), s) for s in range(4)]:
        runs = {}
        for ahead in (True, False):
            decoder = Decoder(pair[0], pair[1], V, make_shape("auto"), sampling, set(eos))
            decoder.policy, decoder.steps_ahead, decoder.keep_caches = Scripted(SCRIPT), ahead, True
            events = list(decoder.generate(PROMPT, 24, seed))
            runs[ahead] = (events, decoder.policy.asked, decoder.kept)
        (ours, asked, kept), (reference, reference_asked, reference_kept) = runs[True], runs[False]
        assert [e.shape for e in ours] == [e.shape for e in reference]
        assert [e.emitted for e in ours] == [e.emitted for e in reference]
        assert [e.finished for e in ours] == [e.finished for e in reference]
        assert all(torch.equal(a.p, b.p) and a.path == b.path for a, b in zip(ours, reference))
        # lag and tokens left, worked out one token ahead (and asked once more where a token ended the answer)
        assert asked[: len(reference_asked)] == reference_asked and len(asked) - len(reference_asked) in (0, 1)
        assert kept.tokens == reference_kept.tokens and kept.target.length == len(kept.tokens)
    calls = []
    real_forward = CachedLM.forward
    monkeypatch.setattr(CachedLM, "forward", lambda self, *a, **k: calls.append(
        "target" if self.model is pair[0] else "draft") or real_forward(self, *a, **k))
    reads.clear()
    decoder = Decoder(pair[0], pair[1], V, make_shape("auto"), SamplingParams(1.0), set())
    decoder.policy, decoder.steps_ahead = Scripted([AR, AR, AR]), True
    steps = decoder.generate(PROMPT, 3, seed=1)
    next(steps)
    assert calls == ["target"] * 3 and reads == [1]  # the prompt, steps 1 and 2 queued; step 1's token read
    steps.close()


def test_greedy_auto_queued_ahead_equals_plain_greedy(pair):
    decoder = Decoder(pair[0], pair[1], V, make_shape("auto"), SamplingParams(temperature=0), set())
    decoder.steps_ahead = True
    assert [t for e in decoder.generate(PROMPT, 25, seed=0) for t in e.emitted] == plain_greedy(pair[0], 25)


@pytest.mark.parametrize("device_steps, prompt", [(None, PROMPT), (True, PROMPT), (True, REPEATING)],
                         ids=["host", "device", "device-lookup"])
def test_auto_queued_ahead_follows_the_target_distribution_while_its_shape_changes(pair, device_steps, prompt):
    """As the test above, with auto's plain steps queued ahead: the shape after a plain step is
    chosen before its token is read; and as a GPU runs it, its `sd` chains and lookup chains
    decided on the device too (on a prompt whose end occurred before, lookup chains draft from the
    first step)."""
    sampling = SamplingParams(temperature=1.0)
    counts = torch.zeros(V, V)
    shapes, drafted = set(), set()
    for seed in range(N_SAMPLES):
        decoder = Decoder(pair[0], pair[1], V, make_shape("auto", nodes=3), sampling, set())
        decoder.policy, decoder.steps_ahead, decoder.device_steps = switching_policy(), True, device_steps
        list(decoder.generate(prompt, 6, 10**6 + seed))
        events = list(decoder.generate(prompt, 3, seed))  # (3: see the test above)
        tokens = [t for e in events for t in e.emitted]
        counts[tokens[0], tokens[1]] += 1
        shapes.add(tuple(e.shape.describe() for e in events))
        drafted.update(e.shape.variant for e in events if len(e.tree) > 1)
    if prompt == PROMPT:
        assert any(names[0] == "ar" and len(names) > 1 for names in shapes)  # a shape chosen ahead of a token
    assert ("lookup" if prompt == REPEATING else "sd") in drafted
    assert chi_square_pvalue(counts, exact_joint(pair[0], sampling, prompt) * N_SAMPLES) > 1e-3


def test_a_lookup_chosen_before_the_last_token_is_read_counts_what_follows_that_token(pair):
    """Where the shape is chosen before the last drawn token is read (Decoder._next_shape's
    `unread`), the lookup chain weighed is what followed the matched n-gram after that token:
    one token fewer than the continuation found."""
    decoder = Decoder(pair[0], pair[1], V, make_shape("auto"), SamplingParams(1.0), set())
    decoder.policy = Scripted([AR, AR])
    decoder.ngrams = NgramIndex(4)
    lookups = []
    decoder.policy.next_shape = lambda lag, remaining=None, lookup=(0, 0): lookups.append(lookup) or AR
    decoder.policy.longest_lookup = 4
    seq = [1, 2, 3, 1, 2]  # "1 2" was followed by "3 1 2"
    decoder._next_shape(0, 10, seq)
    decoder._next_shape(0, 10, seq, unread=1)
    assert lookups == [(2, 3), (2, 2)]
