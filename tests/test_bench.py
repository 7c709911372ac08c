import json

import pytest
from typer.testing import CliRunner

from rsd_cli.cli import app

FIELDS = {"variant", "budget", "shape", "temperature", "block_efficiency", "mbsu", "tokens_per_second",
          "speedup_vs_ar", "speedup_vs_ar_range", "draft_seconds", "verify_seconds", "overhead_seconds",
          "acceptance_per_depth", "first_token_seconds", "tokens_per_second_after_first"}


def test_bench_runs_end_to_end_with_every_field_and_a_plot(tiny_profile, tmp_path):
    plot = tmp_path / "bench.svg"
    result = CliRunner().invoke(app, ["bench", "-p", str(tiny_profile), "--budgets", "3,6", "--limit", "1",
                                      "-n", "6", "--json", "--plot", str(plot), "--temperatures", "1,0"])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    rows = report["results"]
    assert report["memory"]["peak_rss_mb"] > report["memory"]["weights_mb"] > 0
    assert 0 < report["memory"]["runtime_rss_mb"] <= report["memory"]["peak_rss_mb"]  # (equal: a test process
    # whose peak came in earlier tests)
    assert report["memory"]["model_peak_over_weights"] < report["memory"]["peak_over_weights"]
    assert report["small_batch_layers"] == 30  # (3 + 1) layers x (q, k, v, o, gate, up, down) + 2 heads
    assert "packed/packed" in report["cpu_kernels"]  # which kernels computed these results
    settings = report["settings"]  # (what the run was: a saved report says how to run it again)
    assert (settings["budgets"], settings["temperatures"], settings["prompt_count"], settings["max_tokens"]) == \
        ([3, 6], [1.0, 0.0], 1, 6)
    assert settings["prompts"] == "built-in held-out set" and settings["profile"] == "tiny"
    variants = {r["variant"] for r in rows}
    assert variants == {"ar", "sd", "mss", "spectr", "rsd-c", "rsd-s", "lookup", "auto", "hf-assisted", "hf-static"}
    for row in rows:
        assert FIELDS <= set(row), row
        if not row["variant"].startswith("hf-"):  # (a run's mean time to its first token, below its wall time)
            assert 0 < row["first_token_seconds"] < row["wall_seconds"] and row["tokens_per_second_after_first"] > 0
    auto_rows = [r for r in rows if r["variant"] == "auto"]  # one per temperature: it picks its own trees
    assert len(auto_rows) == 2 and all(r["budget"] is None and r["shapes_used"] for r in auto_rows)
    tree_rows = [r for r in rows if r["variant"] not in ("ar", "auto", "hf-assisted", "hf-static")]
    assert len(tree_rows) == 6 * 2 * 2  # variants x budgets x temperatures
    assert all(r["target_tokens_per_step"] <= r["budget"] for r in tree_rows)
    assert all(r["speedup_vs_ar"] > 0 for r in rows)
    ar = [r for r in rows if r["variant"] == "ar"]
    assert all(r["speedup_vs_ar"] == 1.0 and r["block_efficiency"] == 1.0 for r in ar)
    svg = plot.read_text()
    assert svg.startswith("<svg") and "block efficiency" in svg and "polyline" in svg


def test_bench_csv_and_table(tiny_profile):
    runner = CliRunner()
    csv_out = runner.invoke(app, ["bench", "-p", str(tiny_profile), "--variants", "ar,rsd-s", "--depths", "2",
                                  "--limit", "1", "-n", "4", "--csv", "--no-assisted", "--no-hf-static"])
    assert csv_out.exit_code == 0, csv_out.stderr
    lines = csv_out.stdout.strip().splitlines()
    assert lines[0].startswith("variant,compile,runtime,budget,depth,shape") and len(lines) == 3
    table = runner.invoke(app, ["bench", "-p", str(tiny_profile), "--variants", "ar,sd", "--limit", "1", "-n", "4",
                                "--no-assisted"])
    assert table.exit_code == 0 and table.stdout.startswith("rsd bench · 1 prompt · up to 4 tokens"), table.stdout
    repeated = runner.invoke(app, ["bench", "-p", str(tiny_profile), "--variants", "ar", "--limit", "2", "-n", "3",
                                   "--repeats", "2", "--no-assisted", "--no-hf-static"])
    assert repeated.stdout.startswith("rsd bench · 2 prompts × 2 · up to 3 tokens"), repeated.stdout


