"""A few tests on the real embedded model (SmolLM2-135M-Instruct): the product as a user meets it."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from rsd_cli.cli import app

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def embedded_pair():
    from rsd_cli.models import load_pair
    from rsd_cli.profiles import load_profile

    profile = load_profile("default", environ={})
    return profile, load_pair(profile)


def test_adapter_auto_finds_the_shipped_adapter_for_the_embedded_target(embedded_pair):
    from rsd_cli.models import adapter_path, embedded_adapter

    profile, pair = embedded_pair
    assert adapter_path("auto", profile, pair.target, 3) == embedded_adapter()
    assert adapter_path("auto", profile, pair.target, 2) is None  # trained after 3 layers, not 2
    assert "+ adapter" in pair.description


def test_rsd_generate_on_the_embedded_default():
    result = CliRunner().invoke(app, ["generate", "What is the capital of France?", "-n", "12", "--seed", "0",
                                      "-t", "0"], input="")
    assert result.exit_code == 0, result.stderr
    assert "Paris" in result.stdout
    assert "block efficiency" in result.stderr and "Paris" not in result.stderr


def test_the_embedded_pair_loaded_light_samples_the_same_tokens(embedded_pair, monkeypatch):
    """Loaded without transformers' modeling code (rsd_cli/llama.py, what generate, chat and
    inspect-tree do), the embedded pair is the same pair: fingerprint, adapter, runtime, and the
    tokens a seeded `sd` sampling run draws."""
    from rsd_cli import llama
    from rsd_cli.generation import complete
    from rsd_cli.models import fingerprint, load_pair
    from rsd_cli.profiles import load_profile
    from rsd_cli.prompting import encode_prompt
    from rsd_cli.runtime import apply_flags, make_decoder

    profile, pair = embedded_pair
    monkeypatch.delenv("RSD_SMALL_BATCH_MATMUL")  # the kernels the module's pair loaded with (its own choice)
    light = load_pair(load_profile("default", environ={}), light=True)
    assert isinstance(light.target, llama.LlamaForCausalLM) and not isinstance(pair.target, llama.LlamaForCausalLM)
    assert fingerprint(light.target) == fingerprint(pair.target) and light.description == pair.description
    assert light.runtimes.describe() == pair.runtimes.describe()
    settings = {"variant": "sd", "draft_len": 2, "temperature": 0.7}
    ids = encode_prompt(pair.tokenizer, "Name three colours of the rainbow.")
    assert encode_prompt(light.tokenizer, "Name three colours of the rainbow.") == ids
    sampled = [complete(make_decoder(p, apply_flags(load_profile("default", environ={}), settings)), ids, 32, seed=5)[0]
               for p in (light, pair)]
    assert sampled[0] == sampled[1] and len(sampled[0]) == 32


@pytest.mark.parametrize("variant", ["sd", "mss", "spectr", "rsd-c", "rsd-s", "lookup", "auto"])
def test_every_variant_is_greedy_exact_on_the_embedded_pair(embedded_pair, variant):
    from rsd_cli.generation import complete
    from rsd_cli.prompting import encode_prompt
    from rsd_cli.runtime import apply_flags, make_decoder

    profile, pair = embedded_pair
    ids = encode_prompt(pair.tokenizer, "Name three colours of the rainbow.")

    def tokens(name):
        apply_flags(profile, {"variant": name, "temperature": 0.0, "branching": "2,2,1", "beam_width": 2,
                              "depth": 3, "num_drafts": 2})
        return complete(make_decoder(pair, profile), ids, 24, seed=0)[0]

    assert tokens(variant) == tokens("ar")


def test_json_output_on_the_embedded_default():
    result = CliRunner().invoke(app, ["generate", "Say hi.", "-n", "6", "--seed", "1", "--json"], input="")
    assert result.exit_code == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["profile"] == "default" and 1 <= record["stats"]["new_tokens"] <= 6


def test_the_answer_ends_where_rsd_tokenize_says_and_ignore_eos_runs_to_the_length(embedded_pair):
    """`rsd tokenize` reads the embedded tokenizer alone and names the tokens that end an answer,
    the ones the loaded pair stops at; a greedy answer that ends at one runs to -n with --ignore-eos."""
    _, pair = embedded_pair
    result = CliRunner().invoke(app, ["tokenize", " Paris", "--json"])
    assert result.exit_code == 0, result.stderr
    record = json.loads(result.stdout)
    assert {e["id"] for e in record["end_of_sequence"]} == pair.eos_ids
    assert [t["text"] for t in record["tokens"]] == [" Paris"]
    waved = json.loads(CliRunner().invoke(app, ["tokenize", "hi 👋 東京", "--json"]).stdout)["tokens"]
    assert any("\ufffd" in t["text"] for t in waved)  # (the emoji's and kanji's pieces: part of a character)
    assert b"".join(bytes(t["bytes"]) for t in waved) == "hi 👋 東京".encode()

    def answer(*extra):
        result = CliRunner().invoke(app, ["generate", "Say hi in two words.", "-n", "24", "-t", "0", "--json",
                                          *extra], input="")
        assert result.exit_code == 0, result.stderr
        return json.loads(result.stdout)

    short, full = answer(), answer("--ignore-eos")
    assert short["finish_reason"] == "eos" and len(short["token_ids"]) < 24
    assert full["finish_reason"] == "length" and len(full["token_ids"]) == 24
    assert full["token_ids"][: len(short["token_ids"]) - 1] == short["token_ids"][:-1]  # (until its end)


def test_the_compiled_runtime_is_greedy_exact_on_the_embedded_pair(embedded_pair):
    """Every tree verified on the compiled static-cache runtime gives transformers' eager `ar` output."""
    from rsd_cli.compiled import CompiledModel
    from rsd_cli.engine import Runtimes
    from rsd_cli.generation import complete
    from rsd_cli.prompting import encode_prompt
    from rsd_cli.runtime import apply_flags, make_decoder

    profile, pair = embedded_pair
    ids = encode_prompt(pair.tokenizer, "Name three colours of the rainbow.")
    compiled = Runtimes(CompiledModel(pair.target), CompiledModel(pair.draft), "on")
    saved = pair.runtimes

    def tokens(name, runtimes):
        apply_flags(profile, {"variant": name, "temperature": 0.0, "branching": "2,2,1", "beam_width": 2,
                              "depth": 3, "draft_len": 3})
        pair.runtimes = runtimes
        try:
            return complete(make_decoder(pair, profile), ids, 24, seed=0)[0]
        finally:
            pair.runtimes = saved

    reference = tokens("ar", Runtimes())
    for variant in ("ar", "sd", "rsd-c", "rsd-s"):
        assert tokens(variant, compiled) == reference, variant
    # the static shapes CUDA graphs replay (run here without graphs): the real model's sizes
    static = Runtimes(CompiledModel(pair.target, False, static_shapes=True),
                      CompiledModel(pair.draft, False, static_shapes=True), "on")
    for variant in ("sd", "rsd-c"):
        assert tokens(variant, static) == reference, variant


