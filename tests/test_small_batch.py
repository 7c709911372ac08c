"""The CPU linear kernels (torch's, transposed, oneDNN, oneDNN on packed weights): each the same
product as F.linear for every row count, with gradients, and after the weight changes; chosen per
shape where measured faster on this machine (measured once, cached), or forced, or switched off."""

import json

import pytest
import torch
import torch.nn.functional as F

from rsd_cli import small_batch
from rsd_cli.models import load_model
from tiny import tiny_model, tiny_tokenizer


# (the "blocks" kernel serves quantised weights only: tests/test_blocks.py)
KERNELS = [k for k in small_batch.KERNELS if k not in ("onednn", "packed", "blocks") or
           (k != "blocks" and small_batch.onednn_available())]


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 12, 15, 16, 17, 64, 65, 130])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kernel", KERNELS)
def test_same_product_as_linear_for_every_row_count(rows, bias, kernel, monkeypatch):
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", kernel)
    torch.manual_seed(rows)
    layer = torch.nn.Linear(24, 40, bias=bias)
    x = torch.randn(1, rows, 24)
    expected = F.linear(x, layer.weight, layer.bias)
    assert small_batch.install(layer) == (kernel != "torch")
    assert small_batch.kernels_of(layer) == ((kernel, kernel, "torch") if kernel != "torch" else small_batch.TORCH)
    with torch.inference_mode():
        got = layer(x)
        direct = small_batch.kernel_linear(x, layer.weight, layer.bias, (kernel, kernel, "torch"))
    assert got.shape == expected.shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(direct, expected, rtol=1e-5, atol=1e-5)


def test_the_onednn_kernel_is_available_on_this_machine():
    """CI runs on an x86 CPU build of torch: oneDNN's linear is there, so the suite covers it."""
    assert small_batch.onednn_available()


@pytest.mark.parametrize("kernel", KERNELS)
def test_gradients_flow_through_it(kernel, monkeypatch):
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", kernel)
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 16)
    x = torch.randn(5, 8, requires_grad=True)
    F.linear(x, layer.weight, layer.bias).square().sum().backward()
    expected = x.grad.clone(), layer.weight.grad.clone()
    x.grad, layer.weight.grad = None, None
    small_batch.install(layer)
    layer(x).square().sum().backward()
    torch.testing.assert_close((x.grad, layer.weight.grad), expected)


def test_every_fp32_cpu_layer_and_idempotent():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8), torch.nn.Linear(8, 8),
                                torch.nn.Linear(8, 16).to(torch.float64))
    assert small_batch.install(model) == 3
    assert small_batch.install(model) == 3
    patched = ["forward" in layer.__dict__ for layer in model]
    assert patched == [True, True, True, False]


def test_a_linear_with_a_forward_of_its_own_keeps_it():
    """A subclass of torch's linear whose forward computes more (Phi-3.5-MoE's router returns its
    routing too) keeps its forward: the model answers as before, its other linears on the kernels."""
    from tiny import tiny_relative

    model = tiny_relative("phimoe", 40, layers=1)
    ids = torch.tensor([[1, 5, 7, 9]])
    with torch.inference_mode():
        expected = model(ids).logits
        assert small_batch.install(model) == 5  # (q, k, v, o and the head; not the router)
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)
    assert "forward" not in model.model.layers[0].mlp.router.__dict__


def test_switched_off_by_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "0")
    layer = torch.nn.Linear(8, 16)
    assert small_batch.install(layer) == 0 and "forward" not in layer.__dict__
    tiny_model().save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    loaded, _ = load_model(str(tmp_path / "m"), torch.device("cpu"), torch.float32)
    assert small_batch.installed(loaded) == 0


@pytest.mark.parametrize("kernel", ["transposed", "onednn", "packed"])
def test_loaded_models_use_it_and_give_the_same_logits(tmp_path, monkeypatch, kernel):
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", kernel)
    model = tiny_model(vocab=40, layers=2)
    model.save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    loaded, _ = load_model(str(tmp_path / "m"), torch.device("cpu"), torch.float32)
    assert "forward" in loaded.lm_head.__dict__
    assert small_batch.installed(loaded, loaded) == 2 * 7 + 1  # layers x (q, k, v, o, gate, up, down) + head
    ids = torch.randint(0, 40, (1, 6))
    with torch.inference_mode():
        torch.testing.assert_close(loaded(ids).logits, model.eval()(ids).logits, rtol=1e-4, atol=1e-5)