def test_width_sets_the_tree_width_of_the_depth_shapes(tiny_profile):
    result = CliRunner().invoke(app, ["bench", "-p", str(tiny_profile), "--variants", "ar,rsd-c,rsd-s", "--depths", "1,2",
                                      "--width", "2", "--limit", "1", "-n", "4", "--no-assisted", "--no-hf-static", "--json"])
    assert result.exit_code == 0, result.stderr
    shapes = [row["shape"] for row in json.loads(result.stdout)["results"]]
    assert shapes == ["ar", "rsd-c b=(2)", "rsd-s W=2 L=1", "rsd-c b=(2,1)", "rsd-s W=2 L=2"]
    result = CliRunner().invoke(app, ["bench", "-p", str(tiny_profile), "--depths", "1", "--width", "0"])
    assert result.exit_code == 2 and "--width must be at least 1 (got 0)" in result.stderr


def test_width_is_the_width_at_depths_alone(tiny_profile):
    """--width set the profile's beam width, so it changed rsd-s's own tree (W=40 L=4 beside rsd-c's
    b=(2,2)) and, where it was bad, named a flag bench has not (`flag --beam-width`); it is the width
    of the --depths trees, as its help says, and without --depths a notice says it changes nothing."""
    result = CliRunner().invoke(app, ["bench", "-p", str(tiny_profile), "--variants", "ar,rsd-c,rsd-s", "--width", "40",
                                      "--limit", "1", "-n", "3", "--no-assisted", "--no-hf-static", "--json"])
    assert result.exit_code == 0, result.stderr
    assert [row["shape"] for row in json.loads(result.stdout)["results"]] == ["ar", "rsd-c b=(2,2)", "rsd-s W=3 L=4"]
    assert "rsd: --width changes nothing without --depths" in result.stderr


@pytest.mark.parametrize("args, code, said", [
    (["--variants", "ar,mss,rsd-c", "--depths", "2", "--width", "41"], 2,
     "--width: branching factor 41 is larger than the vocabulary (40 tokens)"),
    (["--variants", "rsd-s", "--depths", "1,2", "--width", "50"], 2,
     "--width: beam width 50 is larger than the vocabulary (40 tokens)"),
    (["--variants", "sd", "--depths", "2,300"], 2,
     "--depths: sd γ=300 drafts trees of up to 301 nodes, which is more than the target's context (256 tokens)"),
    (["--variants", "rsd-s", "--depths", "100", "--width", "3"], 2,
     "--depths: rsd-s W=3 L=100 drafts trees of up to 301 nodes, which is more than the target's context"),
    (["--variants", "rsd-c"], 1, "{profile}: decoding.branching: rsd-c b=(20,20) drafts trees of up to 421 nodes"),
    (["--variants", "mss,sd"], 1, "{profile}: decoding.branching: mss b=(20,20) drafts trees of up to 421 nodes"),
])
def test_a_tree_the_models_cannot_take_is_refused_before_anything_is_measured(tiny_profile, monkeypatch, args,
                                                                               code, said):
    """bench measured the trees generate refuses: `--depths 2 --width 41` as rsd-c b=(41,1) on a vocabulary
    of 40 tokens, `--depths 300` and a profile's b=(20,20) (421 nodes) past the tiny target's context of 256
    (generate: `larger_than_the_context`). Now each is refused as generate refuses it, naming the bench flag
    (exit 2) or the profile's entry (exit 1), before anything is measured; mss and spectr, drafting with
    replacement, take any width."""
    import rsd_cli.bench as bench

    ran = []
    monkeypatch.setattr(bench, "run_bench", lambda *args, **kwargs: ran.append(1) or [])
    tiny_profile.write_text(tiny_profile.read_text().replace("branching = [2, 2]", "branching = [20, 20]"))
    result = CliRunner().invoke(app, ["bench", "-p", str(tiny_profile), "--limit", "1", *args])
    assert result.exit_code == code and not ran, result.stderr
    assert result.stderr.startswith("rsd: error: " + said.format(profile=tiny_profile)), result.stderr
    assert result.stderr.count("\n") == 1


