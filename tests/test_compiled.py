"""The static-cache runtime (compiled and not) against transformers' eager forward: the same logits
for trees and pruned caches, the same greedy output for every variant, the target's distribution
(Monte-Carlo), and the --compile setting as a user meets it."""

from __future__ import annotations

import json
import math
import weakref

import pytest
import torch
from typer.testing import CliRunner

from rsd_cli import compiled, small_batch, threads
from rsd_cli.cli import BENCH_VARIANTS, app
from rsd_cli.compiled import CompiledModel, StaticLM
from rsd_cli.drafting import make_shape
from rsd_cli.engine import CachedLM, Decoder, Runtimes
from rsd_cli.errors import RsdError
from rsd_cli.sampling import SamplingParams
from rsd_cli.tree import DraftTree
from test_engine import (DEVICE_SHAPES, MC_SHAPES, N_SAMPLES, PAIR_DRAW, PROMPT, V, chi_square_pvalue, exact_joint,
                         plain_greedy, sample_pairs, shapes, together)
from test_engine import run as run_on
from test_threads import Alternating
from tiny import LONG_FACTORS_FROM, tiny_model, tiny_relative


@pytest.fixture(scope="module")
def pair():
    return tiny_model(V, layers=2, seed=0, scale=0.1), tiny_model(V, layers=1, seed=1, scale=0.1)


@pytest.fixture(scope="module")
def runtimes(pair):
    """Both backends of the static-cache runtime, each built once (compiled graphs are shared)."""
    return {compile: Runtimes(CompiledModel(pair[0], compile), CompiledModel(pair[1], compile),
                              "on" if compile else "auto") for compile in (True, False)}


@pytest.fixture(scope="module")
def static_runtimes(pair):
    """The static-shape path CUDA graphs replay (slots as a tensor, masks over the whole capacity,
    buffers shared by a model's generations), run without the graphs: what the CPU can check."""
    return Runtimes(CompiledModel(pair[0], False, static_shapes=True),
                    CompiledModel(pair[1], False, static_shapes=True), "auto")


# Llama 4 on the runtime, after some earlier tests in the same process: logits up to 4.0 from transformers' (a
# prompt read as a chain too), on CI's two workers only (CI and two fresh clones: not alone, not after test_compiled's
# tests before it in one process). The runtime's own maths is off there (a fresh uncompiled backend on a deep copy
# too; not the grouped experts, the kernels, the threads or grad mode): a process-wide state not yet found. Open in
# issue 14's note; not strict, so that it shows as XPASS wherever it does not happen.
LLAMA4_AFTER_OTHERS = pytest.mark.xfail(reason="Llama 4 on the runtime goes wrong after some earlier tests in a "
                                        "process (order-dependent, cause not yet found)", strict=False)


def a_tree() -> DraftTree:
    tree = DraftTree.rooted_at(5)
    a, _ = tree.add_draw(0, 2)
    b, _ = tree.add_draw(0, 4)
    c, _ = tree.add_draw(a, 1)
    tree.add_draw(b, 3)
    tree.add_draw(c, 0)
    return tree


def assert_same_tree_logits(ours, reference, before_tree=lambda: None, tolerance: float = 1e-5) -> int:
    """Both caches read PROMPT, then a_tree() in one forward: the same logits. Returns the tree's base."""
    for lm in (ours, reference):
        lm.extend(PROMPT)
    before_tree()
    tree = a_tree()
    base = len(PROMPT)
    visible = torch.cat([torch.ones(len(tree), base, dtype=torch.bool), tree.ancestry()], dim=1)
    positions = [base + d for d in tree.depths]
    torch.testing.assert_close(ours.forward(tree.tokens, positions, visible),
                               reference.forward(tree.tokens, positions, visible), atol=tolerance, rtol=tolerance)
    return base


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


@pytest.mark.parametrize("compile", [True, False, "static shapes", "compiled static shapes",
                                     pytest.param("CUDA graphs", marks=CUDA),
                                     pytest.param("compiled CUDA graphs", marks=CUDA)],
                         ids=["compiled", "eager", "static-shapes", "compiled-static-shapes", "cuda-graphs",
                              "compiled-cuda-graphs"])
def test_static_cache_matches_transformers_for_trees_pruning_and_growth(pair, runtimes, compile):
    """A 6-node tree (padded to 8 when compiled or on static shapes), pruning to one path, then
    chains past the buffers' first capacity: every logit equals transformers' eager forward with
    its DynamicCache. On a GPU the growth replaces the shared buffers, so every graph is captured
    again (in a memory pool of its own: reusing the old one fails torch's allocator)."""
    model, tolerance, setting = pair[0], 1e-5, str(compile)
    if "CUDA" in setting:
        import copy

        model, tolerance = copy.deepcopy(pair[0]).cuda(), 1e-4
        runtime = CompiledModel(model, True, inductor=compile.startswith("compiled"))
        assert runtime.graphed and runtime.inductor == compile.startswith("compiled")
        ours = StaticLM(runtime, V, capacity=12)
        assert ours.static
    elif "static shapes" in setting:  # (compiled: the layers CUDA graphs capture on a GPU, without the graphs)
        ours = StaticLM(CompiledModel(pair[0], compile.startswith("compiled"), static_shapes=True), V, capacity=12)
        assert ours.static
    else:
        ours = StaticLM(runtimes[compile].target, V, capacity=12)  # grows on the way
    reference = CachedLM(model, V)
    base = assert_same_tree_logits(ours, reference, tolerance=tolerance)
    kept = list(range(base)) + [base + n for n in (0, 1, 3, 5)]  # root, a, c, e
    for lm in (ours, reference):
        lm.keep(kept)
    assert ours.length == reference.length == base + 4
    for chain in ([2], [1, 3], [4, 0, 2], [1] * 9, [3, 2] * 10):  # (20 tokens: padded to 32 on static shapes)
        torch.testing.assert_close(ours.extend(chain, last_only=False), reference.extend(chain, last_only=False),
                                   atol=tolerance, rtol=tolerance)
    assert ours.capacity > 12 and ours.length == reference.length
    if compile is True:
        assert {1, 2, 4, 8} <= runtimes[compile].target.graphs  # the bucketed sizes ran compiled
    if compile in ("compiled static shapes", "compiled CUDA graphs"):
        assert {1, 2, 4, 8, 32} <= ours.compiled.graphs
    if "CUDA" in setting:
        assert ours.compiled.graphed and {key[0] for key in ours.compiled._captured} >= {32}  # after the growth


class AllPacked:
    """Kernel verdicts: oneDNN on packed weights for every layer shape and row count."""

    def kernels(self, weights, blocks=None):
        return ("packed", "packed", "packed")

    def save(self):
        pass


@pytest.fixture(scope="module")
def packed_runtimes(pair):
    """Copies of the pair whose linear layers use the packed oneDNN kernel, compiled."""
    import copy

    from rsd_cli import small_batch

    models = tuple(copy.deepcopy(model) for model in pair)
    for model in models:
        small_batch.install(model, AllPacked())
    return models, Runtimes(CompiledModel(models[0], True), CompiledModel(models[1], True), "on")


@pytest.mark.skipif(not hasattr(torch.library, "custom_op"), reason="torch < 2.4: compiled graphs use torch's product")
def test_compiled_graphs_run_the_measured_cpu_kernels(pair, packed_runtimes, monkeypatch):
    from rsd_cli import small_batch

    if not small_batch.onednn_available():
        pytest.skip("no oneDNN in this torch")
    models, runtimes = packed_runtimes
    ran = []
    real = small_batch.run_kernel
    monkeypatch.setattr(small_batch, "run_kernel", lambda kernel, *args: ran.append(kernel) or real(kernel, *args))
    assert_same_tree_logits(StaticLM(runtimes.target, V, capacity=32), CachedLM(pair[0], V),
                            before_tree=ran.clear)
    assert 8 in runtimes.target.graphs and ran.count("packed") >= 2 * 7  # every linear of both layers
    assert small_batch.packed_of(models[0].model.layers[0].mlp.down_proj) is not None


@pytest.mark.parametrize("shape", shapes()[:4], ids=lambda s: s.describe())
def test_greedy_on_compiled_graphs_with_packed_kernels_equals_plain_greedy(pair, packed_runtimes, shape):
    models, runtimes = packed_runtimes
    assert run(models, runtimes, shape, SamplingParams(temperature=0), 25, seed=0) == plain_greedy(pair[0], 25)


def run(pair, runtimes, shape, sampling, max_tokens, seed, device_steps=None, prompt=PROMPT):
    return run_on(pair, shape, sampling, max_tokens, seed, prompt=prompt, device_steps=device_steps, runtimes=runtimes)


# a lookup chain decided on the device (Decoder._lookup_step): its tokens looked up on the host, fed
# to the target's forward with the root, every node decided at once
DEVICE_LOOKUP = make_shape("lookup", draft_len=3)


@pytest.mark.parametrize("shape", DEVICE_SHAPES + [DEVICE_LOOKUP], ids=lambda s: s.describe())
def test_device_steps_on_static_shapes_compiled_and_through_graph_replays_are_plain_greedy(
        pair, runtimes, static_runtimes, shape, monkeypatch):
    """A GPU's path for sd chains, rsd-c root children and lookup chains — tokens drawn (or looked up)
    and decided on the device, fed from there to the draft's next level and to the target's forward —
    on the compiled runtime, on static shapes and through graph replays (the CPU stand-in for CUDA
    graphs): plain greedy output."""
    for backend in (runtimes[True], static_runtimes):
        assert run(pair, backend, shape, SamplingParams(0.0), 25, 0, device_steps=True) == plain_greedy(pair[0], 25)
    runtimes, graphs = recorded_graphs(pair, monkeypatch)
    assert run(pair, runtimes, shape, SamplingParams(0.0), 20, 0, device_steps=True) == plain_greedy(pair[0], 20)
    assert graphs and all(graph.replays >= 1 for graph in graphs)


@pytest.mark.parametrize("shape", shapes(), ids=lambda s: s.describe())
def test_greedy_on_the_compiled_runtime_equals_plain_greedy(pair, runtimes, shape):
    assert run(pair, runtimes[True], shape, SamplingParams(temperature=0), 25, seed=0) == plain_greedy(pair[0], 25)


@pytest.mark.parametrize("shape", MC_SHAPES[1:], ids=lambda s: s.describe())
def test_first_two_tokens_follow_the_target_distribution_when_compiled(pair, runtimes, shape):
    sampling = SamplingParams(temperature=1.0)
    expected = exact_joint(pair[0], sampling) * N_SAMPLES
    counts = torch.zeros(V, V)
    for seed in range(N_SAMPLES):
        first, second = run(pair, runtimes[True], shape, sampling, PAIR_DRAW, seed)[:2]
        counts[first, second] += 1
    assert chi_square_pvalue(counts, expected) > 1e-3


@pytest.mark.parametrize("shape", shapes(), ids=lambda s: s.describe())
def test_greedy_on_static_shapes_equals_plain_greedy(pair, static_runtimes, shape):
    assert run(pair, static_runtimes, shape, SamplingParams(temperature=0), 25, seed=0) == plain_greedy(pair[0], 25)


def test_trees_up_to_64_nodes_replay_on_their_buckets_and_give_plain_greedy(pair, monkeypatch):
    """What auto drafts on a GPU: trees of 17-64 nodes run as graphs of 32 and 64 tokens (the
    largest static buckets; the CPU tests' other trees stay within 16), with the graph stand-in."""
    runtimes, graphs = recorded_graphs(pair, monkeypatch)
    target = runtimes.target
    for branching, bucket in (((4, 3, 1), 32), ((4, 3, 2), 64)):  # 29 and 41 nodes
        shape = make_shape("rsd-c", branching=branching)
        assert run(pair, runtimes, shape, SamplingParams(0.0), 20, 0) == plain_greedy(pair[0], 20), branching
        assert bucket in {key[0] for key in target._captured}
    assert all(graph.replays >= 1 for graph in graphs)


@pytest.mark.parametrize("shape", [MC_SHAPES[1], MC_SHAPES[4]], ids=lambda s: s.describe())
def test_first_two_tokens_follow_the_target_distribution_on_static_shapes(pair, static_runtimes, shape):
    sampling = SamplingParams(temperature=1.0)
    counts = torch.zeros(V, V)
    for seed in range(N_SAMPLES):
        first, second = run(pair, static_runtimes, shape, sampling, PAIR_DRAW, seed)[:2]
        counts[first, second] += 1
    assert chi_square_pvalue(counts, exact_joint(pair[0], sampling) * N_SAMPLES) > 1e-3


def test_lookup_chains_fill_their_forward_s_bucket_and_follow_the_target_distribution(pair, static_runtimes,
                                                                                       monkeypatch):
    """On static shapes (what CUDA graphs replay) a lookup chain decided on the device is padded to the
    bucket its forward fills anyway (Decoder._filled: 2 looked-up tokens and the root verified as 4
    rows), so that its maths is one graph per bucket: the first two tokens' joint distribution is still
    the target's, drafts accepted and rejected, and greedy decoding is still plain greedy. (Which row
    the bonus is drawn from, past the filler: test_engine's lookup_verdict test.)"""
    from test_engine import REPEATING

    from rsd_cli import engine

    shape, sampling = make_shape("lookup", draft_len=2), SamplingParams(temperature=1.0)
    filled = []
    real = Decoder._filled
    monkeypatch.setattr(Decoder, "_filled", staticmethod(lambda target, n: filled.append((n, real(target, n))) or
                                                         real(target, n)))
    first = []
    monkeypatch.setattr(engine, "lookup_verdict", lambda *args, real=engine.lookup_verdict: first.append(
        args[2].shape[0]) or real(*args))
    counts = torch.zeros(V, V)
    for seed in range(N_SAMPLES):
        tokens = run(pair, static_runtimes, shape, sampling, PAIR_DRAW, seed, device_steps=True, prompt=REPEATING)
        counts[tokens[0], tokens[1]] += 1
    assert (2, 3) in filled and 4 in first  # (the root, 2 looked-up tokens and one more: a bucket of 4)
    assert counts[2, 5] > 0 and counts[2].sum() < counts.sum()  # (both drafts accepted; the first rejected)
    assert chi_square_pvalue(counts, exact_joint(pair[0], sampling, REPEATING) * N_SAMPLES) > 1e-3
    greedy = run(pair, static_runtimes, shape, SamplingParams(0.0), 25, 0, device_steps=True, prompt=REPEATING)
    assert greedy == plain_greedy(pair[0], 25, REPEATING)


def test_auto_measures_its_costs_on_the_static_shape_caches(pair, static_runtimes, monkeypatch, tmp_path):
    """auto times forwards on caches of the generation's own kind: with static shapes (CUDA graphs
    on a GPU) those must hold the shared buffers, so they are measured before the generation's."""
    from rsd_cli import auto

    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(auto, "_MEASURED", {})
    made = []
    real = Decoder._cache
    monkeypatch.setattr(Decoder, "_cache", lambda self, *args: made.append(real(self, *args)) or made[-1])
    assert run(pair, static_runtimes, make_shape("auto"), SamplingParams(0.0), 25, 0) == plain_greedy(pair[0], 25)
    assert len(made) == 4 and all(cache.static for cache in made)  # 2 measured, 2 generating


def test_static_shape_buffers_serve_one_generation_at_a_time(pair):
    """CUDA graphs replay on the buffers they were captured with, so a model's static-shape
    generations share one set: taken by one live cache at a time, handed back when its generation
    ends (or its consumer stops early); a second cache meanwhile runs on buffers of its own."""
    target, draft = (CompiledModel(model, False, static_shapes=True) for model in pair)
    first = StaticLM(target, V, 16)
    second = StaticLM(target, V, 16)
    assert first.static and not second.static and second.keys.data_ptr() != first.keys.data_ptr()
    first.release()
    third = StaticLM(target, V, 8)
    assert third.static and third.keys.data_ptr() == first.keys.data_ptr() and third.capacity == 16
    del third  # dropped without release: the buffers are free again
    decoder = Decoder(pair[0], pair[1], V, make_shape("sd", draft_len=2), SamplingParams(0.0), set(),
                      runtimes=Runtimes(target, draft, "auto"))
    events = decoder.generate(PROMPT, 50, seed=0)
    next(events)
    assert not StaticLM(target, V, 8).static and not StaticLM(draft, V, 8).static  # in use
    events.close()  # the consumer stopped early
    assert StaticLM(target, V, 8).static and StaticLM(draft, V, 8).static
    tokens = [t for event in decoder.generate(PROMPT, 25, seed=0) for t in event.emitted]
    assert tokens == plain_greedy(pair[0], 25) and StaticLM(target, V, 8).static


class RecordedForward:
    """A stand-in for a captured CUDA graph on the CPU: replay() runs the forward again on the
    tensors it was recorded with and writes the same output buffer. Like a graph, it holds no
    reference to them (only their addresses): one freed meanwhile fails the test, where a real
    graph would read whatever the memory holds by then."""

    def __init__(self, runtime, run):
        recorded = []

        def recording(*args):
            recorded.append([weakref.ref(a) if isinstance(a, torch.Tensor) else a for a in args])
            return CompiledModel.forward(runtime, *args)

        runtime.forward = recording  # run() calls it once
        try:
            self.logits = run()
        finally:
            del runtime.forward
        self.runtime, self.recorded, self.replays = runtime, recorded[0], 0

    def replay(self):
        args = [a() if isinstance(a, weakref.ref) else a for a in self.recorded]
        assert all(a is not None for a in args), "a tensor the graph reads was freed"
        self.logits.copy_(CompiledModel.forward(self.runtime, *args))
        self.replays += 1


