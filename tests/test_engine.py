"""The engine on tiny random models: tree attention, cache pruning, greedy equivalence, and the
joint distribution of the first two tokens (Monte-Carlo, fixed seeds, chi-square)."""

from __future__ import annotations

import copy
import functools
import gc
import weakref
from types import CellType, FunctionType, SimpleNamespace

import pytest
import torch
from scipy.stats import chisquare
from torch.utils._python_dispatch import TorchDispatchMode

from rsd_cli.drafting import VARIANTS, Shape, make_shape, shape_for_budget
from rsd_cli.engine import CachedLM, Decoder, Stats, unchanged_prefix
from rsd_cli.sampling import SamplingParams, logits_to_probs
from rsd_cli.step_graphs import StepGraphs
from rsd_cli.tree import DraftTree
from rsd_cli.verification import Rule, chain_outcome
from tiny import tiny_model

V = 6
PROMPT = [1, 3, 4]


@pytest.fixture(scope="module")
def pair():
    # scale 0.1: spread-out distributions (about 30 likely token pairs) and a draft that differs
    # from the target (total variation 0.34 on the pair), so rejections really happen
    return tiny_model(V, layers=2, seed=0, scale=0.1), tiny_model(V, layers=1, seed=1, scale=0.1)


def full_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def test_tree_forward_equals_per_path_forwards_and_pruning_keeps_the_path(pair):
    target, _ = pair
    lm = CachedLM(target, V)
    lm.extend(PROMPT)
    tree = DraftTree.rooted_at(5)
    a, _ = tree.add_draw(0, 2)
    b, _ = tree.add_draw(0, 4)
    c, _ = tree.add_draw(a, 1)
    d, _ = tree.add_draw(b, 3)
    e, _ = tree.add_draw(c, 0)
    base = len(PROMPT)
    visible = torch.cat([torch.ones(len(tree), base, dtype=torch.bool), tree.ancestry()], dim=1)
    logits = lm.forward(tree.tokens, [base + dep for dep in tree.depths], visible)
    for node in range(len(tree)):
        path_tokens = [tree.tokens[n] for n in tree.path_to(node)]
        reference = full_logits(target, PROMPT + path_tokens)[-1]
        assert torch.allclose(logits[node], reference, atol=1e-5), node
    # keep prefix + root + a + c + e; the next token's logits equal a fresh forward
    lm.keep(list(range(base)) + [base + n for n in (0, a, c, e)])
    assert lm.length == base + 4
    nxt = lm.extend([2], last_only=True)[-1]
    fresh = full_logits(target, PROMPT + [5, 2, 1, 0, 2])[-1]
    assert torch.allclose(nxt, fresh, atol=1e-5)


def test_the_cache_goes_by_the_name_the_model_takes_it_by_without_a_deprecation_warning(pair):
    """transformers 5.24 renamed forward's past_key_values to cache (the old name warns on every
    call, to be removed in 5.40); 5.17, on the GPU machine, knows only past_key_values, and its Mamba
    family cache_params."""
    import inspect
    import warnings

    from rsd_cli.engine import cache_argument

    target, _ = pair
    named = inspect.signature(target.forward).parameters
    assert cache_argument(target) == ("cache" if "cache" in named else "past_key_values")
    lm = CachedLM(target, V)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm.extend(PROMPT)
        lm.extend([2, 4], last_only=True)
    assert not [w for w in caught if "past_key_values" in str(w.message)]
    assert lm.length == len(PROMPT) + 2  # the cache was used: the second call extended it

    class Older(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            pass

    assert cache_argument(Older()) == "past_key_values"

    class OlderMamba(torch.nn.Module):  # (Mamba's family before 5.24: any other name lands unread in **kwargs)
        def forward(self, input_ids=None, cache_params=None, use_cache=None, **kwargs):
            pass

    assert cache_argument(OlderMamba()) == "cache_params"


def test_a_wrong_mask_would_be_caught(pair):
    """Sanity check of the test above: ignoring the tree structure changes the logits."""
    target, _ = pair
    lm = CachedLM(target, V)
    lm.extend(PROMPT)
    base = len(PROMPT)
    causal = torch.ones(3, base + 3, dtype=torch.bool)  # siblings see each other: wrong for a tree
    logits = lm.forward([2, 4, 1], [base, base, base], causal)
    reference = full_logits(target, PROMPT + [4])[-1]
    assert not torch.allclose(logits[1], reference, atol=1e-4)


def shapes():
    return [make_shape("ar"), make_shape("sd", draft_len=3), make_shape("mss", branching=(2, 2, 1)),
            make_shape("spectr", num_drafts=3, depth=3), make_shape("rsd-c", branching=(3, 2)),
            make_shape("rsd-s", beam_width=3, depth=3)]


# rsd-c with root children only: off the CPU (or with device_steps) drawn and decided on the device,
# one transfer a step (Decoder._fan_step), as sd chains are (_chain_step)
FAN = make_shape("rsd-c", branching=(3,))
DEVICE_SHAPES = [make_shape("sd", draft_len=3), FAN]


def run(pair, shape, sampling, max_tokens, seed, eos=frozenset(), prompt=PROMPT, device_steps=None, runtimes=None):
    target, draft = pair
    decoder = Decoder(target, draft, V, shape, sampling, set(eos), runtimes=runtimes)
    decoder.device_steps = device_steps
    return [t for event in decoder.generate(prompt, max_tokens, seed) for t in event.emitted]


def plain_greedy(target, n: int, prompt=PROMPT) -> list[int]:
    """The target's own greedy continuation of the prompt, one full forward per token."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(full_logits(target, tokens)[-1].argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("shape", shapes() + [FAN], ids=lambda s: s.describe())
def test_greedy_equals_plain_greedy_decoding(pair, shape):
    assert run(pair, shape, SamplingParams(temperature=0), 25, seed=0) == plain_greedy(pair[0], 25)


@pytest.mark.parametrize("shape", [make_shape("rsd-c", branching=(3, 2)), make_shape("rsd-s", beam_width=3, depth=2),
                                   FAN], ids=lambda s: s.describe())
def test_greedy_trees_try_the_drafts_best_tokens_and_stay_exact(pair, shape):
    """At temperature 0 draws without replacement become the draft's top tokens (beam search for
    rsd-s): the root has 3 distinct children, not the one a one-hot q would leave, and a child
    other than the first is accepted now and then, while the output is still plain greedy."""
    target, draft = pair
    events = list(Decoder(target, draft, V, shape, SamplingParams(temperature=0), set()).generate(PROMPT, 40, seed=0))
    assert [t for e in events for t in e.emitted] == plain_greedy(target, 40)
    for event in events:
        root_children = event.tree.draws[0]
        q_root = event.tree.q[0]
        assert len(root_children) == 3
        ranked = [event.tree.tokens[c] for c in root_children]
        assert ranked == q_root.topk(3).indices.tolist()
    assert any(e.checks[0].decision.accepted not in (None, 0) for e in events)


def exact_joint(target, sampling, prompt=PROMPT) -> torch.Tensor:
    """(V, V) target probability of the first two generated tokens."""
    first = logits_to_probs(full_logits(target, prompt)[-1], sampling).double()
    joint = torch.zeros(V, V, dtype=torch.float64)
    for x in range(V):
        joint[x] = first[x] * logits_to_probs(full_logits(target, prompt + [x])[-1], sampling).double()
    return joint


def chi_square_pvalue(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Chi-square goodness of fit, pooling cells expected below 5 into one."""
    counts, expected = counts.flatten().double(), expected.flatten().double()
    expected = expected * counts.sum() / expected.sum()  # exact totals, as scipy requires
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    return float(chisquare(obs[keep].numpy(), exp[keep].numpy()).pvalue)


# tokens an answer takes where the first two are counted: a step drafts no deeper than the answer's tokens - 1
# (Decoder._for_answers), so a tree of depth 2 is drafted whole, and verified there, in answers of 3
PAIR_DRAW = 3


def sample_pairs(pair, shape, sampling, n: int, prompt=PROMPT, device_steps=None, runtimes=None) -> torch.Tensor:
    counts = torch.zeros(V, V)
    for seed in range(n):
        first, second = run(pair, shape, sampling, PAIR_DRAW, seed, prompt=prompt, device_steps=device_steps,
                            runtimes=runtimes)[:2]
        counts[first, second] += 1
    return counts


N_SAMPLES = 1500
MC_SHAPES = [make_shape("ar"), make_shape("sd", draft_len=2), make_shape("mss", branching=(2, 2)),
             make_shape("spectr", num_drafts=2, depth=2), make_shape("rsd-c", branching=(2, 2)),
             make_shape("rsd-s", beam_width=2, depth=2)]


@pytest.mark.parametrize("shape", MC_SHAPES, ids=lambda s: s.describe())
def test_first_two_tokens_follow_the_target_distribution(pair, shape):
    sampling = SamplingParams(temperature=1.0)
    expected = exact_joint(pair[0], sampling) * N_SAMPLES
    assert chi_square_pvalue(sample_pairs(pair, shape, sampling, N_SAMPLES), expected) > 1e-3


@pytest.mark.parametrize("shape", [make_shape("sd", draft_len=2), FAN], ids=lambda s: s.describe())
def test_device_steps_follow_the_target_distribution(pair, shape):
    """sd chains and rsd-c root children drafted and decided on the device (what a GPU runs, forced
    here on the CPU): the first two tokens' joint distribution is the target's."""
    sampling = SamplingParams(temperature=1.0)
    expected = exact_joint(pair[0], sampling) * N_SAMPLES
    assert chi_square_pvalue(sample_pairs(pair, shape, sampling, N_SAMPLES, device_steps=True), expected) > 1e-3


@pytest.mark.parametrize("shape", DEVICE_SHAPES, ids=lambda s: s.describe())
def test_device_steps_are_plain_greedy_and_draft_from_fresh_draft_forwards(pair, shape):
    """The same device steps at temperature 0 give plain greedy output, and at temperature 1 every
    node's q is a fresh draft forward of its path (the draft fed tokens drawn on the device, its
    cache pruned to a prefix), with corrections and bonuses both seen. By default they run only
    off the CPU: on it these shapes take the host path, which the other tests check."""
    target, draft = pair
    assert run(pair, shape, SamplingParams(temperature=0), 25, seed=0, device_steps=True) == plain_greedy(target, 25)
    decoder = Decoder(target, draft, V, shape, SamplingParams(1.0), set())
    decoder.device_steps = True
    seq, kinds = list(PROMPT), set()
    for event in decoder.generate(PROMPT, 20, seed=5):
        kinds.add(event.extra_kind)
        for node, q in event.tree.q.items():
            path = [event.tree.tokens[n] for n in event.tree.path_to(node)]
            fresh = logits_to_probs(full_logits(draft, seq[:-1] + path)[-1], SamplingParams(1.0))
            assert torch.allclose(q, fresh, atol=1e-5), (event.step, node)
        seq.extend(event.emitted)
    assert kinds == {"bonus", "correction"}
    assert decoder._on_device(shape, draft, torch.device("cpu")) is not None
    decoder.device_steps = None
    assert decoder._on_device(shape, draft, torch.device("cpu")) is None
    assert decoder._on_device(shape, draft, torch.device("cuda")) is not None


# ops a CUDA graph cannot capture: a value read on the host, or an output whose shape depends on values
UNCAPTURABLE = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "item"}


class NoHostReads(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket).split(".")[-1]
        assert name not in UNCAPTURABLE, f"{name} cannot be captured in a CUDA graph"
        return func(*args, **(kwargs or {}))


def by_address(value):
    """A maker of `value` (a function, partial, tuple or tensor) that holds the tensors it reads through
    its closures, defaults and arguments by weak reference: as a CUDA graph holds what a captured
    function read, by address. The maker fails once one of them was freed (a replay then reads memory
    put to other uses)."""
    if isinstance(value, torch.Tensor):
        ref = weakref.ref(value)

        def tensor():
            assert ref() is not None, "a graph reads a tensor freed since its capture"
            return ref()
        return tensor
    if isinstance(value, tuple):
        makers = [by_address(item) for item in value]
        return lambda: tuple(make() for make in makers)
    if isinstance(value, functools.partial):
        func, args = by_address(value.func), by_address(value.args)
        keywords = {name: by_address(item) for name, item in value.keywords.items()}
        return lambda: functools.partial(func(), *args(), **{name: make() for name, make in keywords.items()})
    if isinstance(value, FunctionType):  # (its parts, not the function: that would hold its cells)
        code, scope, name = value.__code__, value.__globals__, value.__name__
        defaults = by_address(value.__defaults__ or ())
        cells = [by_address(cell.cell_contents) for cell in value.__closure__ or ()]
        return lambda: FunctionType(code, scope, name, defaults() or None,
                                    tuple(CellType(make()) for make in cells) or None)
    return lambda: value


def replaying_capture(captured: list):
    """A CPU stand-in for StepGraphs' CUDA capture with a graph's semantics: the outputs are fixed
    buffers that each replay overwrites, computed from what the function read when it was captured,
    held by address only (by_address: a replay fails once one of those tensors was freed); no op may
    read a value on the host (as capturing forbids)."""

    def capture(run):
        with NoHostReads():
            outputs = run()
        remade = by_address(run)

        def replay():
            with NoHostReads():
                for buffer, value in zip(outputs, remade()()):
                    buffer.copy_(value)

        captured.append(outputs)
        return replay, outputs

    return capture


