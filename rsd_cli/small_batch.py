"""Faster linear layers for the few-token forwards of speculative decoding, on some CPUs.

Every target and draft call in rsd multiplies a handful of rows (1 for plain decoding and the
draft's catch-up, 2-64 for a verified tree or a draft level) by each weight matrix, so a
forward is a stream of weights through small products, and which CPU kernel computes those
fastest differs by machine, by shape and by row count. Four compute the same product:

- "torch": `F.linear` (MKL's GEMM for fp32 on x86 builds);
- "transposed": `(W @ x.T).T`, another MKL path (single rows padded to two with a zero row);
- "onednn": oneDNN's inner product (`torch.ops.mkldnn._linear_pointwise`, what inductor emits
  for CPU linears), on the layer's own weight;
- "packed": the same on a copy of the weight in oneDNN's blocked layout, made once at load
  (`torch.ops.mkldnn._reorder_linear_weight`): more memory (the copy), and few-row products
  nearly as cheap as one row;
- "blocks": for a weight that holds 4-bit or 8-bit quantised blocks (a GGUF model's, such as the
  embedded one), rsd's own kernel on those blocks (`blocks`): 0.75 or 1.125 bytes a weight
  streamed instead of 4, each weight rebuilt exactly.

Measured on a 2-core AMD EPYC (Zen 5, streaming the weights from memory as a forward does):
torch's product reaches 11-14 GB/s on the 49k-row output head of SmolLM2-135M (7-14 ms for
1-16 rows), "transposed" is 1.5-2x faster for 2-4 rows of widening layers, and oneDNN's reaches
26-38 GB/s for every shape and row count (the head: 3.2 ms for one row, 5.6 ms for eight); on
a 2-core Intel Xeon (Sapphire Rapids) torch's own kernel was the fast one. On the packed copy a
4-token forward of that model costs 1.1x a 1-token one (1.4x on its own weights), which is what
tree verification needs. So by default
("auto") each layer shape is timed once per machine with every kernel, for one row and for
2-8 rows apart, and keeps torch's unless another takes at most 90% of its time — except a shape
held as quantised blocks, where the kernel runs on vectors (AVX-512, AVX2, NEON): its few-row products run on
"blocks" unmeasured (FEW_ROWS_ON_BLOCKS), and only its prompts are timed (128 rows, torch's
against "blocks": on the 2-core EPYC blocks took 0.65x MKL's time at 128-256 rows); the
verdicts are cached under the rsd cache folder.
RSD_SMALL_BATCH_MATMUL picks one kernel everywhere instead: "0" or "torch", "1" or
"transposed", "onednn", "packed", "blocks". Packed copies are made only while they take
at most half the memory still available (else "onednn" serves those layers).

The result is the same product; only the order of the float additions inside it may differ, as
between any two GEMM kernels. Prompts (more than 64 rows) run on `F.linear` unless their blocks
measured faster; anything that needs gradients (distillation) runs on `F.linear`; in a compiled
graph the chosen kernel is an opaque operator (`rsd::linear`, torch >= 2.4) that inductor calls
between its fused kernels, finding the weight's kernels by its address (`enrol`) when it runs.
"""

from __future__ import annotations

import functools
import os
import platform
import statistics
import time
import types
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

from .threads import cpu_threads

MAX_ROWS = 64  # above this, prompt prefill: F.linear's GEMM, or the blocks kernel where measured faster
KERNELS = ("torch", "transposed", "onednn", "packed", "blocks")
TORCH = ("torch", "torch", "torch")  # kernels for a single row, for 2 to MAX_ROWS rows, for more (prompts)