def recorded_graphs(pair, monkeypatch, notice=lambda message: None) -> tuple:
    """(Runtimes of the pair on static shapes, "graphed" as on a CUDA device, the RecordedForward
    list every capture appends to): the CUDA-graph protocol on the CPU."""
    graphs = []

    def capture(self, run):
        graphs.append(RecordedForward(self, run))
        return graphs[-1].replay, graphs[-1].logits

    monkeypatch.setattr(CompiledModel, "_graph_of", capture)
    target, draft = (CompiledModel(model, False, static_shapes=True, notice=notice) for model in pair)
    target.graphed = draft.graphed = True
    return Runtimes(target, draft, "on"), graphs


def test_graph_replays_feed_their_inputs_and_a_failed_capture_falls_back(pair, monkeypatch):
    """The replay protocol on the CPU, with recorded forwards for graphs: each call copies its
    inputs into the graph's buffers, every tensor a graph reads outlives it, every token count
    gets its own graph, outputs are copies (a later replay does not change them), and the output
    is plain greedy. A capture that fails says so once and leaves the model on static shapes
    without graphs, with the same output."""
    notices = []
    runtimes, graphs = recorded_graphs(pair, monkeypatch, notices.append)
    target, draft = runtimes.target, runtimes.draft
    assert run(pair, runtimes, make_shape("rsd-c", branching=(2, 2)), SamplingParams(0.0), 25, 0) == \
        plain_greedy(pair[0], 25)
    # the target: the prompt's first two tokens (2), then trees of 1 + 2 + 4 nodes (padded to 8)
    assert {key[0] for key in target._captured} == {2, 8}
    assert len(graphs) == len(target._captured) + len(draft._captured) and not notices
    assert all(graph.replays >= 1 for graph in graphs)  # every call replayed, none ran on its own

    def one_token(token: int) -> torch.Tensor:
        ids = torch.tensor([[token]] * 3)  # (the token, its position and its slot)
        return target.replay(ids, torch.zeros(1, target._buffers[0].shape[2]), *target._buffers)

    first = one_token(1)
    second = one_token(2)
    assert not torch.equal(first, second) and torch.equal(second, graphs[-1].logits)  # outputs are copies

    def broken(self, *args):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(CompiledModel, "_capture", broken)
    runtimes, _ = recorded_graphs(pair, monkeypatch, notices.append)
    target, draft = runtimes.target, runtimes.draft
    assert run(pair, runtimes, make_shape("rsd-c", branching=(2, 2)), SamplingParams(0.0), 25, 0) == \
        plain_greedy(pair[0], 25)
    assert not target.graphed and not draft.graphed and target._buffers is not None  # static shapes, no graphs
    assert notices == ["capturing a CUDA graph failed (RuntimeError: operation not permitted when stream is "
                       "capturing): the static-cache runtime runs without graphs"] * 2


@CUDA
def test_cuda_graphs_replay_transformers_logits_and_greedy_tokens(pair):
    import copy

    models = tuple(copy.deepcopy(model).cuda() for model in pair)
    runtimes = Runtimes(CompiledModel(models[0], True), CompiledModel(models[1], True), "on")
    assert runtimes.target.graphed and runtimes.describe() == "static cache, compiled, CUDA graphs"
    ours, reference = StaticLM(runtimes.target, V, capacity=32), CachedLM(models[0], V)
    assert_same_tree_logits(ours, reference)
    assert ours.static and runtimes.target._captured  # the tree ran as a replayed graph
    assert 0 < ours.forward_seconds < 60 and 0 < reference.forward_seconds < 60  # CUDA events, read back
    ours.release()
    for shape in shapes():
        assert run(models, runtimes, shape, SamplingParams(temperature=0), 25, seed=0) == \
            run(models, None, shape, SamplingParams(temperature=0), 25, seed=0), shape.describe()


@CUDA
@pytest.mark.parametrize("shape", DEVICE_SHAPES + [DEVICE_LOOKUP], ids=lambda s: s.describe())
def test_step_maths_replayed_as_cuda_graphs_decide_as_launched_op_by_op(pair, shape):
    """On a GPU with compiled forwards a device step's maths is captured as CUDA graphs (StepGraphs)
    and replayed: every step's tokens, p and q equal those of the same maths launched op by op,
    read after the whole generation."""
    import copy

    from rsd_cli.step_graphs import StepGraphs

    models = tuple(copy.deepcopy(model).cuda() for model in pair)
    runtimes = Runtimes(CompiledModel(models[0], True), CompiledModel(models[1], True), "on")
    events = {}
    for graphed in (True, False):
        decoder = Decoder(*models, V, shape, SamplingParams(1.0), set(), runtimes=runtimes)
        if not graphed:
            decoder.step_graphs = StepGraphs(torch.device("cuda"), False)
        events[graphed] = list(decoder.generate(PROMPT, 30, seed=2))
        if graphed:
            assert decoder.step_graphs.enabled and decoder.step_graphs._graphs
    assert [e.emitted for e in events[True]] == [e.emitted for e in events[False]]
    for a, b in zip(events[True], events[False]):
        assert torch.equal(a.p, b.p) and all(torch.equal(a.tree.q[n], b.tree.q[n]) for n in a.tree.q)


@CUDA
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_ar_queued_ahead_on_a_gpu_gives_the_tokens_of_one_step_at_a_time(pair, temperature):
    """On a GPU `ar` queues each step from the token before it, read later from page-locked memory
    (Decoder._plain_steps_ahead): the tokens and p of one step at a time, with an end-of-sequence
    token ending some answers early, and kept caches that hold what they say."""
    import copy

    models = tuple(copy.deepcopy(model).cuda() for model in pair)
    runtimes = Runtimes(CompiledModel(models[0], True), CompiledModel(models[1], True), "on")
    for seed in range(4):
        events, kept = {}, {}
        for ahead in (True, False):
            decoder = Decoder(*models, V, make_shape("ar"), SamplingParams(temperature), {0}, runtimes=runtimes)
            decoder.steps_ahead, decoder.keep_caches = ahead, True
            events[ahead] = list(decoder.generate(PROMPT, 30, seed=seed))
            kept[ahead] = decoder.kept
            assert kept[ahead].target.length == len(kept[ahead].tokens)
            kept[ahead].release()
        assert [e.emitted for e in events[True]] == [e.emitted for e in events[False]]
        assert all(torch.equal(a.p, b.p) for a, b in zip(events[True], events[False]))
        assert kept[True].tokens == kept[False].tokens


@CUDA
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_trees_queued_ahead_on_a_gpu_give_the_tokens_of_one_step_at_a_time(pair, temperature, monkeypatch):
    """On a GPU `sd` chains and `rsd-c` fans of root children queue each step before the last one's
    outcome is read, its inputs made on the device (Decoder._tree_steps_ahead): the tokens and p of
    one step at a time, with an end-of-sequence token ending some answers early, and kept caches
    that hold what they say."""
    import copy

    placed = []
    real = StaticLM.forward_placed
    monkeypatch.setattr(StaticLM, "forward_placed", lambda self, *a: placed.append(1) or real(self, *a))
    models = tuple(copy.deepcopy(model).cuda() for model in pair)
    runtimes = Runtimes(CompiledModel(models[0], True), CompiledModel(models[1], True), "on")
    for seed, shape in enumerate([make_shape("rsd-c", branching=(k,)) for k in (1, 3, 5)] +
                                 [make_shape("sd", draft_len=gamma) for gamma in (1, 3)]):
        events, kept = {}, {}
        for ahead in (True, False):
            decoder = Decoder(*models, V, shape, SamplingParams(temperature), {0}, runtimes=runtimes)
            decoder.steps_ahead, decoder.keep_caches = ahead, True
            placed.clear()
            events[ahead] = list(decoder.generate(PROMPT, 30, seed=seed))
            assert bool(placed) == ahead
            kept[ahead] = decoder.kept
            assert kept[ahead].target.length == len(kept[ahead].tokens)
            kept[ahead].release()
        assert [e.emitted for e in events[True]] == [e.emitted for e in events[False]], shape.describe()
        assert all(torch.allclose(a.p, b.p, atol=1e-4) for a, b in zip(events[True], events[False]))
        assert kept[True].tokens == kept[False].tokens


@CUDA
def test_auto_queued_ahead_on_a_gpu_gives_the_events_of_one_step_at_a_time(pair):
    """On a GPU `auto` queues its plain steps ahead (Decoder._plain_steps_ahead): with the same shapes
    step after step (a scripted policy), the tokens and p of one step at a time."""
    import copy

    from test_auto import SCRIPT, Scripted

    models = tuple(copy.deepcopy(model).cuda() for model in pair)
    runtimes = Runtimes(CompiledModel(models[0], True), CompiledModel(models[1], True), "on")
    for seed in range(3):
        events = {}
        for ahead in (True, False):
            decoder = Decoder(*models, V, make_shape("auto"), SamplingParams(1.0), {0}, runtimes=runtimes)
            decoder.policy, decoder.steps_ahead = Scripted(SCRIPT), ahead
            events[ahead] = list(decoder.generate(PROMPT, 24, seed=seed))
        assert [e.emitted for e in events[True]] == [e.emitted for e in events[False]]
        assert all(torch.allclose(a.p, b.p, atol=1e-4) for a, b in zip(events[True], events[False]))


@CUDA
def test_a_logit_bias_in_step_maths_replayed_as_cuda_graphs_decides_as_launched_op_by_op(pair):
    """A logit bias (one vector made once on the device) inside the step maths a GPU captures as CUDA
    graphs: `ar` queued ahead, `sd` and `rsd-c` fans queued ahead or not, the tokens and p of the same
    maths launched op by op, and never the token biased to -inf."""
    import copy

    from rsd_cli.step_graphs import StepGraphs

    biased = SamplingParams(1.0, logit_bias=((0, -math.inf), (3, 1.5)))
    models = tuple(copy.deepcopy(model).cuda() for model in pair)
    runtimes = Runtimes(CompiledModel(models[0], True), CompiledModel(models[1], True), "on")
    for seed, shape in enumerate([make_shape("ar"), make_shape("sd", draft_len=2), make_shape("rsd-c", branching=(3,))]):
        events = {}
        for graphed in (True, False):
            decoder = Decoder(*models, V, shape, biased, set(), runtimes=runtimes)
            if not graphed:
                decoder.step_graphs = StepGraphs(torch.device("cuda"), False)
            events[graphed] = list(decoder.generate(PROMPT, 30, seed=seed))
        assert [e.emitted for e in events[True]] == [e.emitted for e in events[False]], shape.describe()
        assert all(torch.equal(a.p, b.p) for a, b in zip(events[True], events[False]))
        assert 0 not in [t for e in events[True] for t in e.emitted]


@CUDA
@pytest.mark.parametrize("kind", ["mistral", "gemma3", "gemma2", "phi3", "exaone4", "cohere2", "mixtral", "starcoder2",
                                  "gpt_oss", "gemma4", "gemma4-moe", "gemma3n"])
def test_a_windowed_model_runs_in_cuda_graphs_past_its_window(kind):
    """Mistral-like, every layer seeing the last 8 positions, Gemma 3-like, the first layer only (a
    mask for each layer kind), Gemma 2-like, every other layer seeing 4 (and rsd's own attention,
    its scores soft-capped), Phi-3-like, every layer seeing 4 (its fused linears the stacks a GPU
    multiplies by), EXAONE 4-like, the first layer seeing 4 and the next without a rotation, or Cohere
    2-like (EXAONE 4's layer kinds, attention and MLP side by side, adjacent pairs turned), or
    Mixtral-like (every layer seeing 4, MLPs of experts: routed on the device, no size depending on
    the routing) or StarCoder2-like (every layer seeing 4, LayerNorms, an MLP without a gate, its
    biases) or gpt-oss-like (every other layer seeing 4, attention sinks, experts with biases), in
    compiled CUDA graphs (masks over the whole capacity, windowed on the host), or Gemma 4-like (every
    other layer seeing 4, caches of two shapes, the last two layers reading the first two's; or experts
    beside each MLP), or Gemma 3n-like (Gemma 4's caches of one shape, four streams, a learned residual,
    the first layer's gate cut off): every variant's greedy tokens are the target's, 30 tokens past the
    window."""
    import copy

    from test_engine import FAN, LONG_PROMPT, every_layer_windowed
    from tiny import tiny_windowed

    if kind == "mistral":
        target, draft = every_layer_windowed(kind), every_layer_windowed(kind, layers=1, seed=1)
    elif kind == "gemma3":
        target, draft = tiny_windowed(kind, V), tiny_windowed(kind, V, layers=1, seed=1)
    else:
        target, draft = tiny_relative(kind, V, layers={"gemma4": 4, "gemma4-moe": 3, "gemma3n": 4}.get(kind, 2)), \
            tiny_relative(kind, V, layers=1, seed=1)
    expected = plain_greedy(target, 30, LONG_PROMPT)
    models = tuple(copy.deepcopy(model).cuda() for model in (target, draft))
    runtimes = Runtimes(CompiledModel(models[0], True), CompiledModel(models[1], True), "on")
    assert runtimes.target.graphed and runtimes.target.window == (8 if kind in ("mistral", "gemma3") else 4)
    assert (runtimes.target.by_kind is None) == (kind in ("mistral", "phi3", "mixtral", "starcoder2"))
    for shape in shapes() + [FAN]:
        decoder = Decoder(*models, V, shape, SamplingParams(temperature=0), set(), runtimes=runtimes)
        tokens = [t for event in decoder.generate(LONG_PROMPT, 30, seed=0) for t in event.emitted]
        assert tokens == expected, shape.describe()


@CUDA
@pytest.mark.parametrize("kind", ["minicpm3", "youtu", "deepseek_v2", "deepseek_v3", "glm4_moe_lite"])
def test_latent_attention_runs_in_cuda_graphs(kind):
    """MiniCPM3-, Youtu-, DeepSeek V2- and V3- and GLM-4.7-Flash-like models (latent attention: the
    latents and rotated key parts cached, expanded on the device every forward; the mixtures' experts
    chosen within groups on the device) in compiled CUDA graphs: every variant's greedy tokens are
    the target's."""
    runtimes = assert_greedy_in_cuda_graphs(tiny_relative(kind, V, layers=2), tiny_relative(kind, V, layers=1, seed=1))
    assert runtimes.target.cache_shapes[0] == (1, 16, 4)


def assert_greedy_in_cuda_graphs(target, draft) -> Runtimes:
    """Both models on a CUDA device in compiled CUDA graphs: every variant's greedy tokens (and a fan's)
    are the target's, 30 tokens after LONG_PROMPT. Returns the runtimes."""
    import copy

    from test_engine import FAN, LONG_PROMPT

    expected = plain_greedy(target, 30, LONG_PROMPT)
    models = tuple(copy.deepcopy(model).cuda() for model in (target, draft))
    runtimes = Runtimes(CompiledModel(models[0], True), CompiledModel(models[1], True), "on")
    assert runtimes.target.graphed
    for shape in shapes() + [FAN]:
        decoder = Decoder(*models, V, shape, SamplingParams(temperature=0), set(), runtimes=runtimes)
        tokens = [t for event in decoder.generate(LONG_PROMPT, 30, seed=0) for t in event.emitted]
        assert tokens == expected, shape.describe()
    return runtimes


@CUDA
@pytest.mark.parametrize("kind", ["gptj", "falcon", "falcon-7b", "bloom", "mpt", "falcon-rw", "gpt_neo", "llama4",
                                  "lfm2", "lfm2_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next", "granite4",
                                  "granite4-dense", "nemotron_h", "bamba", "mamba2"])
def test_gptj_falcon_and_models_biased_by_slot_run_in_cuda_graphs(kind):
    """GPT-J-, Falcon- (40B's and 7B's layouts), and with trees BLOOM-, MPT-, Falcon-RW- (ALiBi: a mask
    for each head, its biases by the slots' positions made on the host), GPT-Neo- (local layers
    windowed to 4 positions), Llama 4-like models (chunks of 4, q scaled by position, experts
    reading the token times their weight) and LFM2-like ones (short convolutions, each row's taps
    found in its mask on the device: what steps queued ahead need; LFM2-MoE's experts) and Qwen3.5-like
    ones (gated delta nets read along each row's path, a triangular solve; Qwen3-Next's products fused) and
    Granite 4-like ones (Mamba-2 mixers read along each row's path) in compiled CUDA graphs: every
    variant's greedy tokens are the target's, 30 tokens past GPT-Neo's window and Llama 4's first
    chunks."""
    assert_greedy_in_cuda_graphs(tiny_relative(kind, V, layers=2), tiny_relative(kind, V, layers=1, seed=1))


