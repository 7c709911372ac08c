"""Faster linear layers for the few-token forwards of speculative decoding, on some CPUs.

Verifying a draft tree runs the target on a handful of tokens at once (2-64 rows). torch's
fp32 `F.linear` computes x @ W.T, and with so few rows MKL's GEMM can be far slower than the
memory traffic explains: measured on a 2-core AMD EPYC, the 49k-row output head of
SmolLM2-135M costs 9 ms for one token but 21 ms for two to eight, and a 4-token forward of the
whole model 1.7x a 1-token one. The same product computed as (W @ x.T).T takes another MKL path
that is 1.5-3x faster there for layers whose output is at least as wide as their input
(attention q/o, MLP gate/up, the head); for the narrowing MLP down-projection it is slower, so
that one is left alone, as are long prompts, where `F.linear` is best. Single rows are timed
apart: where computing them as two rows (one of zeros) with this kernel is faster — the
49k-row head there: 13.5 ms for torch's 1-row product, 4.3 ms for this 2-row one — they are.

On a 2-core Intel Xeon (Sapphire Rapids) the opposite holds: torch's kernel is the fast one
(a 2-token forward 34 ms with it, 64 ms with this one). So by default ("auto") each layer shape
is timed once per machine with both kernels and keeps torch's unless this one is clearly
faster; the verdicts are cached under the rsd cache folder. RSD_SMALL_BATCH_MATMUL=1 uses it
wherever it could apply, 0 nowhere.

The result is the same product; only the order of the float additions inside it may differ, as
between any two GEMM kernels.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

MAX_ROWS = 64  # above this, prompt prefill: F.linear is the right kernel


def _padded_rows(rows: int) -> int:
    """Row counts the small-batch kernel handles badly are padded with zero rows (measured: 3 rows
    cost more than 4, and 9-15 rows more than 16)."""
    return 4 if rows == 3 else 16 if 9 <= rows <= 15 else rows


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       one_row: bool = False) -> torch.Tensor:
    """F.linear(x, weight, bias), computed as (W @ x.T).T for 2 to MAX_ROWS rows, and for a single
    row too with one_row (as 2 rows, one of them zeros: for the output head on some CPUs torch's
    1-row product is 3x slower than this 2-row one)."""
    rows = x.numel() // x.shape[-1]
    if rows < 2 - one_row or rows > MAX_ROWS:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    padded = max(2, _padded_rows(rows))
    if padded > rows:
        flat = torch.cat([flat, flat.new_zeros(padded - rows, flat.shape[1])])
    out = torch.mm(weight, flat.t()).t()[:rows]  # (rows, out_features)
    if bias is not None:
        out = out + bias
    return out.contiguous().view(*x.shape[:-1], out.shape[-1])


def _forward(self, x):
    return small_batch_linear(x, self.weight, self.bias, pads_one_row(self))


def pads_one_row(module) -> bool:
    """Whether this layer computes single rows with the small-batch kernel too (as 2 rows)."""
    return getattr(module, "_rsd_one_row", False)


def kernel_code(module) -> int:
    """0: torch's product; 1: the small-batch one for 2-64 rows; 2: for single rows too."""
    return 0 if not uses_small_batch(module) else 2 if pads_one_row(module) else 1


CALIBRATION_ROWS = (2, 4, 8)  # the forwards that matter: tree verification and draft levels
CALIBRATION_REPEATS = 5
REQUIRED_GAIN = 0.9  # this kernel must take at most 90% of torch's time, summed over the rows
CALIBRATION_BYTES = 64 * 2**20  # enough weights to stream from memory, not from a CPU cache


def mode() -> str:
    """RSD_SMALL_BATCH_MATMUL: "auto" (default: where measured faster), "1" (always), "0" (never)."""
    value = os.environ.get("RSD_SMALL_BATCH_MATMUL", "auto").strip().lower()
    return value if value in ("0", "1") else "auto"


def _candidate(module) -> bool:
    # not a layer accelerate placed: its hook wraps `forward`, which the kernel would replace
    return (isinstance(module, torch.nn.Linear) and module.weight.device.type == "cpu"
            and not hasattr(module, "_hf_hook")
            and module.weight.dtype == torch.float32 and module.out_features >= module.in_features)


