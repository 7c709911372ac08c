"""Light loading (rsd_cli/llama.py): a Llama checkpoint read into rsd's own modules, without
transformers' modeling code, must be the model transformers loads — the same tensors under the same
names, fingerprint, rotary tables, end-of-sequence ids and logits on the static-cache runtime — and
be used only where nothing runs transformers' forward."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from rsd_cli import llama, models
from rsd_cli.cli import app
from rsd_cli.compiled import CompiledModel, StaticLM
from rsd_cli.errors import RsdError
from rsd_cli.prompting import encode_prompt
from tiny import tiny_model, tiny_relative, tiny_tokenizer

V = 40


def _save(model, folder: Path, **save) -> Path:
    model.save_pretrained(folder, **save)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _both(folder: Path):
    """(light model, transformers' model) of the same folder."""
    light = models.load_model(str(folder), torch.device("cpu"), torch.float32, light=True)[0]
    full = models.load_model(str(folder), torch.device("cpu"), torch.float32)[0]
    return light, full


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return _save(tiny_model(V, layers=3, seed=4, scale=0.3), tmp_path_factory.mktemp("light") / "m")


def test_a_llama_folder_loads_light_and_holds_transformers_tensors_names_and_fingerprint(tiny_dir):
    assert llama.why_not(tiny_dir) is None
    light, full = _both(tiny_dir)
    assert isinstance(light, llama.LlamaForCausalLM) and not isinstance(full, llama.LlamaForCausalLM)
    ours, theirs = light.state_dict(), full.state_dict()
    assert list(ours) == list(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    assert models.fingerprint(light) == models.fingerprint(full)
    assert models.weight_sample(light) == models.weight_sample(full)
    assert models.params_read(light) == models.params_read(full)
    assert models._eos_ids(tiny_tokenizer(), light) == models._eos_ids(tiny_tokenizer(), full)
    positions = torch.arange(256)[None]
    for a, b in zip(light.model.rotary_emb(torch.zeros(1), positions), full.model.rotary_emb(torch.zeros(1), positions)):
        assert torch.equal(a, b)
    assert (light.model.layers[1].self_attn.head_dim, light.model.layers[1].self_attn.scaling) == \
        (full.model.layers[1].self_attn.head_dim, full.model.layers[1].self_attn.scaling)
    with pytest.raises(RsdError, match="static-cache runtime only"):
        light(torch.tensor([[1, 2]]))


def test_the_generic_fast_tokenizer_loads_without_the_models_config(tiny_dir, tmp_path):
    from transformers import AutoTokenizer

    light, full = models._light_tokenizer(tiny_dir), AutoTokenizer.from_pretrained(str(tiny_dir))
    assert type(light).__name__ == "LightTokenizer"  # (read without transformers: tests/test_light_tokenizer.py)
    text = "hello, world!\nwho's there?"
    assert light.encode(text) == full.encode(text) and light.decode(light.encode(text)) == full.decode(full.encode(text))
    chat = [{"role": "user", "content": "hi"}]
    assert light.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        full.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert (light.eos_token_id, light.get_vocab()) == (full.eos_token_id, full.get_vocab())
    other = tmp_path / "other"
    shutil.copytree(tiny_dir, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    # a key the light tokenizer does not know: transformers' generic class, loaded directly
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "some_new_key": 1}))
    generic = models._light_tokenizer(other)
    assert type(generic) is type(full) and generic.encode(text) == full.encode(text)
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    assert models._light_tokenizer(other) is None  # a class of its own: AutoTokenizer picks it


def _static_logits(model, tokens: list[int], static_shapes: bool = False) -> torch.Tensor:
    """Logits of every token on the static-cache runtime (static_shapes: the path CUDA graphs replay)."""
    lm = StaticLM(CompiledModel(model, compile=False, static_shapes=static_shapes), V, capacity=32)
    with torch.inference_mode():
        logits = lm.extend(tokens, last_only=False)
    lm.release()
    return logits


