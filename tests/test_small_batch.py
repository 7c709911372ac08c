"""The CPU small-batch linear: same product as F.linear for every row count, installed only where
it is meant to be, and switchable off."""

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