def _padded_rows(rows: int) -> int:
    """Row counts the transposed kernel handles badly are padded with zero rows (measured: 3 rows
    cost more than 4, and 9-15 rows more than 16; a single row is computed as two)."""
    return 2 if rows == 1 else 4 if rows == 3 else 16 if 9 <= rows <= 15 else rows


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) computed as (W @ x.T).T (on some CPUs another, faster MKL path
    for few rows; on the EPYC torch's 1-row product of the 49k-row head took 13.5 ms and this
    one, on the row and a zero row, 4.3 ms)."""
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])
    padded = _padded_rows(rows)
    if padded > rows:
        flat = torch.cat([flat, flat.new_zeros(padded - rows, flat.shape[1])])
    out = torch.mm(weight, flat.t()).t()[:rows]  # (rows, out_features)
    if bias is not None:
        out = out + bias
    return out.contiguous().view(*x.shape[:-1], out.shape[-1])


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) by oneDNN's inner product; weight as it is, or packed_weight's copy."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """A copy of the (out, in) weight in oneDNN's blocked layout, for onednn_linear."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


@functools.cache
def onednn_available() -> bool:
    """Whether this torch has oneDNN's CPU linear and it computes torch's product."""
    try:
        weight, x = torch.randn(8, 4), torch.randn(3, 4)
        return bool(torch.backends.mkldnn.is_available()
                    and torch.allclose(onednn_linear(x, weight), F.linear(x, weight), atol=1e-5)
                    and torch.allclose(onednn_linear(x, packed_weight(weight)), F.linear(x, weight), atol=1e-5))
    except Exception:  # noqa: BLE001 - a build without it, or an op renamed in another version
        return False


def kernel_of_rows(rows: int, kernels: tuple) -> str:
    """kernels = (for one row, for 2 to MAX_ROWS rows, for more): the one for this many rows."""
    return kernels[0] if rows == 1 else kernels[1] if rows <= MAX_ROWS else kernels[2]


