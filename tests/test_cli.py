"""The CLI as a user runs it: stdout and stderr asserted apart, exit codes, no tracebacks."""

from __future__ import annotations

import io
import json
import re

import pytest
from typer.testing import CliRunner

from rsd_cli.cli import app, read_prompt
from rsd_cli.errors import RsdError, UsageError


@pytest.fixture
def cli():
    runner = CliRunner()

    def invoke(*args, input=None, env=None):
        return runner.invoke(app, [str(a) for a in args], input=input, env=env)

    return invoke


def assert_clean_error(result, code: int, fragment: str):
    assert result.exit_code == code, (result.stdout, result.stderr)
    assert fragment in result.stderr
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    assert result.stdout == ""


def test_generate_streams_text_to_stdout_and_stats_to_stderr(cli, tiny_profile):
    result = cli("generate", "hello", "-p", tiny_profile, "--seed", "3", input="")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() != ""
    assert "block efficiency" not in result.stdout
    assert "block efficiency" in result.stderr and "tok/s" in result.stderr


def test_a_run_that_drafted_nothing_tells_no_acceptance(cli, tiny_profile):
    """`-v ar` said "acceptance 0.00 (per depth -) · … · draft 0.00s · verify …": as if drafts were
    rejected. A run that drafted nothing says its target's time; one that drafted, its acceptance."""
    plain = cli("generate", "hello", "-p", tiny_profile, "-n", "4", "-v", "ar", "--ignore-eos", input="")
    assert plain.exit_code == 0, plain.stderr
    assert re.fullmatch(r"ar · 4 steps · 4 tokens · block efficiency 1\.00 · [\d.]+ tok/s.* · target [\d.]+s( · forwards on .*)?\n",
                        plain.stderr), plain.stderr
    assert "acceptance" not in plain.stderr and "draft" not in plain.stderr
    drafted = cli("generate", "hello", "-p", tiny_profile, "-n", "4", "-v", "sd", "--ignore-eos", input="")
    assert re.search(r" · acceptance [\d.]+ \(per depth [\d. ]+\) · .* · draft [\d.]+s · verify [\d.]+s",
                     drafted.stderr), drafted.stderr


def test_one_step_and_one_token_are_said_in_the_singular(cli, tiny_profile):
    """`-n 1` said "1 steps · 1 tokens", `rsd tokenize` "1 tokens"."""
    result = cli("generate", "hello", "-p", tiny_profile, "-n", "1", "-v", "ar", input="")
    assert result.exit_code == 0 and " 1 step · 1 token · block efficiency" in result.stderr, result.stderr
    result = cli("generate", "hello", "-p", tiny_profile, "-n", "2", "-v", "ar", "--ignore-eos", input="")
    assert " 2 steps · 2 tokens · block efficiency" in result.stderr, result.stderr
    result = cli("tokenize", "a", "-p", tiny_profile, input="")
    assert result.exit_code == 0 and result.stderr.startswith("1 token · the answer ends at: "), result.stderr


def test_sleeping_openmp_threads_are_named_once_as_the_reason_for_slow_forwards(cli, tiny_profile):
    """OMP_WAIT_POLICY=PASSIVE makes a CPU forward ~3x slower (its threads sleep at each barrier):
    said in one line, with the same answer; nothing said without it."""
    passive = cli("generate", "hello", "-p", tiny_profile, "-t", "0", input="", env={"OMP_WAIT_POLICY": "passive"})
    assert passive.exit_code == 0, passive.stderr
    assert passive.stderr.count("rsd: OMP_WAIT_POLICY=PASSIVE makes forwards on the CPU several times slower") == 1
    plain = cli("generate", "hello", "-p", tiny_profile, "-t", "0", input="", env={"OMP_WAIT_POLICY": "ACTIVE"})
    assert "OMP_WAIT_POLICY" not in plain.stderr and plain.stdout == passive.stdout


def test_a_missing_c_compiler_is_named_once_as_the_reason_for_slow_forwards(cli, tiny_profile, monkeypatch):
    """Without cc, gcc or clang rsd's C kernel cannot be built and quantised weights run on float32
    ones, ~4x slower for the embedded pair: said in one line (how to silence it included), with the
    same answer; nothing said where a compiler is found, or the kernel is switched off or another forced."""
    from rsd_cli import blocks

    found = cli("generate", "hello", "-p", tiny_profile, "-t", "0", input="", env={"RSD_SMALL_BATCH_MATMUL": "auto"})
    assert found.exit_code == 0, found.stderr
    assert "C compiler" not in found.stderr
    monkeypatch.setattr(blocks, "_compiler", lambda: None)
    line = "rsd: no C compiler found (cc, gcc or clang) to build rsd's C kernel"
    for env, said in (({"RSD_SMALL_BATCH_MATMUL": "auto"}, 1), ({"RSD_SMALL_BATCH_MATMUL": "blocks"}, 1),
                      ({"RSD_SMALL_BATCH_MATMUL": "auto", "RSD_BLOCK_KERNELS": "0"}, 0),
                      ({"RSD_SMALL_BATCH_MATMUL": "packed"}, 0)):
        missing = cli("generate", "hello", "-p", tiny_profile, "-t", "0", input="", env=env)
        assert missing.exit_code == 0, missing.stderr
        assert missing.stderr.count(line) == said, (env, missing.stderr)
        assert "RSD_BLOCK_KERNELS=0" in missing.stderr if said else "C compiler" not in missing.stderr
        assert missing.stdout == found.stdout


def test_a_c_kernel_that_does_not_build_is_named_once_with_the_compiler_s_error(cli, tiny_profile, tmp_path):
    """A compiler that cannot build rsd's C kernel (macOS's clang has no OpenMP of its own) leaves quantised
    weights on float32 ones as a missing compiler does: said in one line, with the compiler's error, and
    the same answer."""
    from rsd_cli import blocks

    env = {"RSD_SMALL_BATCH_MATMUL": "auto"}
    found = cli("generate", "hello", "-p", tiny_profile, "-t", "0", input="", env=env)
    failing = tmp_path / "cc"
    failing.write_text("#!/bin/sh\necho \"clang: error: unsupported option '-fopenmp'\" >&2\nexit 1\n")
    failing.chmod(0o755)
    blocks.library.cache_clear()  # (built once a process: built again here, with the failing compiler)
    try:
        broken = cli("generate", "hello", "-p", tiny_profile, "-t", "0", input="", env={**env, "CC": str(failing)})
    finally:
        blocks.library.cache_clear()
    assert broken.exit_code == 0, broken.stderr
    line = f"rsd: rsd's C kernel did not build with {failing} (clang: error: unsupported option '-fopenmp'): "
    assert broken.stderr.count(line) == 1, broken.stderr
    assert "RSD_BLOCK_KERNELS=0" in broken.stderr and "C kernel" not in found.stderr
    assert broken.stdout == found.stdout


def test_generate_json_has_every_field(cli, tiny_profile):
    result = cli("generate", "hello", "-p", tiny_profile, "--json", "-n", "10", "-t", "0", input="")
    assert result.exit_code == 0, result.stderr
    record = json.loads(result.stdout)
    assert {"text", "token_ids", "profile", "variant", "stats"} <= set(record)
    for key in ("steps", "new_tokens", "block_efficiency", "acceptance_rate", "tokens_per_second",
                "draft_seconds", "verify_seconds", "wall_seconds", "mbsu", "acceptance_per_depth"):
        assert key in record["stats"], key
    assert record["variant"] == "rsd-c" and record["profile"] == "tiny"
    assert record["stats"]["new_tokens"] == len(record["token_ids"]) <= 10
    assert "block efficiency" in result.stderr
    raw = [json.loads(cli("generate", prompt, "-p", tiny_profile, "--json", "-n", "2", "--raw", input="").stdout)
           for prompt in ("hello", "hello hello")]  # (the tiny tokenizer: a token a character)
    assert raw[1]["prompt_tokens"] - raw[0]["prompt_tokens"] == len(" hello")
    assert record["prompt_tokens"] > raw[0]["prompt_tokens"]  # (the chat template's tokens around "hello")