class Fixed:
    """Verdicts decided in advance: these kernels for these (in, out) shapes, torch's elsewhere."""

    def __init__(self, kernels_by_shape):
        self.kernels_by_shape, self.asked = kernels_by_shape, []

    def kernels(self, weights, blocks=None):
        out_features, in_features = weights[0].shape
        assert all(w.shape == weights[0].shape for w in weights)
        self.asked.append((in_features, out_features))
        return self.kernels_by_shape.get((in_features, out_features), small_batch.TORCH)

    def save(self):
        pass


def test_auto_installs_the_kernels_measured_faster_for_each_shape(monkeypatch):
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "auto")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8), torch.nn.Linear(8, 8),
                                torch.nn.Linear(8, 16))
    verdicts = Fixed({(8, 16): ("onednn", "transposed", "torch"), (16, 8): ("torch", "onednn", "torch")})
    assert small_batch.install(model, verdicts) == 3
    assert [small_batch.kernels_of(layer) for layer in model] == [
        ("onednn", "transposed", "torch"), ("torch", "onednn", "torch"), small_batch.TORCH,
        ("onednn", "transposed", "torch")]
    assert "forward" not in model[2].__dict__  # torch's everywhere: left as it was
    assert sorted(verdicts.asked) == [(8, 8), (8, 16), (16, 8)]  # once per shape
    calls = []
    monkeypatch.setattr(small_batch, "onednn_linear", lambda x, w, b: calls.append("onednn") or F.linear(x, w, b))
    monkeypatch.setattr(small_batch, "transposed_linear", lambda x, w, b: calls.append("transposed") or F.linear(x, w, b))
    with torch.inference_mode():
        model[0](torch.randn(1, 8)), model[0](torch.randn(3, 8)), model[0](torch.randn(65, 8))
        model[1](torch.randn(1, 16)), model[1](torch.randn(4, 16))
    assert calls == ["onednn", "transposed", "onednn"]  # by row count; prompts (> 64 rows) on torch's


def test_verdicts_are_measured_once_per_machine_and_shape_then_read_back(monkeypatch, tmp_path):
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "auto")
    measured = []

    def measure(weights, rows, blocks=None, kernels=None):
        measured.append((len(weights), *weights[0].shape, rows))
        wide = weights[0].shape[0] == 32
        return {"torch": 1.0, "transposed": 0.5 if rows != (1,) or wide else 1.2, "onednn": 0.7}

    monkeypatch.setattr(small_batch, "measure_kernels", measure)
    path = tmp_path / "cache" / "small-batch.json"
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(8, 16), torch.nn.Linear(8, 32))
    assert small_batch.install(model, small_batch.Verdicts.load(path)) == 3
    assert measured == [(2, 16, 8, (1,)), (2, 16, 8, (2, 4, 8)), (1, 32, 8, (1,)), (1, 32, 8, (2, 4, 8))]
    assert [small_batch.kernels_of(layer) for layer in model] == [("onednn", "transposed", "torch")] * 2 + [
        ("transposed", "transposed", "torch")]
    saved = json.loads(path.read_text())
    assert len(saved) == 2 and all(key.startswith(small_batch.machine()) for key in saved)
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(8, 32))
    assert small_batch.install(fresh, small_batch.Verdicts.load(path)) == 2
    assert len(measured) == 4  # read back, not measured again
    monkeypatch.setattr(small_batch, "measure_kernels", lambda w, rows, blocks=None: {"torch": 1.0, "transposed": 1.3, "onednn": 0.95})
    monkeypatch.setattr(small_batch, "machine", lambda: "another cpu")
    other = torch.nn.Sequential(torch.nn.Linear(8, 16))
    assert small_batch.install(other, small_batch.Verdicts.load(path)) == 0  # 5% faster is not enough
    assert len(json.loads(path.read_text())) == 3


