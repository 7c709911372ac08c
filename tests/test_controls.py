"""Controls a script expects: stop strings (generation ends at the first one, which is never
printed, even in part), per-token logprobs, the counts other tools report, resumable chat."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rsd_cli.cli import app
from rsd_cli.generation import StopText
from tiny import tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_a_stop_string_spanning_two_steps_is_never_printed(tokenizer):
    text = StopText(tokenizer, ["lo w"])
    assert text.push(ids(tokenizer, "hel")) == (3, "he")  # "l" could begin the stop string: held back
    assert text.push(ids(tokenizer, "lo")) == (2, "l")  # now "lo" could
    assert text.matched is None
    assert text.push(ids(tokenizer, " wor")) == (2, "")  # stop complete at the 2nd token of the step
    assert text.matched == "lo w" and text.text == "hel" and text.flush() == ""


def test_held_back_text_is_released_once_it_cannot_begin_a_stop_string(tokenizer):
    text = StopText(tokenizer, ["wor"])
    assert text.push(ids(tokenizer, "hello w")) == (7, "hello ")
    assert text.push(ids(tokenizer, "ax")) == (2, "wax")
    assert text.push(ids(tokenizer, "wo")) == (2, "")
    assert text.flush() == "wo"  # the end of generation: what was held is printed
    assert text.matched is None


def test_a_stop_inside_one_step_and_at_the_very_first_token(tokenizer):
    text = StopText(tokenizer, ["b, c"])
    assert text.push(ids(tokenizer, "a, b, c, d")) == (7, "a, ")
    assert text.matched == "b, c"
    first = StopText(tokenizer, ["x", "a"])
    assert first.push(ids(tokenizer, "abc")) == (1, "") and first.matched == "a" and first.text == ""


def test_the_first_stop_string_to_complete_wins(tokenizer):
    text = StopText(tokenizer, ["cd", "bcde"])
    assert text.push(ids(tokenizer, "abcdef")) == (4, "ab")  # "bcde" starts first but is not complete yet
    assert text.matched == "cd" and text.text == "ab"


def test_streamed_pieces_never_hold_part_of_a_stop_string(tokenizer):
    rng = random.Random(0)
    for _ in range(200):
        body = "".join(rng.choice("ab ") for _ in range(rng.randint(0, 12)))
        stop = "".join(rng.choice("ab ") for _ in range(rng.randint(1, 3)))
        tokens = ids(tokenizer, body)
        text, printed = StopText(tokenizer, [stop]), ""
        position = 0
        while position < len(tokens):
            size = rng.randint(1, 4)
            kept, piece = text.push(tokens[position:position + size])
            printed += piece
            assert stop not in printed
            position += size
            if text.matched:
                break
        printed += text.flush()
        expected = body.split(stop)[0] if stop in body else body
        assert printed == expected == text.text, (body, stop)


def test_include_stop_ends_the_text_with_the_stop_string(tokenizer):
    """vLLM's include_stop_str_in_output: the stop string is released and ends the text (what follows
    it, in the same token or later, is not), and nothing of it is shown before it is complete."""
    text = StopText(tokenizer, ["lo w"], include=True)
    assert text.push(ids(tokenizer, "hel")) == (3, "he")
    assert text.push(ids(tokenizer, "lo")) == (2, "l")
    assert text.push(ids(tokenizer, " wor")) == (2, "lo w")  # the stop complete: released with it
    assert text.matched == "lo w" and text.text == "hello w" and text.flush() == ""
    rng = random.Random(1)
    for _ in range(200):
        body = "".join(rng.choice("ab ") for _ in range(rng.randint(0, 12)))
        stop = "".join(rng.choice("ab ") for _ in range(rng.randint(1, 3)))
        tokens, text, printed, position = ids(tokenizer, body), StopText(tokenizer, [stop], include=True), "", 0
        while position < len(tokens) and not text.matched:
            size = rng.randint(1, 4)
            printed += text.push(tokens[position:position + size])[1]
            assert stop not in printed[:-len(stop)]
            position += size
        printed += text.flush()
        expected = body[: body.index(stop) + len(stop)] if stop in body else body
        assert printed == expected == text.text, (body, stop)


def greedy(tiny_profile, *extra):
    result = CliRunner().invoke(app, ["generate", "hello", "-p", str(tiny_profile), "-t", "0", "-n", "12", "--json",
                                      *extra])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_generate_stops_at_a_string_and_counts_only_what_it_emitted(tiny_profile):
    full = greedy(tiny_profile)
    assert len(full["text"]) >= 8
    stop = full["text"][4:6]  # two characters, so two tokens of the character tokenizer
    record = greedy(tiny_profile, "--stop", stop, "--stop", "never-seen")
    cut = full["text"].index(stop)
    assert record["text"] == full["text"][:cut]
    assert record["finish_reason"] == "stop" and record["stop"] == stop
    assert record["token_ids"] == full["token_ids"][: cut + 2]  # up to the token completing the stop
    assert record["stats"]["new_tokens"] == cut + 2
    plain = CliRunner().invoke(app, ["generate", "hello", "-p", str(tiny_profile), "-t", "0", "-n", "12",
                                     "--stop", stop])
    assert plain.exit_code == 0 and plain.stdout == full["text"][:cut] + "\n"


def test_include_stop_prints_the_stop_string_from_a_flag_the_profile_the_environment_and_chat(
        tiny_profile, tmp_path, monkeypatch):
    full = greedy(tiny_profile)
    stop = full["text"][4:6]
    end = full["text"].index(stop) + len(stop)
    record = greedy(tiny_profile, "--stop", stop, "--include-stop")
    assert record["text"] == full["text"][:end] and record["finish_reason"] == "stop" and record["stop"] == stop
    assert record["token_ids"] == greedy(tiny_profile, "--stop", stop)["token_ids"]  # (the same tokens either way)
    plain = CliRunner().invoke(app, ["generate", "hello", "-p", str(tiny_profile), "-t", "0", "-n", "12",
                                     "--stop", stop, "--include-stop"])
    assert plain.exit_code == 0 and plain.stdout == full["text"][:end] + "\n"
    profile = tmp_path / "include.toml"
    profile.write_text(tiny_profile.read_text().replace(
        "[sampling]\n", f"[sampling]\nstop = {json.dumps([stop])}\ninclude_stop = true\n"))
    assert greedy(profile)["text"] == full["text"][:end]
    assert greedy(profile, "--no-include-stop")["text"] == full["text"][: end - len(stop)]
    shown = CliRunner().invoke(app, ["profiles", "show", str(profile)])
    assert "include_stop = true" in shown.stdout
    monkeypatch.setenv("RSD_SAMPLING_INCLUDE_STOP", "off")
    assert greedy(profile)["text"] == full["text"][: end - len(stop)]
    monkeypatch.setenv("RSD_SAMPLING_INCLUDE_STOP", "maybe")
    result = CliRunner().invoke(app, ["generate", "hi", "-p", str(profile)])
    assert result.exit_code == 1 and result.stderr.strip().endswith(
        "environment variable RSD_SAMPLING_INCLUDE_STOP must be true or false, got 'maybe'")
    monkeypatch.delenv("RSD_SAMPLING_INCLUDE_STOP")
    bad = tmp_path / "bad.toml"
    bad.write_text(tiny_profile.read_text().replace("[sampling]\n", "[sampling]\ninclude_stop = 1\n"))
    result = CliRunner().invoke(app, ["generate", "hi", "-p", str(bad)])
    assert result.exit_code == 1 and "sampling.include_stop must be true or false, got 1" in result.stderr
    saved = tmp_path / "chat.json"
    script = f"/set temperature 0\n/set max_tokens 12\n/set stop {stop}\n/set include_stop on\nhello\n/save {saved}\n"
    result = CliRunner().invoke(app, ["chat", "-p", str(tiny_profile)], input=script)
    assert result.exit_code == 0, result.stderr
    assert "include_stop = on" in result.stderr
    assert json.loads(saved.read_text())["messages"][-1]["content"].endswith(stop)
    result = CliRunner().invoke(app, ["chat", "-p", str(tiny_profile)], input="/set include_stop sometimes\n")
    assert "/set include_stop: 'sometimes' is not on or off" in result.stderr


def test_stop_strings_from_the_profile_and_the_environment(tiny_profile, tmp_path, monkeypatch):
    full = greedy(tiny_profile)
    stop = full["text"][3:5]
    profile = tmp_path / "stops.toml"
    profile.write_text(tiny_profile.read_text().replace("[sampling]\n", f"[sampling]\nstop = {json.dumps([stop])}\n"))
    assert greedy(profile)["stop"] == stop
    profile.write_text(tiny_profile.read_text().replace("[sampling]\n", f"[sampling]\nstop = {json.dumps(stop)}\n"))
    assert greedy(profile)["stop"] == stop  # (one string, not in a list, as RSD_SAMPLING_STOP takes it)
    monkeypatch.setenv("RSD_SAMPLING_STOP", json.dumps(["zzz", stop]))
    assert greedy(tiny_profile)["stop"] == stop


def test_empty_or_malformed_stop_strings_are_usage_errors(tiny_profile, tmp_path):
    result = CliRunner().invoke(app, ["generate", "hi", "-p", str(tiny_profile), "--stop", ""])
    assert result.exit_code == 2 and "sampling.stop must not contain an empty string" in result.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text(tiny_profile.read_text().replace("[sampling]\n", "[sampling]\nstop = [1]\n"))
    result = CliRunner().invoke(app, ["generate", "hi", "-p", str(bad)])
    assert result.exit_code == 1 and "sampling.stop must be a list of strings" in result.stderr


def test_chat_answers_end_at_a_stop_string_set_with_slash_set(tiny_profile, tmp_path):
    full = greedy(tiny_profile)
    stop = full["text"][4:6]
    saved = tmp_path / "chat.json"
    script = f"/set temperature 0\n/set max_tokens 12\n/set stop {stop}\nhello\n/save {saved}\n"
    result = CliRunner().invoke(app, ["chat", "-p", str(tiny_profile)], input=script)
    assert result.exit_code == 0, result.stderr
    answer = json.loads(saved.read_text())["messages"][-1]
    assert answer["role"] == "assistant" and stop not in answer["content"]
    result = CliRunner().invoke(app, ["chat", "-p", str(tiny_profile)], input='/set stop ["a", 1]\n')
    assert "/set stop: '[\"a\", 1]' is not a string or a JSON list of strings" in result.stderr


def test_inspect_tree_ends_at_a_stop_string_too(tiny_profile):
    full = greedy(tiny_profile)
    stop = full["text"][2:4]
    result = CliRunner().invoke(app, ["inspect-tree", "hello", "-p", str(tiny_profile), "-t", "0", "--step", "50",
                                      "--stop", stop])
    assert result.exit_code == 1 and "generation ended after" in result.stderr


def test_logprobs_are_those_of_a_fresh_target_forward(tiny_profile, tiny_pair_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from rsd_cli.prompting import encode_prompt

    result = CliRunner().invoke(app, ["generate", "hello", "-p", str(tiny_profile), "-t", "0.8", "-n", "10",
                                      "--json", "--logprobs", "3"])
    assert result.exit_code == 0, result.stderr
    record = json.loads(result.stdout)
    assert [r["token"] for r in record["logprobs"]] == record["token_ids"]
    target = AutoModelForCausalLM.from_pretrained(tiny_pair_dir / "target").eval()
    tokenizer = tiny_tokenizer()
    ids = encode_prompt(tokenizer, "hello")
    for entry in record["logprobs"]:
        with torch.no_grad():
            logits = target(torch.tensor([ids])).logits[0, -1]
        expected = torch.log_softmax(logits / 0.8, -1)
        assert entry["logprob"] == pytest.approx(float(expected[entry["token"]]), abs=1e-4)
        assert [t["token"] for t in entry["top"]] == expected.topk(3).indices.tolist()
        assert all(t["bytes"] == list(t["text"].encode()) for t in [entry, *entry["top"]])  # (whole characters)
        assert [t["logprob"] for t in entry["top"]] == pytest.approx(expected.topk(3).values.tolist(), abs=1e-4)
        ids.append(entry["token"])
    result = CliRunner().invoke(app, ["generate", "hello", "-p", str(tiny_profile), "--logprobs", "2"])
    assert result.exit_code == 2 and "--logprobs needs --json" in result.stderr


def test_json_stats_carry_the_counts_other_tools_report(tiny_profile):
    stats = greedy(tiny_profile)["stats"]  # rsd-c b=(2,2): 6 drafted tokens a full step
    assert stats["target_forwards"] == stats["steps"]
    assert stats["mean_accepted_length"] == stats["block_efficiency"]
    assert 0 <= stats["accepted_tokens"] <= stats["drafted_tokens"] <= 6 * stats["steps"]
    assert stats["accepted_tokens"] == round((stats["block_efficiency"] - 1) * stats["steps"])


def test_chat_resumes_a_saved_conversation(tiny_profile, tmp_path):
    saved, again = tmp_path / "chat.json", tmp_path / "again.json"
    first = CliRunner().invoke(app, ["chat", "-p", str(tiny_profile), "-s", "be brief"],
                               input=f"hello\n/save {saved}\n")
    assert first.exit_code == 0, first.stderr
    resumed = CliRunner().invoke(app, ["chat", "-p", str(tiny_profile), "--load", str(saved)],
                                 input=f"more\n/save {again}\n")
    assert resumed.exit_code == 0, resumed.stderr
    assert "resumed 2 messages" in resumed.stderr
    record = json.loads(again.read_text())
    assert record["system"] == "be brief" and len(record["messages"]) == 4
    assert record["messages"][:2] == json.loads(saved.read_text())["messages"]
    inline = CliRunner().invoke(app, ["chat", "-p", str(tiny_profile)], input=f"/load {saved}\n/save {again}\n")
    assert "loaded 2 messages" in inline.stderr and len(json.loads(again.read_text())["messages"]) == 2
    broken = tmp_path / "broken.json"
    broken.write_text('{"messages": [{"role": "wizard"}]}')
    result = CliRunner().invoke(app, ["chat", "-p", str(tiny_profile), "--load", str(broken)])
    assert result.exit_code == 1 and "is not a saved conversation" in result.stderr
    result = CliRunner().invoke(app, ["chat", "-p", str(tiny_profile), "--load", str(tmp_path / "none.json")])
    assert result.exit_code == 1 and "cannot read" in result.stderr


# min-p and the repetition penalty: processing of p (and q), exact like temperature / top-k / top-p

def test_processing_matches_transformers_processors():
    import torch
    from transformers.generation.logits_process import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

    from rsd_cli.sampling import SamplingParams, logits_to_probs

    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    context = torch.tensor([[1, 5, 7], [2, 2, 9], [0, 49, 3]])
    seen = torch.zeros(3, 50, dtype=torch.bool).scatter(1, context, True)
    ours = logits_to_probs(logits, SamplingParams(temperature=0.7, min_p=0.1, repetition_penalty=1.3), seen)
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(context, logits.clone()) / 0.7
    theirs = MinPLogitsWarper(0.1)(context, theirs).softmax(-1)
    torch.testing.assert_close(ours, theirs)
    with pytest.raises(ValueError, match="needs the tokens seen"):
        logits_to_probs(logits, SamplingParams(repetition_penalty=1.3))


def test_presence_and_frequency_penalties_are_openais():
    """Each token's logit less the presence penalty if it is in the answer so far and the frequency
    penalty times its count there (OpenAI's definition, before the temperature); with a repetition
    penalty, that comes first (transformers' order)."""
    import torch

    from rsd_cli.sampling import SamplingParams, logits_to_probs

    torch.manual_seed(0)
    logits = torch.randn(2, 20) * 3
    counts = torch.zeros(2, 20, dtype=torch.long)
    counts[0, 3], counts[0, 7], counts[1, 7] = 2, 1, 4
    sampling = SamplingParams(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.25)
    expected = ((logits - 0.5 * (counts > 0) - 0.25 * counts) / 0.8).softmax(-1)
    torch.testing.assert_close(logits_to_probs(logits, sampling, counts=counts), expected)
    both = SamplingParams(repetition_penalty=1.3, presence_penalty=-0.5)  # (a negative one encourages)
    penalised = torch.where(counts > 0, torch.where(logits > 0, logits / 1.3, logits * 1.3), logits)
    torch.testing.assert_close(logits_to_probs(logits, both, counts > 0, counts),
                               (penalised + 0.5 * (counts > 0)).softmax(-1))
    with pytest.raises(ValueError, match="needs the counts of each row's answer"):
        logits_to_probs(logits, SamplingParams(frequency_penalty=0.1), counts > 0)


def test_min_p_and_penalty_flags_are_checked(tiny_profile):
    for flag, value, message in (("--min-p", "1", "sampling.min_p must be in [0, 1)"),
                                 ("--min-p", "-0.1", "sampling.min_p must be in [0, 1)"),
                                 ("--repetition-penalty", "0", "sampling.repetition_penalty must be a finite number greater than 0"),
                                 ("--repetition-penalty", "inf", "sampling.repetition_penalty must be a finite number greater than 0"),
                                 ("--presence-penalty", "nan", "sampling.presence_penalty must be a finite number"),
                                 ("--frequency-penalty", "inf", "sampling.frequency_penalty must be a finite number")):
        result = CliRunner().invoke(app, ["generate", "hi", "-p", str(tiny_profile), flag, value])
        assert result.exit_code == 2 and message in result.stderr, (flag, value, result.stderr)


def test_presence_and_frequency_penalties_reach_generation_from_flags_and_profiles(tiny_profile, tmp_path):
    """--presence-penalty and --frequency-penalty (and the profile's keys) penalise what the answer
    repeats: a greedy answer that repeats tokens repeats none under them (here it ends sooner),
    the same from a flag as from the profile."""
    def tokens(*extra, profile=tiny_profile):
        result = CliRunner().invoke(app, ["generate", "the cat", "-p", str(profile), "-t", "0", "-v", "sd", "-n", "24",
                                          "--json", *extra], input="")
        assert result.exit_code == 0, result.stderr
        return json.loads(result.stdout)["token_ids"]

    plain = tokens()
    penalised = tokens("--presence-penalty", "2", "--frequency-penalty", "1")
    assert len(set(plain)) < len(plain) and len(set(penalised)) == len(penalised) > 1
    profile = tmp_path / "penalised.toml"
    profile.write_text(tiny_profile.read_text() + "presence_penalty = 2.0\nfrequency_penalty = 1.0\n")
    assert tokens(profile=profile) == penalised


def test_a_stop_inside_one_accepted_path_cuts_that_step(tiny_pair_dir):
    """A step that emits several tokens is cut after the token completing the stop string; the
    statistics count only the tokens kept, and generation ends with that step."""
    from rsd_cli.drafting import make_shape
    from rsd_cli.engine import Decoder
    from rsd_cli.generation import complete
    from rsd_cli.sampling import SamplingParams
    from tiny import tiny_model

    target = tiny_model(40, 3, 0, 0.3)
    tokenizer = tiny_tokenizer()  # the target drafts for itself: every greedy draft is accepted
    decoder = Decoder(target, target, 40, make_shape("sd", draft_len=4), SamplingParams(0.0), set())
    prompt = ids(tokenizer, "hello")
    before, steps = [], []
    for event in decoder.generate(prompt, 40, seed=0):
        steps.append((len(before), list(event.emitted)))
        before += event.emitted
    start, emitted = next((s, e) for s, e in steps[1:] if len(e) == 5)  # 4 accepted + the bonus
    stop = tokenizer.decode(emitted[1:3])
    assert stop not in tokenizer.decode(before[: start + 2])  # it first completes at emitted[2]
    tokens, stats, events = complete(decoder, prompt, 40, seed=0, text=StopText(tokenizer, [stop]))
    assert tokens == before[: start + 3] and stats.new_tokens == start + 3
    assert events[-1].finished == "stop" and events[-1].emitted == emitted[:3] and events[-1].stop == stop
    assert stats.steps == len([s for s, _ in steps if s <= start])


def test_a_stop_string_counts_only_past_min_tokens(tokenizer):
    """With min_tokens, a stop string ends the text only where it ends after the first min_tokens - 1
    tokens' text (vLLM's rule): one inside them is kept as text, a later one still ends it."""
    text = StopText(tokenizer, ["b"], min_tokens=4)
    assert text.push(ids(tokenizer, "abc")) == (3, "abc")  # ("b" would have ended it at "a")
    assert text.push(ids(tokenizer, "d")) == (1, "d") and text.matched is None
    assert text.push(ids(tokenizer, "ab")) == (2, "a") and text.matched == "b" and text.text == "abcda"
    spanning = StopText(tokenizer, ["cd"], min_tokens=4)  # completed by the 4th token: it counts
    assert spanning.push(ids(tokenizer, "abcd")) == (4, "ab") and spanning.matched == "cd"


def sampled(profile, *extra) -> dict:
    """One `rsd generate --json` record: T=1, sd, seed 3 (an answer the tiny pair ends at its
    end-of-sequence token, id 2, after 9 tokens), up to 40 tokens."""
    result = CliRunner().invoke(app, ["generate", "the cat", "-p", str(profile), "-t", "1", "-v", "sd", "--seed", "3",
                                      "-n", "40", "--json", *extra], input="")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_ignore_eos_min_tokens_and_the_logit_bias_reach_generation(tiny_profile, tmp_path):
    """--ignore-eos runs the answer to -n without its end-of-sequence token, as a bias of -inf on
    that token does; --min-tokens N bars it for the first N tokens only (the same draws there); the
    profile's keys give what the flags give."""
    plain = sampled(tiny_profile)
    assert plain["finish_reason"] == "eos" and len(plain["token_ids"]) < 12 and plain["token_ids"][-1] == 2
    ignoring = sampled(tiny_profile, "--ignore-eos")
    assert ignoring["finish_reason"] == "length" and len(ignoring["token_ids"]) == 40 and 2 not in ignoring["token_ids"]
    assert sampled(tiny_profile, "--logit-bias", "2=-inf")["token_ids"] == ignoring["token_ids"]
    at_least = sampled(tiny_profile, "--min-tokens", "12")
    assert len(at_least["token_ids"]) >= 12 and at_least["token_ids"][:12] == ignoring["token_ids"][:12]
    favoured = sampled(tiny_profile, "--logit-bias", "17=4", "--logit-bias", "2=-inf")["token_ids"]
    assert favoured.count(17) >= 10 > 3 >= ignoring["token_ids"].count(17) and 2 not in favoured
    profile = tmp_path / "biased.toml"
    profile.write_text(tiny_profile.read_text() + "logit_bias = { 17 = 4, 2 = -inf }\nmin_tokens = 12\n")
    assert sampled(profile, "--min-tokens", "0")["token_ids"] == favoured
    assert sampled(profile, "--logit-bias", "5=0")["token_ids"][:12] == ignoring["token_ids"][:12]  # (a flag's
    # table replaces the profile's, as --stop's list does)


def test_malformed_logit_biases_and_min_tokens_are_one_line_errors(tiny_profile, tmp_path):
    for args, code, message in (
            (["--logit-bias", "x=1"], 2, "--logit-bias takes TOKEN_ID=BIAS, like 2=-100 or 13=5"),
            (["--logit-bias", "2"], 2, "--logit-bias takes TOKEN_ID=BIAS"),
            (["--logit-bias", "2=nan"], 2, "sampling.logit_bias must give token 2 a number"),
            (["--logit-bias", "2=inf"], 2, "sampling.logit_bias must give token 2 a number"),
            (["--logit-bias", "40=-1"], 2,  # (a usage error, as a value out of its range: known once the models are)
             "flag --logit-bias: the logit bias names token id 40, but the models' vocabulary has 40 tokens"),
            (["--min-tokens", "-1"], 2, "sampling.min_tokens must be at least 0")):
        result = CliRunner().invoke(app, ["generate", "hi", "-p", str(tiny_profile), *args], input="")
        assert result.exit_code == code and message in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text(tiny_profile.read_text() + 'logit_bias = { two = -1 }\n')
    result = CliRunner().invoke(app, ["generate", "hi", "-p", str(bad)], input="")
    assert result.exit_code == 1 and "sampling.logit_bias must have token ids as keys" in result.stderr
    bad.write_text(tiny_profile.read_text() + 'logit_bias = { 40 = -1 }\n')  # a profile's: a runtime error
    result = CliRunner().invoke(app, ["generate", "hi", "-p", str(bad)], input="")
    assert result.exit_code == 1 and result.stderr.strip() == (f"rsd: error: {bad}: sampling.logit_bias: the logit "
                                                               "bias names token id 40, but the models' vocabulary "
                                                               "has 40 tokens (ids 0-39)")


def test_chat_sets_a_logit_bias_and_min_tokens(tiny_profile, tmp_path):
    """/set logit_bias and /set min_tokens apply from the next answer; a malformed or impossible
    bias is refused in one line and leaves the session's as it was."""
    saved = tmp_path / "chat.json"
    script = ("/set temperature 0\n/set max_tokens 30\n/set logit_bias x\n/set logit_bias 2=-1,40=5\n"
              "/set logit_bias 17=6, 2=-inf\n/set min_tokens 3\nhello\n/save " + str(saved) + "\n")
    result = CliRunner().invoke(app, ["chat", "-p", str(tiny_profile)], input=script)
    assert result.exit_code == 0, result.stderr
    assert "/set logit_bias: 'x' is not TOKEN_ID=BIAS entries separated by commas" in result.stderr
    assert "the logit bias names token id 40" in result.stderr
    assert "logit_bias = 17=6,2=-inf" in result.stderr and "min_tokens = 3" in result.stderr
    answer = json.loads(saved.read_text())["messages"][-1]["content"]
    assert answer.count("o") >= 9  # (token 17 is "o"; the greedy answer without the bias has one)


def test_a_logit_bias_from_the_environment_shows_as_a_toml_table(tiny_profile, monkeypatch):
    """RSD_SAMPLING_LOGIT_BIAS takes a JSON object; `rsd profiles show` writes the table as TOML
    reads it back (-inf included), and --json as numbers."""
    import tomllib

    monkeypatch.setenv("RSD_SAMPLING_LOGIT_BIAS", '{"2": -Infinity, "17": 4}')
    monkeypatch.setenv("RSD_SAMPLING_MIN_TOKENS", "5")
    result = CliRunner().invoke(app, ["profiles", "show", str(tiny_profile)])
    assert result.exit_code == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("logit_bias"))
    assert tomllib.loads(line.split("  #")[0])["logit_bias"] == {"2": -float("inf"), "17": 4}
    assert "min_tokens = 5  # env RSD_SAMPLING_MIN_TOKENS" in result.stdout
    monkeypatch.setenv("RSD_SAMPLING_LOGIT_BIAS", "2=-1")
    result = CliRunner().invoke(app, ["profiles", "show", str(tiny_profile)])
    assert result.exit_code == 1 and "RSD_SAMPLING_LOGIT_BIAS must be a JSON object" in result.stderr


def test_tokenize_gives_the_ids_a_logit_bias_takes_and_the_prompts_length(tiny_profile):
    """`rsd tokenize TEXT`: a line per token (id, tab, its text JSON-quoted) on stdout, the count and
    the tokens that end an answer on stderr; --chat gives the tokens `rsd generate` sends (its
    prompt_tokens); --json one object. An id it prints bars that text through --logit-bias."""
    from rsd_cli.models import load_pair
    from rsd_cli.profiles import load_profile

    result = CliRunner().invoke(app, ["tokenize", "cat o", "-p", str(tiny_profile)])
    assert result.exit_code == 0, result.stderr
    lines = [line.split("\t") for line in result.stdout.splitlines()]
    assert [json.loads(text) for _, text in lines] == ["c", "a", "t", " ", "o"]
    o = int(lines[-1][0])
    pair = load_pair(load_profile(str(tiny_profile)))
    assert [int(token) for token, _ in lines] == pair.tokenizer.encode("cat o", add_special_tokens=False)
    assert result.stderr.strip() == f'5 tokens · the answer ends at: {" ".join(str(t) for t in pair.eos_ids)} "</s>"'
    chat = CliRunner().invoke(app, ["tokenize", "the cat", "-p", str(tiny_profile), "--chat", "--json"])
    record = json.loads(chat.stdout)
    answer = sampled(tiny_profile, "--ignore-eos")
    assert record["count"] == len(record["tokens"]) == answer["prompt_tokens"]
    assert record["end_of_sequence"] == [{"id": t, "text": "</s>", "bytes": list(b"</s>")} for t in sorted(pair.eos_ids)]
    assert "o" in answer["text"] and "o" not in sampled(tiny_profile, "--ignore-eos", "--logit-bias", f"{o}=-inf")["text"]
    refused = CliRunner().invoke(app, ["tokenize", "x", "-p", str(tiny_profile), "-s", "be brief"])
    assert refused.exit_code == 2 and "--system applies with --chat" in refused.stderr


def test_chat_set_alone_lists_every_setting_as_set_takes_it_and_where_it_comes_from(tiny_profile):
    """`/set` alone: every setting /set takes, its value as /set would take it, and where it comes from
    (the default, the profile, a flag, /set); `/set KEY`: that one."""
    script = "/set logit_bias 2=-inf,17=6\n/set stop [\"a b\"]\n/set\n/set top_k\n"
    result = CliRunner().invoke(app, ["chat", "-p", str(tiny_profile), "-t", "0.5"], input=script)
    assert result.exit_code == 0, result.stderr
    lines = result.stderr.splitlines()
    from rsd_cli.chat import SETTABLE

    start = next(i for i, line in enumerate(lines) if line.startswith("temperature = "))
    listing = lines[start:start + len(SETTABLE)]
    assert [line.split(" = ")[0] for line in listing] == list(SETTABLE)
    for expected in ("temperature = 0.5  (flag --temperature)", "logit_bias = 2=-inf,17=6  (/set)",
                     'stop = ["a b"]  (/set)', "branching = 2,2  (" + str(tiny_profile) + ")",
                     "max_tokens = 12  (" + str(tiny_profile) + ")", "top_p = 1.0  (default)"):
        assert expected in listing, expected
    assert lines[start + len(SETTABLE):] == ["top_k = 0  (default)"]


def test_stop_tokens_end_the_answer_as_its_end_of_sequence_token_does(tiny_profile, tmp_path):
    """--stop-token ID (sampling.stop_tokens, /set stop_token) ends the answer at that token, kept
    with its text as vLLM keeps a stop token that is not special; --min-tokens bars it as it bars
    the end-of-sequence token; `rsd tokenize` lists it among the tokens that end an answer; an id
    beyond the vocabulary is one line."""
    def record(*extra, profile=tiny_profile):
        result = CliRunner().invoke(app, ["generate", "the cat", "-p", str(profile), "-t", "0", "-v", "sd", "-n", "20",
                                          "--json", *extra], input="")
        assert result.exit_code == 0, result.stderr
        return json.loads(result.stdout)

    plain = record()["token_ids"]
    stop = plain[1]
    stopped = record("--stop-token", str(stop))
    assert stopped["token_ids"] == plain[:2] and stopped["finish_reason"] == "eos"
    assert stopped["text"] == record("-n", "2")["text"]  # (its text kept)
    at_least = record("--stop-token", str(stop), "--min-tokens", "8")["token_ids"]
    assert stop not in at_least[:8] and (len(at_least) == 20 or at_least.index(stop) == len(at_least) - 1)
    profile = tmp_path / "stops.toml"
    profile.write_text(tiny_profile.read_text() + f"stop_tokens = [{stop}]\n")
    assert record(profile=profile)["token_ids"] == plain[:2]
    listed = json.loads(CliRunner().invoke(app, ["tokenize", "x", "-p", str(profile), "--json"]).stdout)
    assert stop in {entry["id"] for entry in listed["end_of_sequence"]}
    chat = CliRunner().invoke(app, ["chat", "-p", str(tiny_profile), "-t", "0", "-v", "sd", "-n", "20"],
                              input=f"/set stop_token 40\n/set stop_token {stop}\nthe cat\n/set stop_token\n")
    assert "stop token id 40 is beyond the models' vocabulary (40 tokens)" in chat.stderr
    assert f"stop_token = {stop}  (/set)" in chat.stderr
    beyond = CliRunner().invoke(app, ["generate", "hi", "-p", str(tiny_profile), "--stop-token", "40"], input="")
    assert beyond.exit_code == 2 and beyond.stderr.strip() == \
        "rsd: error: flag --stop-token: stop token id 40 is beyond the models' vocabulary (40 tokens)"
    profile.write_text(tiny_profile.read_text() + "stop_tokens = [40]\n")  # a profile's: a runtime error
    beyond = CliRunner().invoke(app, ["generate", "hi", "-p", str(profile)], input="")
    assert beyond.exit_code == 1 and beyond.stderr.strip() == \
        f"rsd: error: {profile}: sampling.stop_tokens: stop token id 40 is beyond the models' vocabulary (40 tokens)"


class Untemplated:
    """A base model's tokenizer (no chat template) that records the text it is asked to encode."""

    chat_template = None

    def __init__(self):
        self.texts = []

    def encode(self, text, add_special_tokens=True):
        self.texts.append(text)
        return [1, 2]


def test_a_base_model_s_chat_turn_is_the_conversation_as_plain_text():
    """Without a chat template, a chat turn sent only its last message: no system prompt, no history,
    without a word. It is now the conversation as plain text, answers read back as they were written."""
    from rsd_cli.prompting import encode_prompt

    tokenizer = Untemplated()
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " hello there\n"}]
    encode_prompt(tokenizer, "and you?", system="Be brief.", history=history)
    encode_prompt(tokenizer, "hi", history=[])
    encode_prompt(tokenizer, "hi", system="Be brief.")  # generate: the system prompt before it, as --raw puts it
    encode_prompt(tokenizer, "hi", system="Be brief.", raw=True, history=history)  # --raw: as it was
    assert tokenizer.texts == ["Be brief.\n\nUser: hi\nAssistant: hello there\nUser: and you?\nAssistant:",
                               "User: hi\nAssistant:", "Be brief.\n\nhi", "Be brief.\n\nhi"]


