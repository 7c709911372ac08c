"""Tiny random models and a character tokenizer, built in temp dirs so tests stay fast and offline."""

from __future__ import annotations

from pathlib import Path

import torch

from rsd_cli.compiled import attention_of, decoder_of, layers_of

CHARS = list("abcdefghijklmnopqrstuvwxyz .,!?'\n")
SPECIALS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
LONG_FACTORS_FROM = 16  # where tiny_relative("phi3-longrope") turns q and k by its long factors


def tiny_config(vocab: int = 40, layers: int = 2, seed_scale: float = 0.02, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(**{
        "vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "initializer_range": seed_scale, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 0, **extra,
    })


def tiny_model(vocab: int = 40, layers: int = 2, seed: int = 0, scale: float = 0.02):
    """A random Llama; larger `scale` gives peakier next-token distributions."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(vocab, layers, scale))
    if scale > 0.1:
        with torch.no_grad():
            model.lm_head.weight.mul_(3.0)
    return model.eval()


def tiny_relative(kind: str, vocab: int = 40, layers: int = 2, seed: int = 0, scale: float = 0.3):
    """A random model of another Llama-style family the static-cache runtime covers, as tiny_model:
    "qwen2" (biases on q, k and v, set random here so that they matter), "mistral", "qwen3" (an
    RMS norm on each head of q and k, its weights random here too), "gemma" (norms scaling by 1 +
    weight, a GELU MLP, a scaled embedding) or "gemma3" (Gemma's, with norms after attention and the
    MLP, q and k normed per head, the first layer windowed to 4 positions with its own rotary base,
    linearly scaled rotary angles on the full-attention layers, soft-capped logits) or "smollm3"
    (Llama's layers, every other one without a rotation here), "olmo2" (norms after attention and the
    MLP only, q and k normed as a whole), "olmo3" (OLMo 2's, the first layer windowed to 4 positions with
    a rotary table of its own), "seed_oss" (Llama's, biases on q, k and v), "granite" (Llama's, its embedding,
    blocks' outputs, attention scores and logits scaled by constants), "gemma2" (Gemma 3's norms, every
    other layer windowed to 4 positions, attention scores soft-capped), "phi3" (q, k and v one
    linear, gate and up one linear, every layer windowed to 4 positions) or "phi3-longrope" (Phi-3's
    without a window, 3/4 of each head turned by `longrope`, its long factors from position
    LONG_FACTORS_FROM) or "exaone4" (OLMo 2's norms, q and k normed per head, the first layer
    windowed to 4 positions, the others without a rotation)
    "ernie4_5" (q and k turned by adjacent pairs of dimensions), "hunyuan" (Hunyuan's dense models:
    each head of q and k normed after the rotation, its base scaled by a fixed NTK alpha), "glm4"
    (biases on q, k and v, gate and up one linear, norms after attention and the MLP too, half of
    each head turned by adjacent pairs), "cohere2" (LayerNorms without a bias, attention and the
    MLP side by side on one norm's output, adjacent pairs turned on the windowed first layer only,
    logits scaled) or "cohere" (Cohere 2's layers, every one turned, in float32, none windowed), or
    a mixture of experts: "mixtral" (Mistral's layers, every one windowed to 4 positions, MLPs of 4
    experts, 2 a token, routing weights renormalised, in float32), "qwen2_moe" (Qwen2's attention,
    4 experts, 2 a token, weights as the router gave them, a shared expert behind a sigmoid gate;
    the second layer a plain MLP), "qwen3_moe" (Qwen3's attention, 8 experts, 3 a token,
    renormalised), "olmoe" (q and k normed whole, 4 experts, 2 a token), "granitemoe" (Granite's
    scalings, 4 experts, 2 a token weighted by a softmax of their router logits),
    "granitemoeshared" (GraniteMoE's, a shared expert without a gate), "gpt_oss" (attention sinks,
    biases on every linear, the router and the experts, every other layer windowed to 4 positions,
    YaRN angles from position 64, 4 experts, 2 a token, their gate clamped at 1.5 so that the clamp
    matters) or "ernie4_5_moe" (ERNIE 4.5's attention, 4 experts, 2 a token, chosen with a random
    correction, a shared expert; the first layer a plain MLP) or "phimoe" (LayerNorms, biases on q, k,
    v, o and the head, every layer windowed to 4 positions, 2 of 4 experts chosen by its sparse mixer,
    its jitter 0.3); "apertus" (q and k normed per head, an MLP without a gate of xIELUs, each layer's
    constants random); or with LayerNorms (a bias
    each, random here) or MLPs without a gate: "starcoder2" (both, biases on every linear, a GELU,
    every layer windowed to 4 positions), "stablelm" (LayerNorms, Llama's MLP, biases on q, k and v,
    a quarter of each head turned), "nemotron" (LayerNorms by 1 + weight, an MLP without a gate of
    squared ReLUs, half of each head turned), "arcee" (Llama's layers, Nemotron's MLP) or "phi" (one
    LayerNorm read by attention and an MLP without a gate side by side, biases on every linear and
    the head, a GELU by formula, half of each head turned) or "gptj" (GPT-J: Phi's layers without
    biases on attention, half of each head turned by adjacent pairs, every head its own keys) or
    "gpt_neox" (GPT-NeoX, Pythia: q, k and v one linear head by head, attention and an MLP without a
    gate side by side on two LayerNorms, a quarter of each head turned, every head its own keys) or
    "falcon" (40B's layout: q, k and v one linear by groups of 2 heads, GPT-NeoX's layers, biases),
    "falcon-7b" (one key head, one LayerNorm read by attention and the MLP) or "falcon-sequential"
    (Falcon-RW's layout without its ALiBi: head by head, attention then the MLP, biases) or "falcon-rw"
    (with it); or with ALiBi position biases of 12 heads: "bloom" (its embedding normed, q, k and v
    head by head, biases) or "mpt" (q's rows, k's, v's; no biases); or with learned positions instead
    of rotary angles, LayerNorms and biases on every linear (random): "opt" (ReLUs, positions from row
    2), "gpt2" (Conv1D linears, q, k and v one, a GELU by formula), "gpt_bigcode" (StarCoder 1: one
    key head) or "gpt_bigcode-mha" (q, k and v head by head), "gpt_neo" (GPT-2's layers on linears,
    attention unscaled, local layers windowed to 4 positions beside global ones); "gemma4" (windowed
    and full-attention layers in turn, the full ones' heads wider with one key head, the last layers
    reading earlier ones' caches, per-layer inputs, random layer scalars) or "gemma4-moe" (26B-A4B's kind: experts
    beside each MLP, the router's and each expert's scales random); or with multi-head latent
    attention: "minicpm3", "youtu", "deepseek_v3" and "glm4_moe_lite" (experts chosen within the best
    groups, a random correction) or "deepseek_v2"; or "lfm2" (short convolutions with biases in attention's
    place on every other layer, attention between them) or "lfm2_moe" (with experts from its second layer on);
    "qwen3_5" (gated delta nets on every other layer, gated attention between them) or "qwen3_5_moe" (with
    experts) or "qwen3_next" (with experts, its delta nets' products fused); "granite4" (Mamba-2 mixers on every
    other layer, attention between them without positions, experts beside a shared MLP) or "granite4-dense" (the
    shared MLP alone, attention turned); "nemotron_h" (`layers` of Nemotron-H's blocks: a Mamba-2 mixer's, an
    MLP's, attention's without positions, a mixer's, an MLP's, ... — so its third block's attention and
    fourth's mixer without an MLP after them); "bamba" (Granite 4's mixers on every other layer, attention
    between them with half of each head turned, a gated MLP in every layer); "mamba2" (Mamba-2's mixers
alone: no attention, no MLP); with sliding-window attention off (but Gemma 2, 3
    and 4's, Phi-3's, EXAONE 4's, Mixtral's and gpt-oss's). Every norm's weight is random."""
    from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, GemmaConfig,
                              GemmaForCausalLM, MistralConfig,
                              MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                              SmolLM3Config, SmolLM3ForCausalLM, GraniteConfig, GraniteForCausalLM, Olmo2Config,
                              Olmo2ForCausalLM, Olmo3Config, Olmo3ForCausalLM, Phi3Config, Phi3ForCausalLM,
                              SeedOssConfig, SeedOssForCausalLM, Exaone4Config, Exaone4ForCausalLM, Ernie4_5Config,
                              Ernie4_5ForCausalLM, HunYuanDenseV1Config, HunYuanDenseV1ForCausalLM, Glm4Config,
                              Glm4ForCausalLM, Cohere2Config, Cohere2ForCausalLM, CohereConfig, CohereForCausalLM,
                              MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM, OlmoeConfig, OlmoeForCausalLM, GraniteMoeConfig,
                              GraniteMoeForCausalLM, GraniteMoeSharedConfig, GraniteMoeSharedForCausalLM,
                              Starcoder2Config, Starcoder2ForCausalLM, StableLmConfig, StableLmForCausalLM,
                              NemotronConfig, NemotronForCausalLM, ArceeConfig, ArceeForCausalLM, PhiConfig,
                              PhiForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM, GptOssConfig, GptOssForCausalLM,
                              ApertusConfig, ApertusForCausalLM, OPTConfig, OPTForCausalLM,
                              GPT2Config, GPT2LMHeadModel, GPTBigCodeConfig, GPTBigCodeForCausalLM,
                              Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM, PhimoeConfig, PhimoeForCausalLM,
                              Gemma4TextConfig, Gemma4ForCausalLM, MiniCPM3Config, MiniCPM3ForCausalLM, YoutuConfig,
                              YoutuForCausalLM, DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config,
                              DeepseekV3ForCausalLM, Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM, GPTJConfig,
                              GPTJForCausalLM, FalconConfig, FalconForCausalLM, BloomConfig, BloomForCausalLM,
                              MptConfig, MptForCausalLM, GPTNeoConfig, GPTNeoForCausalLM, Gemma3nTextConfig,
                              Gemma3nForCausalLM, Llama4TextConfig, Llama4ForCausalLM, Lfm2Config, Lfm2ForCausalLM,
                              Lfm2MoeConfig, Lfm2MoeForCausalLM, Qwen3_5TextConfig, Qwen3_5ForCausalLM,
                              Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM,
                              GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, NemotronHConfig,
                              NemotronHForCausalLM, BambaConfig, BambaForCausalLM, Mamba2Config, Mamba2ForCausalLM)

    config, model_class = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
                           "qwen3": (Qwen3Config, Qwen3ForCausalLM), "gemma": (GemmaConfig, GemmaForCausalLM),
                           "gemma2": (Gemma2Config, Gemma2ForCausalLM), "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
                           "smollm3": (SmolLM3Config, SmolLM3ForCausalLM),
                           "granite": (GraniteConfig, GraniteForCausalLM), "olmo2": (Olmo2Config, Olmo2ForCausalLM),
                           "olmo3": (Olmo3Config, Olmo3ForCausalLM),
                           "seed_oss": (SeedOssConfig, SeedOssForCausalLM), "phi3": (Phi3Config, Phi3ForCausalLM),
                           "phi3-longrope": (Phi3Config, Phi3ForCausalLM),
                           "exaone4": (Exaone4Config, Exaone4ForCausalLM),
                           "ernie4_5": (Ernie4_5Config, Ernie4_5ForCausalLM),
                           "hunyuan": (HunYuanDenseV1Config, HunYuanDenseV1ForCausalLM),
                           "glm4": (Glm4Config, Glm4ForCausalLM), "cohere2": (Cohere2Config, Cohere2ForCausalLM),
                           "cohere": (CohereConfig, CohereForCausalLM), "mixtral": (MixtralConfig, MixtralForCausalLM),
                           "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
                           "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM), "olmoe": (OlmoeConfig, OlmoeForCausalLM),
                           "granitemoe": (GraniteMoeConfig, GraniteMoeForCausalLM),
                           "granitemoeshared": (GraniteMoeSharedConfig, GraniteMoeSharedForCausalLM),
                           "starcoder2": (Starcoder2Config, Starcoder2ForCausalLM),
                           "stablelm": (StableLmConfig, StableLmForCausalLM),
                           "nemotron": (NemotronConfig, NemotronForCausalLM), "arcee": (ArceeConfig, ArceeForCausalLM),
                           "phi": (PhiConfig, PhiForCausalLM), "gpt_neox": (GPTNeoXConfig, GPTNeoXForCausalLM),
                           "gpt_oss": (GptOssConfig, GptOssForCausalLM), "apertus": (ApertusConfig, ApertusForCausalLM),
                           "opt": (OPTConfig, OPTForCausalLM), "gpt2": (GPT2Config, GPT2LMHeadModel),
                           "gpt_bigcode": (GPTBigCodeConfig, GPTBigCodeForCausalLM),
                           "gpt_bigcode-mha": (GPTBigCodeConfig, GPTBigCodeForCausalLM),
                           "ernie4_5_moe": (Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM),
                           "phimoe": (PhimoeConfig, PhimoeForCausalLM),
                           "gemma4": (Gemma4TextConfig, Gemma4ForCausalLM),
                           "gemma4-moe": (Gemma4TextConfig, Gemma4ForCausalLM),
                           "gemma3n": (Gemma3nTextConfig, Gemma3nForCausalLM),
                           "llama4": (Llama4TextConfig, Llama4ForCausalLM),
                           "minicpm3": (MiniCPM3Config, MiniCPM3ForCausalLM), "youtu": (YoutuConfig, YoutuForCausalLM),
                           "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM),
                           "deepseek_v2": (DeepseekV2Config, DeepseekV2ForCausalLM),
                           "glm4_moe_lite": (Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM),
                           "gptj": (GPTJConfig, GPTJForCausalLM), "falcon": (FalconConfig, FalconForCausalLM),
                           "falcon-7b": (FalconConfig, FalconForCausalLM),
                           "falcon-sequential": (FalconConfig, FalconForCausalLM),
                           "falcon-rw": (FalconConfig, FalconForCausalLM), "bloom": (BloomConfig, BloomForCausalLM),
                           "mpt": (MptConfig, MptForCausalLM), "gpt_neo": (GPTNeoConfig, GPTNeoForCausalLM),
                           "lfm2": (Lfm2Config, Lfm2ForCausalLM), "lfm2_moe": (Lfm2MoeConfig, Lfm2MoeForCausalLM),
                           "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM),
                           "qwen3_5_moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM),
                           "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM),
                           "granite4": (GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM),
                           "granite4-dense": (GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM),
                           "nemotron_h": (NemotronHConfig, NemotronHForCausalLM),
                           "bamba": (BambaConfig, BambaForCausalLM),
                           "mamba2": (Mamba2Config, Mamba2ForCausalLM)}[kind]
    settings = dict(sliding_window=None)
    if kind == "mixtral":
        settings = dict(sliding_window=4, num_local_experts=4, num_experts_per_tok=2)
    elif kind == "qwen2_moe":
        settings = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                        shared_expert_intermediate_size=24, mlp_only_layers=[1])
    elif kind == "qwen3_moe":
        settings = dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, norm_topk_prob=True)
    elif kind == "ernie4_5_moe":  # (the first layer a plain MLP; 4 experts, 2 a token, chosen with a correction)
        settings = dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=16, moe_num_shared_experts=1,
                        moe_layer_start_index=1, moe_layer_interval=1)
    elif kind == "phimoe":  # (LayerNorms, biases on q, k, v and o, 4 experts chosen by its sparse mixer; a window)
        settings = dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=4, router_jitter_noise=0.3,
                        attention_bias=True, lm_head_bias=True)
    elif kind == "olmoe":
        settings = dict(num_experts=4, num_experts_per_tok=2)
    elif kind == "starcoder2":
        settings = dict(sliding_window=4, use_bias=True, hidden_act="gelu_pytorch_tanh")
    elif kind == "stablelm":
        settings = dict(use_qkv_bias=True, partial_rotary_factor=0.25)
    elif kind == "nemotron":
        settings = dict(partial_rotary_factor=0.5)
    elif kind == "gpt_neox":  # (its own names; every head its keys)
        settings = dict(partial_rotary_factor=0.25, attention_bias=True, use_parallel_residual=True)
    elif kind == "phi":
        settings = dict(partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0)
    elif kind == "gptj":  # (Phi's layers, half of each head turned by adjacent pairs; every head its keys)
        settings = dict(rotary_dim=4, n_inner=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    elif kind == "falcon":  # (40B's and 180B's layout: 2 key heads, attention and the MLP side by side on two norms)
        settings = dict(new_decoder_architecture=True, num_kv_heads=2, ffn_hidden_size=64, bias=True)
    elif kind == "falcon-7b":  # (one key head, attention and the MLP side by side on one norm)
        settings = dict(multi_query=True, parallel_attn=True, ffn_hidden_size=64)
    elif kind == "falcon-sequential":  # (Falcon-RW's layout without its ALiBi: every head its keys, one block after
        # the other, biases)
        settings = dict(multi_query=False, parallel_attn=False, ffn_hidden_size=64, bias=True)
    elif kind == "falcon-rw":  # (Falcon-RW: that layout with ALiBi)
        settings = dict(multi_query=False, parallel_attn=False, ffn_hidden_size=64, bias=True, alibi=True)
    elif kind == "bloom":  # (12 heads: slopes of two bases, not all powers of 2)
        settings = dict(hidden_dropout=0.0, attention_dropout=0.0)
    elif kind == "gpt_neo":  # (local and global layers in turn, the local ones windowed to 4 positions)
        settings = dict(attention_types=[[["local", "global"], layers // 2]] + [[["local"], 1]] * (layers % 2),
                        window_size=4, resid_dropout=0.0, embed_dropout=0.0, attention_dropout=0.0)
    elif kind == "mpt":  # (12 heads: slopes of a base's powers re-ordered, as MPT's are for a count not a power of 2)
        settings = dict(expansion_ratio=2, attn_config={"alibi_bias_max": 8})
    elif kind == "opt":  # (learned positions, LayerNorms, biases on every linear, ReLUs without a gate)
        settings = dict(ffn_dim=64, init_std=scale, do_layer_norm_before=True)
    elif kind == "gpt2":  # (Conv1D linears, q, k and v one; learned positions; a tanh GELU by formula)
        settings = dict(n_inner=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    elif kind.startswith("gpt_bigcode"):  # (StarCoder 1, SantaCoder: one key head; or q, k, v head by head)
        settings = dict(n_inner=64, multi_query=kind == "gpt_bigcode", activation_function="gelu_pytorch_tanh",
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    elif kind == "apertus":  # (Llama 3's angles, scaled from position 64; its xIELU's constants random)
        settings = dict(rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=4.0, low_freq_factor=1.0,
                                             high_freq_factor=4.0, original_max_position_embeddings=64))
    elif kind == "gpt_oss":  # (every other layer windowed, as gpt-oss's; YaRN angles; its sinks and biases random)
        settings = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"] * (layers // 2)
                        + ["sliding_attention"] * (layers % 2), head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                        swiglu_limit=1.5, attn_implementation="eager",
                        rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                             truncate=False, original_max_position_embeddings=64, rope_theta=10000.0))
    elif kind.startswith("granitemoe"):
        settings = dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0,
                        num_local_experts=4, num_experts_per_tok=2)
        if kind == "granitemoeshared":
            settings.update(shared_intermediate_size=24)
    elif kind == "smollm3":
        settings = dict(no_rope_layers=[int(i % 2 == 0) for i in range(layers)])  # (1: rotated)
    elif kind == "olmo3":
        settings = dict(sliding_window=4, layer_types=["sliding_attention"] + ["full_attention"] * (layers - 1))
    elif kind == "cohere":  # (every layer turned, in float32; logits scaled)
        settings = dict(logit_scale=0.5)
    elif kind == "cohere2":  # (the first layer windowed and turned, the second neither; logits scaled)
        settings = dict(sliding_window=4, layer_types=["sliding_attention"] + ["full_attention"] * (layers - 1),
                        logit_scale=0.5)
    elif kind == "hunyuan":  # (its checkpoints' rotary base: "dynamic" by name, a fixed NTK alpha)
        settings = dict(head_dim=8, rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "rope_theta": 10000.0,
                                                     "factor": 1.0})
    elif kind == "exaone4":  # (the first layer windowed, the others full attention without a rotation)
        settings = dict(sliding_window=4, layer_types=["sliding_attention"] + ["full_attention"] * (layers - 1))
    elif kind == "phi3":  # (as Phi-3-mini-4k: a window on every layer, 2047 of its 4096 positions there)
        settings = dict(sliding_window=4)
    elif kind == "phi3-longrope":  # (as Phi-3.5-mini and Phi-4-mini, 3/4 of each head turned as the latter's)
        factors = dict(short_factor=[1.0, 1.5, 3.0], long_factor=[2.0, 5.0, 11.0])  # (one per turned pair)
        rope = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                    factor=256 / LONG_FACTORS_FROM, original_max_position_embeddings=LONG_FACTORS_FROM, **factors)
        settings = dict(partial_rotary_factor=0.75, original_max_position_embeddings=LONG_FACTORS_FROM,
                        rope_parameters=rope)
    elif kind == "granite":
        settings = dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0)
    elif kind == "gemma":
        settings = dict(head_dim=8)
    elif kind == "gemma2":
        # (eager attention, as rsd loads it: transformers before 5.24 defaulted to SDPA, which drops the soft-cap)
        settings = dict(head_dim=8, sliding_window=4, attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                        query_pre_attn_scalar=16, attn_implementation="eager", layer_types=["sliding_attention", "full_attention"] * (layers // 2)
                        + ["sliding_attention"] * (layers % 2))
    elif kind == "gemma4":  # (windowed and full-attention layers in turn, the last full; from the third on, each
        # reads the cache of the last earlier layer of its kind; full attention's heads twice as wide, one key head
        # whose values are its keys' product, a quarter of each head turned; per-layer inputs; MLPs of the layers
        # reading others' caches twice as wide)
        types = (["sliding_attention", "full_attention"] * layers)[:layers]
        types[-1] = "full_attention"
        settings = dict(head_dim=8, global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True,
                        sliding_window=4, layer_types=types, num_kv_shared_layers=max(0, layers - 2),
                        use_double_wide_mlp=True, hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab,
                        final_logit_softcapping=5.0,
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                            "rope_theta": 1e6}})
    elif kind == "gemma4-moe":  # (26B-A4B's kind: 4 experts, 2 a token, beside each MLP; no per-layer inputs)
        types = (["sliding_attention", "full_attention"] * layers)[:layers]
        types[-1] = "full_attention"
        settings = dict(head_dim=8, global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True,
                        sliding_window=4, layer_types=types, hidden_size_per_layer_input=0, enable_moe_block=True,
                        num_experts=4, top_k_experts=2, moe_intermediate_size=16, final_logit_softcapping=5.0)
    elif kind == "gemma3n":  # (Gemma 4's layer kinds and shared caches, heads of 8 alike; 4 streams (AltUp), a
        # learned residual of rank 4, the first layer's MLP gate keeping its largest 5%)
        types = (["sliding_attention", "full_attention"] * layers)[:layers]
        types[-1] = "full_attention"
        settings = dict(head_dim=8, sliding_window=4, layer_types=types, num_kv_shared_layers=max(0, layers - 2),
                        hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab, laurel_rank=4,
                        altup_num_inputs=4, activation_sparsity_pattern=[0.95] + [0.0] * (layers - 1),
                        final_logit_softcapping=5.0)
    elif kind == "llama4":  # (every other layer without a rotation, its q scaled by position from position 3 on
        # (floor_scale 4); the others turned by adjacent pairs, q and k normed without a weight after it, chunks of 4;
        # every other MLP (the first, third...) 4 experts, 2 a token, reading the token times their weight, beside a
        # shared expert)
        settings = dict(head_dim=8, intermediate_size=16, intermediate_size_mlp=64, num_local_experts=4,
                        num_experts_per_tok=2, moe_layers=list(range(0, layers, 2)),
                        no_rope_layers=[int(i % 2 == 0) for i in range(layers)], attention_chunk_size=4,
                        floor_scale=4, attn_scale=0.5)
    elif kind == "lfm2":  # (short convolutions of 3 taps on the first layer and every other one after it, attention
        # between them, q and k normed per head; biases on the convolutions and their products, random here)
        settings = dict(layer_types=["conv" if i % 2 == 0 else "full_attention" for i in range(layers)], conv_bias=True,
                        block_auto_adjust_ff_dim=False)
    elif kind == "lfm2_moe":  # (LFM2's layers, from the second on 4 experts of 16, 2 a token, chosen by sigmoid scores
        # plus a random bias, renormalised and scaled)
        settings = dict(layer_types=["conv" if i % 2 == 0 else "full_attention" for i in range(layers)], conv_bias=True,
                        num_dense_layers=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                        routed_scaling_factor=1.5)
    elif kind in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):  # (gated delta nets on the first layer and every other one after it, 2 key heads and 4
        # value heads of 8, convolutions of 4 taps; attention between them, its output gated, q and k normed, half of
        # each head turned)
        settings = dict(layer_types=["linear_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                        head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                        linear_value_head_dim=8, linear_conv_kernel_dim=4,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
        if kind != "qwen3_5":  # (Qwen3.5's layers, every MLP 4 experts of 16, 2 a token, beside a shared expert
            # behind a sigmoid gate; Qwen3-Next's delta nets' products fused by key head)
            settings.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                            shared_expert_intermediate_size=32)
    elif kind.startswith("granite4"):  # (Mamba-2 mixers on the first layer and every other one after it, 4 heads of
        # 16 in 2 groups, states of 8, convolutions of 4 taps with a bias, products with biases; attention between
        # them without positions (4.0-H's), or turned ("-dense"); 4 experts of 16, 2 a token, beside a shared MLP, or
        # the shared MLP alone ("-dense"); Granite's multipliers)
        dense = kind == "granite4-dense"
        settings = dict(layer_types=["mamba" if i % 2 == 0 else "attention" for i in range(layers)], mamba_n_heads=4,
                        mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_proj_bias=True,
                        num_local_experts=0 if dense else 4, num_experts_per_tok=2, shared_intermediate_size=32,
                        position_embedding_type="rope" if dense else None, embedding_multiplier=2.0,
                        residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=2.0)
    elif kind == "nemotron_h":  # (Mamba-2 mixers of 4 heads of 16 in 2 groups, states of 8, convolutions of 4 taps
        # with a bias, products with biases; MLPs of squared ReLUs without a gate)
        cycle = ["linear_attention", "mlp", "full_attention", "linear_attention", "mlp"]
        settings = dict(layers_block_type=[cycle[i % len(cycle)] for i in range(layers)], mamba_num_heads=4,
                        mamba_head_dim=16, n_groups=2, ssm_state_size=8, conv_kernel=4, use_conv_bias=True,
                        use_bias=True, head_dim=8)
    elif kind == "bamba":  # (Granite 4's Mamba-2 mixers on the first layer and every other one after it, attention
        # between them, half of each head turned; a gated MLP after each)
        settings = dict(attn_layer_indices=list(range(1, layers, 2)), mamba_n_heads=4, mamba_d_head=16,
                        mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_proj_bias=True)
    elif kind == "mamba2":  # (Mamba-2's mixers alone, 4 heads of 16 in 2 groups, states of 8, convolutions of 4 taps
        # with a bias, products with biases)
        settings = dict(num_heads=4, head_dim=16, n_groups=2, state_size=8, expand=2, conv_kernel=4, use_bias=True,
                        use_conv_bias=True)
    elif kind == "minicpm3":  # (latent attention: q through a rank of 16, keys and values through a latent of 16,
        # 4 of each head's 12 dimensions turned; the embedding, each block's output and the logits scaled)
        settings = dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                        scale_emb=2.0, scale_depth=1.4, dim_model_base=16)
    elif kind == "youtu":  # (latent attention, q one product, the rotated part turned by adjacent pairs)
        settings = dict(q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                        rope_interleave=True)
    elif kind in ("deepseek_v3", "glm4_moe_lite"):  # (Youtu's latent attention; from the second layer on, 8
        # experts in 4 groups, 2 of them a token within the best 2 groups by sigmoid scores plus a random correction,
        # weighted by the scores renormalised and times 2.5, beside a shared expert)
        settings = dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                        rope_interleave=True, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                        n_shared_experts=1, moe_intermediate_size=16, routed_scaling_factor=2.5, norm_topk_prob=True,
                        **({"first_k_dense_replace": 1} if kind == "deepseek_v3" else {}))
    elif kind == "deepseek_v2":  # (latent attention turned as complex numbers; from the second layer on, 8 experts
        # in 4 groups, 2 of them a token by softmax scores within the group of the best one (with 2 groups the
        # best 2 would always lie there), times 2.5)
        settings = dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=1,
                        topk_method="group_limited_greedy", n_shared_experts=1, moe_intermediate_size=16,
                        routed_scaling_factor=2.5, first_k_dense_replace=1)
    elif kind == "gemma3":
        settings = dict(head_dim=8, sliding_window=4, final_logit_softcapping=5.0, query_pre_attn_scalar=16,
                        layer_types=["sliding_attention"] + ["full_attention"] * (layers - 1),
                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    torch.manual_seed(seed)
    shared = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=scale, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind in ("gpt_neox", "opt", "gpt2", "gptj", "bloom", "mpt", "gpt_neo") \
            or kind.startswith(("gpt_bigcode", "falcon")):
        del shared["num_key_value_heads"]
    if kind in ("bloom", "mpt"):  # (12 heads of 4)
        shared.update(hidden_size=48, num_attention_heads=12)
    elif kind in ("minicpm3", "youtu", "deepseek_v2", "deepseek_v3", "glm4_moe_lite"):  # (latent attention: every
        # head its own keys, from the latent)
        shared["num_key_value_heads"] = shared["num_attention_heads"]
    shared.update(settings)  # (Llama 4's experts' intermediate size: its own)
    model = model_class(config(**shared))
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
        if model.lm_head.bias is not None:  # (Phi's)
            model.lm_head.bias.normal_(0.0, scale)
        for layer in layers_of(decoder_of(model)[0]):
            for linear in (getattr(attention_of(layer), name, None)
                           for name in ("q_proj", "k_proj", "v_proj", "query_key_value")
                           + (("dense",) if kind.startswith("falcon") or kind == "bloom" else ())):
                if linear is not None and linear.bias is not None:
                    linear.bias.normal_(0.0, scale)
            conv = getattr(layer, "conv", None) or getattr(layer, "mamba", None)  # (LFM2's short convolution and its
            # products; Granite 4's Mamba-2 mixer's)
            for linear in (getattr(conv, name, None) for name in ("conv", "conv1d", "in_proj", "out_proj")):
                if linear is not None and linear.bias is not None:
                    linear.bias.normal_(0.0, scale)
            for linear in (getattr(getattr(layer, "mlp", None), name, None)
                           for name in ("c_fc", "c_proj", "fc1", "fc2", "fc_in", "fc_out", "dense_h_to_4h",
                                        "dense_4h_to_h")):
                if linear is not None and linear.bias is not None:
                    linear.bias.normal_(0.0, scale)
        for name, weight in model.named_parameters():
            if "norm" in name or ".ln_" in name:  # (GPT-2: ln_*; Gemma's start at 0, others' at 1; biases at 0)
                weight.normal_(float(weight.mean()), scale)
            elif name.endswith(("sinks", "bias")) and kind == "gpt_oss":  # (its sinks, router's and experts' biases)
                weight.normal_(0.0, 1.0 if name.endswith("sinks") else scale)
            elif name.endswith("bias") and (kind in ("opt", "gpt2", "phimoe") or kind.startswith("gpt_bigcode")):
                weight.normal_(0.0, scale)
            elif name.endswith("e_score_correction_bias"):  # (ERNIE 4.5's: as large as the router's scores)
                weight.normal_(0.0, 0.2)
            elif name.endswith(("alpha_p", "alpha_n")):  # (Apertus's xIELU, each layer's own)
                weight.normal_(float(weight), 0.5)
            elif name.endswith(("router.scale", "per_expert_scale", "correct_output_scale")):  # (Gemma 4's router's,
                # from 1; Gemma 3n's corrected stream's scale, from 0)
                weight.normal_(1.0, scale)
        for layer in layers_of(decoder_of(model)[0]):
            if kind == "nemotron_h" and getattr(layer, "mamba", None) is not None:  # (time steps past its minimum,
                # 0.001: transformers' forward clamps them to it in a chain, not one token at a time)
                layer.mamba.dt_bias.fill_(1.0)
            if getattr(layer, "layer_scalar", None) is not None:  # (Gemma 4's, a buffer: each layer's own)
                layer.layer_scalar.uniform_(0.5, 1.5)
            correction = getattr(getattr(getattr(layer, "mlp", None), "gate", None), "e_score_correction_bias", None)
            if getattr(getattr(layer, "feed_forward", None), "use_expert_bias", False):  # (LFM2-MoE's, on its block)
                correction = layer.feed_forward.expert_bias
            if correction is not None:  # (DeepSeek V3's, a buffer: as large as the sigmoid scores' spread)
                correction.normal_(0.0, 0.2)
    return model.eval()


def tiny_gemma4_multimodal(vocab: int = 40, seed: int = 0):
    """Gemma 4's multimodal model (as E2B and up are published) without its vision and audio towers,
    read for its text: tiny_relative("gemma4", layers=4)'s decoder (the last two layers reading the
    first two's caches), images' tokens seeing each other (`use_bidirectional_attention = "vision"`:
    text's causal)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = tiny_relative("gemma4", vocab, layers=4, seed=seed).config.to_dict()
    text.pop("per_layer_config", None)  # (made again from these)
    text.update(global_head_dim=16, num_global_key_value_heads=1, use_bidirectional_attention="vision")
    special = dict(boi_token_id=vocab, eoi_token_id=vocab + 1, image_token_id=vocab + 2, boa_token_id=vocab + 3,
                   eoa_token_index=vocab + 4, audio_token_id=vocab + 5, video_token_id=vocab + 6)  # (past the tests')
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text, vision_config=None, audio_config=None,
                                                        tie_word_embeddings=False, **special))
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name:
                weight.normal_(float(weight.mean()), 0.3)
    return model.eval()


def tiny_windowed(kind: str, vocab: int = 40, layers: int = 2, seed: int = 0, window: int = 8,
                  scale: float = 0.3):
    """A random model whose attention (or some layers' of it) sees a sliding window of the last
    `window` positions: "mistral" (every layer), "qwen2" (the layers past the first, with
    `use_sliding_window`), "gemma3" (every layer but the last, its own layer types), "gemma3-vision"
    (the same decoder in Gemma 3's multimodal model, as Gemma 3 4B and up: its window in its text
    config) or "gemma4" (every other layer, in 4: the last two reading the keys of the first two's
    kinds)."""
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, Gemma4ForCausalLM, Gemma4TextConfig, MistralConfig,
                              MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

    shared = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=scale, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, sliding_window=window)
    torch.manual_seed(seed)
    if kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**shared))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**shared, use_sliding_window=True, max_window_layers=1))
    elif kind == "gemma3":
        types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
        model = Gemma3ForCausalLM(Gemma3TextConfig(**shared, head_dim=8, layer_types=types))
    elif kind == "gemma3-vision":
        from transformers import Gemma3Config, Gemma3ForConditionalGeneration

        text = dict(shared, head_dim=8, layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"])
        vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                      patch_size=14)
        model = Gemma3ForConditionalGeneration(Gemma3Config(  # (image tokens past the tests' tokens)
            text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=vocab + 2,
            boi_token_index=vocab, eoi_token_index=vocab + 1))
    else:
        shared["num_hidden_layers"] = 4
        model = Gemma4ForCausalLM(Gemma4TextConfig(
            **shared, head_dim=8, global_head_dim=8, layer_types=["sliding_attention", "full_attention"] * 2,
            num_kv_shared_layers=2, vocab_size_per_layer_input=vocab, hidden_size_per_layer_input=8))
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
        if kind.startswith("gemma"):  # (Gemma's norms start at 0: 1 + weight)
            for name, weight in model.named_parameters():
                if "norm" in name:
                    weight.normal_(0.0, scale)
    return model.eval()