def device_events(pair, shape, sampling, seed, graphs=None):
    decoder = Decoder(*pair, V, shape, sampling, set())
    decoder.device_steps = True
    decoder.step_graphs = graphs
    return list(decoder.generate(PROMPT, 30, seed))  # (every event kept to the end: no buffer overwritten)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
@pytest.mark.parametrize("shape", [make_shape("ar"), make_shape("sd", draft_len=1)] + DEVICE_SHAPES,
                         ids=lambda s: s.describe())
def test_device_steps_replayed_as_graphs_decide_as_they_do_without(pair, shape, temperature):
    """A GPU with compiled forwards replays the maths of device steps and of plain steps as CUDA
    graphs (StepGraphs): one capture per site and shapes, replayed every step. With a stand-in that keeps a graph's
    semantics, every step's tokens, decisions, p and q equal those of the maths run directly, bit
    for bit, after the whole generation (results that outlive a step are copies, not buffers the
    next replay overwrites); and nothing in the maths reads a value on the host."""
    sampling = SamplingParams(temperature)
    captured = []
    graphs = StepGraphs(torch.device("cpu"), True, capture=replaying_capture(captured))
    plain, replayed = device_events(pair, shape, sampling, 3), device_events(pair, shape, sampling, 3, graphs)
    assert [e.emitted for e in replayed] == [e.emitted for e in plain]
    for a, b in zip(plain, replayed):
        assert torch.equal(a.p, b.p)
        assert a.tree.q.keys() == b.tree.q.keys() and all(torch.equal(a.tree.q[n], b.tree.q[n]) for n in a.tree.q)
        assert [c.decision for c in a.checks] == [c.decision for c in b.checks]
    assert graphs.enabled  # (a capture that raised, a host read among them, would have turned them off)
    # a plain step's draw; a chain's levels and its verdict; a fan's children and its verdict
    sites = {"ar": 1, "sd": shape.depth + 1}.get(shape.variant, 2)
    assert len(captured) == sites < len(replayed)


@pytest.mark.parametrize("sampling", [SamplingParams(1.0), SamplingParams(0.0),
                                      SamplingParams(0.8, top_k=4, top_p=0.9, min_p=0.05)], ids=str)
@pytest.mark.parametrize("shape", [make_shape("ar"), make_shape("lookup", draft_len=3)], ids=lambda s: s.describe())
def test_plain_steps_give_the_events_of_the_general_path(pair, sampling, shape, monkeypatch):
    """ar's steps (and auto's plain ones, and lookup's that find nothing to look up) take a shorter
    path than a tree's (Decoder._plain_step): the same tokens, p and events as the general host path
    (_tree_step) gives them, bit for bit."""
    shortened, real = [], Decoder._plain_step
    monkeypatch.setattr(Decoder, "_plain_step", lambda self, *args: shortened.append(1) or real(self, *args))
    ours = list(Decoder(*pair, V, shape, sampling, set()).generate(PROMPT, 30, 7))
    assert len(shortened) == sum(len(e.tree) == 1 for e in ours) > 0  # (every step that drafted nothing)
    assert (shape.variant == "ar") != any(len(e.tree) > 1 for e in ours)
    monkeypatch.setattr(Decoder, "_plain_step", lambda self, step, shape, seq, target, generator:
                        self._tree_step(step, shape, seq, target, None, generator))
    general = list(Decoder(*pair, V, shape, sampling, set()).generate(PROMPT, 30, 7))
    assert [e.emitted for e in ours] == [e.emitted for e in general]
    for a, b in zip(ours, general):
        assert torch.equal(a.p, b.p) and (a.extra_kind, a.path) == (b.extra_kind, b.path)
        assert [(c.node, c.draws, c.decision) for c in a.checks] == [(c.node, c.draws, c.decision) for c in b.checks]
        assert a.tree.tokens == b.tree.tokens


def ar_events(pair, sampling, ahead: bool, runtimes=None, graphs=None, eos=(), context_length=None, n=30, seed=7):
    decoder = Decoder(*pair, V, make_shape("ar"), sampling, set(eos), context_length, runtimes)
    decoder.steps_ahead, decoder.step_graphs, decoder.keep_caches = ahead, graphs, True
    return decoder, list(decoder.generate(PROMPT, n, seed))


@pytest.mark.parametrize("runtime", ["transformers", "static", "static graphed"])
@pytest.mark.parametrize("sampling", [SamplingParams(1.0), SamplingParams(0.0),
                                      SamplingParams(0.8, top_k=4, top_p=0.9, min_p=0.05)], ids=str)
def test_plain_steps_queued_ahead_give_the_events_of_one_step_at_a_time(pair, sampling, runtime):
    """On a GPU `ar` queues each step's forward and draw from the token before it while that token
    is still on the device (Decoder._plain_steps_ahead): the same tokens, p and endings as one step
    at a time, bit for bit (with the maths replayed as graphs too: the drawn token is a buffer
    the next replay overwrites), whether the answer ends at its length, at the context's end or at
    an end-of-sequence token; and the step queued past the end is dropped, so the caches a chat
    keeps hold exactly the tokens they say."""
    from rsd_cli.compiled import CompiledModel
    from rsd_cli.engine import Runtimes

    runtimes = None if runtime == "transformers" else \
        Runtimes(CompiledModel(pair[0], False), CompiledModel(pair[1], False), "off")
    graphs = StepGraphs(torch.device("cpu"), True, capture=replaying_capture([])) if "graphed" in runtime else None
    endings = set()
    for eos, context_length, seed in [((), None, 7), ((), len(PROMPT) + 12, 7)] + [((0,), None, s) for s in range(4)]:
        decoder, ours = ar_events(pair, sampling, True, runtimes, graphs, eos, context_length, seed=seed)
        one_at_a_time, reference = ar_events(pair, sampling, False, runtimes, None, eos, context_length, seed=seed)
        assert [e.emitted for e in ours] == [e.emitted for e in reference]
        assert [e.finished for e in ours] == [e.finished for e in reference]
        for a, b in zip(ours, reference):
            assert torch.equal(a.p, b.p) and (a.extra_kind, a.path, a.tree.tokens) == (b.extra_kind, b.path, b.tree.tokens)
            assert a.forward_seconds > 0
        endings.add(ours[-1].finished)
        kept = decoder.kept
        assert kept.tokens == one_at_a_time.kept.tokens == (PROMPT + [t for e in ours for t in e.emitted])[:-1]
        assert kept.target.length == len(kept.tokens)
    assert endings == {"length", "context", "eos"}


def test_plain_steps_queued_ahead_queue_the_next_forward_before_reading_a_token(pair, monkeypatch):
    """What lets the host's work overlap the device's: step t+1's forward is queued before step
    t's token is read, and a consumer that stops early (a stop string) leaves caches that hold
    what they say, from which the next answer is the one a fresh decoder gives."""
    from rsd_cli import engine

    calls = []
    real_forward, real_soon = CachedLM.forward, engine.to_host_soon

    def forward(self, tokens, *args, **kwargs):
        calls.append("forward")
        return real_forward(self, tokens, *args, **kwargs)

    def soon(tensor):
        read = real_soon(tensor)
        return lambda: calls.append("read") or read()

    monkeypatch.setattr(CachedLM, "forward", forward)
    monkeypatch.setattr(engine, "to_host_soon", soon)
    decoder, events = ar_events(pair, SamplingParams(1.0), True, n=5)
    # the prompt's forward, steps 1 and 2 queued, then each read after the next step is queued
    assert calls == ["forward"] * 3 + ["read", "forward"] * 3 + ["read"] * 2
    steps = decoder.generate(PROMPT, 20, seed=1)
    first = next(steps)
    steps.close()  # step 2 was queued: it is dropped
    kept = decoder.kept
    assert kept.tokens == PROMPT and kept.target.length == len(PROMPT)
    follow_up = PROMPT + first.emitted + [2]
    greedy = Decoder(*pair, V, make_shape("ar"), SamplingParams(0.0), set())
    greedy.steps_ahead, greedy.keep_caches, greedy.kept = True, True, kept
    assert [t for e in greedy.generate(follow_up, 6, seed=0) for t in e.emitted] == greedy_of(pair[0], follow_up, 6)


def test_steps_are_queued_ahead_off_the_cpu_unless_switched_off(pair, monkeypatch):
    """By default steps are queued ahead where the target is not on the CPU: `ar` and `auto`
    (their plain steps), `sd` chains and `rsd-c` fans on static-shape caches; never with a
    repetition penalty, nor for trees deeper than root children; RSD_STEPS_AHEAD=0 switches it off."""
    from rsd_cli.compiled import StaticLM

    runtimes = static_runtimes(pair)
    cpu, cuda = SimpleNamespace(device=torch.device("cpu")), SimpleNamespace(device=torch.device("cuda"))
    decoder = Decoder(*pair, V, make_shape("ar"), SamplingParams(1.0), set())
    assert decoder._ahead_kind(cpu, None) is None and decoder._ahead_kind(cuda, None) == "plain"
    decoder.shape = make_shape("auto")
    assert decoder._ahead_kind(cuda, None) == "plain"
    decoder.sampling = SamplingParams(1.0, repetition_penalty=1.2)
    assert decoder._ahead_kind(cuda, None) is None
    for shape, kind in [(make_shape("sd", draft_len=2), "chain"), (make_shape("rsd-c", branching=(3,)), "fan"),
                        (make_shape("rsd-c", branching=(2, 2)), None), (make_shape("rsd-s", beam_width=2, depth=2), None)]:
        decoder = Decoder(*pair, V, shape, SamplingParams(1.0), set())
        target, draft = StaticLM(runtimes.target, V, 16), StaticLM(runtimes.draft, V, 16)
        decoder.steps_ahead = decoder.device_steps = True  # (as off the CPU)
        assert decoder._ahead_kind(target, draft) == kind, shape.describe()
        target.release(), draft.release()
    monkeypatch.setenv("RSD_STEPS_AHEAD", "0")
    decoder = Decoder(*pair, V, make_shape("ar"), SamplingParams(1.0), set())
    assert decoder._ahead_kind(cuda, None) is None


def static_runtimes(pair):
    from rsd_cli.compiled import CompiledModel
    from rsd_cli.engine import Runtimes

    return Runtimes(CompiledModel(pair[0], False, static_shapes=True),
                    CompiledModel(pair[1], False, static_shapes=True), "off")


def tree_events(pair, shape, sampling, ahead: bool, runtimes, graphs=None, eos=(), context_length=None, n=30,
               seed=7, prompt=PROMPT):
    decoder = Decoder(*pair, V, shape, sampling, set(eos), context_length, runtimes)
    decoder.device_steps, decoder.steps_ahead, decoder.step_graphs, decoder.keep_caches = True, ahead, graphs, True
    events = list(decoder.generate(prompt, n, seed))
    kept, decoder.kept = decoder.kept, None
    kept.release()  # (the static runtime's shared buffers, for the next decoder)
    return kept, events


AHEAD_SHAPES = [make_shape("rsd-c", branching=(k,)) for k in (1, 3, 5)] + \
    [make_shape("sd", draft_len=gamma) for gamma in (1, 2, 3)]


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_decoders_after_the_one_that_captured_shared_step_graphs_replay_them(pair, temperature):
    """A model's step graphs are shared by its decoders, one after another (a chat's turns, bench's
    runs: CompiledModel.step_graphs), and a capture holds what the maths reads by address: the
    constants a queued-ahead step's inputs are made from (columns, depths, sights: Decoder._placed)
    live as long as the graphs that read them (StepGraphs keeps each captured function), so the
    decoders made after the one that captured them replay the graphs
    with the tokens of one step at a time; `ar`, lookup chains and `auto` replay theirs too. (Kept by
    the decoder that made them, they were freed with it: on an H200 later decoders read reused memory,
    `sd` γ=1 accepted every draft at T=0 and a gather failed a device assert.)"""
    runtimes, sampling = static_runtimes(pair), SamplingParams(temperature)
    graphs = StepGraphs(torch.device("cpu"), True, capture=replaying_capture([]), capture_at=1)
    shapes = [make_shape("sd", draft_len=1), make_shape("sd", draft_len=3), make_shape("rsd-c", branching=(3,)),
              make_shape("ar"), make_shape("lookup", draft_len=3)] + [make_shape("auto")] * (temperature == 0)
    for seed, shape in enumerate(shapes * 2):
        _, ours = tree_events(pair, shape, sampling, True, runtimes, graphs, seed=seed)
        gc.collect()  # (the decoder gone, and whatever it alone held)
        if shape.variant == "auto":  # (its shapes chosen a step late queued ahead: greedy, the target's tokens)
            _, reference = tree_events(pair, make_shape("ar"), sampling, False, runtimes, None, seed=seed)
            assert [t for e in ours for t in e.emitted] == [t for e in reference for t in e.emitted]
            continue
        _, reference = tree_events(pair, shape, sampling, False, runtimes, None, seed=seed)
        assert [e.emitted for e in ours] == [e.emitted for e in reference], shape.describe()
    assert graphs._graphs  # (they were captured, and replayed by the decoders after)


@pytest.mark.parametrize("graphed", [False, True], ids=["direct", "graphed"])
@pytest.mark.parametrize("sampling", [SamplingParams(1.0), SamplingParams(0.0),
                                      SamplingParams(0.8, top_k=4, top_p=0.9, min_p=0.05)], ids=str)
