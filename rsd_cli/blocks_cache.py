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

import os
import shutil
from pathlib import Path

import torch

from .small_batch import _version

FOLDER = "rsd-blocks"
LAYOUT = "1"  # of the blocks' bytes (blocks.BYTES): files of another layout are not read
KEPT = "rsd_kept_blocks"  # the attribute of a weight that holds (its version then, blocks read back for it)
DTYPES = {torch.uint8: "U8", torch.float16: "F16", torch.bfloat16: "BF16"}
FILE_BYTES = 2**29  # blocks a file at most (a larger weight's alone): what a conversion holds in memory


def attach(model, folder: Path) -> int:
    """Give each parameter the blocks kept for it in `folder` (attribute KEPT); returns how many got them."""
    from safetensors import safe_open

    kept = Path(folder) / FOLDER
    tensors: dict[str, torch.Tensor] = {}
    try:
        for file in sorted(kept.glob("*.safetensors")) if kept.is_dir() else []:
            with safe_open(str(file), framework="pt") as f:
                if (f.metadata() or {}).get("layout") != LAYOUT:
                    return 0
                tensors.update({name: f.get_tensor(name) for name in f.keys()})  # (mapped, read where used)
    except Exception:  # noqa: BLE001 - a damaged file: the blocks are recovered from the weights
        return 0
    attached = 0
    for name, weight in model.named_parameters():
        if name in tensors:
            setattr(weight, KEPT, (_version(weight), tensors[name]))
            attached += 1
    return attached


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


class Writer:
    """Blocks written into a new folder as they come, in safetensors files of at most FILE_BYTES
    (each file's blocks held until it is full)."""

    def __init__(self, folder: Path):
        self.folder, self.pending, self.size, self.files, self.written = Path(folder), {}, 0, 0, 0
        self.folder.mkdir()

    def add(self, name: str, blocks: torch.Tensor) -> None:
        nbytes = blocks.numel() * blocks.element_size()
        if self.pending and self.size + nbytes > FILE_BYTES:
            self.flush()
        self.pending[name] = blocks.contiguous()
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
        """Write what is pending; returns how many weights' blocks the folder holds."""
        if self.pending:
            self.flush()
        return self.written
