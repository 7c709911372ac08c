"""Targets placed over devices by accelerate (profile keys device_map, max_memory, offload_folder):
a tiny target spread over the CPU and the disk decodes exactly as the unplaced one, and bad keys
get one-line errors naming the file and the key."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from rsd_cli import models
from rsd_cli.cli import app
from rsd_cli.engine import Decoder
from rsd_cli.models import Placement
from rsd_cli.sampling import SamplingParams
from test_engine import N_SAMPLES, PAIR_DRAW, PROMPT, V, chi_square_pvalue, exact_joint, plain_greedy, shapes
from tiny import tiny_model, tiny_tokenizer


def model_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 3-layer tiny target and a 1-layer draft on disk (with a tokenizer: what a user has)."""
    root = tmp_path_factory.mktemp("placement")
    for name, layers, seed in (("target", 3, 0), ("draft", 1, 1)):
        tiny_model(V, layers=layers, seed=seed, scale=0.1).save_pretrained(root / name)
        tiny_tokenizer().save_pretrained(root / name)
    return root


@pytest.fixture(scope="module")
def placed(saved, tmp_path_factory):
    """The target with a max_memory small enough to push its later layers to the disk."""
    unplaced = models.load_model(str(saved / "target"), torch.device("cpu"), torch.float32)[0]
    memory = {"cpu": int(model_bytes(unplaced) * 0.7)}
    folder = str(tmp_path_factory.mktemp("offload"))
    return models.load_model(str(saved / "target"), torch.device("cpu"), torch.float32,
                             placement=Placement("auto", memory, folder))[0]


@pytest.fixture(scope="module")
def unplaced(saved):
    return models.load_model(str(saved / "target"), torch.device("cpu"), torch.float32)[0]


def test_the_small_max_memory_spreads_the_target_over_cpu_and_disk(placed):
    counts = models.layers_per_device(placed)
    assert set(counts) == {"cpu", "disk"} and sum(counts.values()) == 3
    assert any(p.device.type == "meta" for p in placed.parameters())  # offloaded: loaded at each forward


def run(target, draft, shape, sampling, max_tokens, seed):
    decoder = Decoder(target, draft, V, shape, sampling, set())
    return [t for event in decoder.generate(PROMPT, max_tokens, seed) for t in event.emitted]


@pytest.mark.parametrize("shape", shapes(), ids=lambda s: s.describe())
def test_a_placed_target_gives_the_same_greedy_tokens_for_every_variant(saved, placed, unplaced, shape):
    draft = models.load_model(str(saved / "draft"), torch.device("cpu"), torch.float32)[0]
    expected = plain_greedy(unplaced, 20)
    greedy = SamplingParams(temperature=0)
    assert run(placed, draft, shape, greedy, 20, seed=0) == expected
    # an early-exit draft runs on the placed target's own (offloaded) modules
    early_exit = models.early_exit_draft(placed, 1, vocab=4)
    assert run(placed, early_exit, shape, greedy, 20, seed=0) == expected


def test_rsd_c_on_a_placed_target_follows_the_target_distribution(placed, unplaced):
    from rsd_cli.drafting import make_shape

    sampling = SamplingParams(temperature=1.0)
    draft = models.early_exit_draft(placed, 1)
    counts = torch.zeros(V, V)
    for seed in range(N_SAMPLES):
        first, second = run(placed, draft, make_shape("rsd-c", branching=(2, 2)), sampling, PAIR_DRAW, seed)[:2]
        counts[first, second] += 1
    assert chi_square_pvalue(counts, exact_joint(unplaced, sampling) * N_SAMPLES) > 1e-3


def test_an_adapter_trained_on_the_unplaced_target_fits_the_placed_one(tmp_path, placed, unplaced):
    """Its weight sample is read from the offload; the draft it makes computes the same logits."""
    adapter = models.new_adapter(unplaced, 1, head_rows=4)
    with torch.no_grad():
        for p in adapter.parameters():
            p.add_(0.01)
    path = tmp_path / "adapter.safetensors"
    models.save_adapter(adapter, path, unplaced, 1, {"vocab": 4})
    assert models.fits_target(models._read_adapter(path, with_tensors=False)[0], placed)
    assert models.new_adapter(placed, 1).state_dict().keys() == models.new_adapter(unplaced, 1).state_dict().keys()
    drafts = [models.early_exit_draft(m, 1, models.load_adapter(path, m, 1, vocab=4), vocab=4) for m in (placed, unplaced)]
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        torch.testing.assert_close(drafts[0](ids).logits, drafts[1](ids).logits)