def test_an_unreadable_or_unwritable_cache_only_means_measuring_again(monkeypatch, tmp_path):
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "auto")
    monkeypatch.setattr(small_batch, "measure_kernels", lambda w, rows, blocks=None: {"torch": 1.0, "transposed": 0.5})
    broken = tmp_path / "small-batch.json"
    broken.write_text("{not json")
    assert small_batch.install(torch.nn.Linear(8, 16), small_batch.Verdicts.load(broken)) == 1
    blocked = tmp_path / "file" / "small-batch.json"
    (tmp_path / "file").write_text("a file where the folder should be")
    assert small_batch.install(torch.nn.Linear(8, 16), small_batch.Verdicts.load(blocked)) == 1


@pytest.mark.parametrize("slowed", ["transposed_linear", "onednn_linear"])
def test_the_measurement_times_each_kernel(monkeypatch, slowed):
    """Slowing one kernel down must show in its time, and only in its."""
    if slowed == "onednn_linear" and not small_batch.onednn_available():
        pytest.skip("no oneDNN in this torch")
    weight = torch.randn(256, 64)
    real = getattr(small_batch, slowed)
    monkeypatch.setattr(small_batch, slowed, lambda x, w, b: [real(x, w, b) for _ in range(20)][0])
    seconds = small_batch.measure_kernels([weight, weight.clone()], (1, 4))
    kernel = slowed.removesuffix("_linear")
    assert seconds[kernel] > 5 * seconds["torch"]
    assert small_batch.fastest(seconds) != kernel


def test_the_fastest_kernel_must_beat_torch_s_clearly():
    assert small_batch.fastest({"torch": 1.0, "transposed": 0.95, "onednn": 0.92}) == "torch"
    assert small_batch.fastest({"torch": 1.0, "transposed": 0.9, "onednn": 0.5}) == "onednn"
    assert small_batch.fastest({"torch": 1.0, "transposed": 0.8}) == "transposed"


def test_a_single_row_padded_to_two_gives_torch_s_product():
    weight, bias = torch.randn(256, 64), torch.randn(256)
    x = torch.randn(1, 1, 64)
    padded = small_batch.transposed_linear(x, weight, bias)
    assert padded.shape == (1, 1, 256)
    torch.testing.assert_close(padded, torch.nn.functional.linear(x, weight, bias))


def test_kernels_are_timed_in_interleaved_rounds_in_a_rotating_order(monkeypatch):
    """A slow spell of the machine during one round falls on every kernel alike: the medians and
    the verdict stay those of the other rounds."""
    order, spell = [], iter([9.0] * 3 + [0.0] * 100)  # the first round's three timings run 9 s slow
    speed = {"torch": 1.0, "transposed": 0.8, "onednn": 1.1}
    monkeypatch.setattr(small_batch, "_seconds", lambda fn, x: fn(x) + next(spell))
    runs = {name: (lambda x, name=name: order.append(name) or speed[name]) for name in speed}
    medians = small_batch._interleaved_medians(runs, torch.zeros(1), 3)
    assert order == ["torch", "transposed", "onednn", "transposed", "onednn", "torch", "onednn", "torch", "transposed"]
    assert medians == speed
    assert small_batch.fastest(medians) == "transposed"


def test_a_close_verdict_is_measured_twice_more_and_the_medians_decide():
    measurements = iter([{"torch": 1.0, "blocks": 0.88}, {"torch": 1.0, "blocks": 0.97}, {"torch": 1.0, "blocks": 0.95}])
    assert small_batch.close_call({"torch": 1.0, "blocks": 0.88})
    assert small_batch.settled_fastest(lambda: next(measurements)) == "torch"  # 0.88 once; 0.95 the median
    assert next(measurements, None) is None
    clear = iter([{"torch": 1.0, "blocks": 0.6}, {"torch": 1.0, "blocks": 2.0}])
    assert small_batch.settled_fastest(lambda: next(clear)) == "blocks"  # far from the threshold: once
    assert next(clear) == {"torch": 1.0, "blocks": 2.0}
    prompts = iter([{"torch": 1.0, "blocks": 1.05}, {"torch": 1.0, "blocks": 0.9}, {"torch": 1.0, "blocks": 0.97}])
    assert small_batch.settled_fastest(lambda: next(prompts), required=1.0) == "blocks"  # prompts: no margin
    assert not small_batch.close_call({"torch": 1.0})  # torch alone: nothing to decide