def install(model, verdicts: Verdicts | None = None) -> int:
    """Use the small-batch product in the model's widening fp32 CPU linear layers (with "auto",
    only those of a shape where it measured faster on this machine); returns how many layers
    now use it. Idempotent; a model on another device is left as it is."""
    if mode() == "0":
        return 0
    if verdicts is None and mode() == "auto":
        verdicts = Verdicts.load()
    by_shape: dict[tuple[int, int], list] = {}
    for module in model.modules():
        if _candidate(module):
            by_shape.setdefault(tuple(module.weight.shape), []).append(module)
    count = 0
    for modules in by_shape.values():
        weights = [m.weight for m in modules]
        if verdicts is None or verdicts.faster(weights):
            one_row = verdicts is None or verdicts.one_row(weights)
            for module in modules:
                if not uses_small_batch(module):
                    module.forward = types.MethodType(_forward, module)
                module._rsd_one_row = one_row
        count += sum(uses_small_batch(m) for m in modules)
    if verdicts is not None:
        verdicts.save()
    return count


def uses_small_batch(module) -> bool:
    """Whether this layer computes few-row products with the small-batch kernel."""
    return getattr(module.__dict__.get("forward"), "__func__", None) is _forward


def installed(*models) -> int:
    """How many distinct linear layers of these models use the small-batch product."""
    return len({id(m) for model in models for m in model.modules() if uses_small_batch(m)})


def _median_seconds(fn, x: torch.Tensor) -> float:
    times = []
    for _ in range(CALIBRATION_REPEATS):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _calibration_share(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The first CALIBRATION_BYTES of these weights (all of one shape and dtype), at least one."""
    each = weights[0].numel() * weights[0].element_size()
    return weights[: -(-CALIBRATION_BYTES // each)]


def measure_one_row_gain(weights: list[torch.Tensor]) -> float:
    """This kernel's time on one row padded to two over torch's on one row, for weights of one
    shape (as measure_gain)."""
    weights = _calibration_share(weights)
    ours = lambda x: [small_batch_linear(x, w, one_row=True) for w in weights]  # noqa: E731
    theirs = lambda x: [F.linear(x, w) for w in weights]  # noqa: E731
    with torch.inference_mode():
        x = torch.randn(1, weights[0].shape[1])
        ours(x), theirs(x)
        return _median_seconds(ours, x) / _median_seconds(theirs, x)


def measure_gain(weights: list[torch.Tensor]) -> float:
    """This kernel's time over torch's for (out, in) weights of one shape, summed over
    CALIBRATION_ROWS (below 1: this kernel is faster). Each timing runs through all the weights
    in turn, as a forward does, so they come from memory rather than a warm cache (the first
    CALIBRATION_BYTES of them: a big model's calibration stays short)."""
    weights = _calibration_share(weights)
    ours = lambda x: [small_batch_linear(x, w) for w in weights]  # noqa: E731
    theirs = lambda x: [F.linear(x, w) for w in weights]  # noqa: E731
    totals = [0.0, 0.0]
    with torch.inference_mode():
        for rows in CALIBRATION_ROWS:
            x = torch.randn(rows, weights[0].shape[1])
            ours(x), theirs(x)
            totals[0] += _median_seconds(ours, x)
            totals[1] += _median_seconds(theirs, x)
    return totals[0] / totals[1]


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
    return f"{cpu} | torch {torch.__version__} | {torch.get_num_threads()} threads"


class Verdicts:
    """Per weight shape on this machine: is the small-batch kernel faster? Measured once, then
    read from `small-batch.json` in the rsd cache folder (a lost or unwritable file only means
    measuring again)."""

    def __init__(self, path: Path | None, known: dict):
        self.path, self.known, self.changed = path, known, False
        self.machine = machine()

    @classmethod
    def load(cls, path: Path | None = None) -> Verdicts:
        from .models import cache_dir, read_json_table

        path = cache_dir() / "small-batch.json" if path is None else path
        return cls(path, read_json_table(path))

    def faster(self, weights: list[torch.Tensor]) -> bool:
        """Verdict for a model's layers of one shape (measured together the first time)."""
        return self._verdict(weights, "", measure_gain)

    def one_row(self, weights: list[torch.Tensor]) -> bool:
        """Verdict for single rows of this shape: pad them to two for the small-batch kernel?"""
        return self._verdict(weights, " | one row as two", measure_one_row_gain)

    def _verdict(self, weights: list[torch.Tensor], kind: str, measure) -> bool:
        out_features, in_features = weights[0].shape
        key = f"{self.machine} | {in_features}x{out_features}{kind}"
        if not isinstance(self.known.get(key), bool):
            self.known[key] = measure(weights) <= REQUIRED_GAIN
            self.changed = True
        return self.known[key]

    def save(self) -> None:
        from .models import write_json_table

        if self.changed and self.path is not None and write_json_table(self.path, self.known):
            self.changed = False