def write_profile(path, saved, **target):
    lines = [f'[target]\nsource = "{saved / "target"}"']
    lines += [f"{key} = {value}" for key, value in target.items()]
    lines += ['[draft]\nkind = "early-exit"\nlayers = 1\nadapter = ""',
              '[decoding]\nvariant = "rsd-c"\nbranching = [2, 2]',
              "[sampling]\ntemperature = 0\nmax_tokens = 12\nseed = 3"]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_generate_with_a_placed_target_as_a_user_runs_it(tmp_path, saved, unplaced):
    runner = CliRunner()
    plain = runner.invoke(app, ["generate", "abc", "--raw", "--profile", str(write_profile(tmp_path / "a.toml", saved)),
                                "--json"])
    assert plain.exit_code == 0, plain.output
    memory = int(model_bytes(unplaced) * 0.7)
    profile = write_profile(tmp_path / "b.toml", saved, max_memory=f'{{ cpu = "{memory}B" }}',
                            offload_folder='"spill"')
    result = runner.invoke(app, ["generate", "abc", "--raw", "--profile", str(profile), "--json", "--compile", "auto"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["token_ids"] == json.loads(plain.stdout)["token_ids"]
    assert record["placement"]["target"] == {"cpu": 1, "disk": 2} or set(record["placement"]["target"]) == {"cpu", "disk"}
    assert "the target's layers: " in result.stderr and "on disk" in result.stderr
    assert "meta device" not in result.stderr  # (accelerate's warning)
    assert "does not apply to the target (a model placed over several devices)" in result.stderr
    assert (tmp_path / "spill").is_dir()  # relative to the profile's folder
    assert json.loads(plain.stdout)["placement"] is None


@pytest.mark.parametrize("keys, message", [
    ({"device_map": '{ "model.layers.0" = "gpu0" }'},
     "target.device_map places 'model.layers.0' on an unknown device 'gpu0'"),
    ({"device_map": '"everywhere"'}, "target.device_map must be \"\", auto, balanced"),
    ({"max_memory": '{ cpu = "lots" }'}, "target.max_memory has a malformed size for 'cpu': 'lots'"),
    ({"max_memory": '{ 3 = "1GiB" }'}, "target.max_memory: no GPU 3"),
    ({"device_map": '{ "" = "cuda:1" }'}, "target.device_map: no GPU 1"),
    ({"offload_folder": '"spill"'}, "target.offload_folder needs target.device_map"),
    ({"device_map": '"auto"', "offload_folder": '"occupied/spill"'}, "target.offload_folder: "),
])
def test_bad_placement_keys_give_one_line_naming_file_and_key(tmp_path, saved, keys, message):
    (tmp_path / "occupied").write_text("a file, not a folder")
    profile = write_profile(tmp_path / "bad.toml", saved, **keys)
    result = CliRunner().invoke(app, ["generate", "abc", "--raw", "--profile", str(profile)])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(profile) in lines[0] and message in lines[0], result.stderr
    if "occupied" in str(keys):
        assert "is not writable" in lines[0]


@pytest.mark.parametrize("device, message", [
    ('"gpu"', 'target.device must be "auto", "cpu", "cuda", "cuda:N" or "mps" (got \'gpu\')'),
    ('""', 'target.device must be "auto", "cpu", "cuda", "cuda:N" or "mps" (got \'\')'),
    ('"cuda:x"', 'target.device must be "auto", "cpu", "cuda", "cuda:N" or "mps" (got \'cuda:x\')'),
    ('"cuda:99"', "target.device: no GPU 99 ("),
    pytest.param('"mps"', "target.device: mps is not available on this machine",
                 marks=pytest.mark.skipif(torch.backends.mps.is_available(), reason="a Mac with MPS")),
    pytest.param('"cuda"', "target.device: no GPU 0 (CUDA is not available)",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available")),
])
def test_a_device_that_is_no_device_or_not_on_this_machine_gets_one_line_naming_file_and_key(
        tmp_path, saved, device, message, monkeypatch):
    """A device torch does not know ("gpu") ended in a RuntimeError listing torch's 20 device types; mps on
    a machine without it in 'PyTorch is not linked with support for mps devices'; cuda:99 on a machine of
    one GPU in a CUDA error."""
    monkeypatch.delenv("RSD_TARGET_DEVICE")  # (the tests' own: the profile's device here)
    profile = write_profile(tmp_path / "bad.toml", saved, device=device)
    result = CliRunner().invoke(app, ["generate", "abc", "--raw", "--profile", str(profile)])
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(profile) in lines[0] and message in lines[0], result.stderr
    assert "RuntimeError" not in lines[0] and "Traceback" not in result.stderr


def test_a_device_from_the_environment_is_checked_as_in_a_profile(monkeypatch):
    monkeypatch.setenv("RSD_TARGET_DEVICE", "gpu")
    result = CliRunner().invoke(app, ["profiles", "show"])
    assert result.exit_code == 1
    assert result.stderr == ('rsd: error: environment variable RSD_TARGET_DEVICE must be "auto", "cpu", "cuda", '
                             '"cuda:N" or "mps" (got \'gpu\')\n')
    monkeypatch.setenv("RSD_TARGET_DEVICE", "cuda:99")
    result = CliRunner().invoke(app, ["generate", "abc", "-n", "1"])
    assert result.exit_code == 1 and result.stderr.startswith(
        "rsd: error: env RSD_TARGET_DEVICE: target.device: no GPU 99 ("), result.stderr


def test_a_draft_placement_needs_a_separate_draft_model(tmp_path, saved):
    profile = write_profile(tmp_path / "p.toml", saved)
    profile.write_text(profile.read_text().replace('adapter = ""', 'adapter = ""\ndevice_map = "auto"'))
    result = CliRunner().invoke(app, ["generate", "abc", "--raw", "--profile", str(profile)])
    assert result.exit_code == 1 and 'draft.device_map applies to kind = "model"' in result.stderr


def test_placement_keys_from_the_environment_and_in_profiles_show(monkeypatch):
    monkeypatch.setenv("RSD_TARGET_MAX_MEMORY", '{"0": "70GiB", "cpu": "200GiB"}')
    monkeypatch.setenv("RSD_TARGET_DEVICE_MAP", "balanced")
    result = CliRunner().invoke(app, ["profiles", "show"])
    assert 'max_memory = { 0 = "70GiB", cpu = "200GiB" }  # env RSD_TARGET_MAX_MEMORY' in result.stdout
    assert 'device_map = "balanced"  # env RSD_TARGET_DEVICE_MAP' in result.stdout
    monkeypatch.setenv("RSD_TARGET_MAX_MEMORY", "70GiB")
    result = CliRunner().invoke(app, ["profiles", "show"])
    assert result.exit_code == 1 and "RSD_TARGET_MAX_MEMORY must be a JSON object" in result.stderr


def test_memory_sizes():
    from rsd_cli.profiles import memory_bytes

    assert memory_bytes("70GiB") == 70 * 2**30 and memory_bytes("1.5 GB") == 1_500_000_000
    assert memory_bytes("512mb") == 512 * 10**6 and memory_bytes(4096) == 4096 and memory_bytes("4096") == 4096
    assert memory_bytes("lots") is None and memory_bytes("0GB") is None and memory_bytes(-1) is None


def test_distill_trains_an_adapter_on_a_placed_target(tmp_path, tiny_pair_dir, monkeypatch):
    """The same data and seed give the same adapter whether the target is placed or not."""
    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path / "cache"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("tell me a story\nwhat is the sea?\n")
    target = models.load_model(str(tiny_pair_dir / "target"), "cpu", torch.float32)[0]
    adapters = []
    for name, extra in (("plain", ""), ("placed", f'max_memory = {{ cpu = {int(model_bytes(target) * 0.7)} }}\n')):
        profile = tmp_path / f"{name}.toml"
        profile.write_text(f'[target]\nsource = "{tiny_pair_dir / "target"}"\n{extra}')
        out = tmp_path / f"{name}.safetensors"
        result = CliRunner().invoke(app, ["distill", "-p", str(profile), "--out", str(out), "--layers", "1",
                                          "--tokens", "120", "--eval-tokens", "30", "--max-new-tokens", "16",
                                          "--epochs", "2", "--prompts", str(prompts), "--vocab", "20"])
        assert result.exit_code == 0, result.stderr
        assert ("on disk" in result.stderr) == (name == "placed")
        adapters.append(models._read_adapter(out)[1])
    assert adapters[0].keys() == adapters[1].keys() and "head.weight" in adapters[0]
    for key in adapters[0]:
        torch.testing.assert_close(adapters[0][key], adapters[1][key], atol=2e-3, rtol=0)


def test_max_memory_that_names_no_gpu_keeps_a_strategy_off_a_gpu_machine_s_gpus(monkeypatch):
    """accelerate places a model on the devices max_memory names, so `max_memory = { cpu = ... }`
    runs on the CPU — in float32 there, not in the bfloat16 a GPU would get — on a GPU machine too."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert Placement("auto").uses_cuda() and Placement("balanced", {0: 10**9, "cpu": 10**9}).uses_cuda()
    assert not Placement("auto", {"cpu": 10**9}).uses_cuda()
    assert not Placement("sequential", {"cpu": 10**9, "disk": 10**10}).uses_cuda()
    assert Placement({"": 0}).uses_cuda() and not Placement({"": "cpu"}).uses_cuda()