def test_mss_and_spectr_are_measured_wider_than_the_vocabulary(tiny_profile):
    result = CliRunner().invoke(app, ["bench", "-p", str(tiny_profile), "--variants", "ar,mss,spectr", "--depths", "1",
                                      "--width", "41", "--limit", "1", "-n", "3", "--no-assisted", "--no-hf-static",
                                      "--json"])
    assert result.exit_code == 0, result.stderr
    assert [row["shape"] for row in json.loads(result.stdout)["results"]] == ["ar", "mss b=(41)", "spectr K=41 L=1"]


def test_bench_rejects_bad_lists(tiny_profile):
    result = CliRunner().invoke(app, ["bench", "-p", str(tiny_profile), "--variants", "ar,warp"])
    assert result.exit_code == 2 and "unknown variant 'warp'" in result.stderr
    result = CliRunner().invoke(app, ["bench", "-p", str(tiny_profile), "--seed", str(2**64)])  # (torch's overflow)
    assert result.exit_code == 2 and f"--seed must be at most {2**63 - 1} (got {2**64})" in result.stderr and "Traceback" not in result.stderr
    for flag, value, message in (("--budgets", "8,0", "--budgets takes numbers of at least 1 (got '8,0')"),
                                 ("--depths", "0", "--depths takes numbers of at least 1 (got '0')"),
                                 ("--temperatures", "0,nan", "--temperatures takes finite numbers of at least 0"),
                                 ("--temperatures", "inf", "--temperatures takes finite numbers of at least 0"),
                                 ("--temperatures", "-1", "--temperatures takes finite numbers of at least 0"),
                                 ("--temperatures", "", "--temperatures lists nothing"),  # (an empty table before)
                                 ("--variants", " , ", "--variants lists nothing"),
                                 ("--budgets", "", "--budgets lists nothing"),
                                 ("--temperatures", "0,1,", "--temperatures takes a comma-separated list "
                                  "(got '0,1,': an empty item)"),  # (read as 0,1 before)
                                 ("--variants", "ar,,sd", "--variants takes a comma-separated list "
                                  "(got 'ar,,sd': an empty item)")):
        result = CliRunner().invoke(app, ["bench", "-p", str(tiny_profile), flag, value])
        assert result.exit_code == 2 and result.stderr == f"rsd: error: {message}" + (
            "" if "(got" in message else f" (got {value!r})") + "\n", (flag, value, result.stderr)


def test_a_budget_of_more_nodes_than_the_context_is_refused(tiny_profile, monkeypatch):
    """`--budgets 100000` gave `auto` caches of 100000 more slots (5.5 GB on the embedded pair) before
    anything was measured; a budget past the target's context (the tiny pair's 256) is refused first."""
    import rsd_cli.bench as bench

    ran = []
    monkeypatch.setattr(bench, "run_bench", lambda *args, **kwargs: ran.append(1) or [])
    result = CliRunner().invoke(app, ["bench", "-p", str(tiny_profile), "--budgets", "4,1000,300"])
    assert result.exit_code == 2 and not ran
    assert result.stderr == ("rsd: error: --budgets: a budget of 1000 nodes is more than the target's context "
                             "(256 tokens): a step verifies its whole tree in one forward\n"), result.stderr


def test_a_plot_that_cannot_be_written_is_refused_before_anything_is_measured(tiny_profile, tmp_path, monkeypatch):
    """--plot was written after the run, before the results were printed: a wrong suffix, a PNG without
    matplotlib or a missing folder lost a whole run's numbers."""
    import rsd_cli.bench as bench

    ran = []
    monkeypatch.setattr(bench, "run_bench", lambda *args, **kwargs: ran.append(1) or [])
    for plot, code, message in ((tmp_path / "x.txt", 2, "--plot must end in .svg or .png (got x.txt)"),
                                (tmp_path / "no" / "x.svg", 1, f"cannot write the plot to {tmp_path / 'no' / 'x.svg'}: "
                                                               f"folder {tmp_path / 'no'} does not exist")):
        result = CliRunner().invoke(app, ["bench", "-p", str(tiny_profile), "--plot", str(plot)])
        assert result.exit_code == code and result.stderr == f"rsd: error: {message}\n", result.stderr
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *args: None if name == "matplotlib" else object())
    result = CliRunner().invoke(app, ["bench", "-p", str(tiny_profile), "--plot", str(tmp_path / "x.png")])
    assert result.exit_code == 1 and "a PNG plot needs matplotlib" in result.stderr
    assert ran == []  # refused before the models loaded, nothing measured