def kernel_for(x: torch.Tensor, weight: torch.Tensor, kernels: tuple) -> str:
    """The kernel for this product: kernels = (for one row, for 2 to MAX_ROWS rows, for more),
    names from KERNELS; torch's for products that need gradients (oneDNN's op and rsd's kernel
    have no backward)."""
    kernel = kernel_of_rows(x.numel() // x.shape[-1], kernels)
    if kernel in ("onednn", "packed", "blocks") and torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return "torch"
    return kernel


def run_kernel(kernel: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               prepared: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) by this kernel; "packed" and "blocks" run on `prepared`, the copy
    of the weight they need (prepared_of), oneDNN on the weight itself where there is none."""
    if kernel == "blocks" and prepared is not None and x.dtype == torch.float32:
        from .blocks import blocks_linear

        return blocks_linear(x, prepared, bias)
    if kernel in ("onednn", "packed", "blocks") and onednn_available():
        return onednn_linear(x, prepared if kernel == "packed" and prepared is not None else weight, bias)
    if kernel == "transposed":
        return transposed_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def kernel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernels: tuple,
                  prepared: dict | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) by the kernel chosen for this row count (kernel_for), on its
    copy of the weight in `prepared` (prepared_copies). Inside a graph torch.compile traces, the
    product is one opaque operation (`rsd::linear`) that runs the kernels enrolled for the weight
    (`enrol`; none: torch's), so compiled graphs fuse what lies around it and keep the measured
    kernel, and one graph serves layers whose kernels or weight formats differ."""
    if torch.compiler.is_compiling():
        if _COMPILABLE:
            return torch.ops.rsd.linear(x, weight, bias)
        return F.linear(x, weight, bias)  # a torch without custom operators: inductor's own product
    kernel = kernel_for(x, weight, kernels)
    blocks = (prepared or {}).get("blocks")
    if (kernel == "torch" and blocks is not None and x.numel() // x.shape[-1] > MAX_ROWS
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        # a prompt on torch's GEMM: the weight rebuilt from its blocks (the same values) rather than
        # read, as a layer on blocks may hold its float32 weight in a file's pages it never reads
        from .blocks import gemm_on_blocks

        return gemm_on_blocks(x, blocks, bias)
    return run_kernel(kernel, x, weight, bias, (prepared or {}).get(kernel))


_ENROLLED: dict[int, tuple] = {}  # a weight's address -> (weak references to it and its copies, its kernels)


def enrol(weight: torch.Tensor, kernels: tuple, prepared: dict) -> None:
    """What rsd::linear runs for this weight in compiled graphs: these kernels on these copies.
    Looked up by the weight's address when the graph runs, not traced into it: a compiled graph
    holds no kernel name or copy, so the embedded draft's adapter layer (Q8_0 blocks beside the
    target's Q4_1, kernels of its own) replays the target's layers' graphs instead of compiling
    three more. Held weakly: the copies live as long as their layer, not as long as the process."""
    copies = {kernel: weakref.ref(copy) for kernel, copy in prepared.items()}
    _ENROLLED[weight.data_ptr()] = (weakref.ref(weight), copies, kernels)


def enrolled(weight: torch.Tensor) -> tuple[tuple, dict]:
    """(kernels, copies) enrolled for this weight; torch's where none (or where the enrolled
    weight or a copy is gone, its memory perhaps reused)."""
    found = _ENROLLED.get(weight.data_ptr())
    if found is not None:
        held, copies = found[0](), {kernel: ref() for kernel, ref in found[1].items()}
        if (held is not None and held.shape == weight.shape and held.dtype == weight.dtype
                and all(copy is not None for copy in copies.values())):
            return found[2], copies
    return TORCH, {}


_COMPILABLE = None  # whether rsd::linear is registered: register_operator()


def register_operator() -> bool:
    """rsd::linear for compiled graphs (torch >= 2.4), registered once before the first compile
    (compiled._compiled; registering costs ~0.15 s, which a process that compiles nothing skips);
    False where this torch cannot register it: compiled graphs then use torch's product."""
    global _COMPILABLE
    if _COMPILABLE is None:
        _COMPILABLE = _register_operator()
    return _COMPILABLE


def _register_operator() -> bool:
    if not hasattr(torch.library, "custom_op"):
        return False
    try:
        @torch.library.custom_op("rsd::linear", mutates_args=(),
                                 schema="(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
        def linear_operator(x, weight, bias):
            kernels, prepared = enrolled(weight)
            kernel = kernel_for(x, weight, kernels)
            out = run_kernel(kernel, x, weight, bias, prepared.get(kernel))
            return out.clone() if out is x else out  # (an operator's output must not alias its input)

        @linear_operator.register_fake
        def _(x, weight, bias):
            return x.new_empty((*x.shape[:-1], weight.shape[0]))
    except Exception:  # noqa: BLE001 - an API that differs in this torch: compiled graphs use torch's product
        return False
    return True


def _forward(self, x):
    kernel = kernel_for(x, self.weight, self._rsd_kernels)
    return run_kernel(kernel, x, self.weight, self.bias, prepared_of(self, kernel))


def _version(tensor: torch.Tensor) -> int:
    """The tensor's in-place modification count (an inference tensor keeps none: -1)."""
    return -1 if tensor.is_inference() else tensor._version


class _WeightCopy:
    """A copy of a layer's weight that a kernel runs on (oneDNN's packed layout, quantised blocks;
    None: the weight has none) and the weight and version it was made from. A copy of the layer
    (copy.deepcopy: oneDNN's packed tensors cannot be copied) makes its own at first use."""

    __slots__ = ("weight", "version", "tensor")

    def __init__(self, weight: torch.Tensor | None, tensor: torch.Tensor | None):
        self.weight, self.tensor = weight, tensor
        self.version = _version(weight) if weight is not None else -1

    def __deepcopy__(self, memo) -> _WeightCopy:
        return _WeightCopy(None, None)


def _quantised_blocks(weight: torch.Tensor) -> torch.Tensor | None:
    from .blocks import quantised_blocks

    return quantised_blocks(weight)


# the kernels that run on a copy of the weight: where a layer keeps it, and how it is made
COPIES = {"packed": ("_rsd_packed", lambda weight: packed_weight(weight)),  # (looked up at each call)
          "blocks": ("_rsd_blocks", lambda weight: _quantised_blocks(weight))}


def prepared_of(module, kernel: str) -> torch.Tensor | None:
    """The layer's copy of its weight for this kernel (COPIES) if it has one and its weight has
    not changed since (a trained, reassigned or copied weight gets its copy made again)."""
    if kernel not in COPIES:
        return None
    attribute, make = COPIES[kernel]
    entry = module.__dict__.get(attribute)
    if entry is None:
        return None
    if entry.weight is not module.weight or _version(entry.weight) != entry.version:
        entry = _WeightCopy(module.weight, make(module.weight))
        setattr(module, attribute, entry)
    return entry.tensor


def packed_of(module) -> torch.Tensor | None:
    """The layer's oneDNN-packed weight, or None."""
    return prepared_of(module, "packed")


def blocks_of(module) -> torch.Tensor | None:
    """The layer's weight as quantised blocks (blocks.quantised_blocks), or None."""
    return prepared_of(module, "blocks")


def prepared_copies(module) -> dict[str, torch.Tensor]:
    """{kernel: its copy of the weight} for the kernels this layer uses that run on one."""
    copies = {kernel: prepared_of(module, kernel) for kernel in set(kernels_of(module)) & set(COPIES)}
    return {kernel: copy for kernel, copy in copies.items() if copy is not None}


def _prepare(modules: list, kernel: str) -> None:
    """Give each layer its copy of the weight for this kernel (layers sharing a weight share it)."""
    attribute, make = COPIES[kernel]
    copies: dict[int, _WeightCopy] = {}
    for module in modules:
        if module.__dict__.get(attribute) is None:
            weight = module.weight
            if id(weight) not in copies:
                copies[id(weight)] = _WeightCopy(weight, make(weight))
            setattr(module, attribute, copies[id(weight)])


def available_memory() -> int | None:
    """Bytes of memory still available (MemAvailable), None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def room_to_pack(modules: list, size=None) -> bool:
    """Packed copies (or quantised blocks, at most `size(weight)` bytes each) only while they take
    at most half the memory still available."""
    weights = {id(m.weight): m.weight for m in modules}.values()
    return room_for(sum(size(w) if size else w.numel() * w.element_size() for w in weights))


def blocks_size(weight: torch.Tensor) -> float:
    """The most bytes the weight's quantised blocks can take: its format's where a GGUF file named
    it (a hint: 0.625-1.25 bytes a weight), else float16 blocks' 2 a weight."""
    from .blocks import BLOCK, BYTES, HINT

    hint = getattr(weight, HINT, None)
    return weight.numel() * (BYTES[hint.format] / BLOCK if hint is not None and hint.format in BYTES else 2)


def room_for(needed: int) -> bool:
    """Whether copies of `needed` bytes take at most half the memory still available (or it is unknown)."""
    free = available_memory()
    return free is None or needed <= free // 2


def kernels_of(module) -> tuple[str, str, str]:
    """(kernel for a single row, for 2-64 rows, for more) this layer uses; TORCH for an unpatched layer."""
    return getattr(module, "_rsd_kernels", TORCH) if uses_small_batch(module) else TORCH


CALIBRATION_ROWS = ((1,), (2, 4, 8))  # single rows (plain decoding, catch-up); trees and draft levels
PROMPT_ROWS = (128,)  # prompts, timed for quantised blocks only (torch's GEMM against the blocks kernel)
CALIBRATION_REPEATS = 5
REQUIRED_GAIN = 0.9  # another kernel must take at most 90% of torch's time, summed over the rows
CLOSE = 0.15  # a verdict within 15% of that threshold is measured twice more (see settled_fastest)
# enough weights to stream from memory, not from a CPU cache, on most CPUs: the 2-core Intel Xeon's VM
# reads 128 MB again and again at 40 GB/s from its last-level cache (20 GB/s from 256 MB on)
CALIBRATION_BYTES = 64 * 2**20
# One row and 2-64 rows of a weight held as quantised blocks: rsd's kernel on them, not measured,
# where it runs on vectors (AVX-512, AVX2, NEON). A forward streams every weight, and the blocks are 0.75-1.125
# bytes a weight against float32's 4; a product timed alone cannot show that where the CPU's
# last-level cache holds all the weights of a shape (a 2-core Intel Xeon's VM sees 300 MB of it):
# there the verdicts named torch's product for one row of most shapes and for k and v at every row
# count, and `ar` on transformers' forward (`--compile off`) ran at 20-23 tok/s against 25-40 with
# the few-row products on blocks, compiled (`--compile on`) 20-26 against 35-47 (alternating runs).
# The kernel's plain loops (no AVX2) are measured as before: built without AVX-512 there (before its AVX2
# products), a row through 60 of the embedded target's matrices took 23.7 ms on them and 11.3 with torch's.
FEW_ROWS_ON_BLOCKS = ("blocks", "blocks")


def requested_mode() -> str:
    """RSD_SMALL_BATCH_MATMUL as asked: "auto" (default: per shape, where measured faster), "0" or
    "torch" (torch's everywhere), "1" or "transposed", "onednn", "packed", "blocks" (that kernel
    everywhere it applies; "blocks" on quantised weights, torch's on the others); anything else is
    "auto". `mode` is what this machine can do of it."""
    value = os.environ.get("RSD_SMALL_BATCH_MATMUL", "auto").strip().lower()
    value = {"1": "transposed", "torch": "0"}.get(value, value)
    return value if value in ("0", *KERNELS[1:]) else "auto"


def mode() -> str:
    """requested_mode, torch's ("0") where the kernel asked for is not available here."""
    value = requested_mode()
    if value in ("onednn", "packed") and not onednn_available():
        return "0"
    if value == "blocks" and not blocks_available():
        return "0"
    return value


def blocks_available() -> bool:
    from .blocks import available

    return available()


def _candidate(module) -> bool:
    # not a layer accelerate placed: its hook wraps `forward`, which the kernel would replace; nor a
    # subclass with a forward of its own (Phi-3.5-MoE's router: a linear that returns its routing too)
    return (isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward
            and module.weight.device.type == "cpu" and not hasattr(module, "_hf_hook")
            and module.weight.dtype == torch.float32)


def install(model, verdicts: Verdicts | None = None) -> int:
    """Give the model's fp32 CPU linear layers the kernels measured fastest for their shape on
    this machine (or the one RSD_SMALL_BATCH_MATMUL names); returns how many layers use another
    kernel than torch's for some row count. Idempotent; a model on another device is left as it is."""
    forced = mode()
    if forced == "0":
        return 0
    if verdicts is None and forced == "auto":
        verdicts = Verdicts.load()
    candidates = [module for module in model.modules() if _candidate(module)]
    if forced in ("auto", "blocks") and blocks_available() and room_to_pack(candidates, blocks_size):
        _prepare(candidates, "blocks")  # (None for weights that are not quantised blocks)
    by_shape: dict[tuple, list] = {}  # (shape, block format or None) -> layers
    for module in candidates:
        by_shape.setdefault((tuple(module.weight.shape), _block_format(module)), []).append(module)
    count = 0
    for (_, quantised), modules in by_shape.items():
        if verdicts is not None:
            kernels = verdicts.kernels([m.weight for m in modules], [blocks_of(m) for m in modules] if quantised else None)
        else:
            kernels = ((forced,) * 3 if quantised else TORCH) if forced == "blocks" else (forced, forced, "torch")
        if "packed" in kernels:
            if room_to_pack(modules):
                _prepare(modules, "packed")
            else:
                kernels = tuple("onednn" if k == "packed" else k for k in kernels)
        if kernels != TORCH:
            for module in modules:
                if not uses_small_batch(module):
                    module.forward = types.MethodType(_forward, module)
                module._rsd_kernels = kernels
        count += sum(kernels_of(m) != TORCH for m in modules)
    if verdicts is not None:
        verdicts.save()
    return count


def _block_format(module) -> str | None:
    from .blocks import block_format

    blocks = blocks_of(module)
    return None if blocks is None else block_format(blocks)


def uses_small_batch(module) -> bool:
    """Whether this layer's forward chooses its kernel by row count (see kernels_of)."""
    return getattr(module.__dict__.get("forward"), "__func__", None) is _forward


def signature(*models) -> str:
    """The kernels these models' linear layers use, per shape and row class (for cached costs
    that depend on them), e.g. "576x1536 onednn/packed, 576x49152 packed/packed"."""
    used = {f"{m.in_features}x{m.out_features} {'/'.join(kernels_of(m))}"
            for model in models for m in model.modules() if isinstance(m, torch.nn.Linear)}
    return ", ".join(sorted(used))


def installed(*models) -> int:
    """How many distinct linear layers of these models use another kernel than torch's."""
    return len({id(m) for model in models for m in model.modules() if kernels_of(m) != TORCH})


def _seconds(fn, x: torch.Tensor) -> float:
    start = time.perf_counter()
    fn(x)
    return time.perf_counter() - start


def _interleaved_medians(runs: dict, x: torch.Tensor, repeats: int) -> dict[str, float]:
    """Each run's median time over `repeats` rounds that time every run once, in an order rotated
    each round: a slow spell of the machine (a busy neighbour, frequency) falls on all of them
    alike instead of on whichever was being timed then."""
    names = list(runs)
    times = {name: [] for name in names}
    for round_ in range(repeats):
        for name in names[round_ % len(names):] + names[: round_ % len(names)]:
            times[name].append(_seconds(runs[name], x))
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def _calibration_share(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The first CALIBRATION_BYTES of these weights (all of one shape and dtype), at least one."""
    each = weights[0].numel() * weights[0].element_size()
    return weights[: -(-CALIBRATION_BYTES // each)]


def available_kernels(quantised: bool = False) -> tuple[str, ...]:
    """The kernels this torch and machine offer; "blocks" only for weights held as quantised blocks."""
    kernels = KERNELS[:4] if onednn_available() else KERNELS[:2]
    return (*kernels, "blocks") if quantised and blocks_available() else kernels


def _timed_runs(weights: list[torch.Tensor], kernels, blocks: list | None = None) -> dict:
    """One callable per kernel running x through all the weights (packed ones on packed copies,
    "blocks" on `blocks`, the weights' quantised blocks)."""
    copies = {"packed": [packed_weight(w) for w in weights] if "packed" in kernels else None, "blocks": blocks}
    return {k: (lambda x, k=k: [run_kernel(k, x, w, None, c) for w, c in zip(weights, copies.get(k) or [None] * len(weights))])
            for k in kernels}


def measure_kernels(weights: list[torch.Tensor], rows: tuple[int, ...], blocks: list | None = None,
                    kernels: tuple[str, ...] | None = None) -> dict[str, float]:
    """Seconds each available kernel (or each of `kernels`) takes for these (out, in) weights of one
    shape, summed over the row counts (with `blocks`, their quantised blocks, rsd's kernel on those
    too): medians of CALIBRATION_REPEATS interleaved rounds. Each timing runs through all the
    weights in turn, as a forward does, so they come from memory rather than a warm cache (the
    first CALIBRATION_BYTES of them: a big model's calibration stays short)."""
    weights = _calibration_share(weights)
    blocks = blocks[: len(weights)] if blocks is not None else None
    totals = dict.fromkeys(kernels or available_kernels(quantised=blocks is not None), 0.0)
    with torch.inference_mode():
        runs = _timed_runs(weights, totals, blocks)
        for n in rows:
            x = torch.randn(n, weights[0].shape[1])
            for run in runs.values():
                run(x)  # warm-up: first-call allocations and oneDNN primitive creation
            for kernel, seconds in _interleaved_medians(runs, x, CALIBRATION_REPEATS).items():
                totals[kernel] += seconds
    return totals


def fastest(seconds: dict[str, float], required: float = REQUIRED_GAIN) -> str:
    """The fastest kernel if it takes at most `required` of torch's time, else torch."""
    best = min(seconds, key=seconds.get)
    return best if seconds[best] <= required * seconds["torch"] else "torch"


def close_call(seconds: dict[str, float], required: float = REQUIRED_GAIN) -> bool:
    """Whether the fastest other kernel's time is within CLOSE of `required` x torch's: where the
    verdict could go either way from one measurement's noise."""
    others = [t for kernel, t in seconds.items() if kernel != "torch"]
    return bool(others) and abs(min(others) / (required * seconds["torch"]) - 1) < CLOSE


def settled_fastest(measure, required: float = REQUIRED_GAIN) -> str:
    """`fastest` of measure()'s seconds; for a close call, of each kernel's median over three
    measurements (on the 2-core EPYC one measurement put down_proj's prompts on blocks at 0.6x
    torch's time in one calibration and on torch's in another: a verdict is kept for good)."""
    seconds = measure()
    if close_call(seconds, required):
        more = [seconds, measure(), measure()]
        seconds = {kernel: statistics.median(m[kernel] for m in more) for kernel in seconds}
    return fastest(seconds, required)


def machine() -> str:
    """What the verdicts depend on: the CPU, torch's version and its thread count."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu} | torch {torch.__version__} | {cpu_threads()} threads"


class Verdicts:
    """Per weight shape on this machine: the fastest kernel for one row, for 2-8 rows and (for
    quantised blocks) for prompts.
    Measured once, then read from `small-batch.json` in the rsd cache folder (a lost or
    unwritable file only means measuring again)."""

    def __init__(self, path: Path | None, known: dict):
        self.path, self.known, self.changed = path, known, False
        self.machine = machine()

    @classmethod
    def load(cls, path: Path | None = None) -> Verdicts:
        from .models import cache_dir, read_json_table

        path = cache_dir() / "small-batch.json" if path is None else path
        return cls(path, read_json_table(path))

    def kernels(self, weights: list[torch.Tensor], blocks: list | None = None) -> tuple[str, str, str]:
        """(kernel for one row, for 2-64 rows, for more) for a model's layers of one shape (with
        `blocks`, their quantised blocks: a verdict of its own), measured together the first time.

        Few rows of quantised blocks go to their kernel unmeasured where it is vectorised
        (FEW_ROWS_ON_BLOCKS): only their prompts are timed."""
        from .blocks import block_format, vectorised

        out_features, in_features = weights[0].shape
        quantised = f" {block_format(blocks[0])}" if blocks is not None else ""
        unmeasured = blocks is not None and vectorised()  # few rows on blocks
        # (v2: timed in interleaved rounds, close calls measured again; v3: few rows on blocks
        # unmeasured. Earlier verdicts are measured anew)
        key = f"{self.machine} | {in_features}x{out_features}{quantised} | kernels {'v3' if unmeasured else 'v2'}"
        known = self.known.get(key)
        if not (isinstance(known, list) and len(known) == 3
                and set(known) <= set(available_kernels(quantised=blocks is not None))):
            few = list(FEW_ROWS_ON_BLOCKS) if unmeasured else \
                [settled_fastest(lambda rows=rows: measure_kernels(weights, rows, blocks)) for rows in CALIBRATION_ROWS]
            # (no margin asked of blocks for prompts: its copies exist anyway, and with one the 0.6-0.8x
            # it measured on the 2-core EPYC came out as torch's in some calibrations, slowing prompts 20%)
            known = few + [settled_fastest(lambda: measure_kernels(weights, PROMPT_ROWS, blocks, ("torch", "blocks")),
                                           required=1.0) if blocks is not None else "torch"]
            self.known[key] = known
            self.changed = True
        return tuple(known)

    def save(self) -> None:
        from .models import write_json_table

        if self.changed and self.path is not None and write_json_table(self.path, self.known):
            self.changed = False