def test_trees_queued_ahead_give_the_events_of_one_step_at_a_time(pair, sampling, graphed, monkeypatch):
    """On a GPU `sd` chains and `rsd-c` fans of root children queue each step before the outcome of
    the one before is read (Decoder._tree_steps_ahead): the next root, its position, what the draft
    reads and a fan's accepted child's move in the cache are worked out on the device, and so are
    the forwards' inputs. Against one step at a time: the same tokens, trees, decisions and
    endings (at the length, the context's end, an end-of-sequence token), p and q equal up to the
    draft's rounding (it reads one token in a forward of two rows), every q a fresh draft forward
    of its context, and kept caches that hold what they say; with the maths replayed as graphs too."""
    from rsd_cli.compiled import StaticLM

    placed = []
    real = StaticLM.forward_placed
    monkeypatch.setattr(StaticLM, "forward_placed", lambda self, *a: placed.append(1) or real(self, *a))
    runtimes = static_runtimes(pair)
    endings = set()
    for shape in AHEAD_SHAPES:
        draft_sampling = Decoder(*pair, V, shape, sampling, set()).draft_sampling
        forwards = shape.depth + 1  # a step's: the draft's of what it missed, its levels', the target's
        for eos, context_length, seed in [((), None, 7), ((), len(PROMPT) + 12, 7)] + [((0,), None, s) for s in range(3)]:
            graphs = StepGraphs(torch.device("cpu"), True, capture=replaying_capture([])) if graphed else None
            placed.clear()
            kept, ours = tree_events(pair, shape, sampling, True, runtimes, graphs, eos, context_length, seed=seed)
            assert len(placed) - forwards * len(ours) in (0, forwards)  # (and one step dropped at the end)
            reference_kept, reference = tree_events(pair, shape, sampling, False, runtimes, None, eos, context_length,
                                                   seed=seed)
            endings.add(ours[-1].finished)
            # one step at a time, a step drafts no deeper than what fits before the context's end (_next_shape);
            # a queued step's shape is set before the outcome of the one before is read: the same up to there
            cut = next((i for i, e in enumerate(reference) if e.shape != shape), len(reference))
            whole = cut == len(reference)
            if not whole:
                assert context_length is not None and ours[-1].finished == reference[-1].finished == "context"
                assert sum(len(e.emitted) for e in ours) == sum(len(e.emitted) for e in reference)
                assert all(e.shape.depth < shape.depth for e in reference[cut:])
                ours, reference = ours[:cut], reference[:cut]
            assert [e.emitted for e in ours] == [e.emitted for e in reference], shape.describe()
            assert [e.finished for e in ours] == [e.finished for e in reference]
            seq = list(PROMPT)
            for a, b in zip(ours, reference):
                assert (a.path, a.extra_kind, a.tree.tokens) == (b.path, b.extra_kind, b.tree.tokens)
                assert [c.decision for c in a.checks] == [c.decision for c in b.checks]
                assert torch.allclose(a.p, b.p, atol=1e-6)
                for node, q in a.tree.q.items():
                    assert torch.allclose(q, b.tree.q[node], atol=1e-6)
                    path = [a.tree.tokens[n] for n in a.tree.path_to(node)]
                    fresh = logits_to_probs(full_logits(pair[1], seq[:-1] + path)[-1], draft_sampling)
                    assert torch.allclose(q, fresh, atol=1e-5)
                assert a.forward_seconds > a.draft_forward_seconds > 0 and a.draft_calls == b.draft_calls
                seq.extend(a.emitted)
            assert kept.target.length == len(kept.tokens)
            if whole:
                assert kept.tokens == reference_kept.tokens and kept.draft.length == reference_kept.draft.length
    assert endings == {"length", "context", "eos"}


@pytest.mark.parametrize("shape", [make_shape("rsd-c", branching=(3,)), make_shape("sd", draft_len=2)],
                         ids=lambda s: s.describe())
def test_trees_queued_ahead_queue_the_next_step_before_reading_one_and_grow_their_caches(pair, monkeypatch, shape):
    """Step t+1's forwards are queued before step t's outcome is read; a long answer outgrows the
    caches made for it (they grow, the host setting their lengths first); a consumer that stops
    early leaves caches that hold what they say, from which the next answer is the one a fresh
    decoder gives."""
    from rsd_cli import engine
    from rsd_cli.compiled import StaticLM

    calls = []
    real_forward, real_soon, real_grow = StaticLM.forward_placed, engine.to_host_soon, StaticLM._grow

    def soon(tensor):
        read = real_soon(tensor)
        return lambda: calls.append("read") or read()

    monkeypatch.setattr(StaticLM, "forward_placed", lambda self, *a: calls.append("forward") or real_forward(self, *a))
    monkeypatch.setattr(engine, "to_host_soon", soon)
    monkeypatch.setattr(StaticLM, "_grow", lambda self, needed: calls.append("grow") or real_grow(self, needed))
    runtimes, sampling = static_runtimes(pair), SamplingParams(1.0)
    _, events = tree_events(pair, shape, sampling, True, runtimes, n=6)
    steps, forwards = len(events), shape.depth + 1  # a step's: the draft's of what it missed, its levels', the target's
    assert calls[: 2 * forwards + 2] == ["forward"] * 2 * forwards + ["read", "forward"]
    assert calls.count("read") == steps and calls.count("forward") - forwards * steps in (0, forwards)  # (+ one dropped)
    answers = {}
    for ahead in (True, False):  # a short answer's caches (room for 4 tokens), kept for a long one
        decoder = Decoder(*pair, V, shape, sampling, set(), runtimes=runtimes)
        decoder.device_steps, decoder.steps_ahead, decoder.keep_caches = True, ahead, True
        short = [t for e in decoder.generate(PROMPT, 4, seed=0) for t in e.emitted]
        calls.clear()
        answers[ahead] = [e.emitted for e in decoder.generate(PROMPT + short + [1], 120, seed=1)]
        assert calls.count("grow") >= 2 * ahead  # (the target's and the draft's)
        kept, decoder.kept = decoder.kept, None
        assert kept.target.length == len(kept.tokens)
        kept.release()
    assert answers[True] == answers[False]
    decoder = Decoder(*pair, V, shape, SamplingParams(0.0), set(), runtimes=runtimes)
    decoder.device_steps, decoder.steps_ahead, decoder.keep_caches = True, True, True
    steps = decoder.generate(PROMPT, 20, seed=1)
    first = next(steps)
    steps.close()  # step 2 was queued: it is dropped
    kept = decoder.kept
    assert kept.tokens == PROMPT + first.emitted[:-1] and kept.target.length == len(kept.tokens)
    assert kept.draft.length == len(PROMPT) + min(len(first.path), shape.depth - 1)
    follow_up = PROMPT + first.emitted + [2]
    decoder.kept = kept
    assert [t for e in decoder.generate(follow_up, 8, seed=0) for t in e.emitted] == greedy_of(pair[0], follow_up, 8)


@pytest.mark.parametrize("static_shapes", [True, False], ids=["static", "dynamic"])
def test_answers_reach_the_end_of_the_models_context_on_the_compiled_runtime(pair, static_shapes):
    """At the end of the models' context a tree queued ahead (its shape set before the outcome of the
    step before is read) has rows past the last position the rotary tables hold (it was an IndexError,
    a device assert on a GPU): they read its angle (their tokens are never emitted), and the answer ends
    at the context, queued ahead as one step at a time — which drafts no deeper than what fits
    (_next_shape), and gives the same steps up to there."""
    from rsd_cli.compiled import CompiledModel
    from rsd_cli.engine import Runtimes

    runtimes = Runtimes(CompiledModel(pair[0], False, static_shapes=static_shapes),
                        CompiledModel(pair[1], False, static_shapes=static_shapes), "off")
    context = pair[0].config.max_position_embeddings
    for left in (3, 4, 6):
        prompt = [1 + i % 5 for i in range(context - left)]
        for shape in (make_shape("ar"), make_shape("sd", draft_len=3), make_shape("rsd-c", branching=(3,)),
                      make_shape("rsd-c", branching=(2, 2))):
            for seed in range(3):
                answers = []
                for ahead in (True, False):
                    decoder = Decoder(*pair, V, shape, SamplingParams(1.0), set(), context, runtimes)
                    decoder.device_steps, decoder.steps_ahead = True, ahead
                    events = list(decoder.generate(prompt, 50, seed=seed))
                    assert events[-1].finished == "context" and sum(len(e.emitted) for e in events) == left
                    answers.append([e.emitted for e in events])
                fits = left
                for event in events:  # (one step at a time)
                    assert event.shape.depth < fits
                    fits -= len(event.emitted)
                cut = next((i for i, e in enumerate(events) if e.shape != shape), len(events))
                assert answers[0][:cut] == answers[1][:cut], shape.describe()


@pytest.mark.parametrize("kind", ["gpt2", "opt", "gpt_neo"])
def test_learned_positions_past_the_context_s_end_on_transformers_forward(kind):
    """On transformers' forward (`--compile off`, or a model the runtime does not take) a tree's rows past
    the context's end read its last position, as on the runtime: a model with a table of learned
    positions (GPT-2, OPT) indexed it past its end (an IndexError; a device assert on a GPU). And near
    the end a step drafts no deeper than the tokens that still fit (GPT-Neo's attention, which then took
    no more keys than its context, failed on them: a RuntimeError, "The size of tensor a (256) must match
    the size of tensor b (257)"). Greedy, the answer is the target's own up to the context's end, for chains, trees, lookup
    chains and `auto` (GPT-Neo takes chains only there)."""
    from tiny import tiny_relative

    target, draft = tiny_relative(kind, vocab=40, seed=0), tiny_relative(kind, vocab=40, seed=1)
    context = target.config.max_position_embeddings
    prompt = [1 + i % 5 for i in range(context - 3)]
    expected = plain_greedy(target, 3, prompt)
    for shape in (make_shape("sd", draft_len=4), make_shape("rsd-c", branching=(2, 2)), make_shape("lookup"),
                  make_shape("auto")):
        decoder = Decoder(target, draft, 40, shape, SamplingParams(0.0), set(), context)
        if not decoder.takes(shape.variant):
            continue
        events, left = [], len(expected)
        for event in decoder.generate(prompt, 9, 0):
            assert event.shape.depth < left, shape.describe()  # (what it can emit: depth + 1 tokens at most)
            events.append(event)
            left -= len(event.emitted)
        assert events[-1].finished == "context" and [t for e in events for t in e.emitted] == expected, shape.describe()


@pytest.mark.parametrize("kind", ["gpt2", "opt", "gpt_neo"])
def test_a_draft_s_learned_positions_past_its_shorter_context_on_transformers_forward(kind):
    """A draft whose table of learned positions is shorter than the target's context reads its last
    position past its end on transformers' forward, as on the runtime (an IndexError before 7b3b22b):
    its q is poorer there, the answer the target's (greedy: its own tokens). GPT-Neo's attention hides
    keys by tables of slots as large as its context, which grow past it (slot_tables_cover; "The size
    of tensor a (16) must match the size of tensor b (24)" before)."""
    from tiny import tiny_relative

    made = tiny_relative(kind, vocab=40, seed=1)
    made.config.max_position_embeddings = 16  # (GPT-2's n_positions: the same attribute)
    torch.manual_seed(1)
    draft = type(made)(made.config).eval()
    target = tiny_model(40, layers=2, seed=0, scale=0.3)
    prompt = [1 + i % 5 for i in range(24)]  # (past the draft's 16 positions from the start)
    decoder = Decoder(target, draft, 40, make_shape("sd", draft_len=3), SamplingParams(0.0), set(), 256)
    assert [t for e in decoder.generate(prompt, 12, 0) for t in e.emitted] == plain_greedy(target, 12, prompt)


def test_gpt_neo_s_grown_tables_of_slots_are_those_a_longer_context_makes():
    """slot_tables_cover grows GPT-Neo's causal and local tables (one of each kind for all its layers)
    to what its attention makes for a context that long."""
    from rsd_cli.engine import slot_tables_cover
    from tiny import tiny_relative

    made = tiny_relative("gpt_neo", vocab=40, seed=1)
    short_config, long_config = copy.deepcopy(made.config), copy.deepcopy(made.config)
    short_config.max_position_embeddings, long_config.max_position_embeddings = 16, 40
    short, longer = type(made)(short_config).eval(), type(made)(long_config).eval()
    slot_tables_cover(short, 40)
    pairs = [(a, b) for a, b in zip(short.modules(), longer.modules())
             if hasattr(a, "attention_type") and isinstance(getattr(a, "bias", None), torch.Tensor)]
    assert {a.attention_type for a, _ in pairs} == {"global", "local"}
    for grown, made_so in pairs:
        assert torch.equal(grown.bias, made_so.bias), grown.attention_type
    assert len({id(a.bias) for a, _ in pairs}) == 2  # (one table of each kind)


@pytest.mark.parametrize("shape", [FAN, make_shape("sd", draft_len=1)], ids=lambda s: s.describe())
def test_trees_queued_ahead_follow_the_target_distribution(pair, shape):
    """The first two tokens of chains and fans queued ahead (each step's inputs worked out on the
    device from the last one's outcome) follow the target's joint distribution."""
    sampling, runtimes = SamplingParams(temperature=1.0), static_runtimes(pair)
    counts = torch.zeros(V, V)
    for seed in range(N_SAMPLES):
        _, events = tree_events(pair, shape, sampling, True, runtimes, n=2, seed=seed)
        first, second = [t for e in events for t in e.emitted][:2]
        counts[first, second] += 1
    assert chi_square_pvalue(counts, exact_joint(pair[0], sampling) * N_SAMPLES) > 1e-3