def test_rows_take_turns_prompt_by_prompt_in_alternating_order(tiny_profile, monkeypatch):
    """Every variant runs a prompt before the next prompt starts, and every other prompt in the
    opposite order: no row always runs first, next to the peers, or last, furthest from `ar`."""
    import rsd_cli.bench as bench

    ran, real = [], bench.complete

    def recorded(decoder, *args, **kwargs):
        ran.append(decoder.shape.variant)
        return real(decoder, *args, **kwargs)

    monkeypatch.setattr(bench, "complete", recorded)
    result = CliRunner().invoke(app, ["bench", "-p", str(tiny_profile), "--depths", "1", "--variants", "ar,sd,lookup",
                                      "--limit", "3", "--repeats", "2", "-n", "4", "--json", "--no-assisted",
                                      "--no-hf-static"])
    assert result.exit_code == 0, result.stderr
    forward, backward = ["ar", "sd", "lookup"], ["lookup", "sd", "ar"]
    assert ran == forward + (forward + backward) * 3  # the warm-up, then 3 prompts twice
    assert [r["variant"] for r in json.loads(result.stdout)["results"]] == forward


@pytest.mark.parametrize("output", ["--json", "table"])
def test_an_interrupted_bench_reports_the_prompts_every_row_ran(tiny_profile, monkeypatch, output):
    """Ctrl-C (or SIGTERM) minutes into a bench lost every row measured. Now the rounds every row ran whole
    are reported — the same numbers as a run of those prompts alone — saying so, then rsd exits as
    interrupted (130); Ctrl-C in the warm-up, before any round, reports nothing."""
    import rsd_cli.bench as bench

    args = ["bench", "-p", str(tiny_profile), "--variants", "ar,sd", "-n", "4", "--ignore-eos", "--no-assisted",
            "--no-hf-static", *([output] if output == "--json" else [])]
    calls, real = [], bench.complete

    def stopped_at(call: int):
        def complete(*args, **kwargs):
            calls.append(1)
            if len(calls) == call:
                raise KeyboardInterrupt
            return real(*args, **kwargs)
        return complete

    # 2 warm-up runs, 2 rounds of 2 rows, then Ctrl-C in the third round's second row
    monkeypatch.setattr(bench, "complete", stopped_at(8))
    result = CliRunner().invoke(app, [*args, "--limit", "3"])
    assert result.exit_code == 130, result.stderr
    assert "rsd: interrupted after 2 of 3 rounds (a prompt each, every row in turn): the rows measure those" \
        in result.stderr and result.stderr.endswith("rsd: interrupted\n")
    monkeypatch.setattr(bench, "complete", real)
    whole = CliRunner().invoke(app, [*args, "--limit", "2"])
    assert whole.exit_code == 0, whole.stderr
    if output == "--json":
        report, alone = json.loads(result.stdout), json.loads(whole.stdout)
        assert report["settings"]["rounds_measured"] == 2 and report["settings"]["rounds_planned"] == 3
        assert alone["settings"]["rounds_measured"] == alone["settings"]["rounds_planned"] == 2
        numbers = ("variant", "new_tokens", "steps", "block_efficiency", "acceptance_rate")
        assert [{k: row[k] for k in numbers} for row in report["results"]] == [
            {k: row[k] for k in numbers} for row in alone["results"]]
        assert report["results"][0]["new_tokens"] == 8  # (2 prompts × 4 tokens)
    else:
        assert result.stdout.startswith("rsd bench · 3 prompts · up to 4 tokens · interrupted: 2 of 3 rounds")
        assert "sd" in result.stdout and "Traceback" not in result.stderr

    calls.clear()
    monkeypatch.setattr(bench, "complete", stopped_at(1))  # (in the warm-up: nothing measured)
    early = CliRunner().invoke(app, [*args, "--limit", "3"])
    assert early.exit_code == 130 and early.stdout == "" and "rounds" not in early.stderr, early.stderr


