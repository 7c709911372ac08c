"""Faster linear layers for the few-token forwards of speculative decoding, on CPU.

Verifying a draft tree runs the target on a handful of tokens at once (2-64 rows). torch's
fp32 `F.linear` computes x @ W.T, and with so few rows MKL's GEMM can be far slower than the
memory traffic explains: measured on this project's 2-core AMD EPYC CI machine, the 49k-row
output head of SmolLM2-135M costs 9 ms for one token but 21 ms for two to eight, and a 4-token
forward of the whole model 1.7x a 1-token one. The same product computed as (W @ x.T).T takes
another MKL path that is 1.5-3x faster there for layers whose output is at least as wide as their
input (attention q/o, MLP gate/up, the head); for the narrowing MLP down-projection it is slower,
so that one is left alone, as are single rows and long prompts, where `F.linear` is best.

The result is the same product; only the order of the float additions inside it may differ, as
between any two GEMM kernels. Set RSD_SMALL_BATCH_MATMUL=0 to keep torch's default everywhere.
"""

from __future__ import annotations

import os
import types

import torch
import torch.nn.functional as F

MAX_ROWS = 64  # above this, prompt prefill: F.linear is the right kernel


def _padded_rows(rows: int) -> int:
    """Row counts the small-batch kernel handles badly are padded with zero rows (measured: 3 rows
    cost more than 4, and 9-15 rows more than 16)."""
    return 4 if rows == 3 else 16 if 9 <= rows <= 15 else rows


def _forward(self, x):
    rows = x.numel() // x.shape[-1]
    if rows < 2 or rows > MAX_ROWS:
        return F.linear(x, self.weight, self.bias)
    flat = x.reshape(rows, x.shape[-1])
    padded = _padded_rows(rows)
    if padded > rows:
        flat = torch.cat([flat, flat.new_zeros(padded - rows, flat.shape[1])])
    out = torch.mm(self.weight, flat.t()).t()[:rows]  # (rows, out_features)
    if self.bias is not None:
        out = out + self.bias
    return out.contiguous().view(*x.shape[:-1], out.shape[-1])


def enabled() -> bool:
    return os.environ.get("RSD_SMALL_BATCH_MATMUL", "1") != "0"


def install(model) -> int:
    """Use the small-batch product in the model's widening fp32 CPU linear layers; returns how
    many layers now use it. Idempotent; a model on another device is left as it is."""
    if not enabled():
        return 0
    count = 0
    for module in model.modules():
        if (isinstance(module, torch.nn.Linear) and module.weight.device.type == "cpu"
                and module.weight.dtype == torch.float32 and module.out_features >= module.in_features):
            if not uses_small_batch(module):
                module.forward = types.MethodType(_forward, module)
            count += 1
    return count


def uses_small_batch(module) -> bool:
    """Whether this layer computes few-row products with the small-batch kernel."""
    return getattr(module.__dict__.get("forward"), "__func__", None) is _forward


def installed(*models) -> int:
    """How many distinct linear layers of these models use the small-batch product."""
    return len({id(m) for model in models for m in model.modules() if uses_small_batch(m)})
