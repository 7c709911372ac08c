"""A GGUF file converted to a safetensors folder one tensor at a time.

transformers loads a GGUF file by dequantising every tensor into a float32 dictionary and then a
float32 model: 4 bytes a weight held twice in memory at once — a 7B Q4_K_M file (4 GB) needs
over 28 GB, more than many machines that could run its blocks have. Here transformers' own
loader runs once for what it decides (the config, the parameter each tensor becomes and the order
of its rows: Llama's q and k are permuted back) with gguf's dequantize answering, for each
two-dimensional tensor, a small marker — the tensor's index and each row's number — instead of
its values. Then each tensor is dequantised by gguf's own function, its rows put in that order,
and written straight into `model.safetensors` (files of at most 2 GiB, with an index, for a model
larger than that): the same float32 values transformers would have loaded (tested), with only one
tensor's in memory at a time. The scales and offsets of its
quantised tensors (gguf_hints) come from the same pass.

Architectures whose tensors transformers reshapes or combines (its tensor processors other than
Llama's), and any file where the markers do not come back as plain row orders of parameters of
the model's shapes, return None: the caller then converts through transformers' full load.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # (where the weights take several files)
SHARD_BYTES = 2**31  # float32 bytes a file at most


def convert(gguf_path: Path, folder: Path, progress=lambda done: None) -> int | None:
    """Write the model of `gguf_path` (weights, config, generation config) into `folder` (which
    exists) as transformers' conversion would, tensor by tensor, calling progress(share of the
    weights written) after each; returns how many tensors got block hints (gguf_hints.HINTS_FILE),
    or None (nothing written) where this file needs transformers' full load."""
    import gguf
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, load_gguf_checkpoint

    from . import gguf_hints

    reader = gguf.GGUFReader(str(gguf_path))
    architecture = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    if architecture in TENSOR_PROCESSORS and architecture != "llama":
        return None  # (its processor may reshape or merge tensors, not only reorder rows)
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config.dtype = torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    found = _row_orders(reader, gguf_path, model, load_gguf_checkpoint)
    if found is None:
        return None
    tensors = _plan(reader, model, found)
    if tensors is None:
        return None
    linears = {id(module.weight) for module in model.modules() if isinstance(module, torch.nn.Linear)}
    hints = _write_weights(folder, tensors, {name for name, weight in model.named_parameters() if id(weight) in linears},
                           progress)
    if hints:
        gguf_hints.save_hints(hints, folder)
    config.architectures = [type(model).__name__]  # (as save_pretrained records it)
    config.save_pretrained(folder)
    GenerationConfig.from_model_config(config).save_pretrained(folder)
    return len(hints)


def _write_weights(folder: Path, tensors: dict, linears: set[str], progress) -> dict:
    """Write _plan's tensors into safetensors files (_shards) in `folder`, a tensor or two in memory
    at a time (the next one dequantised on another thread while one is written), and the blocks the
    CPU kernels will run the `linears` on (blocks_cache: made here from the same values, so that no
    load has to read them all to make them); returns {name: (format, scales_and_offsets)} for those
    of a gguf_hints.FORMAT_OF type whose scales fit the tensor (progress: as convert's)."""
    import torch

    from . import blocks, blocks_cache, gguf_hints

    hints, kept = {}, blocks_cache.Writer(folder / blocks_cache.FOLDER) if blocks.available() else None
    shards = _shards({name: shape for name, (shape, _) in tensors.items()})
    names = [name for shapes in shards.values() for name in shapes]
    made = _one_ahead(lambda name: _values(tensors[name]), names)
    elements, written = sum(int(np.prod(shape, dtype=np.int64)) for shape, _ in tensors.values()), 0
    for file, shapes in shards.items():
        with (folder / file).open("wb") as out:
            out.write(_header(shapes))
            for name in shapes:
                values, hint = next(made)
                if hint is not None and gguf_hints.fits(hint, shapes[name]):
                    hints[name] = hint
                out.write(values.data)
                if kept is not None and name in linears:
                    weight = torch.from_numpy(values)
                    if name in hints:
                        setattr(weight, blocks.HINT, gguf_hints.hint(hints[name][0], hints[name][1].float()))
                    if (found := blocks.quantised_blocks(weight)) is not None:
                        kept.add(name, found)
                written += values.size
                progress(written / elements)
    if len(shards) > 1:
        weight_map = {name: file for file, shapes in shards.items() for name in shapes}
        (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": 4 * elements}, "weight_map": weight_map},
                                                    indent=2) + "\n")  # (every tensor, float32)
    if kept is not None and kept.close() == 0:
        (folder / blocks_cache.FOLDER).rmdir()  # (no blocks: a load makes none either)
    return hints