def test_each_row_gives_the_range_of_its_ratio_to_ar_prompt_by_prompt(tiny_profile, monkeypatch):
    """Beside its tokens/s over `ar`'s, a row gives the least and most of that ratio on one prompt
    (one run: a prompt in a repeat), each prompt's against `ar` on the same prompt: here `sd` takes
    two seconds a token on both prompts, `ar` two on the first and one on the second."""
    import rsd_cli.bench as bench
    from rsd_cli.engine import Stats

    runs, real = [], bench.complete

    def timed(decoder, ids, *args, **kwargs):
        text, stats, events = real(decoder, ids, *args, **kwargs)
        variant = decoder.shape.variant
        runs.append(variant)
        first_prompt = runs.count(variant) % 3 == 2  # (each invocation: the warm-up, then the two prompts)
        slow = variant == "sd" or first_prompt
        faked = Stats()
        faked.merge(stats)
        faked.wall_seconds = faked.new_tokens * (2.0 if slow else 1.0)
        return text, faked, events

    monkeypatch.setattr(bench, "complete", timed)
    result = CliRunner().invoke(app, ["bench", "-p", str(tiny_profile), "--depths", "1", "--variants", "ar,sd",
                                      "--limit", "2", "--repeats", "1", "-n", "4", "--json", "--no-assisted",
                                      "--no-hf-static"])
    assert result.exit_code == 0, result.stderr
    rows = {r["variant"]: r for r in json.loads(result.stdout)["results"]}
    assert rows["ar"]["speedup_vs_ar_range"] == [1.0, 1.0]
    assert rows["sd"]["speedup_vs_ar_range"] == [0.5, 1.0]
    assert rows["sd"]["speedup_vs_ar"] == pytest.approx(0.75)  # (tokens/s over all prompts: 1/2 over 2/3)
    table = CliRunner().invoke(app, ["bench", "-p", str(tiny_profile), "--depths", "1", "--variants", "ar,sd",
                                     "--limit", "2", "-n", "4", "--no-assisted", "--no-hf-static"],
                                env={"COLUMNS": "250"})  # (a table this wide wraps its cells in 80 columns)
    assert "per prompt" in table.stdout and "0.50-1.00" in table.stdout


@pytest.mark.parametrize("width", [80, 100, 140])
def test_the_results_table_fits_a_terminal_leaving_out_the_least_telling_columns(width):
    """On a terminal of 80-160 columns the 18 columns were squeezed to one or two characters each ("v…",
    "1.…"): the table now leaves columns out until it fits, names them under it, says a value every row
    shares in its title, and never cuts a cell; at its own width (a pipe's 200) nothing is said left out."""
    import io

    from rich.console import Console

    from rsd_cli.bench import COLUMNS, results_table

    def row(variant, shape, rate, compile="off"):
        values = dict.fromkeys(COLUMNS, 0.25)
        values.update(variant=variant, shape=shape, compile=compile, budget=None, depth=None, temperature=0.7,
                      tokens_per_second=rate, speedup_vs_ar_range=[0.5, 1.25], new_tokens=64)
        return values

    rows = [row("ar", "ar", 31.5), row("rsd-c", "rsd-c b=(2,2,1)", 35.25),
            row("hf-assisted", "transformers assisted generation", 30.0, compile=None)]
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(results_table(rows, width=width))
    text = out.getvalue()
    assert "…" not in text and max(map(len, text.splitlines())) <= width
    table_lines = [line for line in text.splitlines() if line.startswith(("┃", "│"))]
    assert all(word in text for word in ("variant", "shape", "BE", "tok/s", "× ar", "35.25", "rsd-c b=(2,2,1)"))
    assert text.startswith("rsd bench · T 0.70") and "budget" not in text  # (shared; empty in every row)
    assert "left out at this width: overhead s, verify s, draft s" in " ".join(text.split())
    assert len(table_lines[0].split("┃")) - 2 < len(COLUMNS)
    wide = io.StringIO()
    Console(file=wide, width=250, color_system=None).print(results_table(rows, width=250))
    assert "left out" not in wide.getvalue() and "overhead s" in wide.getvalue() and "…" not in wide.getvalue()