def test_calibration_streams_a_bounded_share_of_a_big_model(monkeypatch):
    timed = []
    monkeypatch.setattr(small_batch, "_seconds", lambda fn, x: timed.append(len(fn(x))) or 1.0)
    monkeypatch.setattr(small_batch, "CALIBRATION_BYTES", 3 * 64 * 32 * 4)  # three 64x32 fp32 weights
    weights = [torch.randn(64, 32) for _ in range(10)]
    assert set(small_batch.measure_kernels(weights, (1, 2)).values()) == {2.0}
    assert set(timed) == {3}
    timed.clear()
    small_batch.measure_kernels(weights[:1], (2,))
    assert set(timed) == {1}


def test_a_packed_weight_follows_changes_to_the_layer_s_weight(monkeypatch):
    """A trained (changed in place) or reassigned weight is packed again: never a stale product."""
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "packed")
    layer = torch.nn.Linear(24, 40)
    assert small_batch.install(layer) == 1 and small_batch.packed_of(layer) is not None
    x = torch.randn(3, 24)
    with torch.no_grad():
        layer.weight.mul_(2.0)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        layer.weight = torch.nn.Parameter(torch.randn(40, 24))
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_layers_sharing_a_weight_share_its_packed_copy(monkeypatch):
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "packed")
    first = torch.nn.Linear(8, 16)
    second = torch.nn.Linear(8, 16)
    second.weight = first.weight
    small_batch.install(torch.nn.Sequential(first, second))
    assert small_batch.packed_of(first) is small_batch.packed_of(second)


def test_without_room_for_packed_copies_the_layers_use_oneDNN_on_their_own_weights(monkeypatch):
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "packed")
    monkeypatch.setattr(small_batch, "available_memory", lambda: 2 * 16 * 8 * 4 - 1)  # half of it < one weight
    layer = torch.nn.Linear(8, 16)
    assert small_batch.install(layer) == 1
    assert small_batch.kernels_of(layer) == ("onednn", "onednn", "torch") and small_batch.packed_of(layer) is None
    monkeypatch.setattr(small_batch, "available_memory", lambda: 2 * 16 * 8 * 4)
    other = torch.nn.Linear(8, 16)
    small_batch.install(other)
    assert small_batch.kernels_of(other) == ("packed", "packed", "torch") and small_batch.packed_of(other) is not None


def test_the_signature_names_each_shape_s_kernels(monkeypatch):
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "auto")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
    small_batch.install(model, Fixed({(8, 16): ("onednn", "transposed", "torch")}))
    assert small_batch.signature(model) == "16x8 torch/torch/torch, 8x16 onednn/transposed/torch"


def test_a_copied_layer_packs_its_own_weight(monkeypatch):
    import copy

    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "packed")
    layer = torch.nn.Linear(24, 40)
    small_batch.install(layer)
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        twin.weight.mul_(-1.0)
        x = torch.randn(2, 24)
        torch.testing.assert_close(twin(x), F.linear(x, twin.weight, twin.bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert small_batch.packed_of(twin) is not small_batch.packed_of(layer)


def test_training_a_packed_layer_does_not_repack_it_at_every_step(monkeypatch):
    """Products that need gradients run on torch's kernel; the copy is packed again only when a
    product without gradients needs it after the weight changed."""
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "packed")
    layer = torch.nn.Linear(8, 16)
    small_batch.install(layer)
    packs = []
    real = small_batch.packed_weight
    monkeypatch.setattr(small_batch, "packed_weight", lambda w: packs.append(1) or real(w))
    optimiser = torch.optim.SGD(layer.parameters(), lr=0.1)
    for _ in range(3):
        optimiser.zero_grad()
        layer(torch.randn(4, 8)).square().sum().backward()
        optimiser.step()
    assert packs == []
    with torch.no_grad():
        x = torch.randn(3, 8)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert packs == [1]


def test_a_layer_made_in_inference_mode_packs_too(monkeypatch):
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "packed")
    with torch.inference_mode():
        layer = torch.nn.Linear(8, 16)
        small_batch.install(layer)
        x = torch.randn(2, 8)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
