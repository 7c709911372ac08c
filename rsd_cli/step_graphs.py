"""CUDA graphs of a decoding step's maths: what runs between the forwards of an `sd` chain or an
`rsd-c` fan decided on the device (probabilities, draws, decisions) replayed as one graph per call
site and input shapes, so that a step launches a few copies and one replay where it launched
20-40 small kernels, each with the Python that queues it. On a GPU with compiled forwards that
host work is what a speculative step waits on (a small model's forward replays in ~1.5 ms)."""

from __future__ import annotations

from typing import Callable

import torch

# (run) -> (replay, outputs): what capturing `run` gives; run() returns a tuple of tensors, the
# graph's output buffers, which each replay overwrites with what run() would return then
Capture = Callable[[Callable[[], tuple]], tuple[Callable[[], None], tuple]]

# a site and shapes runs directly on its first calls and is captured at this one: a capture (a run on
# a side stream, the capture, the graph's own memory pool) costs milliseconds, a replay saves a
# fraction of one a call (an H200, `rsd-c` b=(7): ~0.9 ms a step), so a shape `auto` tries once or
# twice, or a run's last steps, need not pay for one
CAPTURE_AT = 3


def cuda_capture(device: torch.device, pool=None) -> Capture:
    """Captures on a CUDA device: one run on a side stream first (libraries set their workspaces
    up), then the capture, each graph in a memory pool of its own unless `pool` names a shared one
    (a graph's outputs stay valid while other graphs replay: a shared pool would let their
    temporaries overwrite them; CompiledModel shares one, copying each output at once)."""

    def capture(run):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs = run()
        return graph.replay, outputs

    return capture


class StepGraphs:
    """Calls pure functions of tensors — `graphs(site, fn, *tensors)` — as replayed graphs where
    `enabled`, else directly. fn reads nothing but its arguments (uniforms passed in, no generator)
    and returns a tuple of tensors; a site (any hashable) names one fn with its constants, and each
    site and input shapes is captured once, and its graph keeps fn (with whatever tensors fn reads
    as constants) while it lives: a graph reads what it was captured with by address, and graphs
    shared by a model's decoders outlive each one. Graphed, the results are the graph's own buffers,
    overwritten by the next call of the same site and shapes: callers `keep` what outlives it. A site
    and shapes runs directly until its `capture_at`-th call (CAPTURE_AT). If a capture fails, the
    maths runs directly from then on, with a one-line notice."""

    def __init__(self, device: torch.device, enabled: bool, notice=lambda message: None,
                 capture: Capture | None = None, capture_at: int = CAPTURE_AT):
        self.enabled = enabled
        self.notice = notice
        self.capture = capture or cuda_capture(device)
        self.capture_at = capture_at
        self._graphs: dict[tuple, tuple] = {}  # (site, input shapes) -> (input buffers, replay, outputs, fn)
        self._calls: dict[tuple, int] = {}  # (site, input shapes) -> calls so far, until it is captured

    def __call__(self, site, fn: Callable[..., tuple], *tensors: torch.Tensor) -> tuple:
        if not self.enabled:
            return fn(*tensors)
        key = (site, *((t.shape, t.dtype) for t in tensors))
        if key not in self._graphs:
            calls = self._calls[key] = self._calls.get(key, 0) + 1
            if calls < self.capture_at:
                return fn(*tensors)
            inputs = tuple(t.clone() for t in tensors)
            try:
                replay, outputs = self.capture(lambda: fn(*inputs))
            except Exception as e:  # noqa: BLE001 - an op, driver or library that cannot be captured
                self.enabled = False
                self._graphs.clear()
                reason = str(e).splitlines()[0] if str(e) else ""
                self.notice(f"capturing a CUDA graph of the step's maths failed ({type(e).__name__}: {reason}): "
                            f"it runs without graphs")
                return fn(*tensors)
            self._graphs[key] = (inputs, replay, outputs, fn)
        inputs, replay, outputs, _ = self._graphs[key]
        for buffer, value in zip(inputs, tensors):
            buffer.copy_(value)
        replay()
        return outputs

    def keep(self, tensor: torch.Tensor) -> torch.Tensor:
        """A result that outlives the next call of its site: a copy where it is a graph's buffer."""
        return tensor.clone() if self.enabled else tensor
