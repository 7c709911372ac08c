"""The static-cache runtime: a Llama forward that owns its KV buffers, compiled with torch.compile.

transformers' eager forward costs more in per-call overhead than the embedded model's arithmetic
on many machines (44 ms for one token on a 2-core Intel Xeon, 23 ms on an H100, against 16.6 and
1.5 ms compiled), and its caches cannot take tree nodes at chosen slots or undo them
(StaticCache has no crop). So for Llama-architecture models rsd runs its own forward over the
model's own modules (weights, norms and rotary tables are read, never copied):

- one key and one value buffer per model, (layers, kv_heads, capacity, head_dim), allocated per
  generation for the prompt, up to 512 answer tokens and one tree, doubling when full; new tokens
  are written at their slots (the cache's running length onwards), the accepted path compacted by
  one index copy for all layers;
- the attention mask is additive float (n, kv_len) over the used part of the buffers;
- token counts are padded to a few buckets (1, 2, 4, 8, 16, and 32, 64 on static shapes; padding
  rows write beyond the used length and see only themselves), and the used length is a dynamic
  dimension, so a handful of compiled graphs of one decoder layer serve every tree, every layer
  and the early-exit draft;
  prompts and trees of more than 16 tokens run the same code uncompiled, where overhead matters less;
- on CPU each linear product runs the kernel measured fastest for its shape and row count
  (`small_batch`: oneDNN on packed weights on an AMD EPYC), inside compiled graphs too, where it is
  one opaque operator (`rsd::linear`) between the kernels inductor fuses; uncompiled, a layer whose
  linears all run on quantised blocks (`blocks`: the embedded model's own Q4_1 weights) is one
  call of rsd's C library, and otherwise its q/k/v and gate/up products run as one call each;
- on a CUDA device "compiled" adds CUDA graphs: each bucketed token count's whole forward
  (embedding, every compiled layer, head) is captured once and replayed, on static shapes (KV
  buffers shared by a model's generations, new tokens written at slots given as a tensor, masks
  over the whole capacity), so a forward is one launch instead of hundreds (the embedded target
  on an H100: 1.8 ms, against 3.3 ms with graphs of the uncompiled layers and ~20 ms eager).

The engine sees the same `forward(tokens, positions, visible)` / `keep(indices)` as with
transformers' forward (`engine.CachedLM`), so exactness arguments carry over unchanged: tests
compare the two runtimes' logits, greedy outputs and sampled distributions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import operator
import weakref
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F

from .engine import (ChainExtension, ForwardClock, astride, chain_after, full_vocabulary, long_factors_from,
                     lower_triangle, timed_chain, unchanged_prefix, within_chunk, within_window)
from .sampling import to_device
from .step_graphs import StepGraphs, cuda_capture
from .blocks import (NativeForward, NativeLayer, block_format, blocks_linear, joined, native_head, native_table,
                     vectorised)
from .small_batch import (MAX_ROWS, TORCH, blocks_of, enrol, kernel_linear, kernels_of, machine,
                          prepared_copies, register_operator, room_for, signature)
from .threads import cpu_threads, every_thread, on_threads, run_in_c, run_on_torch

BUCKETS = (1, 2, 4, 8, 16)
# whole layers in C (blocks.NativeLayer) for every forward that can take them: measured on a 2-core
# AMD EPYC, the embedded target, C against torch's layer (its attention SDPA), ms: 4 / 16 / 32 / 64
# tokens after 150 cached 6.1 / 23.1 / 41.1 / 79.9 against 9.1 / 25.4 / 42.0 / 78.0, after 1000
# cached 8.7 / 29.3 / 52.2 / 100.1 against 13.4 / 35.1 / 58.7 / 106.3; prompts of 32 / 64 / 128 /
# 512 / 1000 tokens 39.9 / 74.5 / 112 / 557 / 1201 against 39.0 / 71.6 / 126 / 593 / 1252
# CUDA graphs take milliseconds to capture, not a compile: trees and draft levels up to 64 nodes
# (what `auto` drafts) replay too, where one forward costs about the same for 1 or 64 tokens
STATIC_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
SDPA_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)  # scaled_dot_product_attention(enable_gqa=)
# a prompt's forward on the runtime masks at most about this many scores (rows x keys: 128 MB of float32 on
# the host, as much again on a GPU, a head's worth more for ALiBi), a longer one read in pieces of rows
# (StaticLM.extend): a 32k-token prompt's one forward built a 4 GB mask; a piece has at least PIECE_ROWS
PROMPT_MASK_SCORES = 2 ** 25
PIECE_ROWS = 256
# on static shapes (CUDA graphs) a chain of more tokens than the widest bucket, no prompt (the draft catching up
# on `auto`'s plain steps), is read as up to this many replays of that bucket's graph instead of one forward
# off the graphs, eager: on an H100 the embedded target's forward took ~20 ms eager and 1.3-1.5 ms in a graph
# of 1-16 tokens, so a 3-layer draft's eager forward costs about what 8 of its replays do (not measured there yet)
GRAPHED_PIECES = 8
# a forward of at least this many rows that is a chain after every key before it (a prompt, a chat's next
# message) runs gated delta nets and Mamba-2 mixers by chunks of as many rows from the state its keys before add
# up to (_delta_along_chain, _mamba_along_chain), as transformers' chunked algorithms do: O(rows x chunk) instead
# of O(rows x keys) (a 3000-token prompt of a Qwen3.5 of 6 delta nets on the 2-core AMD EPYC: 37 s read along
# each row's path, against 14 s on transformers' forward)
CHAIN_ROWS = 64
# the keys of gated delta nets and Mamba-2 mixers that every row since has seen are summed into one state
# (StaticLM._fold) once at least this many have come after the last ones summed: a row then reads that state and
# the keys after it, at most about this many more than its own tree's, whatever the context's length (read along
# its whole path, a step's time grew with the context: 46 -> 78 ms at 3000 tokens for 6 delta nets of Qwen3.5-0.8B)
FOLD_ROWS = 64
# Llama-style decoders the tests cover: Llama itself; Qwen2 and Seed-OSS (biases on q, k and v: the
# layer takes them); Mistral (Llama's layer); Qwen3 (an RMS norm on each head of q and k); SmolLM3
# (Llama's layers, every fourth without a rotation); Granite 3.x (Llama's, the embedding, each block's
# output and the logits scaled by constants); Gemma (norms that scale by 1 + weight, a GELU MLP: `Style`); Gemma 2
# (norms after attention and the MLP too, attention scores soft-capped); Gemma 3's text decoder (270M,
# 1B, and 4B and up read for their text: Gemma 2's norms, q and k normed per head, a rotary table per
# layer kind); OLMo 2 (norms after attention and the MLP only, q and k normed whole) and OLMo 3 (OLMo
# 2's, a window and a rotary table per layer kind). A sliding window is in the masks (StaticLM.forward
# hides the keys it has passed): one mask where every layer has it (Mistral 7B v0.1's 4096), one per
# layer kind where some layers do (Gemma 2's every other, Gemma 3's five of six, OLMo 3's three of
# four, Qwen2's past `max_window_layers`). Phi-3 (q/k/v and gate/up fused: `projections` reads views of
# them), EXAONE 4, ERNIE 4.5, Hunyuan, GLM-4 and Cohere 1/2 differ from Llama as `Style` and `rotates` say.
# Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and GraniteMoE: their MLPs mixtures of experts (mixture_of_experts).
# StarCoder2, StableLM, Nemotron, Arcee, Phi and GPT-NeoX: LayerNorms with biases, MLPs without a gate,
# attention beside the MLP, q/k/v head by head (`Style`). GPT-J: Phi's layers (one LayerNorm, attention
# beside an MLP without a gate), each head's first `rotary_dim` dimensions turned by adjacent pairs.
# Falcon (7B, 40B, 180B, Falcon 2): GPT-NeoX's layers, q, k and v one linear by groups of heads, each
# group's q heads then its key and its value (one group: multi-query; a group a head: Falcon-RW's).
# ALiBi (BLOOM, MPT, Falcon-RW): no rotation, each head's scores biased by its slope times the key's
# position (`alibi_of`, StaticLM's masks: by each slot's position, so trees too, which transformers'
# forward, biasing by slot, cannot take); BLOOM's embedding normed, MPT's layers named otherwise.
# GPT-Neo: GPT-2's layers on linears, attention unscaled, its local layers windowed by position (trees
# too; transformers' forward windows by slot). Gemma 3n: Gemma 4's layers (caches shared, per-layer inputs)
# run on each of four streams (AltUp: _altup_layer), a learned residual beside attention, MLP gates cut off.
# Llama 4: q and k turned by adjacent pairs and normed without a weight, its layers without a rotation
# scaling q by position, the others chunked by position (trees too; transformers' forward goes by slots
# there), experts reading the token times their weight beside a shared expert.
SUPPORTED_TYPES = ("llama", "qwen2", "mistral", "qwen3", "gemma", "gemma2", "gemma3_text", "smollm3", "granite",
                   "olmo2", "olmo3", "seed_oss", "phi3", "exaone4", "ernie4_5", "hunyuan_v1_dense", "glm4",
                   "cohere", "cohere2", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "granitemoeshared",
                   "starcoder2", "stablelm", "nemotron", "arcee", "phi", "gpt_neox", "gpt_oss", "apertus", "opt",
                   "gpt2", "gpt_bigcode", "ernie4_5_moe", "phimoe", "gemma4_text", "minicpm3", "youtu", "deepseek_v2",
                   "deepseek_v3", "glm4_moe_lite", "gptj", "falcon", "bloom", "mpt", "gpt_neo", "gemma3n_text",
                   "llama4_text", "lfm2", "lfm2_moe", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next",
                   "granitemoehybrid", "nemotron_h", "bamba", "mamba2")
# (MLPs of experts, top-k routed: `Style.experts`)
MIXTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "granitemoeshared", "gpt_oss", "ernie4_5_moe",
            "phimoe", "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "llama4_text", "lfm2_moe", "qwen3_5_moe_text",
            "qwen3_next", "granitemoehybrid")
# rotary tables that depend on the position alone (YaRN too: Qwen2.5's and Qwen3's long-context setting)
# (ntk_alpha: Hunyuan's, a fixed base); `longrope` picks short or long factors for a whole forward by its last
# position: the runtime turns each row by its own position's (CompiledModel.tables; engine.long_factors_from)
# (proportional: Gemma 4's full-attention layers', a quarter of each head turned, the rest by angle 0)
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "ntk_alpha", "longrope", "proportional")
# the MLP's gate (or without one, its activation): SiLU (Llama), GELU tanh-approximated or exact, ReLU squared,
# xIELU (Apertus: each layer's own learned constants, xielu_constants), ReLU (OPT)
# (gelu_new: Phi's tanh GELU, by formula; bloom_gelu: BLOOM's, by its own formula)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu", "relu2", "gelu_new", "xielu", "relu", "bloom_gelu")


class Style(NamedTuple):
    """How a family's decoder layers differ from Llama's: what decoder_layer branches on (constants
    in its compiled graphs)."""

    norm_in_float: bool = False  # RMS norms multiply by their weight in float32, then cast (Gemma, OLMo 2 and 3)
    norm_offset: bool = False  # ... by 1 + their weight (Gemma)
    activation: str = "silu"  # the MLP gate's (ACTIVATIONS)
    softcap: float | None = None  # attention scores soft-capped to (-softcap, softcap) before the mask (Gemma 2)
    residual_scale: float = 1.0  # what attention's and the MLP's outputs are multiplied by before they join (Granite)
    pairs: bool = False  # q and k turned by adjacent pairs of dimensions (GLM-4, ERNIE 4.5), not by halves
    rotation_in_float: bool = False  # ... in float32, then cast (ERNIE 4.5, Cohere, Cohere 2, Llama 4)
    norm_after_rotation: bool = False  # each head of q and k normed after the rotation (Hunyuan), not before
    centred: bool = False  # norms that subtract the mean too (Cohere's LayerNorm without a bias)
    # attention and the MLP side by side, both joining the residual: the MLP reads the first norm's
    # output (Cohere, Phi) or, where the layer has a second norm, that norm of the layer's input (GPT-NeoX)
    parallel: bool = False
    # ... their outputs added together, then to the residual (GPT-NeoX, Phi, GPT-J, Falcon), not each to it in
    # turn (Cohere): the same sum, rounded otherwise in bfloat16
    parallel_sum: bool = False
    experts: int = 0  # the experts each token is routed to, where MLPs are mixtures of experts (Mixtral, ...)
    renormalise: bool = False  # ... their routing weights divided by their sum (Mixtral's; a config's norm_topk_prob)
    routing_in_float: bool = False  # ... and kept in float32 (Mixtral's, DeepSeek V2's), not cast to the model's dtype
    top_first: bool = False  # ... a softmax of the k largest router logits (GraniteMoE), not the k largest of a softmax
    norm_min: float = 0.0  # ... renormalised by at least this sum (ERNIE 4.5's `moe_norm_min`), where it has one
    sparse_mixer: float | None = None  # ... chosen as Phi-3.5-MoE's sparsemixer does at inference, this its jitter
    # ... chosen within the best groups of experts, weighted by their scores times a factor: (the scores,
    # "sigmoid" with a correction (DeepSeek V3's, GLM-4.7-Flash's) or "softmax" (DeepSeek V2's), groups,
    # groups kept, the routed scaling factor)
    grouped: tuple | None = None
    layer_norm: bool = False  # norms are torch's LayerNorms, with a bias (StarCoder2, StableLM; Nemotron's by 1 + weight)
    gated: bool = True  # the MLP's up product times its activated gate (Llama); else up, activated, then down
    # q, k and v one linear whose outputs go by groups of heads, each group's q heads then its k and v (GPT-NeoX:
    # a group a head; Falcon's by its key heads)
    interleaved: bool = False
    query_scaled: bool = False  # q multiplied by the attention's scaling before its product with k (OPT)
    sinks: bool = False  # each head's softmax has a learned logit more, whose share goes to no value (gpt-oss)
    angles_once: bool = False  # the rotary module gives each angle once, for both halves of a head (gpt-oss)
    value_norm: bool = False  # each head of v RMS-normed without a weight, in float32 (Gemma 3n, 4)
    latent_pairs: bool = False  # latent attention's rotated part turned by adjacent pairs (DeepSeek's rope_interleave)
    latent_complex: bool = False  # ... by adjacent pairs as complex numbers in float32, in place (DeepSeek V2's)
    # experts chosen by their router logits, each reading the token times its logit's sigmoid instead of weighting
    # its output (Llama 4)
    input_weighted: bool = False
    output_gate: bool = False  # q's product gives each head a gate too, attention's output times its sigmoid (Qwen3.5)
    # the residual stream kept in float32 whatever the weights' dtype: each layer's norm reads it cast to theirs,
    # the final norm reads it as it is, its output cast to the head's dtype (Mamba-2's `residual_in_fp32`)
    residual_in_float: bool = False
    bias_after_product: bool = False  # linears add their bias to the rounded product (Falcon's FalconLinear)
    # the one key head passed to torch's attention as it is, broadcast over q's heads (Falcon-7B's multi-query
    # attention in transformers): in bfloat16 and float16 its kernel for that shape rounds otherwise
    broadcast_keys: bool = False
    # attention as the family's own code in transformers computes it, in bfloat16 and float16 (in float32 torch's
    # kernel, within its rounding): "bloom" (ALiBi's bias plus the scaled scores rounded once), "mpt" (the scores
    # rounded, scaled, rounded, its bias added in float32) or "gpt_neo" (scores in float32); each then a softmax in
    # float32 cast back before the product with v; or None
    eager_attention: str | None = None


def decoder_of(model) -> tuple:
    """(the module holding the text decoder's layers, embedding, final norm and rotary tables, its
    config): the model's own `model`, or a multimodal model's `language_model`, read for its text
    (Gemma 3 4B and up, whose output head is the model's `lm_head` as a text model's), or OPT's `decoder`
    (GPT-NeoX's: `gpt_neox`; GPT-2's: `transformer`, its layers `h`: layers_of; Mamba-2's: `backbone`)."""
    inner = getattr(model, "model", None) or getattr(model, "gpt_neox", None) or getattr(model, "transformer", None) \
        or getattr(model, "backbone", None)
    if hasattr(getattr(inner, "decoder", None), "layers"):  # (OPT's)
        return inner.decoder, model.config
    language = getattr(inner, "language_model", None)
    get = getattr(model.config, "get_text_config", None)
    if language is not None and hasattr(language, "layers") and callable(get):
        return language, get(decoder=True)
    return inner, model.config


def layers_of(inner):
    """A decoder's layers (GPT-2's `h`, MPT's `blocks`; Nemotron-H's blocks paired, Mamba-2's each alone:
    nemotron_layers), or None."""
    found = getattr(inner, "layers", None)
    if found is not None and len(found) and type(found[0]).__name__ in ("NemotronHBlock", "Mamba2Block"):
        return nemotron_layers(found)
    return found if found is not None else getattr(inner, "h", None) or getattr(inner, "blocks", None)


class PairedBlocks:
    """Two of Nemotron-H's blocks as one of the runtime's layers: a Mamba-2 mixer's or attention's block
    (`first`, its norm and mixer as a layer's input_layernorm and `mamba` or `self_attn`), and the MLP's
    block after it (`then`, its norm and MLP as post_attention_layernorm and `mlp`; None each where a
    mixer or attention comes next: a layer without an MLP). A block of experts, or an MLP's after another
    MLP's, pairs with nothing: `first` None (unsupported says so)."""

    def __init__(self, first, then):
        self.blocks = (first, then)
        self.input_layernorm = None if first is None else first.norm
        if first is not None:
            setattr(self, "self_attn" if type(first.mixer).__name__.endswith("Attention") else "mamba", first.mixer)
        self.post_attention_layernorm = None if then is None else then.norm
        self.mlp = None if then is None else then.mixer


def nemotron_layers(blocks) -> list[PairedBlocks]:
    """Nemotron-H's blocks (norm, then one of a Mamba-2 mixer, attention, an MLP or experts, each added to
    the residual) as the runtime's layers (PairedBlocks): each mixer's or attention's with the MLP's after
    it, if one is; Mamba-2's (norm, then a mixer) each alone. Made once for a list of blocks."""
    made = getattr(blocks, "_rsd_layers", None)  # (the block count they were made for, the layers)
    if made is not None and made[0] == len(blocks):
        return made[1]
    layers: list[PairedBlocks] = []
    for block in blocks:
        kind = getattr(block, "block_type", "mamba")  # (Mamba-2's: mixers all)
        if kind == "mlp" and layers and layers[-1].mlp is None and layers[-1].blocks[0] is not None:
            layers[-1] = PairedBlocks(layers[-1].blocks[0], block)
        else:
            layers.append(PairedBlocks(None, block) if kind in ("mlp", "moe") else PairedBlocks(block, None))
    blocks._rsd_layers = (len(blocks), layers)
    return layers


def style_of(model) -> Style:
    _, cfg = decoder_of(model)
    family = cfg.model_type
    gemma, cohere = family.startswith("gemma"), family in ("cohere", "cohere2")
    # (Gemma 3n's and 4's norms multiply by their weight, not by 1 + it; each head of their v is normed)
    newer_gemma = family in ("gemma3n_text", "gemma4_text")
    mixture, oss = family in MIXTURES, family == "gpt_oss"
    bigcode, ernie, llama4 = family == "gpt_bigcode", family in ("ernie4_5", "ernie4_5_moe"), family == "llama4_text"
    # (Qwen3.5's and Qwen3-Next's norms by 1 + weight in float32, attention's output gated)
    qwen35 = family in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
    parallel = cohere or family in ("phi", "gptj") or bool(getattr(cfg, "use_parallel_residual", False)) \
        or family == "falcon" and bool(cfg.new_decoder_architecture or cfg.parallel_attn)
    return Style(norm_in_float=gemma or family in ("olmo2", "olmo3", "nemotron_h") or cohere or oss or qwen35,
                 norm_offset=gemma and not newer_gemma or family == "nemotron" or qwen35,
                 activation=clamped_swiglu(model) if oss else activation_of(cfg),
                 softcap=getattr(cfg, "attn_logit_softcapping", None) or None,
                 residual_scale=float(getattr(cfg, "residual_multiplier", 1.0)) if family != "minicpm3"
                 else cfg.scale_depth / math.sqrt(cfg.num_hidden_layers),
                 pairs=ernie or llama4 or family in ("glm4", "cohere", "cohere2", "gptj"),
                 rotation_in_float=ernie or llama4 or cohere,
                 norm_after_rotation=llama4 or family == "hunyuan_v1_dense", centred=cohere,
                 parallel=parallel, parallel_sum=parallel and not cohere,
                 experts=int(cfg.num_experts_per_tok) if mixture else  # (Gemma 4's beside its MLP: its own name)
                 int(cfg.top_k_experts) if family == "gemma4_text" and getattr(cfg, "enable_moe_block", False) else 0,
                 # (Mixtral's: no setting, always; DeepSeek V2's router never does, whatever its config says)
                 renormalise=mixture and bool(getattr(cfg, "norm_topk_prob", True))
                 and family not in ("deepseek_v2", "llama4_text"),
                 routing_in_float=family in ("mixtral", "deepseek_v3", "glm4_moe_lite", "deepseek_v2"),
                 top_first=family.startswith("granitemoe") or oss,
                 grouped=grouped_routing(cfg),
                 norm_min=float(getattr(cfg, "moe_norm_min", 0.0) or 0.0) if mixture else 0.0,
                 sparse_mixer=float(cfg.router_jitter_noise) if family == "phimoe" else None,
                 layer_norm=bigcode or family in ("starcoder2", "stablelm", "nemotron", "phi", "gpt_neox", "opt",
                                                  "gpt2", "phimoe", "gptj", "falcon", "bloom", "mpt", "gpt_neo"),
                 gated=family not in ("starcoder2", "nemotron", "arcee", "phi", "gpt_neox", "apertus", "opt", "gpt2",
                                      "gptj", "falcon", "bloom", "mpt", "gpt_neo", "nemotron_h")
                 and not bigcode,
                 query_scaled=family == "opt",
                 interleaved=family in ("gpt_neox", "falcon", "bloom") or bigcode and not cfg.multi_query, sinks=oss,
                 angles_once=oss,
                 value_norm=newer_gemma, latent_pairs=bool(getattr(cfg, "rope_interleave", False)),
                 latent_complex=family == "deepseek_v2", input_weighted=llama4, output_gate=qwen35,
                 residual_in_float=family == "mamba2" and bool(getattr(cfg, "residual_in_fp32", False)),
                 bias_after_product=family == "falcon",
                 broadcast_keys=family == "falcon" and not cfg.new_decoder_architecture and bool(cfg.multi_query),
                 eager_attention=family if family in ("bloom", "mpt", "gpt_neo") else None)


def grouped_routing(cfg) -> tuple | None:
    """Style.grouped of a config, (kind, groups, groups kept, factor, renormalisation's epsilon, scores in
    float32): DeepSeek V3's and GLM-4.7-Flash's sigmoid scores, DeepSeek V2's softmax (its `greedy` top-k:
    one group), LFM2-MoE's sigmoid scores in one group, in the model's dtype; else None."""
    if cfg.model_type in ("deepseek_v3", "glm4_moe_lite"):
        return "sigmoid", int(cfg.n_group), int(cfg.topk_group), float(cfg.routed_scaling_factor), 1e-20, True
    if cfg.model_type == "deepseek_v2":
        limited = cfg.topk_method == "group_limited_greedy"
        return ("softmax", int(cfg.n_group) if limited else 1, int(cfg.topk_group) if limited else 1,
                float(cfg.routed_scaling_factor), 1e-20, True)
    if cfg.model_type == "lfm2_moe":
        return "sigmoid", 1, 1, float(cfg.routed_scaling_factor), 1e-6, False
    return None


def clamped_swiglu(model) -> str:
    """gpt-oss's experts' gate as the activation's name (ACTIVATIONS: `clamped_swiglu:alpha:limit`), from
    its first mixture's experts (transformers 5.17 fixes them, later ones read them from the config)."""
    experts = next(mlp_of(layer).experts for layer in layers_of(decoder_of(model)[0]))
    return f"clamped_swiglu:{experts.alpha!r}:{experts.limit!r}"


def layer_norms(layer) -> tuple:
    """A decoder layer's norm modules (before attention, before the MLP, after attention, after the
    MLP), None where its family has none: Llama's input_layernorm and post_attention_layernorm (the
    one before the MLP, whatever its name says); Gemma 2 and 3's four (their post_attention_layernorm
    is after attention); GLM-4's four (its post_self_attn_layernorm after attention, post_mlp_layernorm
    after the MLP); OLMo 2 and 3's and EXAONE 4's last two only; Apertus's, OPT's and GPT-2's two, named
    otherwise."""
    if hasattr(layer, "operator_norm"):  # (LFM2: before attention or its short convolution, before the MLP)
        return layer.operator_norm, layer.ffn_norm, None, None
    if hasattr(layer, "pre_ff_layernorm"):  # (Bamba)
        return layer.input_layernorm, layer.pre_ff_layernorm, None, None
    if hasattr(layer, "feedforward_layernorm"):  # (Apertus)
        return layer.attention_layernorm, layer.feedforward_layernorm, None, None
    if hasattr(layer, "self_attn_layer_norm"):  # (OPT: its `final_layer_norm` is before the MLP)
        return layer.self_attn_layer_norm, layer.final_layer_norm, None, None
    if hasattr(layer, "norm_1"):  # (MPT)
        return layer.norm_1, layer.norm_2, None, None
    if hasattr(layer, "ln_attn"):  # (Falcon 40B and 180B: one before attention, one before the MLP, side by side)
        return layer.ln_attn, layer.ln_mlp, None, None
    if hasattr(layer, "ln_1"):  # (GPT-2; GPT-J: one, read by attention and the MLP alike)
        return layer.ln_1, getattr(layer, "ln_2", None), None, None
    if not hasattr(layer, "post_attention_layernorm"):  # Cohere: one norm, read by attention and the MLP alike
        return layer.input_layernorm, None, None, None
    if hasattr(layer, "post_self_attn_layernorm"):  # GLM-4: its post_attention_layernorm is before the MLP
        return (layer.input_layernorm, layer.post_attention_layernorm, layer.post_self_attn_layernorm,
                layer.post_mlp_layernorm)
    if hasattr(layer, "post_feedforward_layernorm"):
        return (getattr(layer, "input_layernorm", None), getattr(layer, "pre_feedforward_layernorm", None),
                layer.post_attention_layernorm, layer.post_feedforward_layernorm)
    return layer.input_layernorm, layer.post_attention_layernorm, None, None


def rotates(layer, kind: str, cfg) -> bool:
    """Whether a layer turns q and k by its positions' angles: not SmolLM3's layers without a rotation
    (`use_rope` off), nor EXAONE 4's full-attention layers beside windowed ones (its "global NoPE")."""
    if cfg.model_type == "exaone4":
        return getattr(cfg, "sliding_window", None) is None or kind == "sliding_attention"
    if cfg.model_type == "cohere2":  # (its full-attention layers: none)
        return kind == "sliding_attention"
    if alibi_of(cfg) is not None:  # (Falcon-RW's: its position biases instead)
        return False
    return bool(getattr(attention_of(layer), "use_rope", True))


def activation_of(cfg) -> str:
    """The MLP's activation as transformers' config names it (Gemma 3: `hidden_activation`, OPT:
    `activation_function`, Falcon: `activation`)."""
    if cfg.model_type == "falcon":
        return cfg.activation
    if cfg.model_type in ("bloom", "mpt"):  # (BLOOM's own tanh GELU; MPT's exact one)
        return "bloom_gelu" if cfg.model_type == "bloom" else "gelu"
    if cfg.model_type == "nemotron_h":  # (its MLPs')
        return cfg.mlp_hidden_act
    return getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None) \
        or getattr(cfg, "activation_function", "silu")