@pytest.mark.parametrize("kind", ["llama", "gemma3", "bloom", "phi3-longrope", "qwen3_5", "granite4"])
def test_a_long_prompt_is_read_in_pieces_with_the_keys_and_logits_of_one_forward(monkeypatch, kind):
    """A prompt whose one forward would mask more than PROMPT_MASK_SCORES scores is read in pieces of
    rows (here 4, made small), each a forward seeing the cache and itself causally: the last row's logits
    and every chain after it are one forward's (to float sums in another order) on every backend — a
    Llama, a Gemma 3 (a window of 4 on its first layer: masks by layer kind and position), a BLOOM
    (ALiBi: each head's biases by position) and a Phi-3 turned by `longrope` factors (the prompt astride
    their start at 16: every piece turned by the long ones, as one forward turns it) alike, and a Qwen3.5
    and a Granite 4.0-H, whose delta nets and mixers read a long chain by chunks (CHAIN_ROWS made small:
    chunks of 2) from the state its keys before add up to: its pieces so, and its one forward each row
    along its path (CHAIN_ROWS past it), the same logits. A chain that is no prompt (a step) is one
    forward whatever its length."""
    from test_engine import LONG_PROMPT
    from tiny import tiny_windowed

    target = tiny_model(V, layers=2, scale=0.3) if kind == "llama" else \
        tiny_windowed("gemma3", V) if kind == "gemma3" else tiny_relative(kind, V, layers=2)
    prompt = LONG_PROMPT * 2  # (24 tokens: 6 pieces of 4)
    assert len(prompt) > LONG_FACTORS_FROM > 4
    for backend in (CompiledModel(target, True), CompiledModel(target, False),
                    CompiledModel(target, False, static_shapes=True)):
        whole = StaticLM(backend, V, capacity=40)
        monkeypatch.setattr(compiled, "PROMPT_MASK_SCORES", 10 ** 9)
        monkeypatch.setattr(compiled, "CHAIN_ROWS", 10 ** 9)  # (the path's sums: what chunks must give)
        expected = whole.extend(prompt, reading=True)
        assert whole.calls == 1
        monkeypatch.setattr(compiled, "CHAIN_ROWS", 2)
        monkeypatch.setattr(compiled, "PROMPT_MASK_SCORES", 4 * len(prompt))
        monkeypatch.setattr(compiled, "PIECE_ROWS", 1)
        pieces = StaticLM(backend, V, capacity=40)
        # (a delta net's sums over a path by 1e-4 at logits of ~20, as in the tree test)
        tolerance = 3e-4 if kind == "qwen3_5" else 1e-5
        torch.testing.assert_close(pieces.extend(prompt, reading=True), expected, atol=tolerance, rtol=1e-5)
        assert pieces.calls == 6 and pieces.length == len(prompt)
        for chain in ([2], [1, 3], [3, 2] * 4):
            torch.testing.assert_close(pieces.extend(chain), whole.extend(chain), atol=max(tolerance, 3e-5), rtol=1e-5)
        calls = pieces.calls
        pieces.extend(prompt)  # (not a prompt: one forward)
        assert pieces.calls == calls + 1
        whole.release()
        pieces.release()


@pytest.mark.parametrize("kind", ["llama", "gemma3", "bloom", "qwen3_5", "lfm2"])
def test_a_long_chain_on_static_shapes_is_read_in_graphed_pieces(monkeypatch, kind):
    """On static shapes (a GPU's CUDA graphs) a chain that is no prompt and longer than the widest bucket
    (the draft catching up on `auto`'s plain steps) is read in pieces of that bucket, each a static-shape
    forward (a graph's replay there; one forward of all its rows would run off the graphs), the last
    padded to its bucket: every row's logits and the chains after it are one forward's on the dynamic
    runtime — for a Llama, a Gemma 3 (a window of 4 on its first layer), a BLOOM (ALiBi by position), a
    Qwen3.5 (gated delta nets, each piece's rows read along their paths where one forward reads the chain
    by chunks) and an LFM2 (short convolutions). Past GRAPHED_PIECES pieces it is one forward, as before."""
    from tiny import tiny_windowed

    target = tiny_model(V, layers=2, scale=0.3) if kind == "llama" else \
        tiny_windowed("gemma3", V) if kind == "gemma3" else tiny_relative(kind, V, layers=2)
    backend = CompiledModel(target, False, static_shapes=True)
    top = backend.buckets[-1]
    chain = [(7 * i + 3) % V for i in range(2 * top + 22)]  # (150 tokens: pieces of 64, 64 and 22 padded to 32)
    replays = []
    replay = backend.replay
    monkeypatch.setattr(backend, "replay", lambda ids, *rest, **named: replays.append(ids.shape[1]) or
                        replay(ids, *rest, **named))
    pieces, whole = StaticLM(backend, V, capacity=32), StaticLM(CompiledModel(target, False), V, capacity=32)
    tolerance = 3e-4 if kind == "qwen3_5" else 1e-5  # (a delta net's sums over a path, as in the prompt's test)
    for read in (pieces, whole):
        read.extend(PROMPT, reading=True)
    replays.clear()
    torch.testing.assert_close(pieces.extend(chain, last_only=False), whole.extend(chain, last_only=False),
                               atol=tolerance, rtol=1e-5)
    assert replays == [top, top, 32] and pieces.length == whole.length == len(PROMPT) + len(chain)
    torch.testing.assert_close(pieces.extend(chain), whole.extend(chain, last_only=False)[-1:], atol=tolerance,
                               rtol=1e-5)
    assert replays[3:] == [top, top, 32]
    for after in ([2], [1, 3]):
        torch.testing.assert_close(pieces.extend(after), whole.extend(after), atol=tolerance, rtol=1e-5)
    monkeypatch.setattr(compiled, "GRAPHED_PIECES", 2)  # (longer: one forward off the graphs, as before)
    replays.clear()
    torch.testing.assert_close(pieces.extend(chain), whole.extend(chain), atol=tolerance, rtol=1e-5)
    assert replays == []
    pieces.release()
    whole.release()


def test_same_seed_same_tokens_on_every_backend(pair, runtimes):
    """The backends differ only in the order of float additions: sampled runs agree token for token
    on this pair (the test would catch a runtime that draws random numbers differently)."""
    shape = make_shape("rsd-c", branching=(2, 2))
    sampling = SamplingParams(temperature=1.0)
    reference = run(pair, None, shape, sampling, 30, seed=3)
    assert run(pair, runtimes[True], shape, sampling, 30, seed=3) == reference
    assert run(pair, runtimes[False], shape, sampling, 30, seed=3) == reference
    static = Runtimes(CompiledModel(pair[0], False, static_shapes=True), CompiledModel(pair[1], False, static_shapes=True))
    assert run(pair, static, shape, sampling, 30, seed=3) == reference


def skip_a_dynamic_hunyuan(model) -> None:
    """Hunyuan's checkpoints call their rotary base `dynamic` though a fixed NTK alpha sets it: transformers
    5.24 names it `ntk_alpha` (angles by position alone: the runtime's), where 5.17 recomputed them
    past the model's context as `dynamic` scaling does (left to transformers' forward, as refused)."""
    if getattr(getattr(compiled.decoder_of(model)[0], "rotary_emb", None), "rope_type", None) == "dynamic":
        assert compiled.unsupported(model) == "rope type 'dynamic'"
        pytest.skip("this transformers scales Hunyuan's angles by the sequence's length")


@pytest.mark.parametrize("kind", ["qwen2", "mistral", "qwen3", "gemma", "gemma2", "gemma3", "smollm3", "granite",
                                  "olmo2", "olmo3", "seed_oss", "phi3", "exaone4", "ernie4_5", "hunyuan",
                                  "glm4", "cohere2", "cohere", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
                                  "granitemoe", "granitemoeshared", "starcoder2", "stablelm", "nemotron", "arcee", "phi",
                                  "gpt_neox", "gpt_oss", "apertus", "opt", "gpt2", "gpt_bigcode", "gpt_bigcode-mha",
                                  "ernie4_5_moe", "phimoe", "minicpm3", "youtu", "deepseek_v2", "deepseek_v3",
                                  "glm4_moe_lite", "gptj", "falcon", "falcon-7b", "falcon-sequential"])
def test_other_llama_style_families_run_on_the_static_cache_runtime(kind):
    """Qwen2 (q, k and v with biases), Mistral, Qwen3 (q and k normed per head), Gemma (norms by 1 +
    weight, GELU), Gemma 2 (norms after attention and MLP, soft-capped attention scores and logits,
    a window on every other layer), Gemma 3 (q and k normed, a window and a rotary table by layer
    kind), SmolLM3 (layers without a rotation), Granite (the embedding, blocks' outputs and logits
    scaled), OLMo 2 and 3 (norms after the blocks only, q and k normed whole; OLMo 3 windowed by
    layer kind), Seed-OSS (Qwen2's biases), Phi-3 (q, k and v one linear, gate and up one, a window on
    every layer), EXAONE 4 (OLMo 2's norms, q and k normed per head, full-attention layers without a
    rotation beside windowed ones), ERNIE 4.5 (q and k turned by adjacent pairs of dimensions), Hunyuan
    (each head of q and k normed after the rotation, a rotary base scaled by a fixed NTK alpha) and
    GLM-4 (Qwen2's biases, gate and up one linear, Gemma 2's four norms, half of each head turned by
    adjacent pairs), Cohere 2 (LayerNorms without a bias, attention and MLP side by side, windowed
    layers turned by adjacent pairs and the others not at all, scaled logits) and Cohere (Command R:
    every layer turned, in float32), and mixtures of experts: Mixtral (Mistral's layers, windowed,
    routing weights renormalised and kept in float32), Qwen2-MoE (a shared expert, a plain MLP in the
    second layer), Qwen3-MoE (3 of 8 experts a token), OLMoE and GraniteMoE (Granite's scalings, the
    routing weights a softmax of the top router logits; with a shared expert without a gate too), and
    LayerNorms with biases or MLPs without a gate: StarCoder2 (both, biases on every linear, a
    window), StableLM (LayerNorms, a quarter of each head turned), Nemotron (LayerNorms by 1 +
    weight, squared ReLUs without a gate), Arcee (Llama's layers, Nemotron's MLP) and Phi (attention
    and an MLP without a gate side by side on one LayerNorm, biases on every linear and the head),
    GPT-NeoX (q, k and v one linear head by head, attention and the MLP side by side on two norms), and
    gpt-oss (attention sinks, biases on every linear, a window on every other layer, YaRN angles each
    given once for both halves of a head, experts transposed with their gate and up interleaved, biased
    and clamped, routed by a softmax of the top router logits, the router biased too), Apertus (its
    norms named otherwise, q and k normed per head, an MLP without a gate of xIELUs, each layer's
    constants its own), OPT (learned position embeddings from row 2 instead of a rotation,
    LayerNorms, biases on every linear, ReLUs without a gate, q scaled before its product), GPT-2
    (Conv1D linears read as views, q, k and v one, learned positions, LayerNorms named `ln_*`) and
    GPT-BigCode (StarCoder 1, SantaCoder: GPT-2's layout on linears, one key head, q's rows then k's
    then v's; or without multi-query, q, k and v head by head), and the mixtures of ERNIE 4.5 (experts
    chosen with a correction of their scores, weighted without it, a shared expert) and Phi-3.5-MoE
    (LayerNorms, biases, its sparse mixer), and multi-head latent attention: MiniCPM3 (q through a
    rank of its own, normed; the embedding, blocks' outputs and logits scaled), Youtu (q one
    product, the rotated part turned by adjacent pairs), and DeepSeek V3 and GLM-4.7-Flash (latent
    attention; a plain MLP in the first layer, then experts chosen by sigmoid scores plus a random
    correction within the best groups, weighted by the scores times a factor, a shared expert) and
    DeepSeek V2 (its rotated parts turned as complex numbers; experts by softmax scores within the
    group of the best one, times a factor), and GPT-J (Phi's layers, each head's first dimensions
    turned by adjacent pairs, its angles given sin first and once a pair) and Falcon (q, k and v one
    linear by groups of heads: 40B's layout, 7B's multi-query one, Falcon-RW's head by head; two norms
    side by side, one, or attention then the MLP):
    tree logits, pruning and growth as
    transformers' forward gives them on every
    backend, and each variant's greedy output is plain greedy."""
    target, draft = tiny_relative(kind, V, layers=2, seed=0), tiny_relative(kind, V, layers=1, seed=1)
    skip_a_dynamic_hunyuan(target)
    # (Nemotron's logits reach ~30, where float32 sums in another order differ by ~1.5e-5; GLM-4.7-Flash's
    # latents, expanded and routed, by as much)
    assert_the_runtime_decodes_as_transformers(target, draft, 3e-5 if kind in ("nemotron", "glm4_moe_lite") else 1e-5)


# torch's CPU attention in bfloat16 adds a row's keys in vectors of 16 floats on AVX-512 and of 8 on AVX2: with
# AVX-512 the tiny prompts' 11 keys (transformers' forward) and a static cache's 12-16 (rsd's, the rest masked)
# fit one vector alike and give the same sums to the bit; with AVX2 they are added in other groupings (a row of
# 11 keys and the same keys padded to 16: 35 of 200 random rows apart), a bfloat16 step or a few apart in the
# logits after 3 layers (3.4 at most on an AVX2 AMD EPYC, where the bit-exact check failed 8 models of 14)
SAME_BFLOAT16_ATTENTION = torch.backends.cpu.get_cpu_capability() != "AVX2"


def bfloat16_steps(ours: torch.Tensor, expected: torch.Tensor, largest: float) -> float:
    """The largest difference between two tensors of logits, in bfloat16 steps at the `largest` logit's
    magnitude (8 bits of precision: 1/16 from 8 to 16)."""
    return (ours - expected).abs().max().item() / 2.0 ** (math.floor(math.log2(largest)) - 7)


def transformers_last(model, prompt: list[int], path: list[int], token_by_token: bool = False) -> torch.Tensor:
    """transformers' logits (1, V) of the path's last token after the prompt: its forward of them all, or
    (`token_by_token`) the prompt's, then each token of the path in a forward of its own, as its generate
    reads them (where its logits depend on how the tokens are split into forwards: MPT's position bias)."""
    if not token_by_token:
        return CachedLM(model, V).extend(prompt + path)
    cache = CachedLM(model, V)
    cache.extend(prompt)
    return [cache.extend([token]) for token in path][-1]


@pytest.mark.parametrize("kind", ["qwen3", "gemma3", "olmo2", "gpt_neox", "phi", "cohere2", "granite4", "mamba2",
                                  "falcon", "falcon-7b", "bloom", "mpt", "gpt_neo", "deepseek_v2"])
def test_in_bfloat16_the_runtime_gives_transformers_logits(monkeypatch, kind):
    """A GPU's default dtype is bfloat16: there a prompt's and a tree's rows on the uncompiled runtime are
    what transformers' forward gives (each row's path read as a chain) to the bit, on this CPU, each product
    in torch's kernel, on dynamic and on static shapes (a GPU's). Mamba-2 keeps its residual stream in
    float32 (`residual_in_fp32`; kept in bfloat16, its logits a bfloat16 step off); OLMo 2's rotary tables
    are float32, q and k turned in float32 and cast back (else q stayed float32 and attention refused its
    bfloat16 keys); GPT-NeoX's and Phi's attention and MLP, side by side, are added together before the
    residual (added to it in turn, a bfloat16 step off);
    Cohere 2 turns q and k in float32, as Cohere does (in bfloat16, a bfloat16 step off). Falcon's linears add
    their bias to the rounded product; Falcon-7B's one key head is broadcast to torch's attention, whose kernel
    for that shape rounds otherwise than its grouped one; BLOOM's, MPT's and GPT-Neo's attention is their own
    code's (scores rounded, or kept in float32, a softmax in float32 cast back, then the product with v; torch's
    kernel keeps it all in float32); DeepSeek V2 weights its experts' outputs by float32 routing weights (each
    one a bfloat16 step off or more without). MPT's bias is a key's position less the last key's in the forward,
    so transformers' logits depend on how its tokens are split into forwards: a tree's rows are what its
    generate gives, the prompt read in one forward and each token of the path after it in one of its own.
    Compiled graphs round each result to bfloat16 as the uncompiled layers do (inductor's
    `emulate_precision_casts`), which leaves their fused float32 arithmetic 0-2.1 bfloat16 steps at the largest
    logit from transformers' (2.9 for Granite 4 on transformers 5.17; without it 2.5-8.4 steps: 0.09-0.42 in
    logits up to 16). On an AVX2 CPU, whose attention sums depend on how many keys a forward holds
    (SAME_BFLOAT16_ATTENTION), the uncompiled rows are held to the compiled graphs' bound."""
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "torch")  # (transformers' product: oneDNN's rounds otherwise)
    model = tiny_relative(kind, V, layers=3, seed=0).to(torch.bfloat16)
    tree = a_tree()
    base = len(PROMPT)
    visible = torch.cat([torch.ones(len(tree), base, dtype=torch.bool), tree.ancestry()], dim=1)
    paths = [[token for token, seen in zip(tree.tokens, row) if seen] for row in tree.ancestry().tolist()]
    expected = torch.cat([transformers_last(model, PROMPT, path, token_by_token=kind == "mpt") for path in paths])
    read = CachedLM(model, V).extend(PROMPT)
    # (static shapes: what a GPU's graphs run, a mask over the whole buffer, rows padded to a bucket)
    for backend in (CompiledModel(model, False), CompiledModel(model, False, static_shapes=True),
                    CompiledModel(model, True)):
        ours = StaticLM(backend, V, capacity=12)
        prompt = ours.extend(PROMPT, reading=True)
        logits = ours.forward(tree.tokens, [base + d for d in tree.depths], visible)
        ours.release()
        if not backend.compiled and SAME_BFLOAT16_ATTENTION:
            assert torch.equal(prompt, read) and torch.equal(logits, expected), (logits - expected).abs().max()
        else:
            if backend.compiled:
                assert 8 in backend.graphs  # (the tree's 7 rows in the compiled graph of 8)
            largest = max(read.abs().max().item(), expected.abs().max().item())
            steps = bfloat16_steps(prompt, read, largest), bfloat16_steps(logits, expected, largest)
            assert max(steps) < 3.5, steps


@pytest.mark.parametrize("kind", ["bloom", "mpt", "falcon-rw", "gpt_neo",
                                  pytest.param("llama4", marks=LLAMA4_AFTER_OTHERS), "lfm2", "lfm2_moe", "qwen3_5",
                                  "qwen3_5_moe", "qwen3_next", "granite4", "granite4-dense", "nemotron_h",
                                  "bamba", "mamba2"])