def test_light_models_give_transformers_logits_and_so_does_their_early_exit_draft(tiny_dir):
    light, full = _both(tiny_dir)
    tokens = [1, 5, 9, 3, 17, 22, 8, 30]
    ours = _static_logits(light, tokens)
    assert torch.equal(ours, _static_logits(full, tokens))
    with torch.inference_mode():
        eager = full(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, eager, atol=1e-5, rtol=1e-5)
    assert torch.equal(_static_logits(light, tokens[:4], True), _static_logits(full, tokens[:4], True))
    # an early-exit draft (adapter + own norm and 16-row head) on each: the same modules, the same logits
    drafts = []
    for target in (light, full):
        adapter = models.new_adapter(target, 2, head_rows=16)
        drafts.append(models.early_exit_draft(target, 2, adapter, vocab=16))
    assert type(drafts[0]) is llama.LlamaForCausalLM
    assert list(drafts[0].state_dict()) == list(drafts[1].state_dict())
    assert torch.equal(_static_logits(drafts[0], tokens), _static_logits(drafts[1], tokens))


@pytest.mark.parametrize("kind", ["qwen2", "mistral", "qwen3"])
def test_qwen2_mistral_and_qwen3_folders_load_light_as_transformers_loads_them(kind, tmp_path):
    """The same tensors under the same names (Qwen2's q/k/v biases, Qwen3's head norms included),
    fingerprint, rotary tables and logits on the static-cache runtime, and an early-exit draft of
    the same class."""
    folder = _save(tiny_relative(kind, V, layers=3, seed=4), tmp_path / kind)
    assert llama.why_not(folder) is None
    light, full = _both(folder)
    assert type(light) is llama.CLASSES[kind] and type(light).__name__ == type(full).__name__
    ours, theirs = light.state_dict(), full.state_dict()
    assert list(ours) == list(theirs) and any(name.endswith("q_proj.bias") for name in ours) == (kind == "qwen2")
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    assert models.fingerprint(light) == models.fingerprint(full)
    tokens = [1, 5, 9, 3, 17, 22, 8, 30]
    assert torch.equal(_static_logits(light, tokens), _static_logits(full, tokens))
    with torch.inference_mode():
        torch.testing.assert_close(_static_logits(light, tokens), full(torch.tensor([tokens])).logits[0],
                                   atol=1e-5, rtol=1e-5)
    draft = models.early_exit_draft(light, 2, models.new_adapter(light, 2, head_rows=16), vocab=16)
    assert type(draft) is llama.CLASSES[kind]
    # the tokenizer transformers picks for the family (Qwen2's own class reads a generic file its own
    # way): the same prompt ids loaded light or not
    tokenizers = [models.load_model(str(folder), torch.device("cpu"), torch.float32, light=flag)[1] for flag in (1, 0)]
    assert encode_prompt(tokenizers[0], "hello, you") == encode_prompt(tokenizers[1], "hello, you")
    config = json.loads((folder / "config.json").read_text())
    windowed = {"qwen2": {"use_sliding_window": True, "sliding_window": 4}, "mistral": {"sliding_window": 4},
                "qwen3": {"use_sliding_window": True, "sliding_window": 4}}[kind]
    windowed_folder = _edited(folder, tmp_path / "a", **windowed)
    if kind == "mistral":  # (every layer's window: in the static-cache runtime's masks, loaded light too)
        assert llama.why_not(windowed_folder) is None
        light, full = _both(windowed_folder)
        long = [1, 5, 9, 3, 17, 22, 8, 30, 2, 7]  # (past the window of 4)
        with torch.inference_mode():
            torch.testing.assert_close(_static_logits(light, long), full(torch.tensor([long])).logits[0],
                                       atol=1e-5, rtol=1e-5)
    else:
        assert llama.why_not(windowed_folder) == f"{kind}'s sliding-window attention (on the layers past " \
                                                 "max_window_layers)"
    assert llama.why_not(_edited(folder, tmp_path / "b", sliding_window=config["max_position_embeddings"])) is None
    unstated = tmp_path / "unstated"
    shutil.copytree(folder, unstated)
    (unstated / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "rms_norm_eps"}))
    assert llama.why_not(unstated) == "a config.json that leaves out rms_norm_eps"  # (its class's default, not Llama's)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
    {"rope_type": "linear", "factor": 2.0},
], ids=["llama3", "linear"])
def test_rotary_scalings_load_light_with_transformers_tables(scaling, tmp_path):
    """Llama 3.1's rotary scaling (long wavelengths divided, middle ones smoothed) and linear
    scaling: the same tables bit for bit as transformers computes, so the same logits."""
    from transformers import LlamaForCausalLM

    from tiny import tiny_config

    torch.manual_seed(3)
    config = tiny_config(V, 2, 0.3, head_dim=32, rope_parameters={"rope_theta": 500000.0, **scaling})
    folder = _save(LlamaForCausalLM(config).eval(), tmp_path / scaling["rope_type"])
    assert llama.why_not(folder) is None
    light, full = _both(folder)
    assert light.model.rotary_emb.rope_type == full.model.rotary_emb.rope_type == scaling["rope_type"]
    positions = torch.arange(256)[None]
    for a, b in zip(light.model.rotary_emb(torch.zeros(1), positions), full.model.rotary_emb(torch.zeros(1), positions)):
        assert torch.equal(a, b)
    unscaled = llama.inverse_frequencies(SimpleNamespace(head_dim=32, rope_parameters={"rope_theta": 500000.0,
                                                                                        "rope_type": "default"}))
    assert not torch.equal(light.model.rotary_emb.inv_freq, unscaled)  # (the scaling did something)
    tokens = [1, 5, 9, 3, 17, 22, 8, 30]
    assert torch.equal(_static_logits(light, tokens), _static_logits(full, tokens))


