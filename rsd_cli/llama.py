"""Llama-architecture checkpoints (Qwen2's, Mistral's and Qwen3's too) loaded without transformers' modeling code.

Importing transformers' Llama model costs ~2 s of a 2-core CPU's time (its modeling code pulls
torch._dynamo, torch.distributed and every model's import structure in), about half of what a
short `rsd generate` takes. rsd's static-cache runtime (`compiled.CompiledModel`) reads a model's
weights, norms and rotary tables but never calls its forward, so where that runtime runs both
models, the checkpoint is loaded into the modules below instead: the same module tree, parameter
names and constructors as transformers' `LlamaForCausalLM` (the early-exit draft, the adapter and
the fingerprint work on it unchanged), without a forward of its own. A checkpoint this module
does not cover (another architecture, a rotary scaling, remote code, quantised weights, no
safetensors), a placement over devices and `--compile off` load through transformers as before;
RSD_LIGHT_LOAD=0 always does. Tests compare both loads: state dicts, fingerprints, rotary tables
and logits.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from .errors import RsdError

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
LOADED_BY = "rsd (without transformers' modeling code)"
# what a Qwen2, Qwen3 or Mistral config.json must state to load here (their classes' defaults are not
# Llama's, which read_config fills in; real checkpoints state them all)
STATED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "max_position_embeddings", "rms_norm_eps")


ROPE_TYPES = {"default": (), "linear": ("factor",),  # the rotary scalings computed here: their parameters
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def _rope(raw: dict) -> tuple[float, str, dict]:
    """(rope_theta, rope_type, every rope parameter) as transformers 4 (rope_theta, rope_scaling)
    or 5 (rope_parameters) write them in config.json."""
    parameters = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    theta = parameters.get("rope_theta", raw.get("rope_theta", 10000.0))
    kinds = (parameters.get("rope_type"), scaling.get("rope_type"), scaling.get("type"))
    # any scaling named anywhere decides (which one transformers would apply is not ours to guess)
    kind = next((k for k in kinds if k and k != "default"), "default")
    return float(theta), kind, {**scaling, **parameters, "rope_theta": float(theta), "rope_type": kind}


def inverse_frequencies(config) -> torch.Tensor:
    """The rotary embedding's inverse frequencies, as transformers' rope functions compute them
    (the same float32 operations in the same order: the tests compare the tables bit for bit)."""
    parameters, dim = config.rope_parameters, config.head_dim
    # on the CPU even while the modules are made on "meta" (load): a table, computed, not loaded
    steps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(dtype=torch.float)
    inv_freq = 1.0 / (parameters["rope_theta"] ** (steps / dim))
    kind = parameters["rope_type"]
    if kind == "linear":
        return inv_freq / parameters["factor"]
    if kind == "llama3":  # Llama 3.1's: long wavelengths divided by the factor, the middle ones smoothed
        factor, low, high = parameters["factor"], parameters["low_freq_factor"], parameters["high_freq_factor"]
        old_context = parameters["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_context / low, old_context / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def why_not(folder: Path) -> str | None:
    """Why this model folder must load through transformers, or None when it can load here."""
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return "no readable config.json"
    kind = raw.get("model_type")
    architecture = CLASSES[kind].__name__ if kind in CLASSES else None  # (transformers' class of that name)
    if architecture is None or raw.get("architectures", [architecture]) != [architecture]:
        return f"a {kind} model"
    if kind != "llama" and any(key not in raw for key in STATED):
        return f"a config.json that leaves out {next(key for key in STATED if key not in raw)}"
    if _window(raw) is not None and kind != "mistral":  # (Mistral's is every layer's: compiled.window_of)
        return f"{kind}'s sliding-window attention (on the layers past max_window_layers)"
    if raw.get("auto_map") or raw.get("quantization_config"):
        return "remote code or quantised weights"
    if raw.get("hidden_act", "silu") != "silu" or raw.get("mlp_bias") or raw.get("pretraining_tp", 1) != 1:
        return "layers that differ from Llama's"
    _, rope_type, rope = _rope(raw)
    if rope_type not in ROPE_TYPES or any(key not in rope for key in ROPE_TYPES[rope_type]) \
            or rope.get("partial_rotary_factor", 1.0) != 1.0:
        return f"rope type {rope_type!r}"
    if not (folder / WEIGHTS).is_file():
        try:
            shards = _shards(folder)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return "no safetensors weights"
        if not all((folder / shard).is_file() for shard in shards):  # (a download cut short)
            return "safetensors shards missing"
    return None


def _window(raw: dict) -> int | None:
    """The sliding window the layers attend to, or None: Qwen2's where `use_sliding_window` (its
    config drops the window otherwise), Mistral's where shorter than the context."""
    window = raw.get("sliding_window")
    if raw.get("model_type") in ("qwen2", "qwen3"):
        return window if raw.get("use_sliding_window") and window else None
    if raw.get("model_type") == "mistral" and window and window < raw.get("max_position_embeddings", 0):
        return window
    return None