def test_models_biased_or_windowed_by_slot_in_transformers_take_trees_on_the_static_cache_runtime(kind):
    """BLOOM, MPT and Falcon-RW bias attention by position (ALiBi), GPT-Neo windows its local layers,
    Llama 4 chunks attention and scales q by position on its layers without a rotation, each of which
    transformers' forward works out of cache slots (Llama 4's scale: of the cache's length), and LFM2's
    short convolutions and Qwen3.5's gated delta nets carry a state from token to token (a tree's
    siblings would all be read into it): there rsd gives them chains only. The runtime biases, windows,
    chunks and scales by each slot's position, and convolves each row's inputs and sums its delta
    net's updates along its own path (kept by slot), so a tree's rows are
    what transformers' forward gives each row's path read as a chain, on every backend (BLOOM's and
    MPT's 12 heads: slopes not all powers of 2; GPT-Neo's window of 4: the tree's deepest rows see
    none of the prompt; Llama 4's chunks of 4 and its scale changing every 4 positions; LFM2's 3 taps:
    the deepest rows' reach only their ancestors; LFM2-MoE's experts by sigmoid scores plus a bias; Qwen3.5's
    delta nets of 4 value heads over 2 key heads, attention's output gated; Qwen3.5-MoE's experts beside a
    gated shared expert; Qwen3-Next's delta nets' products fused by key head; Granite 4's Mamba-2 mixers in
    groups, its attention without positions; Nemotron-H's blocks paired, a mixer's with an MLP's, attention
    and a mixer alone; Bamba's mixers beside attention turned by position; Mamba-2's mixers alone, without
    attention); pruned to one path, chains after it too; and every variant's greedy output is plain greedy."""
    # (LFM2's: convolution, attention, convolution; Nemotron-H's blocks: mixer, MLP, attention, mixer)
    layers = 4 if kind == "nemotron_h" else 3 if kind.startswith(("lfm2", "qwen3_", "granite4", "bamba", "mamba2")) \
        else 2
    target, draft = tiny_relative(kind, V, layers=layers, seed=0), tiny_relative(kind, V, layers=1, seed=1)
    assert compiled.unsupported(target) is None
    assert (compiled.alibi_of(target.config) is None) == \
        (kind in ("gpt_neo", "llama4", "nemotron_h", "bamba", "mamba2")
         or kind.startswith(("lfm2", "qwen3_", "granite4")))
    tree = a_tree()
    base = len(PROMPT)
    visible = torch.cat([torch.ones(len(tree), base, dtype=torch.bool), tree.ancestry()], dim=1)
    paths = [[token for token, seen in zip(tree.tokens, row) if seen] for row in tree.ancestry().tolist()]
    expected = torch.cat([CachedLM(target, V).extend(PROMPT + path) for path in paths])
    kept = [0, 1, 3, 5]  # (a path of the tree: its root, a, c and e)
    for backend in (CompiledModel(target, True), CompiledModel(target, False),
                    CompiledModel(target, False, static_shapes=True)):
        if backend.alibi == "bloom" and not backend.compiled:  # (a table of BLOOM's biases shorter than the
            backend.biases = backend.biases[:, :4]  # positions read: made again, longer, as past its context)
        ours = StaticLM(backend, V, capacity=12)
        ours.extend(PROMPT)
        logits = ours.forward(tree.tokens, [base + d for d in tree.depths], visible)
        # (GPT-Neo's scores unscaled, ~3x larger: float32 sums in another order differ by ~3e-5 after its softmax;
        # Qwen3.5's delta nets' sums over a path, against transformers' state, by ~1e-4 at logits of ~20 — as
        # much as transformers' own one token at a time against one forward; with experts, transformers' own
        # forwards of 11 and 13 tokens differ by 4e-4 on their first 11)
        # (transformers 5.17's Bamba, the GPU machine's, 4.4e-5 from the runtime in one logit of 36; 5.24's 2e-7)
        tolerance = {"gpt_neo": 1e-4, "qwen3_5": 3e-4, "qwen3_5_moe": 1e-3, "qwen3_next": 1e-3, "granite4": 3e-5,
                     "granite4-dense": 3e-5, "bamba": 1e-4, "mamba2": 3e-5}.get(kind, 1e-5)
        torch.testing.assert_close(logits, expected, atol=tolerance, rtol=tolerance)
        ours.keep(list(range(base)) + [base + n for n in kept])
        reference = CachedLM(target, V)
        reference.extend(PROMPT + [tree.tokens[n] for n in kept])
        for chain in ([2], [1, 3], [3, 2] * 10):
            torch.testing.assert_close(ours.extend(chain), reference.extend(chain), atol=max(tolerance, 3e-5),
                                       rtol=tolerance)
        ours.release()
    with pytest.raises(RsdError, match="take chains only"):  # (transformers' forward)
        CachedLM(target, V).forward(tree.tokens, [base + d for d in tree.depths],
                                    torch.ones(len(tree), len(tree), dtype=torch.bool).tril())
    runtimes = Runtimes(CompiledModel(target, False), CompiledModel(draft, False), "auto")
    for shape in shapes():
        assert run((target, draft), runtimes, shape, SamplingParams(temperature=0), 20, seed=0) == \
            plain_greedy(target, 20), shape.describe()


@pytest.mark.parametrize("kind", ["qwen3_5", "granite4", "nemotron_h", "bamba", "mamba2"])
def test_stateful_layers_read_the_keys_every_row_saw_as_one_state(monkeypatch, kind):
    """The keys of delta nets and Mamba-2 mixers that every row has seen are summed into one state (here
    once 2 have come, FOLD_ROWS made small), which rows read instead of them: a tree's rows after a
    prompt read that way are still what transformers' forward gives each row's path read as a chain, and
    chains after it (those of 4 or more read by chunks from that state and the keys after it, which
    leave their own last state there: CHAIN_ROWS made small too); keys the state had summed taken back
    start it again from none, and chains then follow transformers' too; every variant's greedy output
    is plain greedy. The states live off static shapes only (CUDA graphs read every key)."""
    monkeypatch.setattr(compiled, "FOLD_ROWS", 2)
    monkeypatch.setattr(compiled, "CHAIN_ROWS", 4)
    target, draft = tiny_relative(kind, V, layers=3, seed=0), tiny_relative(kind, V, layers=1, seed=1)
    tree = a_tree()
    base = len(PROMPT)
    visible = torch.cat([torch.ones(len(tree), base, dtype=torch.bool), tree.ancestry()], dim=1)
    paths = [[token for token, seen in zip(tree.tokens, row) if seen] for row in tree.ancestry().tolist()]
    expected = torch.cat([CachedLM(target, V).extend(PROMPT + path) for path in paths])
    tolerance = 3e-4 if kind == "qwen3_5" else 1e-4 if kind == "bamba" else 3e-5  # (as in the tree test)
    assert any(weights is not None for weights in CompiledModel(target, False).state_weights)  # (a state kept)
    for backend in (CompiledModel(target, True), CompiledModel(target, False),
                    CompiledModel(target, False, static_shapes=True)):
        ours = StaticLM(backend, V, capacity=12)
        assert (ours.states is None) == backend.static_shapes
        ours.extend(PROMPT)
        logits = ours.forward(tree.tokens, [base + d for d in tree.depths], visible)
        assert ours.folded == (0 if backend.static_shapes else base)
        torch.testing.assert_close(logits, expected, atol=tolerance, rtol=tolerance)
        kept = [0, 1, 3, 5]  # (a path of the tree: its root, a, c and e)
        ours.keep(list(range(base)) + [base + n for n in kept])
        reference = CachedLM(target, V)
        reference.extend(PROMPT + [tree.tokens[n] for n in kept])
        # ([3, 2, 3, 2]: no padding rows, read by chunks on every backend; [5] then reads the state it left)
        for chain in ([2], [1, 3], [3, 2] * 2, [5]):
            torch.testing.assert_close(ours.extend(chain), reference.extend(chain), atol=tolerance, rtol=tolerance)
        assert ours.folded == (0 if backend.static_shapes else ours.length - 1)
        ours.keep(list(range(base - 1)))  # (keys the state summed taken back)
        assert ours.folded == 0
        reference = CachedLM(target, V)
        reference.extend(PROMPT[:-1])
        for chain in ([4], [1, 3, 2], [2, 5]):
            torch.testing.assert_close(ours.extend(chain), reference.extend(chain), atol=tolerance, rtol=tolerance)
        ours.release()
    for backend in (CompiledModel(target, True), CompiledModel(target, False)):
        runtimes = Runtimes(backend, CompiledModel(draft, False), "auto")
        for shape in shapes():
            assert run((target, draft), runtimes, shape, SamplingParams(temperature=0), 20, seed=0) == \
                plain_greedy(target, 20), shape.describe()


@pytest.mark.parametrize("kind", ["lfm2", "granite4"])
def test_stateful_layers_compiled_at_load_compile_nothing_more_in_an_answer(monkeypatch, kind):
    """The graphs warm_up compiles for a model of convolutions (LFM2) or one keeping a state (Granite 4's
    mixers: with and without a fold, FOLD_ROWS made small) serve a whole answer of warmed token counts
    after its prompt:
    keys as many as the buffers hold (a guard of its own), states summed and read again, the buffers
    grown — nothing compiles in the middle of it."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(compiled, "FOLD_ROWS", 3)
    runtime = CompiledModel(tiny_relative(kind, V, layers=2, seed=0), True)
    compiled.warm_up(runtime)
    lm = StaticLM(runtime, V, capacity=8)
    lm.extend(PROMPT[:4])  # (a prompt into an empty cache: a graph of its own, before any token)
    graphs = counters["stats"]["unique_graphs"]
    for step in range(24):
        lm.extend([step % 5 + 1] * (1, 2, 4)[step % 3])
    assert lm.folded > 0 if kind == "granite4" else lm.states is None
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("kind", ["lfm2", "qwen3_5", "granite4", "nemotron_h"])
@pytest.mark.parametrize("shape", [MC_SHAPES[4], MC_SHAPES[5]], ids=lambda s: s.describe())
def test_stateful_trees_on_the_runtime_follow_the_target_distribution_and_decode_together(kind, shape):
    """An LFM2 pair (short convolutions), a Qwen3.5 pair (gated delta nets), a Granite 4 pair and a
    Nemotron-H pair (Mamba-2 mixers), whose state
    transformers carries from token to token, on the static-cache runtime: `rsd-c` and `rsd-s` trees
    give the first two tokens the target's joint distribution (rejected siblings leave nothing behind
    in what each row reads: its path's), and sampled completions decoded together (each row reading
    its own prompt and answer) are the ones decoded alone."""
    target, draft = tiny_relative(kind, V, layers=3, seed=0), tiny_relative(kind, V, layers=2, seed=1)
    runtimes = Runtimes(CompiledModel(target, False), CompiledModel(draft, False), "auto")
    sampling = SamplingParams(temperature=1.0)
    counts = sample_pairs((target, draft), shape, sampling, N_SAMPLES, runtimes=runtimes)
    assert chi_square_pvalue(counts, exact_joint(target, sampling) * N_SAMPLES) > 1e-3
    spread = SamplingParams(temperature=3.0)  # (this target's answers at T=1: mostly one of two)
    alone = [run((target, draft), runtimes, make_shape("ar"), spread, 8, seed) for seed in (1, 2, 3)]
    assert len({tuple(tokens) for tokens in alone}) == 3
    decoder = Decoder(target, draft, V, make_shape("ar"), spread, set(), runtimes=runtimes)
    assert together(decoder, 8, [1, 2, 3])[0] == alone


@pytest.mark.parametrize("kind, reason", [("bloom", "ALiBi position biases"),
                                          ("gpt_neo", "local attention windowed by cache slots"),
                                          pytest.param("llama4", "chunked attention scaled by the cache's length",
                                                       marks=LLAMA4_AFTER_OTHERS),
                                          ("lfm2", "recurrent layers"), ("qwen3_5", "recurrent layers"),
                                          ("bamba", "recurrent layers"), ("mamba2", "recurrent layers")])
def test_a_pair_biased_or_windowed_by_slot_takes_trees_on_the_runtime_and_chains_on_transformers_forward(
        tmp_path, kind, reason):
    """As a user runs a BLOOM, GPT-Neo, Llama 4, LFM2, Qwen3.5, Bamba or Mamba-2 pair: `rsd-c` and `rsd-s` on
    the static-cache runtime answer with `ar`'s greedy tokens on transformers' forward, and `rsd bench` measures a tree there; on
    transformers' forward (`--compile off`) a tree is refused in one line, and `auto` chooses among
    chains."""
    from tiny import save_profiled_pair

    pair = save_profiled_pair(tmp_path, tiny_relative(kind, 40, layers=3, seed=0), tiny_relative(kind, 40, 1, seed=1))
    answers = {}
    for variant, setting in (("ar", "off"), ("rsd-c", "on"), ("rsd-s", "auto"), ("auto", "off")):
        result = CliRunner().invoke(app, ["generate", "hello", "-p", str(pair), "-t", "0", "-n", "12", "--ignore-eos",
                                          "--variant", variant, "--compile", setting, "--json"])
        assert result.exit_code == 0, result.stderr
        answers[variant] = json.loads(result.stdout)
    assert answers["rsd-c"]["runtime"] == "static cache, compiled"
    assert all(answer["token_ids"] == answers["ar"]["token_ids"] for answer in answers.values())
    assert len(answers["ar"]["token_ids"]) == 12
    result = CliRunner().invoke(app, ["generate", "hello", "-p", str(pair), "--variant", "rsd-c", "--compile", "off"])
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    model_type = {"llama4": "llama4_text", "qwen3_5": "qwen3_5_text"}.get(kind, kind)
    assert f"rsd-c verifies a tree, which the target's {reason} ({model_type}) cannot take" in result.stderr
    bench = CliRunner().invoke(app, ["bench", "-p", str(pair), "--variants", "ar,rsd-c", "--compile", "off,auto",
                                     "--limit", "1", "-n", "4", "--no-assisted", "--no-hf-static", "--json"])
    assert bench.exit_code == 0, bench.stderr  # (the tree measured where it is taken, refused in its row elsewhere)
    rows = {(row["variant"], row["compile"]): row for row in json.loads(bench.stdout)["results"]}
    assert set(rows) == {("ar", "off"), ("ar", "auto"), ("rsd-c", "auto"), ("rsd-c", "off")}
    assert all(rows[key]["tokens_per_second"] > 0 and not rows[key].get("error")
               for key in (("ar", "off"), ("ar", "auto"), ("rsd-c", "auto")))
    assert rows[("rsd-c", "off")]["tokens_per_second"] is None
    assert rows[("rsd-c", "off")]["error"].startswith("rsd-c verifies a tree, which the target's")
    assert "warning: rsd-c on --compile off failed and has no numbers: rsd-c verifies a tree" in bench.stderr
    if kind == "llama4":  # (its default variants: all where trees are taken, chains where not)
        bench = CliRunner().invoke(app, ["bench", "-p", str(pair), "--compile", "off,auto", "--limit", "1", "-n", "4",
                                         "--no-assisted", "--no-hf-static", "--json"])
        assert bench.exit_code == 0, bench.stderr
        measured = [(row["variant"], row["compile"]) for row in json.loads(bench.stdout)["results"]]
        assert sorted(v for v, c in measured if c == "off") == ["ar", "auto", "lookup", "sd"]
        assert sorted(v for v, c in measured if c == "auto") == sorted(BENCH_VARIANTS.split(","))
        assert f"({model_type}) take no tree on --compile off: measuring ar, sd, lookup, auto there" in bench.stderr


def assert_the_runtime_decodes_as_transformers(target, draft, tolerance: float = 1e-5) -> None:
    """On every backend of the static-cache runtime (compiled, uncompiled, static shapes), a tree's
    logits, the next ones after pruning it and a chain's as transformers' forward gives them, and each
    variant's greedy output plain greedy."""
    assert compiled.unsupported(target) is None
    for backend in (CompiledModel(target, True), CompiledModel(target, False),
                    CompiledModel(target, False, static_shapes=True)):
        ours, reference = StaticLM(backend, V, capacity=12), CachedLM(target, V)
        base = assert_same_tree_logits(ours, reference, tolerance=tolerance)
        for lm in (ours, reference):
            lm.keep(list(range(base)) + [base + n for n in (0, 1, 3, 5)])
        for chain in ([2], [1, 3], [3, 2] * 10):  # (logits up to ~17: float32 sums in another order differ by ~1e-5)
            torch.testing.assert_close(ours.extend(chain), reference.extend(chain), atol=max(tolerance, 3e-5),
                                       rtol=1e-5)
        ours.release()
    runtimes = Runtimes(CompiledModel(target, False), CompiledModel(draft, False), "auto")
    for shape in shapes():
        assert run((target, draft), runtimes, shape, SamplingParams(temperature=0), 20, seed=0) == \
            plain_greedy(target, 20), shape.describe()


@pytest.mark.parametrize("kind, layers, caches", [("gemma4", 2, [0, 1]), ("gemma4", 4, [0, 1, 0, 1]),
                                                   ("gemma4-moe", 3, [0, 1, 2])])
def test_gemma4_runs_on_the_static_cache_runtime(kind, layers, caches):
    """Gemma 4: windowed and full-attention layers in turn, the full ones' heads twice as wide with one
    key head (caches of two shapes: LayerCaches) whose values are their keys' product, v normed without
    a weight, a quarter of each full head turned (`proportional`), each layer's per-layer input added
    after its MLP and its output scaled; with 4 layers the last two computing no keys of their own but
    reading the first two's caches, their MLPs twice as wide; and 26B-A4B's kind, a mixture of experts
    beside each MLP (its router's and each expert's scales random): tree logits, pruning and growth as
    transformers' forward gives them on every backend, each variant's greedy output plain greedy."""
    target, draft = tiny_relative(kind, V, layers=layers, seed=0), tiny_relative(kind, V, layers=1, seed=1)
    runtime = CompiledModel(target, False)
    assert runtime.cache_of == caches  # ((kv_heads, keys' width, values' width): windowed layers', then full ones')
    assert runtime.cache_shapes == [(2, 8, 8), (1, 16, 16), (1, 16, 16)][:len(set(caches))]
    assert [type(buffers).__name__ for buffers in runtime.new_buffers(4)] == ["LayerCaches"] * 2
    # (each layer's float32 sums in another order than transformers' through 4 layers of norms: ~5e-5)
    assert_the_runtime_decodes_as_transformers(target, draft, 1e-4)


