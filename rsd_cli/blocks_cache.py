"""Quantised blocks kept beside the float32 weights of a GGUF file rsd converted.

At a load every CPU weight's blocks are recovered from its float32 values and checked against each
of them (blocks.quantised_blocks): 4 bytes a weight read to make 0.6-1.25 — for a 7B model 29 GB,
half a minute on a 2-core machine, every time. A folder rsd converted itself (the rsd cache's,
marked complete) keeps the blocks in `rsd-blocks/` (files of at most 512 MiB), made by the
conversion from the values it writes (gguf_convert) or else by the first load, and loads map those
instead: where every product of a layer runs on blocks, its float32 weights are never read at all
(they stay on disk, mapped).

The folder is written whole under another name and renamed, so one that is there is complete (what
a process that died meanwhile left is deleted by the next one to write); it goes with the
converted folder, which is replaced whole when its file is converted again. Blocks read back serve
only the tensor loaded from that folder, unchanged since (its version), and of that weight's
shape; a weight trained or edited in place gets its blocks recovered and checked again.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from pathlib import Path

import torch

from .small_batch import _version

FOLDER = "rsd-blocks"
LAYOUT = "1"  # of the blocks' bytes (blocks.BYTES): files of another layout are not read
KEPT = "rsd_kept_blocks"  # the attribute of a weight that holds (its version then, blocks read back for it)
DTYPES = {torch.uint8: "U8", torch.float16: "F16", torch.bfloat16: "BF16"}  # (safetensors' names)
DTYPE_OF = {code: dtype for dtype, code in DTYPES.items()}
FILE_BYTES = 2**29  # blocks a file at most (a larger weight's alone): what a conversion holds in memory


def attach(model, folder: Path) -> int:
    """Give each parameter the blocks kept for it in `folder` (attribute KEPT); returns how many got them."""
    kept = Path(folder) / FOLDER
    tensors: dict[str, torch.Tensor] = {}
    try:
        for file in sorted(kept.glob("*.safetensors")) if kept.is_dir() else []:
            tensors.update(_mapped(file))
    except Exception:  # noqa: BLE001 - a damaged or foreign file: the blocks are recovered from the weights
        return 0
    attached = 0
    for name, weight in model.named_parameters():
        if name in tensors:
            setattr(weight, KEPT, (_version(weight), tensors[name]))
            attached += 1
    return attached


def _mapped(file: Path) -> dict[str, torch.Tensor]:
    """A blocks file's tensors as views of one private mapping of it, read where they are used (q, k
    and v's, written side by side, stay so: the C layer runs them stacked without a copy, blocks.joined)."""
    with file.open("rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        entries = json.loads(f.read(size))
    if entries.pop("__metadata__", {}).get("layout") != LAYOUT:
        raise ValueError("another layout")
    whole = torch.from_file(str(file), shared=False, size=file.stat().st_size, dtype=torch.uint8)
    tensors = {}
    for name, entry in entries.items():
        dtype = DTYPE_OF[entry["dtype"]]
        start, end = (8 + size + at for at in entry["data_offsets"])
        if end > whole.numel() or end - start != math.prod(entry["shape"]) * dtype.itemsize:
            raise ValueError("a truncated file")
        tensors[name] = whole[start:end].view(dtype).view(entry["shape"])
    return tensors


def kept_blocks(weight: torch.Tensor) -> torch.Tensor | None:
    """The blocks read back for this (out, in) weight (attach), where it has not changed since and
    they are blocks of its shape: (out, in / 32, a format's bytes) uint8 or (out, in / 32, 32) 16-bit floats."""
    from .blocks import BLOCK, BYTES

    kept = getattr(weight, KEPT, None)
    if kept is None or kept[0] != _version(weight):
        return None
    blocks, (rows, columns) = kept[1], weight.shape
    if blocks.dim() != 3 or tuple(blocks.shape[:2]) != (rows, columns // BLOCK):
        return None
    widths = (BLOCK,) if blocks.dtype in (torch.float16, torch.bfloat16) else \
        tuple(BYTES.values()) if blocks.dtype == torch.uint8 else ()
    return blocks if blocks.shape[2] in widths else None


def keep(model, folder: Path) -> int:
    """Write the blocks the model's layers run on into `folder`/FOLDER, where it has none yet;
    returns how many weights' blocks were written (0 also where the folder cannot be written)."""
    from .small_batch import blocks_of

    target = Path(folder) / FOLDER
    if target.exists():
        return 0
    names = {id(weight): name for name, weight in model.named_parameters()}
    found: dict[str, torch.Tensor] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        blocks = blocks_of(module) if isinstance(weight, torch.Tensor) else None
        if blocks is not None and id(weight) in names:
            found[names[id(weight)]] = blocks
    if not found:
        return 0
    _drop_abandoned(target)
    partial = target.with_name(f"{FOLDER}.{os.getpid()}.partial")
    try:
        shutil.rmtree(partial, ignore_errors=True)
        writer = Writer(partial)
        for name, blocks in found.items():
            writer.add(name, blocks)
        writer.close()
        partial.rename(target)  # (another process's may be there already: then this one is dropped)
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
        return 0
    return len(found)


def _drop_abandoned(target: Path) -> None:
    """Delete what processes that died while they wrote blocks here left (FOLDER.<pid>.partial)."""
    for partial in target.parent.glob(f"{FOLDER}.*.partial"):
        try:
            os.kill(int(partial.name.split(".")[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(partial, ignore_errors=True)
        except (ValueError, OSError):  # (not a pid, or another user's process: left)
            pass


# the linears the C layer runs stacked (q, k and v; gate and up): their blocks are kept side by side, in this order
SIDE_BY_SIDE = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _side_by_side(name: str) -> tuple[str, ...]:
    """The names of the weights kept side by side with this one (itself among them, in order)."""
    for group in SIDE_BY_SIDE:
        for member in group:
            if name.endswith(f".{member}.weight"):
                prefix = name[: -len(f"{member}.weight")]
                return tuple(f"{prefix}{other}.weight" for other in group)
    return (name,)


class Writer:
    """Blocks written into a new folder as they come, in safetensors files of at most FILE_BYTES
    (each file's blocks held until it is full), those of SIDE_BY_SIDE weights one after another in
    one file (each held until its group is complete)."""

    def __init__(self, folder: Path):
        self.folder, self.waiting, self.pending, self.size, self.files, self.written = Path(folder), {}, {}, 0, 0, 0
        self.folder.mkdir()

    def add(self, name: str, blocks: torch.Tensor) -> None:
        self.waiting[name] = blocks
        group = _side_by_side(name)
        if all(member in self.waiting for member in group):
            self._put({member: self.waiting.pop(member) for member in group})

    def _put(self, group: dict[str, torch.Tensor]) -> None:
        nbytes = sum(blocks.numel() * blocks.element_size() for blocks in group.values())
        if self.pending and self.size + nbytes > FILE_BYTES:
            self.flush()
        self.pending.update({name: blocks.contiguous() for name, blocks in group.items()})
        self.size += nbytes

    def flush(self) -> None:
        from .gguf_convert import header

        entries = {name: (DTYPES[blocks.dtype], tuple(blocks.shape), blocks.numel() * blocks.element_size())
                   for name, blocks in self.pending.items()}
        self.files += 1
        with (self.folder / f"blocks-{self.files:05d}.safetensors").open("wb") as out:
            out.write(header(entries, {"layout": LAYOUT}))
            for blocks in self.pending.values():
                out.write(blocks.view(torch.uint8).reshape(-1).numpy().data)
        self.written += len(self.pending)
        self.pending, self.size = {}, 0

    def close(self) -> int:
        """Write what is pending (a group some member of which had no blocks: each alone); returns
        how many weights' blocks the folder holds."""
        for name in list(self.waiting):
            self._put({name: self.waiting.pop(name)})
        if self.pending:
            self.flush()
        return self.written