def _values(planned) -> tuple:
    """A _plan entry -> (its float32 values, C-contiguous, (format, scales_and_offsets) or None)."""
    import gguf
    import torch

    from . import gguf_hints

    _, values = planned
    if not isinstance(values, tuple):
        return np.ascontiguousarray(values, dtype="<f4"), None
    tensor, order = values  # (the file's tensor, its rows in transformers' order)
    rows = gguf.dequantize(tensor.data, tensor.tensor_type).reshape(len(order), -1)
    kind, hint = tensor.tensor_type.name, None
    if kind in gguf_hints.FORMAT_OF:
        hint = (gguf_hints.FORMAT_OF[kind], torch.from_numpy(np.ascontiguousarray(
            gguf_hints.scales_and_offsets(tensor.data, kind)[order])))
    return np.ascontiguousarray(rows[order], dtype="<f4"), hint


def _one_ahead(make, items):
    """make(item) for each item in order, the next one made on another thread while the caller uses
    this one (gguf's dequantisation in numpy overlaps the writing)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        coming = None
        for item in items:
            following = pool.submit(make, item)
            if coming is not None:
                yield coming.result()
            coming = following
        if coming is not None:
            yield coming.result()


def _row_orders(reader, gguf_path: Path, model, load_gguf_checkpoint) -> dict | None:
    """transformers' loader, reading `reader`, with gguf's dequantize answering, for each 2-D tensor,
    a marker (rows, 2) int64: the tensor's index in the file and each row's number. -> {parameter name:
    what it made} (markers, and the one-dimensional tensors' values), or None where that loader
    cannot run so."""
    import gguf

    index_of = {tensor.data.ctypes.data: i for i, tensor in enumerate(reader.tensors)}

    def dequantize(data, qtype):
        index = index_of.get(data.ctypes.data)
        if index is None or data.ndim != 2:
            return original(data, qtype)
        marker = np.empty((data.shape[0], 2), dtype=np.int64)
        marker[:, 0], marker[:, 1] = index, np.arange(data.shape[0])
        return marker

    original, reader_class = gguf.dequantize, gguf.GGUFReader
    gguf.dequantize, gguf.GGUFReader = dequantize, lambda *args, **kwargs: reader  # (its tensors' addresses)
    try:
        return load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    except Exception:  # another version of transformers' loader: the full load decides
        return None
    finally:
        gguf.dequantize, gguf.GGUFReader = original, reader_class


def _plan(reader, model, found: dict) -> dict | None:
    """{parameter name: (shape, (file tensor, row order) or float32 values)} for every tensor the
    model saves, or None where what transformers made is not that (a parameter missing or left
    over, a marker that is not one tensor's rows reordered, a shape that does not fit)."""
    import torch

    expected = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    if set(found) != set(expected):
        return None
    plan = {}
    for name, made in found.items():
        shape = tuple(expected[name].shape)
        if made.dtype == torch.int64:
            if made.dim() != 2 or made.shape[1] != 2 or not (made[:, 0] == made[0, 0]).all():
                return None
            tensor, order = reader.tensors[int(made[0, 0])], made[:, 1].numpy()
            rows = len(order)
            if not np.array_equal(np.sort(order), np.arange(rows)):
                return None
            columns = int(np.prod(tensor.shape)) // rows  # (gguf's shape lists the columns first)
            if shape != (rows, columns):
                return None
            plan[name] = (shape, (tensor, order))
        else:
            if tuple(made.shape) != shape or not made.is_floating_point():
                return None
            plan[name] = (shape, made.to(torch.float32).numpy())
    return plan


def _shards(shapes: dict[str, tuple]) -> dict[str, dict[str, tuple]]:
    """{file: {name: shape}}: the tensors in files of at most SHARD_BYTES (a larger tensor alone),
    one WEIGHTS_FILE where they all fit in one. (torch maps each file whole and privately: one of
    more than the machine's memory is refused.)"""
    groups, size = [{}], 0
    for name, shape in shapes.items():
        nbytes = 4 * int(np.prod(shape, dtype=np.int64))
        if groups[-1] and size + nbytes > SHARD_BYTES:
            groups.append({})
            size = 0
        groups[-1][name] = shape
        size += nbytes
    if len(groups) == 1:
        return {WEIGHTS_FILE: groups[0]}
    return {f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors": group for i, group in enumerate(groups)}


def _header(shapes: dict[str, tuple]) -> bytes:
    """A safetensors header for float32 tensors of these shapes, written in this order."""
    return header({name: ("F32", shape, 4 * int(np.prod(shape, dtype=np.int64))) for name, shape in shapes.items()})


def header(entries: dict[str, tuple[str, tuple, int]], metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors header for tensors {name: (dtype, e.g. "F32" or "U8", shape, bytes)} written in
    this order right after it."""
    described, at = {}, 0
    for name, (dtype, shape, size) in entries.items():
        described[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + size]}
        at += size
    text = json.dumps({"__metadata__": {"format": "pt", **(metadata or {})}, **described}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # (the data starts 8-byte aligned)
    return struct.pack("<Q", len(text)) + text
