"""A sliding-window model or a mixture of experts on the static-cache runtime against transformers' eager forward: tokens
per second of `rsd generate` with `--compile auto` and `off`, alternating, and whether both give
the same greedy tokens.

`--family mistral` (the default): a model windowed on every layer (Mistral 7B v0.1's kind), of the
embedded target's shape (SmolLM2-135M: 30 layers, hidden 576, 9 heads, 3 key-value heads).
`--family gemma3`: Gemma 3 270M's shape (18 layers, hidden 640, 4 heads of 256, 1 key-value head,
five windowed layers to one of full attention, norms after attention and the MLP), with the
embedded model's 49152-token vocabulary instead of its 262144.
`--family qwen3_moe`: a Qwen3-MoE of the embedded target's width (hidden 576, 9 heads of 64, 3
key-value heads) and 12 layers, each an MLP of 16 experts of 256, 4 a token (no window).
`--family mixtral`: a Mixtral as wide, 12 layers windowed, 8 experts of 768, 2 a token.
`--family gpt_oss`: a gpt-oss as wide and deep as the Qwen3-MoE, 16 experts of 256, 4 a token,
every other layer windowed (gpt-oss's attention sinks, biases, clamped experts and YaRN angles).
`--family opt`: OPT-125m's shape (12 layers, hidden 768, 12 heads, 3072-wide ReLU MLPs, learned
positions, a 50272-token vocabulary; no window), the RSD paper's draft model, its draft a 2-layer
OPT as wide (OPT has no early-exit draft).
`--family gpt2`: GPT-2's shape (12 layers, hidden 768, 12 heads, Conv1D linears, learned positions,
a 50257-token vocabulary), its draft a 2-layer GPT-2 as wide (distilgpt2's width).
`--family gemma4`: Gemma 3 270M's shape as Gemma 4 lays it out (18 layers, five windowed to one of
full attention, whose heads are 512 wide, a quarter of them turned; the last 6 layers reading the
caches of earlier ones, their MLPs twice as wide; per-layer inputs 32 wide), its draft a 4-layer
Gemma 4 as wide (Gemma 4 has no early-exit draft).
`--family gemma3n`: Gemma 3n E2B's layout at Gemma 3 270M's width (12 layers, four windowed to one of
full attention, the last 4 reading the caches of earlier ones; four streams (AltUp), a learned residual
of rank 64, the first 4 layers' MLP gates cut off at their largest 5%, per-layer inputs 32 wide), its
draft a 4-layer Gemma 3n as wide (Gemma 3n has no early-exit draft).
`--family gemma4_moe`: 26B-A4B's kind at Gemma 3 270M's width, 12 layers, five windowed to one of
full attention, 16 experts of 256, 4 a token, beside each MLP (no per-layer inputs), its draft its
first 3 layers.
`--family deepseek_v3`: DeepSeek V3's kind at the embedded target's width (hidden 576, 9 heads),
12 layers of multi-head latent attention (q through a rank of 192, keys and values through a latent
of 128, 32 of each head's 96 dimensions turned by pairs), the first a plain MLP, then 16 experts of
256, 4 a token, chosen within the best 2 of 4 groups, beside a shared expert (no window); its draft
its first 3 layers.
`--family glm4`: a GLM-4 of the embedded target's shape (gate and up one linear, half of each head
turned by adjacent pairs, four norms; no window).
`--family gptj`: a GPT-J of GPT-2 small's shape (12 layers, hidden 768, 12 heads, 64 of each head's
dimensions turned by adjacent pairs, attention beside the MLP, a 50400-token vocabulary), its draft
a 2-layer GPT-J as wide.
`--family falcon`: Falcon-7B's layout (one key head, attention beside the MLP on one LayerNorm) at
that shape, its draft a 2-layer Falcon as wide.
`--family bloom`: BLOOM's layout (ALiBi position biases, 12 heads: slopes not all powers of 2, the
embedding normed) at that shape with the embedded model's vocabulary, its draft a 2-layer BLOOM as
wide. transformers' forward takes chains only from a BLOOM: a tree variant asked of `off` is
refused, and its `auto` rate is then compared with `ar`'s on `off` (`--variants ar,sd,rsd-c`).
`--family gpt_neo`: GPT-Neo 125M's shape (12 layers, hidden 768, local layers windowed to
`--window` positions beside global ones), its draft a 2-layer GPT-Neo as wide; trees as BLOOM's.
`--family llama4`: Llama 4 Scout's layout at the embedded target's width (hidden 576, 9 heads of 64, 3
key-value heads), 12 layers, every fourth without a rotation, its q scaled by position, the others in
chunks of `--window` positions, q and k normed without a weight; 16 experts of 256, 1 a token, reading
the token times its weight, beside a shared expert, on every layer; its draft its first 3 layers.
transformers' forward takes chains only from a Llama 4 (its chunks and scale go by cache slots): a
tree variant asked of `off` is refused, as BLOOM's.
`--family lfm2`: LFM2-350M's layout (16 layers, hidden 1024, short convolutions of 3 taps in
attention's place on 10 of them, attention on the others, 16 heads of 64, 8 key-value heads, MLPs
of 4608) with the embedded model's vocabulary, its draft its first 3 layers. transformers' forward
takes chains only from an LFM2 (its convolutions carry a state): a tree variant asked of `off` is
refused, as BLOOM's.
`--family qwen3_5`: a Qwen3.5 of 0.8B's layout (24 layers, hidden 1024, gated delta nets of 16 heads
of 128 with convolutions of 4 taps on three layers of four, gated attention of 8 heads of 256, 2
key-value heads, a quarter of each head turned, on the others, MLPs of 3584) with the embedded
model's vocabulary, its draft its first 4 layers. transformers' forward takes chains only (its delta
nets carry a state): a tree variant asked of `off` is refused, as BLOOM's.
`--family granite4`: Granite 4.0-H's kind at GPT-2 small's width (12 layers, hidden 768: Mamba-2 mixers
of 24 heads of 64 with states of 128 on three layers of four, attention of 12 heads, 4 key-value
heads, without positions, on the others; 16 experts of 256, 2 a token, beside a shared MLP of 1024;
Granite's multipliers) with the embedded model's vocabulary, its draft its first 4 layers.
transformers' forward takes chains only (its mixers carry a state): a tree asked of `off` is refused.
`--family nemotron_h`: Nemotron-H's kind at GPT-2 small's width (21 blocks in the pattern
"M-M-M*-" three times: 9 Mamba-2 mixers of 24 heads of 64 with states of 128, 9 MLPs of 3072 squared
ReLUs, 3 attention blocks of 12 heads, 4 key-value heads, without positions) with the embedded model's
vocabulary, its draft its first 6 blocks. transformers' forward takes plain steps alone from it: every
other variant asked of `off` is refused, and its `auto` rate is compared with `ar`'s on `off`.
`--family bamba`: Bamba's kind (IBM's Bamba 9B: Mamba-2 mixers, attention on every ninth layer) at GPT-2
small's width (12 layers, hidden 768: mixers of 24 heads of 64 with states of 128, attention on the
fourth, eighth and twelfth layers, 12 heads, 4 key-value heads, half of each head turned; gated MLPs of
2048) with the embedded model's vocabulary, its draft its first 4 layers (3 mixers, then attention).
transformers' forward takes chains only (its mixers carry a state): a tree asked of `off` is refused.
`--family mamba2`: Mamba-2's own layout (mamba2-130m's: 24 layers of mixers alone, hidden 768, 24 heads of
64 with states of 128, no attention, no MLP) with the embedded model's vocabulary, its draft its first 4
layers. transformers' forward takes chains only: a tree asked of `off` is refused.
`--family phi3_longrope`: a Phi-3 of the embedded target's shape turned by `longrope` factors,
its long ones from position `--window` on (Phi-3.5's and Phi-4-mini's kind, whose long factors
start at 4096; no window): the answer goes past that position, where rsd reads the sequence
again by the long factors.
Random float32 weights, a window of
64 positions, the embedded model's tokenizer; the prompt and answer run well past the window.
Random weights: the speeds say what the runtime costs, the tokens only that both runtimes agree.
`--repeat K`: the prompt K times over (a long context: K = 100 is ~2000 tokens), and the rates those
after the first token (reading the prompt left out).

    .venv/bin/python benchmarks/windowed_runtime.py --rounds 2 -n 96
    .venv/bin/python benchmarks/windowed_runtime.py --family gemma3 --rounds 2 -n 96
    .venv/bin/python benchmarks/windowed_runtime.py --family qwen3_moe --rounds 2 -n 64
    .venv/bin/python benchmarks/windowed_runtime.py --family phi3_longrope --rounds 2 -n 64
    .venv/bin/python benchmarks/windowed_runtime.py --family gpt_oss --rounds 2 -n 64
    .venv/bin/python benchmarks/windowed_runtime.py --family opt --rounds 2 -n 64
    .venv/bin/python benchmarks/windowed_runtime.py --family gpt2 --rounds 2 -n 64
    .venv/bin/python benchmarks/windowed_runtime.py --family gemma4 --rounds 2 -n 96
    .venv/bin/python benchmarks/windowed_runtime.py --family gemma3n --rounds 2 -n 96
    .venv/bin/python benchmarks/windowed_runtime.py --family gemma4_moe --rounds 2 -n 64
    .venv/bin/python benchmarks/windowed_runtime.py --family deepseek_v3 --rounds 2 -n 64
    .venv/bin/python benchmarks/windowed_runtime.py --family gptj --rounds 2 -n 64
    .venv/bin/python benchmarks/windowed_runtime.py --family falcon --rounds 2 -n 64
    .venv/bin/python benchmarks/windowed_runtime.py --family bloom --rounds 2 -n 64 --variants ar,sd,rsd-c
    .venv/bin/python benchmarks/windowed_runtime.py --family gpt_neo --rounds 2 -n 96 --variants ar,sd,rsd-c
    .venv/bin/python benchmarks/windowed_runtime.py --family llama4 --rounds 2 -n 96 --variants ar,sd,rsd-c
    .venv/bin/python benchmarks/windowed_runtime.py --family lfm2 --rounds 2 -n 64 --variants ar,sd,rsd-c
    .venv/bin/python benchmarks/windowed_runtime.py --family qwen3_5 --rounds 2 -n 48 --variants ar,sd,rsd-c
    .venv/bin/python benchmarks/windowed_runtime.py --family granite4 --rounds 2 -n 64 --variants ar,sd,rsd-c
    .venv/bin/python benchmarks/windowed_runtime.py --family qwen3_5 --rounds 2 -n 64 --variants ar,sd --repeat 100
    .venv/bin/python benchmarks/windowed_runtime.py --family nemotron_h --rounds 2 -n 64 --variants ar,sd,rsd-c
    .venv/bin/python benchmarks/windowed_runtime.py --family bamba --rounds 2 -n 64 --variants ar,sd,rsd-c
    .venv/bin/python benchmarks/windowed_runtime.py --family mamba2 --rounds 2 -n 64 --variants ar,sd,rsd-c
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPT = "Write a long story about a robot who learns to paint, with many details about colours and brushes."


def make_model(folder: Path, window: int, family: str = "mistral") -> Path:
    import torch
    from transformers import (BloomConfig, BloomForCausalLM, FalconConfig, FalconForCausalLM, GPTJConfig,
                              GPTJForCausalLM, GPTNeoConfig, GPTNeoForCausalLM,
                              DeepseekV3Config, DeepseekV3ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig,
                              Gemma3nForCausalLM, Gemma3nTextConfig, Gemma4ForCausalLM, Gemma4TextConfig,
                              Glm4Config, Lfm2Config, Lfm2ForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig,
                              GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, Llama4ForCausalLM, Llama4TextConfig,
                              NemotronHConfig, NemotronHForCausalLM, BambaConfig, BambaForCausalLM, Mamba2Config,
                              Mamba2ForCausalLM,
                              Glm4ForCausalLM, GptOssConfig,
                              GptOssForCausalLM, GPT2Config, GPT2LMHeadModel, MistralConfig, OPTConfig,
                              OPTForCausalLM,
                              MistralForCausalLM, MixtralConfig, MixtralForCausalLM, Phi3Config, Phi3ForCausalLM,
                              Qwen3MoeConfig, Qwen3MoeForCausalLM)

    from rsd_cli.models import resolve_source

    # the embedded target's shape (SmolLM2-135M), which the dense families here take
    embedded = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    if family == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(
            vocab_size=49152, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
            num_key_value_heads=1, head_dim=256, max_position_embeddings=8192, sliding_window=window,
            query_pre_attn_scalar=256, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    elif family == "gemma4":
        model = Gemma4ForCausalLM(Gemma4TextConfig(
            vocab_size=49152, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
            num_key_value_heads=1, head_dim=256, global_head_dim=512, max_position_embeddings=8192,
            sliding_window=window, num_kv_shared_layers=6, use_double_wide_mlp=True, hidden_size_per_layer_input=32,
            vocab_size_per_layer_input=49152, final_logit_softcapping=30.0, tie_word_embeddings=True,
            bos_token_id=1, eos_token_id=2, pad_token_id=0))
    elif family == "gemma3n":
        types = (["sliding_attention"] * 4 + ["full_attention"]) * 2 + ["sliding_attention", "full_attention"]
        model = Gemma3nForCausalLM(Gemma3nTextConfig(
            vocab_size=49152, hidden_size=640, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=4,
            num_key_value_heads=1, head_dim=256, max_position_embeddings=8192, sliding_window=window,
            layer_types=types, num_kv_shared_layers=4, hidden_size_per_layer_input=32,
            vocab_size_per_layer_input=49152, laurel_rank=64, activation_sparsity_pattern=[0.95] * 4 + [0.0] * 8,
            tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0))
        with torch.no_grad():  # (each layer's corrected stream scaled: transformers starts the scale at 0)
            for layer in model.model.layers:
                layer.altup.correct_output_scale.fill_(1.0)
    elif family == "gemma4_moe":
        model = Gemma4ForCausalLM(Gemma4TextConfig(
            vocab_size=49152, hidden_size=640, intermediate_size=1024, num_hidden_layers=12, num_attention_heads=4,
            num_key_value_heads=1, head_dim=256, global_head_dim=512, max_position_embeddings=8192,
            sliding_window=window, hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=16,
            top_k_experts=4, moe_intermediate_size=256, final_logit_softcapping=30.0, tie_word_embeddings=True,
            bos_token_id=1, eos_token_id=2, pad_token_id=0))
    elif family == "deepseek_v3":
        model = DeepseekV3ForCausalLM(DeepseekV3Config(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=9,
            num_key_value_heads=9, q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
            v_head_dim=64, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
            moe_intermediate_size=256, first_k_dense_replace=1, max_position_embeddings=8192,
            tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    elif family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            vocab_size=49152, hidden_size=576, moe_intermediate_size=256, num_hidden_layers=12, num_attention_heads=9,
            num_key_value_heads=3, head_dim=64, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
            max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5))
    elif family == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=768, num_hidden_layers=12, num_attention_heads=9,
            num_key_value_heads=3, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=8192,
            sliding_window=window, tie_word_embeddings=True, rms_norm_eps=1e-5))
    elif family == "gpt_oss":  # (its sinks and biases random: transformers starts the biases at 0)
        model = GptOssForCausalLM(GptOssConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=256, num_hidden_layers=12, num_attention_heads=9,
            num_key_value_heads=3, head_dim=64, num_local_experts=16, num_experts_per_tok=4, sliding_window=window,
            layer_types=["sliding_attention", "full_attention"] * 6, max_position_embeddings=8192,
            tie_word_embeddings=True, rms_norm_eps=1e-5, attn_implementation="eager"))
        with torch.no_grad():
            for name, weight in model.named_parameters():
                if name.endswith(("sinks", "bias")):
                    weight.normal_(0.0, 0.02)
    elif family == "opt":
        model = OPTForCausalLM(OPTConfig(vocab_size=50272, hidden_size=768, num_hidden_layers=12, ffn_dim=3072,
                                         num_attention_heads=12, max_position_embeddings=2048, pad_token_id=1,
                                         bos_token_id=2, eos_token_id=2))
    elif family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config())  # (GPT-2 small's defaults)
    elif family == "gptj":
        model = GPTJForCausalLM(GPTJConfig(vocab_size=50400, n_embd=768, n_layer=12, n_head=12, rotary_dim=64,
                                           n_positions=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    elif family == "falcon":
        model = FalconForCausalLM(FalconConfig(vocab_size=65024, hidden_size=768, num_hidden_layers=12,
                                               num_attention_heads=12, multi_query=True, parallel_attn=True,
                                               bos_token_id=1, eos_token_id=2, pad_token_id=0))
    elif family == "bloom":
        model = BloomForCausalLM(BloomConfig(vocab_size=49152, hidden_size=768, n_layer=12, n_head=12,
                                             bos_token_id=1, eos_token_id=2, pad_token_id=0))
    elif family == "gpt_neo":
        model = GPTNeoForCausalLM(GPTNeoConfig(vocab_size=50257, hidden_size=768, num_layers=12, num_heads=12,
                                               attention_types=[[["global", "local"], 6]], window_size=window,
                                               max_position_embeddings=2048, bos_token_id=1, eos_token_id=2))
    elif family == "llama4":  # (floor_scale as the chunks: the scale changes within the answer)
        model = Llama4ForCausalLM(Llama4TextConfig(
            **{**embedded, "intermediate_size": 256, "num_hidden_layers": 12}, intermediate_size_mlp=1536, head_dim=64,
            num_local_experts=16, num_experts_per_tok=1, attention_chunk_size=window, floor_scale=window,
            pad_token_id=0, bos_token_id=1, eos_token_id=2))
    elif family == "lfm2":  # (LFM2-350M's layer kinds; its MLP's 6656 adjusted to 2/3, a multiple of 256: 4608)
        kinds = ["conv", "conv", "full_attention"] * 3 + ["conv", "full_attention"] * 3 + ["conv"]
        model = Lfm2ForCausalLM(Lfm2Config(
            vocab_size=49152, hidden_size=1024, intermediate_size=6656, num_hidden_layers=16, num_attention_heads=16,
            num_key_value_heads=8, layer_types=kinds, max_position_embeddings=8192, tie_word_embeddings=True,
            bos_token_id=1, eos_token_id=2, pad_token_id=0))
    elif family == "qwen3_5":
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(
            vocab_size=49152, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
            num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
            linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=8192,
            tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    elif family == "granite4":
        model = GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
            vocab_size=49152, hidden_size=768, intermediate_size=256, num_hidden_layers=12, num_attention_heads=12,
            num_key_value_heads=4, layer_types=(["mamba"] * 3 + ["attention"]) * 3, mamba_n_heads=24, mamba_d_head=64,
            mamba_d_state=128, mamba_n_groups=1, num_local_experts=16, num_experts_per_tok=2,
            shared_intermediate_size=1024, position_embedding_type=None, embedding_multiplier=12.0,
            residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=6.0, max_position_embeddings=8192,
            tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    elif family == "nemotron_h":
        kinds = {"M": "linear_attention", "-": "mlp", "*": "full_attention"}
        model = NemotronHForCausalLM(NemotronHConfig(
            vocab_size=49152, hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_key_value_heads=4,
            head_dim=64, layers_block_type=[kinds[c] for c in "M-M-M*-" * 3], mamba_num_heads=24, mamba_head_dim=64,
            n_groups=1, ssm_state_size=128, max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
            eos_token_id=2, pad_token_id=0))
    elif family == "bamba":
        model = BambaForCausalLM(BambaConfig(
            vocab_size=49152, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
            num_key_value_heads=4, attn_layer_indices=[3, 7, 11], mamba_n_heads=24, mamba_d_head=64, mamba_d_state=128,
            mamba_n_groups=1, max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
            pad_token_id=0))
    elif family == "mamba2":
        model = Mamba2ForCausalLM(Mamba2Config(
            vocab_size=49152, hidden_size=768, num_hidden_layers=24, num_heads=24, head_dim=64, state_size=128,
            n_groups=1, expand=2, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    elif family == "glm4":
        model = Glm4ForCausalLM(Glm4Config(**embedded, head_dim=64, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    elif family == "phi3_longrope":  # (32 factors each: one per pair of a head's 64 dimensions)
        rope = dict(rope_type="longrope", rope_theta=10000.0, factor=8192 / window,
                    original_max_position_embeddings=window, short_factor=[1.0 + i / 16 for i in range(32)],
                    long_factor=[1.0 + i for i in range(32)])
        model = Phi3ForCausalLM(Phi3Config(**embedded, original_max_position_embeddings=window, rope_parameters=rope,
                                           sliding_window=None, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    else:
        model = MistralForCausalLM(MistralConfig(**embedded, sliding_window=window))
    models = {"target": model}
    if family in ("opt", "gpt2", "gptj", "falcon", "bloom"):  # (a separate draft: no early exit for them)
        models["draft"] = type(model)(type(model.config)(**{**model.config.to_dict(), "num_hidden_layers": 2}))
    elif family == "gpt_neo":
        models["draft"] = type(model)(type(model.config)(**{**model.config.to_dict(), "num_layers": 2,
                                                            "attention_types": [[["global", "local"], 1]],
                                                            "attention_layers": ["global", "local"]}))
    elif family == "gemma4":  # (its windowed and full-attention layers in turn, the last full; none reading others')
        settings = {**model.config.to_dict(), "num_hidden_layers": 4, "num_kv_shared_layers": 0,
                    "layer_types": ["sliding_attention", "full_attention"] * 2}
        settings.pop("per_layer_config", None)
        models["draft"] = type(model)(type(model.config)(**settings, global_head_dim=512))
    elif family == "gemma3n":  # (four windowed layers, then one of full attention; none reading others')
        settings = {**model.config.to_dict(), "num_hidden_layers": 4, "num_kv_shared_layers": 0,
                    "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
                    "activation_sparsity_pattern": [0.95] * 4}
        settings.pop("kv_sharing_modes", None)
        settings.pop("intermediate_size", None)
        models["draft"] = type(model)(type(model.config)(**settings, intermediate_size=2048))
    embedded = Path(resolve_source("embedded")[0])
    for role, each in models.items():
        each.save_pretrained(folder / role)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (embedded / name).exists():
                shutil.copy(embedded / name, folder / role / name)
    profile = folder / "windowed.toml"
    # (their first attention layer: their fourth; Nemotron-H's first attention block: its sixth)
    layers = 6 if family == "nemotron_h" else 4 if family in ("qwen3_5", "granite4", "bamba", "mamba2") else 3
    draft = f'kind = "model"\nsource = "{folder / "draft"}"' if "draft" in models else f'layers = {layers}\nadapter = ""'
    profile.write_text(f'[target]\nsource = "{folder / "target"}"\n[draft]\n{draft}\n')
    return profile


def run(profile: Path, compile: str, variant: str, tokens: int, repeat: int = 1) -> dict | None:
    """`rsd generate`'s record, or None where the variant is refused (a tree asked of transformers'
    forward for a BLOOM)."""
    prompt = " ".join([PROMPT] * repeat)
    result = subprocess.run([sys.executable, "-m", "rsd_cli", "generate", prompt, "-p", str(profile), "-n", str(tokens),
                             "-t", "0", "--ignore-eos", "-v", variant, "--compile", compile, "--json"],
                            capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if result.returncode == 1 and ("verifies a tree" in result.stderr or "verifies drafts" in result.stderr):
        return None
    result.check_returncode()
    return json.loads(result.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("-n", type=int, default=96)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--variants", default="ar,sd")
    parser.add_argument("--repeat", type=int, default=1, help="the prompt this many times over")
    parser.add_argument("--family", choices=("mistral", "gemma3", "gemma4", "gemma4_moe", "deepseek_v3", "qwen3_moe",
                                             "mixtral", "gpt_oss", "opt", "gpt2", "glm4", "phi3_longrope", "gptj",
                                             "falcon", "bloom", "gpt_neo", "gemma3n", "llama4", "lfm2",
                                             "qwen3_5", "granite4", "nemotron_h", "bamba", "mamba2"),
                        default="mistral")
    args = parser.parse_args()
    past = {"qwen3_moe": "", "glm4": "", "deepseek_v3": "", "opt": "", "gpt2": "", "gptj": "", "falcon": "",
            "bloom": "", "lfm2": "", "qwen3_5": "", "granite4": "", "nemotron_h": "", "bamba": "", "mamba2": "",
            "llama4": f" across chunks of {args.window}",
            "phi3_longrope": f" past position {args.window}, the long factors' start"}
    with tempfile.TemporaryDirectory() as tmp:
        profile = make_model(Path(tmp), args.window, args.family)
        rate = "tokens_per_second" if args.repeat == 1 else "tokens_per_second_after_first"
        plain_off: tuple | None = None  # (`ar`'s rates and answer on `off`: what a refused variant is compared with)
        for variant in args.variants.split(","):
            rates: dict[str, list[float]] = {"off": [], "auto": []}
            answers = {}
            for _ in range(args.rounds):
                for compile in ("off", "auto"):  # (alternating: this machine's pace drifts)
                    record = run(profile, compile, variant, args.n, args.repeat)
                    if record is None:  # (refused on transformers' forward: `ar` there instead)
                        continue
                    rates[compile].append(record["stats"][rate])
                    answers[compile] = (record["token_ids"], record["runtime"], record["prompt_tokens"])
            if variant == "ar":
                plain_off = rates["off"], answers["off"]
            if not rates["off"] and plain_off is not None:
                rates["off"], answers["off"] = plain_off[0], (plain_off[1][0], "refused: ar's there",
                                                              plain_off[1][2])
            same = answers["off"][0] == answers["auto"][0]
            ratio = sum(rates["auto"]) / sum(rates["off"])
            print(f"{variant}: off ({answers['off'][1]}) {', '.join(f'{r:.1f}' for r in rates['off'])} tok/s; "
                  f"auto ({answers['auto'][1]}) {', '.join(f'{r:.1f}' for r in rates['auto'])} tok/s; "
                  f"{ratio:.2f}x; prompt {answers['auto'][2]} + {args.n} tokens"
                  f"{' (after the first)' if args.repeat > 1 else ''}"
                  f"{past.get(args.family, f' past a window of {args.window}')}; "
                  f"same tokens: {same}")


if __name__ == "__main__":
    main()