def test_the_first_tokens_time_is_reported_and_said_apart_where_it_took_most_of_the_run(cli, tiny_profile,
                                                                                       monkeypatch):
    """--json gives the time to the first token (the prompt read and the first step) and the rate
    after it; where the first token took at least half the run (a long prompt), the statistics line
    says both, else neither. A clock made up for the run: 12 s to the first step, 0.1 s a step after."""
    from types import SimpleNamespace

    from rsd_cli import generation

    def run(first: float, *args: str):
        ticks = iter([0.0] + [first + 0.1 * i for i in range(1000)])  # the start, then one a step
        monkeypatch.setattr(generation, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
        result = cli("generate", "hello", "-p", tiny_profile, "-n", "6", "-t", "0", "-v", "ar", *args, input="")
        assert result.exit_code == 0, result.stderr
        return result

    stats = json.loads(run(12.0, "--json").stdout)["stats"]
    assert stats["steps"] == 6 and stats["first_token_seconds"] == pytest.approx(12.0)
    assert stats["wall_seconds"] == pytest.approx(12.5)
    assert stats["tokens_per_second_after_first"] == pytest.approx(5 / 0.5)  # (ar: a token a step)
    assert stats["tokens_per_second"] == pytest.approx(6 / 12.5)
    assert "0.5 tok/s (first token after 12.0 s, then 10.0 tok/s) · target" in run(12.0).stderr
    assert "tok/s · target" in run(0.1).stderr and "first token after" not in run(0.1).stderr  # (0.1 s of 0.6)


def test_the_rate_after_the_first_token_of_merged_runs_leaves_each_ones_first_step_out():
    from rsd_cli.engine import Stats

    one, other = Stats(), Stats()
    one.steps, one.new_tokens, one.first_step_tokens, one.wall_seconds, one.first_token_seconds = 4, 7, 1, 3.0, 2.0
    other.steps, other.new_tokens, other.first_step_tokens, other.wall_seconds, other.first_token_seconds = 2, 3, 2, 1.5, 1.0
    one.merge(other)
    assert one.first_token_seconds == 3.0 and one.tokens_per_second_after_first == pytest.approx((10 - 3) / (4.5 - 3.0))
    assert Stats().tokens_per_second_after_first == 0.0


def test_forwards_on_fewer_threads_are_said_in_the_stats_line_and_counted_in_json(cli, tiny_profile, monkeypatch):
    """Where the governor keeps fewer threads than the CPU's (other processes hold cores), the stats
    line says so and --json counts the forwards by their threads; on every thread nothing is said.
    The tokens are the same."""
    import torch

    from rsd_cli import threads

    if not threads._openmp():
        pytest.skip("torch's own thread pool: its count is never changed")

    class Kept(threads.Governor):
        """a governor that keeps `kept` threads: no trial, no halving"""

        def __init__(self, kept: int):
            super().__init__(load=lambda: None)
            self.kept = kept

        def _reset(self, most: int) -> None:
            super()._reset(most)
            self.threads = self.kept

        def _choose(self) -> int:
            return self.threads

        def _record(self, *_) -> None:
            pass

    def generate(kept: int):
        monkeypatch.setattr(threads, "GOVERNOR", Kept(kept))
        result = cli("generate", "hello", "-p", tiny_profile, "--json", "-n", "6", "-t", "0", input="")
        assert result.exit_code == 0, result.stderr
        return json.loads(result.stdout), result.stderr

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        (alone, quiet), (shared, said) = generate(2), generate(1)
    finally:
        torch.set_num_threads(before)
    assert alone["stats"]["cpu_threads"] == shared["stats"]["cpu_threads"] == 2
    assert set(alone["stats"]["forward_threads"]) == {"2"} and set(shared["stats"]["forward_threads"]) == {"1"}
    assert shared["stats"]["forward_threads"]["1"] > shared["stats"]["steps"]  # (the prompt's, each step's, drafts')
    assert "forwards on 1 of 2 threads" in said and "forwards on" not in quiet
    assert alone["token_ids"] == shared["token_ids"]


def test_seeded_runs_repeat_and_greedy_variants_agree(cli, tiny_profile):
    def text(*extra):
        result = cli("generate", "the cat", "-p", tiny_profile, "--json", "-n", "12", *extra, input="")
        assert result.exit_code == 0, result.stderr
        return json.loads(result.stdout)["token_ids"]

    assert text("--seed", "5") == text("--seed", "5")
    greedy = text("-t", "0", "-v", "ar")
    for variant in ("sd", "mss", "spectr", "rsd-c", "rsd-s", "lookup"):
        assert text("-t", "0", "-v", variant) == greedy, variant
    assert text("-t", "0", "-v", "lookup", "--ngram", "1", "--draft-len", "6") == greedy


def saved_windowed_pair(root, target_kind: str, draft_kind: str) -> tuple:
    """A saved pair of tiny sliding-window models (tiny.tiny_windowed kinds, windows of 8): its
    profile, a prompt longer than the window, and transformers' own 24 greedy tokens after it."""
    import torch
    from tiny import save_profiled_pair, tiny_tokenizer, tiny_windowed

    tokenizer = tiny_tokenizer()
    profile = save_profiled_pair(root, tiny_windowed(target_kind, len(tokenizer), 3, 0),
                                 tiny_windowed(draft_kind, len(tokenizer), 1, 1))
    prompt = "the cat sat on"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = tiny_windowed(target_kind, len(tokenizer), 3, 0).generate(
            ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)[0, ids.shape[1]:]
    return profile, prompt, expected.tolist()


def test_a_sliding_window_pair_answers_with_its_targets_greedy_tokens_past_the_window(cli, tmp_path):
    """A saved Gemma 3-like pair (every layer but the last sees the last 8 positions; the target
    multimodal, as Gemma 3 4B and up, its sizes and window in its text config) gives, for every
    variant, on transformers' forward and on the static-cache runtime (its text decoder read there),
    transformers' own greedy answer to a prompt longer than the window: before, the forward past
    the window failed with a traceback, and the multimodal target did not load."""
    profile, prompt, expected = saved_windowed_pair(tmp_path, "gemma3-vision", "gemma3")
    for variant, compile in (("ar", "off"), ("sd", "auto"), ("rsd-c", "auto"), ("rsd-c", "off"), ("rsd-s", "auto")):
        result = cli("generate", prompt, "-p", profile, "--raw", "--json", "-n", "24", "-t", "0", "-v", variant,
                     "--compile", compile, input="")
        assert result.exit_code == 0, result.stderr
        record = json.loads(result.stdout)
        assert record["token_ids"] == expected, (variant, compile)
        assert record["runtime"].startswith("static cache") == (compile == "auto"), record["runtime"]


@pytest.mark.parametrize("kind", ["mistral", "gemma3"])
def test_a_sliding_window_pair_runs_on_the_static_cache_runtime(cli, tmp_path, kind):
    """A saved Mistral 7B v0.1-like pair (every layer sees the last 8 positions), or a Gemma 3 one
    (every layer but the last), runs on the static-cache runtime (before: transformers' eager
    forward) and gives transformers' own greedy answer past the window for every variant."""
    profile, prompt, expected = saved_windowed_pair(tmp_path, kind, kind)
    for variant, compile in (("ar", "auto"), ("sd", "auto"), ("rsd-c", "auto"), ("rsd-c", "off")):
        result = cli("generate", prompt, "-p", profile, "--raw", "--json", "-n", "24", "-t", "0", "-v", variant,
                     "--compile", compile, input="")
        assert result.exit_code == 0, result.stderr
        record = json.loads(result.stdout)
        assert record["token_ids"] == expected, variant
        assert record["runtime"].startswith("static cache") == (compile == "auto"), record["runtime"]


def test_an_alibi_pair_runs_chains_and_refuses_a_tree_in_one_line(cli, tmp_path):
    """A saved BLOOM pair (ALiBi: its attention takes no tree): `sd` gives transformers' own greedy
    answer, several samples of `ar` run one after the other with their seeds, and a tree variant
    is refused in one line naming the variants that run; before, rsd failed with "too many values
    to unpack" (a tree's mask given where BLOOM wants a 2D one)."""
    import torch
    from tiny import save_profiled_pair, tiny_alibi, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    profile = save_profiled_pair(tmp_path, tiny_alibi("bloom", len(tokenizer), 3, 0),
                                 tiny_alibi("bloom", len(tokenizer), 1, 1))
    prompt = "the cat sat on the mat"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = tiny_alibi("bloom", len(tokenizer), 3, 0).generate(
            ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
    result = cli("generate", prompt, "-p", profile, "--raw", "--json", "-n", "16", "-t", "0", "-v", "sd", input="")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["token_ids"] == expected
    samples = cli("generate", prompt, "-p", profile, "--json", "-n", "6", "-t", "1", "-v", "ar", "--samples", "2",
                  "--seed", "4", input="")
    assert samples.exit_code == 0, samples.stderr
    records = [json.loads(line) for line in samples.stdout.splitlines()]
    assert [(r["seed"], r["samples_together"]) for r in records] == [(4, 1), (5, 1)]
    alone = cli("generate", prompt, "-p", profile, "--json", "-n", "6", "-t", "1", "-v", "ar", "--seed", "5", input="")
    assert json.loads(alone.stdout)["token_ids"] == records[1]["token_ids"]
    refused = cli("generate", prompt, "-p", profile, "-v", "rsd-c", input="")
    assert refused.exit_code == 1 and refused.stdout == ""
    assert refused.stderr.strip() == ("rsd: error: rsd-c verifies a tree, which the target's ALiBi position "
                                      "biases (bloom) cannot take: use --variant ar, sd or lookup (or auto)")
    bench = cli("bench", "-p", profile, "--limit", "1", "-n", "4", "--no-assisted", "--no-hf-static", "--json",
                input="")
    assert bench.exit_code == 0, bench.stderr  # (its default variants: those the pair takes)
    assert [row["variant"] for row in json.loads(bench.stdout)["results"]] == ["ar", "sd", "lookup", "auto"]
    assert "the target's ALiBi position biases (bloom) take no tree: measuring ar, sd, lookup, auto" in bench.stderr
    chat = cli("chat", "-p", profile, "-n", "4", input="/set variant rsd-c\n/set temperature 0\n/set variant sd\nhi\n")
    assert chat.exit_code == 0, chat.stderr  # (a tree refused at /set, the session as it was; other settings taken)
    assert ("error: rsd-c verifies a tree, which the target's ALiBi position biases (bloom) cannot take: use /set "
            "variant ar, sd or lookup (or auto)") in chat.stderr
    assert "temperature = 0.0" in chat.stdout + chat.stderr and "variant = sd" in chat.stdout + chat.stderr


def test_pairs_with_recurrent_layers_decode_what_they_can_take_back_and_refuse_the_rest(cli, tmp_path):
    """A saved LFM2 pair (short convolutions) decodes `sd` chains, its greedy answer plain
    decoding's, and refuses a tree in one line; a saved Mamba pair (transformers' Mamba reads a chain
    after a state without it) runs `auto` among plain steps where no variant was chosen and refuses
    `sd` asked for."""
    from tiny import save_profiled_pair, tiny_recurrent, tiny_tokenizer

    rows = len(tiny_tokenizer())

    def answer(profile, *extra):
        result = cli("generate", "the cat", "-p", profile, "--json", "-n", "8", "-t", "0", *extra, input="")
        assert result.exit_code == 0, result.stderr
        return json.loads(result.stdout)

    chains = save_profiled_pair(tmp_path / "lfm2", tiny_recurrent("lfm2", rows, 4, 0),
                                tiny_recurrent("lfm2", rows, 2, 1))
    drafted = answer(chains)  # (the profile's variant: sd's default)
    assert drafted["variant"] == "sd" and drafted["token_ids"] == answer(chains, "-v", "ar")["token_ids"]
    refused = cli("generate", "the cat", "-p", chains, "-v", "rsd-c", input="")
    assert refused.exit_code == 1 and refused.stdout == ""
    assert refused.stderr.strip() == ("rsd: error: rsd-c verifies a tree, which the target's recurrent layers (lfm2) "
                                      "cannot take: use --variant ar, sd or lookup (or auto)")
    plain = save_profiled_pair(tmp_path / "mamba", tiny_recurrent("mamba", rows, 2, 0),
                               tiny_recurrent("mamba", rows, 1, 1))
    record = answer(plain)
    assert record["variant"] == "auto" and record["stats"]["shapes"] == {"ar": len(record["token_ids"])}
    assert record["token_ids"] == answer(plain, "-v", "ar")["token_ids"]
    refused = cli("generate", "the cat", "-p", plain, "-v", "sd", input="")
    assert refused.exit_code == 1 and refused.stderr.strip() == (
        "rsd: error: sd verifies drafts, which the target's recurrent layers (mamba) cannot take back: use --variant "
        "ar (or auto)")


def test_a_draft_with_fewer_rows_than_the_target_leaves_the_target_its_own_tokens(cli, tmp_path):
    """A target whose embedding has rows past the draft's (Qwen2.5-7B's 152064 against 0.5B's
    151936): its answers hold tokens only it has (before, the vocabulary was narrowed to the
    draft's and they were never drawn), which the draft reads without failing."""
    import torch
    from tiny import save_profiled_pair, tiny_model, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    rows = len(tokenizer)
    target, draft = tiny_model(rows + 4, layers=3, seed=0, scale=0.3), tiny_model(rows, layers=1, seed=1, scale=0.3)
    with torch.no_grad():  # (the target's own tokens about as likely as its likeliest)
        target.lm_head.weight[rows:] = target.lm_head.weight[:4] * 1.5
    profile = save_profiled_pair(tmp_path, target, draft)
    result = cli("generate", "the cat", "-p", profile, "--json", "-n", "24", "-t", "1", "-v", "sd", "--samples", "3",
                 input="")
    assert result.exit_code == 0, result.stderr
    drawn = [token for line in result.stdout.splitlines() for token in json.loads(line)["token_ids"]]
    assert max(drawn) >= rows


def test_samples_json_prints_one_object_per_line(cli, tiny_profile):
    result = cli("generate", "hi", "-p", tiny_profile, "--samples", "3", "--json", "-n", "5", input="")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 3
    assert [json.loads(line)["seed"] for line in lines] == [7, 8, 9]


def test_a_run_without_a_seed_says_the_seed_it_drew_and_that_seed_reproduces_it(cli, tiny_profile):
    """--json gives the seed a run drew for itself (the profile's -1), so a sample a script liked can
    be had again with --seed; samples after it take the next seeds, as with --seed."""
    drawn = cli("generate", "hi", "-p", tiny_profile, "--seed", "-1", "-v", "sd", "-t", "1", "--json", "-n", "12",
                "--samples", "2", input="")
    assert drawn.exit_code == 0, drawn.stderr
    first, second = (json.loads(line) for line in drawn.stdout.strip().splitlines())
    assert isinstance(first["seed"], int) and first["seed"] >= 0 and second["seed"] == first["seed"] + 1
    again = cli("generate", "hi", "-p", tiny_profile, "--seed", first["seed"], "-v", "sd", "-t", "1", "--json",
                "-n", "12", input="")
    assert json.loads(again.stdout)["token_ids"] == first["token_ids"]
    other = cli("generate", "hi", "-p", tiny_profile, "--seed", "-1", "-v", "sd", "-t", "1", "--json", "-n", "12",
                input="")
    assert json.loads(other.stdout)["seed"] != first["seed"]  # (a fresh draw each run: 1 in 2^62 to coincide)


def test_samples_read_the_prompt_once_and_give_what_separate_runs_give(cli, tiny_profile, monkeypatch):
    """Each sample after the first starts from the caches the one before left (the prompt read
    once); the tokens are those of separate runs with the same seeds."""
    from rsd_cli.engine import ChainExtension

    read = []
    real = ChainExtension.extend
    monkeypatch.setattr(ChainExtension, "extend",
                        lambda self, tokens, *a, **k: read.append(len(tokens)) or real(self, tokens, *a, **k))
    prompt = "hello there, " * 8
    result = cli("generate", prompt, "-p", tiny_profile, "--samples", "3", "--json", "-n", "6", input="")
    assert result.exit_code == 0, result.stderr
    together = [json.loads(line)["token_ids"] for line in result.stdout.splitlines()]
    prompt_reads = [n for n in read if n > 10]
    assert len(prompt_reads) == 2  # the target's and the draft's, for the first sample only
    alone = []
    for seed in (7, 8, 9):
        one = cli("generate", prompt, "-p", tiny_profile, "--seed", seed, "--json", "-n", "6", input="")
        alone.append(json.loads(one.stdout)["token_ids"])
    assert together == alone and len(read) > len(prompt_reads) + 6


@pytest.mark.parametrize("variant", ["ar", "auto"])
def test_samples_of_plain_decoding_are_decoded_together_and_are_what_separate_runs_give(cli, tiny_profile, variant):
    """--samples of ar or auto: one forward a step for every unfinished sample; each sample's tokens,
    text and finish are those of a separate `ar` run with its seed (a stop string ending each
    where it does alone), reported in order (the text: as one after the other); an overall line on
    stderr. A drafting variant's samples still run one after the other."""
    common = ["-p", tiny_profile, "-n", "16", "-t", "1", "--stop", ",", "--seed", "4"]
    result = cli("generate", "hi", *common, "--samples", "4", "--json", "-v", variant, input="")
    assert result.exit_code == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    alone = [json.loads(cli("generate", "hi", *common[:-1], str(seed), "--json", "-v", "ar", input="").stdout)
             for seed in (4, 5, 6, 7)]
    for record, one in zip(records, alone):
        assert record["samples_together"] == 4 and record["shape"] == "ar" and record["variant"] == variant
        for key in ("seed", "token_ids", "text", "finish_reason", "stop"):
            assert record[key] == one[key], key
        assert record["stats"]["new_tokens"] == len(record["token_ids"]) == record["stats"]["steps"]
    assert {r["finish_reason"] for r in records} == {"stop", "length"}  # (seeds chosen to show both)
    assert "4 completions decoded together · " in result.stderr and result.stderr.count("ar · ") == 4
    text = cli("generate", "hi", *common, "--samples", "4", "-v", variant, input="")
    assert text.stdout == "\n---\n".join(one["text"] + "\n" for one in alone)
    drafted = cli("generate", "hi", *common, "--samples", "2", "--json", "-v", "sd", input="")
    assert [json.loads(line)["samples_together"] for line in drafted.stdout.splitlines()] == [1, 1]


def test_more_samples_than_a_forward_takes_are_decoded_in_groups(cli, tiny_profile, monkeypatch):
    from rsd_cli import generation

    monkeypatch.setattr(generation, "TOGETHER_AT_MOST", 2)
    common = ["-p", tiny_profile, "-n", "8", "-t", "1", "--seed", "4", "-v", "ar", "--samples", "3"]
    records = [json.loads(line) for line in cli("generate", "hi", *common, "--json", input="").stdout.splitlines()]
    assert [r["samples_together"] for r in records] == [2, 2, 1] and [r["seed"] for r in records] == [4, 5, 6]
    text = cli("generate", "hi", *common, input="")
    assert text.stdout == "\n---\n".join(r["text"] + "\n" for r in records)
    assert text.stderr.count("completions decoded together") == 1  # (a group of one is just a sample)
    monkeypatch.undo()
    # at most 64 a forward, and fewer for long answers (each row's attention passes over every one's keys)
    assert [generation.together_group(n) for n in (16, 96, 256, 512, 4000, 10**6)] == [64, 64, 32, 16, 2, 2]


@pytest.mark.parametrize("variant", ["ar", "sd"])
def test_prompts_from_a_file_are_answered_in_order_each_as_alone(cli, tiny_profile, tmp_path, variant):
    """--prompts FILE (lines, .jsonl, or stdin's lines for -): every prompt answered, --samples of each,
    in order, completion i with seed --seed + i; each record names its prompt and has the tokens of
    a separate run with that prompt and seed (decoded together for ar, one after the other for sd)."""
    prompts = ["hello there", "a b c", "what is this?"]
    lines = tmp_path / "prompts.txt"
    lines.write_text("\n".join(prompts[:2]) + "\n\n" + prompts[2] + "\n")
    common = ["-p", tiny_profile, "-n", "8", "-t", "1", "--seed", "3", "-v", variant]
    result = cli("generate", "--prompts", lines, *common, "--samples", "2", "--json", input="")
    assert result.exit_code == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["prompt_index"] for r in records] == [0, 0, 1, 1, 2, 2]
    assert [r["seed"] for r in records] == [3, 4, 5, 6, 7, 8]
    assert {r["samples_together"] for r in records} == ({6} if variant == "ar" else {1})
    for record in records:
        one = cli("generate", prompts[record["prompt_index"]], *common[:-3], str(record["seed"]), "-v", variant,
                  "--json", input="")
        alone = json.loads(one.stdout)
        assert record["token_ids"] == alone["token_ids"] and record["prompt_tokens"] == alone["prompt_tokens"]
        assert "prompt_index" not in alone
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("\n".join(json.dumps(p if i % 2 else {"prompt": p}) for i, p in enumerate(prompts)))
    again = cli("generate", "--prompts", jsonl, *common, "--samples", "2", "--json", input="")
    assert [json.loads(line)["token_ids"] for line in again.stdout.splitlines()] == [r["token_ids"] for r in records]
    piped = cli("generate", "--prompts", "-", *common, "--samples", "2", input=lines.read_text())
    texts = [r["text"] for r in records]
    assert piped.exit_code == 0 and piped.stdout == "\n---\n".join(t + "\n" for t in texts)


def test_text_that_is_not_utf8_is_one_line_error(cli, tiny_profile):
    """Bytes that are not UTF-8 in an argument or the environment reach Python as surrogate escapes
    ("\\udcff" for 0xff); the tokenizer failed on them with "TypeError: TextInputSequence must be str"."""
    for args, env, message in (
            (["generate", "ab\udcff"], None, "rsd: error: the prompt is not valid UTF-8 (byte 2)"),
            (["generate", "hi", "--system", "\udcfe"], None, "rsd: error: the system prompt is not valid UTF-8 (byte 0)"),
            (["tokenize", "caf\u00e9 \udcff"], None, "rsd: error: the text is not valid UTF-8 (byte 6)"),
            (["generate", "hi", "--stop", "\udcff"], None, "rsd: error: flag --stop: sampling.stop must be UTF-8 text"),
            (["generate", "hi"], {"RSD_SAMPLING_STOP": "\udcff"},
             "rsd: error: environment variable RSD_SAMPLING_STOP must be UTF-8 text")):
        result = cli(*args, "-p", tiny_profile, "-n", "2", input="", env=env) if args[0] == "generate" else \
            cli(*args, "-p", tiny_profile, input="")
        assert result.exit_code in (1, 2) and result.stdout == "", (args, result.stderr)
        assert result.stderr.startswith(message) and result.stderr.count("\n") == 1, (args, result.stderr)


def test_the_stats_table_in_a_file_is_not_cut_to_80_columns(cli, tiny_profile):
    """`--stats` into a log: Rich squeezed the table into 80 columns there ("accep…", "corre…")."""
    result = cli("generate", "hello", "-p", tiny_profile, "-v", "rsd-c", "--stats", "-n", "12", "-t", "1", input="",
                 env={"COLUMNS": None})
    assert result.exit_code == 0, result.stderr
    header = next(line for line in result.stderr.splitlines() if "step" in line and "verify" in line)
    assert all(name in header for name in ("accepted", "emitted", "draft ms", "verify ms", "text"))
    assert "…" not in result.stderr and ("bonus" in result.stderr or "correction" in result.stderr)


def test_live_asked_for_where_it_cannot_draw_is_said(cli, tiny_profile):
    result = cli("generate", "hello", "-p", tiny_profile, "--live", "-n", "3", input="")
    assert result.exit_code == 0 and result.stdout.strip()
    assert result.stderr.startswith("rsd: --live draws nothing where stderr is not a terminal\n")
    result = cli("generate", "hello", "-p", tiny_profile, "-n", "3", input="")
    assert "--live" not in result.stderr  # (not asked for: nothing said)
    result = cli("generate", "hello", "-p", tiny_profile, "--live", "--json", "-n", "3", input="",
                 env={"TTY_COMPATIBLE": "1"})  # (Rich takes stderr for a terminal)
    assert result.exit_code == 0 and "rsd: --live draws nothing with --json\n" in result.stderr
    result = cli("chat", "-p", tiny_profile, "--tree", "-n", "3", input="hi\n/tree on\n")
    assert result.exit_code == 0 and result.stderr.startswith("rsd: --tree draws nothing where stderr is not a terminal\n")
    assert "(the live view draws nothing where stderr is not a terminal)" in result.stderr


def test_bad_prompts_files_are_clear_errors(cli, tiny_profile, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    result = cli("generate", "--prompts", empty, "-p", tiny_profile, input="")
    assert result.exit_code == 1 and "holds no prompts" in result.stderr and "Traceback" not in result.stderr
    result = cli("generate", "hi", "--prompts", empty, "-p", tiny_profile, input="")
    assert result.exit_code == 2 and "give a prompt or --prompts, not both" in result.stderr
    missing = tmp_path / "missing.txt"
    result = cli("generate", "--prompts", missing, "-p", tiny_profile, input="")
    assert result.exit_code == 1
    assert result.stderr == f"rsd: error: cannot read prompts from {missing}: No such file or directory\n"
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9\n".encode("latin-1"))
    result = cli("generate", "--prompts", latin1, "-p", tiny_profile, input="")
    assert result.exit_code == 1
    assert result.stderr == f"rsd: error: cannot read prompts from {latin1}: not UTF-8 text (invalid continuation byte at byte 3)\n"


def test_a_chat_template_that_refuses_the_prompt_is_a_one_line_error_a_chat_survives(cli, tiny_pair_dir, tmp_path):
    """A template's own refusal (Gemma's "System role not supported", raised by raise_exception in it) ended
    `rsd generate -s` with "TemplateError: …" and the whole chat session at its first message."""
    import shutil

    folder = tmp_path / "target"
    shutil.copytree(tiny_pair_dir / "target", folder)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}a:{% endif %}")
    profile = tmp_path / "gemma-like.toml"
    profile.write_text(f'[target]\nsource = "{folder}"\n[draft]\nkind = "early-exit"\nlayers = 1\n'
                       '[sampling]\nmax_tokens = 3\n')
    said = ("rsd: error: the model's chat template refuses this prompt: System role not supported (a system prompt "
            "was given, which some templates take none of)\n")
    result = cli("generate", "hi", "-p", profile, "-s", "be brief", input="")
    assert result.exit_code == 1 and result.stderr == said and result.stdout == "", result.stderr
    assert cli("generate", "hi", "-p", profile, input="").exit_code == 0  # (no system prompt: taken)
    session = cli("chat", "-p", profile, "-s", "be brief", input="hello\n/system\nhello\n")
    assert session.exit_code == 0, session.stderr
    assert "error: the model's chat template refuses this prompt: System role not supported" in session.stderr
    assert "system prompt cleared" in session.stderr and session.stdout.strip(), (session.stdout, session.stderr)


@pytest.mark.parametrize("variant", ["rsd-c", "ar"])  # (one after the other, and decoded together)
def test_a_prompt_past_the_context_in_a_prompts_file_is_refused_before_any_answer(cli, tiny_profile, tmp_path, variant):
    """The second prompt of three past the tiny target's context of 256 tokens stopped the run after the
    first answer, the third never given; the file is now checked whole before the first answer."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n" + "ab" * 300 + "\nworld\n")
    result = cli("generate", "--prompts", prompts, "-p", tiny_profile, "-n", "3", "-v", variant, "--json", input="")
    assert result.exit_code == 1 and result.stdout == "", result.stdout
    assert result.stderr == "rsd: error: prompt 2 of 3: the prompt has 605 tokens but the model's context holds 256\n"


def test_ctrl_c_during_samples_decoded_together_reports_each_one_so_far(cli, tiny_profile, monkeypatch):
    from rsd_cli import engine

    real = engine.Decoder.generate_together

    def interrupted(self, *args, **kwargs):
        for step, events in enumerate(real(self, *args, **kwargs), start=1):
            yield events
            if step == 3:
                raise KeyboardInterrupt

    monkeypatch.setattr(engine.Decoder, "generate_together", interrupted)
    result = cli("generate", "hi", "-p", tiny_profile, "-n", "16", "-t", "1", "--seed", "4", "--samples", "3",
                 "--json", "-v", "ar", input="")
    assert result.exit_code == 130 and "rsd: interrupted" in result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["seed"] for r in records] == [4, 5, 6]
    assert all(r["finish_reason"] == "interrupted" and len(r["token_ids"]) == 3 for r in records)


def test_budget_and_tree_flags(cli, tiny_profile):
    result = cli("generate", "hi", "-p", tiny_profile, "--json", "-n", "6", "-v", "rsd-s", "--budget", "10", input="")
    assert result.exit_code == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["shape"] == "rsd-s W=2 L=4"
    assert record["stats"]["target_tokens_per_step"] <= 10


def test_a_budget_of_hundreds_of_nodes_reads_as_one_short_line(cli, tiny_profile):
    """`--budget 250` picks rsd-c b=(3,1,…) of 83 levels: the statistics line printed every one of
    them in the head and in each shape it counted (1666 factors for `--budget 5000` on the embedded
    pair). Runs of a factor past 8 levels read as factor×count, and the answer's trees are no deeper
    than it can use."""
    result = cli("generate", "hi", "-p", tiny_profile, "-n", "6", "-v", "rsd-c", "--budget", "250", input="")
    assert result.exit_code == 0, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("rsd-c b=(3,1×82) · shapes rsd-c b=(3,1,1,1,1) ×"), line
    assert len(line) < 300


@pytest.mark.parametrize("args, said", [
    (["-v", "rsd-c", "--branching", "40,40,40"],
     "flag --branching: rsd-c b=(40,40,40) drafts trees of up to 65641 nodes, which is more than the target's "
     "context (256 tokens): a step verifies its whole tree in one forward"),
    (["-v", "sd", "--draft-len", "300"], "flag --draft-len: sd γ=300 drafts trees of up to 301 nodes, which"),
    (["-v", "rsd-s", "--beam-width", "2", "--depth", "200"], "flag --beam-width: rsd-s W=2 L=200"),
    (["-v", "rsd-c", "--budget", "1000"], "flag --budget: a budget of 1000 nodes is more than the target's context"),
    (["-v", "auto", "--budget", "300"], "flag --budget: a budget of 300 nodes is more than the target's context"),
])
def test_a_tree_of_more_nodes_than_the_context_is_refused(cli, tiny_profile, args, said):
    """A step verifies its tree in one forward: `--branching 40,40,40` on the tiny pair's 40 tokens
    (65641 nodes) filled the machine's 24 GB and was killed, `--budget 100000` with auto took 5.5 GB for
    its caches. A tree of more nodes than the target's context is refused, naming the flag (exit 2);
    from a profile, exit 1, naming the profile's file and entry."""
    result = cli("generate", "hi", "-p", tiny_profile, "-n", "4", *args, input="")
    assert result.exit_code == 2 and result.stdout == "", result.stderr
    assert result.stderr.startswith(f"rsd: error: {said}"), result.stderr
    profile = tiny_profile.read_text().replace("branching = [2, 2]", "branching = [40, 40, 40]")
    tiny_profile.write_text(profile)
    result = cli("generate", "hi", "-p", tiny_profile, "-n", "4", input="")
    assert result.exit_code == 1 and result.stderr.startswith(
        f"rsd: error: {tiny_profile}: decoding.branching: rsd-c b=(40,40,40) drafts trees"), result.stderr


@pytest.mark.parametrize(
    "args, shape, said",
    [
        (["-v", "rsd-c", "--depth", "3"], "rsd-c b=(2,2)",
         "rsd: --depth changes nothing for rsd-c: its tree is set by --branching and --budget"),
        (["-v", "sd", "--draft-len", "2", "--branching", "3", "--beam-width", "4"], "sd γ=2",
         "rsd: --branching, --beam-width change nothing for sd: its tree is set by --draft-len and --budget"),
        (["-v", "ar", "--draft-len", "3"], "ar", "rsd: --draft-len changes nothing for ar: it drafts no tree"),
        (["-v", "rsd-c", "--budget", "4", "--branching", "3"], "rsd-c b=(1,1,1)",
         "rsd: --branching changes nothing for rsd-c: a budget of 4 nodes picks its tree"),
        (["-v", "lookup", "--budget", "4", "--ngram", "2"], "lookup γ=3", None),
        (["-v", "rsd-s", "--depth", "2", "--beam-width", "2"], "rsd-s W=2 L=2", None),
        (["-v", "spectr", "--depth", "2", "--num-drafts", "2"], "spectr K=2 L=2", None),
    ],
)
def test_a_tree_flag_the_variant_does_not_read_is_said_in_one_line(cli, tiny_profile, args, shape, said):
    """`-v rsd-c --depth 3` drafted rsd-c's own tree without a word (--depth is rsd-s's and spectr's):
    a tree flag the variant does not read is named in one line on stderr, with what sets its tree, and
    the answer is the one without it (said, not refused: a script may pass one set of flags to every
    variant); flags it reads are said nothing of."""
    result = cli("generate", "hi", "-p", tiny_profile, "--json", "-t", "0", *args, input="")
    assert result.exit_code == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["shape"] == shape
    notes = [line for line in result.stderr.splitlines() if line.startswith("rsd: ")]
    assert notes == ([said] if said else [])
    if said:
        unread = said.removeprefix("rsd: ").split(" change")[0].split(", ")  # the flags named
        kept = [arg for i, arg in enumerate(args) if arg not in unread and (i == 0 or args[i - 1] not in unread)]
        plain = cli("generate", "hi", "-p", tiny_profile, "--json", "-t", "0", *kept, input="")
        assert json.loads(plain.stdout)["token_ids"] == record["token_ids"]
        assert not [line for line in plain.stderr.splitlines() if line.startswith("rsd: ")]


@pytest.mark.parametrize("args, said", [
    (["-n", "3", "--min-tokens", "5"], "rsd: min_tokens 5 (flag --min-tokens) is above max_tokens 3 (flag "
     "--max-tokens): every answer runs to 3 tokens (no end-of-sequence token or stop string ends it earlier)"),
    (["-n", "3", "--min-tokens", "3"], None),
    (["-n", "3", "--ignore-eos"], None),
])
def test_min_tokens_above_max_tokens_is_said_in_one_line(cli, tiny_profile, args, said):
    """`-n 3 --min-tokens 5` capped the answer at 3 tokens without a word: said on stderr, and the
    answer is the one --max-tokens gives with the end-of-sequence barred throughout (--ignore-eos's)."""
    result = cli("generate", "hi", "-p", tiny_profile, "--json", "-t", "0", *args, input="")
    assert result.exit_code == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if line.startswith("rsd: ")]
    assert notes == ([said] if said else [])
    barred = cli("generate", "hi", "-p", tiny_profile, "--json", "-t", "0", "-n", "3", "--ignore-eos", input="")
    tokens = json.loads(result.stdout)["token_ids"]
    assert tokens == json.loads(barred.stdout)["token_ids"] and len(tokens) == 3


