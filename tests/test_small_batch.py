"""The CPU small-batch linear: same product as F.linear for every row count, installed only where
it is meant to be (by default only where it measured faster on this machine), switchable off."""

import json

import pytest
import torch
import torch.nn.functional as F

from rsd_cli import small_batch
from rsd_cli.models import load_model
from tiny import tiny_model, tiny_tokenizer


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 12, 15, 16, 17, 64, 65, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_same_product_as_linear_for_every_row_count(rows, bias):
    torch.manual_seed(rows)
    layer = torch.nn.Linear(24, 40, bias=bias)
    x = torch.randn(1, rows, 24)
    expected = F.linear(x, layer.weight, layer.bias)
    assert small_batch.install(layer) == 1
    with torch.inference_mode():
        got = layer(x)
    assert got.shape == expected.shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_gradients_flow_through_it():
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 16)
    x = torch.randn(5, 8, requires_grad=True)
    F.linear(x, layer.weight, layer.bias).square().sum().backward()
    expected = x.grad.clone(), layer.weight.grad.clone()
    x.grad, layer.weight.grad = None, None
    small_batch.install(layer)
    layer(x).square().sum().backward()
    torch.testing.assert_close((x.grad, layer.weight.grad), expected)


def test_only_widening_fp32_layers_and_idempotent():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8), torch.nn.Linear(8, 8),
                                torch.nn.Linear(8, 16).to(torch.float64))
    assert small_batch.install(model) == 2
    assert small_batch.install(model) == 2
    patched = ["forward" in layer.__dict__ for layer in model]
    assert patched == [True, False, True, False]


def test_switched_off_by_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "0")
    layer = torch.nn.Linear(8, 16)
    assert small_batch.install(layer) == 0 and "forward" not in layer.__dict__
    tiny_model().save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    loaded, _ = load_model(str(tmp_path / "m"), torch.device("cpu"), torch.float32)
    assert small_batch.installed(loaded) == 0


def test_loaded_models_use_it_and_give_the_same_logits(tmp_path):
    model = tiny_model(vocab=40, layers=2)
    model.save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    loaded, _ = load_model(str(tmp_path / "m"), torch.device("cpu"), torch.float32)
    assert "forward" in loaded.lm_head.__dict__
    assert small_batch.installed(loaded, loaded) == 2 * 4 + 1  # layers x (q, o, gate, up) + head
    ids = torch.randint(0, 40, (1, 6))
    with torch.inference_mode():
        torch.testing.assert_close(loaded(ids).logits, model.eval()(ids).logits, rtol=1e-4, atol=1e-5)


class Fixed:
    """Verdicts decided in advance: faster for these (in, out) shapes only."""

    def __init__(self, faster_shapes):
        self.faster_shapes, self.asked = faster_shapes, []

    def faster(self, weights):
        out_features, in_features = weights[0].shape
        assert all(w.shape == weights[0].shape for w in weights)
        self.asked.append((in_features, out_features))
        return (in_features, out_features) in self.faster_shapes

    def one_row(self, weights):
        return False

    def save(self):
        pass


def test_auto_installs_it_only_for_shapes_measured_faster(monkeypatch):
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "auto")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8), torch.nn.Linear(8, 8),
                                torch.nn.Linear(8, 16))
    verdicts = Fixed({(8, 16)})
    assert small_batch.install(model, verdicts) == 2
    assert [small_batch.uses_small_batch(layer) for layer in model] == [True, False, False, True]
    assert sorted(verdicts.asked) == [(8, 8), (8, 16)]  # once per shape; narrowing layers are never candidates


