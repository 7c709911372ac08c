"""Tiny random models and a character tokenizer, built in temp dirs so tests stay fast and offline."""

from __future__ import annotations

from pathlib import Path

import torch

CHARS = list("abcdefghijklmnopqrstuvwxyz .,!?'\n")
SPECIALS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def tiny_config(vocab: int = 40, layers: int = 2, seed_scale: float = 0.02, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=seed_scale, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, **extra,
    )


def tiny_model(vocab: int = 40, layers: int = 2, seed: int = 0, scale: float = 0.02):
    """A random Llama; larger `scale` gives peakier next-token distributions."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(vocab, layers, scale))
    if scale > 0.1:
        with torch.no_grad():
            model.lm_head.weight.mul_(3.0)
    return model.eval()


def tiny_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_pair(root: Path, vocab: int = 40) -> tuple[Path, Path]:
    """A target (3 layers) and a separate draft (1 layer) sharing one tokenizer."""
    target_dir, draft_dir = root / "target", root / "draft"
    tokenizer = tiny_tokenizer()
    for path, layers, seed in ((target_dir, 3, 0), (draft_dir, 1, 1)):
        tiny_model(vocab, layers, seed, scale=0.3).save_pretrained(path)
        tokenizer.save_pretrained(path)
    return target_dir, draft_dir
