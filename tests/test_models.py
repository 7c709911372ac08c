from pathlib import Path

import pytest
import torch

from rsd_cli import models
from rsd_cli.errors import RsdError
from tiny import tiny_model, write_tiny_gguf


def test_gguf_is_dequantised_once_then_loaded_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path / "cache"))
    original = tiny_model(40, layers=2, seed=0, scale=0.3)
    gguf_file = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_file, original)

    cached = models.gguf_to_cache(gguf_file)
    assert cached.parent.parent == tmp_path / "cache"
    assert (cached / "model.safetensors").is_file() and (cached / "rsd-complete").is_file()
    model, tokenizer = models.load_model(str(gguf_file), torch.device("cpu"), torch.float32)
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, original(ids).logits, atol=1e-5)
    assert tokenizer.convert_ids_to_tokens([5]) == ["c"]

    # the second load must not convert again
    def boom(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", boom, raising=True)
    assert models.gguf_to_cache(gguf_file) == cached


def test_unreadable_gguf_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(RsdError, match="cannot load GGUF file"):
        models.load_model(str(bad), torch.device("cpu"), torch.float32)


def test_early_exit_draft_shares_the_targets_tensors():
    target = tiny_model(40, layers=3, seed=0)
    draft = models.early_exit_draft(target, 2)
    assert type(draft) is type(target)
    assert draft.config.num_hidden_layers == 2
    target_ptrs = {p.data_ptr() for p in target.parameters()}
    assert all(p.data_ptr() in target_ptrs for p in draft.parameters())
    assert draft.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states[2]  # after 2 layers
        expected = target.lm_head(target.model.norm(hidden))
        assert torch.allclose(draft(ids).logits, expected, atol=1e-5)
    assert models.params_read(draft) < models.params_read(target)
    with pytest.raises(RsdError, match="only 3 layers"):
        models.early_exit_draft(target, 3)


def test_adapter_round_trip_and_fingerprint_check(tmp_path):
    target = tiny_model(40, layers=3, seed=0)
    layer = models.new_adapter_layer(target, 1)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.01)
    path = tmp_path / "adapter.safetensors"
    models.save_adapter(layer, path, target, 1, {"epochs": 1})
    loaded = models.load_adapter(path, target, 1)
    for a, b in zip(layer.parameters(), loaded.parameters()):
        assert torch.equal(a, b)
    draft = models.early_exit_draft(target, 1, loaded)
    assert draft.config.num_hidden_layers == 2
    assert draft(torch.tensor([[1, 2]])).logits.shape == (1, 2, 40)

    other = tiny_model(40, layers=3, seed=5)
    with pytest.raises(RsdError, match="trained for another target"):
        models.load_adapter(path, other, 1)
    with pytest.raises(RsdError, match="trained after 1 layers"):
        models.load_adapter(path, target, 2)
    with pytest.raises(RsdError, match="adapter file not found"):
        models.load_adapter(tmp_path / "none.safetensors", target, 1)


def test_sources_are_resolved_with_clear_errors(tmp_path):
    with pytest.raises(RsdError, match="model not found"):
        models.resolve_source(str(tmp_path / "missing"))
    (tmp_path / "dir").mkdir()
    with pytest.raises(RsdError, match="not a model directory"):
        models.resolve_source(str(tmp_path / "dir"))
    assert models.resolve_source("HuggingFaceTB/SmolLM2-135M") == ("HuggingFaceTB/SmolLM2-135M", False)


def test_unreachable_hub_id_fails_fast(monkeypatch):
    monkeypatch.setattr(models, "hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(RsdError, match="cannot load 'nobody/no-such-model-xyz' from the Hugging Face hub"):
        models.load_model("nobody/no-such-model-xyz", torch.device("cpu"), torch.float32)


def test_embedded_model_is_found_without_importing_its_package():
    import sys

    path = models.embedded_gguf()
    assert path.name == models.EMBEDDED_FILE and path.is_file()
    assert models.EMBEDDED_PACKAGE not in sys.modules


def test_reduced_vocabulary_draft_head_is_a_shared_view_and_decoding_stays_exact():
    from rsd_cli.drafting import make_shape
    from rsd_cli.engine import Decoder
    from rsd_cli.sampling import SamplingParams

    target = tiny_model(40, layers=3, seed=0, scale=0.3)
    draft = models.early_exit_draft(target, 1, vocab=20)
    assert draft.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    assert draft(torch.tensor([[1, 2]])).logits.shape[-1] == 20
    from rsd_cli.small_batch import uses_small_batch

    # a new (widening: 36 rows > 32 hidden) head gets the target's CPU kernels too
    assert uses_small_batch(models.early_exit_draft(target, 1, vocab=36).lm_head)
    assert models.params_read(draft) < models.params_read(models.early_exit_draft(target, 1))

    def run(shape):
        decoder = Decoder(target, draft, 40, shape, SamplingParams(0.0), set())
        return [t for e in decoder.generate([1, 5, 6], 20, seed=0) for t in e.emitted]

    reference = run(make_shape("ar"))
    assert run(make_shape("rsd-s", beam_width=2, depth=3)) == reference
    assert run(make_shape("sd", draft_len=3)) == reference