@pytest.mark.parametrize("layers, caches", [(1, [0]), (4, [0, 1, 0, 1])])
def test_gemma3n_runs_on_the_static_cache_runtime(layers, caches):
    """Gemma 3n (E2B, E4B): four streams through the layers (AltUp: each predicted from all by
    coefficients routed off the active one, the layer run on the active prediction, every stream
    corrected by what it changed, the per-layer input added to the other three), made of the embedded
    tokens' projections and merged after the last layer; a learned residual of rank 4 beside
    attention; the first layer's MLP gate keeping its largest 5% only; v normed without a weight;
    windowed and full-attention layers in turn, the last two of 4 reading the first two's caches: tree
    logits, pruning and growth as transformers' forward gives them on every backend, each variant's
    greedy output plain greedy. Each part matters: the logits of a forward without the corrected
    scale, the learned residual or the gate's cut-off are off by far more than the tolerance."""
    target, draft = tiny_relative("gemma3n", V, layers=layers, seed=0), tiny_relative("gemma3n", V, layers=1, seed=1)
    runtime = CompiledModel(target, False)
    assert runtime.cache_of == caches and len(runtime.altup[0]) == 3
    tokens = torch.tensor([1, 5, 2, 3, 4, 2])
    with torch.no_grad():
        expected = target(tokens[None]).logits[0]

    def logits(weights) -> torch.Tensor:
        runtime.layers[0] = (weights, *runtime.layers[0][1:])
        return StaticLM(runtime, V, capacity=12).forward(tokens.tolist(), list(range(6)),
                                                         torch.ones(6, 6, dtype=torch.bool).tril())

    whole = runtime.layers[0][0]
    torch.testing.assert_close(logits(whole), expected, atol=1e-5, rtol=1e-5)
    altup = whole.altup
    for part in (dict(laurel=None), dict(sparsity=None), dict(altup=(*altup[:5], None, altup[6]))):
        assert (logits(whole._replace(**part)) - expected).abs().max() > 0.01, part
    assert_the_runtime_decodes_as_transformers(target, draft, 1e-4)


def test_gemma4s_multimodal_model_runs_its_text_decoder_on_the_static_cache_runtime():
    """A Gemma 4 as published (its multimodal model; images' tokens seeing each other, text's causal),
    read for its text on every backend as transformers' forward gives it, every variant's greedy
    output plain greedy."""
    from tiny import tiny_gemma4_multimodal

    target = tiny_gemma4_multimodal(V)
    assert type(compiled.decoder_of(target)[0]).__name__ == "Gemma4TextModel"
    assert_the_runtime_decodes_as_transformers(target, tiny_relative("gemma4", V, layers=1, seed=1), 1e-4)


# float32 sums of terms up to ~150 (below): another summation order moves an entry near 0 by a few of the large
# terms' ulps (2.3e-5 on a 2-core Intel Xeon, where atol=1e-5 failed); a wrong expert or weight moves it by O(1)
SUMS_OF_HUNDREDS = dict(rtol=1e-5, atol=1e-4)


def test_each_way_of_running_routed_experts_gives_each_tokens_weighted_experts(monkeypatch):
    """The four ways the runtime runs a mixture's experts — torch's grouped product, each chosen
    expert once, each token's experts' weights gathered, every expert on every token weighted by 0
    where not chosen — give each token the sum of its chosen experts' gated MLPs times their
    weights, 1 to 16 tokens, float32 and float64 routing weights alike, and gpt-oss's experts (biases,
    gate and up interleaved and clamped) too; routed_experts takes the
    grouped product where it runs, else each chosen expert (not capturing a CUDA graph), and from
    then on where the grouped product refuses shapes its probe passed."""
    torch.manual_seed(0)
    count, hidden, inner, k = 6, 16, 8, 2
    gate_up, down = torch.randn(count, 2 * inner, hidden), torch.randn(count, hidden, inner)
    ways = [compiled._each_chosen_expert, compiled._gathered_experts, compiled._every_expert]
    if hasattr(torch, "_grouped_mm"):
        ways.append(compiled._grouped_experts)
    for n in (1, 3, 16):
        h = torch.randn(n, hidden)
        weights, chosen = torch.rand(n, count).topk(k, dim=-1)
        expected = torch.zeros(n, hidden)
        for token in range(n):
            for slot in range(k):
                expert = int(chosen[token, slot])
                gate, up = (gate_up[expert] @ h[token]).chunk(2)
                expected[token] += weights[token, slot] * (down[expert] @ (torch.nn.functional.silu(gate) * up))
        for way in ways:
            torch.testing.assert_close(way(h, chosen, weights, gate_up, down, "silu"), expected, **SUMS_OF_HUNDREDS)
            doubles = way(h, chosen, weights.double(), gate_up, down, "silu")
            assert doubles.dtype == torch.float64, way.__name__
        # gpt-oss's experts: biased products, gate and up interleaved, both clamped, the up offset by 1
        gate_up_bias, down_bias = torch.randn(count, 2 * inner), torch.randn(count, hidden)
        expected = torch.zeros(n, hidden)
        for token in range(n):
            for slot in range(k):
                expert = int(chosen[token, slot])
                both = gate_up[expert] @ h[token] + gate_up_bias[expert]
                gate, up = both[0::2].clamp(max=1.5), both[1::2].clamp(-1.5, 1.5)
                glu = (up + 1) * gate * torch.sigmoid(gate * 1.702)
                expected[token] += weights[token, slot] * (down[expert] @ glu + down_bias[expert])
        for way in ways:
            torch.testing.assert_close(way(h, chosen, weights, gate_up, down, "clamped_swiglu:1.702:1.5", gate_up_bias,
                                           down_bias), expected, **SUMS_OF_HUNDREDS)
    used = []
    for way in ("_grouped_experts", "_each_chosen_expert"):
        monkeypatch.setattr(compiled, way, lambda *args, way=way: used.append(way) or torch.zeros(1))
    monkeypatch.setitem(compiled._GROUPED, ("cpu", torch.float32), True)
    compiled.routed_experts(h, chosen, weights, gate_up, down, "silu")
    monkeypatch.setitem(compiled._GROUPED, ("cpu", torch.float32), False)
    compiled.routed_experts(h, chosen, weights, gate_up, down, "silu")
    assert used == ["_grouped_experts", "_each_chosen_expert"]

    def refused(*args):  # (shapes torch's grouped product does not take, which its probe did)
        used.append("refused")
        raise RuntimeError("grouped_mm: unsupported strides")

    monkeypatch.setattr(compiled, "_grouped_experts", refused)
    monkeypatch.setitem(compiled._GROUPED, ("cpu", torch.float32), True)
    compiled.routed_experts(h, chosen, weights, gate_up, down, "silu")
    compiled.routed_experts(h, chosen, weights, gate_up, down, "silu")
    assert used[2:] == ["refused", "_each_chosen_expert", "_each_chosen_expert"]
    assert compiled._GROUPED[("cpu", torch.float32)] is False


def test_phi3_s_fused_linears_run_as_views_of_their_rows_and_mlp_biases_are_refused():
    """Phi-3's q/k/v and gate/up are one linear each: the runtime reads them as linears over views of
    the fused weight's rows (no copy, no parameter added to the model: its state dict and fingerprint
    stay as they are; made again where the model moved since), whose fused weights are the stacks it
    multiplies by — on a CPU by the kernels rsd installed on the fused linears. A rotation of 3/4 of
    each head (Phi-4-mini's) gives transformers' logits; an MLP with biases (ERNIE 4.5's `use_bias`)
    is refused in a line."""
    import copy

    from transformers import Ernie4_5Config, Ernie4_5ForCausalLM, Phi3Config, Phi3ForCausalLM

    from rsd_cli.compiled import projections, stack_projections

    model = tiny_relative("phi3", V, layers=1)
    names = list(model.state_dict())
    layer = model.model.layers[0]
    q, k, v, _, gate, up, _ = projections(layer)
    fused = layer.self_attn.qkv_proj.weight
    assert q.weight.data_ptr() == fused.data_ptr() and v.weight.data_ptr() + v.weight.numel() * 4 == \
        fused.data_ptr() + fused.numel() * 4
    assert [t.data_ptr() for t in stack_projections(layer)] == \
        [fused.data_ptr(), layer.mlp.gate_up_proj.weight.data_ptr()]
    CompiledModel(model, False)
    assert list(model.state_dict()) == names and projections(layer)[0] is q
    # on a CPU the fused weights are multiplied whole, by the kernels rsd installed on the fused linears
    # (the views have none: each on torch's product, 0.7x transformers' speed)
    packed = ("packed", "packed", "torch")  # (RSD_SMALL_BATCH_MATMUL=packed: conftest; 4 linears and the head)
    assert small_batch.install(model) == 5 and small_batch.kernels_of(layer.self_attn.qkv_proj) == packed
    weights, small, _ = CompiledModel(model, False).layers[0]
    assert weights.wq.data_ptr() == fused.data_ptr() and weights.wq.shape == fused.shape and weights.wk is None
    assert weights.wg.shape == layer.mlp.gate_up_proj.weight.shape and weights.wu is None
    assert small.q[0] == small.gate[0] == packed and "packed" in small.q[1]
    moved = copy.deepcopy(model).double()  # (views made before a model moves are made again)
    assert projections(moved.model.layers[0])[0].weight.dtype == torch.float64
    partial = Phi3ForCausalLM(Phi3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.75,
                                         bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.3))
    assert compiled.unsupported(partial) is None
    assert_same_tree_logits(StaticLM(CompiledModel(partial.eval(), False), V, capacity=12), CachedLM(partial, V))
    biased = Ernie4_5ForCausalLM(Ernie4_5Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                num_attention_heads=4, num_key_value_heads=2, use_bias=True,
                                                bos_token_id=1, eos_token_id=2, pad_token_id=0))
    assert compiled.unsupported(biased) == "Ernie4_5ForCausalLM's MLP has biases"


def test_a_yarn_scaled_model_runs_on_the_static_cache_runtime_with_transformers_logits():
    """YaRN (Qwen2.5's and Qwen3's long-context setting: scaled angles, and cos and sin scaled by its
    attention factor) depends on the position alone: past the original context of 16 positions, a
    tree's logits are transformers', on every backend. Llama 3's `dynamic` scaling, which depends
    on the sequence's length, stays with transformers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    settings = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3,
                    tie_word_embeddings=False)
    torch.manual_seed(0)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}
    model = Qwen2ForCausalLM(Qwen2Config(**settings, rope_parameters=yarn)).eval()
    assert model.model.rotary_emb.attention_scaling != 1.0 and compiled.unsupported(model) is None
    prompt, tree = [t % V for t in range(3, 23)], a_tree()  # (past the original 16 positions)
    visible = torch.cat([torch.ones(len(tree), len(prompt), dtype=torch.bool), tree.ancestry()], dim=1)
    positions = [len(prompt) + depth for depth in tree.depths]
    for backend in (CompiledModel(model, True), CompiledModel(model, False, static_shapes=True)):
        ours, reference = StaticLM(backend, V, capacity=32), CachedLM(model, V)
        with torch.inference_mode():
            for lm in (ours, reference):
                lm.extend(prompt)
            torch.testing.assert_close(ours.forward(tree.tokens, positions, visible),
                                       reference.forward(tree.tokens, positions, visible), atol=1e-5, rtol=1e-5)
        ours.release()
    dynamic = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    assert compiled.unsupported(Qwen2ForCausalLM(Qwen2Config(**settings, rope_parameters=dynamic))) == \
        "rope type 'dynamic'"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_a_longrope_model_turns_each_row_before_its_long_factors_by_the_short_ones(device):
    """`longrope` (Phi-3.5-mini, Phi-4-mini, Phi-3's 128k models): transformers turns every row of a
    forward by the long factors where the forward reaches the original context (16 here), so the
    target's distribution after a sequence is one forward of it, by the short factors while it is
    within 16 tokens. A tree astride position 16 in one forward turns its rows before it by the
    long ones (checked: off by more than 0.1); on transformers' forward (split in two there) and on
    every backend of the runtime (a table of each position's own angles), those rows' logits are
    one forward's of their paths, for trees before, astride and (after a prompt read past 16, as
    transformers reads it in one forward, by the long factors) past position 16. On a GPU: in CUDA
    graphs, with and without inductor."""
    target = tiny_relative("phi3-longrope", V, layers=2, seed=0).to(device)
    assert compiled.unsupported(target) is None
    if device == "cuda":
        backends, tolerance = [CompiledModel(target, True), CompiledModel(target, True, inductor=False)], 1e-4
        assert all(backend.graphed for backend in backends)
    else:
        backends, tolerance = [CompiledModel(target, True), CompiledModel(target, False),
                               CompiledModel(target, False, static_shapes=True)], 1e-5
    tree = a_tree()
    for length in (11, 13, 15, 16, 20):  # (the tree's rows at positions length - 1 .. length + 2)
        prompt = [(3 * t + 1) % V for t in range(length)]
        base, context = len(prompt) - 1, prompt[:-1]
        tree.tokens[0] = prompt[-1]  # (the root: the prompt's last token, as a step reads it)
        visible = torch.cat([torch.ones(len(tree), base, dtype=torch.bool), tree.ancestry()], dim=1)
        positions = [base + depth for depth in tree.depths]
        # (the rows whose tokens a step may emit: before position 16, or all past it)
        rows = [n for n, p in enumerate(positions) if p < LONG_FACTORS_FROM or base >= LONG_FACTORS_FROM]
        with torch.inference_mode():
            paths = [[tree.tokens[m] for m in tree.path_to(n)] for n in rows]  # (root to node, both included)
            expected = torch.stack([target(torch.tensor([context + path], device=device)).logits[0, -1]
                                    for path in paths])
            read = target(torch.tensor([context], device=device)).logits[0]
            if min(positions) < LONG_FACTORS_FROM <= max(positions):
                whole = CachedLM(target, V)
                whole.long_from = None  # (the tree in one forward of transformers')
                whole.extend(context, reading=True)
                assert not torch.allclose(whole.forward(tree.tokens, positions, visible)[rows], expected, atol=0.1)
        for lm in [CachedLM(target, V)] + [StaticLM(backend, V, capacity=32) for backend in backends]:
            with torch.inference_mode():
                torch.testing.assert_close(lm.extend(context, last_only=False, reading=True), read,
                                           atol=tolerance, rtol=tolerance)
                torch.testing.assert_close(lm.forward(tree.tokens, positions, visible)[rows], expected,
                                           atol=tolerance, rtol=tolerance)
            lm.release()


@pytest.mark.parametrize("runtime", ["transformers", "static cache"])
def test_longrope_decoding_across_the_long_factors_start_is_transformers_decoding(runtime):
    """Greedy: every variant's answer from a prompt of 12 tokens to 14 more, past position 16 where
    the long factors start, is one forward's of the sequence before each token — transformers'
    own generate's too (which reads the whole sequence again there, by the long factors) —, on
    transformers' forward and on the runtime. Sampled: the first two
    tokens after a prompt of 15 — emitted from one tree whose rows at 14 and 15 are turned by the
    short factors and at 16 by the long ones — and after a prompt of 16 — the first from a tree
    astride 16, the second after the caches read everything again — follow the distribution of one
    forward of the sequence before each."""
    target, draft = tiny_relative("phi3-longrope", V, layers=2, seed=1), tiny_relative("phi3-longrope", V, 1, seed=2)
    runtimes = None if runtime == "transformers" else \
        Runtimes(CompiledModel(target, False), CompiledModel(draft, False), "auto")
    prompt = [1, 3, 4, 5, 2, 3, 0, 1, 4, 4, 5, 3]
    expected = plain_greedy(target, 14, prompt)
    import transformers

    # (5.17's generate drops the cache there but then reads only the last token)
    if tuple(int(part) for part in transformers.__version__.split(".")[:2]) >= (5, 24):
        with torch.inference_mode():
            ids = torch.tensor([prompt])  # (its token 0 is the pad token: the mask says it is read)
            assert target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=14,
                                   pad_token_id=0)[0, len(prompt):].tolist() == expected
    for shape in shapes():
        assert run((target, draft), runtimes, shape, SamplingParams(temperature=0), 14, 0, prompt=prompt) == expected, \
            shape.describe()
    sampling = SamplingParams(temperature=1.0)
    for length, shape in LONGROPE_MC:
        prompt = [(3 * t + 1) % V for t in range(length)]
        counts = sample_pairs((target, draft), shape, sampling, N_SAMPLES, prompt=prompt, runtimes=runtimes)
        assert chi_square_pvalue(counts, exact_joint(target, sampling, prompt) * N_SAMPLES) > 1e-3, \
            (length, shape.describe())


def test_longrope_answers_are_queued_ahead_once_past_the_long_factors_start(monkeypatch, tmp_path):
    """On a GPU (the static shapes its CUDA graphs replay, here on the CPU) an answer that crosses a
    `longrope` target's long factors' start is decoded one step at a time up to there — the caches
    are read again at it — and queued ahead after it (Decoder._plain_steps_ahead for `ar` and
    `auto`, _tree_steps_ahead for `sd` chains and `rsd-c` fans): the greedy tokens of one forward per
    token, its steps numbered on from the ones before; sampled, the tokens of one step at a time."""
    from test_engine import tree_events

    from rsd_cli import auto

    target, draft = tiny_relative("phi3-longrope", V, layers=2, seed=1), tiny_relative("phi3-longrope", V, 1, seed=2)
    prompt = [1, 3, 4, 5, 2, 3, 0, 1, 4, 4, 5, 3]  # (12 tokens; the answer's 14 pass position 16)
    expected = plain_greedy(target, 14, prompt)
    runtimes = Runtimes(CompiledModel(target, False, static_shapes=True),
                        CompiledModel(draft, False, static_shapes=True), "off")
    queued, real = [], Decoder._ahead  # (the steps queued ahead: from which step on)
    monkeypatch.setattr(Decoder, "_ahead", lambda self, *a, first_step=1: queued.append(first_step) or
                        real(self, *a, first_step=first_step))
    for shape in [make_shape("ar"), make_shape("auto"), make_shape("sd", draft_len=2),
                  make_shape("rsd-c", branching=(3,))]:
        queued.clear()
        _, events = tree_events((target, draft), shape, SamplingParams(temperature=0), True, runtimes, n=14,
                                prompt=prompt)
        assert [t for e in events for t in e.emitted] == expected, shape.describe()
        assert [e.step for e in events] == list(range(1, len(events) + 1))
        # queued ahead from the first step whose root is at 16 (the prompt's root at 11: 5 tokens before it)
        assert len(queued) == 1 and 1 < queued[0] < len(events), shape.describe()
        before = [t for e in events[: queued[0] - 1] for t in e.emitted]
        assert len(prompt) - 1 + len(before) == LONG_FACTORS_FROM, shape.describe()
        # sampled: the tokens of one step at a time throughout (the uniforms drawn in the same order) — where
        # the steps had the same shapes: `auto` starts each run from no memory of earlier ones, but chooses by
        # this run's timings too, which may differ between runs
        sampled = {}
        for ahead in (True, False):
            monkeypatch.setattr(auto, "memory_path", lambda ahead=ahead: tmp_path / f"auto-{ahead}.json")
            (tmp_path / f"auto-{ahead}.json").unlink(missing_ok=True)
            sampled[ahead] = [(e.shape, e.emitted) for e in tree_events(
                (target, draft), shape, SamplingParams(1.0), ahead, runtimes, n=14, prompt=prompt, seed=3)[1]]
        if shape.variant != "auto" or [s for s, _ in sampled[True]] == [s for s, _ in sampled[False]]:
            assert sampled[True] == sampled[False], shape.describe()


@pytest.mark.parametrize("runtime", ["transformers", "static cache"])
def test_a_phi_moe_target_decodes_across_its_long_factors_start_as_one_forward(runtime):
    """Phi-3.5-MoE (`phimoe`: `longrope` too, its experts chosen by its sparse mixer) on transformers'
    forward and on the static-cache runtime: every variant's greedy answer from 12 tokens to 14
    more, past position 16, is one forward's of the sequence before each token (its caches read
    again at 16)."""
    from transformers import PhimoeConfig, PhimoeForCausalLM

    torch.manual_seed(1)
    rope = dict(rope_type="longrope", rope_theta=10000.0, factor=16.0, original_max_position_embeddings=16,
                short_mscale=1.0, long_mscale=1.2, short_factor=[1.0, 1.5, 3.0, 1.2], long_factor=[2.0, 5.0, 11.0, 3.0])
    target = PhimoeForCausalLM(PhimoeConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
        original_max_position_embeddings=16, rope_parameters=rope, sliding_window=None, initializer_range=0.3,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(3.0)
    assert compiled.unsupported(target) is None
    runtimes = None if runtime == "transformers" else \
        Runtimes(CompiledModel(target, False), CompiledModel(target, False), "auto")
    prompt = [1, 3, 4, 5, 2, 3, 0, 1, 4, 4, 5, 3]
    expected = plain_greedy(target, 14, prompt)
    for shape in shapes():  # (the target as its own draft)
        assert run((target, target), runtimes, shape, SamplingParams(temperature=0), 14, 0, prompt=prompt) == \
            expected, shape.describe()


@pytest.mark.parametrize("runtime", ["transformers", "static cache"])
def test_longrope_completions_decoded_together_stay_exact(runtime):
    """Completions decoded together (`ar` and `auto` with --samples or --prompts) share their prompts'
    beginning and take no step alone: where an answer would go past position 16 from a prompt read
    before it, decoding them together is refused in a line (rsd generate decodes them one after the
    other: the next test); prompts read past 16, whose beginning one forward of each turns by the
    long factors, are read each alone, and every completion's greedy answer is transformers'
    generate."""
    target = tiny_relative("phi3-longrope", V, layers=2, seed=1)
    runtimes = None if runtime == "transformers" else Runtimes(CompiledModel(target, False), None, "auto")
    decoder = Decoder(target, None, V, make_shape("ar"), SamplingParams(temperature=0), set(), runtimes=runtimes)
    short = [1, 3, 4, 5, 2, 3, 0, 1, 4, 4, 5, 3]
    for prompt in (short, short + [2, 4, 1, 3, 5]):  # (the last token at position 16 is read in a step)
        with pytest.raises(RsdError, match="cannot go past position 16, where the target's `longrope` factors"):
            together(decoder, 14, [0, 1], prompt)
    # (19 and 20 tokens with the first 12 in common)
    prompts = [short + [2, 4, 1, 3, 5, 0, 2], short + [5, 0, 2, 4, 1, 3, 3, 1]]
    tokens, _ = together(decoder, 8, [0, 1], prompts)
    for prompt, answer in zip(prompts, tokens):
        assert answer == plain_greedy(target, 8, prompt)


@pytest.mark.parametrize("runtime", ["transformers", "static cache"])
def test_longrope_chat_turns_reuse_only_caches_turned_as_their_prompts_need(runtime):
    """A chat's caches, kept from answer to answer (`keep_caches`): a second turn whose answer goes
    past position 16 on the first turn's keys (turned by the short factors: read again on the way),
    a third that goes on from there (all long), then a shorter conversation sharing the first turn's
    beginning (the kept keys turned by the long factors: read afresh) — every answer `sd`'s greedy,
    which is one forward's of the sequence before each token."""
    target, draft = tiny_relative("phi3-longrope", V, layers=2, seed=1), tiny_relative("phi3-longrope", V, 1, seed=2)
    runtimes = None if runtime == "transformers" else \
        Runtimes(CompiledModel(target, False), CompiledModel(draft, False), "auto")
    decoder = Decoder(target, draft, V, make_shape("sd", draft_len=3), SamplingParams(temperature=0), set(),
                      runtimes=runtimes)
    decoder.keep_caches = True
    conversation = [1, 3, 4, 5, 2, 3, 0, 1, 4, 4]
    for turn, (message, count) in enumerate([([], 4), ([3, 1], 6), ([2, 5, 1], 5), (None, 8)]):
        prompt = conversation[:10] if message is None else conversation + message
        answer = [t for event in decoder.generate(prompt, count, 0) for t in event.emitted]
        assert answer == plain_greedy(target, count, prompt), turn
        conversation = prompt + answer