def test_tied_and_sharded_checkpoints_load_light(tmp_path):
    tied = tiny_model(V, layers=2, seed=5)
    tied.config.tie_word_embeddings = True
    tied.tie_weights()
    light, full = _both(_save(tied, tmp_path / "tied"))
    assert light.lm_head.weight is light.model.embed_tokens.weight
    assert models.fingerprint(light) == models.fingerprint(full)
    assert torch.equal(light.lm_head.weight, full.lm_head.weight)

    from safetensors.torch import load_file, save_file

    older = _save(tiny_model(V, layers=2, seed=7), tmp_path / "older")  # with the rotary table saved, as some were
    tensors = load_file(str(older / llama.WEIGHTS))
    tensors["model.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(tensors, str(older / llama.WEIGHTS), metadata={"format": "pt"})
    generation = json.loads((older / "generation_config.json").read_text())
    (older / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [2, 5]}))
    light, full = _both(older)
    assert models.fingerprint(light) == models.fingerprint(full)
    assert models._eos_ids(tiny_tokenizer(), light) == models._eos_ids(tiny_tokenizer(), full) == {2, 5}
    (older / "generation_config.json").unlink()
    assert llama.load(older, torch.device("cpu"), torch.float32).generation_config.eos_token_id == 2  # the config's

    sharded = _save(tiny_model(V, layers=2, seed=6), tmp_path / "sharded", max_shard_size="20KB")
    assert (sharded / llama.INDEX).is_file() and not (sharded / llama.WEIGHTS).exists()
    light, full = _both(sharded)
    for name, tensor in full.state_dict().items():
        assert torch.equal(light.state_dict()[name], tensor), name