def layer_kinds(cfg, count: int) -> list[str]:
    """Each of the first `count` layers' attention kind ("full_attention", "sliding_attention")."""
    if cfg.model_type == "gpt_neo":  # (its "local" layers: windowed)
        return ["sliding_attention" if kind == "local" else "full_attention" for kind in cfg.attention_layers[:count]]
    if cfg.model_type == "nemotron_h":  # (its kinds are its blocks': PairedBlocks pairs them)
        return ["full_attention"] * count
    types = getattr(cfg, "layer_types", None)
    if types:
        return list(types[:count])
    return ["sliding_attention" if sliding_window(cfg) else "full_attention"] * count


class LayerCaches:
    """The keys (or values) of a model whose layers' caches differ in shape (Gemma 4's full-attention
    layers: wider heads, fewer of them): one (caches, kv_heads, capacity, head_dim) tensor for each
    shape; `self[i]` is cache i's (kv_heads, capacity, head_dim)."""

    def __init__(self, shapes: list[tuple], capacity: int, dtype, device):
        kinds = list(dict.fromkeys(shapes))  # (kv_heads, head_dim[, dtype]) of each tensor, in order of first use
        counts = [0] * len(kinds)
        self.where = []  # cache -> (its tensor, its index there)
        for shape in shapes:
            kind = kinds.index(shape)
            self.where.append((kind, counts[kind]))
            counts[kind] += 1
        self.tensors = tuple(torch.zeros((count, kind[0], capacity, kind[1]),
                                         dtype=kind[2] if len(kind) > 2 else dtype, device=device)
                             for count, kind in zip(counts, kinds))

    def __getitem__(self, cache: int) -> torch.Tensor:
        tensor, index = self.where[cache]
        return self.tensors[tensor][index]


def stacks_of(buffers) -> tuple:
    """The tensors holding a model's keys (or values): the one tensor, or a LayerCaches' each."""
    return buffers.tensors if isinstance(buffers, LayerCaches) else (buffers,)


def bucket(n: int, sizes: tuple[int, ...] = BUCKETS) -> int | None:
    """The padded token count for n tokens, or None when n is beyond the compiled sizes."""
    return next((b for b in sizes if b >= n), None)


def unsupported(model) -> str | None:
    """Why this model cannot run on the static-cache runtime, or None when it can."""
    inner, cfg = decoder_of(model)
    if cfg.model_type not in SUPPORTED_TYPES:
        return f"a {cfg.model_type} model (the static-cache runtime covers {', '.join(SUPPORTED_TYPES)})"
    layers = layers_of(inner)
    # (Granite 4's and Nemotron-H's hybrids: attention without positions, the Mamba-2 mixers order the tokens;
    # Mamba-2's: no attention at all)
    if layers is None or not hasattr(model, "lm_head") \
            or not (rotary_of(inner) is not None or positions_of(inner) or alibi_of(cfg)
                    or cfg.model_type in ("granitemoehybrid", "nemotron_h", "mamba2")):
        return f"{type(model).__name__} is not laid out as a Llama-style decoder"
    if cfg.model_type == "bloom" and (cfg.apply_residual_connection_post_layernorm
                                      or cfg.pretraining_tp > 1 and cfg.slow_but_exact):
        return "BLOOM's options (the residual after the norm, or products split as in its pretraining)"
    if cfg.model_type == "nemotron_h" and any(layer.blocks[0] is None for layer in layers):
        return "Nemotron-H's experts, or an MLP's block not after a mixer's or attention's"
    if cfg.model_type == "mpt" and (cfg.attn_config.clip_qkv or cfg.attn_config.qk_ln
                                    or any(m.bias is not None for m in (layers[0].attn.Wqkv, layers[0].ffn.up_proj))):
        return "MPT's options (q, k and v clipped or normed, biases)"
    if cfg.model_type == "opt" and (not cfg.do_layer_norm_before or getattr(inner, "project_in", None) is not None
                                    or getattr(inner, "final_layer_norm", None) is None
                                    or not cfg.layer_norm_elementwise_affine):
        return "OPT-350m's layout (norms after the residual, embeddings projected in and out)"
    if cfg.model_type == "gpt2" and (cfg.scale_attn_by_inverse_layer_idx or cfg.reorder_and_upcast_attn
                                     or cfg.add_cross_attention or not cfg.scale_attn_weights):
        return "GPT-2's options (attention scaled by layer, upcast and reordered, or cross-attention)"
    if cfg.model_type == "gpt_bigcode" and (cfg.add_cross_attention or not cfg.scale_attn_weights):
        return "GPT-BigCode's options (cross-attention, or attention not scaled)"
    # (Gemma 4's "vision": images' tokens see each other, text's are causal — all rsd reads)
    if activation_of(cfg) not in ACTIVATIONS \
            or getattr(cfg, "use_bidirectional_attention", False) not in (False, None, "vision"):
        return f"{type(model).__name__}'s layers differ from Llama's"
    if getattr(cfg, "enable_moe_block", False) and not all(gemma4_experts_plain(layer) for layer in layers_of(inner)):
        return "Gemma 4's experts are laid out otherwise"
    rope = getattr(getattr(inner, "rotary_emb", None), "rope_type", "default")  # (Gemma 3: one per layer kind)
    kinds = list(rope.values()) if isinstance(rope, dict) else [rope]
    if any(kind not in ROPE_TYPES for kind in kinds) or len(kinds) > 1 and "longrope" in kinds:  # (long_factors_from)
        return f"rope type {rope!r}"
    gate, up, down = projections(layers[0])[4:]
    if gate is not None and any(linear.bias is not None for linear in (gate, up, down)):  # (ERNIE 4.5's `use_bias`)
        return f"{type(model).__name__}'s MLP has biases"
    if getattr(cfg, "qk_layernorm", False) or (getattr(cfg, "use_parallel_residual", False)
                                               and cfg.model_type == "stablelm"):  # (StableLM's options)
        return f"{type(model).__name__} norms q and k with a LayerNorm for each head, or runs attention beside the MLP"
    if not all(_plain_experts(layer) for layer in layers):
        return f"{type(model).__name__}'s experts are laid out otherwise"
    if cfg.model_type == "falcon" and cfg.new_decoder_architecture and not cfg.parallel_attn:
        return "Falcon's new layout without parallel attention"
    if getattr(cfg, "clip_qkv", None) is not None:  # (OLMoE's option)
        return f"{type(model).__name__} clips q, k and v"
    if getattr(cfg, "use_qk_norm", False) and cfg.model_type != "llama4_text":  # (Command R+: a LayerNorm weight
        # for each head; Llama 4's, without a weight, are its _head_norms')
        return f"{type(model).__name__} norms q and k with a weight for each head"
    placement = getattr(model, "hf_device_map", None) or {}
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1 or len(set(placement.values())) > 1:
        return "a model placed over several devices"
    if "disk" in placement.values() or any(d.type == "meta" for d in devices):
        return "a model whose weights accelerate offloads"
    return None


def alibi_of(cfg) -> str | None:
    """How a model biases attention scores by position instead of turning q and k (ALiBi): "bloom"
    (BLOOM's, Falcon-RW's: each head's bias of a key a function of its position alone, as the model's
    build_alibi_tensor computes it), "mpt" (MPT's: its slopes times the key's position less the last
    one's), or None."""
    if cfg.model_type == "bloom" or cfg.model_type == "falcon" and cfg.alibi:
        return "bloom"
    return "mpt" if cfg.model_type == "mpt" else None