@pytest.mark.parametrize("args, env, said", [
    (["--include-stop"], {}, "rsd: include_stop (flag --include-stop) changes nothing without a stop string (--stop)"),
    ([], {"RSD_SAMPLING_INCLUDE_STOP": "1"}, "rsd: include_stop (env RSD_SAMPLING_INCLUDE_STOP) changes nothing "
     "without a stop string (--stop)"),
    (["--include-stop", "--stop", "zz"], {}, None),
], ids=["flag", "env", "with-a-stop"])
def test_include_stop_without_a_stop_string_is_said_in_one_line(cli, tiny_profile, args, env, said):
    """--include-stop applies to the user's stop strings only: without one it changed nothing without a
    word. Said (the answer unchanged), in chat too; not with a stop string."""
    result = cli("generate", "hi", "-p", tiny_profile, "--json", "-t", "0", *args, input="", env=env)
    assert result.exit_code == 0, result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("rsd: ")] == ([said] if said else [])
    plain = cli("generate", "hi", "-p", tiny_profile, "--json", "-t", "0", input="")
    assert json.loads(result.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]
    chat = CliRunner().invoke(app, ["chat", "-p", str(tiny_profile), *args], input="", env=env)
    assert chat.exit_code == 0 and [line for line in chat.stderr.splitlines() if line.startswith("rsd: ")] == \
        ([said] if said else [])


