import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from rsd_cli import models
from rsd_cli.errors import RsdError
from tiny import tiny_model, write_tiny_gguf


def test_gguf_is_dequantised_once_then_loaded_from_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path / "cache"))
    original = tiny_model(40, layers=2, seed=0, scale=0.3)
    gguf_file = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_file, original)

    cached = models.gguf_to_cache(gguf_file)
    assert capsys.readouterr().err == ""  # no progress bar of transformers' own in a script's stderr
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


def test_a_conversion_reports_its_progress_where_rsd_s_spinner_can_show_it(tmp_path, monkeypatch, capsys):
    """The conversion says what it does and how much of the weights it has written (rsd's spinner on
    a terminal shows it), with stderr left as it is while it runs — so the spinner goes on turning
    — and nothing of transformers' own on it."""
    import sys

    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path / "cache"))
    gguf_file = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_file, tiny_model(40, layers=2, seed=0, scale=0.3))
    said, streams = [], []
    models.gguf_to_cache(gguf_file, lambda line: said.append(line) or streams.append(sys.stderr))
    assert said[0].startswith("converting tiny.gguf to safetensors (once) in ")
    shares = [int(line.split("(once, ")[1].split("%")[0]) for line in said[1:]]
    assert len(shares) == 2 * 9 + 3 and shares == sorted(shares) and shares[-1] == 100  # (every tensor)
    assert all(stream is sys.stderr for stream in streams)
    assert capsys.readouterr().err == ""


def test_a_first_conversion_is_said_in_one_line_off_a_terminal_too(tmp_path, monkeypatch):
    """Converting a GGUF file takes seconds once (14 s for the embedded model on a 2-core Xeon): a
    script's first `rsd generate` says so in one line on stderr, as it says it measures the models'
    costs, where the spinner's progress is not shown; later runs say nothing, the same answer."""
    from typer.testing import CliRunner

    from rsd_cli.cli import app

    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path / "cache"))
    gguf_file = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_file, tiny_model(40, layers=2, seed=0, scale=0.3))
    profile = tmp_path / "gguf.toml"
    profile.write_text(f'[target]\nsource = "{gguf_file}"\n[draft]\nkind = "early-exit"\nlayers = 1\n'
                       '[decoding]\nvariant = "sd"\n[sampling]\nmax_tokens = 4\n')
    runner = CliRunner()
    first, again = (runner.invoke(app, ["generate", "c", "-p", str(profile), "--raw", "-t", "0"], input="")
                    for _ in range(2))
    assert first.exit_code == 0 and again.exit_code == 0, (first.stderr, again.stderr)
    line = f"rsd: converting tiny.gguf to safetensors once (later runs load {tmp_path / 'cache'}"
    assert first.stderr.count(line) == 1 and first.stderr.count("\n") == 2  # that line and the summary
    assert "converting" not in again.stderr and again.stdout == first.stdout != ""


def test_a_cache_folder_that_cannot_be_made_is_named_in_one_line(tmp_path):
    """A GGUF file's conversion needs rsd's cache folder; one that cannot be made (here under a file)
    said `NotADirectoryError: [Errno 20] ...`: now its reason and path, and which setting names it."""
    from typer.testing import CliRunner

    from rsd_cli.cli import app

    gguf_file, blocker = tmp_path / "tiny.gguf", tmp_path / "a-file"
    write_tiny_gguf(gguf_file, tiny_model(40, layers=2, seed=0, scale=0.3))
    blocker.write_text("")
    profile = tmp_path / "gguf.toml"
    profile.write_text(f'[target]\nsource = "{gguf_file}"\n[draft]\nkind = "early-exit"\nlayers = 1\n')
    result = CliRunner().invoke(app, ["generate", "c", "-p", str(profile)], input="",
                                env={"RSD_CACHE_DIR": str(blocker / "cache")})
    assert result.exit_code == 1 and result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"rsd: error: Not a directory: {blocker / 'cache'}")
    assert result.stderr.endswith(f" (in rsd's cache folder {blocker / 'cache'}: set RSD_CACHE_DIR to a writable "
                                  "folder)\n")
    assert result.stderr.count("\n") == 1


