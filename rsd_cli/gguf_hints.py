"""The scales and offsets of a GGUF file's quantised tensors, kept beside its converted weights
so that the CPU kernels hold those weights as blocks (blocks.Hint) where their float32 values
alone do not say how.

transformers dequantises every tensor of a GGUF file into float32. Q4_1 and Q8_0 values are
recognised from those floats (blocks.quantised_blocks), but llama.cpp's K-quants — Q4_K_M, the
most common GGUF file, is Q4_K with Q6_K for some tensors — are not: a Q4_K weight is
d * q - m per block of 32 with d and m products of a half float and a 6-bit integer, and q need
not reach 0 or 15 in a block. Without their blocks such weights stream 4 bytes each a forward
instead of 0.75. This module reads d and m from the file's own bytes, in the order transformers
gives the rows (its own loader runs once more, with `gguf.dequantize` answering these instead of
values), so that each becomes blocks of one of the kernel's formats that give back every float32
value transformers made (q4_1 for Q4_K and Q4_0, q5_1 for Q5_K and Q5_1, q8_16 for Q6_K and
Q3_K, q8_0 for Q5_0, iq4 for IQ4_NL and IQ4_XS): the same arithmetic, d * q exact and one
rounding for + m.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

HINTS_FILE = "rsd-block-hints.safetensors"

# a GGUF tensor type -> the kernel's format for it (blocks.scale_group: the weights a scale covers)
FORMAT_OF = {"Q4_K": "q4_1", "Q5_K": "q5_1", "Q6_K": "q8_16", "Q3_K": "q8_16", "Q4_0": "q4_1", "Q5_0": "q8_0",
             "Q5_1": "q5_1", "IQ4_NL": "iq4", "IQ4_XS": "iq4"}
# each type's block: its bytes and where its half-float d (and m, or K-quants' dmin) lie
_LAYOUT = {"Q4_K": (144, 0, 2), "Q5_K": (176, 0, 2), "Q6_K": (210, 208, None), "Q3_K": (110, 108, None),
           "Q4_0": (18, 0, None), "Q5_0": (22, 0, None), "Q5_1": (24, 0, 2), "IQ4_NL": (18, 0, None),
           "IQ4_XS": (136, 0, None)}


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """(n, bytes) uint8 -> (n, 1) float32: the half float at byte `at` of each block."""
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16).astype(np.float32)


def scales_and_offsets(data: np.ndarray, type_name: str) -> np.ndarray:
    """A tensor of one of FORMAT_OF's types as the file holds it ((..., row bytes) uint8, gguf's
    reader's `data`) -> (..., 2 * groups) float32: each group's scale d, then each group's offset m
    (zeros where the type has none), so that its weight is d * q + m, as gguf's dequantize
    computes it (d and m here are exact: half floats, or half floats times small integers)."""
    size, d_at, m_at = _LAYOUT[type_name]
    blocks = data.reshape(-1, size)
    d = _half(blocks, d_at)
    if type_name in ("Q4_K", "Q5_K"):  # d * sc - dmin * m per 32, sc and m 6-bit (gguf's unpacking)
        from gguf.quants import Q4_K

        sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
        scale, offset = d * sc.astype(np.float32), -(_half(blocks, m_at) * m.astype(np.float32))
    elif type_name == "Q6_K":  # d * (int8 scale) per 16
        scale = d * np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
        offset = np.zeros_like(scale)
    elif type_name == "Q3_K":  # d * (6-bit scale - 32) per 16, q in -4..3 (gguf's unpacking)
        packed = blocks[:, 96:108]
        low = (packed[:, None, :8] >> np.array([0, 4], dtype=np.uint8)[None, :, None]).reshape(-1, 16) & 15
        high = (packed[:, None, 8:] >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, :, None]).reshape(-1, 16) & 3
        scale = d * ((low | (high << 4)).astype(np.float32) - 32)
        offset = np.zeros_like(scale)
    elif type_name == "IQ4_XS":  # d * (6-bit scale - 32) per 32, q one of 16 int8 values
        high = np.ascontiguousarray(blocks[:, 2:4]).view(np.uint16)
        high = (high >> np.arange(0, 16, 2, dtype=np.uint16)[None, :]) & 3
        low = (blocks[:, 4:8, None] >> np.array([0, 4], dtype=np.uint8)[None, None, :]).reshape(-1, 8) & 15
        scale = d * ((low | (high.astype(np.uint8) << 4)).astype(np.float32) - 32)
        offset = np.zeros_like(scale)
    elif type_name == "Q5_1":
        scale, offset = d, _half(blocks, m_at)
    elif type_name == "Q4_0":  # d * (q - 8) = d * q - 8 d (all exact)
        scale, offset = d, d * -8.0
    else:  # Q5_0, IQ4_NL: d * (q - 16) (q8_0's d * q: its 5-bit lookup costs more than it saves on
        # 576-wide rows, SmolLM2's fallback type), d * (one of 16 int8 values)
        scale, offset = d, np.zeros_like(d)
    rows = data.shape[:-1]
    return np.concatenate([scale.reshape(*rows, -1), offset.reshape(*rows, -1)], axis=-1)


def hinted_types(gguf_path: Path) -> set[str]:
    """The FORMAT_OF types among the file's tensors."""
    import gguf

    return {t.tensor_type.name for t in gguf.GGUFReader(str(gguf_path)).tensors} & set(FORMAT_OF)