def test_chat_s_set_of_include_stop_without_a_stop_string_says_so(tiny_profile):
    script = "/set include_stop on\n/set stop zz\n/set stop []\n/set include_stop off\n"
    result = CliRunner().invoke(app, ["chat", "-p", str(tiny_profile)], input=script)
    assert result.exit_code == 0, result.stderr
    said = [line.strip() for line in result.stderr.splitlines()[1:] if line.strip()]  # (after the banner)
    idle = "include_stop (/set) changes nothing without a stop string (/set stop TEXT)"
    assert said == [f"include_stop = on — {idle}", 'stop = ["zz"]', f"stop = [] — {idle}", "include_stop = off"]


def test_chat_s_set_of_min_tokens_above_max_tokens_says_so(tiny_profile):
    script = "/set max_tokens 4\n/set min_tokens 6\n/set max_tokens 8\n"
    result = CliRunner().invoke(app, ["chat", "-p", str(tiny_profile)], input=script)
    assert result.exit_code == 0, result.stderr
    said = [line.strip() for line in result.stderr.splitlines()[1:] if line.strip()]  # (after the banner)
    assert said == ["max_tokens = 4", "min_tokens = 6 — min_tokens 6 (/set) is above max_tokens 4 (/set): every answer "
                    "runs to 4 tokens (no end-of-sequence token or stop string ends it earlier)", "max_tokens = 8"]


