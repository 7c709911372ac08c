"""The tokenizer read without transformers (rsd_cli/light_tokenizer.py) against transformers' own
generic fast tokenizer on the same files: the same ids, text, chat prompts and special tokens, or
None where the files hold something it does not do as transformers would."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny import tiny_tokenizer

from rsd_cli.light_tokenizer import LightTokenizer

TEXTS = ["", "hello world", "Hello, World!  two  spaces\nnew line\ttab", "<s>special</s> inside <unk> text",
         "naïve café — 東京 🙂 ünïcödé", "def f(x):\n    return x ** 2  # code\n", "   leading and trailing   ",
         "a" * 300]
CONVERSATIONS = [
    [{"role": "user", "content": "hi there"}],
    [{"role": "system", "content": "be brief."}, {"role": "user", "content": "what is it?"}],
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
     {"role": "user", "content": "three, 東京 🙂"}],
]


def transformers_tokenizer(folder: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(folder))


def assert_same(light: LightTokenizer, reference) -> None:
    """Everything rsd asks of a tokenizer, compared."""
    for text in TEXTS:
        for special in (True, False):
            ids = reference.encode(text, add_special_tokens=special)
            assert light.encode(text, add_special_tokens=special) == ids, (text, special)
        ids = reference.encode(text, add_special_tokens=True)
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
            for single in ids[:20]:  # (one token at a time, as the live view and --logprobs decode them)
                assert light.decode([single], skip_special_tokens=skip) == reference.decode([single],
                                                                                          skip_special_tokens=skip)
    ids = reference.encode("hello world")  # (a tensor of ids, and one id alone, as transformers takes them)
    assert light.decode(torch.tensor(ids)) == reference.decode(ids) and light.decode(ids[0]) == reference.decode(ids[0])
    special_ids = [i for i in (reference.bos_token_id, reference.eos_token_id, reference.unk_token_id) if i is not None]
    assert light.decode(special_ids, skip_special_tokens=True) == reference.decode(special_ids, skip_special_tokens=True)
    assert light.decode(special_ids) == reference.decode(special_ids)
    for messages in CONVERSATIONS:
        for generation_prompt in (True, False):
            expected = reference.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
            assert light.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False) == expected
    assert (light.bos_token_id, light.eos_token_id, light.pad_token_id, light.unk_token_id) == \
        (reference.bos_token_id, reference.eos_token_id, reference.pad_token_id, reference.unk_token_id)
    assert light.get_vocab() == reference.get_vocab()
    assert len(light) == len(reference)
    assert light.chat_template == reference.chat_template


@pytest.fixture
def tiny_folder(tmp_path) -> Path:
    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    return tmp_path / "tok"


def test_the_tiny_tokenizer_reads_as_transformers_reads_it(tiny_folder):
    light = LightTokenizer.load(tiny_folder)
    assert light is not None
    assert_same(light, transformers_tokenizer(tiny_folder))


def test_a_chat_template_kept_in_the_config_as_transformers_4_writes_it(tiny_folder):
    template = (tiny_folder / "chat_template.jinja").read_text()
    (tiny_folder / "chat_template.jinja").unlink()
    config = json.loads((tiny_folder / "tokenizer_config.json").read_text())
    # (blocks on lines of their own, trimmed as transformers trims them; its tojson, which escapes nothing)
    config["chat_template"] = (template + "\n{% if add_generation_prompt %}\n    {{ bos_token }}\n  {% endif %}\n"
                               "{{ messages | length | tojson }}{{ {'k': '<b>é</b>'} | tojson }}")
    (tiny_folder / "tokenizer_config.json").write_text(json.dumps(config))
    light = LightTokenizer.load(tiny_folder)
    assert light is not None and light.chat_template == config["chat_template"]
    assert_same(light, transformers_tokenizer(tiny_folder))


@pytest.mark.parametrize("change", [
    {"some_new_key": 1},  # a key it does not know what transformers does with
    {"clean_up_tokenization_spaces": True},
    {"bos_token": "<not in the vocabulary>"},  # transformers would add it
    {"additional_special_tokens": ["<s>"]},
    {"add_bos_token": True},  # a switch that rewrites the post-processor
    {"chat_template": [{"name": "default", "template": "{{ messages }}"}]},  # named templates
    {"tokenizer_class": "LlamaTokenizer"},  # a class of its own
])
def test_anything_transformers_would_act_on_leaves_the_tokenizer_to_transformers(tiny_folder, change):
    config = json.loads((tiny_folder / "tokenizer_config.json").read_text())
    if "chat_template" in change:
        (tiny_folder / "chat_template.jinja").unlink()
    (tiny_folder / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
    assert LightTokenizer.load(tiny_folder) is None


def test_a_template_jinja_cannot_compile_here_leaves_it_to_transformers(tiny_folder):
    # transformers' own {% generation %} tag (its assistant-token masks) is not an extension here
    (tiny_folder / "chat_template.jinja").write_text("{% generation %}{{ messages }}{% endgeneration %}")
    assert LightTokenizer.load(tiny_folder) is None
    (tiny_folder / "chat_template.jinja").write_text("{{ raise_exception('no system prompts') }}")
    light = LightTokenizer.load(tiny_folder)
    with pytest.raises(Exception, match="no system prompts"):
        light.apply_chat_template(CONVERSATIONS[0], tokenize=False)


@pytest.mark.integration
def test_the_embedded_model_s_tokenizer_reads_as_transformers_reads_it():
    from rsd_cli.models import resolve_source

    location, local = resolve_source("embedded")
    assert local
    light = LightTokenizer.load(Path(location))
    assert light is not None
    assert_same(light, transformers_tokenizer(Path(location)))


def byte_tokenizer(kind: str):
    """A small tokenizer whose pieces can hold part of a character: "byte-level" (a BPE over GPT-2's
    byte alphabet, as SmolLM's and Llama 3's) or "byte-fallback" (a BPE that spells what its vocabulary
    lacks as <0xNN> pieces, as Llama 2's and Mistral's); transformers' generic fast tokenizer over it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["hello world, café", "the wave and a smile", "naïve"] * 3  # (emoji and kanji: byte by byte)
    if kind == "byte-level":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    else:
        vocab = {"</s>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
        vocab |= {c: len(vocab) + i for i, c in enumerate(sorted(set("".join(corpus))))}
        tok = Tokenizer(models.BPE(vocab, [], byte_fallback=True))
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


@pytest.mark.parametrize("kind", ["byte-level", "byte-fallback"])
def test_a_token_that_holds_part_of_a_character_has_its_own_bytes(kind, tmp_path):
    """`rsd tokenize "👋"` listed the embedded tokenizer's pieces as "�" three times (and --json, --logprobs
    and inspect-tree said the same): a token's text alone cannot hold part of a character. Its bytes
    can: the tokens' bytes, one after another, are the text's UTF-8, with transformers' tokenizer and
    the light one alike, and a reader sees them as \\xNN."""
    from rsd_cli.prompting import token_bytes, token_text_shown
    from rsd_cli.render import token_label

    reference = byte_tokenizer(kind)
    reference.save_pretrained(tmp_path)
    light = LightTokenizer.load(tmp_path)
    assert light is not None
    for tokenizer in (reference, light):
        for text in ("hello 👋 world", "café 東京 🙂", "naïve"):
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert any("\ufffd" in tokenizer.decode([token]) for token in ids) or text == "naïve"
            assert b"".join(token_bytes(tokenizer, token) for token in ids) == text.encode("utf-8"), (kind, text)
        ids = tokenizer.encode("👋", add_special_tokens=False)
        shown = "".join(token_text_shown(tokenizer, token)[1:-1] for token in ids)
        assert shown == "\\xf0\\x9f\\x91\\x8b", shown
        assert "".join(token_label(tokenizer, token)[1:-1] for token in ids) == "\\xf0\\x9f\\x91\\x8b"
        whole = tokenizer.encode("h", add_special_tokens=False)[0]  # (a whole character: as before)
        assert token_text_shown(tokenizer, whole) == '"h"' and token_label(tokenizer, whole) == "'h'"


def test_bytes_are_quoted_as_text_with_each_stray_byte_escaped():
    from rsd_cli.prompting import quoted_bytes

    assert quoted_bytes(b" \xf0\x9f") == '" \\xf0\\x9f"'
    assert quoted_bytes(b'"\n\xf0') == '"\\"\\n\\xf0"'  # (json.dumps' quoting of the text around the byte)
    assert quoted_bytes(b"it's \xe6\x9d", "repr") == "'it\\'s \\xe6\\x9d'"  # (repr's, the quote escaped)
    assert quoted_bytes("é\\".encode() + b"\x80", "repr") == "'é\\\\\\x80'"


def test_rsd_tokenize_shows_and_gives_the_bytes_of_a_partial_character(tiny_pair_dir, tmp_path):
    import shutil

    from typer.testing import CliRunner

    from rsd_cli.cli import app

    folder = tmp_path / "model"
    byte_tokenizer("byte-level").save_pretrained(folder)
    shutil.copy(tiny_pair_dir / "target" / "config.json", folder)  # (tokenize reads the tokenizer alone)
    profile = tmp_path / "bytes.toml"
    profile.write_text(f'[target]\nsource = "{folder}"\n')
    shown = CliRunner().invoke(app, ["tokenize", "a 👋", "-p", str(profile)])
    assert shown.exit_code == 0, shown.stderr
    assert [line.split("\t")[1] for line in shown.stdout.splitlines()] == \
        ['"a"', '" "', '"\\xf0"', '"\\x9f"', '"\\x91"', '"\\x8b"'], shown.stdout  # ("�" four times before)
    listed = json.loads(CliRunner().invoke(app, ["tokenize", "a 👋", "-p", str(profile), "--json"]).stdout)
    assert [entry["bytes"] for entry in listed["tokens"]] == [[97], [32], [240], [159], [145], [139]]
    assert listed["tokens"][2]["text"] == "\ufffd"  # (the text as the tokenizer decodes it, unchanged)