LONGROPE_MC = [(15, make_shape("rsd-c", branching=(2, 2))), (15, make_shape("sd", draft_len=2)),
               (16, make_shape("rsd-s", beam_width=2, depth=2))]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_stacked_projections_give_the_separate_products(kind, monkeypatch):
    """On a GPU each layer's q/k/v and gate/up weights are stacked (one product each, fewer kernels
    for a graph to replay), the linears' weights becoming views of the stacks: the same logits as
    the separate products (Qwen2's biases added after the stacked product), transformers' forward
    on the viewed weights unchanged, and a second runtime on the same layers (an early-exit draft
    shares its target's) reuses the stacks instead of copying again. Checked here on the CPU."""
    import copy

    model = tiny_model(V, layers=2, seed=4, scale=0.1) if kind == "llama" else tiny_relative(kind, V, layers=2, seed=4)
    stacked_model = copy.deepcopy(model)
    tokens, visible = [t % V for t in (3, 1, 4, 1, 5)], torch.ones(5, 5, dtype=torch.bool).tril()
    separate = StaticLM(CompiledModel(model, False), V, 8).forward(tokens, list(range(5)), visible)
    stacks = [compiled.stack_projections(layer) for layer in stacked_model.model.layers]
    layer = stacked_model.model.layers[0]
    assert layer.self_attn.k_proj.weight.data_ptr() == stacks[0][0][layer.self_attn.q_proj.out_features:].data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), stacked_model.state_dict().values()))
    again = compiled.stack_projections(layer)
    assert again[0] is stacks[0][0] and again[1] is stacks[0][1]
    runtime = CompiledModel(stacked_model, False, stack=True)  # (what a GPU gets)
    assert [weights.wq.data_ptr() for weights, _, _ in runtime.layers] == [qkv.data_ptr() for qkv, _ in stacks]
    products, linear = [], torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *args: products.append(1) or linear(*args))
    torch.testing.assert_close(StaticLM(runtime, V, 8).forward(tokens, list(range(5)), visible), separate,
                               rtol=1e-5, atol=1e-5)
    assert len(products) == 2 * 4 + 1  # q/k/v, o, gate/up, down a layer; the head
    monkeypatch.undo()
    compiled_stacks = StaticLM(CompiledModel(stacked_model, True, stack=True), V, 8)  # (a GPU compiles it so)
    torch.testing.assert_close(compiled_stacks.forward(tokens, list(range(5)), visible), separate,
                               rtol=1e-5, atol=1e-5)
    reference = CachedLM(model, V)
    torch.testing.assert_close(CachedLM(stacked_model, V).forward(tokens, list(range(5)), visible),
                               reference.forward(tokens, list(range(5)), visible), rtol=1e-5, atol=1e-5)


def test_unsupported_models_are_named_with_a_reason():
    from transformers import (BloomConfig, BloomForCausalLM, Gemma2Config, Gemma2ForCausalLM, GPTJConfig,
                              GPTJForCausalLM, LlamaConfig, LlamaForCausalLM, MambaConfig, MambaForCausalLM,
                              MistralConfig, MistralForCausalLM, MptConfig, MptForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)

    mamba = MambaForCausalLM(MambaConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, state_size=4))
    assert "mamba" in compiled.unsupported(mamba)
    gptj = GPTJForCausalLM(GPTJConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=64, rotary_dim=4))
    assert compiled.unsupported(gptj) is None
    bloom = dict(n_layer=1, hidden_size=16, n_head=2, vocab_size=40)
    assert compiled.unsupported(BloomForCausalLM(BloomConfig(**bloom, apply_residual_connection_post_layernorm=True))) \
        == "BLOOM's options (the residual after the norm, or products split as in its pretraining)"
    assert compiled.unsupported(BloomForCausalLM(BloomConfig(**bloom))) is None
    mpt = dict(n_layers=1, d_model=16, n_heads=2, vocab_size=40)
    assert compiled.unsupported(MptForCausalLM(MptConfig(**mpt, attn_config={"clip_qkv": 8.0}))) == \
        "MPT's options (q, k and v clipped or normed, biases)"
    assert compiled.unsupported(MptForCausalLM(MptConfig(**mpt))) is None
    assert compiled.unsupported(tiny_model(V, layers=1)) is None
    small = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256)
    windowed = Qwen2ForCausalLM(Qwen2Config(**small, use_sliding_window=True, sliding_window=16, max_window_layers=1))
    assert compiled.unsupported(windowed) is None and compiled.window_of(windowed.config) is None  # (by layer kind)
    assert compiled.CompiledModel(windowed, False).by_kind == [0, 1]  # (its second layer's)
    every = Qwen2ForCausalLM(Qwen2Config(**small, use_sliding_window=True, sliding_window=16, max_window_layers=0))
    mistral = MistralForCausalLM(MistralConfig(**small, sliding_window=16))
    assert compiled.unsupported(every) is compiled.unsupported(mistral) is None  # (every layer's: in the masks)
    assert compiled.window_of(every.config) == compiled.window_of(mistral.config) == 16
    assert compiled.CompiledModel(every, False).by_kind is None
    gemma2 = Gemma2ForCausalLM(Gemma2Config(**small, head_dim=8))  # (attention scores soft-capped: attention of its own)
    assert compiled.unsupported(gemma2) is None and compiled.style_of(gemma2).softcap == 50.0
    other = LlamaForCausalLM(LlamaConfig(**small, hidden_act="quick_gelu"))  # (ReLU's now taken: OPT's, ReLU-Llamas')
    assert compiled.unsupported(other) == "LlamaForCausalLM's layers differ from Llama's"
    wide = MistralForCausalLM(MistralConfig(**small, sliding_window=256))  # (the whole context: no window)
    assert compiled.unsupported(wide) is None and compiled.window_of(wide.config) is None
    from transformers import CohereConfig, CohereForCausalLM

    plus = CohereForCausalLM(CohereConfig(**small, use_qk_norm=True, bos_token_id=1, eos_token_id=2))  # (Command R+)
    assert compiled.unsupported(plus) == "CohereForCausalLM norms q and k with a weight for each head"
    from transformers import StableLmConfig, StableLmForCausalLM

    for option in ("qk_layernorm", "use_parallel_residual"):  # (StableLM 2 12B's)
        assert compiled.unsupported(StableLmForCausalLM(StableLmConfig(**small, **{option: True}))) == \
            "StableLmForCausalLM norms q and k with a LayerNorm for each head, or runs attention beside the MLP"
    from transformers import OPTConfig, OPTForCausalLM

    opt = dict(vocab_size=V, hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=4)
    for option in (dict(do_layer_norm_before=False), dict(word_embed_proj_dim=16)):  # (OPT-350m's: both)
        assert compiled.unsupported(OPTForCausalLM(OPTConfig(**opt, **option))) == \
            "OPT-350m's layout (norms after the residual, embeddings projected in and out)"
    assert compiled.unsupported(OPTForCausalLM(OPTConfig(**opt))) is None
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = dict(n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=64)
    for option in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        assert compiled.unsupported(GPT2LMHeadModel(GPT2Config(**gpt2, **{option: True}))) == \
            "GPT-2's options (attention scaled by layer, upcast and reordered, or cross-attention)"
    assert compiled.unsupported(GPT2LMHeadModel(GPT2Config(**gpt2))) is None
    notices = []
    assert compiled.runtime_for(mamba, "on", "target", notice=notices.append) is None
    assert notices == ["--compile on does not apply to the target (a mamba model (the static-cache runtime covers "
                       f"{', '.join(compiled.SUPPORTED_TYPES)})): it runs on transformers' eager forward"]
    assert compiled.SUPPORTED_TYPES[:3] == ("llama", "qwen2", "mistral") and "glm4" in compiled.SUPPORTED_TYPES
    assert compiled.runtime_for(mamba, "auto", "target", notice=notices.append) is None and len(notices) == 1
    assert compiled.runtime_for(tiny_model(V, layers=1), "off", "target") is None


def test_auto_measures_once_per_machine_and_keeps_the_verdict(tmp_path, monkeypatch):
    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path / "cache"))
    measured = []
    monkeypatch.setattr(compiled, "compiled_gain", lambda model: measured.append(model) or 1.5)
    model, notices = tiny_model(V, layers=1), []
    runtime = compiled.runtime_for(model, "auto", "target", notice=notices.append)
    assert runtime is not None and not runtime.compiled  # slower compiled: the static cache, uncompiled
    again = compiled.runtime_for(tiny_model(V, layers=1, seed=4), "auto", "draft", notice=notices.append)
    assert len(measured) == 1 and not again.compiled  # same machine and layer shape: read back
    assert notices == ["measuring once whether compiling the layers pays on this machine (the verdict is cached)"]
    verdicts = json.loads((tmp_path / "cache" / "compile.json").read_text())
    assert [v["compiled_over_eager"] for v in verdicts.values()] == [1.5]
    monkeypatch.setattr(compiled, "compiled_gain", lambda model: 0.5)
    (tmp_path / "cache" / "compile.json").unlink()
    assert compiled.runtime_for(model, "auto", "target").compiled


def test_inductor_s_instruction_set_probes_are_answered_once_per_machine(tmp_path, monkeypatch):
    """inductor's probes (build a small library with an instruction set's flags, load it in a new
    Python process) run once per machine, torch and compiler: a later process gets the same
    answers back from compile.json, True and False alike; another probe is still run."""
    cpu_vec_isa = pytest.importorskip("torch._inductor.cpu_vec_isa")
    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path / "cache"))
    probed = []

    def probe(isa, code):
        probed.append((str(isa), code))
        return "unusable" not in code

    for process in range(2):  # each starts from torch's own probe
        monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", probe)
        compiled._remember_isa_probes()
        compiled._remember_isa_probes()  # (once a process: not wrapped twice)
        isa = cpu_vec_isa.VecAVX2()
        assert isa.check_build("usable code") is True and isa.check_build("unusable code") is False
        assert len(probed) == 2
    wider = cpu_vec_isa.VecAVX2()
    wider._arch_flags += " -mavx512bf16"  # (as torch's AVX-512 probe for bfloat16 widens its flags)
    assert wider.check_build("usable code") and len(probed) == 3
    assert cpu_vec_isa.VecAVX512().check_build("usable code") and len(probed) == 4
    monkeypatch.setenv("CXX", str(tmp_path / "another-compiler"))
    assert isa.check_build("usable code") and len(probed) == 5