def test_a_chat_answer_the_context_ends_says_so(tiny_profile):
    """Chat leaves room for max_tokens up to half the context: an answer allowed more can meet the
    context's end, and says so after it; the next message is still sent (its oldest messages left out)."""
    script = "/set max_tokens 120\n/set min_tokens 120\n" + "a" * 200 + "\nb\n"
    result = CliRunner().invoke(app, ["chat", "-p", str(tiny_profile)], input=script)
    assert result.exit_code == 0, result.stderr
    assert result.stderr.count("(the answer stopped at the end of the model's context of 256 tokens (") == 1
    assert "of the answer), before max_tokens 120)" in result.stderr
    assert "(the conversation outgrew the model's context of 256 tokens" in result.stderr  # (the next one's)
    assert "are left out, none of the earlier ones kept; /save keeps all)" in result.stderr  # ("the latest 0 of 2")


def test_chat_s_set_of_a_tree_setting_the_variant_does_not_read_says_so(tiny_profile):
    script = "/set variant rsd-c\n/set depth 3\n/set branching 3\n/set variant rsd-s\n/set depth 3\n"
    result = CliRunner().invoke(app, ["chat", "-p", str(tiny_profile)], input=script)
    assert result.exit_code == 0, result.stderr
    said = [line.strip() for line in result.stderr.splitlines()[1:] if line.strip()]  # (after the banner)
    assert said == ["variant = rsd-c · rsd-c b=(2,2)",
                    "depth = 3 · rsd-c b=(2,2) (depth changes nothing for rsd-c: its tree is set by branching and budget)",
                    "branching = 3 · rsd-c b=(3)", "variant = rsd-s · rsd-s W=3 L=3", "depth = 3 · rsd-s W=3 L=3"]