def test_step_maths_are_graphed_on_a_gpu_with_compiled_forwards_only(pair):
    decoder = Decoder(*pair, V, FAN, SamplingParams(1.0), set())
    compiled = SimpleNamespace(compiled=True)
    assert not decoder._maths(SimpleNamespace(device=torch.device("cpu"), compiled=compiled)).enabled
    decoder.step_graphs = None
    assert decoder._maths(SimpleNamespace(device=torch.device("cuda"), compiled=compiled)).enabled
    decoder.step_graphs = None  # --compile off: every kernel launched as it is
    uncompiled = SimpleNamespace(compiled=False)
    assert not decoder._maths(SimpleNamespace(device=torch.device("cuda"), compiled=uncompiled)).enabled
    decoder.step_graphs = None  # transformers' forward (CachedLM)
    assert not decoder._maths(SimpleNamespace(device=torch.device("cuda"))).enabled


def test_decoders_on_a_model_s_shared_buffers_share_its_step_maths_graphs(pair):
    """Generations on a model's shared static buffers (CUDA graphs) run one at a time, and so do their
    maths' graphs: a chat's turns and bench's runs, a decoder each, capture them once, not once
    per decoder. A generation on buffers of its own (beside one holding the shared) keeps its own."""
    from rsd_cli.compiled import CompiledModel

    compiled = CompiledModel(pair[0], False, static_shapes=True)
    compiled.compiled = True  # (as a model compiled on a GPU)
    holder = SimpleNamespace(device=torch.device("cuda"), compiled=compiled, static=True)
    beside = SimpleNamespace(device=torch.device("cuda"), compiled=compiled, static=False)
    first, second, third = (Decoder(*pair, V, FAN, SamplingParams(1.0), set()) for _ in range(3))
    assert first._maths(holder) is second._maths(holder) is compiled.step_graphs(None)
    assert first._maths(holder).enabled
    assert third._maths(beside) is not first._maths(holder) and third._maths(beside).enabled


def test_a_site_runs_directly_until_its_capture_then_replays_it():
    """A capture costs milliseconds, a replay saves a fraction of one: a site and shapes runs directly
    on its first CAPTURE_AT - 1 calls (a shape `auto` tries once or twice pays for no capture), then
    is captured once and replayed; every call gives what the function gives."""
    from rsd_cli.step_graphs import CAPTURE_AT

    captured = []
    graphs = StepGraphs(torch.device("cpu"), True, capture=replaying_capture(captured))
    for k in range(CAPTURE_AT + 3):
        (doubled,) = graphs("double", lambda x: (2 * x,), torch.tensor([float(k)]))
        assert doubled.item() == 2.0 * k and len(captured) == int(k + 1 >= CAPTURE_AT)
    (doubled,) = graphs("double", lambda x: (2 * x,), torch.tensor([1.0, 2.0]))  # (other shapes: direct at first)
    assert doubled.tolist() == [2.0, 4.0] and len(captured) == 1


def test_step_maths_that_cannot_be_captured_run_directly_with_a_notice(pair):
    notices = []

    def failing(run):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    graphs = StepGraphs(torch.device("cpu"), True, notice=notices.append, capture=failing)
    sampling = SamplingParams(1.0)
    plain, fallen_back = device_events(pair, FAN, sampling, 4), device_events(pair, FAN, sampling, 4, graphs)
    assert [e.emitted for e in fallen_back] == [e.emitted for e in plain]
    assert notices == ["capturing a CUDA graph of the step's maths failed (RuntimeError: operation not permitted "
                       "when stream is capturing): it runs without graphs"]
    assert not graphs.enabled


def test_top_k_top_p_sampling_is_exact_too(pair):
    sampling = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
    expected = exact_joint(pair[0], sampling) * N_SAMPLES
    counts = sample_pairs(pair, make_shape("rsd-c", branching=(3, 2)), sampling, N_SAMPLES)
    assert counts[expected == 0].sum() == 0  # never a token the target would not produce
    assert chi_square_pvalue(counts, expected) > 1e-3


def test_the_monte_carlo_test_detects_a_biased_verifier(monkeypatch):
    """Negative control: on a pair where the correct rule passes, RSD-C trees verified without
    renormalising q fail the same test."""
    pair = (tiny_model(V, layers=2, seed=0, scale=0.1), tiny_model(V, layers=1, seed=1, scale=0.15))
    sampling = SamplingParams(temperature=1.0)
    expected = exact_joint(pair[0], sampling) * N_SAMPLES
    shape = make_shape("rsd-c", branching=(3, 2))
    assert chi_square_pvalue(sample_pairs(pair, shape, sampling, N_SAMPLES), expected) > 1e-3
    monkeypatch.setattr(Shape, "rule", property(lambda self: Rule.BIASED))
    assert chi_square_pvalue(sample_pairs(pair, shape, sampling, N_SAMPLES), expected) < 1e-6


REPEATING = [1, 3, 4, 2, 5, 1, 3, 4]  # its end, 1 3 4, occurred before: lookup drafts 2 5 1 ...


def test_lookup_drafts_what_followed_the_latest_occurrence_of_the_longest_ngram():
    from rsd_cli.drafting import NgramIndex

    index = NgramIndex(3)
    assert index.continuation([7], 4) == []
    assert index.continuation(REPEATING, 2) == [2, 5]
    assert index.continuation(REPEATING + [0], 4) == []  # 0 never occurred before
    seq = REPEATING + [0, 4, 9, 3, 4]  # 3 4 occurred twice before: the latest occurrence wins
    assert index.continuation(seq, 3) == [0, 4, 9]
    assert NgramIndex(3).continuation([5, 5, 5], 4) == [5]  # an occurrence overlapping the end drafts up to it
    longest = [1, 2, 7, 2, 8, 1, 2]  # "1 2" was followed by 7, the latest "2" by 8: the longer match wins
    assert NgramIndex(3).continuation(longest, 1) == [7] and NgramIndex(1).continuation(longest, 1) == [8]
    grown = NgramIndex(3)  # grown step by step, the index answers as one built at once
    for end in range(1, len(seq) + 1):
        assert grown.continuation(seq[:end], 3) == NgramIndex(3).continuation(seq[:end], 3)


def test_the_ngram_index_finds_what_a_search_of_the_whole_sequence_finds():
    from rsd_cli.drafting import NgramIndex

    def search(seq, longest, count):  # the definition, scanning back from the end
        for n in range(min(longest, len(seq)), 0, -1):
            for start in range(len(seq) - n - 1, -1, -1):
                if seq[start:start + n] == seq[-n:]:
                    return n, seq[start + n: start + n + count]
        return 0, []

    generator = torch.Generator().manual_seed(0)
    for trial in range(100):
        seq = torch.randint(0, 5, (int(torch.randint(1, 50, (), generator=generator)),), generator=generator).tolist()
        index = NgramIndex(3)
        for end in range(1, len(seq) + 1):  # step by step, as a generation grows it
            assert index.match(seq[:end], 4) == search(seq[:end], 3, 4)
        index, end = NgramIndex(3), 0
        while end < len(seq):  # by one to four tokens a step, as drafting steps grow it
            end = min(len(seq), end + int(torch.randint(1, 5, (), generator=generator)))
            assert index.match(seq[:end], 4) == search(seq[:end], 3, 4)


@pytest.mark.parametrize("device_steps", [None, True], ids=["host", "device"])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_lookup_drafts_from_the_context_and_stays_exact(pair, temperature, device_steps):
    """Greedy: plain greedy. Sampling: the first two tokens' joint distribution is the target's,
    on a prompt whose end repeats, so the first step drafts (one-hot q) at depths 1 and 2 — on the
    host path (the CPU's) and decided on the device (a GPU's, forced here: Decoder._lookup_step)."""
    shape = make_shape("lookup", draft_len=2)
    sampling = SamplingParams(temperature=temperature)
    target, draft = pair
    decoder = Decoder(target, draft, V, shape, sampling, set())
    decoder.device_steps = device_steps
    events = list(decoder.generate(REPEATING, 12, seed=1))
    assert events[0].tree.tokens == [4, 2, 5] and events[0].draft_calls == 0
    assert all(float(q.max()) == 1.0 == float(q.sum()) for e in events for q in e.tree.q.values())
    if temperature == 0:
        assert run(pair, shape, sampling, 25, seed=0, prompt=REPEATING, device_steps=device_steps) == \
            plain_greedy(target, 25, REPEATING)
        return
    counts = sample_pairs(pair, shape, sampling, N_SAMPLES, REPEATING, device_steps=device_steps)
    expected = exact_joint(target, sampling, REPEATING) * N_SAMPLES
    assert chi_square_pvalue(counts, expected) > 1e-3
    reached = [run(pair, shape, sampling, PAIR_DRAW, seed, prompt=REPEATING, device_steps=device_steps)
               for seed in range(200)]
    assert any(r[:2] == [2, 5] for r in reached) and any(r[0] != 2 for r in reached)  # accepted and rejected


@pytest.mark.parametrize("device_steps", [None, True], ids=["host", "device"])
def test_the_monte_carlo_test_detects_a_lookup_draft_that_lies_about_its_q(pair, monkeypatch, device_steps):
    """Negative control: verifying the looked-up chain as if it had been drawn from a uniform q
    (it was drafted with certainty) biases the output, and the same test sees it, on either path."""
    from rsd_cli import drafting, engine

    real_tree, real_verdict = drafting.lookup_tree, engine.lookup_verdict

    def uniform_q(*args):
        tree = real_tree(*args)
        for node in tree.q:
            tree.q[node] = torch.full_like(tree.q[node], 1 / V)
        return tree

    def uniform_verdict(sampling, logits, tokens, count, u):  # (the same maths with a uniform q)
        m = tokens.shape[0] - 1
        p = logits_to_probs(logits, sampling)
        rows = torch.cat([p[:m], p.index_select(0, count)])
        accepted, corrections, bonus = chain_outcome(rows, torch.full((m, V), 1 / V), tokens[1:], u[:m], u[m:, None])
        return p, torch.full((m, V), 1 / V), torch.cat([tokens[1:], accepted.long(), corrections, bonus])

    assert real_verdict(SamplingParams(1.0), torch.zeros(3, V), torch.tensor([4, 2, 5]), torch.tensor([2]),
                        torch.rand(5, dtype=torch.float64))[1].sum(-1).tolist() == [1.0, 1.0]
    monkeypatch.setattr(engine, "lookup_tree", uniform_q)
    monkeypatch.setattr(engine, "lookup_verdict", uniform_verdict)
    sampling = SamplingParams(temperature=1.0)
    counts = sample_pairs(pair, make_shape("lookup", draft_len=2), sampling, N_SAMPLES, REPEATING,
                          device_steps=device_steps)
    expected = exact_joint(pair[0], sampling, REPEATING) * N_SAMPLES
    assert chi_square_pvalue(counts, expected) < 1e-6