def read_hints(gguf_path: Path, model) -> dict[str, tuple[str, np.ndarray]]:
    """{parameter name of `model` (the file loaded by transformers): (format, scales_and_offsets)}
    for its tensors of FORMAT_OF's types, each row where transformers put it: transformers' GGUF
    loader runs again with gguf's dequantize giving these instead of values (what it does to rows
    — Llama's q and k are permuted back — it does to them; its name table maps them). Parameters
    whose shape does not match are left out; {} where that loader cannot be run so."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    codes = list(FORMAT_OF)

    def dequantize(data, qtype):  # each row: its scales and offsets, then its type's code
        name = gguf.GGMLQuantizationType(qtype).name
        if name not in FORMAT_OF:
            return original(data, qtype)
        hint = scales_and_offsets(data, name)
        code = np.full((*hint.shape[:-1], 1), codes.index(name), dtype=np.float32)
        return np.concatenate([hint, code], axis=-1)

    original = gguf.dequantize
    gguf.dequantize = dequantize
    try:
        tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    except Exception:  # another version of transformers' loader: the weights stay floats
        return {}
    finally:
        gguf.dequantize = original
    parameters = dict(model.named_parameters())
    hints = {}
    for name, tensor in tensors.items():
        weight = parameters.get(name)
        if weight is None or weight.dim() != 2 or tensor.dim() != 2 or tensor.shape[0] != weight.shape[0]:
            continue
        code = tensor[:, -1]
        if not (code == code[0]).all() or not 0 <= int(code[0]) < len(codes):
            continue
        found = (FORMAT_OF[codes[int(code[0])]], tensor[:, :-1].contiguous())
        if fits(found, weight.shape):
            hints[name] = found
    return hints


def fits(hint: tuple, shape) -> bool:
    """Whether a hint (format, scales_and_offsets) is one for a weight of this (rows, columns) shape."""
    from .blocks import scale_group

    fmt, values = hint
    group = scale_group(fmt)
    return shape[1] % group == 0 and tuple(values.shape) == (shape[0], 2 * shape[1] // group)


def save_hints(hints: dict, folder: Path) -> None:
    """Write read_hints' answer into a converted model's folder (HINTS_FILE): each parameter's
    scales and offsets, its format in the file's metadata."""
    from safetensors.torch import save_file

    save_file({name: values for name, (_, values) in hints.items()}, str(folder / HINTS_FILE),
              metadata={name: fmt for name, (fmt, _) in hints.items()})


def attach_hints(model, folder: Path) -> int:
    """Give each parameter the folder's hint for it (blocks.Hint, as the attribute blocks.HINT),
    where the folder has HINTS_FILE; returns how many got one."""
    path = Path(folder) / HINTS_FILE
    if not path.is_file():
        return 0
    import torch
    from safetensors import safe_open

    from .blocks import HINT

    attached = 0
    with safe_open(str(path), framework="pt") as f:
        formats, stored = f.metadata() or {}, set(f.keys())
        for name, weight in model.named_parameters():
            if name in formats and name in stored:
                setattr(weight, HINT, hint(formats[name], f.get_tensor(name).to(torch.float32)))
                attached += 1
    return attached


def hint(fmt: str, values):
    """blocks.Hint of a weight in format `fmt` from its scales_and_offsets (a tensor)."""
    from .blocks import AFFINE, Hint

    half = values.shape[1] // 2
    return Hint(fmt, values[:, :half].contiguous(), values[:, half:].contiguous() if fmt in AFFINE else None)