def test_a_conversion_parses_the_gguf_file_once_and_writes_the_same_files(tmp_path, monkeypatch):
    """transformers reads a GGUF file for the config, the weights and the tokenizer, and builds
    gguf's tensor name table once per module: within rsd's conversion each is made once, gguf is
    left as it was, and the files written are those a conversion without it writes."""
    import contextlib

    import gguf

    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path / "cache"))
    gguf_file = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_file, tiny_model(40, layers=2, seed=0, scale=0.3))
    reads, tables = [], []
    reader, table = gguf.GGUFReader, gguf.get_tensor_name_map
    monkeypatch.setattr(gguf, "GGUFReader", lambda *args, **kw: reads.append(args) or reader(*args, **kw))
    monkeypatch.setattr(gguf, "get_tensor_name_map", lambda *args: tables.append(args) or table(*args))
    counting = gguf.GGUFReader
    cached = models.gguf_to_cache(gguf_file)
    assert len(reads) == 1 and len(tables) == 1
    assert gguf.GGUFReader is counting
    monkeypatch.setattr(models, "_gguf_parsed_once", contextlib.nullcontext)
    models._convert_gguf(gguf_file, tmp_path / "plain", lambda message: None)
    assert len(reads) >= 1 + 3 and len(tables) >= 1 + 2  # without it: each read and table again
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (cached / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()


@pytest.mark.parametrize("kind", ["f32", "f32-tied", "llama", "qwen2"])
def test_a_gguf_file_converts_tensor_by_tensor_to_what_transformers_loads(kind, tmp_path, monkeypatch):
    """The conversion writes each tensor as it dequantises it — transformers' whole float32 model is
    never made — and gives what transformers' own load of the file saves: the same parameters with
    the same float32 values bit for bit (Llama's q and k rows permuted back, Qwen2's biases, a tied
    head left out), the same block hints, config and generation config."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from tiny import tiny_config

    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path / "cache"))
    gguf_file = tmp_path / f"{kind}.gguf"
    if kind.startswith("f32"):
        torch.manual_seed(0)
        config = tiny_config(40, 2, 0.3, tie_word_embeddings=kind == "f32-tied")
        write_tiny_gguf(gguf_file, type(tiny_model())(config).eval())
    else:
        k_quant_gguf(gguf_file, kind=kind)
    whole = tmp_path / "whole"
    whole.mkdir()
    with models._gguf_parsed_once():
        models._convert_whole(gguf_file, whole)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        lambda *args, **kwargs: pytest.fail("the whole model was loaded"))
    cached = models.gguf_to_cache(gguf_file)
    streamed, expected = load_file(cached / "model.safetensors"), load_file(whole / "model.safetensors")
    assert sorted(streamed) == sorted(expected)
    assert ("lm_head.weight" in streamed) == (kind != "f32-tied")
    for name, values in expected.items():
        assert streamed[name].dtype == torch.float32 and torch.equal(streamed[name], values), name
    hints = cached / "rsd-block-hints.safetensors"
    assert hints.is_file() == (kind in ("llama", "qwen2"))
    if hints.is_file():
        streamed, expected = load_file(hints), load_file(whole / hints.name)
        assert sorted(streamed) == sorted(expected) and len(expected) == 16
        assert all(torch.equal(streamed[name], values) for name, values in expected.items())
    for name in ("config.json", "generation_config.json"):
        assert json.loads((cached / name).read_text()) == json.loads((whole / name).read_text()), name


def test_a_large_gguf_model_converts_into_files_of_at_most_2_gib_that_both_loaders_read(tmp_path, monkeypatch):
    """torch maps each weights file whole, and a private map larger than the machine's memory is
    refused ("Cannot allocate memory" for a 7B model's 29 GB of float32): past 2 GiB (here a few
    kB) the conversion writes several files and an index; light loading and transformers' read
    them, giving the weights of a conversion into one file."""
    from safetensors.torch import load_file
    from rsd_cli import gguf_convert

    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path / "one"))
    gguf_file = tmp_path / "tiny-q4_k_m.gguf"
    k_quant_gguf(gguf_file)
    single = load_file(models.gguf_to_cache(gguf_file) / "model.safetensors")
    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path / "several"))
    monkeypatch.setattr(gguf_convert, "SHARD_BYTES", 300_000)
    cached = models.gguf_to_cache(gguf_file)
    files = sorted(cached.glob("model-*.safetensors"))
    assert len(files) >= 3 and not (cached / "model.safetensors").exists()
    weight_map = json.loads((cached / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(weight_map) == sorted(single) and sorted(set(weight_map.values())) == [f.name for f in files]
    assert all(f.stat().st_size <= 300_000 + 4096 or len(load_file(f)) == 1 for f in files)
    for light in (True, False):
        model, _ = models.load_model(str(gguf_file), torch.device("cpu"), torch.float32, light=light)
        state = model.state_dict()
        assert all(torch.equal(state[name], values) for name, values in single.items())


def test_the_gguf_cache_is_keyed_by_content_not_path(tmp_path, monkeypatch):
    """A second venv installing the same model file (another path, another mtime) reuses the
    converted copy; a different file at the same path does not."""
    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path / "cache"))
    path_keyed = tmp_path / "cache" / "gguf" / "tiny-0123456789abcdef"  # as earlier versions wrote
    path_keyed.mkdir(parents=True)
    (path_keyed / "rsd-complete").write_text('{"source": "/gone/venv/tiny.gguf"}')
    unfinished = tmp_path / "cache" / "gguf" / "tiny-fedcba9876543210.partial"
    unfinished.mkdir()
    first = tmp_path / "venv-a" / "tiny.gguf"
    first.parent.mkdir()
    write_tiny_gguf(first, tiny_model(40, layers=2, seed=0, scale=0.3))
    cached = models.gguf_to_cache(first)
    second = tmp_path / "venv-b" / "tiny.gguf"
    second.parent.mkdir()
    second.write_bytes(first.read_bytes())
    assert models.gguf_to_cache(second) == cached
    assert not path_keyed.exists(), "the path-keyed copy nothing reads any more is dropped"
    kept = sorted(p for p in (tmp_path / "cache" / "gguf").iterdir() if p.suffix != ".lock")
    assert kept == sorted([cached, unfinished])

    write_tiny_gguf(second, tiny_model(40, layers=2, seed=1, scale=0.3))
    other = models.gguf_to_cache(second)
    assert other != cached and (other / "rsd-complete").is_file()


def k_quant_gguf(path: Path, layers: int = 2, seed: int = 0, kind: str = "llama"):
    """A tiny Llama (or Qwen2) written as a Q4_K_M-like GGUF file (tiny.k_quant_type); returns the
    float model."""
    from transformers import LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    from tiny import k_quant_type, tiny_config

    torch.manual_seed(seed)
    sizes = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
    if kind == "qwen2":
        llama = {key: value for key, value in tiny_config(40, layers, 0.1).to_dict().items() if key != "model_type"}
        config = Qwen2Config(**{**llama, **sizes, "sliding_window": None})  # (a model_type kept: a Llama file)
        model = Qwen2ForCausalLM(config).eval()
        with torch.no_grad():  # biases that matter
            for layer in model.model.layers:
                for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    linear.bias.normal_(0.0, 0.1)
    else:
        model = LlamaForCausalLM(tiny_config(40, layers, 0.1, **sizes)).eval()
    write_tiny_gguf(path, model, k_quant_type)
    if kind == "qwen2":
        skip_unless_transformers_reads_its_tokenizer(path)
    return model


def skip_unless_transformers_reads_its_tokenizer(path: Path) -> None:
    """Skip where this transformers cannot read the tiny Qwen2 file's tokenizer: before ~5.20 (5.17
    on the GPU machine) Qwen2's GGUF converter needs merges (it asks for `bpe_ranks`), and a
    vocabulary of single characters has none — real files do."""
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except AttributeError as e:
        if "bpe_ranks" not in str(e):
            raise
        import transformers

        pytest.skip(f"transformers {transformers.__version__} reads no Qwen2 GGUF tokenizer without merges")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_k_quant_gguf_keeps_its_quantisation_and_its_weights_run_as_blocks(kind, tmp_path, monkeypatch):
    """A Q4_K/Q5_K/Q6_K file's scales and offsets are kept beside its converted weights (their rows
    where transformers puts them: Llama's q and k permuted back, Qwen2's as written) and each loaded
    weight becomes blocks of its format, giving back the float32 values transformers made, loaded
    light or not."""
    from rsd_cli import blocks, gguf_hints
    from tiny import k_quant_type

    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path / "cache"))
    gguf_file = tmp_path / "tiny-q4_k_m.gguf"
    k_quant_gguf(gguf_file, kind=kind)
    cached = models.gguf_to_cache(gguf_file)
    assert json.loads((cached / "rsd-complete").read_text())["hints"] == 16  # every 2-D tensor of 2 layers
    assert (cached / gguf_hints.HINTS_FILE).is_file()
    expected = {"Q4_K": "q4_1", "Q5_K": "q5_1", "Q6_K": "q8_16"}
    for light in (True, False):
        model, _ = models.load_model(str(gguf_file), torch.device("cpu"), torch.float32, light=light)
        weights = {name: p for name, p in model.named_parameters() if p.dim() == 2}
        assert len(weights) == 16
        for name, weight in weights.items():
            assert getattr(weight, blocks.HINT).format == expected[k_quant_type(name)], name
            found = blocks.quantised_blocks(weight)
            assert found is not None and blocks.block_format(found) == expected[k_quant_type(name)], name
    # a hint that no longer fits its weight (a weight changed in place) costs only the kernel
    q = model.model.layers[0].self_attn.q_proj.weight
    with torch.no_grad():
        q[0, 0] += 1e-3
    assert blocks.quantised_blocks(q) is None


def test_a_converted_gguf_keeps_its_blocks_and_later_loads_run_on_them_without_reading_the_weights(
        tmp_path, monkeypatch):
    """A conversion writes the blocks its linear layers will run on into its folder (rsd-blocks/),
    or else the first load does (the same blocks); later loads, light or not, run on those same
    blocks without recovering or checking them from the float32 values (recovery made to fail here)
    and give the same logits; the C layers' stacked q/k/v and gate/up are the kept file's bytes (no
    copy), with the logits of stacked copies. A weight changed in place, a damaged or foreign-layout file and a folder rsd did not convert get
    no kept blocks."""
    from safetensors.torch import load_file

    from rsd_cli import blocks, blocks_cache, small_batch

    if not blocks.available():
        pytest.skip("no C compiler to build the kernel")
    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "blocks")
    gguf_file = tmp_path / "tiny-q4_k_m.gguf"
    k_quant_gguf(gguf_file)
    ids = torch.tensor([[1, 5, 6, 7, 9]])
    kept_folder = models.gguf_to_cache(gguf_file) / blocks_cache.FOLDER
    by_conversion = {name: t for file in kept_folder.iterdir() for name, t in load_file(str(file)).items()}
    shutil.rmtree(kept_folder)  # (then the first load makes them: the same)

    def load(light=False):  # (a light model has no forward of its own: transformers' runs on the same kernels)
        model, _ = models.load_model(str(gguf_file), torch.device("cpu"), torch.float32, light=light)
        linears = {name: small_batch.blocks_of(m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        with torch.no_grad():
            return model, linears, None if light else model(ids).logits

    abandoned = kept_folder.with_name(f"{blocks_cache.FOLDER}.{2**22 + 12345}.partial")  # (no such process)
    abandoned.mkdir()
    _, first, logits = load()
    assert not abandoned.exists()
    assert kept_folder.is_dir() and len(first) == 15 and all(b is not None for b in first.values())
    written = sorted(kept_folder.iterdir())
    by_load = {name: t for file in written for name, t in load_file(str(file)).items()}
    assert set(by_load) == set(by_conversion) == {f"{name}.weight" for name in first}
    assert all(torch.equal(by_load[name], by_conversion[name]) for name in by_load)

    def not_from_the_values(*args):
        raise AssertionError("blocks recovered from the float32 values")

    with monkeypatch.context() as patched:
        patched.setattr(blocks, "hinted_blocks", not_from_the_values)
        patched.setattr(blocks, "_finite", not_from_the_values)
        for light in (True, False):
            model, again, later_logits = load(light)
            assert set(again) == set(first)
            for name, kept in again.items():
                assert kept.dtype == first[name].dtype and torch.equal(kept, first[name]), name
            assert light or torch.equal(later_logits, logits)
    assert sorted(kept_folder.iterdir()) == written  # (written once)
    # the C layers run q/k/v and gate/up stacked: kept side by side, they are the file's bytes (no
    # copy), with the logits of stacked copies of recovered blocks
    from rsd_cli.compiled import CompiledModel, StaticLM

    def c_logits(model):
        runtime = CompiledModel(model, compile=False)
        assert runtime.all_in_c
        return runtime, StaticLM(runtime, model.config.vocab_size, 64).extend([1, 5, 6, 7, 9, 3, 2], last_only=False)

    kept_model, _ = models.load_model(str(gguf_file), torch.device("cpu"), torch.float32, light=True)
    runtime, kept_logits = c_logits(kept_model)
    attention, mlp = kept_model.model.layers[1].self_attn, kept_model.model.layers[1].mlp
    qkv, _, gate_up, _ = runtime.native[1].weights
    assert qkv.data_ptr() == small_batch.blocks_of(attention.q_proj).data_ptr()
    assert gate_up.data_ptr() == small_batch.blocks_of(mlp.gate_proj).data_ptr()
    with monkeypatch.context() as patched:
        patched.setattr(blocks_cache, "LAYOUT", "0")  # (recovered: separate tensors, stacked copies)
        copied_model, _ = models.load_model(str(gguf_file), torch.device("cpu"), torch.float32, light=True)
    runtime, copied_logits = c_logits(copied_model)
    assert runtime.native[1].weights[0].data_ptr() != small_batch.blocks_of(
        copied_model.model.layers[1].self_attn.q_proj).data_ptr()
    assert torch.equal(kept_logits, copied_logits)
    q = model.model.layers[0].self_attn.q_proj.weight
    assert blocks.quantised_blocks(q) is not None
    with torch.no_grad():
        q[0, 0] += 1e-3  # changed in place: its blocks are recovered and checked again (and no longer fit)
    assert blocks.quantised_blocks(q) is None

    recovered = []
    hinted = blocks.hinted_blocks
    monkeypatch.setattr(blocks, "hinted_blocks", lambda *args: recovered.append(1) or hinted(*args))
    with monkeypatch.context() as patched:
        patched.setattr(blocks_cache, "LAYOUT", "0")  # (files of another layout)
        _, other_layout, other_logits = load()
    assert len(recovered) == 15 and torch.equal(other_logits, logits)
    for file in written:
        file.write_bytes(file.read_bytes()[:100])  # damaged
    recovered.clear()
    _, damaged, damaged_logits = load()
    assert len(recovered) == 15 and torch.equal(damaged_logits, logits)

    # a folder of the user's own (not rsd's conversion) is not written into
    own = tmp_path / "own"
    shutil.copytree(models.gguf_to_cache(gguf_file), own, ignore=shutil.ignore_patterns(models.COMPLETE, blocks_cache.FOLDER))
    gguf_file = own
    _, made, _ = load()
    assert all(b is not None for b in made.values()) and not (own / blocks_cache.FOLDER).exists()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_generate_on_a_k_quant_gguf_runs_its_layers_in_c_with_transformers_greedy_answer(kind, tmp_path, monkeypatch):
    """`rsd generate` with a Q4_K_M-like GGUF file (Llama's, Qwen2's) as the target (its first layer
    the draft): on the static-cache runtime every layer runs in C on the file's own blocks (q4_1,
    q5_1 and q8_16, mixed within q/k/v and gate/up), and the greedy answer is the one transformers'
    forward gives."""
    from typer.testing import CliRunner

    from rsd_cli import blocks, compiled
    from rsd_cli.cli import app

    if not blocks.available():
        pytest.skip("no C compiler to build the kernel")
    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(compiled, "compiled_gain", lambda model: 1.5)  # --compile auto: uncompiled, not measured
    gguf_file = tmp_path / "tiny-q4_k_m.gguf"
    k_quant_gguf(gguf_file, layers=3, seed=4, kind=kind)
    profile = tmp_path / "k.toml"
    profile.write_text(f'[target]\nsource = "{gguf_file}"\n[draft]\nkind = "early-exit"\nlayers = 1\nadapter = ""\n'
                       '[decoding]\nvariant = "rsd-c"\nbranching = [2, 2]\n')
    calls = []
    layers = blocks.NativeForward.layers
    monkeypatch.setattr(blocks.NativeForward, "layers", lambda self, table, *rest: calls.append(
        table.shape[0] // blocks.TABLE_ENTRIES) or layers(self, table, *rest))
    answers = []
    for compile, kernels in (("auto", "blocks"), ("off", "0")):
        monkeypatch.setenv("RSD_RUNTIME_COMPILE", compile)
        monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", kernels)
        result = CliRunner().invoke(app, ["generate", "the cat", "--profile", str(profile), "--json", "-n", "16",
                                          "-t", "0"])
        assert result.exit_code == 0, result.output
        answers.append(json.loads(result.stdout.splitlines()[-1])["token_ids"])
        if compile == "auto":
            assert set(calls) == {3, 1}, calls  # the target's 3 layers, the draft's 1, each in one call
            calls.clear()
    assert calls == []
    assert answers[0] == answers[1] and len(answers[0]) == 16


def test_a_conversion_by_an_earlier_rsd_is_redone_only_where_the_file_has_hints_to_keep(tmp_path, monkeypatch):
    """Caches converted before hints were kept (no "hints" in their marker): a K-quant file's is
    converted again, once; a file with nothing to keep (F32 here, the embedded Q4_1) keeps its copy,
    marked so it is not asked again."""
    from rsd_cli import gguf_convert, gguf_hints

    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path / "cache"))
    plain, quantised = tmp_path / "plain.gguf", tmp_path / "quantised.gguf"
    write_tiny_gguf(plain, tiny_model(40, layers=2, seed=0, scale=0.3))
    k_quant_gguf(quantised)
    conversions = []
    convert = models._convert_gguf
    monkeypatch.setattr(models, "_convert_gguf", lambda *args: conversions.append(args[0].name) or convert(*args))
    for path in (plain, quantised):
        cached = models.gguf_to_cache(path)
        marker = cached / "rsd-complete"
        marker.write_text(json.dumps({"source": str(path), "key": "content"}))  # as rsd wrote it before
        (cached / "rsd-block-hints.safetensors").unlink(missing_ok=True)
    conversions.clear()
    for _ in range(2):
        assert models.gguf_to_cache(plain) and models.gguf_to_cache(quantised)
    assert conversions == ["quantised.gguf"]
    assert json.loads((models.gguf_to_cache(plain) / "rsd-complete").read_text())["hints"] == 0
    assert json.loads((models.gguf_to_cache(quantised) / "rsd-complete").read_text())["hints"] == 16
    # where transformers' loader cannot give the scales, the conversion says so and goes on
    monkeypatch.setattr(gguf_convert, "convert", lambda *args: None)  # (transformers' whole load then)
    monkeypatch.setattr(gguf_hints, "read_hints", lambda *args: {})
    said = []
    cached = models.gguf_to_cache(quantised)
    shutil.rmtree(cached)
    models.gguf_to_cache(quantised, said.append)
    assert any("could not read the scales" in line and "Q4_K, Q5_K, Q6_K" in line for line in said), said


def test_parallel_first_runs_convert_a_gguf_once(tmp_path, monkeypatch):
    """A script that starts several rsd processes on a fresh machine: one converts, the others
    wait for it instead of converting again into the same folder."""
    import threading
    import time

    monkeypatch.setenv("RSD_CACHE_DIR", str(tmp_path / "cache"))
    gguf_file = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_file, tiny_model(40, layers=2, seed=0, scale=0.3))
    convert, conversions = models._convert_gguf, []

    def slow_convert(*args):
        conversions.append(1)
        time.sleep(0.5)  # wide enough for the other thread to find no finished copy
        convert(*args)

    monkeypatch.setattr(models, "_convert_gguf", slow_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(models.gguf_to_cache(gguf_file))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(conversions) == 1 and len(results) == 2 and results[0] == results[1]
    assert (results[0] / "rsd-complete").is_file()


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
    adapter = models.new_adapter(target, 1)
    with torch.no_grad():
        for p in adapter.parameters():
            p.add_(0.01)
    path = tmp_path / "adapter.safetensors"
    models.save_adapter(adapter, path, target, 1, {"epochs": 1})
    loaded = models.load_adapter(path, target, 1)
    assert set(loaded.keys()) == {"layer"}
    for a, b in zip(adapter.parameters(), loaded.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)  # stored as float16
    draft = models.early_exit_draft(target, 1, loaded)
    assert draft.config.num_hidden_layers == 2
    assert draft(torch.tensor([[1, 2]])).logits.shape == (1, 2, 40)
    assert draft.lm_head is target.lm_head and draft.model.norm is target.model.norm

    other = tiny_model(40, layers=3, seed=5)
    with pytest.raises(RsdError, match="trained for another target"):
        models.load_adapter(path, other, 1)
    with pytest.raises(RsdError, match="trained after 1 layers"):
        models.load_adapter(path, target, 2)
    with pytest.raises(RsdError, match="adapter file not found"):
        models.load_adapter(tmp_path / "none.safetensors", target, 1)


def test_an_adapter_with_its_own_norm_and_head_drafts_with_them(tmp_path):
    target = tiny_model(40, layers=3, seed=0)
    torch.manual_seed(0)
    expected_draw = torch.rand(1)
    torch.manual_seed(0)
    adapter = models.new_adapter(target, 1, head_rows=20)
    assert torch.equal(torch.rand(1), expected_draw), "making an adapter must not draw from torch's generator"
    assert adapter["head"].weight.shape == (20, 32)
    assert adapter["head"].weight.data_ptr() != target.lm_head.weight.data_ptr()  # a copy, trained apart
    with torch.no_grad():
        adapter["head"].weight.mul_(2.0)
        adapter["norm"].weight.add_(0.5)
    path = tmp_path / "adapter.safetensors"
    models.save_adapter(adapter, path, target, 1, {"vocab": 20})
    loaded = models.load_adapter(path, target, 1, vocab=20)
    torch.testing.assert_close(loaded["head"].weight, adapter["head"].weight, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(loaded["norm"].weight, adapter["norm"].weight, rtol=1e-3, atol=1e-4)
    draft = models.early_exit_draft(target, 1, loaded, vocab=20)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        hidden = draft.model(ids).last_hidden_state  # after the draft's own norm
        torch.testing.assert_close(draft(ids).logits, hidden @ loaded["head"].weight.T)
        shared = models.early_exit_draft(target, 1, torch.nn.ModuleDict({"layer": loaded["layer"]}), vocab=20)
        assert not torch.allclose(shared(ids).logits, draft(ids).logits)
    assert models.params_read(draft) == models.params_read(shared)  # the same work per call
    with pytest.raises(RsdError, match="20-token draft head"):
        models.load_adapter(path, target, 1)


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

    # a new (reduced) head gets the target's CPU kernels too
    assert uses_small_batch(models.early_exit_draft(target, 1, vocab=36).lm_head)
    assert models.params_read(draft) < models.params_read(models.early_exit_draft(target, 1))

    def run(shape):
        decoder = Decoder(target, draft, 40, shape, SamplingParams(0.0), set())
        return [t for e in decoder.generate([1, 5, 6], 20, seed=0) for t in e.emitted]

    reference = run(make_shape("ar"))
    assert run(make_shape("rsd-s", beam_width=2, depth=3)) == reference
    assert run(make_shape("sd", draft_len=3)) == reference


def test_the_fingerprint_ignores_dtype_and_device_but_not_the_weights(tmp_path):
    """One adapter serves the target in float32, bfloat16 and float16 (a GPU's default is bf16)."""
    target = tiny_model(40, layers=3, seed=0)
    path = tmp_path / "adapter.safetensors"
    models.save_adapter(models.new_adapter(target, 1), path, target, 1, {})
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            same = tiny_model(40, layers=3, seed=0).to(device=device, dtype=dtype)
            assert models.fingerprint(same) == models.fingerprint(target)
            assert models.load_adapter(path, same, 1) is not None, (device, dtype)
    nudged = tiny_model(40, layers=3, seed=0)
    with torch.no_grad():
        nudged.lm_head.weight.mul_(1.05)  # the same architecture, other weights
    assert models.fingerprint(nudged) == models.fingerprint(target)
    with pytest.raises(RsdError, match="trained for another target model \\(other weights\\)"):
        models.load_adapter(path, nudged, 1)


def test_adapters_written_before_the_dtype_free_fingerprint_still_load(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    target = tiny_model(40, layers=3, seed=0)
    path = tmp_path / "adapter.safetensors"
    models.save_adapter(models.new_adapter(target, 1), path, target, 1, {})
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    old = {"rsd_fingerprint": models.legacy_fingerprint(target), "rsd_layers": "1", "rsd_recipe": meta["rsd_recipe"]}
    save_file(tensors, str(path), metadata=old)
    assert models.load_adapter(path, target, 1) is not None
    with pytest.raises(RsdError, match="trained for another target"):
        models.load_adapter(path, tiny_model(40, layers=3, seed=5), 1)


def test_an_adapter_is_rounded_to_8_bit_blocks_where_the_kernel_runs_them(tmp_path, monkeypatch):
    """On a CPU with rsd's kernel the adapter's (float16-stored) linears become Q8_0 blocks, each
    weight within half a step of its block's scale; elsewhere, or asked not to, they stay as stored."""
    from rsd_cli import blocks, small_batch

    if not small_batch.blocks_available():
        pytest.skip("no blocks kernel here (no C compiler)")
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "auto")
    target = tiny_model(40, layers=3, seed=0)
    path = tmp_path / "adapter.safetensors"
    models.save_adapter(models.new_adapter(target, 1, head_rows=20), path, target, 1, {"vocab": 20})

    def linears(adapter) -> list[torch.Tensor]:
        return [m.weight.clone() for m in adapter.modules() if isinstance(m, torch.nn.Linear)]

    stored = linears(models.load_adapter(path, target, 1, vocab=20))
    adapter = models.load_adapter(path, target, 1, vocab=20)
    assert models.round_adapter(adapter)
    rounded = linears(adapter)
    assert len(rounded) == 8  # q, k, v, o, gate, up, down and the head
    for before, after in zip(stored, rounded):
        found = blocks.quantised_blocks(after)
        assert found is not None and blocks.block_format(found) == "q8_0"
        scale = before.reshape(before.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 127
        assert ((after - before).reshape(scale.shape[0], -1, 32).abs() <= scale * 0.5 + 1e-9).all()
        assert not torch.equal(after, before)
    monkeypatch.setenv("RSD_ADAPTER_BLOCKS", "0")
    kept = models.load_adapter(path, target, 1, vocab=20)
    assert not models.round_adapter(kept) and all(torch.equal(a, b) for a, b in zip(linears(kept), stored))
    monkeypatch.delenv("RSD_ADAPTER_BLOCKS")
    monkeypatch.setenv("RSD_SMALL_BATCH_MATMUL", "torch")  # the kernel not used: nothing to gain
    assert not models.round_adapter(models.load_adapter(path, target, 1, vocab=20))


def test_a_model_with_code_of_its_own_loads_only_where_the_profile_trusts_it(tiny_profile, tiny_pair_dir, tmp_path,
                                                                            monkeypatch):
    """A model whose config.json points transformers at Python files of its own (as some hub repos
    do) is refused in one line naming the profile key; with `trust_remote_code = true` (or its
    environment variable) it loads and answers as the same weights do without that code."""
    import transformers.dynamic_module_utils as modules
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from rsd_cli.cli import app
    from tiny import save_remote_code_model

    monkeypatch.setattr(modules, "HF_MODULES_CACHE", str(tmp_path / "modules"))  # (where transformers copies it)
    folder = save_remote_code_model(tmp_path / "remote", AutoModelForCausalLM.from_pretrained(tiny_pair_dir / "target"))
    untrusted = tmp_path / "remote.toml"
    untrusted.write_text(tiny_profile.read_text().replace(str(tiny_pair_dir / "target"), str(folder)))
    trusted = tmp_path / "trusted.toml"
    trusted.write_text(untrusted.read_text().replace("[target]\n", "[target]\ntrust_remote_code = true\n"))

    def run(*args):
        return CliRunner().invoke(app, [*args, "-t", "0", "-n", "8", "--json"] if args[0] == "generate" else list(args))

    result = run("generate", "hello", "-p", str(untrusted))
    assert result.exit_code == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().endswith("it comes with Python code of its own, which rsd runs only where the "
                                          "profile says trust_remote_code = true (in [target], or [draft] for the "
                                          "draft; only for a model you trust)")
    assert len(result.stderr.strip().splitlines()) == 1
    assert run("tokenize", "hello", "-p", str(untrusted)).exit_code == 0  # (its tokenizer runs none of that code)
    expected = json.loads(run("generate", "hello", "-p", str(tiny_profile)).stdout)["token_ids"]
    result = run("generate", "hello", "-p", str(trusted))
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["token_ids"] == expected
    monkeypatch.setenv("RSD_TARGET_TRUST_REMOTE_CODE", "1")
    result = run("generate", "hello", "-p", str(untrusted))
    assert result.exit_code == 0 and json.loads(result.stdout)["token_ids"] == expected


def test_a_model_that_soft_caps_its_attention_scores_loads_on_transformers_eager_attention(tmp_path):
    """Torch's SDPA takes no soft-cap: transformers before 5.24 ran Gemma 2 through it anyway, dropping
    the cap (so rsd's --compile off computed another model than its runtime, which caps), where 5.24
    refuses it. A model whose config soft-caps loads on eager attention, whatever transformers
    would pick (a Llama whose config carries the key stands for Gemma 2 here: 5.24 cannot give Gemma
    2 SDPA to check against)."""
    capped = tiny_model(40, layers=1, seed=0)
    capped.config.attn_logit_softcapping = 30.0
    capped.save_pretrained(tmp_path / "capped")
    plain = tiny_model(40, layers=1, seed=0)
    plain.save_pretrained(tmp_path / "plain")
    load = lambda folder: models._transformers_model(str(folder), True, torch.device("cpu"), torch.float32, None)
    assert load(tmp_path / "capped").config._attn_implementation == "eager"
    assert load(tmp_path / "plain").config._attn_implementation == "sdpa"


def test_a_phi_target_gives_an_early_exit_draft_and_an_own_norm_is_refused_for_layernorms():
    """Phi keeps its final norm as `final_layernorm`: an early-exit draft shares it (and gives the
    target's logits with all its layers); a draft's own final norm and head (`rsd distill
    --train-head`) would lack a LayerNorm's bias, so it is refused in a line naming --shared-head."""
    from tiny import tiny_relative

    target = tiny_relative("phi", 40, layers=2)
    draft = models.early_exit_draft(target, 1)
    assert draft.model.final_layernorm is target.model.final_layernorm and len(draft.model.layers) == 1
    tokens = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        whole = models.early_exit_draft(target, 1, adapter=models.new_adapter(target, 1))(tokens).logits
        torch.testing.assert_close(whole, target(tokens).logits)
    with pytest.raises(RsdError, match="--shared-head"):
        models.new_adapter(target, 1, head_rows=8)


@pytest.mark.parametrize("kind", ["lfm2_moe", "bamba", "nemotron_h", "mamba2"])
def test_early_exit_drafts_and_adapters_of_hybrid_decoders_share_the_target_modules_they_read(kind):
    """An early-exit draft takes the target's rotary tables whatever their name (LFM2-MoE's `pos_emb`:
    else left on the meta device, and the draft failed at its first forward), and of a Bamba, whose
    config works its layer kinds out of its layer count, it sets none; a Mamba-2's decoder is its
    `backbone`. The adapter `rsd distill`
    trains, a copy of the layer after the draft's, is of that layer's kind (a Bamba layer is told
    whether it holds a mixer or attention; a Nemotron-H block names its `mixer`), so the draft with
    it is the whole target, logit for logit; and the draft without one decodes `sd` with plain
    greedy's tokens on transformers' forward and on the static-cache runtime."""
    from rsd_cli.compiled import CompiledModel
    from rsd_cli.drafting import make_shape
    from rsd_cli.engine import Decoder, Runtimes
    from rsd_cli.sampling import SamplingParams
    from tiny import tiny_relative

    layers = 3 if kind == "nemotron_h" else 2  # (Nemotron-H's blocks: a mixer, an MLP, attention)
    target = tiny_relative(kind, 40, layers=layers)
    tokens = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        whole = models.early_exit_draft(target, layers - 1, adapter=models.new_adapter(target, layers - 1))
        torch.testing.assert_close(whole(tokens).logits, target(tokens).logits)
    draft = models.early_exit_draft(target, 1)
    expected = None
    for runtimes in (None, Runtimes(CompiledModel(target, False), CompiledModel(draft, False), "auto")):
        chains = [] if kind == "nemotron_h" and runtimes is None else [make_shape("sd", draft_len=3)]
        for shape in [make_shape("ar")] + chains:  # (Nemotron-H: plain steps alone on transformers' forward)
            decoder = Decoder(target, draft, 40, shape, SamplingParams(temperature=0), set(), runtimes=runtimes)
            got = [t for event in decoder.generate([1, 3, 4, 7, 2], 10, 0) for t in event.emitted]
            expected = expected or got
            assert got == expected and len(got) == 10, shape.describe()


def test_an_early_exit_draft_of_gemma4_is_refused_in_a_line_naming_a_separate_draft(tmp_path):
    """Gemma 4's first layers read per-layer inputs made for all its layers (and its last layers read
    earlier ones' caches): as a user runs it, `rsd generate` with an early-exit draft of one ends with
    one line naming a separate draft, not transformers' error, and `rsd distill` (an adapter for such
    a draft) says so before sampling any answer; without those (a Gemma 4 of plain layers) the early
    exit is cut."""
    from typer.testing import CliRunner

    from rsd_cli.cli import app
    from tiny import tiny_relative, tiny_tokenizer

    target = tiny_relative("gemma4", 40, layers=4)
    target.save_pretrained(tmp_path / "gemma4")
    tiny_tokenizer().save_pretrained(tmp_path / "gemma4")
    profile = tmp_path / "gemma4.toml"
    profile.write_text(f'[target]\nsource = "{tmp_path / "gemma4"}"\n[draft]\nkind = "early-exit"\nlayers = 1\n'
                       'adapter = ""\n')
    result = CliRunner().invoke(app, ["generate", "hello", "-p", str(profile), "-n", "4"])
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        'rsd: error: an early-exit draft cannot be cut from Gemma4ForCausalLM: its layers read inputs made for all '
        'its layers, or caches of other layers; name a smaller model of its family as the draft ([draft] kind = '
        '"model")']
    result = CliRunner().invoke(app, ["distill", "-p", str(profile), "--out", str(tmp_path / "adapter.safetensors"),
                                      "--tokens", "40", "--epochs", "1"])
    assert result.exit_code == 1 and result.stderr.strip().splitlines()[-1].startswith(
        "rsd: error: an early-exit draft cannot be cut from Gemma4ForCausalLM")
    assert "teacher labels" not in result.output and "sampling" not in result.output
    from transformers import Gemma4ForCausalLM

    plain = Gemma4ForCausalLM(target.config.__class__(**{**target.config.to_dict(), "num_kv_shared_layers": 0,
                                                         "hidden_size_per_layer_input": 0}))
    draft = models.early_exit_draft(plain.eval(), 1)
    with torch.no_grad():
        logits = draft(torch.tensor([[3, 1, 4]])).logits
    assert len(draft.model.layers) == 1 and logits.shape == (1, 3, 40) and bool(torch.isfinite(logits).all())


def test_a_published_gemma3n_loads_its_text_decoder_alone(tmp_path):
    """A Gemma 3n as published (Gemma3nForConditionalGeneration: its image tower is timm's, which with
    PIL the whole model needs, neither installed with rsd) loads as its text model's Gemma3nForCausalLM,
    its decoder's weights read out of the checkpoint — the logits of the text model it was saved from —
    and runs both runtimes through `rsd generate` alike; with a weight of the decoder missing from the
    checkpoint, the whole model's load is tried, and (here, without timm) one line says what it needs
    instead of running random weights."""
    from typer.testing import CliRunner

    from rsd_cli.cli import app
    from tiny import save_gemma3n_multimodal, save_profiled_pair, tiny_relative, tiny_tokenizer

    vocab = len(tiny_tokenizer())
    text = tiny_relative("gemma3n", vocab, layers=4, seed=0)
    folder = save_gemma3n_multimodal(tmp_path / "gemma3n", text)
    model, _ = models.load_model(str(folder), torch.device("cpu"), torch.float32)
    assert type(model).__name__ == "Gemma3nForCausalLM"
    ids = torch.tensor([[1, 5, 7, 9, 11]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, text(ids).logits, atol=1e-5, rtol=1e-5)  # (sdpa, eager)
    pair = save_profiled_pair(tmp_path / "pair", text, tiny_relative("gemma3n", vocab, 1, seed=1))
    profile = tmp_path / "published.toml"
    profile.write_text(pair.read_text().replace(str(tmp_path / "pair" / "target"), str(folder)))
    assert str(folder) in profile.read_text()
    answers = {}
    for setting in ("off", "auto"):
        result = CliRunner().invoke(app, ["generate", "hello", "-p", str(profile), "-t", "0", "-n", "8",
                                          "--ignore-eos", "-v", "rsd-c", "--compile", setting, "--json"])
        assert result.exit_code == 0, result.stderr
        answers[setting] = json.loads(result.stdout)
    assert answers["auto"]["runtime"].startswith("static cache")
    assert answers["off"]["token_ids"] == answers["auto"]["token_ids"]
    broken = save_gemma3n_multimodal(tmp_path / "broken", text, drop="model.layers.0.laurel.linear_left.weight")
    if importlib.util.find_spec("timm") is None or importlib.util.find_spec("PIL") is None:
        with pytest.raises(RsdError, match="requires the"):
            models.load_model(str(broken), torch.device("cpu"), torch.float32)


def test_a_multimodal_gemma_loads_its_text_decoder_and_head_alone(tmp_path):
    """Gemma 3 (4B and up: an image tower beside its decoder, its head tied to the text embedding by the
    whole model's config, not its text config), Gemma 4 and Qwen3.5 (published as its multimodal model)
    saved as their multimodal models load as their text models (Gemma3ForCausalLM, Gemma4ForCausalLM,
    Qwen3_5ForCausalLM) with the whole model's logits and without the image tower's weights; a Gemma 3 checkpoint missing a decoder weight loads whole instead, as
    before (the text model alone would have run that weight random)."""
    from tiny import tiny_gemma4_multimodal, tiny_qwen3_5_multimodal, tiny_tokenizer, tiny_windowed

    ids = torch.tensor([[1, 5, 7, 9, 11]])
    for name, whole in (("gemma3", tiny_windowed("gemma3-vision", 36, 3, 0)), ("gemma4", tiny_gemma4_multimodal(36)),
                        ("qwen3_5", tiny_qwen3_5_multimodal(36))):
        whole.save_pretrained(tmp_path / name)
        tiny_tokenizer().save_pretrained(tmp_path / name)
        model, _ = models.load_model(str(tmp_path / name), torch.device("cpu"), torch.float32)
        assert type(model).__name__ == {"gemma3": "Gemma3ForCausalLM", "gemma4": "Gemma4ForCausalLM",
                                        "qwen3_5": "Qwen3_5ForCausalLM"}[name]
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, whole(ids).logits, atol=1e-5, rtol=1e-5)
        if name != "gemma4":  # (no tower: fewer weights than the whole's)
            assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in whole.parameters())
            assert not any("vision" in n or "visual" in n for n, _ in model.named_parameters())
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "gemma3" / "model.safetensors")
    dropped = next(name for name in tensors if name.endswith("layers.0.mlp.up_proj.weight"))
    save_file({k: v for k, v in tensors.items() if k != dropped}, tmp_path / "gemma3" / "model.safetensors",
              metadata={"format": "pt"})
    model, _ = models.load_model(str(tmp_path / "gemma3"), torch.device("cpu"), torch.float32)
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
