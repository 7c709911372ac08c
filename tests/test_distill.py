"""`rsd distill` end to end on a tiny random target, as a user runs it."""

import json

import pytest
from safetensors import safe_open
from typer.testing import CliRunner

from rsd_cli import models
from rsd_cli.cli import app
from rsd_cli.distill import learning_rate_factor
from tiny import tiny_model, tiny_tokenizer


def _distill(profile, out, *extra):
    return CliRunner().invoke(app, ["distill", "-p", str(profile), "--out", str(out), "--layers", "1",
                                    "--tokens", "300", "--eval-tokens", "60", "--max-new-tokens", "24",
                                    "--epochs", "3", "--lr", "1e-2", *extra])


@pytest.fixture
def target_profile(tiny_pair_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path / "cache"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("tell me a story\nwhat is the sea?\nsay hello, please!\n")
    path = tmp_path / "target.toml"
    path.write_text(f'[target]\nsource = "{tiny_pair_dir / "target"}"\n[draft]\nkind = "early-exit"\nlayers = 1\n')
    return path, prompts


def test_distill_trains_writes_metadata_and_the_adapter_drafts(target_profile, tmp_path, tiny_pair_dir):
    profile, prompts = target_profile
    out = tmp_path / "adapter.safetensors"
    result = _distill(profile, out, "--prompts", str(prompts), "--compile", "auto")  # (the tests' default: off)
    assert result.exit_code == 0, result.stderr
    assert "wrote" in result.stderr and out.is_file()
    assert "sampling the target's answers on rsd's runtime (static cache" in result.stderr
    assert result.stdout == ""  # progress and results go to stderr

    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    recipe = json.loads(meta["rsd_recipe"])
    target = models.load_model(str(tiny_pair_dir / "target"), "cpu", __import__("torch").float32)[0]
    assert meta["rsd_fingerprint"] == models.fingerprint(target) and meta["rsd_layers"] == "1"
    assert recipe["epochs"] == 3 and recipe["lr"] == 1e-2 and recipe["schedule"] == "cosine"
    assert recipe["sampled_train_tokens"] >= 300
    assert len(recipe["losses"]) == 3 and recipe["losses"][-1] < recipe["losses"][0]
    assert len(recipe["acceptance_per_epoch"]) == 3
    assert recipe["acceptance_after"] == recipe["acceptance_per_epoch"][-1]

    # the adapter is a draft: generate with it
    with_adapter = tmp_path / "drafted.toml"
    with_adapter.write_text(profile.read_text().replace("layers = 1\n", f'layers = 1\nadapter = "{out}"\n')
                            + '[decoding]\nvariant = "rsd-c"\nbranching = [2, 2]\n[sampling]\nmax_tokens = 8\n')
    generated = CliRunner().invoke(app, ["generate", "-p", str(with_adapter), "hello"])
    assert generated.exit_code == 0, generated.stderr
    assert generated.stdout.strip()

    # a rerun with another learning rate reuses the sampled data instead of sampling again
    again = _distill(profile, tmp_path / "again.safetensors", "--prompts", str(prompts), "--schedule", "constant")
    assert again.exit_code == 0, again.stderr
    assert "reusing sampled data" in again.stderr

    # a cached file cut short (a run killed while writing it, before writes were whole) is sampled over
    (cached,) = (tmp_path / "cache" / "distill").glob("data-*.pt")
    cached.write_bytes(cached.read_bytes()[:1000])
    cut = _distill(profile, tmp_path / "again.safetensors", "--prompts", str(prompts), "--epochs", "1")
    assert cut.exit_code == 0, cut.stderr
    assert f"rsd: the sampled data cached in {cached} cannot be read (" in cut.stderr
    assert "reusing sampled data" not in cut.stderr and "Traceback" not in cut.stderr
    assert _distill(profile, tmp_path / "again.safetensors", "--prompts", str(prompts), "--epochs", "1"
                    ).stderr.count("reusing sampled data") == 1
    assert [path.name for path in (tmp_path / "cache" / "distill").iterdir()] == [cached.name]  # (no partial left)


def test_an_interrupted_distill_writes_the_adapter_of_its_last_whole_epoch(target_profile, tmp_path, monkeypatch):
    """The held-out acceptance printed after each epoch is there to stop when more epochs stop paying, but
    Ctrl-C (or SIGTERM) threw the training away. Now, after a whole epoch, the adapter as that epoch left it
    is written (its recipe saying how many epochs it had), then rsd exits as interrupted (130)."""
    from rsd_cli import distill

    profile, prompts = target_profile
    made, states, real_new, real_acceptance = [], [], distill.new_adapter, distill.expected_acceptance

    def new_adapter(*args, **kwargs):
        made.append(real_new(*args, **kwargs))
        return made[-1]

    def acceptance(*args, **kwargs):  # (called before training, then after each epoch)
        states.append({k: v.detach().clone() for k, v in made[-1].state_dict().items()})
        if len(states) == 3:  # (the end of epoch 2, before it counts)
            raise KeyboardInterrupt
        return real_acceptance(*args, **kwargs)

    monkeypatch.setattr(distill, "new_adapter", new_adapter)
    monkeypatch.setattr(distill, "expected_acceptance", acceptance)
    out = tmp_path / "adapter.safetensors"
    result = _distill(profile, out, "--prompts", str(prompts))
    assert result.exit_code == 130, result.stderr
    assert "rsd: interrupted in epoch 2 of 3: the adapter written is the one epoch 1 left" in result.stderr
    assert f"wrote {out}" in result.stderr and result.stderr.endswith("rsd: interrupted\n")
    with safe_open(str(out), framework="pt") as f:
        recipe = json.loads(f.metadata()["rsd_recipe"])
        written = {k: f.get_tensor(k) for k in f.keys()}
    assert recipe["epochs"] == 3 and recipe["epochs_trained"] == 1
    assert len(recipe["losses"]) == len(recipe["acceptance_per_epoch"]) == 1
    assert recipe["acceptance_after"] == recipe["acceptance_per_epoch"][0]

    def distance(state):  # (the file's names: save_adapter's)
        return sum(float((written[k if k.startswith(("layer.norm.", "layer.head.")) else k.removeprefix("layer.")]
                          .float() - v.half().float()).abs().sum()) for k, v in state.items())

    assert distance(states[1]) == 0 and distance(states[2]) > 0  # (epoch 1's tensors, not epoch 2's)

    states.clear()
    monkeypatch.setattr(distill, "expected_acceptance", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    early = _distill(profile, tmp_path / "early.safetensors", "--prompts", str(prompts))  # (before any epoch)
    assert early.exit_code == 130 and not (tmp_path / "early.safetensors").exists(), early.stderr


def test_an_interrupted_sampling_keeps_its_answers_and_the_same_command_goes_on_from_them(target_profile, tmp_path,
                                                                                         monkeypatch):
    """Sampling the target's answers is most of a distill's time (half an hour on the embedded pair), and
    Ctrl-C, SIGTERM or a closed terminal during it threw every answer away. They are kept batch by batch now:
    the same command goes on from the batches sampled, and ends with the data a run never interrupted samples
    (the same prompts and seeds), the batches kept then removed."""
    import torch

    from rsd_cli import distill

    profile, prompts = target_profile
    args = ("--prompts", str(prompts), "--compile", "auto", "--epochs", "1", "--batch-size", "2")
    assert _distill(profile, tmp_path / "whole.safetensors", *args).exit_code == 0
    (cached,) = (tmp_path / "cache" / "distill").glob("data-*.pt")
    whole = torch.load(cached, weights_only=False)
    cached.unlink()

    real, batches = distill._together, []

    def cut_at(batch: int):
        def together(*args, **kwargs):
            batches.append(args)
            if len(batches) == batch:
                raise KeyboardInterrupt
            return real(*args, **kwargs)
        return together

    monkeypatch.setattr(distill, "_together", cut_at(4))  # (in the training answers)
    first = _distill(profile, tmp_path / "cut.safetensors", *args)
    assert first.exit_code == 130 and not (tmp_path / "cut.safetensors").exists(), first.stderr
    kept = sum(len(s.ids) - s.answer_start for s in whole[0][:6])  # (3 whole batches of 2 answers)
    assert f"rsd: interrupted while sampling: {kept} answer tokens kept" in first.stderr
    assert "the same command goes on from them" in first.stderr and first.stderr.endswith("rsd: interrupted\n")

    batches.clear()
    train_batches = len(whole[0]) // 2
    monkeypatch.setattr(distill, "_together", cut_at(train_batches - 3 + 2))  # (then in the held-out answers)
    second = _distill(profile, tmp_path / "cut.safetensors", *args)
    assert second.exit_code == 130 and f"going on from {kept} answer tokens sampled before" in second.stderr

    monkeypatch.setattr(distill, "_together", real)
    third = _distill(profile, tmp_path / "resumed.safetensors", *args)
    assert third.exit_code == 0 and (tmp_path / "resumed.safetensors").is_file(), third.stderr
    assert "going on from" in third.stderr
    resumed = torch.load(cached, weights_only=False)
    for got, expected in zip(resumed, whole):  # (train, held-out)
        assert [(s.ids, s.answer_start) for s in got] == [(s.ids, s.answer_start) for s in expected]
    assert [path.name for path in (tmp_path / "cache" / "distill").iterdir()] == [cached.name]


def test_distill_samples_with_transformers_generate_with_compile_off(target_profile, tmp_path, monkeypatch):
    from rsd_cli import distill

    profile, prompts = target_profile
    out = tmp_path / "adapter.safetensors"
    real, calls = distill._generated, []

    def cut_second(*args, **kwargs):  # (interrupted in its second batch: the same command goes on from the first)
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(distill, "_generated", cut_second)
    args = ("--prompts", str(prompts), "--compile", "off", "--epochs", "1", "--batch-size", "4")
    cut = _distill(profile, out, *args)
    assert cut.exit_code == 130 and "rsd: interrupted while sampling: " in cut.stderr, cut.stderr
    monkeypatch.setattr(distill, "_generated", real)
    result = _distill(profile, out, *args)
    assert result.exit_code == 0 and "going on from " in result.stderr, result.stderr
    assert "sampling the target's answers on transformers' generate" in result.stderr and out.is_file()
    assert json.loads(safe_open(str(out), framework="pt").metadata()["rsd_recipe"])["sampled_train_tokens"] >= 300
    bad = _distill(profile, out, "--prompts", str(prompts), "--compile", "sometimes")
    assert bad.exit_code == 2 and "--compile takes auto, on or off" in bad.stderr


def test_answers_sampled_on_the_runtime_are_the_target_s_at_temperature_1(tiny_pair_dir):
    """distill's answers decoded together on rsd's runtime: each token a draw from the target at T = 1,
    nothing truncated (a chi-square test of 4000 first tokens against the target's p), each answer
    ending at the end-of-sequence token (kept) or after max_new_tokens; the same recipe, the same
    answers."""
    import torch

    from rsd_cli.compiled import runtime_for
    from rsd_cli.distill import Recipe, sample_answers, sampler
    from rsd_cli.prompting import encode_prompt
    from test_engine import chi_square_pvalue

    target, tokenizer = models.load_model(str(tiny_pair_dir / "target"), "cpu", torch.float32)
    decoder = sampler(target, tokenizer, runtime_for(target, "auto", "target"), "auto")
    assert decoder is not None and decoder.runtimes.target is not None
    quiet = lambda *args: None  # noqa: E731 - (progress)
    ids = encode_prompt(tokenizer, "say hello")
    firsts = sample_answers(target, tokenizer, ["say hello"], 4000, Recipe(max_new_tokens=1, batch_size=64, seed=3),
                            "t", quiet, decoder)
    assert all(s.ids[: s.answer_start] == ids and len(s.ids) == len(ids) + 1 for s in firsts)
    with torch.inference_mode():
        p = target(torch.tensor([ids])).logits[0, -1].double().softmax(-1)
    counts = torch.bincount(torch.tensor([s.ids[-1] for s in firsts]), minlength=p.shape[0])
    assert chi_square_pvalue(counts, p) > 1e-3

    recipe, prompts = Recipe(max_new_tokens=6, batch_size=5, seed=1), ["tell me a story", "what is the sea?"]
    answers = sample_answers(target, tokenizer, prompts, 80, recipe, "t", quiet, decoder)
    assert [s.ids for s in sample_answers(target, tokenizer, prompts, 80, recipe, "t", quiet, decoder)] == \
        [s.ids for s in answers]
    eos = tokenizer.eos_token_id
    assert sum(len(s.ids) - s.answer_start for s in answers) >= 80
    for s in answers:
        answer = s.ids[s.answer_start:]
        assert 1 <= len(answer) <= 6 and eos not in answer[:-1] and (len(answer) == 6 or answer[-1] == eos)


def test_an_adapter_for_another_target_is_refused(target_profile, tmp_path, tiny_pair_dir):
    profile, prompts = target_profile
    out = tmp_path / "adapter.safetensors"
    assert _distill(profile, out, "--prompts", str(prompts), "--epochs", "1").exit_code == 0
    other_target = tmp_path / "other-target"  # same shape and tokenizer, other weights
    tiny_model(40, layers=3, seed=5, scale=0.3).save_pretrained(other_target)
    tiny_tokenizer().save_pretrained(other_target)
    other = tmp_path / "other.toml"
    other.write_text(f'[target]\nsource = "{other_target}"\n'
                     f'[draft]\nkind = "early-exit"\nlayers = 1\nadapter = "{out}"\n')
    result = CliRunner().invoke(app, ["generate", "-p", str(other), "hello"])
    assert result.exit_code == 1
    assert "trained for another target" in result.stderr and "Traceback" not in result.stderr


def test_adapter_auto_drafts_without_the_shipped_adapter_on_another_target(target_profile, tmp_path):
    """The default `draft.adapter = "auto"` uses the shipped adapter only where it was trained
    for the target; "embedded" asks for it and says why it does not fit."""
    profile, _ = target_profile  # a tiny target, early-exit draft, adapter left at its default
    result = CliRunner().invoke(app, ["generate", "-p", str(profile), "hello", "-n", "4", "--seed", "0"])
    assert result.exit_code == 0, result.stderr
    embedded = tmp_path / "embedded.toml"
    embedded.write_text(profile.read_text().replace("layers = 1\n", 'layers = 1\nadapter = "embedded"\n'))
    result = CliRunner().invoke(app, ["generate", "-p", str(embedded), "hello", "-n", "4"])
    assert result.exit_code == 1
    assert "trained for another target" in result.stderr and "Traceback" not in result.stderr


def test_bad_distill_arguments_are_one_line_errors(target_profile, tmp_path):
    profile, _ = target_profile
    # usage errors (2); values the target cannot serve are found on loading it, and are flags' too (they were
    # exit 1, "the target has only 3 layers" for --layers 3 of 3); --lr 0 trained nothing and wrote the adapter
    for extra, message in ((["--schedule", "linear"], "--schedule"),
                           (["--layers", "3"], "--layers 3: the adapter needs at least one of the target's layers "
                            "after the draft's, and the target has 3 (--layers 1 to 2)"),
                           (["--layers", "1", "--vocab", "40"], "--vocab 40: a reduced draft head has fewer rows than "
                            "the target's vocabulary (40 tokens; --vocab 0 takes all of it)"),
                           (["--lr", "0"], "--lr must be a finite number more than 0 (got 0)"),
                           (["--lr", "inf"], "--lr must be a finite number more than 0 (got inf)"),
                           (["--lr", "nan"], "--lr must be a finite number more than 0 (got nan)")):
        args = ["distill", "-p", str(profile), "--out", str(tmp_path / "a.safetensors"), *extra]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2 and message in result.stderr, result.stderr
        assert result.stderr.strip().splitlines()[-1].startswith("rsd: error: ") and "Traceback" not in result.stderr
        assert not (tmp_path / "a.safetensors").exists()
    result = CliRunner().invoke(app, ["distill", "-p", str(profile), "--out", str(tmp_path / "a.bin")])
    assert result.exit_code == 2 and ".safetensors" in result.stderr


def test_a_training_prompt_past_the_context_is_refused_before_any_answer_is_sampled(target_profile, tmp_path,
                                                                                   monkeypatch):
    """Training prompts are drawn in random batches: one past the target's context (the tiny one's 256
    tokens) failed the run wherever its batch came, without saying which prompt."""
    from rsd_cli import distill_command

    sampled = []
    monkeypatch.setattr(distill_command, "sample_answers", lambda *args, **kwargs: sampled.append(1) or [])
    profile, prompts = target_profile
    prompts.write_text(prompts.read_text() + "ab" * 300 + "\n")
    result = _distill(profile, tmp_path / "a.safetensors", "--prompts", str(prompts))
    assert result.exit_code == 1 and not sampled, result.stderr
    assert result.stderr.strip().splitlines()[-1] == ("rsd: error: --prompts: prompt 4 of 4: the prompt has 605 tokens "
                                                      "but the model's context holds 256")


def test_cosine_schedule_warms_up_then_decays_to_zero():
    factors = [learning_rate_factor("cosine", step, 100) for step in range(100)]
    assert factors[0] == pytest.approx(0.2) and factors[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[4:], factors[5:])) and factors[-1] < 0.01
    assert learning_rate_factor("constant", 50, 100) == 1.0


@pytest.mark.parametrize("vocab, head_rows", [(0, None), (20, None), (20, 20)])
def test_training_graph_equals_the_draft_it_trains(tiny_pair_dir, vocab, head_rows):
    """Training feeds the adapter the target's hidden states entering layer K instead of running
    the K frozen layers every step: the logits must be the draft's own."""
    import torch

    from rsd_cli.distill import adapter_only, hidden_entering

    target = models.load_model(str(tiny_pair_dir / "target"), "cpu", torch.float32)[0]
    adapter = models.new_adapter(target, 1, head_rows)
    with torch.no_grad():
        for p in adapter.parameters():
            p.add_(0.05 * torch.randn_like(p))
    draft = models.early_exit_draft(target, 1, adapter, vocab)
    trainee = adapter_only(target, adapter, vocab)
    ids = [1, 5, 9, 3, 7, 11, 4]
    with torch.no_grad():
        expected = draft(torch.tensor([ids])).logits[0]
        prefix = models.early_exit_draft(target, 1, None, vocab)
        got = trainee(inputs_embeds=hidden_entering(prefix, ids)[None], use_cache=False).logits[0]
    assert got.shape == expected.shape == (len(ids), vocab or 40)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert adapter["layer"].self_attn.layer_idx == 1  # still the draft's own cache slot


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_training_graph_of_an_adapter_whose_layer_kind_is_not_the_first_layers(kind):
    """Gemma 2 and 3 (tiny, random): layer 1, where the adapter of a 1-layer draft sits, attends to
    every key where layer 0 sees a window (and, Gemma 3, takes another rotary table). The training
    graph, the adapter as its only layer, must give it its own layer's kind: before, it took layer
    0's (the first of the target's kinds), and trained an adapter for the wrong mask and angles."""
    import torch

    from rsd_cli.distill import adapter_only, hidden_entering
    from tiny import tiny_relative

    target = tiny_relative(kind, 40, layers=3)
    assert target.config.layer_types[:2] == ["sliding_attention", "full_attention"]
    adapter = models.new_adapter(target, 1, None)
    draft, trainee = models.early_exit_draft(target, 1, adapter), adapter_only(target, adapter)
    assert trainee.config.layer_types == ["full_attention"] and draft.config.layer_types == target.config.layer_types[:2]
    ids = [1, 5, 9, 3, 7, 11, 4]  # (longer than the window of 4)
    with torch.no_grad():
        expected = draft(torch.tensor([ids])).logits[0]
        got = trainee(inputs_embeds=hidden_entering(models.early_exit_draft(target, 1), ids)[None],
                      use_cache=False).logits[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["granite4", "bamba", "nemotron_h"])
def test_distill_of_a_hybrid_target_trains_an_adapter_its_drafts_load(kind, tmp_path, monkeypatch):
    """As a user runs it on a hybrid of Mamba-2 mixers and attention: `rsd distill` of a draft whose
    frozen layers all keep a state (Granite 4's and Bamba's first layer, Nemotron-H's first two blocks:
    no attention, so transformers' forward is run without a cache, which would have no length), whose
    adapter is a copy of the attention layer after them — its training graph, the adapter alone, of
    that layer's kind (Bamba's kinds set by its attention layers' indices) and its draft's logits —, and
    the file it writes (a Nemotron-H block's own `norm` kept apart from the draft's own final norm)
    loads: `rsd generate` with it decodes `sd` and `rsd-c` with plain decoding's greedy tokens. Granite 4's
    graph without its embedding multiplier (meant for embeddings, not hidden states); each with a draft
    head of its own, its final norm of the target's kind (Bamba's `final_layernorm`; Nemotron-H's, whose
    config names its epsilon otherwise, its norm's own)."""
    import torch

    from rsd_cli.distill import adapter_only, hidden_entering
    from tiny import tiny_relative

    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path / "cache"))
    layers = 2 if kind == "nemotron_h" else 1  # (Nemotron-H's blocks: a mixer, an MLP, attention, ...)
    target = tiny_relative(kind, 40, layers=5 if kind == "nemotron_h" else 4)
    adapter = models.new_adapter(target, layers, None)
    draft, trainee = models.early_exit_draft(target, layers, adapter), adapter_only(target, adapter)
    ids = [1, 5, 9, 3, 7, 11, 4]
    with torch.no_grad():
        expected = draft(torch.tensor([ids]), use_cache=False).logits[0]
        got = trainee(inputs_embeds=hidden_entering(models.early_exit_draft(target, layers), ids)[None],
                      use_cache=False).logits[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    target.save_pretrained(tmp_path / kind)
    tiny_tokenizer().save_pretrained(tmp_path / kind)
    profile = tmp_path / "target.toml"
    profile.write_text(f'[target]\nsource = "{tmp_path / kind}"\n[draft]\nkind = "early-exit"\nlayers = {layers}\n')
    out = tmp_path / "adapter.safetensors"
    head = ["--vocab", "32"]  # (a draft head of its own: its final norm's kind; Nemotron-H's beside its block's)
    result = CliRunner().invoke(app, ["distill", "-p", str(profile), "--out", str(out), "--layers", str(layers),
                                      "--tokens", "60", "--eval-tokens", "20", "--max-new-tokens", "12",
                                      "--epochs", "1", *head])
    assert result.exit_code == 0, result.stderr
    with_adapter = tmp_path / "drafted.toml"
    with_adapter.write_text(profile.read_text() + f'adapter = "{out}"\nvocab = 32\n')
    answers = []
    for variant, setting in (("ar", "off"), ("sd", "auto"), ("rsd-c", "auto")):
        generated = CliRunner().invoke(app, ["generate", "-p", str(with_adapter), "hello", "-t", "0", "-n", "8",
                                             "--ignore-eos", "-v", variant, "--compile", setting, "--json"])
        assert generated.exit_code == 0, generated.stderr
        answers.append(json.loads(generated.stdout)["token_ids"])
    assert answers[0] == answers[1] == answers[2] and len(answers[0]) == 8


def test_the_training_graph_of_a_mixer_adapter_after_attention_has_the_mixers_kind():
    """A Granite 4.0-H whose first layer is attention and whose second a Mamba-2 mixer: the adapter of a
    one-layer draft copies the mixer, and `rsd distill`'s graph of it alone (one layer) says so — before,
    a layer without attention took the kind of slot 0 there (attention's) — and gives the draft's logits."""
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    from rsd_cli.distill import adapter_only, hidden_entering

    torch.manual_seed(0)
    target = GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["attention", "mamba", "attention"], mamba_n_heads=4, mamba_d_head=16,
        mamba_n_groups=2, mamba_d_state=8, num_local_experts=0, shared_intermediate_size=32,
        position_embedding_type="rope")).eval()
    adapter = models.new_adapter(target, 1, None)
    draft, trainee = models.early_exit_draft(target, 1, adapter), adapter_only(target, adapter)
    assert trainee.config.layer_types == target.config.layer_types[1:2] == ["linear_attention"]
    ids = [1, 5, 9, 3, 7, 11, 4]
    with torch.no_grad():
        expected = draft(torch.tensor([ids]), use_cache=False).logits[0]
        got = trainee(inputs_embeds=hidden_entering(models.early_exit_draft(target, 1), ids)[None],
                      use_cache=False).logits[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_an_adapter_trained_for_a_reduced_head_takes_that_head_or_asks_for_it(target_profile, tmp_path):
    profile, prompts = target_profile
    out = tmp_path / "adapter.safetensors"
    trained = _distill(profile, out, "--prompts", str(prompts), "--epochs", "1", "--vocab", "20")
    assert trained.exit_code == 0, trained.stderr
    assert "draft.vocab = 20" in trained.stderr
    with safe_open(str(out), framework="pt") as f:  # --vocab trains the draft's own norm and head
        assert f.get_slice("head.weight").get_shape()[0] == 20 and "norm.weight" in f.keys()
        assert json.loads(f.metadata()["rsd_recipe"])["train_head"] is True
    shared = tmp_path / "shared.safetensors"
    assert _distill(profile, shared, "--prompts", str(prompts), "--epochs", "1", "--vocab", "20",
                    "--shared-head").exit_code == 0
    with safe_open(str(shared), framework="pt") as f:
        assert not {"head.weight", "norm.weight"} & set(f.keys())
    base = profile.read_text().replace("layers = 1\n", f'layers = 1\nadapter = "{out}"\n')
    for vocab, ok in ((0, False), (30, False), (20, True), (10, True)):
        path = tmp_path / f"v{vocab}.toml"
        path.write_text(base.replace("[draft]\n", f"[draft]\nvocab = {vocab}\n") + "[sampling]\nmax_tokens = 4\n")
        result = CliRunner().invoke(app, ["generate", "-p", str(path), "hello"])
        assert (result.exit_code == 0) == ok, (vocab, result.stderr)
        if not ok:
            assert "trained for a 20-token draft head: set draft.vocab = 20" in result.stderr
    # draft.vocab not set (an explicit 0 above is refused): the head the adapter was trained for
    unset = tmp_path / "unset.toml"
    unset.write_text(base + "[sampling]\nmax_tokens = 4\n")
    assert CliRunner().invoke(app, ["generate", "-p", str(unset), "hello"]).exit_code == 0
    session = CliRunner().invoke(app, ["chat", "-p", str(unset)], input="")
    assert session.exit_code == 0 and "adapter, 20-token head" in session.stderr, session.stderr