def test_verdicts_are_measured_once_per_machine_and_shape_then_read_back(monkeypatch, tmp_path):
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "auto")
    measured = []
    monkeypatch.setattr(small_batch, "measure_gain", lambda ws: measured.append((len(ws), *ws[0].shape)) or 0.5)
    monkeypatch.setattr(small_batch, "measure_one_row_gain", lambda ws: 0.5 if ws[0].shape[0] == 32 else 1.2)
    path = tmp_path / "cache" / "small-batch.json"
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(8, 16), torch.nn.Linear(8, 32))
    assert small_batch.install(model, small_batch.Verdicts.load(path)) == 3
    assert measured == [(2, 16, 8), (1, 32, 8)]  # one measurement per shape, its layers together
    assert [small_batch.kernel_code(layer) for layer in model] == [1, 1, 2]  # single rows padded: 8x32 only
    saved = json.loads(path.read_text())
    assert len(saved) == 4 and all(key.startswith(small_batch.machine()) for key in saved)
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(8, 32))
    assert small_batch.install(fresh, small_batch.Verdicts.load(path)) == 2
    assert len(measured) == 2  # read back, not measured again
    monkeypatch.setattr(small_batch, "measure_gain", lambda w: 1.3)  # slower on another machine
    monkeypatch.setattr(small_batch, "machine", lambda: "another cpu")
    other = torch.nn.Sequential(torch.nn.Linear(8, 16))
    assert small_batch.install(other, small_batch.Verdicts.load(path)) == 0
    assert len(json.loads(path.read_text())) == 5  # (no single-row verdict where the kernel is not used)


def test_an_unreadable_or_unwritable_cache_only_means_measuring_again(monkeypatch, tmp_path):
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "auto")
    monkeypatch.setattr(small_batch, "measure_gain", lambda w: 0.5)
    monkeypatch.setattr(small_batch, "measure_one_row_gain", lambda w: 0.5)
    broken = tmp_path / "small-batch.json"
    broken.write_text("{not json")
    assert small_batch.install(torch.nn.Linear(8, 16), small_batch.Verdicts.load(broken)) == 1
    blocked = tmp_path / "file" / "small-batch.json"
    (tmp_path / "file").write_text("a file where the folder should be")
    assert small_batch.install(torch.nn.Linear(8, 16), small_batch.Verdicts.load(blocked)) == 1


def test_the_measured_gain_compares_the_two_kernels(monkeypatch):
    """measure_gain is our time over torch's: slowing our kernel down must raise it above 1."""
    weight = torch.randn(256, 64)
    real = small_batch.small_batch_linear

    def slowed(x, w, bias=None, one_row=False):
        for _ in range(20):
            real(x, w, bias, one_row)
        return real(x, w, bias, one_row)

    monkeypatch.setattr(small_batch, "small_batch_linear", slowed)
    assert small_batch.measure_gain([weight, weight.clone()]) > 1.5


def test_a_single_row_padded_to_two_gives_torch_s_product(monkeypatch):
    weight, bias = torch.randn(256, 64), torch.randn(256)
    x = torch.randn(1, 1, 64)
    padded = small_batch.small_batch_linear(x, weight, bias, one_row=True)
    assert padded.shape == (1, 1, 256)
    torch.testing.assert_close(padded, torch.nn.functional.linear(x, weight, bias))
    real = small_batch.small_batch_linear
    monkeypatch.setattr(small_batch, "small_batch_linear",
                        lambda x, w, bias=None, one_row=False: [real(x, w, bias, one_row) for _ in range(20)][0])
    assert small_batch.measure_one_row_gain([weight]) > 1.5


def test_calibration_streams_a_bounded_share_of_a_big_model(monkeypatch):
    timed = []
    monkeypatch.setattr(small_batch, "_median_seconds", lambda fn, x: timed.append(len(fn(x))) or 1.0)
    monkeypatch.setattr(small_batch, "CALIBRATION_BYTES", 3 * 64 * 32 * 4)  # three 64x32 fp32 weights
    weights = [torch.randn(64, 32) for _ in range(10)]
    assert small_batch.measure_gain(weights) == 1.0
    assert set(timed) == {3}
    timed.clear()
    small_batch.measure_gain(weights[:1])
    assert set(timed) == {1}