def alibi_biases(model, heads: int, context: int, dtype: torch.dtype) -> torch.Tensor:
    """(heads, context) float32: ALiBi's bias of each head's score of a key at each position, BLOOM's or
    Falcon-RW's, as the model's own build_alibi_tensor computes it for a sequence (transformers 5.24
    multiplies BLOOM's slopes in float32 and Falcon's in bfloat16), in its dtype — Falcon's then over
    sqrt(head_dim), as its attention adds them; MPT's slopes (heads,) in float32."""
    import importlib

    module = importlib.import_module(type(model).__module__)  # (the model's modeling module)
    if alibi_of(model.config) == "mpt":  # (its slope times -1, at the second of two positions)
        return -module.build_mpt_alibi_tensor(heads, 2, model.config.attn_config.alibi_bias_max)[:, 0, 0]
    table = module.build_alibi_tensor(torch.ones(1, context, dtype=torch.long), heads, dtype)[:, 0]
    if model.config.model_type == "falcon":
        table = table / math.sqrt(model.config.hidden_size // heads)
    return table.float()


class SinusoidalTable:
    """GPT-J's rotary angles where transformers before 5.24 keeps them in each attention's
    `embed_positions` (sin, then cos, of each position), read as its GPTJRotaryEmbedding reads them
    since: (sin, cos) of these positions, in x's dtype."""

    def __init__(self, table: torch.Tensor):
        self.table = table

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sincos = self.table.to(position_ids.device)[position_ids].to(x.dtype)
        return sincos.split(sincos.shape[-1] // 2, dim=-1)


def rotary_of(inner):
    """A decoder's rotary module (`rotary_emb`, LFM2-MoE's `pos_emb`), GPT-J's angles in its first attention
    (SinusoidalTable: transformers before 5.24), or None."""
    found = getattr(inner, "rotary_emb", None) or getattr(inner, "pos_emb", None)
    if found is not None:
        return found
    layers = layers_of(inner)
    table = getattr(getattr(layers[0], "attn", None), "embed_positions", None) if layers else None
    return SinusoidalTable(table) if isinstance(table, torch.Tensor) else None


def positions_of(inner) -> tuple | None:
    """(the table of learned position embeddings, the row of position 0 in it) of a decoder that adds
    them to its tokens' (OPT's, from row 2; GPT-2's `wpe`), or None (rotary angles instead)."""
    table = getattr(inner, "embed_positions", None)
    if type(table).__name__ == "OPTLearnedPositionalEmbedding":
        return table.weight.detach(), table.offset
    table = getattr(inner, "wpe", None)  # (GPT-2's)
    return None if table is None else (table.weight.detach(), 0)


def sliding_window(cfg) -> bool:
    """Whether some layer attends to a window of recent tokens only (the runtime's layers see the
    whole cache): per layer where the config lists layer types (Qwen2's `use_sliding_window`), else
    a `sliding_window` shorter than the context (Mistral 7B v0.1's 4096)."""
    types = getattr(cfg, "layer_types", None)
    if types:
        return any(kind == "sliding_attention" for kind in types)
    window = getattr(cfg, "sliding_window", None)
    return bool(window) and window < getattr(cfg, "max_position_embeddings", math.inf)


def window_of(cfg) -> int | None:
    """The sliding window every layer attends to, or None (no window, or one on some layers only)."""
    types = getattr(cfg, "layer_types", None)
    if not sliding_window(cfg) or types and any(kind != "sliding_attention" for kind in types):
        return None
    return cfg.sliding_window


PLACEMENT_REASONS = ("a model placed over several devices", "a model whose weights accelerate offloads")


def attention_temperatures(positions: torch.Tensor, floor_scale: float, scale: float) -> torch.Tensor:
    """(n,) float32: what Llama 4's layers without a rotation multiply each token's q by
    (`attn_temperature_tuning`), as its attention computes it of the token's position — there the
    cache's length plus its row, the same in a chain; here its own position, so a tree's nodes too."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * scale + 1.0


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' Llama rotation (its modeling module costs ~0.7 s to import; rsd_cli/llama.py)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: Style) -> torch.Tensor:
    """x (heads, n, head_dim) turned by its rows' angles: by halves (Llama), or by adjacent pairs (cos
    and sin: pair_angles; ERNIE in float32); only its first cos.shape[-1] dimensions where the rotation
    takes part of each head (GLM-4's half), the others passed as they are."""
    width = cos.shape[-1]
    part = x[..., :width] if width < x.shape[-1] else x
    if not style.pairs:
        turned = part * cos + rotate_half(part) * sin
    elif style.rotation_in_float:
        turned = part.float() * cos + rotate_pairs(part).float() * sin
    else:
        turned = part * cos + rotate_pairs(part) * sin
    # (cast back where it was turned in float32: by `rotation_in_float`, or by OLMo 2's and 3's tables, float32
    # whatever the model's dtype, as their apply_rotary_pos_emb does)
    turned = turned.to(x.dtype)
    return torch.cat([turned, x[..., width:]], dim=-1) if width < x.shape[-1] else turned


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """GLM-4's and ERNIE 4.5's rotation: each pair of adjacent dimensions (x0, x1) turned to (-x1, x0)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def pair_angles(table: torch.Tensor) -> torch.Tensor:
    """A rotary table (positions, rotated dimensions) as rotate_pairs reads it, each angle twice in a
    row: laid out by halves (each angle's cos or sin for the first half of the dimensions, then again
    for the second: GLM-4's, ERNIE's), re-laid; already in pairs (Cohere's), as it is."""
    if torch.equal(table[..., 0::2], table[..., 1::2]):
        return table
    return table[..., : table.shape[-1] // 2].repeat_interleave(2, dim=-1)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, small: tuple,
            bias_after: bool = False) -> torch.Tensor:
    """small = (the CPU kernels this layer's shape measured fastest with, the copies of its weight
    they run on): small_batch.kernels_of / prepared_copies. `bias_after`: the bias added to the product
    once it is rounded to x's dtype (Style.bias_after_product), not inside it."""
    if bias_after and bias is not None:
        return _linear(x, weight, None, small) + bias
    if torch.compiler.is_compiling():  # the weight's enrolled kernels (CompiledModel): graphs do not depend on them
        if x.device.type != "cpu":  # (a GPU: inductor's own product, which it can plan around)
            return F.linear(x, weight, bias)
        return kernel_linear(x, weight, bias, TORCH)
    kernels, prepared = small
    if kernels != TORCH or "blocks" in prepared:
        return kernel_linear(x, weight, bias, kernels, prepared)
    return F.linear(x, weight, bias)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, in_float: bool = False,
              centred: bool = False) -> torch.Tensor:
    """Llama's RMS norm (the weight times the normed x cast to x's dtype), or with `in_float` Gemma's
    and OLMo's: the normed x times a float32 weight (norm_weight), then cast; `centred`, Cohere's
    LayerNorm without a bias: x less its mean, normed so. A (weight, bias) pair: torch's LayerNorm
    (norm_of)."""
    if isinstance(weight, tuple):  # (a LayerNorm's weight and bias: norm_of)
        return F.layer_norm(x, x.shape[-1:], *weight, eps)
    dtype, x = x.dtype, x.float()
    if centred:
        x = x - x.mean(-1, keepdim=True)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:  # (Gemma 4's norm of v: no weight)
        return normed.to(dtype)
    return (normed * weight).to(dtype) if in_float else weight * normed.to(dtype)


def _eps(norm) -> float:
    """An RMS norm module's epsilon (Llama's `variance_epsilon`, Gemma's `eps`)."""
    eps = getattr(norm, "variance_epsilon", None)
    return norm.eps if eps is None else eps


def norm_of(norm, style: Style) -> torch.Tensor | tuple:
    """What _rms_norm takes for a norm module: norm_weight of its weight, or for a LayerNorm
    (`style.layer_norm`) its weight (Nemotron's 1 + it, in its dtype, as its LayerNorm1P computes
    it) and bias."""
    if not style.layer_norm:
        return norm_weight(norm.weight, style)
    weight, bias = norm.weight.detach(), None if norm.bias is None else norm.bias.detach()
    return (weight + 1.0 if style.norm_offset else weight), bias


def norm_weight(weight: torch.Tensor, style: Style) -> torch.Tensor:
    """What _rms_norm takes for a norm module's weight: the weight, or where norms multiply in float32
    the weight in float32, for Gemma 1 + it (computed once: the values its norm computes at every
    call)."""
    weight = weight.detach()
    if style.norm_offset:
        return 1.0 + weight.float()
    return weight.float() if style.norm_in_float else weight


def _activation(x: torch.Tensor, name: str, constants: tuple | None = None) -> torch.Tensor:
    """The named activation of x; xIELU's with its layer's `constants` (xielu_constants)."""
    if name == "xielu":  # (transformers' XIELUActivation in Python, as it computes it)
        alpha_p, alpha_n, beta, eps = constants
        return torch.where(x > 0, alpha_p * x * x + beta * x, (torch.expm1(torch.min(x, eps)) - x) * alpha_n + beta * x)
    if name == "silu":
        return F.silu(x)
    if name == "relu2":
        return torch.square(F.relu(x))
    if name == "relu":
        return F.relu(x)
    if name == "bloom_gelu":  # (transformers' bloom_gelu_forward, as it computes it)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))
    if name == "gelu_new":  # (transformers' NewGELUActivation, as it computes it)
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    return F.gelu(x, approximate="tanh" if name == "gelu_pytorch_tanh" else "none")


def xielu_constants(mlp) -> tuple | None:
    """An MLP's xIELU activation's constants as _activation takes them (alpha_p and alpha_n through their
    softplus, as transformers' XIELUActivation computes them at every call: the same values), or None."""
    act = getattr(mlp, "act_fn", None)
    if type(act).__name__ != "XIELUActivation":
        return None
    with torch.no_grad():
        return (F.softplus(act.alpha_p.detach()), act.beta + F.softplus(act.alpha_n.detach()), act.beta, act.eps)


def _glu(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """(..., 2I) -> (..., I): a gated MLP's activated gate times its up, from their products side by
    side — gate then up, or with gpt-oss's `clamped_swiglu:alpha:limit` interleaved (gate, up of each
    unit), the gate clamped above at limit and its SiLU sharpened by alpha, the up clamped to
    (-limit, limit) and offset by 1, in the order transformers' GptOssExperts computes them."""
    if activation.startswith("clamped_swiglu:"):
        alpha, limit = (float(value) for value in activation.split(":")[1:])
        gate, up = gate_up[..., ::2].clamp(min=None, max=limit), gate_up[..., 1::2].clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    gate, up = gate_up.chunk(2, -1)
    return _activation(gate, activation) * up


def mixture_of_experts(h: torch.Tensor, experts: tuple, style: Style) -> torch.Tensor:
    """A mixture-of-experts MLP on h (n, hidden): each token's `style.experts` likeliest experts by
    the router's softmax (their weights renormalised to sum to 1 where the family does), each expert
    a gated MLP, their outputs weighted and summed (GraniteMoE, gpt-oss: weights a softmax of the k
    largest router logits) — and where the layer has one, a shared expert's output added, scaled by a
    sigmoid gate where it has one (Qwen2-MoE; GraniteMoE-shared's and Llama 4's are not); Llama 4's
    experts (`style.input_weighted`) chosen by their router logits, each reading the token times its
    logit's sigmoid instead of weighting its output. experts = (router (E,
    hidden), gate_up (E, 2I, hidden): each expert's gate rows then its up rows (gpt-oss's interleaved:
    _glu), down (E, hidden, I), the shared expert's (gate, up, down, its gate (1, hidden) or None) or
    None, extras: (gpt-oss's biases: the router's (E,), gate_up's (E, 2I), down's (E, hidden); ERNIE
    4.5's correction (E,): added to the softmax to choose experts, not to weight them) or None). The
    routing is read on the device; routed_experts runs the experts. In a compiled graph, up to
    GATHERED_PAIRS (token, expert) pairs an expert multiply by each pair's expert's weights gathered
    — the compiled kernels read them in place, no copy —, more call the operator rsd::experts
    (routed_experts).
    On a 2-core Xeon, a Qwen3-MoE of 12 layers of 16 experts, 4 a token: 7.6 / 13.8 / 17.4 / 25.7
    ms a compiled forward of 1 / 4 / 8 / 16 tokens gathering up to 4 pairs an expert, 8.1 / 14.6 /
    18.6 / 34.8 up to 2, 10.1 / 21.8 / 24.1 / 29.0 up to 0.5 (the operator from 2 tokens on);
    uncompiled 13.9 / 17.5 / 17.8 / 23.5 (`benchmarks/results/intel-xeon-moe/`)."""
    router, gate_up, down, shared, extras = experts
    router_bias, *biases, correction = extras if extras is not None else (None, None, None, None)
    k = style.experts
    if style.top_first:
        top, chosen = F.linear(h, router, router_bias).float().topk(k, dim=-1)  # (n, k) each
        weights = torch.softmax(top, -1)
    elif style.sparse_mixer is not None:  # (Phi-3.5-MoE)
        weights, chosen = sparse_mixer(F.linear(h, router), style.sparse_mixer)
    elif style.grouped is not None:  # (DeepSeek: scores in float32, chosen within the best groups; LFM2-MoE's in
        # the model's dtype, one group)
        kind, groups, kept, factor, epsilon, in_float = style.grouped
        logits = F.linear(h.float(), router.float()) if in_float else F.linear(h, router)
        weights, chosen = grouped_choice(logits, correction, k, kind, groups, kept, factor, style.renormalise, epsilon)
    elif style.input_weighted:  # (Llama 4: the k largest router logits, weighted by their sigmoid)
        top, chosen = F.linear(h, router).topk(k, dim=-1)  # (n, k) each
        weights = torch.sigmoid(top.float())
    elif correction is not None:  # (ERNIE 4.5: its router in float32)
        probabilities = torch.softmax(F.linear(h.float(), router.float()), -1, dtype=torch.float32)  # (n, E)
        chosen = torch.topk(probabilities + correction, k, dim=-1).indices
        weights = probabilities.gather(-1, chosen)
        weights = weights / weights.sum(-1, keepdim=True).clamp(min=style.norm_min)
    else:
        weights, chosen = torch.topk(torch.softmax(F.linear(h, router), -1, dtype=torch.float32), k, dim=-1)
        if style.renormalise:
            weights = weights / weights.sum(-1, keepdim=True)
    weights = weights if style.routing_in_float else weights.to(h.dtype)
    if style.input_weighted:  # (Llama 4: each (token, expert) pair's input the token times its weight; summed)
        n = h.shape[0]
        pairs = (h[:, None, :] * weights[..., None]).reshape(n * k, -1)  # (n k, hidden)
        mixed = run_experts(pairs, chosen.reshape(-1, 1), pairs.new_ones(n * k, 1), gate_up, down,
                            style.activation).view(n, k, -1).sum(1).to(h.dtype)
    else:
        mixed = run_experts(h, chosen, weights, gate_up, down, style.activation, *biases).to(h.dtype)
    if shared is None:
        return mixed
    wg, wu, wd, shared_gate = shared
    common = F.linear(_activation(F.linear(h, wg), style.activation) * F.linear(h, wu), wd)
    return mixed + (common if shared_gate is None else torch.sigmoid(F.linear(h, shared_gate)) * common)


def run_experts(h, chosen, weights, gate_up, down, activation: str, *biases) -> torch.Tensor:
    """The chosen experts of each token of h (n, hidden), weighted (chosen, weights (n, k)): by
    routed_experts, or in a compiled graph, up to GATHERED_PAIRS (token, expert) pairs an expert by
    each pair's expert's weights gathered — the compiled kernels read them in place, no copy —, more
    by the operator rsd::experts (routed_experts)."""
    if not torch.compiler.is_compiling():
        return routed_experts(h, chosen, weights, gate_up, down, activation, *biases)
    if chosen.numel() <= GATHERED_PAIRS * gate_up.shape[0]:  # (few tokens: the compiled kernels read the weights in place)
        return _gathered_experts(h, chosen, weights, gate_up, down, activation, *biases)
    if _EXPERTS_OPERATOR:  # (registered before compiling; the graph calls it: no size there follows the routing)
        return torch.ops.rsd.experts(h, chosen, weights, gate_up, down, activation, *biases)
    return _every_expert(h, chosen, weights, gate_up, down, activation, *biases)


def experts_beside(x: torch.Tensor, beside: tuple, k: int, activation: str, eps: float) -> torch.Tensor:
    """Gemma 4's mixture of experts beside its MLP (26B-A4B), on x (n, hidden), what the MLP's block
    reads before its norm: each token's k likeliest experts by a softmax of the router's logits (x
    normed without a weight, scaled by the router's `scale` and 1 / sqrt(hidden)), their weights
    renormalised and scaled by each expert's `per_expert_scale`, the experts reading x through a norm
    of their own and their sum normed again, as transformers' Gemma4TextDecoderLayer computes it.
    beside: gemma4_experts'."""
    router, scale, root, expert_scale, gate_up, down, before, after = beside
    scores = F.linear(_rms_norm(x, None, eps, True) * scale * root, router)
    weights, chosen = torch.topk(torch.softmax(scores, -1, dtype=torch.float32), k, dim=-1)  # (n, k) each
    weights = weights / weights.sum(-1, keepdim=True) * expert_scale[chosen]
    mixed = run_experts(_rms_norm(x, before, eps, True), chosen, weights, gate_up, down, activation)
    return _rms_norm(mixed.to(x.dtype), after, eps, True)


def grouped_choice(logits: torch.Tensor, correction: torch.Tensor | None, k: int, kind: str, groups: int, kept: int,
                   factor: float, renormalise: bool, epsilon: float = 1e-20) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, chosen) (n, k) of router logits (n, E) as DeepSeek's routers give them: V3's sigmoid
    scores plus a learned `correction` (E,) choose, among the experts of the `kept` groups whose two
    best corrected scores sum highest, the k best; V2's softmax scores among the experts of the
    groups with the highest best score; LFM2-MoE's sigmoid scores, corrected where it has a
    correction, in one group. Each weighted by its score alone, renormalised (where the model says;
    `epsilon` added to the sum) and times `factor`."""
    sigmoid = kind == "sigmoid"
    scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, -1, dtype=torch.float32)
    choice = scores + correction if sigmoid and correction is not None else scores
    n, count = choice.shape
    by_group = choice.view(n, groups, count // groups)
    group_scores = by_group.topk(2, dim=-1).values.sum(-1) if sigmoid else by_group.max(-1).values
    best_groups = group_scores.topk(kept, dim=-1).indices
    allowed = torch.zeros(n, groups, dtype=torch.bool, device=choice.device).scatter_(1, best_groups, True)
    choice = choice.masked_fill(~allowed.repeat_interleave(count // groups, dim=1), -math.inf if sigmoid else 0.0)
    chosen = choice.topk(k, dim=-1).indices
    weights = scores.gather(1, chosen)
    if renormalise:
        weights = weights / (weights.sum(-1, keepdim=True) + epsilon)
    return weights * factor, chosen


def sparse_mixer(scores: torch.Tensor, jitter: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, chosen) (n, 2) of Phi-3.5-MoE's router logits `scores` (n, E) as transformers'
    sparsemixer gives them at inference: the likeliest expert, weighted by its softmax among the
    experts whose logits are within 2 jitter of it (relative to their size), then the likeliest other
    one, weighted so among the rest."""
    top, first = scores.max(dim=-1, keepdim=True)
    masked = scores.masked_fill((top - scores) / scores.abs().clamp(min=top) > 2 * jitter, float("-inf"))
    weight = torch.softmax(masked, dim=-1).gather(dim=-1, index=first)
    others = torch.scatter(scores, -1, first, float("-inf"))
    top, second = others.max(dim=-1, keepdim=True)
    masked = others.masked_fill((top - scores) / scores.abs().clamp(min=top) > 2 * jitter, float("-inf"))
    return (torch.cat((weight, torch.softmax(masked, dim=-1).gather(dim=-1, index=second)), dim=-1),
            torch.cat((first, second), dim=-1))


def routed_experts(h, chosen, weights, gate_up, down, activation: str, gate_up_bias=None,
                   down_bias=None) -> torch.Tensor:
    """(n, hidden): the sum over each token's chosen experts (chosen, weights (n, k)) of the expert's
    gated MLP on it (_glu; its products' biases (E, 2I) and (E, hidden) where it has them: gpt-oss's)
    times its weight (in h's and the weights' common dtype). torch's grouped product
    where it runs for this device and dtype (the tokens sorted by expert, each expert's weights read
    in place once: on a 2-core Xeon 1-16 tokens of 4 of 16 experts took 0.2-2.7 ms, as a loop over
    the chosen experts, against 1-47 ms gathering each token's experts' weights); else each chosen
    expert once on its tokens (their list read on the host) — or, while a CUDA graph is captured,
    where nothing may be read, each token's experts' weights gathered (as transformers' `batched_mm`
    experts) where that is fewer than all of them, or every expert on every token."""
    capturing = h.is_cuda and torch.cuda.is_current_stream_capturing()
    if _groups(h, capturing):
        try:
            return _grouped_experts(h, chosen, weights, gate_up, down, activation, gate_up_bias, down_bias)
        except RuntimeError:  # (shapes the probe's product passed and these do not: each chosen expert from now on)
            if capturing:  # (a capture that failed: the runtime goes on without graphs, as for any)
                raise
            _GROUPED[(h.device.type, h.dtype)] = False
    if not capturing:
        way = _each_chosen_expert
    else:
        way = _every_expert if chosen.numel() > gate_up.shape[0] else _gathered_experts
    return way(h, chosen, weights, gate_up, down, activation, gate_up_bias, down_bias)


def _each_chosen_expert(h, chosen, weights, gate_up, down, activation: str, gate_up_bias=None,
                        down_bias=None) -> torch.Tensor:
    """routed_experts by each chosen expert once on its tokens (which experts: read on the host)."""
    mixed = h.new_zeros(h.shape, dtype=torch.promote_types(h.dtype, weights.dtype))
    for expert in chosen.unique().tolist():
        token, slot = (chosen == expert).nonzero(as_tuple=True)
        biases = (None, None) if gate_up_bias is None else (gate_up_bias[expert], down_bias[expert])
        out = F.linear(_glu(F.linear(h[token], gate_up[expert], biases[0]), activation), down[expert], biases[1])
        mixed.index_add_(0, token, out * weights[token, slot, None])
    return mixed


def _gathered_experts(h, chosen, weights, gate_up, down, activation: str, gate_up_bias=None,
                      down_bias=None) -> torch.Tensor:
    """routed_experts by each (token, expert) pair's weights gathered (a copy of k experts' a token)."""
    ids = chosen.reshape(-1)  # (n k,)
    gate_up_out = torch.bmm(gate_up[ids], h.repeat_interleave(chosen.shape[1], 0)[:, :, None])[..., 0]  # (n k, 2I)
    gate_up_out = gate_up_out if gate_up_bias is None else gate_up_out + gate_up_bias[ids]
    out = torch.bmm(down[ids], _glu(gate_up_out, activation)[:, :, None])[..., 0]  # (n k, hidden)
    out = out if down_bias is None else out + down_bias[ids]
    return (out * weights.reshape(-1, 1)).view(*chosen.shape, -1).sum(1)


def _grouped_experts(h, chosen, weights, gate_up, down, activation: str, gate_up_bias=None,
                     down_bias=None) -> torch.Tensor:
    """routed_experts by torch._grouped_mm: (token, expert) pairs sorted by expert, each expert's
    weights multiplying its run of rows; counted on the device (nothing read on the host)."""
    n, k = chosen.shape
    flat = chosen.reshape(-1)
    order = flat.argsort(stable=True)  # (n k,) the pairs, expert by expert
    counts = torch.zeros(gate_up.shape[0], dtype=torch.int32, device=h.device)
    ends = counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32)).cumsum(0, dtype=torch.int32)
    gate_up_out = torch._grouped_mm(h[order // k], gate_up.transpose(1, 2), offs=ends)  # (n k, 2I), by expert
    gate_up_out = gate_up_out if gate_up_bias is None else gate_up_out + gate_up_bias[flat[order]]
    out = torch._grouped_mm(_glu(gate_up_out, activation), down.transpose(1, 2), offs=ends)
    out = out if down_bias is None else out + down_bias[flat[order]]
    pairs = torch.empty_like(out).index_copy_(0, order, out)  # (n k, hidden), back in token order
    return (pairs * weights.reshape(-1, 1)).view(n, k, -1).sum(1)


def _every_expert(h, chosen, weights, gate_up, down, activation: str, gate_up_bias=None,
                  down_bias=None) -> torch.Tensor:
    """routed_experts with no size depending on the routing: every expert on every token, the unchosen
    weighted by 0."""
    gate_up_out = torch.matmul(h, gate_up.transpose(1, 2))  # (E, n, 2I)
    gate_up_out = gate_up_out if gate_up_bias is None else gate_up_out + gate_up_bias[:, None]
    out = torch.matmul(_glu(gate_up_out, activation), down.transpose(1, 2))  # (E, n, hidden)
    out = out if down_bias is None else out + down_bias[:, None]
    routing = torch.zeros(h.shape[0], gate_up.shape[0], dtype=weights.dtype, device=h.device).scatter(1, chosen, weights)
    return (out * routing.T[..., None]).sum(0)


GATHERED_PAIRS = 4  # (token, expert) pairs an expert, at most, that a compiled graph multiplies by gathered weights
_GROUPED: dict[tuple, bool] = {}  # (device type, dtype) -> whether torch._grouped_mm runs there


def _groups(h: torch.Tensor, capturing: bool) -> bool:
    """Whether torch's grouped product runs on h's device and dtype (this torch has it; a CUDA one
    for bfloat16 on recent GPUs): tried once on a small product (never while a CUDA graph is
    captured: until then, no)."""
    key = (h.device.type, h.dtype)
    if key not in _GROUPED:
        if capturing or not hasattr(torch, "_grouped_mm"):
            return False
        try:
            a, b = torch.ones(2, 16, dtype=h.dtype, device=h.device), torch.ones(2, 32, 16, dtype=h.dtype, device=h.device)
            offsets = torch.tensor([1, 2], dtype=torch.int32, device=h.device)
            _GROUPED[key] = bool((torch._grouped_mm(a, b.transpose(1, 2), offs=offsets) == 16).all())
        except Exception:  # noqa: BLE001 - not for this device or dtype
            _GROUPED[key] = False
    return _GROUPED[key]


_EXPERTS_OPERATOR: bool | None = None


def register_experts_operator() -> bool:
    """rsd::experts (routed_experts) for compiled graphs, registered once; False where this torch
    cannot register it (graphs then run every expert on every token)."""
    global _EXPERTS_OPERATOR
    if _EXPERTS_OPERATOR is None:
        _EXPERTS_OPERATOR = False
        if hasattr(torch.library, "custom_op"):
            try:
                @torch.library.custom_op("rsd::experts", mutates_args=(), schema="(Tensor h, Tensor chosen, "
                                         "Tensor weights, Tensor gate_up, Tensor down, str activation, "
                                         "Tensor? gate_up_bias=None, Tensor? down_bias=None) -> Tensor")
                def experts_operator(h, chosen, weights, gate_up, down, activation, gate_up_bias=None, down_bias=None):
                    return routed_experts(h, chosen, weights, gate_up, down, activation, gate_up_bias, down_bias)

                @experts_operator.register_fake
                def _(h, chosen, weights, gate_up, down, activation, gate_up_bias=None, down_bias=None):
                    return h.new_empty(h.shape, dtype=torch.promote_types(h.dtype, weights.dtype))

                _EXPERTS_OPERATOR = True
            except Exception:  # noqa: BLE001 - an API that differs in this torch
                pass
    return _EXPERTS_OPERATOR


class LayerWeights(NamedTuple):
    """A decoder layer's tensors as decoder_layer takes them, each None where the layer has no such
    part (see decoder_layer for what each family holds)."""

    ln1: Any  # the norm before attention: a weight, or a LayerNorm's (weight, bias) (norm_of)
    wq: Any  # q's weight; on a GPU q, k and v's stacked; GPT-NeoX's q, k and v head by head
    bq: Any
    wk: Any
    bk: Any
    wv: Any  # (Gemma 4: None where v is k's product)
    bv: Any
    wo: Any
    bo: Any
    ln2: Any  # the norm before the MLP
    wg: Any  # the MLP's gate; on a GPU gate and up stacked
    wu: Any
    wd: Any
    q_norm: Any  # norms of each head of q and k, or of all of them (OLMo)
    k_norm: Any
    after_attention: Any  # norms of each block's output before it joins the residual (Gemma 2 and 3, OLMo)
    after_mlp: Any
    experts: Any = None  # a mixture of experts instead of the MLP (experts_of)
    bu: Any = None  # the up and down products' biases of an MLP without a gate
    bd: Any = None
    sinks: Any = None  # gpt-oss's attention sinks (heads,)
    constants: Any = None  # the activation's own (Apertus's xIELU: xielu_constants)
    side_input: Any = None  # Gemma 4's per-layer input's weights (side_weights)
    scalar: Any = None  # Gemma 4's layer scalar
    shared: bool = False  # Gemma 4: q only, the keys and values an earlier layer's (reads_earlier_cache)
    beside: Any = None  # Gemma 4 26B-A4B's experts beside the MLP (gemma4_experts)
    latent: Any = None  # multi-head latent attention's weights (latent_weights)
    laurel: Any = None  # Gemma 3n's learned residual beside attention (laurel_weights)
    sparsity: Any = None  # Gemma 3n: the MLP gate's cut-off, in standard deviations above its mean (gate_cutoff)
    altup: Any = None  # Gemma 3n's alternating updates of its streams around the layer (altup_weights)
    conv: Any = None  # LFM2's short convolution in attention's place (conv_weights), its products wq's and wo's
    delta: Any = None  # Qwen3.5's gated delta net in attention's place (delta_weights), its products wq/wk/wv/wo's
    mamba: Any = None  # Granite 4's Mamba-2 mixer in attention's place (mamba_weights), its products wq's and wo's


class LayerKernels(NamedTuple):
    """The CPU kernels (small_batch.kernels_of, each a tuple) of a decoder layer's linears, or None
    where it has no such linear: _linear's `small`."""

    q: Any
    k: Any
    v: Any
    o: Any
    gate: Any
    up: Any
    down: Any
    side_gate: Any = None  # (Gemma 4's per-layer input's gate and projection: side_linears)
    side_projection: Any = None
    q_a: Any = None  # (latent attention's: latent_linears)
    kv_a: Any = None
    kv_b: Any = None
    laurel_left: Any = None  # (Gemma 3n's learned residual's two products: laurel_linears)
    laurel_right: Any = None


def decoder_layer(x, cos, sin, mask, keys, values, weights: LayerWeights, kernels: LayerKernels, dims: tuple,
                  slots: torch.Tensor | None = None, fused: tuple = (None, None),
                  sight: Sight | None = None, style: Style = Style(),
                  side: torch.Tensor | None = None, temperature: torch.Tensor | None = None,
                  chain: bool = False, fold: tuple | None = None) -> torch.Tensor:
    """One Llama decoder layer on n new tokens (or one of a related family: `style`, and the norms
    `weights` hold).
    x (n, hidden); cos, sin (n, head_dim); mask (n, kv_len) additive (ALiBi's (heads, n, kv_len), each
    head's biases in it), the new tokens at slots
    kv_len - n .. kv_len - 1 of keys, values (kv_heads, capacity, head_dim), written in place. With
    `slots` (n,) (static shapes, what a CUDA graph replays) the new tokens go to those slots and the
    mask covers the whole capacity: no size depends on the cache's length. `weights` are the layer's
    tensors (LayerWeights), `kernels` the CPU kernels of its linears (LayerKernels), dims = (heads, kv_heads,
    head_dim, scaling, eps). Every layer of a model (and of its early-exit draft, adapter included)
    has the same shapes: one compiled graph serves them all.
    `fused` = (q, k and v's quantised blocks in one, gate and up's in one) or None each (fused_blocks):
    one call of the blocks kernel instead of three or two, the same arithmetic for every output. On a
    GPU wk, wv and wu are None: wq holds q, k and v's weights stacked and wg gate and up's
    (stack_projections), one product instead of three and one instead of two. `sight` (see Sight):
    the keys attention reads and how, where fewer than all of them or plainly causal. Norms' weights
    are norm_weight's, each None where the family has no such norm (layer_norms): `ln1` before
    attention and `ln2` before the MLP (OLMo has neither), `after_attention` and `after_mlp` on each
    block's output before it joins the residual (Gemma 2 and 3, OLMo; not Llama). q_norm and k_norm
    norm each head (Qwen3, Gemma 3) or, as wide as q and k, the whole of them (OLMo). `experts`: a
    mixture of experts' weights (mixture_of_experts) where the MLP is one, its wg, wu and wd then None.
    An MLP without a gate (`style.gated` off: StarCoder2, Nemotron, Arcee, Phi, GPT-NeoX, Apertus, OPT,
    GPT-2, GPT-BigCode) has wg None, and bu and bd its up and down products' biases where it has
    them. With `style.interleaved` (GPT-NeoX, GPT-BigCode without multi-query) wq is q, k and v's one
    linear, its outputs head by head, and wk, wv None. A LayerNorm's weight is a (weight, bias) pair
    (norm_of). `sinks` (heads,): gpt-oss's attention sinks, or None; `constants`: the activation's own
    (Apertus's xIELU: xielu_constants), or None. Gemma 4: wv None where v is k's product (before k's
    norm), `shared` where the layer computes q only and reads keys and values an earlier layer wrote
    (the buffers given are that layer's), `side_input` (side_weights) with `side` (n, width) this
    layer's per-layer input, added after the MLP, and `scalar` what the layer's output is multiplied by;
    `beside` (the MLP's own norm after it, gemma4_experts') a mixture of experts beside the MLP. `latent`
    (latent_weights') where attention is latent (DeepSeek's, MiniCPM3's): wq then makes each head's
    q, of q_proj or q_b_proj, and keys, values hold the latents and the keys' rotated parts.
    Gemma 3n: `altup` (altup_weights) where x is its streams (streams, n, hidden), run around the
    layer by _altup_layer, which gives this body the active stream; `laurel` (laurel_weights) its
    learned residual beside attention; `sparsity` (gate_cutoff) where the MLP's gate keeps only its
    largest values. `temperature` (n,) float32: what each new token's q is multiplied by (Llama 4's layers
    without a rotation: attention_temperatures), or None. LFM2: `conv` (conv_weights) where a short
    convolution is in attention's place (_short_conv), keys then each token's input to it. Qwen3.5:
    `delta` (delta_weights) where a gated delta net is (_gated_delta), wq, wk, wv and wo then its products
    of q/k/v, z, b and the output, keys each token's input to its convolution and values its k, g and u.
    Granite 4: `mamba` (mamba_weights) where a Mamba-2 mixer is (_mamba), wq and wo its input and output
    products, keys each token's input to its convolution and values its B, dt x and dt A (Nemotron-H's too, its
    blocks paired: PairedBlocks; wd and experts None where a layer has no MLP). `chain`: the new
    tokens are a chain after every key before them, at the end of the cache (a prompt: those two by chunks).
    `fold`: where those two read the keys after some slot and, for the keys before it, the state they add up
    to (state, the mask and values from that slot on; StaticLM._fold), or None (every key).
    Attention itself: _attention, _latent_attention."""
    if weights.altup is not None:  # (Gemma 3n: the streams around the layer)
        return _altup_layer(x, cos, sin, mask, keys, values, weights, kernels, dims, slots, fused, sight, style, side)
    in_float = style.norm_in_float
    eps = dims[4]
    n = x.shape[0]
    # stacked blocks where the blocks kernel serves this many rows (prompts: where it measured faster)
    on_blocks = n <= MAX_ROWS or kernels.q[0][2] == "blocks"
    fused = fused if on_blocks and not torch.compiler.is_compiling() else (None, None)
    # (OLMo: no norm before attention; Mamba-2's float32 residual read in the weights' dtype)
    h = x if weights.ln1 is None else _rms_norm(x.to(weights.ln1.dtype) if style.residual_in_float else x,
                                                 weights.ln1, eps, in_float, style.centred)
    normed = h
    if weights.conv is not None:  # (LFM2's short convolution)
        out = _short_conv(h, weights, kernels, mask, keys, slots)
    elif weights.delta is not None:  # (Qwen3.5's gated delta net)
        out = _gated_delta(h, weights, kernels, mask, keys, values, slots, chain, fold)
    elif weights.mamba is not None:  # (Granite 4's Mamba-2 mixer)
        out = _mamba(h, weights, kernels, mask, keys, values, slots, chain, fold)
    elif weights.latent is not None:  # (multi-head latent attention: DeepSeek's, MiniCPM3's, Youtu's)
        out = _latent_attention(h, weights.wq, weights.latent, kernels, dims, cos, sin, mask, keys, values, slots,
                                sight, style)
    else:
        out = _attention(h, weights, kernels, dims, cos, sin, mask, keys, values, slots, fused, sight, style,
                         temperature)
    attended = _linear(out.transpose(0, 1).reshape(n, -1), weights.wo, weights.bo, kernels.o,
                       style.bias_after_product)
    if style.residual_scale != 1.0:  # (Granite)
        attended = attended * style.residual_scale
    residual = x
    if weights.after_attention is not None:
        attended = _rms_norm(attended, weights.after_attention, eps, in_float)
    if not style.parallel_sum:
        x = x + attended
    if weights.laurel is not None:  # (Gemma 3n: a low-rank residual of the normed input, averaged in)
        left, right, laurel_norm = weights.laurel
        low = _linear(_linear(normed, left, None, kernels.laurel_left), right, None, kernels.laurel_right)
        x = (x + (normed + _rms_norm(low, laurel_norm, eps, in_float))) / math.sqrt(2)
    if weights.wd is None and weights.experts is None:  # (no MLP: a Nemotron-H mixer's or attention's block alone)
        return x
    if style.parallel:  # (Cohere, Phi: ln1's output; GPT-NeoX: ln2 of the layer's input)
        h = normed if weights.ln2 is None else _rms_norm(residual, weights.ln2, eps, in_float)
    else:
        h = x if weights.ln2 is None else _rms_norm(x, weights.ln2, eps, in_float)
    if weights.experts is not None:
        mlp = mixture_of_experts(h, weights.experts, style)
    else:
        if not style.gated:
            up = _linear(h, weights.wu, weights.bu, kernels.up, style.bias_after_product)
            hidden = _activation(up, style.activation, weights.constants)
        else:
            if weights.wu is None:  # (stacked float weights)
                gate, up = _linear(h, weights.wg, None, kernels.gate).chunk(2, -1)
            elif fused[1] is not None:
                gate, up = blocks_linear(h, fused[1]).chunk(2, -1)
            else:
                gate, up = _linear(h, weights.wg, None, kernels.gate), _linear(h, weights.wu, None, kernels.up)
            if weights.sparsity is not None:  # (Gemma 3n's first layers)
                gate = _gate_kept(gate, weights.sparsity)
            hidden = _activation(gate, style.activation) * up
        mlp = _linear(hidden, weights.wd, weights.bd, kernels.down, style.bias_after_product)
    # (Gemma 4 26B-A4B: the MLP's output normed, experts' beside it on the block's input)
    if weights.beside is not None:
        mlp_after, routed = weights.beside
        mlp = _rms_norm(mlp, mlp_after, eps, in_float) + experts_beside(x, routed, style.experts, style.activation, eps)
    if style.residual_scale != 1.0:
        mlp = mlp * style.residual_scale
    joined = mlp if weights.after_mlp is None else _rms_norm(mlp, weights.after_mlp, eps, in_float)
    # (GPT-NeoX, Phi, GPT-J, Falcon: the MLP's output plus attention's, then the residual)
    x = joined + attended + residual if style.parallel_sum else x + joined
    # (Gemma 4: the layer's own input, gated by its output, projected, normed, added)
    if weights.side_input is not None:
        gate_weight, projection, side_norm = weights.side_input
        gated = _activation(_linear(x, gate_weight, None, kernels.side_gate), style.activation) * side
        x = x + _rms_norm(_linear(gated, projection, None, kernels.side_projection), side_norm, eps, in_float)
    return x if weights.scalar is None else x * weights.scalar


def _short_conv(h, weights: LayerWeights, kernels: LayerKernels, mask, keys, slots) -> torch.Tensor:
    """LFM2's short convolution on the normed input h (n, hidden), in attention's place, as its
    Lfm2ShortConv computes it: B, C and x of one product (wq's), the convolution of B * x along each
    row's path (_convolved), times C. (1, n, hidden): one head as wide as the layer, before the
    output's product."""
    taps, bias = weights.conv
    b, c, x = _linear(h, weights.wq, weights.bq, kernels.q).chunk(3, -1)
    return (c * _convolved(b * x, taps, bias, mask, keys, slots).to(c.dtype))[None]


def _convolved(inputs, taps, bias, mask, keys, slots) -> torch.Tensor:
    """A causal depthwise convolution (LFM2's, Qwen3.5's of q, k and v) of the new tokens' inputs (n,
    width), along each row's path: the inputs written at their slots of `keys` (1, capacity, width) as
    attention writes its keys, each row convolving the latest K of them it sees (latest_seen: itself and
    its last ancestors, along a tree's path too, where a state carried from token to token would have
    read its siblings). taps (K, width): the weight of each row's latest input first; bias (width,) or
    None. (n, width) float32, as torch's convolution sums."""
    n, kv_len = inputs.shape[0], mask.shape[-1]
    if slots is None:
        keys[0, kv_len - n: kv_len] = inputs
        stored = keys[0, :kv_len]
    else:
        keys[0].index_copy_(0, slots, inputs)
        stored = keys[0]
    latest = latest_seen(mask, taps.shape[0])  # (n, K)
    read = stored[latest.clamp(min=0)] * (latest >= 0)[..., None].to(stored.dtype)  # (n, K, width)
    out = (read.float() * taps.float()).sum(1)
    return out if bias is None else out + bias.float()


def _gated_delta(h, weights: LayerWeights, kernels: LayerKernels, mask, keys, values, slots,
                 chain: bool = False, fold: tuple | None = None) -> torch.Tensor:
    """Qwen3.5's gated delta net on the normed input h (n, hidden), in attention's place, as its
    Qwen3_5GatedDeltaNet computes it — read along each row's path instead of from a state carried
    from token to token: q, k and v convolved (_convolved) and their SiLU, q and k L2-normed (q by
    1/sqrt(dk) too), beta the sigmoid of b's product, each token's decay g = -exp(A_log) softplus(a's
    product + dt_bias). Its state after token t of a path is S_t = exp(g_t) S_(t-1) + k_t u_t^T, u_t =
    beta_t (v_t - exp(g_t) S_(t-1)^T k_t): unrolled, S_t is the sum over the path's tokens j of
    exp(G_t - G_j) k_j u_j^T (G the sum of g along the path). So each token keeps at its slot of `values`
    (1, capacity, hk dk + hv + hv dv) float32 its k, g and u, as attention keeps its keys; a new row's u
    solves the lower-triangular system (I + A) U = beta V - (what the keys before the new rows take
    away), A[t, j] = beta_t exp(G_t - G_j) k_t.k_j over the new rows it sees, and its output is
    q_t.S_t, a sum over every key it sees — its path's, whatever the tree: O(keys) a row, as attention
    (transformers' state is O(1), but a tree's siblings would all be read into it). Then the output
    RMS-normed per head, times z's SiLU. (1, n, hv dv). With `chain` (a prompt), the rows by chunks
    from the state the keys before them add up to (_delta_along_chain). With `fold` (state (hv, dk, dv),
    mask and values from a slot on), the sums go over the keys from that slot on, the state standing
    for those before it (decayed by every key a row sees after them); a chain then leaves its own last
    state there."""
    a_weight, taps, rate, dt_bias, norm, (hk, hv, dk, dv), eps = weights.delta
    n = h.shape[0]
    if a_weight is None:  # (Qwen3-Next: q, k, v and z's products in one and b and a's in another, by key head)
        r = hv // hk
        q, k, v, z = _linear(h, weights.wq, None, kernels.q).view(n, hk, -1).split([dk, dk, r * dv, r * dv], -1)
        b, a = _linear(h, weights.wk, None, kernels.k).view(n, hk, 2 * r).split([r, r], -1)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], -1)
        z, b, a = z.reshape(n, hv * dv), b.reshape(n, hv), a.reshape(n, hv)
    elif weights.wk is None:  # (stacked on a GPU: q/k/v's, z's and b's weights in one)
        mixed, z, b = _linear(h, weights.wq, None, kernels.q).split([taps.shape[1], hv * dv, hv], -1)
    else:
        mixed, z, b = (_linear(h, w, None, k) for w, k in ((weights.wq, kernels.q), (weights.wk, kernels.k),
                                                             (weights.wv, kernels.v)))
    if a_weight is not None:
        a = F.linear(h, a_weight)
    mixed = F.silu(_convolved(mixed, taps, None, mask, keys, slots).to(h.dtype))
    q, k, v = mixed.float().split([hk * dk, hk * dk, hv * dv], -1)
    q, k = (t.view(n, hk, dk) for t in (q, k))
    q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    q = q * dk ** -0.5
    beta = torch.sigmoid(b).float()  # (n, hv)
    g = rate * F.softplus(a.float() + dt_bias)  # (n, hv) float32
    state, mask, values = (None, mask, values) if fold is None else fold  # (the sums' keys: those from the fold on)
    kv_len = mask.shape[-1]
    new, store = _slots_and_store(values, slots, n, kv_len)  # store (kv_len, hk dk + hv + hv dv)
    kept = hk * dk + hv
    store[:, :kept].index_copy_(0, new, torch.cat([k.reshape(n, -1), g], -1).to(store.dtype))
    keys_seen, u_seen, rates = _state_parts(store, weights)  # (kv_len, hv, dk), (kv_len, hv, dv), (kv_len, hv)
    k, q = (t.repeat_interleave(hv // hk, 1) for t in (k, q))  # (n, hv, dk)
    if chain:
        past = kv_len - n
        start = _state_of(keys_seen[:past], u_seen[:past], rates[:past])
        if state is not None:
            start = start + _decayed(state, rates[:past])
        out, u, end = _delta_along_chain(q.transpose(0, 1), k.transpose(0, 1), v.view(n, hv, dv).transpose(0, 1), g.T,
                                         beta.T, start)
        store[:, kept:].index_copy_(0, new, u.transpose(0, 1).reshape(n, hv * dv).to(store.dtype))
        if state is not None:
            state.copy_(end)
        return _gated_norm(out, z, norm, eps, h.dtype, (n, hv, dv))
    seen = mask > -math.inf
    decay, carried = _path_decays(rates, seen, state is not None)  # (hv, n, kv_len), (hv, n)
    system = beta.T[..., None] * decay * torch.einsum("thd,jhd->htj", k, keys_seen)  # (hv, n, kv_len)
    before = torch.ones(kv_len, dtype=torch.bool, device=h.device).index_fill(0, new, False)
    u_seen = u_seen.transpose(0, 1)  # (hv, kv_len, dv): the new rows' stale
    taken = (system * before) @ u_seen
    if state is not None:  # (the keys before the fold: their state, decayed by every key the row sees)
        carried = carried[..., None]  # (hv, n, 1)
        taken = taken + beta.T[..., None] * carried * (k.transpose(0, 1) @ state)
    u = torch.linalg.solve_triangular(system.index_select(-1, new), beta.T[..., None] * v.view(n, hv, dv).transpose(0, 1)
                                      - taken, upper=False, unitriangular=True)  # (hv, n, dv)
    store[:, kept:].index_copy_(0, new, u.transpose(0, 1).reshape(n, hv * dv).to(store.dtype))
    out = (decay * torch.einsum("thd,jhd->htj", q, keys_seen)) @ u_seen  # (hv, n, dv)
    if state is not None:
        out = out + carried * (q.transpose(0, 1) @ state)
    return _gated_norm(out, z, norm, eps, h.dtype, (n, hv, dv))


def _state_parts(store: torch.Tensor, weights: LayerWeights) -> tuple:
    """A gated delta net's (k, u, g) or a Mamba-2 mixer's (B, dt x, dt A) as its keys keep them in `store`
    (kv_len, width): the two whose products its state sums, (kv_len, heads, a) and (kv_len, heads, b), and
    the log decays (kv_len, heads). Views: what is written to the store later shows in them."""
    kv_len = store.shape[0]
    if weights.delta is not None:
        hk, hv, dk, dv = weights.delta[5]
        left, rates, right = store.split([hk * dk, hv, hv * dv], -1)
        return left.view(kv_len, hk, dk).repeat_interleave(hv // hk, 1), right.view(kv_len, hv, dv), rates
    heads, width, groups, size, _ = weights.mamba[6]
    left, right, rates = store.split([groups * size, heads * width, heads], -1)
    return left.view(kv_len, groups, size).repeat_interleave(heads // groups, 1), right.view(kv_len, heads, width), rates


def state_shape(weights: LayerWeights) -> tuple[int, int, int]:
    """(heads, a, b) of the state a gated delta net's (hv, dk, dv) or a Mamba-2 mixer's (heads, B's size,
    head width) keys add up to."""
    if weights.delta is not None:
        _, hv, dk, dv = weights.delta[5]
        return hv, dk, dv
    heads, width, _, size, _ = weights.mamba[6]
    return heads, size, width


def _decayed(state: torch.Tensor, rates: torch.Tensor) -> torch.Tensor:
    """A state (heads, a, b) after keys of log decays `rates` (kv, heads) that added nothing to it."""
    return rates.sum(0).exp()[:, None, None] * state


def _slots_and_store(values, slots, n: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the n new rows' slots, the (kv_len, width) values they are read and written in): `slots`, or the last
    n of the used length without them."""
    if slots is not None:
        return slots, values[0]
    return torch.arange(kv_len - n, kv_len, device=values.device), values[0, :kv_len]


def _gated_norm(out, z, norm, eps: float, dtype, shape: tuple) -> torch.Tensor:
    """A gated delta net's output (hv, n, dv) float32 in its dtype, RMS-normed per head (Llama's norm),
    times z's SiLU: (1, n, hv dv)."""
    n, hv, dv = shape
    out = out.transpose(0, 1).to(dtype).float()  # (n, hv, dv)
    normed = norm * (out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (normed * F.silu(z.view(n, hv, dv).float())).to(dtype).reshape(1, n, hv * dv)


def _state_of(left: torch.Tensor, right: torch.Tensor, rates: torch.Tensor) -> torch.Tensor:
    """(heads, a, b): the state keys (kv, heads, a) and (kv, heads, b) add up to after the last of them,
    each decayed by exp of the sum of the log decays `rates` (kv, heads) of the keys after it — a gated
    delta net's sum of k u^T, a Mamba-2 mixer's of B (dt x)^T."""
    return torch.einsum("jha,jh,jhb->hab", left, _sums_after(rates, 0).exp(), right)


def _delta_along_chain(q, k, v, g, beta, state, chunk: int | None = None) -> tuple:
    """The gated delta rule over a chain of rows by chunks, from `state` (hv, dk, dv), as transformers'
    torch_chunk_gated_delta_rule computes it (its UT transform), returning each row's update u and the
    state after the last row too: q (scaled), k (hv, n, dk) L2-normed, v (hv, n, dv), g and beta (hv, n),
    float32. (out (hv, n, dv), u (hv, n, dv), state (hv, dk, dv))."""
    chunk = chunk or CHAIN_ROWS
    outs, updates = [], []
    for start in range(0, q.shape[1], chunk):
        qc, kc, vc = q[:, start: start + chunk], k[:, start: start + chunk], v[:, start: start + chunk]
        gc, bc = g[:, start: start + chunk].cumsum(-1), beta[:, start: start + chunk]
        decay = _chunk_decays(gc)
        system = (bc[..., None] * kc) @ kc.transpose(1, 2) * decay
        u = torch.linalg.solve_triangular(system, bc[..., None] * (vc - gc.exp()[..., None] * (kc @ state)),
                                          upper=False, unitriangular=True)
        outs.append(gc.exp()[..., None] * (qc @ state) + (qc @ kc.transpose(1, 2) * decay) @ u)
        updates.append(u)
        last = gc[:, -1:]
        state = last.exp()[..., None] * state + (kc * (last - gc).exp()[..., None]).transpose(1, 2) @ u
    return torch.cat(outs, 1), torch.cat(updates, 1), state


def _path_decays(rates: torch.Tensor, seen: torch.Tensor, state: bool) -> tuple:
    """(heads, n, kv_len): exp of the sum of each key's log decay `rates` (kv_len, heads) over the keys
    a row sees (`seen` (n, kv_len)) after a key, the row's own included, as far as that key it sees — 0
    where it sees none. Summed from the newest key back: exact where it matters, near the row. With
    `state`, also (heads, n): how much of a state before every key is left at each row — exp of the sum
    of the log decays of all the keys it sees (else None)."""
    w = torch.where(seen[None], rates.T[:, None, :], 0.0)  # (heads, n, kv_len)
    return torch.where(seen[None], _sums_after(w, -1).exp(), 0.0), w.sum(-1).exp() if state else None


def _sums_after(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Each entry's sum of the entries after it along `dim` (0 for the last), summed from the last back.
    (A 0 after the last first: no size less one, which a compiled graph would take as 1 for two keys.)"""
    x = F.pad(x.movedim(dim, -1), (0, 1))
    return x.flip(-1).cumsum(-1).flip(-1)[..., 1:].movedim(-1, dim)


def _mamba(h, weights: LayerWeights, kernels: LayerKernels, mask, keys, values, slots,
           chain: bool = False, fold: tuple | None = None) -> torch.Tensor:
    """Granite 4's Mamba-2 mixer on the normed input h (n, hidden), in attention's place, as its
    GraniteMoeHybridMambaLayer computes it (its chunked scan's arithmetic) — read along each row's path
    instead of from a state carried from token to token: the gate, x/B/C and dt of one product, x/B/C
    convolved (_convolved) and their SiLU, dt the softplus of dt + dt_bias within its limits. Its state
    after token t of a path, exp(dt_t A) S_(t-1) + dt_t x_t B_t^T, unrolled, makes the output y_t = the
    sum over the path's tokens j of exp(the sum of dt A after j, to t) (C_t.B_j) dt_j x_j, plus D x_t: each
    token keeps its B, dt x and dt A at its slot of `values` (float32), and each row sums over the keys
    it sees (its path's), as attention; then y times the gate's SiLU, RMS-normed by group. (1, n, inner).
    With `chain` (a prompt), the rows by chunks from the state the keys before them add up to
    (_mamba_along_chain); `fold` as _gated_delta's."""
    taps, conv_bias, rate, dt_bias, skip, norm, (heads, width, groups, size, normed), eps, limits = weights.mamba
    n = h.shape[0]
    inner = heads * width
    gate, mixed, dt = _linear(h, weights.wq, weights.bq, kernels.q).split([inner, taps.shape[1], heads], -1)
    mixed = F.silu(_convolved(mixed, taps, conv_bias, mask, keys, slots).to(h.dtype))
    x, b, c = mixed.split([inner, groups * size, groups * size], -1)
    dt = torch.clamp(F.softplus(dt + dt_bias.to(dt.dtype)), *limits).float()  # (n, heads)
    x = x.float().view(n, heads, width)
    state, mask, values = (None, mask, values) if fold is None else fold  # (the sums' keys: those from the fold on)
    kv_len = mask.shape[-1]
    new, store = _slots_and_store(values, slots, n, kv_len)  # store (kv_len, groups size + inner + heads)
    record = torch.cat([b.float(), (x * dt[..., None]).reshape(n, inner), rate * dt], -1)
    store.index_copy_(0, new, record.to(store.dtype))
    b_seen, xdt_seen, rates = _state_parts(store, weights)  # (kv_len, heads, size), (kv_len, heads, width), (kv_len, heads)
    c = c.float().view(n, groups, size).repeat_interleave(heads // groups, 1)  # (n, heads, size)
    if chain:
        past = kv_len - n
        start = _state_of(b_seen[:past], xdt_seen[:past], rates[:past])
        if state is not None:
            start = start + _decayed(state, rates[:past])
        y, end = _mamba_along_chain(c.transpose(0, 1), b_seen[past:].transpose(0, 1), xdt_seen[past:].transpose(0, 1),
                                    (rate * dt).T, start)
        if state is not None:
            state.copy_(end)
    else:
        seen = mask > -math.inf
        decay, carried = _path_decays(rates, seen, state is not None)  # (heads, n, kv_len), (heads, n)
        y = (decay * torch.einsum("thn,jhn->htj", c, b_seen)) @ xdt_seen.transpose(0, 1)  # (heads, n, width)
        if state is not None:  # (the keys before the fold: their state, decayed by every key the row sees)
            y = y + carried[..., None] * (c.transpose(0, 1) @ state)
    y = y.transpose(0, 1) + skip.float()[:, None] * x  # (n, heads, width)
    gated = y.reshape(n, inner) * F.silu(gate.float())
    by_group = gated.view(n, normed, -1)
    normed = (by_group * torch.rsqrt(by_group.pow(2).mean(-1, keepdim=True) + eps)).view(n, inner)
    return (norm * normed).to(h.dtype)[None]


def _chunk_decays(cumulative: torch.Tensor) -> torch.Tensor:
    """(heads, rows, rows): within a chunk, exp(G_i - G_j) for j <= i of the log decays' running sums
    `cumulative` (heads, rows), 0 above the diagonal."""
    rows = cumulative.shape[1]
    lower = torch.ones(rows, rows, dtype=torch.bool, device=cumulative.device).tril()
    return (cumulative[:, :, None] - cumulative[:, None, :]).masked_fill(~lower, -math.inf).exp()


def _mamba_along_chain(c, b, xdt, rates, state, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A Mamba-2 mixer's scan over a chain of rows by chunks, from `state` (heads, size, width), as
    transformers' mamba2_chunk_scan computes it: c, b (heads, n, size), xdt (heads, n, width), rates
    (heads, n) each row's dt A, float32. ((heads, n, width) before D's skip, the state after the last row)."""
    chunk = chunk or CHAIN_ROWS
    outs = []
    for start in range(0, c.shape[1], chunk):
        cc, bc, xc = c[:, start: start + chunk], b[:, start: start + chunk], xdt[:, start: start + chunk]
        gc = rates[:, start: start + chunk].cumsum(-1)
        decay = _chunk_decays(gc)
        outs.append((cc @ bc.transpose(1, 2) * decay) @ xc + gc.exp()[..., None] * (cc @ state))
        last = gc[:, -1:]
        state = last.exp()[..., None] * state + (bc * (last - gc).exp()[..., None]).transpose(1, 2) @ xc
    return torch.cat(outs, 1), state


def latest_seen(mask: torch.Tensor, count: int) -> torch.Tensor:
    """(n, count): the slots of the latest `count` keys each row of an additive mask (n, kv_len) sees,
    latest first, -1 past the first one it sees."""
    n, kv_len = mask.shape
    seen = torch.where(mask > -math.inf, torch.arange(kv_len, device=mask.device), -1)
    return torch.cat([seen, seen.new_full((n, count), -1)], 1).topk(count, -1).values


def _gate_kept(gate: torch.Tensor, cutoff: torch.Tensor) -> torch.Tensor:
    """Gemma 3n's activation sparsity: each row of the MLP's gate less its mean plus `cutoff` (a float32
    number, gate_cutoff) standard deviations, negatives 0 — as its _gaussian_topk computes it."""
    mean = torch.mean(gate, dim=-1, keepdim=True)
    std = torch.std(gate, dim=-1, keepdim=True, unbiased=False)
    return F.relu(gate - (mean + std * cutoff.to(gate.dtype)))


def _altup_layer(streams, cos, sin, mask, keys, values, weights: LayerWeights, kernels: LayerKernels, dims: tuple,
                 slots, fused, sight, style: Style, side) -> torch.Tensor:
    """A Gemma 3n decoder layer on its streams (streams, n, hidden) (AltUp, as transformers'
    Gemma3nTextAltUp computes it): each stream predicted from all of them by coefficients a router
    reads off the active one; the layer (decoder_layer's body) on the active prediction; every
    prediction corrected by what the layer changed; and this layer's per-layer input `side` (n,
    width), gated by the corrected active stream (scaled), added to the other streams."""
    router_norm, input_scale, router, predict, correct, scale, active = weights.altup
    eps, count, n = dims[4], streams.shape[0], streams.shape[1]

    def modalities(x: torch.Tensor) -> torch.Tensor:  # (n, streams)
        routed = F.linear(_rms_norm(x, router_norm, eps, True) * input_scale, router)
        return torch.tanh(routed.float()).type_as(x)

    coefficients = F.linear(modalities(streams[active]), predict).reshape(n, count, count).permute(0, 2, 1)
    predictions = (torch.matmul(streams.permute(1, 2, 0), coefficients).permute(2, 0, 1) + streams).type_as(streams)
    out = decoder_layer(predictions[active], cos, sin, mask, keys, values,
                        weights._replace(altup=None, side_input=None), kernels, dims, slots, fused, sight, style)
    innovation = (out - predictions[active]).repeat(count, 1, 1)  # (streams, n, hidden)
    by_stream = (F.linear(modalities(out), correct) + 1.0).permute(1, 0).unsqueeze(-1)  # (streams, n, 1)
    corrected = (innovation * by_stream + predictions).type_as(out)
    first = corrected[active]
    if scale is not None:  # (its `altup_correct_scale`)
        first = (first.type_as(scale) * scale).type_as(first)
    gate_weight, projection, side_norm = weights.side_input
    gated = _activation(_linear(first, gate_weight, None, kernels.side_gate), style.activation) * side
    added = _rms_norm(_linear(gated, projection, None, kernels.side_projection), side_norm, eps, True)
    return torch.cat([corrected[:1], corrected[1:] + added])


def _attention(h, weights: LayerWeights, kernels: LayerKernels, dims: tuple, cos, sin, mask, keys, values, slots, fused,
               sight, style: Style, temperature: torch.Tensor | None = None) -> torch.Tensor:
    """decoder_layer's attention on its normed input h (n, hidden): (heads, n, head_dim), before the
    output's product."""
    wq, bq, wk, bk, wv, bv = weights.wq, weights.bq, weights.wk, weights.bk, weights.wv, weights.bv
    q_norm, k_norm, sinks, shared = weights.q_norm, weights.k_norm, weights.sinks, weights.shared
    in_float = style.norm_in_float
    heads, kv_heads, head_dim, scaling, eps = dims
    n, kv_len = h.shape[0], mask.shape[-1]
    widths = [heads * head_dim * (2 if style.output_gate else 1), kv_heads * head_dim, kv_heads * head_dim]
    if shared:  # (Gemma 4's last layers: the keys and values are an earlier layer's)
        q, k, v = _linear(h, wq, bq, kernels.q), None, None
    elif style.interleaved:  # (GPT-NeoX: each head's q, k and v side by side; Falcon: each key head's group's)
        q, k, v = _linear(h, wq, bq, kernels.q, style.bias_after_product).view(n, kv_heads, -1, head_dim) \
            .split([heads // kv_heads, 1, 1], 2)
        q, k, v = q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)
    elif wk is None:  # (stacked float weights: on a GPU, or a fused linear's own)
        q, k, v = _linear(h, wq, None, kernels.q).split(widths, -1)
        q, k, v = (t if b is None else t + b for t, b in ((q, bq), (k, bk), (v, bv)))  # (Qwen2's biases)
    elif fused[0] is not None:
        q, k, v = blocks_linear(h, fused[0]).split(widths, -1)
        q, k, v = (t if b is None else t + b for t, b in ((q, bq), (k, bk), (v, bv)))  # (Qwen2's biases)
    else:  # (Gemma 4's full-attention layers: v is k's product, where the model says so)
        q, k = _linear(h, wq, bq, kernels.q), _linear(h, wk, bk, kernels.k)
        v = k if wv is None else _linear(h, wv, bv, kernels.v)
    gate = None
    if style.output_gate:  # (Qwen3.5: each head's q, then its gate)
        q, gate = q.view(n, heads, 2 * head_dim).chunk(2, -1)
        q = q.reshape(n, heads * head_dim)
    whole = q_norm is not None and q_norm.shape[0] != head_dim  # (OLMo 2 and 3: q and k normed as a whole)
    if whole:
        q, k = _rms_norm(q, q_norm, eps, in_float), _rms_norm(k, k_norm, eps, in_float)
    q = q.view(n, heads, head_dim)
    by_head = q_norm is not None and not whole  # (each head of q and k RMS-normed)
    if by_head and not style.norm_after_rotation:  # Qwen3, Gemma 3: before the rotation
        q = _rms_norm(q, q_norm, eps, in_float)
    q = _rotated(q.transpose(0, 1), cos, sin, style)  # (H, n, hd)
    if k is not None:
        k = k.view(n, kv_heads, head_dim)
        if by_head and not style.norm_after_rotation:
            k = _rms_norm(k, k_norm, eps, in_float)
        k = _rotated(k.transpose(0, 1), cos, sin, style)  # (KVH, n, hd)
        v = v.view(n, kv_heads, head_dim)
        if style.value_norm:  # (Gemma 4: each head of v normed, without a weight)
            v = _rms_norm(v, None, eps, True)
        v = v.transpose(0, 1)
    if style.query_scaled:  # (OPT: q scaled before its product with k, as its attention computes it)
        q, scaling = q * scaling, 1.0
    if by_head and style.norm_after_rotation:  # Hunyuan, Llama 4: after it
        q, k = _rms_norm(q, q_norm, eps, in_float), _rms_norm(k, k_norm, eps, in_float)
    if temperature is not None:  # (Llama 4's layers without a rotation: q scaled by each token's position)
        q = (q * temperature[None, :, None]).to(q.dtype)
    if k is not None and slots is None:  # (k None: a layer reading what an earlier one wrote)
        keys[:, kv_len - n: kv_len] = k
        values[:, kv_len - n: kv_len] = v
    elif k is not None:
        keys.index_copy_(1, slots, k)
        values.index_copy_(1, slots, v)
    if slots is None:
        k, v = keys[:, :kv_len], values[:, :kv_len]
        if sight is not None and sight.keys is not None:
            k, v = k.index_select(1, sight.keys), v.index_select(1, sight.keys)
    else:
        k, v = keys, values
    grouped = {}
    own_attention = style.softcap or sinks is not None  # (scores that torch's attention kernel cannot take)
    # (Falcon-7B's one key head broadcast over q's heads, as transformers passes it: in half precision torch's
    # kernel for that shape, its math one, rounds otherwise than its grouped one; in float32 within its rounding)
    broadcast = style.broadcast_keys and q.dtype != torch.float32
    if heads != kv_heads and SDPA_GQA and not own_attention and not broadcast:  # grouped-query attention without
        grouped = {"enable_gqa": True}  # copying the cache
    elif heads != kv_heads and not broadcast:
        k, v = k.repeat_interleave(heads // kv_heads, dim=0), v.repeat_interleave(heads // kv_heads, dim=0)
    if style.softcap:  # Gemma 2: scores soft-capped before the mask
        scores = torch.tanh(q @ k.transpose(1, 2) * scaling / style.softcap) * style.softcap + mask.to(q.dtype)
        out = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v  # (H, n, hd)
    elif sinks is not None:  # gpt-oss: each head's sink logit beside every row's scores, its share dropped
        scores = q @ k.transpose(1, 2) * scaling + mask.to(q.dtype)  # (H, n, kv_len)
        scores = torch.cat([scores, sinks.to(scores.dtype)[:, None, None].expand(-1, n, 1)], dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
        out = torch.softmax(scores, dim=-1, dtype=scores.dtype)[..., :-1].to(v.dtype) @ v
    elif style.eager_attention and q.dtype != torch.float32:  # (BLOOM, MPT, GPT-Neo in half precision)
        if sight is not None and sight.mask is None:  # (causal: every key before the new tokens' own seen by all)
            mask = torch.full((n, k.shape[1]), -math.inf, device=q.device).triu(k.shape[1] - n + 1)
        elif sight is not None:
            mask = sight.mask
        out = _eager_attention(q, k, v, mask, scaling, style.eager_attention)
    elif sight is not None and sight.mask is None:  # causal, every key before the new tokens' own seen by all
        before = k.shape[1] - n  # (rows of zeros before the queries: torch's causal attention is top-left)
        q = torch.cat([q.new_zeros(heads, before, head_dim), q], dim=1) if before else q
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], scale=scaling, is_causal=True,
                                             **grouped)[0, :, before:]  # (H, n, hd)
    else:
        mask = mask if sight is None else sight.mask
        mask = mask[None] if mask.dim() == 3 else mask[None, None]  # (ALiBi's: a mask for each head)
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask.to(q.dtype), scale=scaling,
                                             **grouped)[0]
    if gate is not None:  # (Qwen3.5: each head's output times its gate's sigmoid)
        out = out * torch.sigmoid(gate).transpose(0, 1)
    return out


def _eager_attention(q, k, v, mask, scaling: float, kind: str) -> torch.Tensor:
    """Attention of q (H, n, hd) over k and v (H, kv, hd) through the additive mask ((n, kv), or ALiBi's (H, n,
    kv) with each head's biases in it) as BLOOM's, MPT's or GPT-Neo's attention in transformers computes it
    (Style.eager_attention): (H, n, hd)."""
    if kind == "bloom":  # (its baddbmm: the bias plus the scaled scores, rounded once to q's dtype)
        scores = torch.baddbmm(mask.to(q.dtype), q, k.transpose(1, 2), alpha=scaling)
    elif kind == "mpt":  # (the scores rounded to q's dtype, then scaled, rounded again; its float32 bias added)
        scores = (q @ k.transpose(1, 2)) * scaling + mask.float()
    else:  # (GPT-Neo: q and k in float32, the mask there)
        scores = q.float() @ k.float().transpose(1, 2) * scaling + mask.float()
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype) @ v


def _latent_attention(h, wq, latent: tuple, kernels: LayerKernels, dims: tuple, cos, sin, mask, keys, values, slots,
                      sight, style: Style) -> torch.Tensor:
    """Multi-head latent attention (MLA: DeepSeek V2/V3's, MiniCPM3's, Youtu's) on the normed input h
    (n, hidden) as transformers computes it: (heads, n, v_dim), before the output's product. Each
    token's keys and values are one latent (kv_lora_rank wide, normed) and one rotated key part shared
    by every head (qk_rope_head_dim): `keys` (1, capacity, lora) holds the latents and `values` (1,
    capacity, rope) the rotated parts, and every forward expands the cache's latents into each head's
    key and value by kv_b. q from h by wq (q_proj), or by wq (q_b_proj) after q_a and its norm.
    latent: latent_weights'. With `style.latent_pairs` the rotated parts turn by adjacent pairs, their
    halves' outputs side by side (DeepSeek V3's `rope_interleave`), with `style.latent_complex` by
    adjacent pairs in place (DeepSeek V2's complex numbers): _latent_rotated."""
    q_a, q_a_bias, q_a_norm, q_eps, kv_a, kv_a_bias, kv_a_norm, kv_eps, kv_b, (lora, rope, nope, v_dim) = latent
    heads, _, _, scaling, _ = dims
    n, kv_len = h.shape[0], mask.shape[-1]
    in_float = style.norm_in_float
    if q_a is not None:
        h_q = _rms_norm(_linear(h, q_a, q_a_bias, kernels.q_a), q_a_norm, q_eps, in_float)
    q = _linear(h if q_a is None else h_q, wq, None, kernels.q).view(n, heads, nope + rope).transpose(0, 1)
    q_pass, q_rot = q.split([nope, rope], -1)  # (H, n, nope), (H, n, rope)
    latent_and_rot = _linear(h, kv_a, kv_a_bias, kernels.kv_a)
    compressed, k_rot = latent_and_rot.split([lora, rope], -1)
    compressed = _rms_norm(compressed, kv_a_norm, kv_eps, in_float)  # (n, lora)
    q_rot, k_rot = (_latent_rotated(t, cos, sin, style) for t in (q_rot, k_rot[None]))  # (H, n, rope), (1, n, rope)
    if slots is None:
        keys[:, kv_len - n: kv_len] = compressed[None]
        values[:, kv_len - n: kv_len] = k_rot
        every, rotated = keys[0, :kv_len], values[0, :kv_len]
        if sight is not None and sight.keys is not None:
            every, rotated = every.index_select(0, sight.keys), rotated.index_select(0, sight.keys)
    else:
        keys.index_copy_(1, slots, compressed[None])
        values.index_copy_(1, slots, k_rot)
        every, rotated = keys[0], values[0]
    expanded = _linear(every, kv_b, None, kernels.kv_b).view(-1, heads, nope + v_dim).transpose(0, 1)
    k_pass, v = expanded.split([nope, v_dim], -1)  # (H, kv, nope), (H, kv, v_dim)
    k = torch.cat([k_pass, rotated[None].expand(heads, -1, -1)], -1)
    q = torch.cat([q_pass, q_rot], -1)
    mask = mask if sight is None or sight.mask is None else sight.mask
    if sight is not None and sight.mask is None:  # causal, every key before the new tokens' own seen by all
        before = k.shape[1] - n  # (rows of zeros before the queries: torch's causal attention is top-left)
        q = torch.cat([q.new_zeros(heads, before, nope + rope), q], dim=1) if before else q
        return F.scaled_dot_product_attention(q[None], k[None], v[None], scale=scaling, is_causal=True)[0, :, before:]
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask[None, None].to(q.dtype),
                                          scale=scaling)[0]


def _latent_rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: Style) -> torch.Tensor:
    """MLA's rotated part x (heads, n, rope) turned by its rows' angles: by halves, or with
    `style.latent_pairs` by adjacent pairs, each pair's two outputs in the two halves (transformers'
    apply_rotary_pos_emb_interleave: the same values in the same places)."""
    if style.latent_complex:  # (cos and sin: each angle twice in a row, angles_at)
        return (x.float() * cos + rotate_pairs(x).float() * sin).to(x.dtype)
    if not style.latent_pairs:
        return x * cos + rotate_half(x) * sin
    half = cos.shape[-1] // 2
    cos, sin, even, odd = cos[..., :half], sin[..., :half], x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


def is_latent(attention) -> bool:
    """Whether an attention is multi-head latent attention (its keys and values through one latent)."""
    return getattr(attention, "kv_a_proj_with_mqa", None) is not None


def latent_weights(layer, style: Style) -> tuple | None:
    """A layer's multi-head latent attention as _latent_attention takes it: (q_a's weight, its bias,
    its norm's weight, that norm's eps — None each where q is one product —, kv_a's weight, its bias,
    its norm's weight and eps, kv_b's weight, (kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim,
    v_head_dim)); None where the attention is not latent."""
    a = attention_of(layer)
    if not is_latent(a):
        return None
    detached = lambda t: None if t is None else t.detach()  # noqa: E731
    q_a, q_norm = getattr(a, "q_a_proj", None), getattr(a, "q_a_layernorm", None)
    return (detached(getattr(q_a, "weight", None)), detached(getattr(q_a, "bias", None)),
            None if q_norm is None else norm_weight(q_norm.weight, style), None if q_norm is None else _eps(q_norm),
            a.kv_a_proj_with_mqa.weight.detach(), detached(a.kv_a_proj_with_mqa.bias),
            norm_weight(a.kv_a_layernorm.weight, style), _eps(a.kv_a_layernorm), a.kv_b_proj.weight.detach(),
            (a.kv_lora_rank, a.qk_rope_head_dim, a.qk_nope_head_dim, a.v_head_dim))


def latent_linears(layer) -> tuple:
    """A latent attention's q_a, kv_a and kv_b (None each where the attention is not latent; q_a None
    where q is one product)."""
    a = attention_of(layer)
    if not is_latent(a):
        return None, None, None
    return getattr(a, "q_a_proj", None), a.kv_a_proj_with_mqa, a.kv_b_proj


def _native_layer(layer, fused: tuple, fuse: bool):
    """The layer as a blocks.NativeLayer where all its linears hold quantised blocks (q/k/v and
    gate/up stacked — `fused`, or a stacked copy where there is room for one —, or, where their
    formats differ, their blocks one after another), else None.

    Whatever kernel each linear measured fastest alone (small_batch's verdicts): the C layer runs
    the whole layer in one call, its products and the ~40 operations around them, and that is what
    wins. On a 2-core Intel Xeon whose verdicts then named torch's product for k, v (576x192) at
    every row count and for one row of most others, the embedded target's forward took 38 ms with
    those kernels and 10.8 ms in C (`benchmarks/runtime_cost.py`), `ar` 37.8 against 93.5 tok/s
    (few-row products of quantised weights now take the blocks unmeasured: small_batch.FEW_ROWS_ON_BLOCKS).

    Only where the library's products run on vectors (AVX-512, AVX2, ARM's NEON): its plain loops (no AVX2) made the
    embedded target's `ar` 28.4 tok/s in C layers against 46.7 on torch's layers with each product's
    measured kernel (the 2-core AMD EPYC, built without AVX-512 and AVX2)."""
    q, k, v, o, gate, up, down = projections(layer)
    if not (_holds_blocks(o) and _holds_blocks(down)) or not vectorised():
        return None
    qkv = (q, k, v)
    stacks = [found if found is not None else _c_stack(linears, biased) if fuse else None
              for found, linears, biased in zip(fused, (qkv, (gate, up)), (True, False))]
    if any(stack is None for stack in stacks):
        return None
    bias = None if all(p.bias is None for p in qkv) else \
        torch.cat([p.bias if p.bias is not None else p.weight.new_zeros(p.out_features) for p in qkv])
    return NativeLayer((layer.input_layernorm.weight, layer.post_attention_layernorm.weight), stacks[0],
                       blocks_of(o), stacks[1], blocks_of(down), bias, _head_norms(attention_of(layer)))


def projections(layer) -> tuple:
    """A decoder layer's seven linears: q, k, v, o, gate, up, down (where q/k/v or gate/up are one
    linear, Phi-3's `qkv_proj` and `gate_up_proj`, GLM-4's `gate_up_proj`: linears over views of its
    rows, made once; gate None where the MLP has none, gate, up and down None where it is a mixture of
    experts)."""
    a, m = attention_of(layer), mlp_of(layer)
    if is_latent(a):  # (latent attention: q's product alone, see latent_linears)
        q = a.q_proj if getattr(a, "q_proj", None) is not None else a.q_b_proj
        return (q, None, None, a.o_proj, None, None, None) if hasattr(m, "experts") else \
            (q, None, None, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
    if type(a).__name__ == "GPT2Attention":  # (Conv1D modules, weights (in, out): views of their transposes)
        return _kept_views(layer, a.c_attn.weight, lambda: (
            *_row_views(a.c_attn.weight.T, a.c_attn.bias, (a.embed_dim,) * 3),
            *_row_views(a.c_proj.weight.T, a.c_proj.bias, (a.embed_dim,)), None,
            *_row_views(m.c_fc.weight.T, m.c_fc.bias, (m.c_fc.nf,)),
            *_row_views(m.c_proj.weight.T, m.c_proj.bias, (m.c_proj.nf,))))
    if hasattr(a, "query_key_value"):  # (GPT-NeoX: q, k and v one linear, head by head; no gate)
        return a.query_key_value, None, None, a.dense, None, m.dense_h_to_4h, m.dense_4h_to_h
    if type(a).__name__ == "GPTBigCodeAttention":  # (q, k and v one linear: head by head, or with one key
        if not a.multi_query:  # head, StarCoder's and SantaCoder's, q's rows then k's then v's: views of them)
            return a.c_attn, None, None, a.c_proj, None, m.c_fc, m.c_proj
        return _kept_views(layer, a.c_attn.weight, lambda: (
            *_row_views(a.c_attn.weight, a.c_attn.bias, (a.embed_dim, a.kv_dim, a.kv_dim)), a.c_proj, None, m.c_fc,
            m.c_proj))
    if isinstance(layer, PairedBlocks):  # (Nemotron-H: a mixer's products as Granite 4's; an MLP without a gate, or
        # none)
        mixing = (a.in_proj, None, None, a.out_proj) if mamba_of(layer) is not None else \
            (a.q_proj, a.k_proj, a.v_proj, a.o_proj)
        return (*mixing, None, None, None) if layer.mlp is None else (*mixing, None, layer.mlp.up_proj,
                                                                        layer.mlp.down_proj)
    if type(layer).__name__ == "BambaDecoderLayer" and mamba_of(layer) is not None:  # (Bamba: a mixer's as Granite 4's)
        return a.in_proj, None, None, a.out_proj, m.gate_proj, m.up_proj, m.down_proj
    if type(layer).__name__ == "GraniteMoeHybridDecoderLayer":  # (Granite 4: a Mamba-2 mixer's input product as q;
        # without experts its shared MLP is its MLP, gate and up one linear)
        mixing = (a.in_proj, None, None, a.out_proj) if mamba_of(layer) is not None else \
            (a.q_proj, a.k_proj, a.v_proj, a.o_proj)
        if layer.block_sparse_moe is not None:
            return (*mixing, None, None, None)
        shared = layer.shared_mlp
        return _kept_views(layer, shared.input_linear.weight, lambda: (
            *mixing, *_row_views(shared.input_linear.weight, None, (shared.input_linear.out_features // 2,) * 2),
            shared.output_linear))
    if delta_net_of(layer) is not None:  # (Qwen3.5's gated delta net: q/k/v's product as q, z's as k, b's as v;
        # Qwen3-Next's q/k/v/z's as q, b/a's as k)
        mlp = (None, None, None) if hasattr(m, "experts") else (m.gate_proj, m.up_proj, m.down_proj)
        if hasattr(a, "in_proj_qkvz"):
            return a.in_proj_qkvz, a.in_proj_ba, None, a.out_proj, *mlp
        return a.in_proj_qkv, a.in_proj_z, a.in_proj_b, a.out_proj, *mlp
    if hasattr(layer, "operator_norm"):  # (LFM2: its MLP's names, or experts; a short convolution's input
        # product as q — B, C and x in one —, its output's as o)
        mixing = (a.in_proj, None, None, a.out_proj) if short_conv_of(layer) is not None else \
            (a.q_proj, a.k_proj, a.v_proj, a.out_proj)
        return (*mixing, None, None, None) if hasattr(m, "experts") else (*mixing, m.w1, m.w3, m.w2)
    if hasattr(m, "experts"):  # (a mixture of experts: no MLP linears of its own, see experts_of)
        return a.q_proj, a.k_proj, a.v_proj, a.o_proj, None, None, None
    if hasattr(m, "c_fc"):  # (StarCoder2: no gate; GPT-Neo: its output `out_proj`)
        return a.q_proj, a.k_proj, a.v_proj, getattr(a, "o_proj", None) or a.out_proj, None, m.c_fc, m.c_proj
    if hasattr(a, "Wqkv"):  # (MPT: q's rows, then k's, then v's; no gate)
        return _kept_views(layer, a.Wqkv.weight, lambda: (
            *_row_views(a.Wqkv.weight, a.Wqkv.bias, (a.hidden_size,) * 3), a.out_proj, None, m.up_proj,
            m.down_proj))
    if hasattr(m, "fc_in"):  # (GPT-J: no gate)
        return a.q_proj, a.k_proj, a.v_proj, a.out_proj, None, m.fc_in, m.fc_out
    if hasattr(m, "fc1"):  # (Phi: no gate, attention's output `dense`; OPT: `out_proj`)
        return a.q_proj, a.k_proj, a.v_proj, getattr(a, "dense", None) or a.out_proj, None, m.fc1, m.fc2
    if not hasattr(m, "gate_proj") and not hasattr(m, "gate_up_proj"):  # (Nemotron, Arcee: no gate)
        return a.q_proj, a.k_proj, a.v_proj, a.o_proj, None, m.up_proj, m.down_proj
    fused = getattr(a, "qkv_proj", None) or getattr(m, "gate_up_proj", None)
    if fused is None:  # (Gemma 4: no k and v of its own where a layer reads an earlier one's cache, v None
        # where its values are its keys' product: `attention_k_eq_v`)
        return a.q_proj, getattr(a, "k_proj", None), getattr(a, "v_proj", None), a.o_proj, m.gate_proj, m.up_proj, \
            m.down_proj

    def views() -> tuple:
        if hasattr(a, "qkv_proj"):
            heads, kv_heads = a.config.num_attention_heads, a.num_key_value_heads
            q, k, v = _row_views(a.qkv_proj.weight, a.qkv_proj.bias,
                                 (heads * a.head_dim, kv_heads * a.head_dim, kv_heads * a.head_dim))
        else:
            q, k, v = a.q_proj, a.k_proj, a.v_proj
        gate, up = _row_views(m.gate_up_proj.weight, m.gate_up_proj.bias, (m.gate_up_proj.out_features // 2,) * 2) \
            if hasattr(m, "gate_up_proj") else (m.gate_proj, m.up_proj)  # (gate first)
        return q, k, v, a.o_proj, gate, up, m.down_proj

    return _kept_views(layer, fused.weight, views)


def _kept_views(layer, source: torch.Tensor, make) -> tuple:
    """projections' linears that `make()` builds over views of a fused weight, `source`: made once a
    layer and kept on it (not as a submodule: the model's parameters stay its own), again where the
    weight moved since."""
    views = getattr(layer, "_rsd_views", None)
    if views is None or not any(view is not None and view.weight.data_ptr() == source.data_ptr() for view in views):
        views = make()
        object.__setattr__(layer, "_rsd_views", views)
    return views


def layer_dims(layer, dims: tuple) -> tuple:
    """A layer's (heads, kv_heads, head_dim, scaling, eps): the model's `dims`, but a Gemma 4 layer's
    own (its full-attention layers' heads wider, with fewer key heads, as its per-layer config says),
    and a latent attention's (one latent a token; q and k's heads nope + rope wide)."""
    a = attention_of(layer)
    heads, _, _, _, eps = dims
    if is_latent(a):
        return heads, 1, a.qk_nope_head_dim + a.qk_rope_head_dim, a.scaling, eps
    if type(a).__name__ != "Gemma4TextAttention":
        return dims
    return heads, heads // a.num_key_value_groups, a.head_dim, a.scaling, eps


def cache_shape(layer, dims: tuple) -> tuple[int, int, int]:
    """(kv_heads, keys' width, values' width) of the cache a layer writes (its layer_dims'), a latent
    attention's (1, kv_lora_rank, qk_rope_head_dim): its latents and its keys' rotated parts; an LFM2
    short convolution's (1, hidden, 0): each token's input to it (_short_conv); a Qwen3.5 gated delta
    net's (1, its convolution's width, k's + g's + u's width) and a Mamba-2 mixer's (1, its convolution's
    width, B's + dt x's + dt A's width): their values float32 (values_in_float)."""
    a = attention_of(layer)
    if is_latent(a):
        return 1, a.kv_lora_rank, a.qk_rope_head_dim
    if short_conv_of(layer) is not None:  # (a short convolution's input of each token as its keys, no values)
        return 1, a.out_proj.in_features, 0
    if delta_net_of(layer) is not None:  # (a gated delta net's: its convolution's input; its k, g and u, in float32)
        return 1, a.conv_dim, a.key_dim + a.num_v_heads + a.value_dim
    if mamba_of(layer) is not None:  # (a Mamba-2 mixer's: its convolution's input; its B, dt x and dt A, in float32)
        return 1, a.conv_dim, a.n_groups * a.ssm_state_size + a.intermediate_size + a.num_heads
    _, kv_heads, head_dim, _, _ = dims
    return kv_heads, head_dim, head_dim


def reads_earlier_cache(layer) -> bool:
    """Whether a layer writes no keys and values of its own but reads an earlier layer's (Gemma 4's last
    `num_kv_shared_layers`)."""
    return bool(getattr(attention_of(layer), "is_kv_shared_layer", False))


def cache_owners(layers, kinds: list[str]) -> list[int]:
    """Each layer's KV cache, by the layer that writes it: its own, or for a layer reading an earlier
    one's (reads_earlier_cache), the last layer of its kind that writes one, as transformers' Gemma 4
    shares them (its config's `kv_sharing_modes`: "store" there, "reuse" here)."""
    owners: list[int] = []
    for index, (layer, kind) in enumerate(zip(layers, kinds)):
        writers = [j for j in range(index) if owners[j] == j and kinds[j] == kind]
        owners.append(writers[-1] if reads_earlier_cache(layer) and writers else index)
    return owners


def gemma4_experts(layer, style: Style) -> tuple | None:
    """A Gemma 4 layer's mixture of experts beside its MLP (26B-A4B) as decoder_layer takes it: (the
    MLP's own norm after it, (the router's weight, its scale, 1 / sqrt(hidden), each expert's scale,
    the experts' gate_up (E, 2I, hidden): gate rows then up rows, their down (E, hidden, I), the
    experts' norm before them, after them)) — or None: no such block, or one laid out otherwise
    (gemma4_experts_plain)."""
    if not gemma4_experts_plain(layer):
        return None
    router, experts = layer.router, layer.experts
    weight = lambda norm: norm_weight(norm.weight, style)  # noqa: E731
    return weight(layer.post_feedforward_layernorm_1), (
        router.proj.weight.detach(), router.scale.detach(), router.scalar_root_size, router.per_expert_scale.detach(),
        experts.gate_up_proj.detach(), experts.down_proj.detach(), weight(layer.pre_feedforward_layernorm_2),
        weight(layer.post_feedforward_layernorm_2))


def gemma4_experts_plain(layer) -> bool:
    """Whether a layer has Gemma 4's experts beside its MLP as transformers lays them out: a router
    without a bias over a norm without a weight, its experts stacked (_stacked_experts)."""
    router, experts = getattr(layer, "router", None), getattr(layer, "experts", None)
    if type(router).__name__ != "Gemma4TextRouter" or type(experts).__name__ != "Gemma4TextExperts":
        return False
    return router.proj.bias is None and getattr(router.norm, "weight", None) is None and _stacked_experts(experts)


def side_linears(layer) -> tuple:
    """A Gemma 4 layer's per-layer input's gate and projection (or None, None)."""
    return getattr(layer, "per_layer_input_gate", None), getattr(layer, "per_layer_projection", None)


def side_weights(layer, style: Style) -> tuple | None:
    """What decoder_layer adds a Gemma 4 layer's per-layer input by: (its gate's weight, its projection's,
    their output's norm's), or None."""
    gate, projection = side_linears(layer)
    if gate is None:
        return None
    return gate.weight.detach(), projection.weight.detach(), norm_weight(layer.post_per_layer_input_norm.weight, style)


def laurel_linears(layer) -> tuple:
    """A Gemma 3n layer's learned residual's two products (or None, None)."""
    laurel = getattr(layer, "laurel", None)
    return (None, None) if laurel is None else (laurel.linear_left, laurel.linear_right)


def laurel_weights(layer, style: Style) -> tuple | None:
    """What decoder_layer adds a Gemma 3n layer's learned residual by: (its left product's weight, its
    right one's, their output's norm's), or None."""
    left, right = laurel_linears(layer)
    if left is None:
        return None
    return left.weight.detach(), right.weight.detach(), norm_weight(layer.laurel.post_laurel_norm.weight, style)


def gate_cutoff(layer) -> torch.Tensor | None:
    """Where a Gemma 3n layer's MLP keeps only its gate's largest values (`activation_sparsity`): the
    cut-off in standard deviations above the mean, float32 (the normal distribution's quantile of the
    share dropped, as its _gaussian_topk computes it), else None."""
    mlp = mlp_of(layer)
    share = float(getattr(mlp, "activation_sparsity", 0.0) or 0.0)
    if share <= 0.0:
        return None
    cutoff = torch.distributions.normal.Normal(0, 1).icdf(torch.tensor(share, dtype=torch.float32))
    return cutoff.to(mlp.gate_proj.weight.device)  # (beside the weights: what a CUDA graph reads)


def altup_weights(layer, style: Style) -> tuple | None:
    """What _altup_layer runs a Gemma 3n layer's streams by: (its router's norm's weight, the router's
    input scale, the router's weight, the prediction coefficients', the correction coefficients', the
    scale of the corrected active stream or None, the active stream's index), or None."""
    altup = getattr(layer, "altup", None)
    if altup is None:
        return None
    cfg = altup.config
    return (norm_weight(altup.router_norm.weight, style), altup.router_input_scale.detach(),
            altup.modality_router.weight.detach(), altup.prediction_coefs.weight.detach(),
            altup.correction_coefs.weight.detach(),
            altup.correct_output_scale.detach() if cfg.altup_correct_scale else None, int(cfg.altup_active_idx))


def altup_streams(x: torch.Tensor, projections: list) -> torch.Tensor:
    """Gemma 3n's streams (streams, n, hidden) from its embedded tokens x (n, hidden): x, and each of
    its projections scaled to x's root mean square (as transformers' Gemma3nTextModel makes them)."""
    target = torch.mean(x ** 2, dim=-1, keepdim=True) ** 0.5
    return torch.stack([x] + [_magnitude_as(F.linear(x, weight), target) for weight in projections])


def altup_merged(streams: torch.Tensor, projections: list) -> torch.Tensor:
    """Gemma 3n's last layer's streams (streams, n, hidden) made one (n, hidden): the first, and each
    other's projection scaled to its root mean square, averaged."""
    target = torch.mean(streams[0] ** 2, dim=-1, keepdim=True) ** 0.5
    merged = [streams[0]] + [_magnitude_as(F.linear(stream, weight), target)
                             for stream, weight in zip(streams[1:], projections)]
    return torch.mean(torch.stack(merged), dim=0)


def _magnitude_as(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """y scaled row by row to the root mean square `target` (its own at least sqrt(1e-5))."""
    return y * target / torch.sqrt(torch.mean(y ** 2, dim=-1, keepdim=True).clamp(min=1e-5))


def fused_linears(layer) -> tuple:
    """A layer's own linears of q, k and v in one (Phi-3's qkv_proj, MPT's Wqkv) and of gate and up in
    one (Phi-3's and GLM-4's gate_up_proj), or None each."""
    attention = attention_of(layer)
    return getattr(attention, "qkv_proj", None) or getattr(attention, "Wqkv", None), \
        getattr(getattr(layer, "mlp", None), "gate_up_proj", None)


def _row_views(weight: torch.Tensor, bias: torch.Tensor | None, sizes: tuple) -> list[torch.nn.Linear]:
    """Linears over consecutive rows of a fused linear's (out, in) weight (and bias), sharing its memory
    (GPT-2's Conv1D: the transpose of its (in, out) weight, a view F.linear multiplies in place); the
    first one's `_rsd_stack` is the whole weight (stack_projections then stacks nothing)."""
    weight, linears, start = weight.detach(), [], 0
    for size in sizes:
        linear = torch.nn.Linear(weight.shape[1], size, bias=bias is not None, device="meta")
        linear.weight = torch.nn.Parameter(weight[start: start + size], requires_grad=False)
        if bias is not None:
            linear.bias = torch.nn.Parameter(bias.detach()[start: start + size], requires_grad=False)
        linears.append(linear)
        start += size
    linears[0]._rsd_stack = weight
    return linears


def _detached(linear, name: str) -> torch.Tensor | None:
    """A linear's weight or bias detached (a view of the same storage), or None where the linear or
    that tensor is missing (no gate, experts instead of an MLP; no bias)."""
    tensor = None if linear is None else getattr(linear, name)
    return None if tensor is None else tensor.detach()


def final_norm_of(inner):
    """The decoder's final norm (Phi's `final_layernorm`, GPT-NeoX's and OPT's `final_layer_norm`, GPT-2's
    `ln_f`: models.final_norm_name)."""
    from .models import final_norm_name

    return getattr(inner, final_norm_name(inner))


def embedding_of(inner):
    """The decoder's token embedding (GPT-NeoX's `embed_in`, GPT-2's `wte`, Falcon's `word_embeddings`)."""
    found = getattr(inner, "embed_tokens", None)
    return found if found is not None else getattr(inner, "embed_in", None) \
        or getattr(inner, "word_embeddings", None) or getattr(inner, "embeddings", None) or inner.wte  # (Nemotron-H's)


def attention_of(layer):
    """A decoder layer's attention (GPT-NeoX's `attention`, GPT-2's `attn`, Falcon's `self_attention`,
    GPT-Neo's its `attn`'s `attention`), or what an LFM2, Qwen3.5 or Granite 4 layer has in its place
    (short_conv_of, delta_net_of, mamba_of)."""
    found = getattr(layer, "self_attn", None)
    if found is None:
        found = getattr(layer, "attention", None) or getattr(layer, "self_attention", None) \
            or short_conv_of(layer) or delta_net_of(layer) or mamba_of(layer) or layer.attn
    return found.attention if type(found).__name__ == "GPTNeoAttention" else found  # (GPT-Neo's: within)


def short_conv_of(layer):
    """An LFM2 layer's short convolution, in attention's place (its layers of kind "conv"), or None."""
    found = getattr(layer, "conv", None)
    return found if type(found).__name__.endswith("ShortConv") else None


def delta_net_of(layer):
    """A Qwen3.5 layer's gated delta net, in attention's place (its layers of kind "linear_attention"),
    or None."""
    found = getattr(layer, "linear_attn", None)
    return found if type(found).__name__.endswith("GatedDeltaNet") else None


def mamba_of(layer):
    """A Granite 4 hybrid layer's Mamba-2 mixer, in attention's place (its layers of kind
    "linear_attention" or "mamba"), or None."""
    found = getattr(layer, "mamba", None)
    # (Granite 4's; Nemotron-H's and Bamba's the same arithmetic, named otherwise)
    return found if type(found).__name__.endswith(("MambaLayer", "Mamba2Mixer", "BambaMixer")) else None


def keeps_a_state(layer) -> bool:
    """Whether a layer has a gated delta net or a Mamba-2 mixer in attention's place: its values (a state's
    parts, kept by slot) in float32, a long chain read by chunks."""
    return delta_net_of(layer) is not None or mamba_of(layer) is not None


def carries_state(layer) -> bool:
    """Whether a layer has a short convolution, a gated delta net or a Mamba-2 mixer in attention's
    place (a state in transformers' forward; kept by slot on the runtime)."""
    return short_conv_of(layer) is not None or keeps_a_state(layer)


def mamba_weights(layer) -> tuple | None:
    """What _mamba runs a Mamba-2 mixer by: (its convolution's taps (K, width): the latest input's first,
    its bias or None, A = -exp(A_log) in float32, dt_bias, D, its gated norm's weight, (heads, head width,
    groups, state size, the groups its norm goes by), that norm's eps, the time step's limits), or None."""
    mamba = mamba_of(layer)
    if mamba is None:
        return None
    # (its norm by group as transformers 5.24 computes it, each group's inner // groups wide; 5.17's over the whole)
    normed = mamba.intermediate_size // getattr(mamba.norm, "group_size", mamba.intermediate_size)
    return (conv_taps(mamba.conv1d), _detached(mamba.conv1d, "bias"),
            -mamba.A_log.detach().float().exp(), mamba.dt_bias.detach(), mamba.D.detach(), mamba.norm.weight.detach(),
            (mamba.num_heads, mamba.head_dim, mamba.n_groups, mamba.ssm_state_size, normed),
            getattr(mamba, "layer_norm_epsilon", None) or mamba.norm.variance_epsilon,  # (Nemotron-H's: its norm's)
            tuple(float(limit) for limit in mamba.time_step_limit))


def delta_weights(layer) -> tuple | None:
    """What _gated_delta runs a gated delta net by: (a's product's weight — None for Qwen3-Next's, whose
    products are q/k/v/z's and b/a's —, its convolution's taps (K, width): the latest input's first,
    -exp(A_log) in float32, dt_bias, its output norm's weight, (k heads, v heads, k's head width, v's),
    that norm's eps), or None."""
    delta = delta_net_of(layer)
    if delta is None:
        return None
    a = getattr(delta, "in_proj_a", None)
    return (None if a is None else a.weight.detach(), conv_taps(delta.conv1d),
            -delta.A_log.detach().float().exp(), delta.dt_bias.detach(), delta.norm.weight.detach(),
            (delta.num_k_heads, delta.num_v_heads, delta.head_k_dim, delta.head_v_dim), delta.layer_norm_epsilon)


def conv_weights(layer) -> tuple | None:
    """What decoder_layer runs a short convolution by (_short_conv): (its taps (K, hidden), the
    weight of each row's latest input first, then the one before..., its bias or None), or None."""
    conv = short_conv_of(layer)
    if conv is None:
        return None
    return conv_taps(conv.conv), _detached(conv.conv, "bias")


def conv_taps(conv) -> torch.Tensor:
    """A depthwise Conv1d's weight (width, 1, K), its last tap the latest input's, as _convolved takes it:
    (K, width), the latest input's tap first."""
    return conv.weight.detach()[:, 0].flip(-1).T.contiguous()


def mlp_of(layer):
    """A decoder layer's MLP, or mixture of experts (GraniteMoE's `block_sparse_moe`, MPT's `ffn`, Llama
    4's `feed_forward`; OPT's linears are the layer's own)."""
    found = getattr(layer, "mlp", None)
    return found if found is not None else getattr(layer, "block_sparse_moe", None) or getattr(layer, "ffn", None) \
        or getattr(layer, "feed_forward", None) or layer


def experts_of(layer) -> tuple | None:
    """A mixture-of-experts layer's weights as mixture_of_experts takes them, or None for an MLP."""
    m = mlp_of(layer)
    if not hasattr(m, "experts"):
        return None
    shared = None
    if getattr(m, "shared_expert", None) is not None:  # (Qwen2-MoE; Llama 4's without a gate)
        e, gate = m.shared_expert, getattr(m, "shared_expert_gate", None)
        shared = tuple(w.detach() for w in (e.gate_proj.weight, e.up_proj.weight, e.down_proj.weight)) \
            + (None if gate is None else gate.weight.detach(),)
    elif getattr(m, "shared_experts", None) is not None:  # (ERNIE 4.5: no gate)
        e = m.shared_experts
        shared = tuple(w.detach() for w in (e.gate_proj.weight, e.up_proj.weight, e.down_proj.weight)) + (None,)
    elif getattr(layer, "shared_mlp", None) is not None:  # (GraniteMoE-shared: gate and up one linear, no gate)
        gate_up = layer.shared_mlp.input_linear.weight.detach()
        gate, up = gate_up.chunk(2)
        shared = (gate, up, layer.shared_mlp.output_linear.weight.detach(), None)
    router = getattr(m, "gate", None) or m.router
    gate_up, down, extras = m.experts.gate_up_proj.detach(), m.experts.down_proj.detach(), None
    if _oss_experts(m) or _llama4_experts(m):  # (transposed: views as the others' are laid out, no copy)
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    if _oss_experts(m):  # (its products' biases)
        extras = (*(w.detach() for w in (router.bias, m.experts.gate_up_proj_bias, m.experts.down_proj_bias)), None)
    # (a learned correction of the experts' scores: ERNIE 4.5's in its router's `moe_statics`, DeepSeek V3's its own)
    correction = getattr(getattr(router, "moe_statics", router), "e_score_correction_bias", None)
    if correction is None and getattr(m, "use_expert_bias", False):  # (LFM2-MoE's, on the block)
        correction = m.expert_bias
    if correction is not None:
        extras = (None, None, None, correction.detach().reshape(-1))
    return router.weight.detach(), gate_up, down, shared, extras


def _oss_experts(m) -> bool:
    """Whether an MLP is gpt-oss's mixture of experts as transformers lays it out (unquantised: not
    the MXFP4 kernels' experts): a router with a bias, each expert's products transposed — gate_up
    (E, hidden, 2I), its gate and up columns interleaved, down (E, I, hidden) — with biases, its gate
    clamped (_glu's `clamped_swiglu`)."""
    experts, router = getattr(m, "experts", None), getattr(m, "router", None)
    if type(experts).__name__ != "GptOssExperts" or type(router).__name__ != "GptOssTopKRouter":
        return False
    shapes = [getattr(getattr(experts, name, None), "shape", None) for name in
              ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")]
    gate = all(isinstance(getattr(experts, name, None), float) for name in ("alpha", "limit"))
    if None in shapes or getattr(router, "bias", None) is None or not gate \
            or {name for name, _ in m.named_children()} != {"router", "experts"}:
        return False
    if not len(shapes[0]) == len(shapes[2]) == 3:
        return False
    (count, hidden, doubled), inner = shapes[0], shapes[2][1]
    return doubled == 2 * inner and shapes[1] == (count, doubled) and shapes[3] == (count, hidden) \
        and shapes[2] == (count, inner, hidden)


def _phimoe_experts(m) -> bool:
    """Whether an MLP is Phi-3.5-MoE's mixture of experts as transformers lays it out: its router a
    linear without a bias choosing 2 experts (sparse_mixer), each expert's gate and up rows stacked
    (E, 2I, hidden) and its down (E, hidden, I), their gate the model's activation."""
    experts, router = getattr(m, "experts", None), getattr(m, "router", None)
    if type(experts).__name__ != "PhimoeExperts" or type(router).__name__ != "PhimoeTopKRouter":
        return False
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    return router.bias is None and router.top_k == 2 \
        and {name for name, _ in m.named_children()} == {"router", "experts"} \
        and getattr(gate_up, "dim", lambda: 0)() == 3 and getattr(down, "dim", lambda: 0)() == 3


def _llama4_experts(m) -> bool:
    """Whether an MLP is Llama 4's mixture of experts as transformers lays it out: a router without a
    bias, each expert's products transposed — gate_up (E, hidden, 2I), gate columns then up's, down (E,
    I, hidden) — without biases, and a shared expert, an MLP without biases."""
    experts, router = getattr(m, "experts", None), getattr(m, "router", None)
    if type(experts).__name__ != "Llama4TextExperts" or type(router).__name__ != "Llama4Router":
        return False
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    shared = getattr(m, "shared_expert", None)
    return router.bias is None and {name for name, _ in m.named_children()} == {"router", "experts", "shared_expert"} \
        and getattr(gate_up, "dim", lambda: 0)() == 3 and getattr(down, "dim", lambda: 0)() == 3 \
        and gate_up.shape[2] == 2 * down.shape[1] \
        and all(getattr(module, "bias", None) is None for module in shared.modules())


def _plain_experts(layer) -> bool:
    """Whether a layer's MLP is an MLP, or a mixture of experts as mixture_of_experts computes it: a
    router's weight, each expert's gate and up rows stacked (E, 2I, hidden) and its down (E, hidden,
    I), without biases, their gate the model's activation (transformers' default), a shared expert
    only as Qwen2-MoE's and GraniteMoE-shared's; or gpt-oss's (_oss_experts) or Phi-3.5-MoE's
    (_phimoe_experts)."""
    m, shared = mlp_of(layer), getattr(layer, "shared_mlp", None)
    if not hasattr(m, "experts") or _oss_experts(m) or _phimoe_experts(m) or _llama4_experts(m):
        return True
    router = getattr(m, "gate", None) or getattr(m, "router", None)
    return _stacked_experts(m.experts) and getattr(router, "weight", None) is not None and router.weight.dim() == 2 \
        and {name for name, _ in m.named_children()} <= {"gate", "router", "experts", "shared_expert",
                                                          "shared_expert_gate", "shared_experts"} \
        and all(shared is None or all(getattr(module, "bias", None) is None for module in shared.modules())
                for shared in (shared, getattr(m, "shared_experts", None)))


def _stacked_experts(experts) -> bool:
    """Whether experts are laid out as routed_experts multiplies them: each expert's gate and up rows
    stacked (E, 2I, hidden) and its down (E, hidden, I), without biases, their gate the model's
    activation (transformers' default)."""
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:  # (a transformers without it lays its experts out otherwise)
        return False
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    return isinstance(gate_up, torch.nn.Parameter) and gate_up.dim() == 3 and isinstance(down, torch.nn.Parameter) \
        and down.dim() == 3 and getattr(experts, "has_gate", False) and not getattr(experts, "has_bias", True) \
        and not getattr(experts, "is_transposed", True) and getattr(experts, "is_concatenated", False) \
        and not getattr(experts, "has_post_expert_norm", False) \
        and getattr(type(experts), "_apply_gate", None) is _default_apply_gate


def _blocks_for_prompts(layers) -> bool:
    """Whether the C layers also read prompts (more than MAX_ROWS tokens): where rsd's kernel
    measured faster than torch's product for prompts (small_batch's verdict for that many rows) on
    at least half of these layers' weights. For a few tokens the C layer wins by saving the ~40
    operations around the products; for a prompt the products are the whole cost, and torch's
    GEMM can beat the blocks kernel (2-core Intel Xeon, the embedded target, prompts of 96 to 2000
    tokens 1.39-1.82x: `benchmarks/prompt_path_ab.py`). The layers then read the prompt as
    decoder_layer does, each product by its measured kernel (torch's GEMM on the weight rebuilt from
    its blocks: small_batch.kernel_linear), the head on its blocks."""
    total = on_blocks = 0
    for layer in layers:
        for linear in filter(None, projections(layer)):
            total += linear.weight.numel()
            on_blocks += linear.weight.numel() if kernels_of(linear)[2] == "blocks" else 0
    return total > 0 and 2 * on_blocks >= total


def stack_projections(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k and v's weights stacked, gate and up's stacked) for a layer on a GPU, where a small
    model's forward is a chain of kernel launches: one product instead of three and one instead of
    two, 3 fewer kernels a layer for a CUDA graph to replay. The linears' weights become views of
    the stacks (same values, no second copy); a layer stacked before (an early-exit draft shares
    its target's layers) keeps its stacks."""
    q, k, v, _, gate, up, _ = projections(layer)
    stacks = []
    for linears in ((q, k, v), (gate, up)):
        if None in linears:  # (q, k and v one interleaved linear; a mixture of experts or an MLP without a gate)
            stacks.append(None)
            continue
        stacked = getattr(linears[0], "_rsd_stack", None)
        if stacked is None or any(linear.weight.data_ptr() != stacked[start:].data_ptr()
                                  for linear, start in zip(linears, _starts(linears))):
            with torch.no_grad():
                stacked = torch.cat([linear.weight.detach() for linear in linears])
                for linear, start in zip(linears, _starts(linears)):
                    linear.weight.data = stacked[start: start + linear.out_features]
            linears[0]._rsd_stack = stacked
        stacks.append(stacked)
    return stacks[0], stacks[1]


def _starts(linears) -> list[int]:
    """Where each linear's rows begin in their stack."""
    starts, row = [], 0
    for linear in linears:
        starts.append(row)
        row += linear.out_features
    return starts


def _c_stack(linears, biased: bool):
    """What a C layer runs these linears (q/k/v, or gate/up) on: their blocks stacked into one
    weight's, or, where their formats differ, their blocks one after another; None where one holds
    no blocks."""
    stacked = fused_blocks(linears, biased, held=True)
    return stacked if stacked is not None else _parts(linears, biased, held=True)


def _parts(linears, biased: bool, held: bool = False) -> list | None:
    """These linears' blocks, where each runs the blocks kernel for every row count (_on_blocks; with
    `held`, where each holds blocks: _holds_blocks)."""
    usable = _holds_blocks if held else _on_blocks
    return [blocks_of(linear) for linear in linears] if all(usable(linear, biased) for linear in linears) else None


def _head_norms(attention) -> tuple:
    """The weights of the RMS norms of q and of k (Qwen3's of each head, Hunyuan's named otherwise; Llama
    4's, without one, ones in the model's dtype: the same values), or (None, None)."""
    norm = getattr(attention, "qk_norm", None)
    if type(norm).__name__ == "Llama4TextL2Norm":
        ones = torch.ones(attention.head_dim, dtype=attention.q_proj.weight.dtype, device=attention.q_proj.weight.device)
        return ones, ones
    names = ("query_layernorm", "key_layernorm") if hasattr(attention, "query_layernorm") else \
        ("q_layernorm", "k_layernorm") if hasattr(attention, "q_layernorm") else ("q_norm", "k_norm")  # (LFM2's)
    return tuple(getattr(getattr(attention, name, None), "weight", None) for name in names)


def _room_to_fuse(layers) -> bool:
    """Stacked copies of q/k/v's and gate/up's blocks only while they take at most half the memory
    still available (as small_batch's packed copies)."""
    groups = [[blocks_of(linear) for linear in linears] for layer in layers
              for linears in (projections(layer)[:3], projections(layer)[4:6]) if None not in linears]
    needed = sum(b.numel() * b.element_size() for group in groups if None not in group and joined(group) is None
                 for b in group)  # (parts kept side by side need no copy)
    return needed == 0 or room_for(needed)


def _holds_blocks(linear, biased: bool = False) -> bool:
    """Whether this linear has quantised blocks (small_batch prepared them: RSD_SMALL_BATCH_MATMUL
    auto or blocks), without a bias unless `biased` (its caller adds it)."""
    return blocks_of(linear) is not None and (biased or linear.bias is None)


def _on_blocks(linear, biased: bool = False) -> bool:
    """Whether this linear has quantised blocks and runs the blocks kernel (for one row or for
    several: a layer's small products measure within noise of each other), without a bias
    unless `biased` (its caller adds it)."""
    return _holds_blocks(linear, biased) and "blocks" in kernels_of(linear)[:2]


def fused_blocks(linears, biased: bool = False, held: bool = False) -> torch.Tensor | None:
    """These linears' quantised blocks stacked into one weight's (their outputs side by side), where
    each runs the blocks kernel for every row count (_on_blocks; with `held`, where each holds
    blocks: a C layer's; with `biased`, biases are the caller's to add), all in the same format."""
    found = _parts(linears, biased, held)
    if found is None or len({block_format(b) for b in found}) != 1:
        return None
    flat = joined(found)  # (blocks kept side by side in a file: no copy)
    return torch.cat(found) if flat is None else flat.view(found[0].dtype).view(-1, *found[0].shape[1:])


def final_logits(x, norm, eps: float, head, small: tuple, in_float: bool = False,
                 softcap: float | None = None, divisor: float = 1.0, centred: bool = False,
                 bias: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """(m, hidden) -> (m, rows of the head) logits: the final norm (a norm_weight; `centred`: Cohere's)
    and the output head (its `bias`: Phi's), the logits then divided by `divisor` (Granite's
    `logits_scaling`, Cohere's 1 / `logit_scale`) and soft-capped to (-softcap, softcap) where the
    model says (Gemma 2 and 3's `final_logit_softcapping`). `dtype`: the norm's output cast to it before
    the head (Mamba-2's float32 residual: Style.residual_in_float)."""
    normed = _rms_norm(x, norm, eps, in_float, centred)
    logits = _linear(normed if dtype is None else normed.to(dtype), head, bias, small)
    logits = logits if divisor == 1.0 else logits / divisor
    return logits if not softcap else torch.tanh(logits / softcap) * softcap


class CompiledModel:
    """One loaded model run layer by layer over KV buffers; with `compile`, its decoder layer is a
    torch.compile graph shared by every layer and every generation (each generation has its own
    `StaticLM` with its own buffers) — and on a CUDA device each token count's whole forward is
    then captured once as a CUDA graph (`graphed`) and replayed: one launch instead of the layers'
    many, which is what a small model's GPU forward costs (`inductor=False`: graphs of the
    uncompiled layers, where compiling fails).

    CUDA graphs replay on fixed addresses, so a graphed model runs with static shapes: KV buffers
    shared by its generations one after the other (`lease`), new tokens written at slots given as
    a tensor, masks over the whole capacity. `static_shapes=True` runs that same path without the
    graphs (how the tests check it on a CPU)."""

    def __init__(self, model, compile: bool = True, static_shapes: bool | None = None,
                 notice=lambda message: None, inductor: bool = True, stack: bool | None = None):
        self.model = model
        self.compiled = compile
        self.notice = notice  # one line for the user (a CUDA graph that cannot be captured)
        inner, cfg = decoder_of(model)
        self.inner = inner  # (the text decoder: a multimodal model's language model)
        layers = layers_of(inner)
        # (LFM2's: the first layer with attention, not a short convolution; an LFM2 draft of its first
        # layer alone has none, its dims of no use then)
        attn = next((attention_of(layer) for layer in layers if not carries_state(layer)), None)
        self.style = style = style_of(model)
        heads = getattr(cfg, "num_attention_heads", None) or 1  # (Mamba-2's: no attention at all)
        if attn is None:
            kv_heads, head_dim = getattr(cfg, "num_key_value_heads", None) or heads, cfg.hidden_size // heads
            scaling = head_dim ** -0.5
        else:
            # (GPT-NeoX, OPT: every head its own keys; GPT-BigCode's with one key head: its attention's `kv_heads`)
            # (Gemma 4's differ by layer: its config refuses to name one, layer_dims)
            kv_heads = attn.num_kv_heads if type(attn).__name__ == "FalconAttention" else \
                cfg.num_attention_heads if style.interleaved else \
                cfg.num_attention_heads // attn.num_key_value_groups if type(attn).__name__ == "Gemma4TextAttention" \
                else getattr(cfg, "num_key_value_heads", None) or getattr(attn, "kv_heads", None) \
                or cfg.num_attention_heads
            head_dim = getattr(attn, "head_dim", None) or getattr(attn, "qk_head_dim", None) or attn.head_size  # (MLA's)
            # (MPT's `softmax_scale`, Falcon's and BLOOM's `inv_norm_factor`, GPT-J's before transformers 5.24 one over
            # its `scale_attn`; GPT-Neo's scores: unscaled)
            scaling = 1.0 if cfg.model_type == "gpt_neo" else \
                getattr(attn, "scaling", None) or getattr(attn, "softmax_scale", None) \
                or getattr(attn, "inv_norm_factor", None) or 1.0 / attn.scale_attn
        self.dims = (heads, kv_heads, head_dim, scaling,
                     _eps(next(norm for norm in layer_norms(layers[0]) if norm is not None)))
        self.layers = []
        fuse = _room_to_fuse(layers)
        if stack is None:  # q/k/v's and gate/up's weights stacked (stack_projections): on a GPU
            stack = embedding_of(inner).weight.device.type == "cuda"
        for layer in layers:
            # stacks: on a GPU every layer's (stack_projections, before the views of weights below); elsewhere
            # the model's own fused linears' weights, multiplied whole by the kernels rsd installed on them
            # (the views of their rows that `projections` reads have none: each view on torch's product,
            # Phi-3 of the embedded target's shape ran `ar` at 0.7x its speed on transformers' forward)
            own = fused_linears(layer)
            stacks = stack_projections(layer) if stack else \
                None if own == (None, None) else tuple(None if f is None else f.weight for f in own)
            linears = projections(layer)
            q, k, v, o, gate, up, down = linears
            ln1, ln2, after_attention, after_mlp = (None if norm is None else norm_of(norm, style)
                                                    for norm in layer_norms(layer))
            q_norm, k_norm = (None if w is None else norm_weight(w, style) for w in _head_norms(attention_of(layer)))
            # detached views (same storage): a trained adapter's tensors and the target's then pass
            # the same guards, and one graph serves both
            scalar = getattr(layer, "layer_scalar", None)  # (Gemma 4's)
            weights = LayerWeights(
                ln1=ln1, wq=_detached(q, "weight"), bq=_detached(q, "bias"), wk=_detached(k, "weight"),
                bk=_detached(k, "bias"), wv=_detached(v, "weight"), bv=_detached(v, "bias"), wo=_detached(o, "weight"),
                bo=_detached(o, "bias"), ln2=ln2, wg=_detached(gate, "weight"), wu=_detached(up, "weight"),
                wd=_detached(down, "weight"), q_norm=q_norm, k_norm=k_norm, after_attention=after_attention,
                after_mlp=after_mlp, experts=experts_of(layer), bu=_detached(up, "bias"), bd=_detached(down, "bias"),
                sinks=attention_of(layer).sinks.detach() if style.sinks else None,
                constants=xielu_constants(mlp_of(layer)), side_input=side_weights(layer, style),
                scalar=None if scalar is None else scalar.detach(), shared=reads_earlier_cache(layer),
                beside=gemma4_experts(layer, style), latent=latent_weights(layer, style),
                laurel=laurel_weights(layer, style), sparsity=gate_cutoff(layer), altup=altup_weights(layer, style),
                conv=conv_weights(layer), delta=delta_weights(layer), mamba=mamba_weights(layer))
            if stacks is not None and stacks[0] is not None:  # q's weight then holds q/k/v's stack; k and v: None
                weights = weights._replace(wq=stacks[0].detach(), wk=None, wv=None)
            if stacks is not None and stacks[1] is not None:  # ... gate's gate/up's; up: None
                weights = weights._replace(wg=stacks[1].detach(), wu=None)
            # (the fused linears whole, where stacked as the model has them)
            # (and a Gemma 4 layer's per-layer input's gate and projection)
            multiplied = (q if own[0] is None else own[0], k, v, o, gate if own[1] is None else own[1], up, down,
                          *side_linears(layer), *latent_linears(layer), *laurel_linears(layer))
            kernels = LayerKernels(*(None if linear is None else self._kernels(linear) for linear in multiplied))
            self.layers.append((weights, kernels,
                                (None if None in linears[:3] else fused_blocks(linears[:3], biased=True),
                                 None if gate is None else fused_blocks(linears[4:6])) if fuse else (None, None)))
        self.head_small = self._kernels(model.lm_head)
        self._table: tuple = (None, None)  # (native list, its native_table): every layer in one call
        self.intermediate = getattr(cfg, "intermediate_size", None)  # (the C layers': Llama's)
        final_norm = final_norm_of(inner)
        self.norm_eps = _eps(final_norm)
        self.final_norm = norm_of(final_norm, style)
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.embedding_scale = float(getattr(cfg, "embedding_multiplier", 1.0))  # (Granite's, besides the module's)
        # (Granite's; Cohere's logits are multiplied by its logit_scale)
        self.logits_divisor = float(getattr(cfg, "logits_scaling", 1.0)) / float(getattr(cfg, "logit_scale", None) or 1.0)
        self.embedding = embedding_of(inner)
        norm = getattr(inner, "word_embeddings_layernorm", None)  # (BLOOM's, on the embedding)
        self.embedding_norm = None if norm is None else (norm_of(norm, style), norm.eps)
        self.device = self.embedding.weight.device
        self.dtype = self.embedding.weight.dtype
        self.context = getattr(cfg, "max_position_embeddings", 4096)  # (BLOOM's: its biases' first table)
        # ALiBi (alibi_of): its kind and biases (alibi_biases); StaticLM's masks then carry each head's
        # (position_bias)
        self.alibi = alibi_of(cfg)
        self.biases = None if self.alibi is None else \
            alibi_biases(model, cfg.num_attention_heads, self.context, self.dtype)
        # the sliding window (StaticLM's masks), or None; `by_kind`: each layer's mask, 0 for the
        # full-attention layers' and 1 for the windowed ones' (a mask for each: (2, n, kv_len)), where
        # only some layers have the window
        kinds = layer_kinds(cfg, len(layers))
        # each layer's (heads, kv_heads, head_dim, scaling, eps): the model's dims but Gemma 4's and latent
        # attention's, and the KV cache it writes or reads (cache_owners: an index among the caches, each
        # cache_shape's (kv_heads, keys' width, values' width))
        self.layer_dims = [layer_dims(layer, self.dims) for layer in layers]
        owners = cache_owners(layers, kinds)
        written = sorted(set(owners))
        self.cache_of = [written.index(owner) for owner in owners]
        self.cache_shapes = [cache_shape(layers[owner], self.layer_dims[owner]) for owner in written]
        # (a gated delta net's or Mamba-2 mixer's values: float32 whatever the model's dtype, as transformers keeps
        # their states)
        self.values_in_float = [keeps_a_state(layers[owner]) for owner in written]
        # (gated delta nets or Mamba-2 mixers: a long chain read by chunks, StaticLM.forward)
        self.chains_by_chunks = any(keeps_a_state(layer) for layer in layers)
        # (and a state standing for their keys before a slot: each cache's layer weights where it keeps one, for
        # StaticLM._fold)
        self.state_weights = [self.layers[owner][0] if keeps_a_state(layers[owner]) else None for owner in written]
        # Gemma 4's per-layer inputs: each token's embedding for every layer, read beside its embedding
        self.per_layer_inputs = getattr(inner, "embed_tokens_per_layer", None) is not None
        # Gemma 3n's streams (AltUp): the projections making them of the embedded tokens, and making one of
        # them after the last layer (altup_streams, altup_merged), or None
        made, merged = getattr(inner, "altup_projections", None), getattr(inner, "altup_unembed_projections", None)
        self.altup = None if made is None else ([linear.weight.detach() for linear in made],
                                                [linear.weight.detach() for linear in merged])
        self.window = cfg.sliding_window if sliding_window(cfg) else None
        if cfg.model_type == "gpt_neo":  # (its local layers' window: of positions here, of slots in transformers')
            self.window = cfg.window_size if "sliding_attention" in kinds else None
        # Llama 4's chunked attention: its layers with a rotation see the keys of their position's chunk only
        # (StaticLM's masks: by position), the others every key
        self.chunk = int(cfg.attention_chunk_size) if "chunked_attention" in kinds else None
        some_limited = self.window is not None and window_of(cfg) is None \
            or self.chunk is not None and any(kind != "chunked_attention" for kind in kinds)
        self.by_kind = [int(kind in ("sliding_attention", "chunked_attention")) for kind in kinds] \
            if some_limited else None
        # Llama 4's attention temperature (attention_temperatures): (floor_scale, attn_scale), or None; and
        # which layers it scales (those without a rotation)
        self.temperature = (float(cfg.floor_scale), float(cfg.attn_scale)) \
            if cfg.model_type == "llama4_text" and cfg.attn_temperature_tuning else None
        self.tempered = [self.temperature is not None and not rotates(layer, kind, cfg)
                         for layer, kind in zip(layers, kinds)]
        # rotary tables for every position, computed once: one, or one per layer kind (Gemma 3), and
        # None for layers without a rotation (SmolLM3's every fourth: forward rotates them by angle 0)
        # (OPT, GPT-2: none, their learned position embeddings added to the tokens' instead: positions_of)
        rotary = rotary_of(inner)
        self.positions = positions_of(inner)
        per_kind = bool(getattr(rotary, "layer_types", None))
        names = [(kind if per_kind else "rotary") if rotary is not None and rotates(layer, kind, cfg) else None
                 for kind, layer in zip(kinds, layers)]
        self._rotary = (rotary, list(dict.fromkeys(names)), per_kind)  # (angles_at's)
        self.tables = self.angles_at(torch.arange(self.context, device=self.device))
        # a `longrope` model (engine.long_factors_from): each position's own factors, its short ones before
        # `long_from` and its long ones from it (a prompt read past it: angles_at, forward's `long`)
        self.long_from = long_factors_from(cfg)
        if self.long_from is not None and self.long_from >= self.context:
            self.long_from = None  # (never reached)
        if self.long_from is not None:
            start = self.long_from
            self.tables = [(None, None) if cos is None else (torch.cat([short_cos, cos[start:]]),
                                                             torch.cat([short_sin, sin[start:]]))
                           for (cos, sin), (short_cos, short_sin)
                           in zip(self.tables, self.angles_at(torch.arange(start, device=self.device)))]
        self.table_of = [self._rotary[1].index(name) for name in names]  # [layer]
        self.cos, self.sin = self.tables[0]  # (the only table where the C library runs the layers)
        # layers on quantised blocks run in the blocks library (uncompiled CPU path): all of a forward's
        # layers in one call where every layer can, then the final norm and head in one more (Llama's
        # layers, on one rotary table and one mask)
        in_c = style == Style() and len(self.tables) == 1 and self.cos is not None and self.by_kind is None \
            and not any(is_latent(attention_of(layer)) or carries_state(layer) for layer in layers) \
            and self.cos.shape[-1] == self.dims[2] \
            and self.embedding_scale == self.logits_divisor == 1.0 and layer_norms(layers[0])[2] is None
        native = [_native_layer(layer, fused, fuse) if in_c else None
                  for layer, (_, _, fused) in zip(layers, self.layers)]
        self.native = native if any(native) else None
        self.prompts_in_c = _blocks_for_prompts(layers)
        self.graphs: set[int] = set()  # token counts compiled so far
        self.graphed = compile and self.device.type == "cuda"  # CUDA graphs of the whole forward
        self.static_shapes = self.graphed if static_shapes is None else static_shapes
        self.buckets = STATIC_BUCKETS if self.static_shapes else BUCKETS  # what token counts are padded to
        # whether the layers run as torch.compile graphs (inductor); on a GPU inside the CUDA graphs (fused
        # kernels: fewer launches to replay), or not (`inductor=False`: graphs of the eager layers, where
        # compiling fails)
        self.inductor = compile and inductor
        # the layers compiled; embedding, final norm and head stay eager (a few ops, and a graph per
        # head size would double the compiles)
        self._layer = _compiled(decoder_layer) if self.inductor else decoder_layer
        if self.inductor and self.device.type == "cpu":  # compiled graphs find each weight's CPU kernels by its
            # address (one graph for all)
            for weights, kernels_of_layer, _ in self.layers:
                for weight, kernels in zip((weights.wq, weights.wk, weights.wv, weights.wo, weights.wg, weights.wu,
                                            weights.wd), kernels_of_layer):
                    if weight is not None:  # (None: stacked with q's or gate's weight, or experts instead of an MLP)
                        enrol(weight, *kernels)
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # static shapes: shared KV buffers
        self._holder = None  # weak reference to the StaticLM using them
        self._captured: dict[tuple, tuple] = {}  # (token count, buffer address) -> (inputs, replay, logits)
        self._pool = None  # one CUDA memory pool for all this model's graphs (they run one at a time)
        self._step_graphs: StepGraphs | None = None  # the maths graphs of the steps on those buffers

    def position_bias(self, key_positions: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """(heads, 1 or len(rows), keys) float32 on the host: what ALiBi adds to each head's scores of keys
        at these positions — BLOOM's and Falcon-RW's from their table (alibi_biases; made again twice as
        long for a position past it: ALiBi has no context of its own, and BLOOM's config names none);
        MPT's its slope times the key's position less the row's (`rows`: each row's position, or one for
        them all), as exactly as transformers computes it (int32 times float32). Transformers takes the
        last key's for every row of a forward: a constant a row, which softmax does not see but half
        precision rounds, so a prompt is read with its last position and a step's rows each with its
        own, as transformers' generate reads each token after the one before it."""
        if self.alibi == "mpt":
            last = torch.tensor(rows)[:, None]
            return (key_positions[None, :] - last).to(torch.int32)[None] * self.biases[:, None, None]
        beyond = int(key_positions.max()) + 1 if len(key_positions) else 0
        if beyond > self.biases.shape[1]:
            self.biases = alibi_biases(self.model, self.dims[0], max(beyond, 2 * self.biases.shape[1]), self.dtype)
        return self.biases[:, None, key_positions]

    @property
    def all_in_c(self) -> bool:
        """Whether every layer runs in rsd's C library here (uncompiled, on a CPU: blocks.NativeLayer).
        `auto` then stays uncompiled without measuring: a compiled layer runs the same products
        (rsd::linear) with its other operations and a graph call around them, which one call of the
        library for all layers undercuts (the embedded target, 1 token on a 2-core AMD EPYC: 4.6 ms
        in C, 9.9 ms compiled), and measuring would compile for ~18 s on a first run."""
        return self.native is not None and all(self.native) and self.device.type == "cpu"

    def angles_at(self, positions: torch.Tensor, long: bool = False) -> list[tuple]:
        """Each rotary table's (cos, sin) for these positions (n,) on the model's device, as one forward of
        them turns them (a `longrope` model's: by the factors its last position picks; `long`: by its long
        ones, where they are before their start too — a piece of a prompt astride it), each (n, rotated
        dimensions); (None, None) for layers without a rotation."""
        if long and self.long_from is not None and int(positions.max()) < self.long_from:
            beyond = torch.cat([positions, positions.new_tensor([self.long_from])])  # (a row from the start on)
            return [(None, None) if cos is None else (cos[:-1], sin[:-1]) for cos, sin in self.angles_at(beyond)]
        rotary, names, per_kind = self._rotary
        x = torch.zeros(1, dtype=self.dtype, device=self.device)
        with torch.inference_mode():
            positions = positions[None]
            if hasattr(rotary, "mrope_section"):  # (Qwen3.5's: a text's positions on each of its three grids, which
                # transformers 5.17 asks for as (3, 1, n))
                positions = positions.expand(3, -1, -1)
            found = [None if name is None else rotary(x, positions, name) if per_kind else rotary(x, positions)
                     for name in names]
        # (DeepSeek V2's: complex numbers, each for a pair of dimensions: their cos and sin, each twice in a row)
        found = [(None, None) if table is None else
                 (table.real[0].repeat_interleave(2, -1), table.imag[0].repeat_interleave(2, -1))
                 if torch.is_tensor(table) and table.is_complex() else (table[0][0], table[1][0]) for table in found]
        if self.model.config.model_type == "gptj":  # (its rotary module's, or SinusoidalTable's: sin first, then
            # cos, each angle once for a pair)
            found = [(None, None) if sin is None else (cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1))
                     for sin, cos in found]
        if self.style.angles_once:  # (gpt-oss: each angle for both halves of a head, as rotate_half reads it)
            found = [(None, None) if cos is None else (torch.cat([cos, cos], -1), torch.cat([sin, sin], -1))
                     for cos, sin in found]
        return [(None, None) if cos is None else (pair_angles(cos), pair_angles(sin)) for cos, sin in found] \
            if self.style.pairs else found

    def _kernels(self, linear) -> tuple:
        """(the CPU kernels of this linear, the copies of its weight they run on — and its quantised
        blocks wherever it has them, from which torch's GEMM gets the weight for a prompt: see
        small_batch.kernel_linear)."""
        blocks = blocks_of(linear)
        return kernels_of(linear), {**prepared_copies(linear), **({"blocks": blocks} if blocks is not None else {})}

    def new_states(self) -> list | None:
        """A zero state (heads, a, b) float32 for each cache whose layer keeps one (state_shape; None for the
        others), or None where no layer does."""
        if not self.chains_by_chunks:
            return None
        return [None if weights is None else torch.zeros(state_shape(weights), device=self.device)
                for weights in self.state_weights]

    def fold(self, states: list, values, start: int, end: int) -> None:
        """Sum the keys at slots start .. end - 1 of each cache keeping a state into its state in `states`
        (new_states'), which stood for the keys before `start`: it then stands for those before `end`."""
        with torch.inference_mode():
            for cache, (state, weights) in enumerate(zip(states, self.state_weights)):
                if state is not None:
                    left, right, rates = _state_parts(values[cache][0, start:end], weights)
                    state.copy_(_decayed(state, rates) + _state_of(left, right, rates))

    def new_buffers(self, capacity: int) -> tuple:
        """(keys, values) of every cache (cache_of), `capacity` slots each: a (caches, kv_heads, capacity,
        width) tensor each (a latent attention's keys: its latents, its values: its keys' rotated parts),
        or where caches differ in shape (Gemma 4's) a LayerCaches."""
        made = []
        for shapes in ([(heads, width, self.dtype) for heads, width, _ in self.cache_shapes],  # (keys', then values')
                       [(heads, width, torch.float32 if in_float else self.dtype)
                        for (heads, _, width), in_float in zip(self.cache_shapes, self.values_in_float)]):
            if len(set(shapes)) == 1:
                made.append(torch.zeros((len(shapes), shapes[0][0], capacity, shapes[0][1]), dtype=shapes[0][2],
                                        device=self.device))
            else:
                made.append(LayerCaches(shapes, capacity, self.dtype, self.device))
        return made[0], made[1]

    def lease(self, lm, capacity: int) -> tuple | None:
        """Static shapes: the shared KV buffers, at least `capacity` long, for `lm` (a StaticLM);
        None while another live one holds them (it then runs on buffers of its own, without
        graphs). Longer buffers replace the old ones, and their graphs are captured again."""
        holder = self._holder() if self._holder is not None else None
        if holder is not None and holder is not lm:
            return None
        if self._buffers is None or stacks_of(self._buffers[0])[0].shape[2] < capacity:
            self._buffers = None
            self._drop_graphs()
            self._buffers = self.new_buffers(capacity)
        self._holder = weakref.ref(lm)
        return self._buffers

    def release(self, lm) -> None:
        if self._holder is not None and self._holder() is lm:
            self._holder = None

    def step_graphs(self, notice) -> StepGraphs:
        """The step maths' graphs (StepGraphs, made once) of the generations on this model's shared
        buffers: those run one at a time, so their graphs are captured once a process instead of
        once a decoder — each chat turn, each `rsd bench` run and each shape `auto` tries in them
        made its own, and a capture costs milliseconds of a step that takes ~1.5."""
        if self._step_graphs is None:
            self._step_graphs = StepGraphs(self.device, True, notice)
        return self._step_graphs

    def _drop_graphs(self) -> None:
        """Forget every captured graph, and their memory pool with them: a pool whose graphs are all
        gone lingers in torch's allocator with no user, and capturing into it again fails an
        internal assert (`use_count > 0`), so the next capture starts a pool of its own."""
        self._captured.clear()
        if self._pool is not None:
            self._pool = None
            torch.cuda.empty_cache()  # (the old pool's memory back to the device)

    def _native_table(self, native: list) -> torch.Tensor:
        """blocks.native_table of these layers, made once (and again if `native` is replaced)."""
        if self._table[0] is not native:
            self._table = (native, native_table(native))
        return self._table[1]

    def replay(self, ids: torch.Tensor, mask: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               rows: slice = slice(None), tokens: torch.Tensor | None = None) -> torch.Tensor:
        """A static-shape forward: float32 logits of these rows, a tensor of their own. ids (3, n):
        the tokens, their positions and the slots their keys go to; mask (n, capacity) (by_kind: (2,
        n, capacity); ALiBi: (heads, n, capacity)); both on the host or the device (page-locked host memory is copied in without
        waiting); tokens (k,), k <= n, on the device: the first k tokens instead of ids' first row
        (drawn there: no value read).
        Graphed: the CUDA graph captured for this token count and these buffers (at its first use),
        fed by copying the inputs into its own — ids in one copy, the mask in another, device tokens
        in a third; otherwise a plain call."""
        if not self.graphed:
            ids, mask = ids.to(self.device, copy=True), mask.to(self.device)
            if tokens is not None:
                ids[0, : tokens.shape[0]] = tokens
            every = torch.arange(ids.shape[1], device=self.device)
            return self.forward(ids[0], ids[1], mask, keys, values, every, ids[2])[rows].float()
        key = (ids.shape[1], stacks_of(keys)[0].data_ptr())
        if key not in self._captured:
            try:
                self._captured[key] = self._capture(ids, mask, keys, values)
            except Exception as e:  # noqa: BLE001 - a driver, library or op that cannot be captured
                self.graphed = False  # this model runs its static shapes without graphs from now on
                self._drop_graphs()
                reason = str(e).splitlines()[0] if str(e) else ""
                self.notice(f"capturing a CUDA graph failed ({type(e).__name__}: {reason}): "
                            f"the static-cache runtime runs without graphs")
                return self.replay(ids, mask, keys, values, rows, tokens)
        (id_buffer, mask_buffer, *_), replay, logits = self._captured[key]
        id_buffer.copy_(ids, non_blocking=True)  # (from page-locked memory: queued, not waited for)
        mask_buffer.copy_(mask, non_blocking=True)
        if tokens is not None:
            id_buffer[0, : tokens.shape[0]].copy_(tokens)
        replay()
        # a copy: the graph's output buffer is overwritten by its next replay
        return logits[rows].to(torch.float32, copy=True)

    def _capture(self, ids, mask, keys, values) -> tuple:
        """((the graph's input buffers: ids, mask, rows and ids' rows), its replay, its output buffer). A graph
        reads and writes the addresses it was captured with and holds no reference to their
        tensors: everything it reads stays alive in what this returns (the inputs, `rows` among
        them), in the model (weights, rotary tables) or in the shared KV buffers (their graphs
        dropped when replaced)."""
        rows = torch.arange(ids.shape[1], device=self.device)  # every row's logits
        id_buffer, mask_buffer = ids.to(self.device, copy=True), mask.to(self.device, copy=True)
        tokens, positions, slots = id_buffer  # (views of its rows, kept with the inputs)
        inputs = (id_buffer, mask_buffer, rows, tokens, positions, slots)

        def run() -> torch.Tensor:
            return self.forward(tokens, positions, mask_buffer, keys, values, rows, slots)

        return (inputs, *self._graph_of(run))

    def _graph_of(self, run) -> tuple:
        """(the replay of a CUDA graph of what run() launches, its output buffer), captured as
        step_graphs.cuda_capture does, in this model's one pool (its graphs run one at a time, and
        each output is copied at once). The run before the capture makes the same writes to the KV
        buffers as the replay that follows."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        replay, (logits,) = cuda_capture(self.device, self._pool)(lambda: (run(),))
        return replay, logits

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor | None = None,
                sight: Callable[[], Sight | None] | None = None, long: bool = False, chain: bool = False,
                fold: tuple | None = None) -> torch.Tensor:
        """tokens, positions (n,); mask (n, kv_len) additive (or (2, n, kv_len): the full-attention
        layers' and the windowed ones', where only some layers have a window: by_kind; ALiBi's
        (heads, n, kv_len): position_bias), the new tokens
        at slots kv_len - n .. kv_len - 1 (or at `slots`, the mask then over the whole capacity); keys, values (layers,
        kv_heads, capacity, head_dim), written in place; rows (m,) which outputs to return. Returns
        (m, rows of the head) logits. Sizes in BUCKETS run the compiled graphs (the used length and
        the capacity are dynamic dimensions), others eager. sight: () -> what attention reads, where
        less than every key through the mask (a Sight, worked out only where torch runs the layers
        uncompiled). long: every row turned by a `longrope` model's long factors (angles_at). chain: the
        tokens are a chain after every key before them (decoder_layer's, where torch runs it uncompiled). fold:
        (a slot, new_states' states standing for the keys before it) where the layers keeping a state read
        those states and the keys from that slot on (decoder_layer's `fold`), or None: every key."""
        # (a chain read by chunks, uncompiled: its layers' states then left in `fold`'s, which StaticLM counts on)
        compiled = self.inductor and tokens.shape[0] in self.buckets and not chain
        # prompts (more than MAX_ROWS tokens) in C only where rsd's kernel measured faster for them
        prompt_on_torch = not compiled and slots is None and tokens.shape[0] > MAX_ROWS and not self.prompts_in_c
        native = self.native if not compiled and slots is None and not prompt_on_torch else None
        # each layer's mask: the one mask, or its kind's of the two (full attention's, the window's)
        masks = [mask] if self.by_kind is None else list(mask)
        if compiled:
            for kind_mask in masks:  # (its keys: the last dimension, after ALiBi's heads where it has them)
                torch._dynamo.maybe_mark_dynamic(kind_mask, kind_mask.dim() - 1)
        x = self.embedding(tokens)  # (n, hidden; Gemma's embedding scales it)
        if self.embedding_norm is not None:  # (BLOOM's)
            x = _rms_norm(x, *self.embedding_norm)
        if self.embedding_scale != 1.0:  # (Granite's model scales it)
            x = x * self.embedding_scale
        if self.style.residual_in_float:  # (Mamba-2's residual stream in float32)
            x = x.float()
        sides = None  # (Gemma 4: (n, layers, width) inputs of each layer, from the tokens and their embeddings)
        if self.per_layer_inputs:  # (Gemma 3n's from the tokens alone)
            by_token = self.inner.get_per_layer_inputs(tokens[None]) if self.altup is not None else \
                self.inner.get_per_layer_inputs(tokens[None], x[None])
            sides = self.inner.project_per_layer_inputs(x[None], by_token)[0]
        # (a tree's rows past the context's end read its last rotary angle: their tokens are never emitted)
        positions = positions.clamp(max=self.context - 1)
        temperature = None if self.temperature is None else attention_temperatures(positions, *self.temperature)
        if self.positions is not None:  # (OPT, GPT-2: learned position embeddings added)
            table, first = self.positions
            x = x + table[positions + first]
        head_dim = self.dims[2]
        # (a prompt read astride a `longrope` model's long factors' start: all turned by the long ones)
        tables = self.angles_at(positions, long=True) if long else [(cos[positions], sin[positions]) if cos is not None
                                                         else (None, None) for cos, sin in self.tables]
        angles = [(cos, sin) if cos is not None else  # each table's (n, head_dim)
                  (x.new_ones(x.shape[0], head_dim), x.new_zeros(x.shape[0], head_dim))  # (no rotation: angle 0)
                  for cos, sin in tables]
        cos, sin = angles[0]
        # (compiled graphs read a fold from its slot on where that leaves them two keys or more: a graph takes
        # one as a size of its own; and not from slot 0, a view's offset of its own, but every key instead)
        fold = fold if fold is None or not compiled or 0 < fold[0] <= mask.shape[-1] - 2 else None
        # every layer in one call of the C library where each can run there, else layer by layer
        in_c = native is not None and all(native) and isinstance(keys, torch.Tensor) and keys.is_contiguous() \
            and values.is_contiguous()
        head = blocks_of(self.model.lm_head)
        # the norm and head: one more call, on the head's blocks (as the layers, whatever its product
        # measured alone: a calibration of one 113 MB weight read again and again is partly served
        # by a large CPU cache, which a forward streaming every weight is not)
        head_in_c = (in_c or prompt_on_torch and self.all_in_c) and head is not None and self.model.lm_head.bias is None
        if native is not None:
            heads, kv_heads, head_dim, scaling, eps = self.dims
            dims = (x.shape[1], heads, kv_heads, head_dim, self.intermediate, scaling, eps)

        def logits(y: torch.Tensor, threads: int | None = None) -> torch.Tensor:
            """the final norm and head on the last layer's output y (in C where the head is on blocks), on
            `threads` threads (None: torch's)"""
            if head_in_c:
                return native_head(y, rows, self.inner.norm.weight, self.norm_eps, head, threads=threads)
            with on_threads(threads) if threads else contextlib.nullcontext():
                return final_logits(y[rows], self.final_norm, self.norm_eps, self.model.lm_head.weight,
                                    self.head_small, self.style.norm_in_float, self.softcap, self.logits_divisor,
                                    self.style.centred, self.model.lm_head.bias,
                                    self.dtype if self.style.residual_in_float else None)

        if in_c:
            def in_the_library(threads: int) -> torch.Tensor:
                """every layer in one call, then the head: on `threads` threads"""
                out = NativeForward(cos, sin, mask, dims, threads).layers(self._native_table(native), x, keys, values)
                return logits(out, threads)

            return run_in_c((id(self), tokens.shape[0]), in_the_library)  # (threads change its time, never its bits)

        def on_torch() -> torch.Tensor:
            """the layers (on torch, or some in C one by one) and the head, on torch's threads: compiled
            graphs only on the CPU's count, which their code was compiled for (on fewer, what the
            governor chose beside busy processes, the same layers uncompiled)"""
            graphs = compiled and torch.get_num_threads() == cpu_threads()
            if graphs:
                self.graphs.add(tokens.shape[0])
            y = x if self.altup is None else altup_streams(x, self.altup[0])  # (Gemma 3n: its streams)
            run = NativeForward(cos, sin, mask, dims) if native is not None else None
            # (a Gemma 2 layer's attention reads every key through the mask)
            reads = sight() if sight is not None and not graphs and not (self.style.softcap or self.style.sinks) \
                else None
            # (where layers read a state: each mask kind's columns from the fold's slot, made once for them all)
            fold_masks = None if fold is None else [kind_mask[..., fold[0]:].contiguous() for kind_mask in masks]
            for index, (weights, kernels, fused) in enumerate(self.layers):
                if native is not None and native[index] is not None:
                    y = run.layer(native[index], y, keys[index], values[index])
                    continue
                cache = self.cache_of[index]
                layer_keys, layer_values = keys[cache], values[cache]
                layer_cos, layer_sin = angles[self.table_of[index]]
                kind = 0 if self.by_kind is None else self.by_kind[index]
                layer_mask = masks[kind]
                side = None if sides is None else sides[:, index]
                tempered = temperature if self.tempered[index] else None
                layer_fold = None
                if fold is not None and fold[1][cache] is not None:  # (the state, the mask and values from its slot)
                    layer_fold = (fold[1][cache], fold_masks[kind], layer_values[:, fold[0]:])
                if graphs:
                    torch._dynamo.maybe_mark_dynamic(layer_keys, 1)
                    torch._dynamo.maybe_mark_dynamic(layer_values, 1)
                    if layer_fold is not None:
                        torch._dynamo.maybe_mark_dynamic(layer_fold[1], layer_mask.dim() - 1)
                        torch._dynamo.maybe_mark_dynamic(layer_fold[2], 1)
                    y = self._layer(y, layer_cos, layer_sin, layer_mask, layer_keys, layer_values, weights, kernels,
                                    self.layer_dims[index], slots, fused, None, self.style, side, tempered, False,
                                    layer_fold)
                else:
                    y = decoder_layer(y, layer_cos, layer_sin, layer_mask, layer_keys, layer_values, weights, kernels,
                                      self.layer_dims[index], slots, fused, reads, self.style, side, tempered,
                                      chain and slots is None, layer_fold)
            return logits(y if self.altup is None else altup_merged(y, self.altup[1]))

        # on a CPU on the threads the governor chooses
        return run_on_torch((id(self), tokens.shape[0], "torch"), on_torch, on_cpu=self.device.type == "cpu")


@dataclasses.dataclass(frozen=True)
class Sight:
    """What torch's attention reads in a forward of n new tokens (decoder_layer), worked out once for
    all its layers where that is less than every key with the mask added: `keys` (m,) the cache
    slots some new token sees, in order (None: every slot of the used length), and `mask` (n, m)
    additive over them, or None where that is causal: the new tokens, the last n of the keys read,
    see each other causally and every key before theirs — a chain after what they see of the cache.

    torch's kernel computes every score a mask hides, then adds -inf to it. Told the attention is
    causal, it skips the hidden half. Its causal attention is aligned top-left (query i sees keys
    0..i), so where the new tokens also see keys before their own, as many rows of zeros go before
    their queries and those rows' outputs are dropped: worth it where those keys are at most half as
    many as the new tokens. Keys no new token sees are left out instead of read and hidden. A prompt
    read into an empty cache is causal: the same bits as through the mask, a 5173-token prompt's
    attention on the 2-core Xeon 0.32 -> 0.15 s a layer. The prompts of `--samples`/`--prompts` read
    together (Decoder.generate_together) each see their shared beginning and themselves, not the
    prompts read before them: each one's attention costs what its own length says, not what all of
    them before it add up to."""

    keys: torch.Tensor | None
    mask: torch.Tensor | None


def sight_of(visible: torch.Tensor, mask: torch.Tensor) -> Sight | None:
    """The Sight of new tokens whose `visible` (n, kv_len) bool and additive `mask` (n, kv_len) are
    given, or None where attention should read every key through the mask: keys are left out where
    the scores that saves outnumber the keys copied (a tree's few rows in a long context read them
    all), and the mask where what is read is causal with at most n / 2 keys before the new tokens'
    (a chat's next message read after a longer conversation keeps the mask: the rows of zeros would
    cost more than the mask)."""
    n, kv_len = visible.shape
    seen = visible.any(0)
    hidden = kv_len - int(seen.sum())
    keys = seen.nonzero().squeeze(1) if hidden and n * hidden > kv_len - hidden else None
    read = visible if keys is None else visible[:, keys]
    before = read.shape[1] - n
    if 0 <= before <= n // 2 and bool(read[:, :before].all()) and torch.equal(read[:, before:], lower_triangle(n)):
        return Sight(keys, None)
    return None if keys is None else Sight(keys, mask[:, keys])


def _compiled(fn):
    """fn compiled with static token counts (buckets); only the dimensions marked dynamic vary.
    (On a CUDA device the runtime captures what the compiled layers launch in CUDA graphs.)"""
    import os

    import torch._dynamo
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from .cache import chosen_inductor_folder
    from .models import cache_dir

    # inductor's compiled code goes to the rsd cache folder (a second process reads it back) unless
    # the user chose a folder (`rsd cache` says where)
    if chosen_inductor_folder(cache_dir(), torch_default=default_cache_dir()) is None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # renamed in torch 2.6; both kept for 2.1-2.13
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), 64))
    config.automatic_dynamic_shapes = False
    register_operator()  # rsd::linear, what compiled graphs call for the measured kernels
    register_experts_operator()  # rsd::experts, the experts of mixtures (routed_experts)
    _remember_isa_probes()
    import torch._inductor.config as inductor
    # in bfloat16 and float16 (a GPU's default) each operation's result rounded to the dtype as the
    # uncompiled layers and transformers' forward round it, not kept in float32 through a fused kernel
    # (tiny bfloat16 models' logits 2.5-8.4 bfloat16 steps from transformers' without, 0-2.1 with); for rsd's
    # graphs alone (transformers' own compiled generate, `bench`'s peer, left as torch makes it)
    options = {"emulate_precision_casts": True} if hasattr(inductor, "emulate_precision_casts") else None
    return torch.compile(fn, fullgraph=True, options=options)


def _isa_key() -> str:
    """What inductor's instruction set probes depend on: the machine, torch and the C++ compiler."""
    import os
    import shutil

    compiler = os.environ.get("CXX", "g++")
    path = shutil.which(compiler) or compiler
    try:
        stamp = os.stat(path).st_mtime_ns
    except OSError:
        stamp = 0
    return f"instruction set probes | {machine()} | {path} {stamp}"


def _remember_isa_probes() -> None:
    """inductor finds which vector instruction sets it may use by building a small library with
    each the CPU lists and loading it in a new Python process, in every process that compiles
    (six on a 2-core AMD EPYC: ~0.9 s of each --compile on start). Each probe's answer depends on
    the machine, torch, the compiler and the probe alone, so it is kept (`compile.json` in the rsd
    cache folder) and given back to later processes: the same answers, the same instruction sets,
    the same code and cached graphs. Where this torch lays its probes out otherwise, it probes
    as before."""
    import hashlib

    from .models import cache_dir, read_json_table, write_json_table

    try:
        from torch._inductor.cpu_vec_isa import VecISA

        probe = VecISA.check_build
    except (ImportError, AttributeError):
        return
    if getattr(probe, "remembered", False):
        return

    def check_build(isa, code: str) -> bool:
        path, key = cache_dir() / "compile.json", _isa_key()
        question = f"{type(isa).__name__} {isa.build_arch_flags()} {hashlib.sha256(code.encode()).hexdigest()[:16]}"
        answers = read_json_table(path).get(key)
        if isinstance(answers, dict) and isinstance(answers.get(question), bool):
            return answers[question]
        answer = bool(probe(isa, code))
        known = read_json_table(path)
        known[key] = {**(known[key] if isinstance(known.get(key), dict) else {}), question: answer}
        write_json_table(path, known)
        return answer

    check_build.remembered = True
    VecISA.check_build = check_build


class StaticLM(ChainExtension):
    """`CachedLM`'s interface (forward / extend / keep / length) over a `CompiledModel`'s buffers."""

    def __init__(self, compiled: CompiledModel, vocab_size: int, capacity: int):
        self.compiled = compiled
        self.vocab_size = vocab_size
        buffers = compiled.lease(self, capacity) if compiled.static_shapes else None
        self.static = buffers is not None  # static shapes on the model's shared buffers (CUDA graphs)
        self.keys, self.values = buffers or compiled.new_buffers(capacity)
        self.capacity = stacks_of(self.keys)[0].shape[2]
        self.length = 0
        # a sliding window's keys are hidden by position (a slot's is not its index where completions
        # share the cache), ALiBi's biased by it: each slot's position, kept for those only
        self.window = compiled.window
        self.chunk = compiled.chunk  # (Llama 4's chunked attention: its layers' keys of their row's chunk only)
        self.alibi = compiled.alibi
        self.key_positions = torch.zeros(self.capacity if self.by_position else 0, dtype=torch.long)
        self.clock = ForwardClock(compiled.device)
        self.calls = 0
        self.long_from = compiled.long_from  # (a `longrope` model's: engine.long_factors_from)
        self.prompt_long: bool | None = None  # (while a prompt is read in pieces: whether it is astride that start)
        # gated delta nets' and Mamba-2 mixers' states standing for their keys before slot `folded`, which every
        # row since has seen (_fold; not on static shapes, whose graphs read every key), or None
        self.states = None if self.static else compiled.new_states()
        self.folded = 0

    @property
    def model(self):
        return self.compiled.model

    @property
    def device(self) -> torch.device:
        return self.compiled.device

    @property
    def by_position(self) -> bool:
        """Whether the masks depend on each slot's position (a window, chunks, ALiBi): made on the host,
        never by forward_placed's callers."""
        return self.window is not None or self.chunk is not None or self.alibi is not None

    @property
    def forward_seconds(self) -> float:
        return self.clock.seconds

    def padded(self, n: int, long: bool = False) -> int:
        """The rows a forward of n tokens computes: n padded to its bucket where forwards run compiled or
        on static shapes (not a prompt turned by a `longrope` model's long factors there), else n."""
        size = bucket(n, self.compiled.buckets)
        return (size or n) if self.compiled.compiled or (self.static and size is not None and not long) else n

    def forward(self, tokens: list[int] | torch.Tensor, positions: list[int], visible: torch.Tensor,
                last_only: bool = False, reading: bool = False) -> torch.Tensor:
        """Same contract as CachedLM.forward: visible is (n, length + n) bool over cache + new keys;
        tokens a list, or an (n,) tensor on the model's device (drawn there: no value read). Each row
        is turned by its own position's angles, but a prompt's (`reading`) astride a `longrope` model's
        long factors' start, all by the long ones, as one forward of transformers' turns them
        (engine.long_factors_from)."""
        start = self.clock.start()
        n = len(tokens)
        sizes = self.compiled.buckets
        fold = None if self.states is None else (self._fold(visible), self.states)
        # (a chain after every key before it, long enough: read by chunks where layers carry a state, CHAIN_ROWS)
        chain = n >= CHAIN_ROWS and self.compiled.chains_by_chunks and chain_after(visible, self.length)
        long = reading and (astride(positions, self.long_from) if self.prompt_long is None else self.prompt_long)
        if self.long_from is not None:
            self._note_factors(positions, long)
        # (a longer prompt, or one turned by the long factors: the other path, same buffers)
        static = self.static and bucket(n, sizes) is not None and not long
        size = self.padded(n, long)
        # (compiled graphs: a slot to spare, the keys never as many as the buffers hold, which a graph would take
        # as a guard of its own and compile again for, in the middle of an answer; not on static shapes, whose
        # buffers grown are graphs captured again, nor needed there: their masks cover the whole buffers)
        spare = int(self.compiled.inductor and not self.static)
        if self.length + size + spare > self.capacity:
            self._grow(self.length + size + spare)
        pad = size - n
        device = self.compiled.device
        kv_len = self.capacity if static else self.length + size
        # a graph's inputs are made on the host in page-locked memory, which its replay copies in
        # without waiting for the device (a plain copy to a GPU waits for all the work queued before it)
        pinned = static and self.compiled.graphed and device.type == "cuda"
        by_kind = self.compiled.by_kind is not None  # (a mask for full attention's layers, one for the window's)
        seen = [visible]  # what each mask lets the new tokens see
        if self.by_position:
            new = torch.tensor(positions)
            self.key_positions[self.length: self.length + n] = new
        if self.window is not None or self.chunk is not None:  # (the keys within the window or chunk of each row's
            # position)
            keys_at = self.key_positions[: self.length + n]
            seen.append(visible & (within_window(new, keys_at, self.window) if self.window is not None
                                   else within_chunk(new, keys_at, self.chunk)))
            seen = seen if by_kind else seen[1:]
            visible = seen[-1]
        with torch.inference_mode():  # inputs made here as in warm_up: the compiled graphs' guards match
            mask = torch.full((len(seen), size, kv_len), -math.inf, dtype=torch.float32, pin_memory=pinned)
            for kind_mask, kind_seen in zip(mask, seen):
                kind_mask[:n, : self.length + n].masked_fill_(kind_seen, 0.0)
            if pad:  # padding rows see only themselves; their keys land beyond the used length
                mask[:, n:, self.length + n: self.length + size] = torch.where(torch.eye(pad, dtype=torch.bool), 0.0,
                                                                               -math.inf)
            mask = mask if by_kind else mask[0]  # (n, kv_len), or (2, n, kv_len) by layer kind
            # ALiBi: each head's bias by the keys' positions (heads, 1, kv_len; MPT's by each row's too: heads,
            # size, kv_len), in a mask for each head — made on the host for a graph's mask buffer (a few rows),
            # else on the device only (a prompt's: heads x P x P, as large as transformers' scores)
            bias = None if self.alibi is None else self.compiled.position_bias(
                self.key_positions[:kv_len], [max(positions)] if reading else positions + [positions[-1]] * pad)
            if bias is not None and static:
                mask = mask + bias
                mask = mask.pin_memory() if pinned else mask
            on_device = isinstance(tokens, torch.Tensor)
            ids = [[0] * size if on_device else tokens + [0] * pad, positions + [positions[-1]] * pad]
            if static:  # (tokens, positions, slots): one host tensor, device tokens beside it
                ids = torch.tensor(ids + [list(range(self.length, self.length + size))], pin_memory=pinned)
                logits = self.compiled.replay(ids, mask, self.keys, self.values,
                                              slice(n - 1, n) if last_only else slice(0, n),
                                              tokens if on_device else None)
            else:
                ids = torch.tensor(ids, device=device)
                token_ids = torch.nn.functional.pad(tokens.to(device), (0, pad)) if on_device else ids[0]
                rows = torch.tensor([n - 1]) if last_only else torch.arange(n)  # padding rows skip the head

                def sight() -> Sight | None:
                    """what torch's attention reads, where less than every key through the mask (a prompt's)"""
                    found = sight_of(visible, mask) if n > 1 and not pad and not by_kind and self.alibi is None \
                        else None
                    if found is None:
                        return None
                    return Sight(*(t if t is None else t.to(device) for t in (found.keys, found.mask)))

                placed = mask.to(device)
                if bias is not None:  # (heads, n, kv_len)
                    placed = placed + bias.to(device)
                logits = self.compiled.forward(token_ids, ids[1], placed, self.keys, self.values,
                                               rows.to(device), sight=sight, long=long, chain=chain and not pad,
                                               fold=fold)
        self.length += n
        if fold is not None and chain and not pad:  # (the chain's last state left in the states)
            self.folded = self.length
        logits = full_vocabulary(logits[:, : self.vocab_size].float(), self.vocab_size)  # stays on the device
        self.clock.stop(start)
        self.calls += 1
        return logits

    def _fold(self, visible: torch.Tensor) -> int:
        """The slot before which the layers keeping a state read `states` instead of keys in a forward of
        rows seeing `visible` (n, length + n) bool: the keys every row sees, from the first on, are summed
        into them (CompiledModel.fold) once at least FOLD_ROWS have come since those summed last; where a
        row does not see all of those, the states start again from none."""
        hidden = (~visible[:, : self.length].all(0)).nonzero()
        committed = int(hidden[0]) if len(hidden) else self.length  # (the slots every row sees, from the first on)
        if committed < self.folded:
            self._unfold()
        if committed - self.folded >= FOLD_ROWS:
            self.compiled.fold(self.states, self.values, self.folded, committed)
            self.folded = committed
        return self.folded

    def _unfold(self) -> None:
        """States standing for no key (the keys they summed changed, or a row no longer sees them all)."""
        for state in self.states:
            if state is not None:
                state.zero_()
        self.folded = 0

    def extend(self, tokens: list[int] | torch.Tensor, last_only: bool = True, reading: bool = False) -> torch.Tensor:
        """ChainExtension.extend, but a prompt (`reading`, its last row's logits only) whose one forward
        would mask more than PROMPT_MASK_SCORES scores is read in pieces, one forward each, every piece's
        rows seeing the cache and themselves causally: the same keys and values, the same last row (to
        float sums in another order), with masks of a piece's rows only. A `longrope` model's prompt
        astride its long factors' start, which transformers turns by the long ones as one forward, has
        every piece turned by them (long_factors_from). On static shapes (CUDA graphs) a chain that is no
        prompt and longer than the widest bucket (up to GRAPHED_PIECES of it) is read in pieces of that
        bucket, each a graph's replay."""
        n, past = len(tokens), self.length
        top = self.compiled.buckets[-1]
        if self.static and not reading and top < n <= GRAPHED_PIECES * top:
            # (a chain longer than the widest graph, not a prompt: the draft catching up on the tokens of
            # `auto`'s plain steps: graphed pieces of `top` rows, the last padded to its bucket, instead of one
            # forward off the graphs)
            pieces = []
            for start in range(0, n, top):
                pieces.append(super().extend(tokens[start: start + top], last_only))
            return pieces[-1] if last_only else torch.cat(pieces)
        rows = max(PIECE_ROWS, PROMPT_MASK_SCORES // (past + n))
        if not reading or not last_only or n <= rows:
            return super().extend(tokens, last_only, reading)
        self.prompt_long = astride(list(range(past, past + n)), self.long_from)
        try:
            for start in range(0, n, rows):
                logits = super().extend(tokens[start: start + rows], True, reading=True)
        finally:
            self.prompt_long = None
        return logits

    def forward_placed(self, ids: torch.Tensor, mask: torch.Tensor, rows: slice) -> torch.Tensor:
        """A static-shape forward whose inputs were made on the device (nothing read on the host):
        ids (3, size) — tokens, positions and the slots their keys go to — and mask (size, capacity)
        additive, size a bucket. The host's `length` does not move: the caller, which knows what
        the caches hold only once it reads a step's outcome, sets it (Decoder._tree_steps_ahead).
        Not for a windowed or ALiBi model, whose masks need each slot's position (Decoder._ahead_kind)."""
        assert not self.by_position, "a windowed or ALiBi model's masks are made on the host"
        start = self.clock.start()
        with torch.inference_mode():
            logits = self.compiled.replay(ids, mask, self.keys, self.values, rows)
        logits = full_vocabulary(logits[:, : self.vocab_size].float(), self.vocab_size)
        self.clock.stop(start)
        self.calls += 1
        return logits

    def copy_slot(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        """Every layer's key and value at slot source (1,) copied to slot destination (1,), both on
        the device (an accepted tree node moved next to its parent without reading where it is)."""
        with torch.inference_mode():
            for stack in (*stacks_of(self.keys), *stacks_of(self.values)):
                stack.index_copy_(2, destination, stack.index_select(2, source))

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self.capacity)
        buffers = self.compiled.lease(self, capacity) if self.static else None  # (graphs captured again)
        keys, values = buffers or self.compiled.new_buffers(capacity)
        for new, old in zip((*stacks_of(keys), *stacks_of(values)), (*stacks_of(self.keys), *stacks_of(self.values))):
            new[:, :, : self.length] = old[:, :, : self.length]
        self.keys, self.values, self.capacity = keys, values, capacity
        if self.by_position:
            self.key_positions = torch.cat([self.key_positions, torch.zeros(capacity - len(self.key_positions),
                                                                            dtype=torch.long)])

    def release(self) -> None:
        """Hand the model's shared buffers back (the next generation may take them)."""
        if self.static:
            self.compiled.release(self)

    def keep(self, indices: list[int]) -> None:
        """Keep only these cache positions (ascending): one index copy for all layers."""
        prefix = unchanged_prefix(indices)
        if self.states is not None and prefix < self.folded:  # (keys the states summed moved or dropped)
            self._unfold()
        if prefix < len(indices):
            tail = to_device(indices[prefix:], self.compiled.device)  # (on a GPU: without waiting)
            with torch.inference_mode():
                for stack in (*stacks_of(self.keys), *stacks_of(self.values)):
                    stack[:, :, prefix: len(indices)] = stack.index_select(2, tail)
            if self.by_position:
                self.key_positions[prefix: len(indices)] = self.key_positions[indices[prefix:]]
        self.length = len(indices)


WARM_SIZES = (1, 2, 4)  # token counts every variant uses (draft steps, small trees): compiled at load
PLAIN_SIZES = (1,)  # plain decoding's steps (a prompt's own count compiles at its first use, before any token)
VERDICT_REPEATS = 7


def warm_sizes(fixed, role: str) -> tuple[int, ...]:
    """The token counts to compile at load for a run whose every step has the Shape `fixed` (None: its
    shapes vary — `auto`, a chat's /set, completions decoded together): WARM_SIZES, and for a fixed
    drafting shape the buckets up to its widest forward — the target's tree (max_nodes; every bucket
    below too, as trees drafted with replacement or merged sequences can be smaller), the draft's widest
    level — so that no graph is compiled or read from the compile cache in the middle of an answer. `ar`:
    PLAIN_SIZES, and nothing for the draft, which never runs; `lookup` drafts without it."""
    if fixed is None or fixed.variant == "auto":
        return WARM_SIZES
    if fixed.variant == "ar" or (role == "draft" and not fixed.uses_draft_model):
        return PLAIN_SIZES if role == "target" else ()
    if role == "target":
        widest = fixed.max_nodes
    elif fixed.variant in ("rsd-s", "spectr"):
        widest = fixed.width  # (each level's beams, each sequence's next token)
    else:  # (the levels the draft reads to draft the next: all but the last)
        widest = max(itertools.accumulate(fixed.branching[:-1], operator.mul), default=1)
    top = bucket(widest) or BUCKETS[-1]
    return tuple(sorted(set(WARM_SIZES) | {b for b in BUCKETS if b <= top}))


def warm_up(runtime: CompiledModel, sizes=WARM_SIZES) -> None:
    """Run (so compile) the given token counts once on scratch buffers, with inputs made in
    inference mode as StaticLM.forward makes them (so the compiled graphs' guards match); where layers
    keep a state, with a fold too (their graphs reading a state and the keys after it: StaticLM._fold)."""
    keys, values = runtime.new_buffers(max(sizes) + 8)
    states = runtime.new_states()  # (made as StaticLM makes them, outside inference mode: the same guards)
    past = 4
    with torch.inference_mode(), every_thread():  # (graphs compiled for the CPU's threads)
        for n in sizes:
            tokens = torch.zeros(n, dtype=torch.long, device=runtime.device)
            # static shapes (what CUDA graphs capture): the new keys at slots, the mask over the capacity
            mask = torch.zeros(n, stacks_of(keys)[0].shape[2] if runtime.static_shapes else past + n,
                               device=runtime.device)
            mask = mask if runtime.by_kind is None else mask.expand(2, -1, -1).clone()
            mask = mask if runtime.alibi is None else mask.expand(runtime.dims[0], -1, -1).clone()  # (by head)
            slots = torch.arange(past, past + n, device=runtime.device) if runtime.static_shapes else None
            folds = [None] + ([(1, states)] if states is not None and slots is None else [])
            for fold in folds:
                runtime.forward(tokens, tokens, mask, keys, values, torch.arange(n, device=runtime.device), slots,
                                fold=fold)


def compiled_gain(model) -> float:
    """Compiled over uncompiled forward time of this model on the static-cache runtime, summed over
    a 1-token and a 4-token forward after a 100-token prefix (below 1: compiling pays), each as a
    generation makes it (on a GPU: replaying CUDA graphs). The two alternate, and each keeps its
    fastest of VERDICT_REPEATS runs: a busy moment of the machine then cannot decide the verdict."""
    with every_thread():  # (both on the threads the graphs are compiled for)
        return _compiled_gain(model)


def _compiled_gain(model) -> float:
    eager, compiled = CompiledModel(model, compile=False), CompiledModel(model, compile=True)
    warm_up(compiled, (1, 4))  # (on a GPU each size's graph is then captured at its first timed run)
    vocab = decoder_of(model)[1].vocab_size
    caches = {runtime: StaticLM(runtime, vocab, 128) for runtime in (compiled, eager)}
    for lm in caches.values():
        lm.extend([i % vocab for i in range(100)])  # (ids the embedding has: on a GPU
        # an id past it is a device-side assert, which leaves the process's CUDA context unusable)
    best = {runtime: [math.inf, math.inf] for runtime in (compiled, eager)}
    for _ in range(VERDICT_REPEATS + 1):
        for runtime, lm in caches.items():
            for i, n in enumerate((1, 4)):
                best[runtime][i] = min(best[runtime][i], timed_chain(lm, n))
    for lm in caches.values():
        lm.release()
    return sum(best[compiled]) / sum(best[eager])


# "auto" compiles where a compiled forward takes at most 80% of an uncompiled one: a compiled process
# starts ~6 s later on a 2-core CPU (tracing the graphs again), which a few percent do not repay
# within an answer; where overhead dominates (a GPU, many cores) the gain is several-fold
REQUIRED_GAIN = 0.8


def verdict_key(model) -> str:
    """What the verdict depends on: the machine, device, dtype, the layer's shape and the CPU kernels
    its linears use (an early-exit draft shares its target's layers; the layer count does not enter:
    layers run one compiled graph each)."""
    inner, cfg = decoder_of(model)
    p = next(model.parameters())

    def size(name: str):  # (what a config does not name, as GPT-2's or BLOOM's intermediate size: None)
        try:
            found = getattr(cfg, name, None)
        except RuntimeError:  # (one Gemma 4's config names for each layer, refusing to name one for all)
            return "by layer"
        if isinstance(found, (list, tuple)):  # (Gemma 3n's: one for each layer)
            return found[0] if len(set(found)) == 1 else "by layer"
        return found

    key = (f"{machine()} | {p.device.type} | {str(p.dtype).removeprefix('torch.')} | {cfg.model_type} "
           f"{size('hidden_size')}x{size('intermediate_size')} {size('num_attention_heads')}/"
           f"{size('num_key_value_heads')} heads")
    layers = getattr(inner, "layers", None)
    return f"{key} | kernels {signature(layers[0])}" if layers else key


def compile_pays(model, progress=lambda message: None, notice=lambda message: None) -> bool:
    """The cached verdict for this machine and model shape, measured once (`compile.json` in the
    rsd cache folder; a lost or unwritable file only means measuring again)."""
    from .models import cache_dir, read_json_table, write_json_table

    path = cache_dir() / "compile.json"
    known = read_json_table(path)
    key = verdict_key(model)
    if not isinstance(known.get(key), dict):
        notice("measuring once whether compiling the layers pays on this machine (the verdict is cached)")
        progress("measuring whether compiling pays on this machine (once)")
        try:
            gain = compiled_gain(model)
            known[key] = {"compiled_over_eager": round(gain, 4), "compile": gain <= REQUIRED_GAIN}
        except Exception as e:  # noqa: BLE001 - a compiler missing or failing here: run uncompiled
            known[key] = {"compiled_over_eager": None, "compile": False,
                          "error": f"{type(e).__name__}: {e}".splitlines()[0]}
        write_json_table(path, known)
    return bool(known[key]["compile"])


def runtime_for(model, setting: str, role: str, progress=lambda message: None, notice=lambda message: None,
                fixed=None):
    """The CompiledModel a --compile setting gives this model, or None for transformers' eager
    forward. "off": eager transformers; "on": the static-cache runtime, compiled; "auto": the
    static-cache runtime, compiled where it measured faster on this machine (cached verdict), and
    uncompiled without measuring where every layer runs in C (CompiledModel.all_in_c). fixed: the
    Shape of every step of the run, where it has one (one completion of a chosen variant: not a chat,
    whose /set may change it, nor completions decoded together), else None: what is compiled at load
    (warm_sizes) — for `ar` a one-token forward alone, and nothing for the draft, which never runs (on a
    2-core Xeon the 2- and 4-token graphs took ~1.1 s of a second process's start)."""
    if setting == "off":
        return None
    reason = unsupported(model)
    if reason is not None:
        placed = reason in PLACEMENT_REASONS and getattr(model, "hf_device_map", None)  # a profile asked for it
        if setting == "on" or placed:
            what = "--compile on" if setting == "on" else "the static-cache runtime"
            notice(f"{what} does not apply to the {role} ({reason}): it runs on transformers' eager forward")
        return None
    if setting == "auto":
        uncompiled = CompiledModel(model, compile=False, notice=notice)
        if uncompiled.all_in_c:  # nothing to measure: compiled graphs run the same products with more overhead
            return uncompiled
    compile = setting == "on" or compile_pays(model, progress, notice)
    runtime = uncompiled if setting == "auto" and not compile else CompiledModel(model, compile=compile, notice=notice)
    sizes = runtime.buckets if runtime.graphed and not (fixed and fixed.variant == "ar") else warm_sizes(fixed, role)
    if runtime.inductor and sizes:  # (CUDA graphs are captured later, at each size's first use: milliseconds)
        first = _first_compile_here(model, sizes)
        if first:
            notice(f"compiling the {role}'s layers for this machine, once (later runs read them from the cache)")
        progress(f"compiling the {role}'s layers")
        try:  # (CUDA graphs: every token count a graph may be captured for, compiled now, not mid-answer)
            warm_up(runtime, sizes)
        except Exception as e:  # noqa: BLE001 - torch.compile needs a C++ compiler (CPU) or triton (GPU)
            fallback = "CUDA graphs of its uncompiled layers" if runtime.graphed else "the static-cache runtime uncompiled"
            notice(f"compiling the {role} failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): "
                   f"it runs on {fallback}")
            return CompiledModel(model, compile=runtime.graphed, inductor=False, notice=notice)
        if first:
            _mark_compiled(model, sizes)
        if setting == "on" and role == "target" and runtime.all_in_c:
            # (the same products, with a graph call and the other operations around each: a 1-token forward of
            # the embedded target 9.9 against 4.6 ms on the 2-core EPYC, `ar` 35-47 against 96 tok/s on the Xeon)
            notice("--compile on: the target's layers are compiled as asked, but on this CPU rsd's C library runs them "
                   "about 2x faster uncompiled (what --compile auto picks)")
    return runtime


def _marker(model, size: int | None = None):
    """A file saying this model's layers were compiled here for a token count (each count's graph is a
    compile of its own); without a size, the one marker earlier versions wrote: all of WARM_SIZES."""
    import hashlib

    from .models import cache_dir

    name = f"rsd-{hashlib.sha256(verdict_key(model).encode()).hexdigest()[:16]}"
    return cache_dir() / "inductor" / (name if size is None else f"{name}-{size}")


def _first_compile_here(model, sizes: tuple[int, ...]) -> bool:
    """Whether some of these token counts were never compiled here for this model."""
    if set(sizes) <= set(WARM_SIZES) and _marker(model).exists():
        return False
    return not all(_marker(model, n).exists() for n in sizes)


def _mark_compiled(model, sizes: tuple[int, ...]) -> None:
    try:
        _marker(model).parent.mkdir(parents=True, exist_ok=True)
        for n in sizes:
            _marker(model, n).touch()
    except OSError:
        pass