def _shards(folder: Path) -> list[str]:
    """The files a sharded checkpoint's index names, in order."""
    return sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))


def read_config(folder: Path) -> SimpleNamespace:
    """config.json with transformers' defaults for what it leaves out (LlamaConfig's)."""
    raw = json.loads((folder / "config.json").read_text())
    rope = _rope(raw)[2]
    values = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu",
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "pad_token_id": None, "bos_token_id": 1,
              "eos_token_id": 2, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
              "head_dim": None, **raw, "rope_parameters": rope}
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if values["head_dim"] is None:
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    values.pop("rope_scaling", None)
    values.pop("rope_theta", None)
    values["sliding_window"] = _window(raw)  # (None, or Mistral's window on every layer: why_not)
    return SimpleNamespace(**values)


def read_generation_config(folder: Path, config) -> SimpleNamespace:
    """generation_config.json (rsd reads its eos_token_id), the config's eos_token_id where it
    names none (as transformers' generation config falls back to the model's)."""
    try:
        raw = json.loads((folder / "generation_config.json").read_text())
    except (OSError, ValueError):
        raw = {}
    return SimpleNamespace(**{"eos_token_id": config.eos_token_id, **raw})


@contextlib.contextmanager
def uninitialised():
    """Linear and embedding modules made without drawing initial values, for modules whose values
    are loaded next: on "meta" those draws import torch._dynamo (~0.7 s) and are thrown away."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps


class RotaryEmbedding(nn.Module):
    """cos and sin of each position's angles, as transformers' default rotary embedding makes them
    (float32 angles, then the input's dtype)."""

    attention_scaling = 1.0

    def __init__(self, config):
        super().__init__()
        self.rope_type = config.rope_parameters["rope_type"]
        self.register_buffer("inv_freq", inverse_frequencies(config), persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.scaling = self.head_dim ** -0.5
        heads, kv_heads, bias = config.num_attention_heads, config.num_key_value_heads, config.attention_bias
        qkv_bias = bias or config.model_type == "qwen2"  # Qwen2's q, k and v have biases, its o none
        self.q_proj = nn.Linear(config.hidden_size, heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * self.head_dim, config.hidden_size, bias=bias)
        if config.model_type == "qwen3":  # an RMS norm on each head of q and k
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Decoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(config, index) for index in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class LlamaForCausalLM(nn.Module):
    """transformers' LlamaForCausalLM's modules and parameter names, without its forward: rsd's
    static-cache runtime computes with them."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.generation_config = SimpleNamespace(eos_token_id=config.eos_token_id)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, *args, **kwargs):
        raise RsdError(f"this model was loaded by {LOADED_BY}: it runs on rsd's static-cache runtime only "
                       "(load it with --compile on or auto, or RSD_LIGHT_LOAD=0 for transformers' forward)")


class Qwen2ForCausalLM(LlamaForCausalLM):
    """transformers' Qwen2ForCausalLM's modules and names: Llama's, with biases on q, k and v."""


class MistralForCausalLM(LlamaForCausalLM):
    """transformers' MistralForCausalLM's modules and names: Llama's (a sliding window is in the
    static-cache runtime's masks: compiled.window_of)."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """transformers' Qwen3ForCausalLM's modules and names: Llama's, with an RMS norm on each head of q and k."""


CLASSES = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "mistral": MistralForCausalLM,
           "qwen3": Qwen3ForCausalLM}


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if (folder / WEIGHTS).is_file():
        return load_file(str(folder / WEIGHTS))
    tensors: dict[str, torch.Tensor] = {}
    for shard in _shards(folder):
        tensors.update(load_file(str(folder / shard)))
    return tensors


def load(folder: Path, device, dtype) -> LlamaForCausalLM:
    """The checkpoint in `folder` (why_not(folder) is None) on `device` in `dtype`, in eval mode."""
    config = read_config(folder)
    with torch.device("meta"), uninitialised():
        model = CLASSES[config.model_type](config)
    try:
        tensors = {name: tensor.to(dtype=dtype) for name, tensor in _tensors(folder).items()}
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise RsdError(f"cannot read the weights in {folder}: {str(e).splitlines()[0]}") from None
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    for name in [name for name in tensors if name.endswith("rotary_emb.inv_freq")]:  # (older checkpoints saved
        del tensors[name]  # the rotary table, which transformers also ignores: it is computed)
    expected = set(model.state_dict()) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise RsdError(f"the weights in {folder} do not fit its config.json ({len(missing)} missing, e.g. "
                       f"{(missing or ['-'])[0]}; {len(unexpected)} unexpected, e.g. {(unexpected or ['-'])[0]})")
    model.load_state_dict(tensors, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.generation_config = read_generation_config(folder, config)
    return model.to(device).eval()