def test_assisted_row_runs_with_a_reduced_draft_head(tiny_pair_dir, tmp_path):
    profile = tmp_path / "reduced.toml"
    profile.write_text(f'[target]\nsource = "{tiny_pair_dir / "target"}"\n'
                       f'[draft]\nkind = "early-exit"\nlayers = 1\nvocab = 20\nadapter = ""\n')
    result = CliRunner().invoke(app, ["bench", "-p", str(profile), "--depths", "1", "--variants", "ar,sd",
                                      "--limit", "1", "-n", "5", "--json", "--assisted"])
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)["results"]
    assisted = [r for r in rows if r["variant"] == "hf-assisted"]
    assert assisted and assisted[0]["tokens_per_second"] > 0


def test_weights_are_counted_once_even_through_a_reduced_head_view(tiny_pair_dir, tmp_path):
    from rsd_cli.bench import memory_summary
    from rsd_cli.models import load_pair
    from rsd_cli.profiles import load_profile

    profile = tmp_path / "reduced.toml"
    profile.write_text(f'[target]\nsource = "{tiny_pair_dir / "target"}"\n'
                       f'[draft]\nkind = "early-exit"\nlayers = 1\nvocab = 20\nadapter = ""\n')
    pair = load_pair(load_profile(str(profile)))
    target_bytes = sum(p.numel() * p.element_size() for p in pair.target.parameters())
    assert memory_summary(pair)["weights_mb"] * 2**20 == target_bytes


def test_a_failing_peer_row_is_reported_and_the_others_kept(tiny_profile, monkeypatch):
    import rsd_cli.bench as bench

    def broken(*args, **kwargs):
        raise RuntimeError("assistant and target disagree\nsecond line")

    monkeypatch.setattr(bench, "_assisted", broken)
    for output in ("--json", "--csv"):
        result = CliRunner().invoke(app, ["bench", "-p", str(tiny_profile), "--depths", "1", "--variants", "ar,sd",
                                          "--limit", "2", "-n", "4", output, "--assisted"])
        assert result.exit_code == 0, result.stderr
        assert "warning: hf-assisted failed and has no numbers: RuntimeError: assistant and target disagree" \
            in result.stderr
    rows = json.loads(CliRunner().invoke(app, ["bench", "-p", str(tiny_profile), "--depths", "1", "--variants",
                                               "ar,sd", "--limit", "1", "-n", "4", "--json"]).stdout)["results"]
    assert {r["variant"] for r in rows} == {"ar", "sd", "hf-assisted", "hf-static"}


def test_runtime_baseline_includes_the_model_code_but_no_weights(tiny_pair_dir):
    """The memory baseline imports the target architecture's modeling code (what loading imports
    anyway), so `model_peak_over_weights` counts model data, not Python modules."""
    import subprocess
    import sys

    code = ("import sys; from rsd_cli.bench import runtime_rss_mb; runtime_rss_mb({}); "
            "print('transformers.models.llama.modeling_llama' in sys.modules)")
    target = str(tiny_pair_dir / "target")
    with_code = subprocess.run([sys.executable, "-c", code.format(repr(target))], capture_output=True, text=True)
    without = subprocess.run([sys.executable, "-c", code.format("")], capture_output=True, text=True)
    assert with_code.stdout.strip() == "True", with_code.stderr
    assert without.stdout.strip() == "False", without.stderr