def test_a_lookup_chain_filled_past_its_tokens_draws_its_bonus_after_the_last_of_them():
    """lookup_verdict with m = 3 rows of tokens of which n = 2 were looked up (the third only fills a
    forward's bucket: Decoder._filled): certain drafts are accepted, and the bonus comes from the row
    after the second token, not the one after the filler (each row certain of another token here)."""
    from rsd_cli.engine import lookup_verdict

    sure = torch.full((4, V), -1e4)
    for row, token in enumerate([2, 5, 0, 4]):  # after the root: 2; after 2: 5; after 5: 0; after the filler: 4
        sure[row, token] = 0.0
    tokens, u = torch.tensor([3, 2, 5, 5]), torch.rand(7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    p, q, packed = lookup_verdict(SamplingParams(1.0), sure, tokens, torch.tensor([2]), u)
    m = 3
    drafted, accepted, bonus = packed[:2].tolist(), packed[m: m + 2].tolist(), packed[3 * m:].tolist()
    assert (drafted, accepted, bonus) == ([2, 5], [1, 1], [0])
    assert q.shape == (3, V) and q[:2].argmax(-1).tolist() == [2, 5] and torch.equal(p, torch.softmax(sure, -1))
    sure[1] = sure[2]  # (after 2, 0 is certain: the draft 5 is rejected, its correction 0)
    packed = lookup_verdict(SamplingParams(1.0), sure, tokens, torch.tensor([2]), u)[2]
    assert packed[m: m + 2].tolist() == [1, 0] and packed[2 * m + 1].item() == 0


def test_lookup_chains_decided_on_the_device_read_the_host_once_a_step_without_a_draft_model(pair, monkeypatch):
    """Off the CPU a lookup chain is decided on the device (Decoder._lookup_step): one transfer a step
    that drafted (its tokens, decisions, corrections and bonus: 3n + 1 numbers), a plain step where
    nothing matched, no draft model needed; graphed (a CPU stand-in with a CUDA graph's semantics),
    the same tokens, p, q and decisions as the maths run directly."""
    from rsd_cli import engine

    transfers = []

    def counted(tensor):
        transfers.append(tensor.numel())
        return tensor.tolist()

    monkeypatch.setattr(engine, "to_host", counted)
    shape, sampling, prompt = make_shape("lookup", draft_len=3), SamplingParams(1.0), PROMPT  # (4 first occurs at the end)
    decoder = Decoder(pair[0], None, V, shape, sampling, set())
    assert decoder._on_device(shape, None, torch.device("cuda")) == "lookup"
    assert decoder._on_device(shape, None, torch.device("cpu")) is None  # (the host path, by default)
    decoder.device_steps = True
    events = list(decoder.generate(prompt, 30, seed=4))
    drafted = [e for e in events if len(e.tree) > 1]
    assert drafted and len(events[0].tree) == 1  # (steps with and without a match)
    assert transfers == [3 * (len(e.tree) - 1) + 1 for e in drafted]
    assert all(e.draft_calls == 0 and e.tree.draws[0] for e in drafted)
    assert {e.extra_kind for e in drafted} == {"bonus", "correction"}
    captured = []
    decoder.step_graphs = StepGraphs(torch.device("cpu"), True, capture=replaying_capture(captured))
    replayed = list(decoder.generate(prompt, 30, seed=4))
    assert [e.emitted for e in replayed] == [e.emitted for e in events]
    for a, b in zip(events, replayed):
        assert torch.equal(a.p, b.p) and [c.decision for c in a.checks] == [c.decision for c in b.checks]
        assert all(torch.equal(a.tree.q[n], b.tree.q[n]) for n in a.tree.q)
    assert captured and decoder.step_graphs.enabled


def test_same_seed_same_output(pair):
    shape = make_shape("rsd-s", beam_width=2, depth=3)
    sampling = SamplingParams(temperature=1.0)
    assert run(pair, shape, sampling, 20, seed=11) == run(pair, shape, sampling, 20, seed=11)


def test_stops_at_eos_and_max_tokens(pair):
    sampling = SamplingParams(temperature=1.0)
    for seed in range(10):
        out = run(pair, make_shape("sd", draft_len=4), sampling, 9, seed, eos={0})
        assert len(out) <= 9
        assert 0 not in out[:-1]
        assert out[-1] == 0 or len(out) == 9


def test_events_carry_the_tree_and_stats_add_up(pair):
    target, draft = pair
    decoder = Decoder(target, draft, V, make_shape("rsd-c", branching=(2, 2)), SamplingParams(1.0), set())
    stats = Stats()
    events = list(decoder.generate(PROMPT, 30, seed=3))
    for event in events:
        stats.add(event)
        assert len(event.tree) <= 7 and event.p.shape == (len(event.tree), V)
        assert event.emitted[: event.accepted] == [event.tree.tokens[n] for n in event.path][: len(event.emitted)]
        for node in event.path:
            assert event.status(node) == "accepted"
        assert event.draft_calls == 2  # root level + depth-1 level; leaves need no draft forward
    assert stats.new_tokens == 30
    assert 1 <= stats.block_efficiency <= 3
    assert sum(stats.tried_at_depth[:1]) == len(events)


def test_every_forward_second_is_reported_prompt_included(pair, monkeypatch):
    """overhead = wall - forward: a forward left out (the prompt's) would count as overhead."""
    measured = []
    real_forward = CachedLM.forward

    def timed(self, *args, **kwargs):
        before = self.forward_seconds
        out = real_forward(self, *args, **kwargs)
        measured.append((self.model is draft, self.forward_seconds - before))
        return out

    monkeypatch.setattr(CachedLM, "forward", timed)
    target, draft = pair
    decoder = Decoder(target, draft, V, make_shape("rsd-c", branching=(2,)), SamplingParams(1.0), set())
    events = list(decoder.generate(PROMPT, 10, seed=3))
    assert len(measured) > 2 * len(events)  # the prompt, then draft + target forwards per step
    assert sum(e.forward_seconds for e in events) == pytest.approx(sum(t for _, t in measured), rel=1e-9)
    # the draft's part apart (auto times the machine's pace by each model's forwards)
    drafts = sum(t for by_draft, t in measured if by_draft)
    assert 0 < sum(e.draft_forward_seconds for e in events) == pytest.approx(drafts, rel=1e-9)


def test_a_chain_deeper_than_the_answer_is_queued_ahead_as_its_cut_shape(pair, monkeypatch):
    """The cut to max_tokens - 1 levels is made before the answer's first step, so steps queued ahead
    (a GPU's, forced here) draft the cut chain — a 300-level chain fits no forward bucket and ran one
    step at a time before — and give the tokens one step at a time gives."""
    from rsd_cli.compiled import CompiledModel
    from rsd_cli.engine import Runtimes

    runtimes = Runtimes(CompiledModel(pair[0], False, static_shapes=True),
                        CompiledModel(pair[1], False, static_shapes=True), "off")
    queued = []
    ahead_of = Decoder._tree_steps_ahead
    monkeypatch.setattr(Decoder, "_tree_steps_ahead", lambda self, *args, **kw: queued.append(self.shape) or
                        ahead_of(self, *args, **kw))
    deep, cut = make_shape("sd", draft_len=300), make_shape("sd", draft_len=4)
    for seed in range(3):
        answers = []
        for shape, ahead in ((deep, True), (cut, False)):
            decoder = Decoder(*pair, V, shape, SamplingParams(1.0), set(), 256, runtimes)
            decoder.device_steps, decoder.steps_ahead = True, ahead
            answers.append([t for e in decoder.generate(PROMPT, 5, seed=seed) for t in e.emitted])
        assert answers[0] == answers[1] and len(answers[0]) == 5
    assert queued == [cut] * 3


def test_long_branching_vectors_read_as_runs():
    from rsd_cli.drafting import factors_text

    assert factors_text((2, 2, 1)) == "2,2,1"
    assert factors_text((3,) + (1,) * 7) == "3,1,1,1,1,1,1,1"  # (up to 8 levels, as --branching takes them)
    assert factors_text((3,) + (1,) * 332) == "3,1×332"
    assert factors_text((3, 3, 2, 2) + (1,) * 6) == "3,3,2,2,1×6"
    assert shape_for_budget("mss", 100).describe() == "mss b=(3,1×32)"


def test_a_budget_of_the_root_alone_reads_as_depth_0():
    """`--budget 1` (`rsd bench --budgets 1`) drafts nothing: its rows read `mss b=()` and `rsd-s W=3 L=0`,
    a width no step drafts; each tree variant now reads L=0 (sd and lookup γ=0)."""
    assert [shape_for_budget(v, 1).describe() for v in ("sd", "lookup", "mss", "rsd-c", "rsd-s", "spectr")] == \
        ["sd γ=0", "lookup γ=0", "mss L=0", "rsd-c L=0", "rsd-s L=0", "spectr L=0"]
    assert shape_for_budget("rsd-s", 2).describe() == "rsd-s W=1 L=1"


def test_budget_shapes_fit_the_budget():
    for variant in VARIANTS:
        for budget in (1, 2, 6, 10, 14, 21, 30):
            assert shape_for_budget(variant, budget).max_nodes <= budget
    with pytest.raises(ValueError):
        shape_for_budget("rsd-c", 0)


@pytest.mark.parametrize("deep, cut", [(make_shape("sd", draft_len=300), make_shape("sd", draft_len=4)),
                                       (shape_for_budget("rsd-c", 1000), make_shape("rsd-c", branching=(3, 1, 1, 1))),
                                       (make_shape("rsd-s", beam_width=2, depth=500), make_shape("rsd-s", beam_width=2, depth=4))],
                         ids=["sd", "rsd-c", "rsd-s"])
def test_a_tree_deeper_than_the_answer_drafts_no_level_the_answer_cannot_reach(pair, deep, cut):
    """A step emits at most its depth + 1 tokens: `--draft-len 5000 -n 5` drafted 5000 levels at
    every step (4 minutes for five tokens on the embedded pair). The shape is cut to max_tokens - 1
    levels for the whole answer, so the tokens of a seed are those of the cut shape's; shallower
    shapes are left as they are, and a drafting variant keeps one level at least."""
    target, draft = pair

    def shapes_and_tokens(shape, max_tokens, seed=11):
        events = list(Decoder(target, draft, V, shape, SamplingParams(1.0), set()).generate(PROMPT, max_tokens, seed=seed))
        return [e.shape for e in events], [t for e in events for t in e.emitted]

    shapes_deep, tokens_deep = shapes_and_tokens(deep, 5)
    assert set(shapes_deep) == {cut}
    assert tokens_deep == shapes_and_tokens(cut, 5)[1] and len(tokens_deep) == 5
    assert set(shapes_and_tokens(cut, 12)[0]) == {cut}  # (deep enough already: unchanged)
    shapes_one, _ = shapes_and_tokens(deep, 1)
    assert {s.depth for s in shapes_one} == {1} and shapes_one[0].variant == deep.variant


@pytest.mark.parametrize("shape", shapes()[1:] + [FAN], ids=lambda s: s.describe())
def test_draft_distributions_equal_fresh_draft_forwards_in_every_step(pair, shape):
    """Verification is exact for any q, so a wrong draft mask or a badly pruned draft cache would
    only cost acceptance, silently: check every node's q against a fresh forward of its path."""
    target, draft = pair
    decoder = Decoder(target, draft, V, shape, SamplingParams(1.0), set())
    seq = list(PROMPT)
    for event in decoder.generate(PROMPT, 20, seed=5):
        for node, q in event.tree.q.items():
            path = [event.tree.tokens[n] for n in event.tree.path_to(node)]
            fresh = logits_to_probs(full_logits(draft, seq[:-1] + path)[-1], SamplingParams(1.0))
            assert torch.allclose(q, fresh, atol=1e-5), (event.step, node)
        seq.extend(event.emitted)


def test_complete_keeps_only_the_last_event_unless_asked(pair):
    from rsd_cli.generation import complete

    target, draft = pair
    decoder = Decoder(target, draft, V, make_shape("rsd-c", branching=(2, 2)), SamplingParams(1.0), set())
    tokens, stats, events = complete(decoder, [1, 2], 10, seed=3)
    assert len(events) == 1 and stats.steps > 1 and events[0].step == stats.steps
    tokens_all, stats_all, all_events = complete(decoder, [1, 2], 10, seed=3, keep_events=True)
    assert tokens_all == tokens and [e.step for e in all_events] == list(range(1, stats.steps + 1))


def exact_joint_with_context(target, sampling) -> torch.Tensor:
    """exact_joint for processing that depends on the context (the repetition penalty): the first
    token's distribution sees the prompt, the second's the prompt and the first token."""
    def probs(tokens):
        seen = torch.zeros(V, dtype=torch.bool)
        seen[tokens] = True
        return logits_to_probs(full_logits(target, tokens)[-1], sampling, seen).double()

    first = probs(PROMPT)
    return torch.stack([first[x] * probs(PROMPT + [x]) for x in range(V)])


PENALISED = SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=3.0)
COUNTED = SamplingParams(temperature=1.0, presence_penalty=0.8, frequency_penalty=0.5)  # (the answer's counts)


@pytest.mark.parametrize("shape", [make_shape("rsd-c", branching=(2, 2)), make_shape("sd", draft_len=2),
                                   make_shape("spectr", num_drafts=2, depth=2)], ids=lambda s: s.describe())
def test_min_p_and_the_repetition_penalty_are_exact_on_trees(pair, shape):
    """The second token's distribution depends on the first (penalised once seen), so every tree
    node's p must be processed with the tokens on its own path: a depth-2 tree tests exactly that."""
    expected = exact_joint_with_context(pair[0], PENALISED) * N_SAMPLES
    counts = sample_pairs(pair, shape, PENALISED, N_SAMPLES)
    assert counts[expected == 0].sum() == 0
    assert chi_square_pvalue(counts, expected) > 1e-3


def node_distributions_match_fresh_forwards(pair, sampling) -> bool:
    """Whether every tree node's p in a few steps equals the processed target distribution after
    the sequence so far plus the node's path, computed from scratch."""
    decoder = Decoder(pair[0], pair[1], V, make_shape("rsd-c", branching=(2, 2)), sampling, set())
    seq = list(PROMPT)
    for event in decoder.generate(PROMPT, 8, seed=1):
        for node in range(len(event.tree)):
            context = seq[:-1] + [event.tree.tokens[n] for n in event.tree.path_to(node)]
            seen = torch.zeros(V, dtype=torch.bool)
            seen[context] = True
            fresh = logits_to_probs(full_logits(pair[0], context)[-1], sampling, seen)
            if not torch.allclose(event.p[node], fresh, atol=1e-5):
                return False
        seq += event.emitted
    return True


def test_every_node_is_penalised_for_the_tokens_on_its_own_path(pair, monkeypatch):
    """The repetition penalty depends on tokens accepted earlier in the same tree path: each node's
    p is processed with them. Negative control: contexts without the path do not match."""
    assert node_distributions_match_fresh_forwards(pair, PENALISED)

    def without_path(self, sampling, seq, tree, nodes, device, answer_from=None):
        if not sampling.uses_context:
            return {}
        seen = torch.zeros(len(nodes), self.vocab_size, dtype=torch.bool, device=device)
        seen[:, seq] = True
        return {"seen": seen}

    monkeypatch.setattr(Decoder, "_seen", without_path)
    assert not node_distributions_match_fresh_forwards(pair, PENALISED)


def test_greedy_with_the_repetition_penalty_equals_plain_penalised_greedy(pair):
    target = pair[0]
    sampling = SamplingParams(temperature=0, repetition_penalty=1.8)
    tokens = list(PROMPT)
    for _ in range(20):
        seen = torch.zeros(V, dtype=torch.bool)
        seen[tokens] = True
        tokens.append(int(logits_to_probs(full_logits(target, tokens)[-1], sampling, seen).argmax()))
    for shape in (make_shape("rsd-c", branching=(3, 2)), make_shape("rsd-s", beam_width=2, depth=3)):
        assert run(pair, shape, sampling, 20, seed=0) == tokens[len(PROMPT):], shape.describe()


def answer_counts(tokens: list[int]) -> torch.Tensor:
    """(V,) how often each token is in the answer: what follows PROMPT."""
    return torch.bincount(torch.tensor(tokens[len(PROMPT):], dtype=torch.long), minlength=V)