def test_the_blocks_kernel_runs_the_embedded_model_s_own_weights_exactly(embedded_pair, monkeypatch):
    """Loaded with the kernel on quantised blocks: the target's layers (Q4_1) and head (Q8_0) and the
    draft's adapter (stored in float16, rounded to Q8_0 at load) run on it; logits match oneDNN's
    float32 products, and greedy output of every variant on the static-cache runtime (fused
    projections) is `ar`'s on transformers' forward with packed float32 weights."""
    import torch

    from rsd_cli import blocks, small_batch
    from rsd_cli.compiled import CompiledModel
    from rsd_cli.engine import Runtimes
    from rsd_cli.generation import complete
    from rsd_cli.models import load_pair
    from rsd_cli.prompting import encode_prompt
    from rsd_cli.runtime import apply_flags, make_decoder

    if not blocks.available():
        pytest.skip("no C compiler for the kernel")
    profile, packed = embedded_pair
    if next(packed.target.parameters()).device.type != "cpu":  # (a GPU machine's default: the kernel is the CPU's)
        from rsd_cli.profiles import load_profile

        profile = load_profile("default", environ={"RSD_TARGET_DEVICE": "cpu"})
        packed = load_pair(profile)
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "blocks")
    pair = load_pair(profile)
    layer = pair.target.model.layers[7]
    formats = {blocks.block_format(small_batch.blocks_of(m)) for m in (layer.self_attn.q_proj, layer.mlp.down_proj)}
    assert formats == {"q4_1"} and blocks.block_format(small_batch.blocks_of(pair.target.lm_head)) == "q8_0"
    assert blocks.block_format(small_batch.blocks_of(pair.draft.model.layers[-1].mlp.up_proj)) == "q8_0"
    assert blocks.block_format(small_batch.blocks_of(pair.draft.lm_head)) == "q8_0"
    assert small_batch.kernels_of(pair.target.lm_head) == ("blocks",) * 3
    ids = encode_prompt(pair.tokenizer, "Name three colours of the rainbow.")
    with torch.inference_mode():
        torch.testing.assert_close(pair.target(torch.tensor([ids])).logits,
                                   packed.target(torch.tensor([ids])).logits, rtol=0, atol=2e-3)

    def tokens(name, which, runtimes):
        apply_flags(profile, {"variant": name, "temperature": 0.0, "branching": "2,2,1", "beam_width": 2,
                              "depth": 3, "draft_len": 3})
        saved, which.runtimes = which.runtimes, runtimes
        try:
            return complete(make_decoder(which, profile), ids, 24, seed=0)[0]
        finally:
            which.runtimes = saved

    reference = tokens("ar", packed, Runtimes())
    static = Runtimes(CompiledModel(pair.target, compile=False), CompiledModel(pair.draft, compile=False), "auto")
    assert all(fused[0] is not None for _, _, fused in static.target.layers)
    assert tokens("ar", pair, Runtimes()) == reference
    for variant in ("ar", "sd", "rsd-c", "rsd-s"):
        assert tokens(variant, pair, static) == reference, variant