def test_prompt_files_take_one_prompt_a_line_or_jsonl_with_line_breaks(tiny_profile, tmp_path):
    import pytest

    from rsd_cli.errors import RsdError
    from rsd_cli.prompting import read_prompt_file

    plain = tmp_path / "prompts.txt"
    plain.write_text("first prompt\n\n  second prompt  \n", encoding="utf-8")
    assert read_prompt_file(plain) == ["first prompt", "second prompt"]
    lines = tmp_path / "prompts.jsonl"
    lines.write_text('"Fix the typo:\\ndef add(a, b):\\n    retrun a + b"\n\n{"prompt": "Sum up:\\nx\\ny", "id": 7}\n',
                     encoding="utf-8")
    assert read_prompt_file(lines) == ["Fix the typo:\ndef add(a, b):\n    retrun a + b", "Sum up:\nx\ny"]
    for bad, message in (('{"text": "x"}', "line 1: neither"), ('"a"\n{oops', "line 2: not JSON"), ("", "no prompts")):
        broken = tmp_path / "broken.jsonl"
        broken.write_text(bad, encoding="utf-8")
        with pytest.raises(RsdError, match=message):
            read_prompt_file(broken)
    result = CliRunner().invoke(app, ["bench", "-p", str(tiny_profile), "--prompts", str(lines), "--variants", "ar,lookup",
                                      "--depths", "2", "--limit", "2", "-n", "4", "--json", "--no-assisted",
                                      "--no-hf-static"])
    assert result.exit_code == 0, result.stderr
    assert {row["variant"] for row in json.loads(result.stdout)["results"]} == {"ar", "lookup"}
    result = CliRunner().invoke(app, ["bench", "-p", str(tiny_profile), "--prompts", str(broken)])
    assert result.exit_code == 1 and "no prompts" in result.stderr


def test_with_cuda_graphs_each_job_is_warmed_at_the_timed_length_on_the_longest_prompt(tiny_profile, monkeypatch):
    """CUDA graphs replay on buffers sized for a generation's prompt and answer: where a runtime
    captures them, bench's untimed warm-up runs every job at the timed length on the longest
    prompt (a short one left the first timed rows growing the buffers and capturing again);
    elsewhere 8 tokens of the first prompt do."""
    import rsd_cli.bench as bench
    from rsd_cli.compiled import CompiledModel
    from rsd_cli.engine import Runtimes, Stats
    from rsd_cli.models import load_pair
    from rsd_cli.profiles import load_profile
    from rsd_cli.prompting import encode_prompt

    profile = load_profile(str(tiny_profile))
    pair = load_pair(profile)
    prompts = ["hi", "a much longer prompt than the first one, by many tokens"]
    lengths = [len(encode_prompt(pair.tokenizer, p)) for p in prompts]
    for graphed, expected in ((True, (max(lengths), 12)), (False, (lengths[0], 8))):
        calls = []
        monkeypatch.setattr(bench, "complete", lambda decoder, ids, n, seed, **kwargs:
                            calls.append((len(ids), n)) or (None, Stats(), None))
        runtimes = Runtimes(*(CompiledModel(model, False, static_shapes=True) for model in (pair.target, pair.draft)))
        runtimes.target.graphed = runtimes.draft.graphed = graphed  # (as on a CUDA device)
        bench.run_bench(pair, profile, variants=["ar", "sd"], temperatures=[1.0], budgets=[], depths=[1],
                        prompts=prompts, repeats=1, max_tokens=12, seed=0, assisted=False, compiles=["on"],
                        runtimes={"on": runtimes})
        assert calls[:2] == [expected] * 2  # the two jobs' warm-ups
        assert calls[2:] == [(lengths[0], 12)] * 2 + [(lengths[1], 12)] * 2  # then the timed runs


def test_a_benchmark_on_a_shared_cpu_says_its_numbers_are_the_shared_machines():
    """Rows whose forwards ran on fewer threads than the CPU's (the governor's answer to other
    processes holding cores) give one warning counting them; rows on every thread, and peers, none."""
    from rsd_cli.bench import shared_cpu

    alone = {"variant": "ar", "forward_threads": {"2": 40}, "cpu_threads": 2}
    shared = {"variant": "sd", "forward_threads": {"1": 30, "2": 10}, "cpu_threads": 2}
    peer = {"variant": "hf-static", "tokens_per_second": 20.0}
    assert shared_cpu([alone, peer]) is None and shared_cpu([]) is None
    warning = shared_cpu([alone, shared, peer])
    assert "30 of 80 forwards ran on fewer threads than the CPU's 2" in warning