def counted_greedy(target, sampling, steps: int) -> list[int]:
    """The target's greedy tokens under the presence and frequency penalties, one full forward each."""
    tokens = list(PROMPT)
    for _ in range(steps):
        probs = logits_to_probs(full_logits(target, tokens)[-1], sampling, counts=answer_counts(tokens))
        tokens.append(int(probs.argmax()))
    return tokens[len(PROMPT):]


def test_presence_and_frequency_penalties_count_each_nodes_own_path_exactly(pair):
    """OpenAI's presence and frequency penalties depend on how often each token is in the answer so
    far, the node's own path included (the prompt's tokens not): greedy trees give the penalised
    greedy tokens, and the first two tokens drawn by a depth-2 tree follow the penalised target's
    distribution."""
    greedy = SamplingParams(temperature=0, presence_penalty=0.4, frequency_penalty=0.6)
    expected_tokens = counted_greedy(pair[0], greedy, 20)
    assert counted_greedy(pair[0], SamplingParams(temperature=0, presence_penalty=0.4), 20) != expected_tokens
    for shape in (make_shape("rsd-c", branching=(3, 2)), make_shape("sd", draft_len=3)):
        assert run(pair, shape, greedy, 20, seed=0) == expected_tokens, shape.describe()
    sampling = SamplingParams(temperature=1.0, presence_penalty=1.5, frequency_penalty=1.0)

    def probs(tokens):
        return logits_to_probs(full_logits(pair[0], tokens)[-1], sampling, counts=answer_counts(tokens)).double()

    first = probs(PROMPT)
    expected = torch.stack([first[x] * probs(PROMPT + [x]) for x in range(V)]) * N_SAMPLES
    counts = sample_pairs(pair, make_shape("rsd-c", branching=(2, 2)), sampling, N_SAMPLES)
    assert chi_square_pvalue(counts, expected) > 1e-3


BIASED = SamplingParams(temperature=1.0, logit_bias=((0, -torch.inf), (3, 1.5), (4, -0.7)))  # (token 0 barred)


@pytest.mark.parametrize("shape, device_steps", [
    (make_shape("rsd-c", branching=(2, 2)), False), (make_shape("sd", draft_len=2), False),
    (make_shape("rsd-s", beam_width=2, depth=2), False), (make_shape("sd", draft_len=2), True), (FAN, True),
], ids=lambda value: value.describe() if isinstance(value, Shape) else "device" if value else "host")
def test_a_logit_bias_is_exact_and_bars_tokens_biased_to_minus_infinity(pair, shape, device_steps):
    """The first two tokens follow the target distribution with the bias added to its logits, on the
    host's maths and on the device's (an sd chain, an rsd-c fan of root children): never a token
    biased to -inf."""
    expected = exact_joint(pair[0], BIASED) * N_SAMPLES
    assert expected[0].sum() == 0 and expected[:, 0].sum() == 0
    assert not torch.allclose(expected, exact_joint(pair[0], SamplingParams(1.0)) * N_SAMPLES, atol=10)
    counts = sample_pairs(pair, shape, BIASED, N_SAMPLES, device_steps=device_steps)
    assert counts[0].sum() == 0 and counts[:, 0].sum() == 0
    assert chi_square_pvalue(counts, expected) > 1e-3


def test_greedy_with_a_logit_bias_equals_plain_biased_greedy(pair):
    """Greedy decoding takes the biased argmax, the draft's ranking included (rsd-c at T=0 ranks its
    candidates on a distribution of its own, which gets the bias too)."""
    sampling = SamplingParams(temperature=0, logit_bias=((5, -torch.inf), (2, 0.8)))
    tokens = list(PROMPT)
    for _ in range(20):
        tokens.append(int(logits_to_probs(full_logits(pair[0], tokens)[-1], sampling).argmax()))
    assert tokens[len(PROMPT):] != plain_greedy(pair[0], 20)
    for shape in (make_shape("ar"), make_shape("sd", draft_len=3), make_shape("rsd-c", branching=(3, 2)),
                  make_shape("rsd-s", beam_width=2, depth=3)):
        assert run(pair, shape, sampling, 20, seed=0) == tokens[len(PROMPT):], shape.describe()


def test_a_logit_bias_beyond_the_vocabulary_is_refused(pair):
    from rsd_cli.errors import RsdError

    with pytest.raises(RsdError, match=f"names token id {V}, but the models' vocabulary has {V} tokens"):
        Decoder(*pair, V, make_shape("sd"), SamplingParams(logit_bias=((1, 1.0), (V, -1.0))), set())


def sample_pairs_until_eos(pair, shape, sampling, eos: set[int], n: int) -> torch.Tensor:
    """sample_pairs where `eos` ends an answer: (first, second) counts, the second token missing
    (column V) where the first ended the answer."""
    counts = torch.zeros(V, V + 1)
    for seed in range(n):
        tokens = run(pair, shape, sampling, PAIR_DRAW, seed, eos=eos)
        counts[tokens[0], tokens[1] if len(tokens) > 1 else V] += 1
    return counts


@pytest.mark.parametrize("shape", [make_shape("rsd-c", branching=(2, 2)), make_shape("sd", draft_len=2),
                                   make_shape("spectr", num_drafts=2, depth=2)], ids=lambda s: s.describe())
def test_min_tokens_bars_the_end_of_sequence_tokens_only_while_the_answer_is_shorter(pair, shape):
    """min_tokens = 1 with end-of-sequence tokens {2, 5}: the first token is drawn with them barred,
    the second from the target as it is (a depth-2 tree: the root's row barred, its children's not),
    and the answer ends where the second is one of them."""
    eos = {2, 5}
    sampling = SamplingParams(temperature=1.0, min_tokens=1)
    barred = torch.zeros(V, dtype=torch.bool)
    barred[list(eos)] = True
    first = logits_to_probs(full_logits(pair[0], PROMPT)[-1], sampling, barred=barred).double()
    expected = torch.zeros(V, V + 1, dtype=torch.float64)
    for x in range(V):
        expected[x, :V] = first[x] * logits_to_probs(full_logits(pair[0], PROMPT + [x])[-1], SamplingParams(1.0)).double()
    assert expected[:, list(eos)].sum() > 0.2  # (the second token ends the answer often)
    counts = sample_pairs_until_eos(pair, shape, sampling, eos, N_SAMPLES)
    assert counts[list(eos)].sum() == 0 and counts[:, V].sum() == 0
    assert chi_square_pvalue(counts, expected * N_SAMPLES) > 1e-3


def test_greedy_answers_run_to_min_tokens_then_end_as_plain_greedy(pair):
    """A greedy answer that ends at once (its first token is end-of-sequence) runs to min_tokens
    with those tokens barred, then ends where plain greedy decoding of that context would."""
    eos = {1, 2}
    assert run(pair, make_shape("ar"), SamplingParams(temperature=0), 30, seed=0, eos=eos) == [1]
    sampling = SamplingParams(temperature=0, min_tokens=6)
    tokens = list(PROMPT)
    for length in range(30):
        barred = torch.zeros(V, dtype=torch.bool)
        if length < 6:
            barred[list(eos)] = True
        tokens.append(int(logits_to_probs(full_logits(pair[0], tokens)[-1], sampling, barred=barred).argmax()))
        if tokens[-1] in eos:
            break
    assert 6 < len(tokens) - len(PROMPT) <= 30 and tokens[-1] in eos
    for shape in (make_shape("ar"), make_shape("sd", draft_len=3), make_shape("rsd-c", branching=(3, 2)),
                  make_shape("rsd-s", beam_width=2, depth=3), make_shape("lookup", draft_len=3)):
        assert run(pair, shape, sampling, 30, seed=0, eos=eos) == tokens[len(PROMPT):], shape.describe()


@pytest.mark.parametrize("shape", DEVICE_SHAPES + [make_shape("ar")], ids=lambda s: s.describe())
def test_min_tokens_covering_the_whole_answer_runs_as_a_logit_bias_on_the_fast_paths(pair, shape):
    """--ignore-eos (min_tokens >= the answer's length): the end-of-sequence tokens barred at every
    position, as a bias of -inf on them bars them, with the steps that read no context (decided on
    the device, queued ahead): the bias's tokens, none of them an end-of-sequence token, and the
    decoder's own settings as they were once the answer is over."""
    eos, seen = {2, 5}, []
    ignoring = SamplingParams(1.0, min_tokens=30)
    barring = SamplingParams(1.0, logit_bias=((2, -torch.inf), (5, -torch.inf)))
    tokens = {}
    for sampling in (ignoring, barring):
        decoder = Decoder(*pair, V, shape, sampling, eos)
        decoder.device_steps, decoder.steps_ahead = True, True
        tokens[sampling] = [t for event in decoder.generate(PROMPT, 30, seed=4)
                            if not seen.append(decoder.sampling.uses_context) for t in event.emitted]
        assert decoder.sampling == sampling
    assert tokens[ignoring] == tokens[barring] and len(tokens[barring]) == 30 and not eos & set(tokens[barring])
    assert not any(seen)  # (no step read each node's context)
    decoder = Decoder(*pair, V, shape, SamplingParams(1.0, min_tokens=29), eos)  # (the last token may end it)
    assert [decoder.sampling.uses_context for _ in decoder.generate(PROMPT, 30, seed=4)][0]


class ScalarReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts reads of one tensor value into Python (`int(t)`, `float(t)`, `bool(t)`, `.item()`):
    on a GPU each one waits for the device."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("runtime", ["transformers", "static"])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_a_step_moves_only_a_few_numbers_to_the_host(pair, monkeypatch, runtime, temperature):
    """Device-resident maths: outside the model forwards, a step reads no tensor value on its own
    and moves values to the host only through `to_host`, each time a few numbers: one transfer per
    drafted level (its tokens), one or two per tried node (the first draft's fate, then the others')
    and one for the correction or bonus token — and an `sd` chain or `rsd-c` root children, decided
    on the device, one transfer a step (drafts, decisions, corrections and bonus). Run on the CPU
    as it runs on a GPU: device steps on, the support search (CPU only) off."""
    from torch.utils._python_dispatch import _disable_current_modes

    from rsd_cli import engine, sampling, verification
    from rsd_cli.compiled import CompiledModel, StaticLM
    from rsd_cli.engine import Runtimes

    transfers = []

    def counted(tensor):
        transfers.append(tensor.numel())
        return tensor.tolist()

    for module in (sampling, verification, engine):
        monkeypatch.setattr(module, "to_host", counted)
    monkeypatch.setattr(sampling, "support", lambda probs: None)
    for cls in (CachedLM, StaticLM):  # the forwards themselves (transformers' code) are not counted
        def forward(self, *args, _original=cls.forward, **kwargs):
            with _disable_current_modes():
                return _original(self, *args, **kwargs)
        monkeypatch.setattr(cls, "forward", forward)
    runtimes = None
    if runtime == "static":
        runtimes = Runtimes(CompiledModel(pair[0], compile=False), CompiledModel(pair[1], compile=False))
    params = SamplingParams(temperature=temperature, top_k=4, top_p=0.95)
    for shape in [s for s in shapes() if s.variant != "spectr"] + [FAN]:  # K-SEQ's bisection reads values
        decoder = Decoder(pair[0], pair[1], V, shape, params, set(), runtimes=runtimes)
        decoder.device_steps = True  # (what a GPU runs)
        transfers.clear()
        with ScalarReads() as reads:
            events = list(decoder.generate(PROMPT, 12, seed=1))
        assert reads.count == 0, shape.describe()
        if shape.variant == "sd" or shape is FAN:  # drafts, whether drawn (fan), decisions, corrections, bonus
            one = 3 * shape.depth + 1 if shape.variant == "sd" else 4 * shape.branching[0] + 1
            assert transfers == [one] * len(events), shape.describe()
            continue
        allowed = sum(e.shape.depth + 2 * e.levels_tried + 1 for e in events)  # a rejection costs a second one
        assert 0 < len(transfers) <= allowed, shape.describe()
        assert max(transfers) <= 3 * max(shape.width, max(shape.branching, default=1)), shape.describe()