@pytest.mark.parametrize(
    "args, code, fragment",
    [
        (["--branching", "2,0", "-v", "rsd-c"], 2, "decoding.branching must list factors of at least 1"),
        (["--branching", "2,x", "-v", "rsd-c"], 2, "--branching takes integers"),
        (["--branching", "2,,3", "-v", "rsd-c"], 2, "(got '2,,3': an empty item)"),  # (read as 2,3 before)
        (["--branching", "3,2,", "-v", "rsd-c"], 2, "(got '3,2,': an empty item)"),
        (["--beam-width", "500", "-v", "rsd-s"], 2,  # known once the model is: the flag's too
         "flag --beam-width: beam width 500 is larger than the vocabulary"),
        (["--branching", "50", "-v", "rsd-c"], 2, "flag --branching: branching factor 50 is larger than the vocabulary"),
        (["--budget", "0"], 2, "budget must be at least 1"),
        (["--depth", "0", "-v", "rsd-s"], 2, "decoding.depth must be at least 1"),
        (["-v", "turbo"], 2, "decoding.variant must be one of"),
        (["-t", "-1"], 2, "sampling.temperature must be a finite number, at least 0"),
        (["-t", "inf"], 2, "sampling.temperature must be a finite number, at least 0"),  # (an IndexError before)
        (["-t", "warm"], 2, "--temperature takes a number (got 'warm')"),  # Typer's own check, the same code
        (["--seed", str(2**64)], 2, "sampling.seed must be -1 (a fresh seed each time) or from 0 to "
         f"{2**63 - 1} (got {2**64})"),  # (torch's "ValueError: Overflow when unpacking long long" before)
        (["--seed", "-2"], 2, "sampling.seed must be -1"),  # (a fresh seed, as -1, without a word before)
    ],
)
def test_bad_parameters_are_one_line_errors(cli, tiny_profile, args, code, fragment):
    result = cli("generate", "hi", "-p", tiny_profile, *args, input="")
    assert result.exit_code == code, (result.stdout, result.stderr)
    assert fragment in result.stderr and "Traceback" not in result.stderr and result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("rsd: error: "), result.stderr