def test_generate_with_compile_on_off_and_auto_gives_the_same_greedy_text(tiny_profile, monkeypatch):
    runner = CliRunner()
    outputs, runtimes = {}, {}
    for setting in ("off", "on", "auto"):
        result = runner.invoke(app, ["generate", "hello", "-p", str(tiny_profile), "-t", "0", "-n", "10",
                                     "--compile", setting, "--json"])
        assert result.exit_code == 0, result.stderr
        record = json.loads(result.stdout)
        outputs[setting] = record["token_ids"]
        runtimes[setting] = record["runtime"]
    assert outputs["on"] == outputs["off"] == outputs["auto"]
    assert runtimes["on"] == "static cache, compiled" and runtimes["off"] == "transformers eager"
    assert runtimes["auto"].startswith("static cache")  # compiled or not: this machine's verdict


def assert_alike_on_both_runtimes(profile) -> None:
    """`rsd generate` with this profile, greedy, on the static-cache runtime compiled and on
    transformers' forward: the same 12 tokens (past any end of the answer a random model draws), each
    run on the runtime it names."""
    records = {}
    for setting in ("off", "on"):
        result = CliRunner().invoke(app, ["generate", "hello", "-p", str(profile), "-t", "0", "-n", "12",
                                          "--ignore-eos", "--compile", setting, "--json"])
        assert result.exit_code == 0, result.stderr
        records[setting] = json.loads(result.stdout)
    assert records["on"]["token_ids"] == records["off"]["token_ids"] and len(records["on"]["token_ids"]) == 12
    assert records["on"]["runtime"] == "static cache, compiled" and records["off"]["runtime"] == "transformers eager"


def test_a_qwen2_target_with_an_early_exit_draft_generates_alike_on_every_runtime(tmp_path):
    """As a user runs it: a Qwen2 checkpoint folder, its first layer as the draft."""
    from tiny import tiny_tokenizer

    folder = tmp_path / "qwen2"
    tiny_relative("qwen2", 40, layers=3, seed=0).save_pretrained(folder)  # (the tokenizer's 36 tokens)
    tiny_tokenizer().save_pretrained(folder)
    profile = tmp_path / "qwen2.toml"
    profile.write_text(f'[target]\nsource = "{folder}"\n[draft]\nkind = "early-exit"\nlayers = 1\nadapter = ""\n'
                       '[decoding]\nvariant = "sd"\n')
    small = tmp_path / "small"  # a model whose vocabulary the tokenizer's ids do not fit: a clear error
    tiny_relative("qwen2", V, layers=2, seed=0).save_pretrained(small)
    tiny_tokenizer().save_pretrained(small)
    profile.with_name("small.toml").write_text(profile.read_text().replace(str(folder), str(small)))
    result = CliRunner().invoke(app, ["generate", "hello", "-p", str(profile.with_name("small.toml")), "-n", "2"])
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert f"but the models' vocabulary has {V} tokens: the tokenizer does not fit them" in result.stderr
    assert_alike_on_both_runtimes(profile)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "smollm3", "granite", "olmo3", "phi3", "phi3-longrope", "exaone4",
                                  "ernie4_5", "hunyuan", "glm4", "cohere2", "qwen2_moe", "mixtral", "starcoder2",
                                  "nemotron", "phi", "gpt_oss", "apertus", "ernie4_5_moe", "phimoe", "gemma4-moe",
                                  "minicpm3", "youtu", "deepseek_v3"])
def test_a_newly_covered_family_with_an_early_exit_draft_generates_alike_on_both_runtimes(tmp_path, kind):
    """As a user runs it: a Gemma 2 or 3, SmolLM3, Granite, OLMo 3, Phi-3 (with `longrope` too: its long
    factors from position 16, which the answer passes), EXAONE 4, ERNIE 4.5, Hunyuan, GLM-4, Cohere 2,
    Qwen2-MoE, Mixtral, StarCoder2, Nemotron, Phi, gpt-oss, Apertus, ERNIE 4.5 MoE, PhiMoE, Gemma 4
    MoE (no per-layer inputs, no shared caches: its first layer cuts), MiniCPM3, Youtu or DeepSeek V3
    checkpoint folder,
    its first layer as the draft, on the static-cache runtime compiled and on transformers' forward:
    the same greedy tokens."""
    from tiny import tiny_tokenizer

    folder = tmp_path / kind
    target = tiny_relative(kind, 40, layers=3, seed=0)
    skip_a_dynamic_hunyuan(target)
    target.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    profile = tmp_path / f"{kind}.toml"
    profile.write_text(f'[target]\nsource = "{folder}"\n[draft]\nkind = "early-exit"\nlayers = 1\nadapter = ""\n'
                       '[decoding]\nvariant = "rsd-c"\nbranching = [2, 1]\n')
    assert_alike_on_both_runtimes(profile)


@pytest.mark.parametrize("kind", ["lfm2", "qwen3_5", "granite4"])
def test_a_stateful_target_with_its_first_layer_as_the_draft_generates_alike_on_both_runtimes(tmp_path, kind):
    """As a user runs it: an LFM2 checkpoint folder (its final norm named `embedding_norm`), a Qwen3.5
    or a Granite 4.0-H one, its first layer — a short convolution, a gated delta net or a Mamba-2 mixer,
    no attention at all,
    which transformers' LFM2 cannot read into a cache without masks given — as an early-exit draft:
    `sd` on the static-cache runtime and on transformers' forward give the same greedy tokens, and so
    does `rsd-c` on the runtime."""
    from tiny import tiny_tokenizer

    folder = tmp_path / kind
    tiny_relative(kind, 40, layers=3, seed=0).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    profile = tmp_path / f"{kind}.toml"
    profile.write_text(f'[target]\nsource = "{folder}"\n[draft]\nkind = "early-exit"\nlayers = 1\nadapter = ""\n'
                       '[decoding]\nvariant = "sd"\ndraft_len = 3\n')
    assert_alike_on_both_runtimes(profile)
    records = {}
    for variant, setting in (("sd", "off"), ("rsd-c", "on")):
        result = CliRunner().invoke(app, ["generate", "hello", "-p", str(profile), "-t", "0", "-n", "12", "--ignore-eos",
                                          "-v", variant, "--compile", setting, "--json"])
        assert result.exit_code == 0, result.stderr
        records[variant] = json.loads(result.stdout)
    assert records["rsd-c"]["token_ids"] == records["sd"]["token_ids"]
    assert records["rsd-c"]["variant"] == "rsd-c"


@pytest.mark.parametrize("kind", ["nemotron_h", "bamba", "mamba2"])
def test_a_hybrid_target_with_its_first_blocks_as_the_draft_takes_trees_on_the_runtime_only(tmp_path, kind):
    """As a user runs it: a Nemotron-H checkpoint folder (its embedding `embeddings`, its final norm
    `norm_f`), its first two blocks — a Mamba-2 mixer and an MLP, no attention — as an early-exit draft;
    a Bamba one (its final norm `final_layernorm`, its layer kinds worked out from its layer count),
    its first layer — a mixer and an MLP — as the draft; a Mamba-2 one (its decoder `backbone`, no
    attention at all), its first mixer. transformers' forward takes plain steps alone from Nemotron-H (a
    chain read after its mixers' state is not theirs one at a time) and chains from Bamba and Mamba-2,
    and says so for a tree in one line; on the static-cache runtime `rsd-c` compiled and `sd` on
    `auto` give plain decoding's greedy tokens."""
    from tiny import tiny_tokenizer

    folder = tmp_path / kind
    tiny_relative(kind, 40, layers=5 if kind == "nemotron_h" else 4, seed=0).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    profile = tmp_path / f"{kind}.toml"
    profile.write_text(f'[target]\nsource = "{folder}"\n[draft]\nkind = "early-exit"\n'
                       f'layers = {2 if kind == "nemotron_h" else 1}\nadapter = ""\n')
    records = {}
    for variant, setting in (("ar", "off"), ("rsd-c", "on"), ("sd", "auto"), ("rsd-c", "off"), ("sd", "off")):
        result = CliRunner().invoke(app, ["generate", "hello", "-p", str(profile), "-t", "0", "-n", "12", "--ignore-eos",
                                          "-v", variant, "--compile", setting, "--json"])
        if setting == "off" and (variant == "rsd-c" or kind == "nemotron_h" and variant == "sd"):
            assert result.exit_code != 0 and len(result.stderr.strip().splitlines()) == 1, result.stderr
            continue
        assert result.exit_code == 0, result.stderr
        records[variant, setting] = json.loads(result.stdout)
    assert len({tuple(record["token_ids"]) for record in records.values()}) == 1
    assert len(records["ar", "off"]["token_ids"]) == 12 and records["rsd-c", "on"]["runtime"] == "static cache, compiled"
    assert len(records) == (3 if kind == "nemotron_h" else 4)


def test_longrope_samples_past_the_long_factors_start_are_decoded_one_after_the_other(tmp_path):
    """As a user runs it: `rsd generate --samples 2` with `ar` (whose samples are otherwise decoded
    together) on a Phi-3 checkpoint whose long factors start at position 16, the answers going past
    it: each sample decoded alone, on the runtime, its greedy tokens those of one forward of the
    sequence before each."""
    from rsd_cli.prompting import encode_prompt
    from tiny import tiny_tokenizer

    target, tokenizer = tiny_relative("phi3-longrope", 40, layers=3, seed=0), tiny_tokenizer()
    target.save_pretrained(tmp_path / "phi")
    tokenizer.save_pretrained(tmp_path / "phi")
    profile = tmp_path / "phi.toml"
    profile.write_text(f'[target]\nsource = "{tmp_path / "phi"}"\n[draft]\nkind = "early-exit"\nlayers = 1\n'
                       'adapter = ""\n[decoding]\nvariant = "ar"\n')
    result = CliRunner().invoke(app, ["generate", "hello", "-p", str(profile), "-t", "0", "-n", "12", "--samples", "2",
                                      "--compile", "on", "--json"])
    assert result.exit_code == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    prompt = encode_prompt(tokenizer, "hello")
    assert len(prompt) < LONG_FACTORS_FROM < len(prompt) + 12
    expected = plain_greedy(target, 12, prompt)
    assert [(r["token_ids"], r["samples_together"], r["runtime"]) for r in records] == \
        [(expected, 1, "static cache, compiled")] * 2


@pytest.mark.parametrize("kind", ["gpt_neox", "opt", "gpt2", "gpt_bigcode", "gemma4", "gptj", "falcon", "gemma3n"])
def test_a_pair_of_a_family_without_early_exit_drafts_runs_both_models_on_the_static_cache_runtime(tmp_path, kind):
    """As a user runs a Pythia pair, an OPT one (the RSD paper's), a GPT-2 one, a StarCoder 1 one, a
    Gemma 4 one, a GPT-J one, a Falcon one or a Gemma 3n one: a GPT-NeoX (OPT, GPT-2, GPT-BigCode, Gemma 4,
    GPT-J, Falcon, Gemma 3n) target and a smaller one as the draft (kind = "model"), each a checkpoint folder, both
    on the static-cache runtime compiled: the greedy tokens of both on transformers' forward, for a tree variant
    and for `sd`. (Gemma 4's and 3n's targets of 4 layers, the last two reading the first two's caches.)"""
    from tiny import save_profiled_pair

    layers = 4 if kind in ("gemma4", "gemma3n") else 3
    pair = save_profiled_pair(tmp_path, tiny_relative(kind, 40, layers=layers, seed=0),
                              tiny_relative(kind, 40, 1, seed=1))
    for variant in ("rsd-c", "sd"):
        profile = tmp_path / f"pair-{variant}.toml"
        profile.write_text(pair.read_text() + f'[decoding]\nvariant = "{variant}"\n')
        assert_alike_on_both_runtimes(profile)


def test_bad_compile_settings_are_usage_errors(tiny_profile, tmp_path, monkeypatch):
    monkeypatch.delenv("RSD_RUNTIME_COMPILE")  # the profile's value, not the suite's
    result = CliRunner().invoke(app, ["generate", "hi", "-p", str(tiny_profile), "--compile", "maybe"])
    assert result.exit_code == 2 and "--compile takes auto, on or off" in result.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text('[runtime]\ncompile = "fast"\n')
    result = CliRunner().invoke(app, ["generate", "hi", "-p", str(bad)])
    assert result.exit_code == 1 and "runtime.compile must be one of auto, on, off" in result.stderr
    result = CliRunner().invoke(app, ["bench", "-p", str(tiny_profile), "--compile", "on,fast"])
    assert result.exit_code == 2 and "--compile takes auto, on or off" in result.stderr


def test_bench_interleaves_compile_settings_and_times_the_static_cache_peer(tiny_profile):
    result = CliRunner().invoke(app, ["bench", "-p", str(tiny_profile), "--variants", "ar,rsd-c", "--depths", "1",
                                      "--width", "2", "--limit", "1", "-n", "6", "--compile", "on,off",
                                      "--no-assisted", "--hf-static", "--json"])
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)["results"]
    ours = {(r["variant"], r["compile"]): r for r in rows if r["compile"]}
    assert set(ours) == {("ar", "on"), ("rsd-c", "on"), ("ar", "off"), ("rsd-c", "off")}
    assert ours[("ar", "on")]["runtime"] == "static cache, compiled"
    assert ours[("ar", "off")]["runtime"] == "transformers eager"
    assert ours[("ar", "on")]["speedup_vs_ar"] == 1.0
    assert ours[("ar", "off")]["speedup_vs_ar_off"] == 1.0
    assert ours[("rsd-c", "on")]["speedup_vs_ar_off"] == pytest.approx(
        ours[("rsd-c", "on")]["tokens_per_second"] / ours[("ar", "off")]["tokens_per_second"])
    static = [r for r in rows if r["variant"] == "hf-static"]
    assert len(static) == 1 and static[0]["tokens_per_second"] > 0 and not static[0].get("error")


def test_plain_decoding_compiles_only_a_one_token_forward_and_says_once_what_it_compiles(monkeypatch, tmp_path):
    """`ar` (generate, inspect-tree) warms the 1-token graph alone and nothing for the draft, which never
    runs; the first-compile notice comes back when a later run compiles token counts not compiled yet."""
    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path / "cache"))
    warmed = []
    monkeypatch.setattr(compiled, "warm_up", lambda runtime, sizes=compiled.WARM_SIZES: warmed.append(sizes))
    model, notices = tiny_model(V, layers=1), []
    assert compiled.runtime_for(model, "on", "target", notice=notices.append, fixed=make_shape("ar")).compiled
    assert compiled.runtime_for(model, "on", "draft", notice=notices.append, fixed=make_shape("ar")).compiled
    assert warmed == [compiled.PLAIN_SIZES]
    first = "compiling the target's layers for this machine, once (later runs read them from the cache)"
    assert notices == [first]
    compiled.runtime_for(model, "on", "target", notice=notices.append, fixed=make_shape("ar"))
    assert notices == [first]  # compiled here already
    compiled.runtime_for(model, "on", "target", notice=notices.append)
    assert warmed[-1] == compiled.WARM_SIZES and notices == [first, first]  # 2 and 4 tokens: new compiles
    compiled.runtime_for(model, "on", "target", notice=notices.append)
    compiled.runtime_for(model, "on", "target", notice=notices.append, fixed=make_shape("ar"))
    assert len(notices) == 2
    for marker in (tmp_path / "cache" / "inductor").glob("rsd-*"):
        marker.unlink()
    compiled._marker(model).touch()  # what earlier versions left after compiling WARM_SIZES
    compiled.runtime_for(model, "on", "target", notice=notices.append, fixed=make_shape("ar"))
    compiled.runtime_for(model, "on", "target", notice=notices.append)
    assert len(notices) == 2
    monkeypatch.setattr(compiled, "CompiledModel", GraphedOnTheCpu)
    compiled.runtime_for(tiny_model(V, layers=2), "on", "target", fixed=make_shape("ar"))  # on a GPU too
    assert warmed[-1] == compiled.PLAIN_SIZES


@pytest.mark.parametrize("command, variant, warmed_sizes", [
    ("generate", "ar", [compiled.PLAIN_SIZES]),
    ("generate", "sd", [(1, 2, 4, 8), compiled.WARM_SIZES]),  # target (γ = 4: 5 tokens) and (its own) draft
    ("generate", "rsd-c", [(1, 2, 4, 8), compiled.WARM_SIZES]),  # b=(2, 2): 7 nodes, levels of 1 and 2 drafted
    ("generate", "lookup", [(1, 2, 4, 8)]),  # (γ = 4; nothing for the draft model, which it drafts without)
    ("generate", "auto", [compiled.WARM_SIZES, compiled.WARM_SIZES]),  # (its shapes vary)
    ("samples", "ar", [compiled.WARM_SIZES, compiled.WARM_SIZES]),  # samples together: rows of several
    ("chat", "ar", [compiled.WARM_SIZES, compiled.WARM_SIZES]),  # /set variant may draft later
])
def test_what_a_command_compiles_at_load_follows_its_variant(tiny_profile, monkeypatch, command, variant,
                                                              warmed_sizes):
    warmed, warm_up = [], compiled.warm_up

    def counted(runtime, sizes=compiled.WARM_SIZES):
        warmed.append(sizes)
        warm_up(runtime, sizes)

    monkeypatch.setattr(compiled, "warm_up", counted)
    arguments = {"generate": ["generate", "hello", "-t", "0", "-n", "6", "--json"], "chat": ["chat"],
                 "samples": ["generate", "hello", "-t", "0", "-n", "6", "--json", "--samples", "2"]}[command]
    result = CliRunner().invoke(app, [*arguments, "-p", str(tiny_profile), "-v", variant, "--compile", "on"],
                                input="/bye\n" if command == "chat" else None)
    assert result.exit_code == 0, result.stderr
    assert warmed == warmed_sizes
    if command != "chat":  # and a token count not warmed (the prompt's) compiles at its first use
        off = CliRunner().invoke(app, [*arguments, "-p", str(tiny_profile), "-v", variant, "--compile", "off"])
        records = [json.loads(line)["token_ids"] for line in result.stdout.splitlines()]
        assert records == [json.loads(line)["token_ids"] for line in off.stdout.splitlines()]