def base_model_profile(tiny_pair_dir, tmp_path, max_tokens: int) -> Path:
    """A profile whose target is the tiny one without a chat template (a base model's tokenizer)."""
    import shutil

    untemplated = tmp_path / "base"
    shutil.copytree(tiny_pair_dir / "target", untemplated)
    (untemplated / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((untemplated / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (untemplated / "tokenizer_config.json").write_text(json.dumps(config))
    profile = tmp_path / "base.toml"
    profile.write_text(f'[target]\nsource = "{untemplated}"\n[draft]\nkind = "early-exit"\nlayers = 1\n'
                       f'[decoding]\nvariant = "sd"\n[sampling]\nmax_tokens = {max_tokens}\ntemperature = 0\n')
    return profile


def test_a_base_model_s_chat_says_how_it_talks_to_it_and_ends_an_answer_at_the_next_turn(tiny_pair_dir, tmp_path):
    profile = base_model_profile(tiny_pair_dir, tmp_path, max_tokens=12)
    from rsd_cli import chat

    sent = []
    real = chat.encode_prompt
    saved = tmp_path / "chat.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chat, "encode_prompt", lambda *a, **k: sent.append(k) or real(*a, **k))
        result = CliRunner().invoke(app, ["chat", "-p", str(profile), "-s", "be kind"],
                                    input=f"hello\nagain\n/save {saved}\n")
    assert result.exit_code == 0, result.stderr
    assert "the target has no chat template: the conversation goes to it as plain text" in result.stderr
    assert [k["system"] for k in sent] == ["be kind", "be kind"]
    assert [len(k["history"]) for k in sent] == [0, 2]  # the second turn reads the first
    first = json.loads(saved.read_text())["messages"][1]["content"]
    turn = first[2:4]  # (the tiny tokenizer writes no capitals: the next turn's line stands for a piece it writes)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chat, "NEXT_TURN", turn)
        stopped = CliRunner().invoke(app, ["chat", "-p", str(profile), "-s", "be kind"], input=f"hello\n/save {saved}\n")
        assert stopped.exit_code == 0, stopped.stderr
        assert json.loads(saved.read_text())["messages"][-1]["content"] == first[: first.index(turn)] != first
        # --include-stop keeps the user's stop strings only: the next turn's start, rsd's own, stays out of
        # the answer (kept, the next turn's prompt would hold it twice)
        kept = CliRunner().invoke(app, ["chat", "-p", str(profile), "-s", "be kind", "--include-stop"],
                                  input=f"hello\n/save {saved}\n")
    assert kept.exit_code == 0, kept.stderr
    assert json.loads(saved.read_text())["messages"][-1]["content"] == first[: first.index(turn)]
    assert "rsd: include_stop (flag --include-stop) changes nothing without a stop string (--stop)" in kept.stderr


def test_a_base_model_s_chat_answer_does_not_begin_with_the_space_it_writes_after_assistant(tiny_pair_dir, tmp_path):
    """A base model answers "Assistant:" with a space (` Hello`): printed and kept, each answer began with
    it. Here the first pieces streamed are whitespace, as such a model's first token is."""
    profile = base_model_profile(tiny_pair_dir, tmp_path, max_tokens=6)
    from rsd_cli import chat

    real = chat.stream_completion

    def spaced(*args, out, **kwargs):
        out.write(" ")
        out.write("")
        out.write(" \n")
        tokens, stats, events, text = real(*args, out=out, **kwargs)
        return tokens, stats, events, "  \n" + text

    saved = tmp_path / "chat.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chat, "stream_completion", spaced)
        result = CliRunner().invoke(app, ["chat", "-p", str(profile)], input=f"hello\nagain\n/save {saved}\n")
    assert result.exit_code == 0, result.stderr
    answers = result.stdout.splitlines()
    assert len(answers) == 2 and all(answer and not answer[0].isspace() for answer in answers), answers
    kept = [m["content"] for m in json.loads(saved.read_text())["messages"] if m["role"] == "assistant"]
    assert kept == answers