def test_an_out_of_range_value_in_the_environment_is_not_a_usage_error(cli, tiny_profile):
    result = cli("generate", "hi", "-p", tiny_profile, input="", env={"RSD_SAMPLING_TEMPERATURE": "-1"})
    assert_clean_error(result, 1, "environment variable RSD_SAMPLING_TEMPERATURE must be a finite number, at least 0")


@pytest.mark.parametrize("name, value, said", [
    ("RSD_DECODING_BRANCHING", "2,,3", "RSD_DECODING_BRANCHING must be integers, got '2,,3': an empty item"),
    ("RSD_SAMPLING_STOP_TOKENS", ",7", "RSD_SAMPLING_STOP_TOKENS must be integers, got ',7': an empty item"),
    ("RSD_SAMPLING_LOGIT_BIAS", "5", "RSD_SAMPLING_LOGIT_BIAS must be a JSON object, got '5'"),  # ("a table, got 5")
])
def test_an_empty_item_or_a_json_value_of_another_kind_in_the_environment_is_refused(cli, tiny_profile, name,
                                                                                      value, said):
    """A list from the environment with an empty item (2,,3) was read without it, and a logit bias that is
    JSON but not an object was called "not a table": both now name what is wrong with the text given."""
    result = cli("generate", "hi", "-p", tiny_profile, "-v", "rsd-c", input="", env={name: value})
    assert_clean_error(result, 1, f"environment variable {said}")


def test_a_list_in_the_environment_takes_commas_spaces_or_both(cli, tiny_profile):
    for value in ("3,2", "3 2", " 3, 2 "):
        result = cli("generate", "hi", "-p", tiny_profile, "-v", "rsd-c", "-n", "2", input="",
                     env={"RSD_DECODING_BRANCHING": value})
        assert result.exit_code == 0 and "rsd-c b=(3,2)" in result.stderr, (value, result.stderr)


def test_missing_or_broken_profiles(cli, tmp_path):
    assert_clean_error(cli("generate", "hi", "-p", "nosuch", input=""), 1, "no profile named 'nosuch'")
    broken = tmp_path / "broken.toml"
    broken.write_text("[sampling\n")
    assert_clean_error(cli("generate", "hi", "-p", broken, input=""), 1, "not valid TOML")


def test_missing_model_files(cli, tmp_path):
    profile = tmp_path / "p.toml"
    profile.write_text(f'[target]\nsource = "{tmp_path / "no-model"}"\n')
    assert_clean_error(cli("generate", "hi", "-p", profile, input=""), 1, "model not found")
    (tmp_path / "empty").mkdir()
    profile.write_text(f'[target]\nsource = "{tmp_path / "empty"}"\n')
    assert_clean_error(cli("generate", "hi", "-p", profile, input=""), 1, "not a model directory")


def test_mismatched_tokenizers_are_refused(cli, tiny_pair_dir, tmp_path):
    from transformers import AutoTokenizer

    other = tmp_path / "other-draft"
    import shutil

    shutil.copytree(tiny_pair_dir / "draft", other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["zzz"])
    tok.save_pretrained(other)
    profile = tmp_path / "p.toml"
    profile.write_text(f'[target]\nsource = "{tiny_pair_dir / "target"}"\n'
                       f'[draft]\nkind = "model"\nsource = "{other}"\n')
    assert_clean_error(cli("generate", "hi", "-p", profile, input=""), 1, "different tokenizers")


def test_prompt_longer_than_the_context(cli, tiny_profile):
    result = cli("generate", "a" * 400, "-p", tiny_profile, "--raw", input="")
    assert_clean_error(result, 1, "context holds 256")


def test_an_answer_the_context_ends_says_so_in_one_line(cli, tiny_profile):
    """An answer cut short by the model's context (256 tokens here) before max_tokens says so on
    stderr — plain text, --json, and completions decoded together — where it used to end short without
    a word; an answer that max_tokens ends does not."""
    prompt = ["a" * 240, "-p", tiny_profile, "--raw", "--ignore-eos"]
    record = json.loads(cli("generate", *prompt, "-n", "40", "--json", input="").stdout)
    answer = 256 - record["prompt_tokens"]
    assert record["finish_reason"] == "context" and len(record["token_ids"]) == answer < 40
    line = (f"rsd: the answer stopped at the end of the model's context of 256 tokens ({record['prompt_tokens']} "
            f"of the prompt, {answer} of the answer), before max_tokens 40\n")
    for args in (["-n", "40"], ["-n", "40", "--json"], ["-n", "40", "--samples", "2", "-v", "ar", "-q"]):
        result = cli("generate", *prompt, *args, input="")
        assert result.exit_code == 0, result.stderr
        assert result.stderr.count(line) == (2 if "--samples" in args else 1), (args, result.stderr)
    short = cli("generate", *prompt, "-n", str(answer), input="")
    assert short.exit_code == 0 and "context" not in short.stderr


def test_empty_prompt_and_bad_stdin(cli, tiny_profile):
    assert_clean_error(cli("generate", "   ", "-p", tiny_profile, input=""), 2, "the prompt is empty")
    assert_clean_error(cli("tokenize", "   ", "-p", tiny_profile, input=""), 2, "the text is empty")
    assert_clean_error(cli("generate", "-", "-p", tiny_profile, input=b"\xff\xfe bad"), 1, "not valid UTF-8")


def test_read_prompt_joins_stdin_before_the_argument():
    class Stdin(io.TextIOWrapper):
        def isatty(self):
            return False

    def stdin(data: bytes):
        return Stdin(io.BytesIO(data), encoding="utf-8")

    class Tty:
        def isatty(self):
            return True

    assert read_prompt("summarise this", stdin(b"some text\n")) == "some text\nsummarise this"
    assert read_prompt("-", stdin(b"only stdin")) == "only stdin"
    assert read_prompt("just the argument", Tty()) == "just the argument"
    assert read_prompt("arg", stdin(b"")) == "arg"
    with pytest.raises(UsageError):
        read_prompt(None, Tty())
    with pytest.raises(RsdError, match="not valid UTF-8"):
        read_prompt("-", stdin(b"\xc3\x28"))


def test_profiles_commands(cli, tiny_profile):
    listed = cli("profiles", "list")
    assert listed.exit_code == 0 and listed.stdout.startswith("default\tbuilt-in\t")
    shown = cli("profiles", "show", str(tiny_profile))
    assert shown.exit_code == 0
    assert 'variant = "rsd-c"  # ' + str(tiny_profile) in shown.stdout
    assert "temperature = 1.0  # default" in shown.stdout
    as_json = json.loads(cli("profiles", "show", "default", "--json").stdout)
    assert as_json["values"]["target"]["source"]["value"] == "embedded"
    path = cli("profiles", "path")
    assert path.exit_code == 0 and path.stdout.strip().endswith("profiles")