def tiny_alibi(kind: str, vocab: int = 40, layers: int = 2, seed: int = 0, scale: float = 0.3):
    """A random model with ALiBi position biases, whose attention takes chains only on transformers'
    forward (engine.limit_of; trees on the static-cache runtime): "bloom" or "mpt"."""
    from transformers import BloomConfig, BloomForCausalLM, MptConfig, MptForCausalLM

    torch.manual_seed(seed)
    if kind == "bloom":
        model = BloomForCausalLM(BloomConfig(vocab_size=vocab, hidden_size=32, n_layer=layers, n_head=4,
                                             initializer_range=scale, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    else:
        model = MptForCausalLM(MptConfig(vocab_size=vocab, d_model=32, n_layers=layers, n_heads=4, max_seq_len=256,
                                         initializer_range=scale, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.mul_(3.0)
    return model.eval()


def tiny_recurrent(kind: str, vocab: int = 40, layers: int = 2, seed: int = 0, scale: float = 0.1):
    """A random model with layers that carry a state from token to token (engine.limit_of): "lfm2"
    (short convolutions, attention on every other layer), "falcon_h1" (Mamba-2 mixers and
    attention in each layer, its cache holding keys beside the state) or "mamba"."""
    from transformers import (FalconH1Config, FalconH1ForCausalLM, Lfm2Config, Lfm2ForCausalLM, MambaConfig,
                              MambaForCausalLM)

    torch.manual_seed(seed)
    shared = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=layers, initializer_range=scale,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    if kind == "lfm2":
        model = Lfm2ForCausalLM(Lfm2Config(**shared, num_attention_heads=4, num_key_value_heads=2,
                                           intermediate_size=64, block_ff_dim=64, max_position_embeddings=256,
                                           full_attn_idxs=list(range(1, layers, 2))))
    elif kind == "falcon_h1":
        model = FalconH1ForCausalLM(FalconH1Config(**shared, num_attention_heads=4, num_key_value_heads=2,
                                                   intermediate_size=64, head_dim=8, mamba_d_ssm=64,
                                                   mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
                                                   max_position_embeddings=256))
    else:
        model = MambaForCausalLM(MambaConfig(**shared, state_size=4, expand=2))
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    return model.eval()


def tiny_qwen3_5_multimodal(vocab: int = 40, seed: int = 0):
    """A random Qwen3.5 as published (Qwen3_5ForConditionalGeneration: an image tower beside its text
    decoder, a gated delta net then attention), its text decoder's norms random."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    config = Qwen3_5Config(
        text_config=dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                         layer_types=["linear_attention", "full_attention"], initializer_range=0.3,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=4, temporal_patch_size=2, spatial_merge_size=2))
    model = Qwen3_5ForConditionalGeneration(config)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "language_model" in name and "norm" in name:
                weight.normal_(float(weight.mean()), 0.3)
    return model.eval()


def save_gemma3n_multimodal(folder: Path, text_model, drop: str | None = None) -> Path:
    """A Gemma 3n checkpoint folder laid out as published (Gemma3nForConditionalGeneration's: its
    config's `text_config` the text model's, its decoder's weights under `model.language_model.`, the
    image and audio towers' beside them — one made-up tensor each here: building those towers needs
    timm and PIL), with tiny_tokenizer's files; `drop`: a weight of the decoder left out."""
    from safetensors.torch import save_file
    from transformers import Gemma3nConfig

    folder.mkdir(parents=True, exist_ok=True)
    config = Gemma3nConfig(text_config=text_model.config.to_dict())
    config.architectures = ["Gemma3nForConditionalGeneration"]
    config.save_pretrained(folder)
    tensors = {("model.language_model." + name.removeprefix("model.") if name.startswith("model.") else name):
               tensor.detach().contiguous() for name, tensor in text_model.state_dict().items() if name != drop}
    tensors["model.vision_tower.timm_model.conv_stem.conv.weight"] = torch.zeros(4, 3, 3, 3)
    tensors["model.audio_tower.subsample_conv_projection.conv_0.conv.weight"] = torch.zeros(4, 1, 3, 3)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    tiny_tokenizer().save_pretrained(folder)
    return folder


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


def save_profiled_pair(root: Path, target, draft) -> Path:
    """A target and a separate draft saved in root (each with the tiny tokenizer) and the profile
    of that pair: its path."""
    tokenizer = tiny_tokenizer()
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    profile = root / "pair.toml"
    profile.write_text(f'[target]\nsource = "{root / "target"}"\n'
                       f'[draft]\nkind = "model"\nsource = "{root / "draft"}"\n')
    return profile


REMOTE_CONFIG = """from transformers import LlamaConfig


class TinyRemoteConfig(LlamaConfig):
    model_type = "tiny_remote"
"""
REMOTE_MODEL = """from transformers import LlamaForCausalLM

from .configuration_tiny_remote import TinyRemoteConfig


class TinyRemoteForCausalLM(LlamaForCausalLM):
    config_class = TinyRemoteConfig
"""


def save_remote_code_model(folder: Path, model) -> Path:
    """`model` (a tiny Llama) saved as a model with code of its own, as some hub repos are: its
    config.json names a model type transformers does not know and the Python files (beside the
    weights) that define it, which transformers runs only with trust_remote_code; with the tiny
    tokenizer."""
    import json

    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    (folder / "configuration_tiny_remote.py").write_text(REMOTE_CONFIG)
    (folder / "modeling_tiny_remote.py").write_text(REMOTE_MODEL)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="tiny_remote", architectures=["TinyRemoteForCausalLM"],
                  auto_map={"AutoConfig": "configuration_tiny_remote.TinyRemoteConfig",
                            "AutoModelForCausalLM": "modeling_tiny_remote.TinyRemoteForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def save_tiny_pair(root: Path, vocab: int = 40) -> tuple[Path, Path]:
    """A target (3 layers) and a separate draft (1 layer) sharing one tokenizer."""
    target_dir, draft_dir = root / "target", root / "draft"
    tokenizer = tiny_tokenizer()
    for path, layers, seed in ((target_dir, 3, 0), (draft_dir, 1, 1)):
        tiny_model(vocab, layers, seed, scale=0.3).save_pretrained(path)
        tokenizer.save_pretrained(path)
    return target_dir, draft_dir


def gguf_writer(path: Path, architecture: str, *, context: int, hidden: int, layers: int, intermediate: int,
                heads: int, kv_heads: int, rope_base: float, eps: float, vocab: int):
    """A gguf.GGUFWriter for `path` holding a decoder's sizes and the tiny byte-level BPE tokenizer
    (SPECIALS + CHARS; the vocabulary may be larger than the tokenizer), ready for its tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(rope_base)
    writer.add_layer_norm_rms_eps(eps)
    writer.add_vocab_size(vocab)
    tokens = SPECIALS + CHARS
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([3] * len(SPECIALS) + [1] * len(CHARS))
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    return writer


def write_tiny_gguf(path: Path, model, types=None) -> None:
    """Write a tiny Llama (or Qwen2: its architecture, q/k/v biases, q and k not permuted) as a
    GGUF file (with a byte-level BPE tokenizer), as llama.cpp would: every tensor F32, or the type
    `types(gguf name)` names (quantise_k's; None: F32)."""
    import gguf
    import numpy as np

    cfg = model.config
    architecture = cfg.model_type
    writer = gguf_writer(path, architecture, context=cfg.max_position_embeddings, hidden=cfg.hidden_size,
                         layers=cfg.num_hidden_layers, intermediate=cfg.intermediate_size,
                         heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, rope_base=10000.0,
                         eps=cfg.rms_norm_eps, vocab=cfg.vocab_size)

    def permute(w, heads):  # llama.cpp's q/k layout
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    parts = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for i in range(cfg.num_hidden_layers):
        for hf, gg in parts.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
            names[f"model.layers.{i}.{hf}.bias"] = f"blk.{i}.{gg}.bias"
    for key, value in model.state_dict().items():
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # (a tied head is the embedding: llama.cpp writes no output.weight)
        array = value.numpy().astype(np.float32)
        if architecture == "llama" and "q_proj" in key:
            array = permute(array, cfg.num_attention_heads)
        elif architecture == "llama" and "k_proj" in key:
            array = permute(array, cfg.num_key_value_heads)
        kind = types(names[key]) if types is not None and array.ndim == 2 else None
        if kind is None:
            writer.add_tensor(names[key], array)
        else:
            writer.add_tensor(names[key], quantise_k(torch.from_numpy(array), kind),
                              raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantise_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """The float32 values llama.cpp's Q4_1 quantisation gives back for this (out, in) weight:
    per block of 32 along a row, d = (max - min) / 15 and m = min as half floats, q = round((x -
    min) / d), each weight d * q + m (what transformers dequantises a GGUF file into)."""
    blocks = weight.detach().float().reshape(weight.shape[0], -1, 32)
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    d = (high - low) / 15
    q = torch.floor((blocks - low) / torch.where(d > 0, d, 1.0) + 0.5).clamp(0, 15)
    return (q * d.half().float() + low.half().float()).reshape(weight.shape)


def quantise_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Q8_0: per block of 32, d = max |x| / 127 as a half float, each weight d * round(x / d)."""
    blocks = weight.detach().float().reshape(weight.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.round(blocks / torch.where(d > 0, d, 1.0)).clamp(-127, 127)
    return (q * d.half().float()).reshape(weight.shape)


def quantise_like_gguf(model):
    """The model's weights as a Q4_1 GGUF file holds them (the embedded model's format): its
    decoder layers' linears Q4_1, embeddings and output head Q8_0. In place; returns the model."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and module.weight.shape[1] % 32 == 0:
                quantise = quantise_q4_1 if ".layers." in f".{name}" else quantise_q8_0
                module.weight.copy_(quantise(module.weight))
    return model


def _halves(values):
    """float32 values -> numpy half floats (what llama.cpp stores d and dmin as)."""
    import numpy as np

    return np.asarray(values, dtype=np.float32).astype(np.float16)


def quantise_k(weight: torch.Tensor, type_name: str):
    """The (out, in) weight as a GGUF file holds it in llama.cpp's type `type_name` ((out, row
    bytes) uint8, what gguf's writer takes with raw_dtype): Q4_K, Q5_K, Q6_K, Q3_K, IQ4_NL and
    IQ4_XS made here (a plain quantiser: each group's range, its scale and minimum rounded to 6 or 8
    bits of the super-block's, as llama.cpp lays them out; not its search for the best ones), the
    legacy types by gguf's own quantiser. transformers dequantises these with gguf's dequantize."""
    import gguf
    import numpy as np

    x = weight.detach().float().numpy().astype(np.float32)
    rows = x.shape[0]
    if type_name in ("IQ4_NL", "IQ4_XS", "Q3_K"):
        return _quantise_grid(x, type_name)
    if type_name not in ("Q4_K", "Q5_K", "Q6_K"):
        return gguf.quants.quantize(x, gguf.GGMLQuantizationType[type_name])
    blocks = x.reshape(-1, 256)
    n = blocks.shape[0]
    if type_name == "Q6_K":
        groups = blocks.reshape(n, 16, 16)
        amax = np.abs(groups).max(-1)  # (n, 16)
        scale = amax / 31
        d = _halves(np.abs(scale).max(-1, keepdims=True) / 127)  # (n, 1)
        df = d.astype(np.float32)
        sc = np.clip(np.round(scale / np.where(df > 0, df, 1)), -128, 127).astype(np.int8)
        step = df * sc.astype(np.float32)  # (n, 16)
        q = np.clip(np.round(groups / np.where(step != 0, step, 1)[..., None]), -32, 31).astype(np.int32) + 32
        q = q.reshape(n, 2, 4, 32).astype(np.uint8)  # (half, shift group, 32)
        ql = np.zeros((n, 2, 64), np.uint8)
        ql[:, :, :32] = (q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4)
        ql[:, :, 32:] = (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)
        qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
        out = np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d.view(np.uint8)], axis=1)
        return out.reshape(rows, -1)
    top = 15 if type_name == "Q4_K" else 31
    groups = blocks.reshape(n, 8, 32)
    low = np.minimum(groups.min(-1), 0)  # (n, 8): the offsets are -dmin * m with m >= 0
    scale = (groups.max(-1) - low) / top
    d = _halves(scale.max(-1, keepdims=True) / 63)
    dmin = _halves((-low).max(-1, keepdims=True) / 63)
    df, dminf = d.astype(np.float32), dmin.astype(np.float32)
    sc = np.clip(np.round(scale / np.where(df > 0, df, 1)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-low / np.where(dminf > 0, dminf, 1)), 0, 63).astype(np.uint8)
    step, offset = df * sc.astype(np.float32), dminf * m.astype(np.float32)
    q = np.clip(np.round((groups + offset[..., None]) / np.where(step > 0, step, 1)[..., None]), 0, top)
    q = q.astype(np.uint8)
    packed = np.zeros((n, 12), np.uint8)  # gguf's Q4_K.get_scale_min, backwards
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    pairs = q.reshape(n, 4, 2, 32)
    qs = ((pairs[:, :, 0] & 15) | ((pairs[:, :, 1] & 15) << 4)).reshape(n, 128)
    parts = [d.view(np.uint8), dmin.view(np.uint8), packed]
    if type_name == "Q5_K":
        qh = np.zeros((n, 32), np.uint8)
        for j in range(8):
            qh |= ((q[:, j] >> 4) & 1) << j
        parts.append(qh)
    out = np.concatenate([*parts, qs], axis=1)
    return out.reshape(rows, -1)


def _quantise_grid(x, type_name: str):
    """quantise_k for the types whose weights are d * (a value of a small grid) per group: IQ4_NL
    (per 32, one of 16 int8 values, d a half float), IQ4_XS (the same with d times a 6-bit scale
    per 32 of 256) and Q3_K (q in -4..3 with d times a 6-bit scale per 16 of 256)."""
    import numpy as np
    from gguf.quants import IQ4_NL

    rows = x.shape[0]
    grid = np.arange(-4, 4, dtype=np.float32) if type_name == "Q3_K" else np.array(IQ4_NL.kvalues, np.float32)
    group = 16 if type_name == "Q3_K" else 32
    groups = x.reshape(-1, 256 if type_name != "IQ4_NL" else 32)
    n = groups.shape[0]
    groups = groups.reshape(n, -1, group)
    wanted = np.abs(groups).max(-1) / np.abs(grid).max()  # (n, groups): each group's own scale
    if type_name == "IQ4_NL":
        step = _halves(wanted).astype(np.float32)
    else:
        d = _halves(wanted.max(-1, keepdims=True) / 31)
        df = d.astype(np.float32)
        scales = np.clip(np.round(wanted / np.where(df > 0, df, 1)), -32, 31)
        step = df * scales.astype(np.float32)
    ratio = groups / np.where(step != 0, step, 1)[..., None]
    q = np.abs(ratio[..., None] - grid).argmin(-1).astype(np.uint8)  # (n, groups, group): indices into grid
    if type_name == "IQ4_NL":
        qs = q[:, 0, :16] | (q[:, 0, 16:] << 4)
        return np.concatenate([_halves(step).view(np.uint8), qs], axis=1).reshape(rows, -1)
    ls = (scales + 32).astype(np.uint8)
    if type_name == "IQ4_XS":
        high = (ls >> 4).astype(np.uint16)
        scales_h = (high << np.arange(0, 16, 2, dtype=np.uint16)).sum(-1).astype(np.uint16)
        scales_l = (ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)
        qs = (q[:, :, :16] | (q[:, :, 16:] << 4)).reshape(n, 128)
        return np.concatenate([d.view(np.uint8), scales_h.reshape(n, 1).view(np.uint8), scales_l, qs],
                              axis=1).reshape(rows, -1)
    q = q.reshape(n, 256)  # Q3_K: index k is q = k - 4; its low two bits and (q >= 0) as the mask bit
    low, mask = q & 3, q >> 2
    qs = np.zeros((n, 64), np.uint8)
    for element in range(256):
        half, shift, i = element // 128, element % 128 // 32, element % 32
        qs[:, half * 32 + i] |= low[:, element] << (2 * shift)
    hmask = np.zeros((n, 32), np.uint8)
    for element in range(256):
        hmask[:, element % 32] |= mask[:, element] << (element // 32)
    packed = np.zeros((n, 12), np.uint8)
    packed[:, :8] = (ls[:, :8] & 15) | ((ls[:, 8:] & 15) << 4)
    for k in range(16):
        packed[:, 8 + k % 4] |= (ls[:, k] >> 4) << (2 * (k // 4))
    return np.concatenate([hmask, qs, packed, d.view(np.uint8)], axis=1).reshape(rows, -1)


def dequantise_k(raw, type_name: str) -> torch.Tensor:
    """What transformers loads from such a tensor: gguf's dequantize, as float32."""
    import gguf

    return torch.from_numpy(gguf.dequantize(raw, gguf.GGMLQuantizationType[type_name]).copy())


def k_quant_type(name: str) -> str:
    """A Q4_K_M-like choice of type for a weight (transformers' or GGUF's name): Q6_K for the first
    layer's v and down and for the output head, as llama.cpp's Q4_K_M; Q5_K for the second layer's
    up (mixed formats in gate/up too); Q4_K for the rest."""
    gguf_name = name.replace("self_attn.", "attn_").replace("mlp.", "ffn_").replace("_proj", "")
    if any(part in gguf_name for part in ("layers.0.attn_v", "layers.0.ffn_down", "blk.0.attn_v", "blk.0.ffn_down")) \
            or gguf_name.startswith(("lm_head", "output.")):
        return "Q6_K"
    return "Q5_K" if "layers.1.ffn_up" in gguf_name or "blk.1.ffn_up" in gguf_name else "Q4_K"


def quantise_like_k_quants(model):
    """The model's 2-D weights as a K-quant GGUF file holds them (k_quant_type's types), each with
    the hint a conversion keeps for it (blocks.Hint): in place; returns the model. Rows must be
    whole super-blocks (256 weights)."""
    from rsd_cli import blocks, gguf_hints

    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() != 2:
                continue
            kind = k_quant_type(name)
            raw = quantise_k(parameter, kind)
            parameter.copy_(dequantise_k(raw, kind).reshape(parameter.shape))
            values = torch.from_numpy(gguf_hints.scales_and_offsets(raw, kind))
            setattr(parameter, blocks.HINT, gguf_hints.hint(gguf_hints.FORMAT_OF[kind], values))
    return model