def greedy_of(target, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy continuation of `prompt`, one full forward per token."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(full_logits(target, tokens)[-1].argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("runtime", ["transformers", "static"])
@pytest.mark.parametrize("shape", [make_shape("ar"), make_shape("sd", draft_len=2), make_shape("rsd-c", branching=(2, 2)),
                                   make_shape("auto")], ids=lambda s: s.describe())
def test_a_kept_cache_reads_only_what_the_next_prompt_does_not_share(pair, monkeypatch, runtime, shape):
    """A chat's next answer: its prompt is the conversation so far plus something new. With the
    last answer's caches kept, the prefill reads only what they do not hold, and the answer is the
    one a fresh decoder gives (greedy: token for token)."""
    from rsd_cli.compiled import CompiledModel
    from rsd_cli.engine import ChainExtension, Runtimes

    runtimes = Runtimes(CompiledModel(pair[0], False), CompiledModel(pair[1], False), "off") \
        if runtime == "static" else None
    greedy = SamplingParams(temperature=0)

    def decoder(kept=None) -> Decoder:
        made = Decoder(pair[0], pair[1], V, shape, greedy, set(), runtimes=runtimes)
        made.keep_caches, made.kept = True, kept
        return made

    first = decoder()
    answer = [t for e in first.generate(PROMPT, 9, seed=0) for t in e.emitted]
    assert answer == greedy_of(pair[0], PROMPT, 9)
    held = first.kept.tokens
    assert held == (PROMPT + answer)[: len(held)] and len(held) >= len(PROMPT) and first.kept.target.length == len(held)
    read = []
    real = ChainExtension.extend
    monkeypatch.setattr(ChainExtension, "extend",
                        lambda self, tokens, *a, **k: read.append(len(tokens)) or real(self, tokens, *a, **k))
    follow_up = PROMPT + answer + [2, 5, 1]
    second = decoder(first.kept)
    assert [t for e in second.generate(follow_up, 7, seed=0) for t in e.emitted] == greedy_of(pair[0], follow_up, 7)
    assert read[0] == len(follow_up) - 1 - len(held)  # the prefill: only what the cache did not hold
    # a prompt that parts from what is held half-way: the shared beginning is kept, the rest read again
    read.clear()
    other = PROMPT + answer[:3] + [0, 0, 2]
    assert [t for e in decoder(second.kept).generate(other, 5, seed=0) for t in e.emitted] == greedy_of(pair[0], other, 5)
    assert read[0] == len(other) - 1 - len(PROMPT + answer[:3])


def test_kept_caches_are_dropped_when_a_step_breaks_off_or_the_models_differ(pair, monkeypatch):
    decoder = Decoder(pair[0], pair[1], V, make_shape("sd", draft_len=2), SamplingParams(), set())
    decoder.keep_caches = True
    steps = decoder.generate(PROMPT, 20, seed=0)
    next(steps)
    real = CachedLM.forward

    def interrupted(self, *args, **kwargs):  # Ctrl-C in the target's forward, after the draft's
        if self.model is pair[0]:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(CachedLM, "forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        next(steps)
    assert decoder.kept is None  # the draft's cache held this step's tree: nothing kept
    monkeypatch.setattr(CachedLM, "forward", real)
    list(decoder.generate(PROMPT, 4, seed=0))
    kept = decoder.kept
    assert kept is not None
    other = Decoder(pair[1], pair[1], V, make_shape("ar"), SamplingParams(temperature=0), set())
    other.keep_caches, other.kept = True, kept  # another target: its caches are not used
    assert [t for e in other.generate(PROMPT, 4, seed=0) for t in e.emitted] == greedy_of(pair[1], PROMPT, 4)
    assert other.kept is not kept and other.kept.target is not kept.target


def test_the_unchanged_prefix_of_kept_positions_is_the_leading_run_in_place():
    assert unchanged_prefix([]) == 0
    assert unchanged_prefix(list(range(500))) == 500  # a plain step keeps everything in place
    assert unchanged_prefix([*range(300), 302, 305]) == 300  # the accepted path moves down
    assert unchanged_prefix([*range(300), 300, 304]) == 301
    assert unchanged_prefix([1, 2, 3]) == 0
    for kept in ([0], [0, 1, 3], [0, 2], [*range(7), 9, 10, 11]):  # against the definition
        expected = next((i for i, index in enumerate(kept) if index != i), len(kept))
        assert unchanged_prefix(kept) == expected


def together(decoder, max_tokens: int, seeds: list[int], prompt=PROMPT, ended_at: dict | None = None):
    """Each seed's tokens and last event from Decoder.generate_together (ended_at: seed index -> the
    step after which the caller ends it, as a stop string does)."""
    tokens, last, ended = [[] for _ in seeds], [None] * len(seeds), set()
    prompts = prompt if isinstance(prompt[0], list) else [prompt] * len(seeds)
    for step, events in enumerate(decoder.generate_together(prompts, max_tokens, seeds, ended), start=1):
        for j, event in enumerate(events):
            if event is not None:
                assert j not in ended  # an ended sample takes no further step
                tokens[j] += event.emitted
                last[j] = event
                if (ended_at or {}).get(j) == step:
                    ended.add(j)
    return tokens, last


@pytest.mark.parametrize("variant", ["ar", "auto"])
@pytest.mark.parametrize("sampling", [SamplingParams(0.0), SamplingParams(1.0), PENALISED, COUNTED,
                                      SamplingParams(1.0, logit_bias=((0, -torch.inf), (3, 1.0)), min_tokens=2)],
                         ids=["greedy", "T=1", "penalised", "presence-frequency", "biased-min-tokens"])
def test_samples_together_give_each_seed_the_tokens_it_gives_alone(pair, sampling, variant):
    """Completions decoded together (a row each per forward) draw what each seed draws alone: the
    same tokens, on transformers' forward and on the static-cache runtime (static shapes too); each
    ends on its own as alone (end-of-sequence token, the answer's length, the context's end), or ended
    by the caller."""
    from rsd_cli.compiled import CompiledModel
    from rsd_cli.engine import Runtimes

    target, draft = pair
    seeds = [11, 12, 13, 14, 15]
    static = Runtimes(CompiledModel(target, False, static_shapes=True), CompiledModel(draft, False, static_shapes=True))
    # transformers' forward; the static-cache runtime; on static shapes, as a GPU's graphs run it (rows
    # padded to buckets, slots and a mask over the whole capacity)
    for runtimes in (Runtimes(), Runtimes(CompiledModel(target, False), CompiledModel(draft, False)), static):
        every_reason = set()
        for eos, max_tokens, context in (({5}, 6, 40), (set(), 30, 12)):
            alone, reasons = [], []
            for seed in seeds:
                events = list(Decoder(target, draft, V, make_shape("ar"), sampling, eos, context, runtimes).generate(
                    PROMPT, max_tokens, seed))
                alone.append([t for e in events for t in e.emitted])
                reasons.append(events[-1].finished)
            decoder = Decoder(target, draft, V, make_shape(variant), sampling, eos, context, runtimes)
            tokens, last = together(decoder, max_tokens, seeds)
            assert tokens == alone and [event.finished for event in last] == reasons
            assert all(event.shape.describe() == "ar" and event.checks == [] for event in last)
            assert decoder.kept is None and decoder.policy is None
            every_reason |= set(reasons)
        assert every_reason == ({"eos", "context"} if sampling.greedy else {"eos", "length", "context"})
        tokens, _ = together(decoder, max_tokens, seeds, ended_at={1: 2})
        assert tokens[1] == alone[1][:2] and tokens[:1] + tokens[2:] == alone[:1] + alone[2:]


def test_completions_of_different_prompts_together_give_each_what_it_gives_alone(pair):
    """Prompts read once each (what they all begin with once for all), each completion seeing only its
    own prompt, at its own positions: tokens as alone, equal prompts sharing their reading."""
    from rsd_cli.compiled import CompiledModel
    from rsd_cli.engine import Runtimes

    target, draft = pair
    prompts = [[1, 3, 4], [1, 3, 5, 2, 0], [1, 3, 4], [4], [1, 3, 5, 2, 0, 1, 1]]
    seeds = [21, 22, 23, 24, 25]
    for sampling in (SamplingParams(1.0), PENALISED):
        for runtimes in (Runtimes(), Runtimes(CompiledModel(target, False), CompiledModel(draft, False))):
            alone = [run(pair, make_shape("ar"), sampling, 12, seed, prompt=prompt)
                     for prompt, seed in zip(prompts, seeds)]
            decoder = Decoder(target, draft, V, make_shape("ar"), sampling, set(), None, runtimes)
            assert together(decoder, 12, seeds, prompt=prompts)[0] == alone
            assert together(decoder, 12, seeds, prompt=prompts[1:2] * 5)[0][1] == alone[1]  # (one prompt: the
            # common beginning is all of it but its last token)


def test_samples_together_follow_the_target_distribution(pair):
    sampling = SamplingParams(temperature=1.0)
    decoder = Decoder(*pair, V, make_shape("ar"), sampling, set())
    counts = torch.zeros(V, V)
    for first_seed in range(0, N_SAMPLES, 250):
        tokens, _ = together(decoder, 2, list(range(first_seed, first_seed + 250)))
        for first, second in tokens:
            counts[first, second] += 1
    assert chi_square_pvalue(counts, exact_joint(pair[0], sampling) * N_SAMPLES) > 1e-3


# every layer windowed; the layers past the first; all but the last (in a text model, in a multimodal one);
# every other, half the layers reading others' keys
WINDOWED = ["mistral", "qwen2", "gemma3", "gemma3-vision", "gemma4"]
LONG_PROMPT = [1, 3, 4, 5, 2, 0, 1, 3, 4, 5, 0, 4]  # (12 tokens: past the window of 8)


@pytest.mark.parametrize("kind", WINDOWED)
def test_a_sliding_window_models_tree_sees_its_window_once_the_cache_outgrows_it(kind):
    """A model whose layers (or some of them) attend to the last 8 positions only: a tree's nodes
    after a 12-token cache get the logits of a full forward of their path (transformers' own window),
    and so does the next token after the accepted path is kept; a mask without the window would not
    give them (before, the cache's sliding layers dropped old keys and the forward failed)."""
    from tiny import tiny_windowed

    target = tiny_windowed(kind, V, seed=0)
    tree = DraftTree.rooted_at(5)
    a, _ = tree.add_draw(0, 2)
    b, _ = tree.add_draw(0, 4)
    c, _ = tree.add_draw(a, 1)
    base = len(LONG_PROMPT)
    visible = torch.cat([torch.ones(len(tree), base, dtype=torch.bool), tree.ancestry()], dim=1)
    references = [full_logits(target, LONG_PROMPT + [tree.tokens[n] for n in tree.path_to(node)])[-1]
                  for node in range(len(tree))]
    lm, unwindowed = CachedLM(target, V), CachedLM(target, V)
    unwindowed.window = None  # (the window left out of the masks)
    for cache in (lm, unwindowed):
        cache.extend(LONG_PROMPT)
    logits = lm.forward(tree.tokens, [base + depth for depth in tree.depths], visible)
    for node in range(len(tree)):
        assert torch.allclose(logits[node], references[node], atol=1e-5), node
    wrong = unwindowed.forward(tree.tokens, [base + depth for depth in tree.depths], visible)
    assert not torch.allclose(wrong, logits, atol=1e-4)
    lm.keep(list(range(base)) + [base + n for n in (0, a, c)])
    nxt = lm.extend([3], last_only=True)[-1]
    assert torch.allclose(nxt, full_logits(target, LONG_PROMPT + [5, 2, 1, 3])[-1], atol=1e-5)
    assert lm.key_positions.tolist() == list(range(base + 4))


@pytest.mark.parametrize("kind", WINDOWED)
def test_a_sliding_window_model_decodes_plain_greedy_past_its_window(kind):
    """Every variant, trees kept and cropped step after step 30 tokens past a window of 8, gives the
    target's greedy tokens (its draft windowed too), and so do completions of prompts of different
    lengths decoded together, where a cache slot's position is not its index."""
    from tiny import tiny_windowed

    target, draft = tiny_windowed(kind, V, seed=0), tiny_windowed(kind, V, layers=1, seed=1)
    greedy = SamplingParams(temperature=0)
    expected = plain_greedy(target, 30, LONG_PROMPT)
    for shape in shapes() + [FAN]:
        assert run((target, draft), shape, greedy, 30, seed=0, prompt=LONG_PROMPT) == expected, shape.describe()
    prompts = [LONG_PROMPT, [4, 1], LONG_PROMPT[2:] + [3, 3]]
    decoder = Decoder(target, draft, V, make_shape("ar"), greedy, set())
    tokens, _ = together(decoder, 20, [1, 2, 3], prompt=prompts)
    assert tokens == [plain_greedy(target, 20, prompt) for prompt in prompts]


def every_layer_windowed(kind: str, layers: int = 2, seed: int = 0):
    """A tiny model every layer of which sees the last 8 positions: Mistral's, or Qwen2's with
    max_window_layers = 0."""
    from tiny import tiny_windowed

    model = tiny_windowed(kind, V, layers=layers, seed=seed)
    if kind == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        settings = {key: value for key, value in model.config.to_dict().items() if key != "layer_types"}
        config = Qwen2Config(**{**settings, "max_window_layers": 0})
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(3.0)
    return model


@pytest.mark.parametrize("kind", ["mistral", "qwen2", "qwen2-some-layers", "gemma3"])
def test_the_static_cache_runtime_windows_a_model_with_a_sliding_window(kind):
    """A window on every layer (Mistral 7B v0.1's) or on some (Qwen2's past `max_window_layers`, Gemma
    3's: a mask for each layer kind) runs on the static-cache runtime, its masks hiding the keys each
    row's window has passed by their positions: a tree after a 12-token cache gets full-forward
    logits (not without the window), and every variant, on dynamic and static shapes, and
    completions of different prompts decoded together (slots that are not positions) give the
    target's greedy tokens 30 tokens past a window of 8."""
    from tiny import tiny_windowed

    from rsd_cli.compiled import CompiledModel, StaticLM
    from rsd_cli.engine import Runtimes

    if kind in ("mistral", "qwen2"):
        target, draft = every_layer_windowed(kind), every_layer_windowed(kind, layers=1, seed=1)
        assert set(getattr(target.config, "layer_types", None) or ["sliding_attention"]) == {"sliding_attention"}
    else:  # (the first layer windowed and the second not, or the other way round)
        kind = kind.removesuffix("-some-layers")
        target, draft = tiny_windowed(kind, V), tiny_windowed(kind, V, layers=1, seed=1)
        assert set(target.config.layer_types) == {"sliding_attention", "full_attention"}
    tree = DraftTree.rooted_at(5)
    a, _ = tree.add_draw(0, 2)
    tree.add_draw(0, 4)
    c, _ = tree.add_draw(a, 1)
    base = len(LONG_PROMPT)
    visible = torch.cat([torch.ones(len(tree), base, dtype=torch.bool), tree.ancestry()], dim=1)
    references = torch.stack([full_logits(target, LONG_PROMPT + [tree.tokens[n] for n in tree.path_to(node)])[-1]
                              for node in range(len(tree))])
    runtime = CompiledModel(target, False)
    assert runtime.window == 8
    for static_shapes in (False, True):
        lm, unwindowed = (StaticLM(CompiledModel(target, False, static_shapes=static_shapes), V, 32) for _ in "ab")
        unwindowed.window = unwindowed.compiled.by_kind = None
        with torch.inference_mode():
            for cache in (lm, unwindowed):
                cache.extend(LONG_PROMPT)
            logits = lm.forward(tree.tokens, [base + depth for depth in tree.depths], visible)
            wrong = unwindowed.forward(tree.tokens, [base + depth for depth in tree.depths], visible)
        torch.testing.assert_close(logits, references, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(wrong, references, atol=1e-4)
        # the path kept (root, a, c) and the tokens after it, one at a time until its keys leave the window
        lm.keep(list(range(base)) + [base + n for n in (0, a, c)])
        context = LONG_PROMPT + [5, 2, 1]
        for token in [3, 0, 4, 4, 1, 5, 2, 3, 0]:
            context.append(token)
            with torch.inference_mode():
                nxt = lm.extend([token], last_only=True)[-1]
            torch.testing.assert_close(nxt, full_logits(target, context)[-1], atol=1e-5, rtol=1e-5)
        assert lm.key_positions[: lm.length].tolist() == list(range(len(context)))
        for cache in (lm, unwindowed):
            cache.release()
    greedy = SamplingParams(temperature=0)
    expected = plain_greedy(target, 30, LONG_PROMPT)
    prompts = [LONG_PROMPT, [4, 1], LONG_PROMPT[2:] + [3, 3]]
    for static_shapes in (False, True):
        runtimes = Runtimes(CompiledModel(target, False, static_shapes=static_shapes),
                            CompiledModel(draft, False, static_shapes=static_shapes))
        for shape in shapes() + [FAN]:
            decoder = Decoder(target, draft, V, shape, greedy, set(), None, runtimes)
            tokens = [t for event in decoder.generate(LONG_PROMPT, 30, seed=0) for t in event.emitted]
            assert tokens == expected, (static_shapes, shape.describe())
        decoder = Decoder(target, draft, V, make_shape("ar"), greedy, set(), None, runtimes)
        assert together(decoder, 20, [1, 2, 3], prompt=prompts)[0] == [plain_greedy(target, 20, p) for p in prompts]


@pytest.mark.parametrize("kind", ["bloom", "mpt"])
def test_an_alibi_model_decodes_chains_plain_greedy_and_refuses_trees(kind):
    """ALiBi models work their position biases out of cache slots or a 2D mask, so their attention
    takes no tree: they decode `ar`, `sd` and `lookup` chains (on their own causal mask) with the
    target's greedy tokens, `auto` among chains only, and a tree variant, or completions read
    together, is refused in one line instead of decoded with wrong biases."""
    from rsd_cli.errors import RsdError
    from tiny import tiny_alibi

    target, draft = tiny_alibi(kind, V, seed=0), tiny_model(V, layers=1, seed=1, scale=0.1)
    greedy = SamplingParams(temperature=0)
    expected = plain_greedy(target, 20, LONG_PROMPT)
    for shape in (make_shape("ar"), make_shape("sd", draft_len=3), make_shape("lookup", draft_len=3),
                  make_shape("auto")):
        assert run((target, draft), shape, greedy, 20, seed=0, prompt=LONG_PROMPT) == expected, shape.describe()
    decoder = Decoder(target, draft, V, make_shape("auto"), SamplingParams(temperature=1.0), set())
    list(decoder.generate(LONG_PROMPT, 30, seed=3))
    assert {shape.variant for shape in decoder.policy.shapes} == {"ar", "sd"}
    for shape in (make_shape("rsd-c", branching=(2,)), make_shape("mss", branching=(2, 1)), make_shape("spectr"),
                  make_shape("rsd-s")):
        with pytest.raises(RsdError, match=rf"{shape.variant} verifies a tree, which the target's ALiBi position "
                                           rf"biases \({kind}\) cannot take: use --variant ar, sd or lookup"):
            run((target, draft), shape, greedy, 5, seed=0)
    with pytest.raises(RsdError, match="decoded together"):
        together(Decoder(target, draft, V, make_shape("ar"), greedy, set()), 4, [1, 2])
    lm = CachedLM(target, V)
    lm.extend(PROMPT)
    with pytest.raises(RsdError, match="take chains only, here asked for a tree"):  # (asked of the cache itself)
        lm.forward([2, 4], [3, 3], torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 1]], dtype=torch.bool))