def test_profiles_new_writes_every_setting_of_another_to_edit(cli, tiny_pair_dir, tmp_path):
    """`rsd profiles new NAME --from P`: a user profile holding P's values (its relative paths made
    absolute, the environment's settings left out), each after what it does; one that exists is
    replaced only with --force; the file's path on stdout, as scripts want it."""
    import shutil

    folder = tmp_path / "mine"
    shutil.copytree(tiny_pair_dir, folder / "models")
    base = folder / "base.toml"
    base.write_text('description = "relative paths"\n[target]\nsource = "models/target"\n'
                    '[draft]\nkind = "model"\nsource = "models/draft"\n[decoding]\nvariant = "sd"\n'
                    '[sampling]\nstop = ["\\n\\n", "é"]\nlogit_bias = { 5 = -inf }\nmax_tokens = 6\n')
    env = {"RSD_CONFIG_DIR": str(tmp_path / "cfg"), "RSD_SAMPLING_TEMPERATURE": "0"}
    made = cli("profiles", "new", "edited", "--from", base, env=env)
    assert made.exit_code == 0, made.stderr
    written = tmp_path / "cfg" / "profiles" / "edited.toml"
    assert made.stdout == f"{written}\n" and made.stderr == ""
    text = written.read_text()
    assert "# 0 is greedy\ntemperature = 1.0\n" in text  # the default, not the environment's 0
    assert f'source = "{folder / "models" / "target"}"' in text
    from rsd_cli.profiles import PATH_KEYS, PATH_WORDS, load_profile

    source, new = load_profile(str(base), environ={}), load_profile(str(written), environ={})
    assert new.description == "relative paths"
    for table, values in source.values.items():
        for key, value in values.items():
            moved = (table, key) in PATH_KEYS and value not in PATH_WORDS
            expected = source.resolve_path(value) if moved else value
            assert new[table][key] == expected, (table, key)
    answer = cli("generate", "hi", "-p", "edited", "-t", "0", input="", env=env)
    plain = cli("generate", "hi", "-p", base, "-t", "0", input="", env=env)
    assert answer.exit_code == 0 and answer.stdout == plain.stdout  # the same pair, read from elsewhere
    again = cli("profiles", "new", "edited", env=env)
    assert again.exit_code == 1 and again.stderr == f"rsd: error: profile 'edited' exists: {written} (--force replaces it)\n"
    assert written.read_text() == text
    replaced = cli("profiles", "new", "edited", "--force", env=env)
    assert replaced.exit_code == 0 and 'source = "embedded"' in written.read_text()
    shadow = cli("profiles", "new", "default", env=env)
    assert shadow.exit_code == 0 and "now shadows the built-in one" in shadow.stderr
    for name, message in (("a/b", "a profile's name is letters, digits, '.', '_' and '-' (got 'a/b')"),
                          ("x.toml", "give the profile's name without .toml (got 'x.toml')")):
        bad = cli("profiles", "new", name, env=env)
        assert bad.exit_code == 2 and bad.stderr == f"rsd: error: {message}\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "--no-such-flag"], "No such option: --no-such-flag (see 'rsd generate -h')"),
        (["generate", "hi", "--budgett", "3"], "No such option: --budgett"),  # (and click's guesses: --budget)
        (["frobnicate"], "No such command 'frobnicate' (see 'rsd -h')"),
        (["profiles", "frob"], "No such command 'frob' (see 'rsd profiles -h')"),
        (["inspect-tree"], "Missing argument 'PROMPT' (see 'rsd inspect-tree -h')"),  # (as its help names it)
        (["tokenize"], "Missing argument 'TEXT' (see 'rsd tokenize -h')"),
        # a value of the wrong type or out of range, with what was given (Typer 0.2x's pydantic said "Invalid value
        # for '--max-tokens' / '-n': Input should be a valid integer, unable to parse string as an integer")
        (["inspect-tree", "hi", "--step", "0"], "--step must be at least 1 (got 0) (see 'rsd inspect-tree -h')"),
        (["generate", "hi", "--samples", "0"], "--samples must be at least 1 (got 0)"),
        (["generate", "hi", "-n", "abc"], "--max-tokens takes an integer (got 'abc') (see 'rsd generate -h')"),
        (["generate", "hi", "-t", "warm"], "--temperature takes a number (got 'warm')"),
        (["bench", "--limit", "many"], "--limit takes an integer (got 'many')"),
        (["bench", "--seed", "-3"], "--seed must be at least 0 (got -3)"),
        (["chat", "--seed", "x"], "--seed takes an integer (got 'x')"),
        (["distill", "--layers", "x"], "--layers takes an integer (got 'x')"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(cli, args, message):
    """Click's own checks (an unknown flag or command, a value of the wrong type or out of range, a
    missing argument) read as rsd's own: one line, no framed box, no usage block."""
    result = cli(*args)
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("rsd: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr and "Input should" not in result.stderr


def test_version_is_the_packages(cli):
    from pathlib import Path

    from rsd_cli.profiles import tomllib  # (tomli before Python 3.11)

    version = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["version"]
    result = cli("--version")
    assert result.exit_code == 0 and result.stdout == f"rsd {version}\n" and result.stderr == ""


def test_asking_for_nothing_still_shows_the_help(cli):
    for args in ([], ["profiles"]):
        result = cli(*args)
        assert "Usage: rsd" in result.stdout + result.stderr and "rsd: error" not in result.stderr


def test_help_everywhere(cli):
    for args in (["-h"], ["generate", "-h"], ["profiles", "-h"], ["profiles", "show", "--help"], ["distill", "-h"]):
        result = cli(*args)
        assert result.exit_code == 0 and "Usage" in result.stdout, args
    assert "Sampling" in cli("generate", "--help").stdout and "Draft" in cli("generate", "--help").stdout


@pytest.mark.parametrize("command", ["generate", "chat", "inspect-tree", "tokenize", "bench", "distill"])
def test_help_at_80_columns_cuts_no_option_name_nor_default(cli, command):
    """An 80-column terminal (the classic default) showed `--repetition-pena…` and `--frequency-penal…`
    (--include-stop's `--no-` column in the same panel left them no room) and bench's default variants cut."""
    result = cli(command, "--help", env={"COLUMNS": "80"})
    assert result.exit_code == 0 and max(map(len, result.stdout.splitlines())) == 80
    assert "…" not in result.stdout, [line for line in result.stdout.splitlines() if "…" in line]


@pytest.mark.parametrize("command", [[], ["generate"], ["chat"], ["inspect-tree"], ["tokenize"], ["bench"],
                                     ["distill"], ["profiles", "new"]])
def test_help_shows_a_value_beside_options_that_take_one_and_nothing_beside_flags(cli, command):
    """Typer 0.29 showed `--raw <bool>` (as if a flag took a value), `--stop <list[str]>` and bench's
    `--seed <int range> [0<=x<=9223372036854775807]`; and rich markup ate a help's `[default: …]`,
    leaving bench's `--width` help ending "drafts (spectr) .". Now a flag shows nothing, an option
    TEXT, INTEGER, FLOAT or PATH, an argument its name (PROMPT, or [PROMPT] where it may be left out),
    and every help sentence whole."""
    result = cli(*command, "--help", env={"COLUMNS": "250"})
    assert result.exit_code == 0
    assert not re.search(r"<(bool|str|int|float|path|list)", result.stdout), result.stdout
    assert not re.search(r" \.(\s|$)", result.stdout) and "9223372036854775807" not in result.stdout
    rows = {m.group(1): line for line in result.stdout.splitlines() if (m := re.match(r"│[\s*]*(--[\w-]+)", line))}
    assert re.search(r"--help\s+-h\s+Show this message", rows["--help"]), rows["--help"]
    if command == ["generate"]:
        assert re.search(r"--raw\s+Send the prompt", rows["--raw"])
        assert "Usage: rsd generate [OPTIONS] [PROMPT]" in result.stdout
        assert re.search(r"--seed\s+INTEGER\s+The same tokens.*; -1 draws a fresh one each run\.", rows["--seed"])
        assert re.search(r"--stop\s+TEXT\s+End the answer", rows["--stop"])
        assert re.search(r"--temperature\s+-t\s+FLOAT\s+0 is greedy", rows["--temperature"])
        assert re.search(r"--prompts\s+PATH\s+Answer every prompt", rows["--prompts"])
        assert re.search(r"--samples\s+INTEGER \[x>=1\]\s+Independent", rows["--samples"])
    if command == ["inspect-tree"]:  # (a required argument: Typer 0.29 wrote {PROMPT}, as if a set to pick from)
        assert re.search(r"Usage: rsd inspect-tree \[OPTIONS\] PROMPT *$", result.stdout, re.M), result.stdout
    if command == ["bench"]:
        assert "drafts (spectr); by default the profile's beam_width." in rows["--width"]
        assert "e.g. on,off; by default the profile's." in rows["--compile"]


def test_chat_s_piped_script_is_not_prompted_for(tiny_profile):
    """Lines piped into `rsd chat` are not asked for: its stderr read `you› you› … you› ` (and a blank
    line at the end) around what the commands said. (On a terminal the prompts stay: test_terminal.)"""
    script = 'hello\n"""\nfirst\nsecond\n"""\n/stats\n'
    result = CliRunner().invoke(app, ["chat", "-p", str(tiny_profile), "-n", "3"], input=script)
    assert result.exit_code == 0, result.stderr
    assert "you›" not in result.stderr and "... " not in result.stderr and not result.stderr.endswith("\n\n")
    lines = result.stderr.splitlines()
    assert lines[0].startswith("rsd chat · ") and len(lines) == 2 and "block efficiency" in lines[1], lines