def test_a_failing_compiler_leaves_the_runtime_uncompiled_with_a_notice(monkeypatch, tmp_path):
    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path / "cache"))

    def no_compiler(runtime, sizes=compiled.WARM_SIZES):
        raise RuntimeError("no working C++ compiler found")

    monkeypatch.setattr(compiled, "warm_up", no_compiler)
    notices = []
    runtime = compiled.runtime_for(tiny_model(V, layers=1), "on", "target", notice=notices.append)
    assert runtime is not None and not runtime.compiled
    assert notices[-1] == ("compiling the target failed (RuntimeError: no working C++ compiler found): "
                           "it runs on the static-cache runtime uncompiled")
    monkeypatch.setattr(compiled, "compiled_gain", lambda model: no_compiler(None))
    assert not compiled.runtime_for(tiny_model(V, layers=1), "auto", "target").compiled
    verdicts = json.loads((tmp_path / "cache" / "compile.json").read_text())
    assert [v["error"] for v in verdicts.values()] == ["RuntimeError: no working C++ compiler found"]


class GraphedOnTheCpu(CompiledModel):
    """A CompiledModel that takes itself for one on a CUDA device (graphed, static shapes) while
    running on the CPU: what runtime_for and the buffers do on a GPU, without one."""

    def __init__(self, model, compile=True, static_shapes=None, notice=lambda message: None, inductor=True):
        super().__init__(model, compile, static_shapes, notice, inductor)
        self.graphed = compile
        self.static_shapes = self.static_shapes or compile
        self.buckets = compiled.STATIC_BUCKETS if self.static_shapes else compiled.BUCKETS


def test_on_a_gpu_every_bucket_compiles_at_load_and_a_failed_compile_keeps_graphs_of_the_uncompiled_layers(
        monkeypatch, tmp_path):
    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(compiled, "CompiledModel", GraphedOnTheCpu)
    warmed = []
    monkeypatch.setattr(compiled, "warm_up", lambda runtime, sizes=compiled.WARM_SIZES: warmed.append(sizes))
    runtime = compiled.runtime_for(tiny_model(V, layers=1), "on", "target")
    assert runtime.graphed and runtime.inductor and warmed == [compiled.STATIC_BUCKETS]  # no compile mid-answer

    def no_triton(runtime, sizes=compiled.WARM_SIZES):
        raise RuntimeError("Cannot find a working triton installation")

    monkeypatch.setattr(compiled, "warm_up", no_triton)
    notices = []
    runtime = compiled.runtime_for(tiny_model(V, layers=1), "on", "target", notice=notices.append)
    assert runtime.graphed and not runtime.inductor  # graphs still cut the launches
    assert notices[-1] == ("compiling the target failed (RuntimeError: Cannot find a working triton installation): "
                           "it runs on CUDA graphs of its uncompiled layers")
    assert Runtimes(runtime, runtime).describe() == "static cache, CUDA graphs"


def test_graphs_dropped_with_their_buffers_take_their_memory_pool_with_them(pair):
    """Buffers that grow replace the old ones, and the graphs captured on them go; so must their
    pool: torch keeps a pool whose graphs are all gone, and capturing into it again fails its
    allocator's internal assert (`use_count > 0`, seen on an H100)."""
    runtime = CompiledModel(pair[0], False, static_shapes=True)
    lm = StaticLM(runtime, V, capacity=8)
    runtime._captured[(1, lm.keys.data_ptr())] = ("inputs", "graph", "logits")  # as after a capture
    runtime._pool = "the pool those graphs were captured in"
    lm.extend([1] * 10)  # past the capacity: new buffers
    assert lm.capacity >= 10 and not runtime._captured and runtime._pool is None


def test_buffers_start_small_and_grow_whatever_max_tokens_says(pair, runtimes):
    """inspect-tree decodes with max_tokens = 10**9: the buffers must not be sized by it."""
    decoder = Decoder(pair[0], pair[1], V, make_shape("sd", draft_len=3), SamplingParams(0.0), set(),
                      runtimes=runtimes[False])
    events = decoder.generate(PROMPT, 10**9, seed=0)
    tokens = [t for _, event in zip(range(200), events) for t in event.emitted]
    assert tokens[:40] == plain_greedy(pair[0], 40) and len(tokens) >= 200


@pytest.mark.parametrize("backend", ["transformers", "uncompiled", "compiled"])
@pytest.mark.parametrize("variant", ["ar", "rsd-c"])
def test_forwards_on_torchs_layers_run_on_the_threads_the_governor_chooses(pair, runtimes, backend, variant,
                                                                            monkeypatch):
    """On two threads, a forward on torch's layers (transformers', or the static-cache runtime's)
    runs on the count the governor picks for it — beside a busy process a two-thread forward of the
    embedded target on torch took a second on the 2-core Xeon — and the steps' maths between
    forwards on one thread, while the caller keeps two. Compiled graphs run only on two threads (the
    count in their code); on one the same layers run uncompiled. Greedy output stays plain greedy."""
    from rsd_cli import engine

    if not threads._openmp():
        pytest.skip("torch's own thread pool: its count is never changed")
    chosen = {"transformers": Runtimes(), "uncompiled": runtimes[False], "compiled": runtimes[True]}[backend]
    inside, maths, graphs = [], [], []
    if backend == "compiled":
        for runtime in (chosen.target, chosen.draft):
            layer = runtime._layer
            monkeypatch.setattr(runtime, "_layer", lambda *args, layer=layer: graphs.append(torch.get_num_threads())
                                or layer(*args))
    if backend == "transformers":
        for model in pair:
            model.register_forward_pre_hook(lambda *_: inside.append(torch.get_num_threads()))
    else:
        final = compiled.final_logits
        monkeypatch.setattr(compiled, "final_logits", lambda *args: inside.append(torch.get_num_threads())
                            or final(*args))
    probabilities = engine.logits_to_probs
    monkeypatch.setattr(engine, "logits_to_probs", lambda *args, **kwargs: maths.append(torch.get_num_threads())
                        or probabilities(*args, **kwargs))
    governor = Alternating()
    monkeypatch.setattr(threads, "GOVERNOR", governor)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        tokens = run(pair, chosen, make_shape(variant, branching=(2, 2)), SamplingParams(temperature=0), 20, seed=0)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
        for model in pair:
            model._forward_pre_hooks.clear()
    assert tokens == plain_greedy(pair[0], 20) and inside
    assert len(governor.keys) == len(inside) and inside == governor.chosen and set(maths) == {1}
    if backend == "compiled":  # (PROMPT and the trees: token counts the graphs were compiled for)
        assert set(graphs) == {2} and set(inside) == {1, 2}
        if variant == "ar":  # (every forward the target's: a graph call a layer on two threads)
            assert len(graphs) == inside.count(2) * len(pair[0].model.layers)


@pytest.fixture
def attention_calls(monkeypatch):
    """torch's attention calls in the static-cache runtime, each ("causal" or "mask", keys read)."""
    attention = torch.nn.functional.scaled_dot_product_attention
    calls = []

    def recorded(q, k, v, **kwargs):
        causal = kwargs.get("is_causal") and kwargs.get("attn_mask") is None
        calls.append(("causal" if causal else "mask", k.shape[2]))
        return attention(q, k, v, **kwargs)

    monkeypatch.setattr(compiled.F, "scaled_dot_product_attention", recorded)
    return calls


def test_a_prompts_first_forward_takes_its_attention_as_causal_with_the_masks_logits(pair, runtimes, monkeypatch,
                                                                                     attention_calls):
    """A prompt read into an empty cache: each layer's attention is told it is causal instead of
    adding a mask of -inf (which makes torch's kernel skip the hidden half), and the logits are
    those the mask gives, bit for bit. Where the cache holds tokens before them (a chain after the
    prompt) or the new tokens do not see each other causally (a tree), the mask as before."""
    calls, prompt, layers = attention_calls, PROMPT * 3, len(pair[0].model.layers)

    def first_forward(lm: StaticLM) -> torch.Tensor:
        calls.clear()
        return lm.extend(prompt, last_only=False)

    ours = StaticLM(runtimes[False].target, V, capacity=16)
    causal = first_forward(ours)
    assert calls == [("causal", len(prompt))] * layers
    with monkeypatch.context() as never_causal:  # the same forward through the mask
        never_causal.setattr(compiled, "lower_triangle", lambda n: torch.zeros(n, n, dtype=torch.bool))
        masked_lm = StaticLM(runtimes[False].target, V, capacity=16)
        masked = first_forward(masked_lm)
        assert calls == [("mask", len(prompt))] * layers
        masked_lm.release()
    assert torch.equal(causal, masked)
    calls.clear()
    ours.extend([2, 5])
    tree = a_tree()
    base = ours.length
    visible = torch.cat([torch.ones(len(tree), base, dtype=torch.bool), tree.ancestry()], dim=1)
    ours.forward(tree.tokens, [base + d for d in tree.depths], visible)
    assert calls == [("mask", base)] * layers + [("mask", base + len(tree))] * layers
    ours.release()
    tree_first = StaticLM(runtimes[False].target, V, capacity=16)  # a tree in an empty cache: not causal
    calls.clear()
    tree_first.forward(tree.tokens, tree.depths, tree.ancestry())
    assert calls == [("mask", len(tree))] * layers
    tree_first.release()


@pytest.mark.parametrize("shared", [0, 2], ids=["nothing-shared", "a-shared-beginning"])
def test_prompts_read_together_attend_to_their_own_keys_only(pair, runtimes, monkeypatch, attention_calls, shared):
    """Prompts read into one cache one after the other (generate_together), each seeing the shared
    beginning and itself: each one's attention reads only those keys, causally (the beginning's seen
    by all), not the prompts before it, and gives the logits of the masked attention over them all."""
    calls, layers = attention_calls, len(pair[0].model.layers)
    beginning, prompts = [1, 2][:shared], [[3, 4, 5, 1, 2, 4], [5, 5, 1, 0, 3, 2, 1]]

    def read_together(lm: StaticLM) -> list[torch.Tensor]:
        if beginning:
            lm.extend(beginning)
        logits = []
        for prompt in prompts:
            past, n = lm.length, len(prompt)
            visible = torch.zeros(n, past + n, dtype=torch.bool)
            visible[:, :shared] = True
            visible[:, past:] = compiled.lower_triangle(n)
            calls.clear()
            logits.append(lm.forward(prompt, list(range(shared, shared + n)), visible))
        return logits

    ours = StaticLM(runtimes[False].target, V, capacity=32)
    together = read_together(ours)
    read = [len(prompts[1]) + shared] * layers  # the second prompt's forward: its keys and the beginning's
    assert calls == [("causal", read[0])] * layers
    ours.release()
    with monkeypatch.context() as every_key:
        every_key.setattr(compiled, "sight_of", lambda visible, mask: None)
        masked_lm = StaticLM(runtimes[False].target, V, capacity=32)
        masked = read_together(masked_lm)
        assert calls == [("mask", shared + len(prompts[0]) + len(prompts[1]))] * layers
        masked_lm.release()
    for ours_logits, masked_logits in zip(together, masked):
        torch.testing.assert_close(ours_logits, masked_logits, atol=1e-6, rtol=1e-6)


def test_what_attention_reads_is_worked_out_from_what_the_new_tokens_see():
    """sight_of: causal in an empty cache, and after at most half as many keys as the new tokens that
    they all see; every key through the mask after more (a chat's next message); where some keys are
    hidden from every new token, the seen ones only if the scores skipped outnumber the keys copied
    (a tree's rows in a long context hide a few: all are read)."""
    causal = compiled.lower_triangle
    mask_of = lambda visible: torch.zeros(visible.shape).masked_fill_(~visible, -math.inf)  # noqa: E731

    def sight(visible: torch.Tensor):
        found = compiled.sight_of(visible, mask_of(visible))
        if found is None:
            return None
        keys = None if found.keys is None else found.keys.tolist()
        if found.mask is not None:
            assert torch.equal(found.mask, mask_of(visible)[:, keys])
        return keys, "causal" if found.mask is None else "mask"

    def seen_by_all(before: int, n: int) -> torch.Tensor:
        return torch.cat([torch.ones(n, before, dtype=torch.bool), causal(n)], dim=1)

    def after_others(before: int, n: int) -> torch.Tensor:  # 6 keys of other prompts between
        return torch.cat([torch.ones(n, before, dtype=torch.bool), torch.zeros(n, 6, dtype=torch.bool), causal(n)], 1)

    assert sight(causal(5)) == (None, "causal")
    assert sight(seen_by_all(2, 4)) == (None, "causal")
    assert sight(seen_by_all(3, 4)) is None  # (3 rows of zeros would cost more than the mask)
    assert sight(after_others(2, 4)) == ([0, 1, 8, 9, 10, 11], "causal")
    assert sight(after_others(0, 4)) == ([6, 7, 8, 9], "causal")
    assert sight(after_others(3, 4)) == ([0, 1, 2, 9, 10, 11, 12], "mask")
    tree = torch.ones(3, 40, dtype=torch.bool)
    tree[:, 37:] = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a root and two children
    tree[:, 10:12] = False  # two keys none of them sees: 6 scores skipped would cost 38 keys copied
    assert sight(tree) is None
    tree[:, 10:30] = False  # twenty: 60 scores against 20 keys
    assert sight(tree) == (list(range(10)) + list(range(30, 40)), "mask")


def test_transformers_forward_reads_a_prompt_into_an_empty_cache_without_a_mask(pair, monkeypatch):
    """CachedLM (transformers' forward): a prompt read into an empty cache is given no mask, which
    transformers takes as causal (skipping the hidden half of the scores), with the logits the mask
    gives; after it, and for a tree, the mask."""
    model, masks = pair[0], []
    forward = model.forward

    def recorded(*args, **kwargs):
        masks.append(kwargs["attention_mask"])
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", recorded)
    prompt = PROMPT * 3
    ours = CachedLM(model, V)
    plain = ours.extend(prompt, last_only=False)
    assert masks == [None]
    n = len(prompt)
    mask = torch.zeros(n, n).masked_fill_(~compiled.lower_triangle(n), torch.finfo(torch.float32).min)
    with torch.inference_mode():  # (the forward before: the same prompt through the mask)
        masked = model(input_ids=torch.tensor([prompt]), position_ids=torch.arange(n)[None],
                       attention_mask=mask[None, None]).logits[0, :, :V]
    torch.testing.assert_close(plain, masked, atol=1e-6, rtol=1e-6)
    masks.clear()
    ours.extend([2, 5])
    assert masks[0] is not None and masks[0].shape[-2:] == (2, len(prompt) + 2)


def test_a_model_with_a_sliding_window_reads_its_prompt_without_rsds_masks():
    """A prompt into an empty cache goes without a mask for a sliding-window model too (every layer
    windowed, or all but the last): transformers makes its own, by slot, there each token's
    position, with a full forward's logits (rsd's two float masks would take the prompt's length
    squared each); what follows gets rsd's windowed masks, with a full forward's logits too."""
    from tiny import tiny_windowed

    for kind in ("mistral", "gemma3"):
        model, masks = tiny_windowed(kind, V, seed=0), []
        forward = model.forward
        model.forward = lambda *args, **kwargs: masks.append(kwargs["attention_mask"]) or forward(*args, **kwargs)
        prompt = [1, 3, 4, 5, 2, 0, 1, 3, 4, 5, 0, 4, 2, 2]  # (past the window of 8)
        lm = CachedLM(model, V)
        with torch.no_grad():
            assert torch.allclose(lm.extend(prompt)[-1], forward(torch.tensor([prompt])).logits[0, -1], atol=1e-5)
            later = lm.extend([3, 1])[-1]
            assert torch.allclose(later, forward(torch.tensor([prompt + [3, 1]])).logits[0, -1], atol=1e-5)
        assert masks[0] is None and masks[1] is not None, kind


WIDE_SHAPES = [make_shape("sd", draft_len=4), make_shape("rsd-c", branching=(4, 2)),
               make_shape("rsd-s", beam_width=6, depth=2), make_shape("mss", branching=(2, 2, 1))]


@pytest.mark.parametrize("index", range(len(WIDE_SHAPES)), ids=lambda i: WIDE_SHAPES[i].describe())
def test_a_fixed_shape_compiles_at_load_every_token_count_its_answer_runs(monkeypatch, tmp_path, index):
    """`rsd generate` of a drafting variant wider than WARM_SIZES (an `sd` chain of 4 verifies 5 tokens, a
    tree of 13 nodes 13, a level of 6 beams is drafted in one forward of 6) compiles those counts' graphs
    at load (compiled.warm_sizes), so that none is compiled, or read from the compile cache, in the middle
    of an answer. (Each model of each shape has layers of a width of its own: graphs compiled for another
    do not count.)"""
    from torch._dynamo.utils import counters

    from tiny import tiny_config
    from transformers import LlamaForCausalLM

    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path / "cache"))
    shape = WIDE_SHAPES[index]
    target, draft = (LlamaForCausalLM(tiny_config(V, layers, 0.1, intermediate_size=40 + 8 * index + extra)).eval()
                     for layers, extra in ((2, 0), (1, 4)))  # (the draft's layers too: graphs of their own)
    runtimes = Runtimes(*(compiled.runtime_for(model, "on", role, fixed=shape)
                          for model, role in ((target, "target"), (draft, "draft"))), "on")
    graphs = counters["stats"]["unique_graphs"]
    prompt = [1 + i % (V - 1) for i in range(20)]  # (beyond the buckets: its forward runs uncompiled)
    run((target, draft), runtimes, shape, SamplingParams(temperature=1.0), 24, seed=0, prompt=prompt)
    assert counters["stats"]["unique_graphs"] == graphs