def test_ignore_eos_gives_every_row_and_peer_the_same_number_of_tokens(tiny_profile):
    """--ignore-eos: every run, transformers' peers too, takes --max-tokens tokens (the tiny pair's
    answers end at its end-of-sequence token otherwise, each row at its own length)."""
    def new_tokens(*extra):
        result = CliRunner().invoke(app, ["bench", "-p", str(tiny_profile), "--variants", "ar,sd,rsd-c", "--depths",
                                          "2", "--limit", "3", "-n", "40", "--json", *extra])
        assert result.exit_code == 0, result.stderr
        return {row["variant"]: row["new_tokens"] for row in json.loads(result.stdout)["results"]}

    assert min(new_tokens().values()) < 120
    assert new_tokens("--ignore-eos") == dict.fromkeys(["ar", "sd", "rsd-c", "hf-assisted", "hf-static"], 120)


def test_stop_tokens_end_every_row_and_peer_alike(tiny_profile):
    """--stop-token ends rsd's rows and transformers' peers at the same token: greedy, each takes the
    tokens up to its first occurrence."""
    from rsd_cli.prompting import builtin_prompts

    prompt = builtin_prompts("eval")[0]
    answer = CliRunner().invoke(app, ["generate", prompt, "-p", str(tiny_profile), "-t", "0", "-n", "20", "--json"],
                                input="")
    tokens = json.loads(answer.stdout)["token_ids"]
    stop = tokens[3]
    result = CliRunner().invoke(app, ["bench", "-p", str(tiny_profile), "--variants", "ar,sd", "--limit", "1", "-n",
                                      "20", "--temperatures", "0", "--stop-token", str(stop), "--json"])
    assert result.exit_code == 0, result.stderr
    counts = {row["variant"]: row["new_tokens"] for row in json.loads(result.stdout)["results"]}
    assert counts == dict.fromkeys(["ar", "sd", "hf-assisted", "hf-static"], tokens.index(stop) + 1)


def test_a_row_that_drafted_nothing_shows_no_acceptance_nor_draft_time():
    """`ar`'s row read "accept 0.00" and "draft s 0.00", as if its drafts were all rejected: "-" now (as a
    peer's row); a drafting row's own 0.00 stays."""
    import io

    from rich.console import Console

    from rsd_cli.bench import COLUMNS, results_table

    def row(variant, per_step):
        values = dict.fromkeys(COLUMNS, 0.0)
        values.update(variant=variant, shape=variant, compile="off", budget=None, depth=None, temperature=1.0,
                      tokens_per_second=30.0, speedup_vs_ar_range=None, new_tokens=64, block_efficiency=1.0,
                      target_tokens_per_step=per_step)
        return values

    out = io.StringIO()
    Console(file=out, width=250, color_system=None).print(results_table([row("ar", 1.0), row("sd", 2.0)], width=250))
    header, *cells = [[cell.strip() for cell in line.strip("┃│").split("┃" if "┃" in line else "│")]
                      for line in out.getvalue().splitlines() if line.startswith(("┃", "│"))]
    ar, sd = (dict(zip(header, line)) for line in cells)
    assert (ar["accept"], ar["draft s"], ar["verify s"]) == ("-", "-", "0.00")
    assert (sd["accept"], sd["draft s"]) == ("0.00", "0.00")


def test_a_prompt_past_the_context_is_refused_naming_it_before_anything_is_measured(tiny_profile, tmp_path,
                                                                                    monkeypatch):
    """bench failed on a --prompts file's prompt past the target's context when it came to it, with the
    error of generate's one prompt ("the prompt has 605 tokens…"), not saying which of the file's."""
    from rsd_cli import generation

    answered = []
    real = generation.complete
    monkeypatch.setattr("rsd_cli.bench.complete", lambda *args, **kwargs: answered.append(1) or real(*args, **kwargs))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n" + "ab" * 300 + "\nworld\n")
    result = CliRunner().invoke(app, ["bench", "-p", str(tiny_profile), "--prompts", str(prompts), "--limit", "3",
                                      "--variants", "ar,sd", "-n", "3", "--no-assisted", "--no-hf-static"])
    assert result.exit_code == 1 and not answered, result.stderr
    assert result.stderr == "rsd: error: prompt 2 of 3: the prompt has 605 tokens but the model's context holds 256\n"