def test_a_hub_model_in_the_local_hub_cache_loads_light(tiny_dir, tmp_path, monkeypatch):
    """A hub id whose files are in the hub cache (its main revision) loads light from there; one
    with a shard missing (a download cut short) or not cached at all loads through transformers."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--tiny--llama"
    shutil.copytree(tiny_dir, repo / "snapshots" / "c0ffee")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c0ffee")
    model = models.load_model("tiny/llama", torch.device("cpu"), torch.float32, light=True)[0]
    assert isinstance(model, llama.LlamaForCausalLM)
    assert models.fingerprint(model) == models.fingerprint(_both(tiny_dir)[1])
    assert models._hub_snapshot("tiny/absent") is None

    sharded = _save(tiny_model(V, layers=2, seed=6), tmp_path / "sharded", max_shard_size="20KB")
    next(sharded.glob("model-00002-*.safetensors")).unlink()
    assert llama.why_not(sharded) == "safetensors shards missing"


def _edited(folder: Path, tmp_path: Path, **changes) -> Path:
    copy = tmp_path / "edited"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    config.update(changes)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize("changes, reason, loads", [
    ({"model_type": "mistral"}, "a mistral model", False),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}}, "rope type 'llama3'", False),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'", True),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantised", False),
    ({"auto_map": {"AutoModelForCausalLM": "x.Y"}}, "remote code", False),
    ({"hidden_act": "gelu"}, "differ from Llama", True),
])
def test_what_light_loading_does_not_cover_loads_through_transformers(tiny_dir, tmp_path, changes, reason, loads):
    folder = _edited(tiny_dir, tmp_path, **changes)
    assert reason in llama.why_not(folder)
    if loads:  # (the others transformers reads in ways of its own; the reason is what counts here)
        model = models.load_model(str(folder), torch.device("cpu"), torch.float32, light=True)[0]
        assert not isinstance(model, llama.LlamaForCausalLM)


def test_no_safetensors_or_unfitting_tensors(tiny_dir, tmp_path):
    folder = tmp_path / "bin"
    shutil.copytree(tiny_dir, folder)
    (folder / llama.WEIGHTS).unlink()
    assert llama.why_not(folder) == "no safetensors weights"
    wrong = _edited(tiny_dir, tmp_path, num_hidden_layers=4)  # the file holds 3 layers
    with pytest.raises(RsdError, match="do not fit its config.json .9 missing"):
        llama.load(wrong, torch.device("cpu"), torch.float32)


@pytest.fixture
def uncompiled_verdict(tmp_path, monkeypatch):
    """--compile auto without measuring (compiling) here: compiling does not pay."""
    from rsd_cli import compiled

    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(compiled, "compiled_gain", lambda model: 1.5)


def test_light_only_where_the_static_cache_runtime_runs_both_models(tiny_profile, monkeypatch, uncompiled_verdict):
    from rsd_cli.profiles import load_profile

    for compile, light, expected in (("auto", True, True), ("off", True, False), ("auto", False, False)):
        monkeypatch.setenv("RSD_RUNTIME_COMPILE", compile)
        pair = models.load_pair(load_profile(str(tiny_profile)), light=light)
        assert isinstance(pair.target, llama.LlamaForCausalLM) is expected, (compile, light)
        assert isinstance(pair.draft, llama.LlamaForCausalLM) is expected, (compile, light)
        assert (pair.runtimes.target is not None) is (compile != "off")
    monkeypatch.setenv("RSD_RUNTIME_COMPILE", "auto")
    monkeypatch.setenv("RSD_LIGHT_LOAD", "0")
    pair = models.load_pair(load_profile(str(tiny_profile)), light=True)
    assert not isinstance(pair.target, llama.LlamaForCausalLM)


def test_generate_prints_the_same_answer_loaded_light_or_not(tiny_profile, monkeypatch, uncompiled_verdict):
    monkeypatch.setenv("RSD_RUNTIME_COMPILE", "auto")
    runner = CliRunner()
    answers = []
    for light in ("1", "0"):
        monkeypatch.setenv("RSD_LIGHT_LOAD", light)
        result = runner.invoke(app, ["generate", "hello there", "--profile", str(tiny_profile), "--json", "-n", "12",
                                     "-t", "1", "--seed", "3", "-v", "rsd-c"])
        assert result.exit_code == 0, result.output
        answers.append(json.loads(result.stdout.splitlines()[-1])["token_ids"])
    assert answers[0] == answers[1] and len(answers[0]) == 12


def test_a_light_load_imports_no_modeling_code(tiny_profile, tiny_pair_dir, tmp_path, monkeypatch):
    """What makes it light: transformers' Llama modeling module (and torch._dynamo, which it and
    initialising modules on "meta" pull in) stay unimported through a whole generation, once the
    compile verdict is known (it is cached: here written beforehand, "does not pay") — and with the
    tokenizer read without it (rsd_cli/light_tokenizer.py), no module of transformers at all."""
    from rsd_cli import compiled

    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "torch")
    target = models.load_model(str(tiny_pair_dir / "target"), "cpu", torch.float32, light=True)[0]
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "compile.json").write_text(json.dumps(
        {compiled.verdict_key(target): {"compiled_over_eager": 1.5, "compile": False}}))
    script = (
        "import sys\n"
        "import torch\n"
        "torch.set_num_threads(1)\n"  # the verdict key counts threads: as in this process
        "from rsd_cli.cli import app\n"
        f"sys.argv = ['rsd', 'generate', 'hi', '--profile', {str(tiny_profile)!r}, '-n', '4', '--compile', 'auto']\n"
        "try:\n    app()\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers' or m == 'torch._dynamo'))\n"
    )
    env = {**os.environ, "RSD_CONFIG_DIR": str(tmp_path / "config"), "RSD_CACHE_DIR": str(tmp_path / "cache"),
           "RSD_SMALL_BATCH_MATMUL": "torch"}
    env.pop("RSD_LIGHT_LOAD", None)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.stdout.splitlines()[-1] == "[]", done.stdout + done.stderr