def test_models_whose_layers_take_no_tree_are_told_by_their_config():
    from transformers import AutoConfig

    from rsd_cli.engine import CHAIN_VARIANTS, limit_of

    def limit(kind, **extra):
        found = limit_of(AutoConfig.for_model(kind, **extra))
        return found and (found.variants, found.reason)

    alibi = (CHAIN_VARIANTS, "ALiBi position biases")
    assert limit("bloom") == limit("mpt") == limit("falcon", alibi=True) == alibi
    assert limit("falcon") is None  # (rotary by default)
    assert limit("llama4_text") == (CHAIN_VARIANTS, "chunked attention scaled by the cache's length")
    assert limit("gpt_neo") == (CHAIN_VARIANTS, "local attention windowed by cache slots")
    # (what the static-cache runtime works out by position, or LFM2's convolutions by path: trees there, pair_limit)
    assert all(limit_of(AutoConfig.for_model(kind)).transformers_only
               for kind in ("bloom", "mpt", "llama4_text", "gpt_neo", "lfm2", "lfm2_moe", "qwen3_5_text",
                            "qwen3_5_moe_text", "qwen3_next", "granitemoehybrid", "nemotron_h", "bamba", "mamba2"))
    assert not any(limit_of(AutoConfig.for_model(kind)).transformers_only for kind in ("falcon_h1", "mamba"))
    # (chains read after a state exactly)
    for kind in ("lfm2", "lfm2_moe", "qwen3_next", "granitemoehybrid", "falcon_h1", "bamba", "mamba2"):
        assert limit(kind) == (CHAIN_VARIANTS, "recurrent layers"), kind
    for kind in ("mamba", "falcon_mamba", "jamba", "nemotron_h"):  # (by name or layer kinds)
        assert limit(kind) == (("ar",), "recurrent layers"), kind
    for kind in ("llama", "gpt2", "gpt_neox", "opt", "gemma3_text", "mistral", "qwen2", "phi3"):
        assert limit(kind) is None, kind


@pytest.mark.parametrize("kind", ["lfm2", "falcon_h1", "mamba"])
def test_a_model_with_recurrent_layers_decodes_the_chains_it_can_take_back(kind):
    """Layers with a state (LFM2's short convolutions, Falcon-H1's Mamba-2 mixers beside attention
    in one cache layer, Mamba) read every token into it, a tree's siblings too. LFM2 and Falcon-H1
    decode chains (`ar`, `sd`, `lookup`; `auto` among plain steps and `sd`) with the target's
    greedy tokens: a rejected draft is taken back by going back to the state copied before it
    (keys cropped) and reading the accepted tokens again. transformers' Mamba reads a chain after
    a state without that state, so it decodes plainly only. What neither can take, and completions
    read together, is refused in one line; tokens a cache must give back (a later sample's prompt,
    an answer's end read ahead) are read again, the same samples as alone."""
    from rsd_cli.errors import RsdError
    from tiny import tiny_recurrent

    target, draft = tiny_recurrent(kind, V, layers=4, seed=0), tiny_recurrent(kind, V, layers=2, seed=1)
    chains = kind != "mamba"
    greedy = SamplingParams(temperature=0)
    expected = plain_greedy(target, 16, LONG_PROMPT)
    runs = ("ar", "sd", "lookup", "auto") if chains else ("ar", "auto")
    for variant in runs:
        assert run((target, draft), make_shape(variant, draft_len=3), greedy, 16, seed=0, prompt=LONG_PROMPT) == \
            expected, variant
    refusal = (f"verifies a tree, which the target's recurrent layers \\({kind}\\) cannot take: use --variant ar, "
               "sd or lookup" if chains else
               f"verifies drafts, which the target's recurrent layers \\({kind}\\) cannot take back: use --variant ar")
    for variant in ("rsd-c",) if chains else ("sd", "lookup", "rsd-c"):
        with pytest.raises(RsdError, match=f"{variant} {refusal}"):
            run((target, draft), make_shape(variant), greedy, 4, seed=0)
    with pytest.raises(RsdError, match="decoded together"):
        together(Decoder(target, draft, V, make_shape("ar"), greedy, set()), 4, [1, 2])
    lm = CachedLM(target, V)
    lm.extend(LONG_PROMPT)
    lm.extend([5, 2])
    lm.extend([4])
    lm.keep(list(range(len(LONG_PROMPT) + 1)))  # (2 and 4 given back: back to a state, or all read afresh)
    assert lm.length == len(LONG_PROMPT) + 1
    assert torch.allclose(lm.extend([3])[-1], full_logits(target, LONG_PROMPT + [5, 3])[-1], atol=1e-5)
    sampling = SamplingParams(temperature=1.0)
    alone = [run((target, draft), make_shape("ar"), sampling, 8, seed=seed) for seed in (4, 5)]
    assert alone[0] != alone[1]
    decoder = Decoder(target, draft, V, make_shape("ar"), sampling, set())
    decoder.keep_caches, decoder.steps_ahead = True, True  # (a prompt kept from the first; a step read ahead)
    assert [[t for e in decoder.generate(PROMPT, 8, seed) for t in e.emitted] for seed in (4, 5)] == alone
    if kind == "lfm2":  # the first two tokens of `sd` chains, rejected drafts taken back, follow the target's
        # distribution (Falcon-H1's torch-only mixers would take a minute)
        counts = sample_pairs((target, draft), make_shape("sd", draft_len=2), sampling, N_SAMPLES)
        assert chi_square_pvalue(counts, exact_joint(target, sampling) * N_SAMPLES) > 1e-3


def test_a_recurrent_models_state_is_copied_only_for_forwards_a_step_may_take_back(monkeypatch):
    """Plain steps give nothing back, so their forwards copy no state (a Qwen3.5-0.8B-sized one takes
    7-9 ms on the 2-core Xeon); `sd` steps copy it before the target's verification and each draft
    forward, and `auto` switching between the two still decodes the target's greedy tokens."""
    from tiny import tiny_recurrent

    copied = []
    original = CachedLM._snapshot
    monkeypatch.setattr(CachedLM, "_snapshot", lambda self: copied.append(self.length) or original(self))
    target, draft = tiny_recurrent("lfm2", V, layers=4, seed=0), tiny_recurrent("lfm2", V, layers=2, seed=1)
    greedy = SamplingParams(temperature=0)
    plain = run((target, draft), make_shape("ar"), greedy, 12, seed=0, prompt=LONG_PROMPT)
    assert copied == [0]  # (the prompt's read alone)
    copied.clear()
    assert run((target, draft), make_shape("sd", draft_len=2), greedy, 12, seed=0, prompt=LONG_PROMPT) == plain
    assert len(copied) > 12
    assert run((target, draft), make_shape("auto"), greedy, 12, seed=0, prompt=LONG_PROMPT) == plain


def test_a_draft_with_fewer_rows_than_the_targets_vocabulary_keeps_the_targets_whole_distribution():
    """Qwen2.5-0.5B's embedding has 151936 rows, 7B's 152064 (one tokenizer, rows padded otherwise):
    the first two tokens follow the target's distribution over all its tokens, those only it has
    included (before, the vocabulary was narrowed to the draft's), and the draft reads such a token
    as its own last row (its q stays the one its drafts are drawn from, 0 on the target's extra
    tokens)."""
    from rsd_cli.models import draft_reads_every_token

    wide = V + 2
    target, draft = tiny_model(wide, layers=2, seed=0, scale=0.1), tiny_model(V, layers=1, seed=1, scale=0.1)
    with torch.no_grad():  # (the extra tokens as likely as two of the others)
        target.lm_head.weight[V:] = target.lm_head.weight[1:3]
    draft_reads_every_token(draft, wide)
    with torch.no_grad():
        assert torch.equal(draft(torch.tensor([[V + 1, 2]])).logits, draft(torch.tensor([[V - 1, 2]])).logits)
    sampling = SamplingParams(temperature=1.0)
    first = logits_to_probs(full_logits(target, PROMPT)[-1], sampling).double()
    expected = torch.stack([first[x] * logits_to_probs(full_logits(target, PROMPT + [x])[-1], sampling).double()
                            for x in range(wide)]) * N_SAMPLES
    for shape in (make_shape("sd", draft_len=2), make_shape("rsd-c", branching=(2, 2))):
        counts = torch.zeros(wide, wide)
        for seed in range(N_SAMPLES):
            decoder = Decoder(target, draft, wide, shape, sampling, set())
            first_token, second_token = [t for e in decoder.generate(PROMPT, PAIR_DRAW, seed) for t in e.emitted][:2]
            counts[first_token, second_token] += 1
        assert counts[V:].sum() > 0.1 * N_SAMPLES  # (the target's own tokens drawn, and read by the draft)
        assert chi_square_pvalue(counts, expected) > 1e-3, shape.describe()
