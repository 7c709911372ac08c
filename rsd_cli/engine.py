"""The decoding loop: one step = draft a tree -> verify it in one target pass -> accept -> prune.

`Decoder.generate` yields one `StepEvent` per step; every front end (generate, chat,
inspect-tree, bench, --json) and the tests consume these events.
"""

from __future__ import annotations

import bisect
import copy
import math
import os
import time
from collections import Counter
from functools import partial
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import torch

from .drafting import LOOKUP_NGRAM, NgramIndex, Shape, build_tree, lookup_tree, make_shape
from .errors import RsdError
from .models import text_config
from .sampling import (SamplingParams, gumbel_of, inverse_cdf, logits_to_probs, row_uniforms, sample, to_device,
                       to_host, to_host_soon)
from .step_graphs import StepGraphs
from .threads import FORWARDS, cpu_threads, one_thread_maths, run_on_torch
from .tree import DraftTree
from .verification import Decision, Plan, Rule, chain_outcome, fan_outcome, plan, verify


def full_vocabulary(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(..., N) logits of a reduced draft head -> (..., vocab_size): the other tokens get -inf (q = 0)."""
    if logits.shape[-1] >= vocab_size:
        return logits
    return torch.nn.functional.pad(logits, (0, vocab_size - logits.shape[-1]), value=-torch.inf)


def probs_and_draw(sampling: SamplingParams, argmax: bool, logits: torch.Tensor, u: torch.Tensor) -> tuple:
    """(1, V) logits, a (1, 1) uniform -> their probabilities (1, V) and a token (1,) drawn from them by
    the inverse CDF (or their argmax): a plain step's or a chain level's maths, nothing read."""
    probs = logits_to_probs(logits, sampling)
    return probs, probs.argmax(-1) if argmax else inverse_cdf(probs, u)


def lookup_verdict(sampling: SamplingParams, logits: torch.Tensor, tokens: torch.Tensor, count: torch.Tensor,
                   u: torch.Tensor) -> tuple:
    """A lookup chain's maths, nothing read: tokens (m + 1,) the root, the n looked-up tokens and m - n
    more that only fill the forward's rows (count: (1,) n), (m + 1, V) the target's logits after each,
    u (2m + 1,) float64 (an acceptance for each node, then the corrections' draws and the bonus's) ->
    p (m + 1, V), q (m, V) one-hot at each token (a looked-up one was drafted with certainty:
    lookup_tree), and (drafted, accepted, corrections, bonus) packed in one tensor, of which the first
    n of each are read: the bonus, after all n are accepted, is drawn from p's row n."""
    m = tokens.shape[0] - 1
    p = logits_to_probs(logits, sampling)
    drafted = tokens[1:]
    q = torch.zeros(m, p.shape[-1], dtype=p.dtype, device=p.device).scatter_(1, drafted[:, None], 1.0)
    rows = torch.cat([p[:m], p.index_select(0, count)])  # (row n in the last one's place: the bonus's)
    accepted, corrections, bonus = chain_outcome(rows, q, drafted, u[:m], u[m:, None])
    return p, q, torch.cat([drafted, accepted.long(), corrections, bonus])


def within_window(positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """(n, keys) bool: which keys a sliding window of `window` positions lets each row see (as
    transformers' sliding-window masks: a key less than `window` positions behind the row's)."""
    return positions[:, None] - key_positions[None, :] < window


def within_chunk(positions: torch.Tensor, key_positions: torch.Tensor, chunk: int) -> torch.Tensor:
    """(n, keys) bool: which keys chunked attention lets each row see (Llama 4's, as transformers' chunked
    masks): those whose position is in the row's chunk of `chunk` positions."""
    return positions[:, None] // chunk == key_positions[None, :] // chunk


def chain_after(visible: torch.Tensor, past: int) -> bool:
    """Whether new tokens whose `visible` is (n, past + n) see every key before them and each other as a
    chain (causally)."""
    return bool(visible[:, :past].all()) and torch.equal(visible[:, past:].cpu(), lower_triangle(visible.shape[0]))


def placed_mask(columns: torch.Tensor, limit: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """A static-shape forward's additive mask (n, capacity) made on the device: row r sees the
    cache's slots up to limit[r] and its own slot, slots[r]. columns: arange(capacity)."""
    seen = (columns[None, :] <= limit[:, None]) | (columns[None, :] == slots[:, None])
    return torch.where(seen, 0.0, -math.inf)


def placed_inputs(columns: torch.Tensor, base: torch.Tensor, tokens: torch.Tensor, depths: torch.Tensor,
                  sights: torch.Tensor) -> tuple:
    """A static-shape forward's inputs made on the device, as StaticLM.forward makes them on the host:
    tokens (n,) at positions base + depths and at slots base, base + 1, ..., each row seeing the
    cache's slots up to base + its sight and its own slot (a negative sight: its own alone, a
    padding row). base (1,); depths, sights (n,); columns: arange(capacity).
    -> ids (3, n): tokens, positions, slots; mask (n, capacity)."""
    slots = base + torch.arange(tokens.shape[0], device=base.device)
    limit = torch.where(sights >= 0, base + sights, -1)
    return torch.stack([tokens, base + depths, slots]), placed_mask(columns, limit, slots)


def tree_tokens(size: int, root: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
    """A root and its drafted tokens, then padding tokens (0) up to `size`: a verifying forward's tokens."""
    return torch.cat([root, drafted, torch.zeros(size - 1 - drafted.shape[0], dtype=torch.long, device=root.device)])


def fan_next(k: int, packed: torch.Tensor, base: torch.Tensor) -> tuple:
    """What a fan step's outcome leaves for the next step, on the device: the next root (the
    accepted child's bonus, else the correction), what the draft reads next (the accepted child
    and the root, count 2; else the root and a padding token, count 1), the next root's position,
    and the slot move that puts the accepted child next to its root (a slot onto itself where none
    was accepted). packed: (drafted, drawn, accepted, correction, bonus), as _fan_maths packs it."""
    drafted, accepted = packed[:k], packed[2 * k: 3 * k]
    correction, bonus = packed[3 * k: 3 * k + 1], packed[3 * k + 1:]
    hit = accepted.amax(0, keepdim=True)  # (1,) 1 where a child was accepted
    first = accepted.argmax(0, keepdim=True)  # the first accepted (0 where none)
    root = torch.where(hit > 0, bonus.gather(0, first), correction)
    catch = torch.where(hit > 0, torch.cat([drafted.gather(0, first), root]),
                        torch.cat([root, torch.zeros_like(root)]))
    return root, catch, 1 + hit, base + 1 + hit, base + 1 + first * hit, base + 1


def chain_next(gamma: int, packed: torch.Tensor, base: torch.Tensor) -> tuple:
    """What a chain step's outcome leaves for the next step, on the device, as fan_next for a fan:
    the next root (the bonus where every draft was accepted, else the first rejection's correction),
    what the draft reads next (the last draft, which it never read, and the bonus, count 2; else the
    correction and a padding token, count 1: it read the accepted drafts while drafting), and the
    next root's position. The accepted drafts stay where they are in both caches. packed:
    (drafted, accepted, corrections, bonus) as _chain_maths packs it."""
    accepted, corrections, bonus = packed[gamma: 2 * gamma], packed[2 * gamma: 3 * gamma], packed[3 * gamma:]
    run = accepted.cumprod(0).sum(0, keepdim=True)  # (1,) drafts accepted before the first rejection
    every = (run == gamma).long()
    root = torch.where(every > 0, bonus, corrections.gather(0, run.clamp(max=gamma - 1)))
    catch = torch.where(every > 0, torch.cat([packed[gamma - 1: gamma], root]),
                        torch.cat([root, torch.zeros_like(root)]))
    return root, catch, 1 + every, base + 1 + run


def lower_triangle(n: int) -> torch.Tensor:
    """(n, n) bool: row i sees columns 0..i (n new tokens attending to each other causally)."""
    return torch.arange(n)[:, None] >= torch.arange(n)


def fresh_seed() -> int:
    """A seed for a run that was given none (`--seed N` with it reproduces the run)."""
    return int(torch.randint(0, 2**62, ()).item())


def unchanged_prefix(indices: list[int]) -> int:
    """How many cache positions `keep(indices)` leaves where they are: the leading run of
    indices equal to their own position; only the rest (the accepted path) has to move.
    Indices ascend and differ, so indices[i] >= i, and indices[i] == i exactly in that run: a
    binary search finds its end (a step keeps the whole context: O(log n), not a Python loop)."""
    return bisect.bisect_left(range(len(indices)), True, key=lambda i: indices[i] != i)


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences have in common."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def synchronise(device: torch.device) -> None:
    """Wait for a CUDA device's queued work (a forward returns before it ends); elsewhere nothing."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_chain(cache, n: int) -> float:
    """Seconds one n-token chain forward takes on `cache` (every row's logits, as a tree's
    verification or a draft level asks for; a GPU's work included); the cache is then cut back."""
    past = cache.length
    synchronise(cache.device)
    start = time.perf_counter()
    cache.extend([1] * n, last_only=False)
    synchronise(cache.device)
    seconds = time.perf_counter() - start
    cache.keep(list(range(past)))
    return seconds


class ForwardClock:
    """Seconds a cache's forwards took. On a CUDA device the work runs after the call returns (the
    logits stay there), so it is timed with CUDA events, read once they have happened (a step's
    transfers to the host wait for them anyway); elsewhere with the host's clock."""

    def __init__(self, device: torch.device):
        self.device = device if device.type == "cuda" else None
        self.totals: list[float] = [0.0]  # totals[i]: seconds of the first i forwards read so far
        self.pending: list[tuple] = []  # (start, end) events not read yet, in order

    def start(self):
        if self.device is None:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def stop(self, started) -> None:
        if self.device is None:
            self.totals.append(self.totals[-1] + time.perf_counter() - started)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self.device))
        self.pending.append((started, end))

    @property
    def count(self) -> int:
        """How many forwards were timed so far (a mark for `seconds_through`)."""
        return len(self.totals) - 1 + len(self.pending)

    def seconds_through(self, mark: int) -> float:
        """Seconds the first `mark` forwards took, waiting for those only (later ones may still run)."""
        while len(self.totals) <= mark:
            start, end = self.pending.pop(0)
            end.synchronize()
            self.totals.append(self.totals[-1] + start.elapsed_time(end) / 1000)
        return self.totals[mark]

    @property
    def seconds(self) -> float:
        return self.seconds_through(self.count)


class ChainExtension:
    """`extend` for a cache that has `length` and `forward` (CachedLM here, compiled.StaticLM)."""

    # a `longrope` model's cache (long_factors_from): whether some key before the long factors' start was
    # turned by the short factors, by the long ones (Decoder._long_keys, Decoder._kept_prefix)
    turned_short = turned_long = False

    def _note_factors(self, positions: list[int], long: bool) -> None:
        """Before a forward of rows at `positions` (a `longrope` model's; `long`: all turned by the long
        factors, else each before the start by the short ones): what the cache then holds (an empty
        one, only that forward's)."""
        before, held = min(positions) < self.long_from, self.length > 0
        self.turned_short = before and not long or self.turned_short and held
        self.turned_long = before and long or self.turned_long and held

    def extend(self, tokens: list[int] | torch.Tensor, last_only: bool = True, reading: bool = False) -> torch.Tensor:
        """Append a chain of tokens (a list, or an (n,) tensor on the model's device) after the
        cache (causal attention); `reading`: a prompt's tokens (forward)."""
        n, past = len(tokens), self.length
        visible = torch.ones(n, past + n, dtype=torch.bool)
        # (Tensor.tril runs its rows in parallel whatever their number: waking a many-core CPU's
        # threads took 0.1-0.3 ms a call on the H100 machine's 16 cores)
        visible[:, past:] = lower_triangle(n)
        return self.forward(tokens, list(range(past, past + n)), visible, last_only, reading=reading)

    def release(self) -> None:
        """Hand back what the cache borrowed from its runtime (a static-shape runtime's shared
        buffers, see compiled.StaticLM); nothing for transformers' cache."""


PLAIN = make_shape("ar")
CHAIN_VARIANTS = ("ar", "sd", "lookup")
# layer kinds and models (for configs that name no layer kinds) that carry a state from token to token:
# Mamba and other state-space or linear-attention layers, short convolutions (LFM2), RWKV
RECURRENT_LAYERS = frozenset({"linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba", "recurrent"})
# ... of those, the ones whose forward of several tokens after a cache gives what the same tokens one
# at a time give (benchmarks/architectures.py; 3 tokens after 9, to 1e-6): LFM2's and LFM2-MoE's convolutions,
# Qwen3-Next's and Qwen3.5's gated delta rule, Mamba-2's mixers (Mamba-2; Granite 4, Bamba and Falcon-H1 hybrids).
# transformers' Mamba-1 mixers (Mamba, Falcon-Mamba, Jamba) read such a chain without the state before it (0.8-1.7 off; Jamba
# 3e-3), and Nemotron-H's one token at a time does not clamp its time steps as its chained scan does: plain
# decoding for those and the rest
CHAIN_RECURRENT = frozenset({"lfm2", "lfm2_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "mamba2",
                             "granitemoehybrid", "falcon_h1", "bamba"})
# ... of those, the ones the static-cache runtime reads along each row's path from what it keeps by slot, like keys
# (their convolutions' inputs; each token's k, decay and update for Qwen3.5's and Qwen3-Next's gated delta nets, its
# B, dt x and dt A for Granite 4's, Nemotron-H's and Bamba's Mamba-2 mixers): trees there (Limit.transformers_only)
READ_BY_PATH = frozenset({"lfm2", "lfm2_moe", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "granitemoehybrid",
                          "nemotron_h", "bamba", "mamba2"})
SNAPSHOTS = 8  # the most states a recurrent cache keeps to roll back to (CachedLM.keep)
# what a layer's state is (transformers' LinearAttentionCacheLayerMixin): copied before a forward, put back
STATE_FIELDS = ("conv_states", "recurrent_states", "is_conv_states_initialized", "is_recurrent_states_initialized",
                "has_previous_state", "conv_kernel_size")
RECURRENT_MODELS = frozenset({
    "mamba", "mamba2", "falcon_mamba", "rwkv", "recurrent_gemma", "xlstm", "bamba", "zamba", "zamba2", "jamba",
    "falcon_h1", "granitemoehybrid", "lfm2", "lfm2_moe", "lfm3", "nemotron_h", "qwen3_next", "qwen3_5_text",
    "qwen3_5_moe_text", "kimi_linear", "minimax", "olmo_hybrid", "bailing_hybrid", "plamo2"})


@dataclass(frozen=True)
class Limit:
    """What a model whose layers take no tree can run, and why (`limit_of`)."""

    variants: tuple[str, ...]  # (`auto` then chooses among these)
    reason: str  # "ALiBi position biases"
    recurrent: bool = False  # layers with a state (CachedLM reads chains into it and takes drafts back itself)
    # a limit of transformers' forward alone, none on the static-cache runtime, where a model takes trees:
    # position biases that transformers works out of cache slots (the runtime's masks go by each slot's
    # position: compiled.StaticLM), and the recurrent layers of READ_BY_PATH (the runtime keeps what each token gives
    # them by slot and reads each row's path: compiled._convolved, _gated_delta, _mamba)
    transformers_only: bool = False

    def refusal(self, variant: str, whose: str, how: str = "--variant") -> str:
        """The one line that refuses `variant` for this model ("the target's ALiBi position biases
        (bloom)"...), naming what runs as `how` sets it."""
        if self.variants == ("ar",):
            return f"{variant} verifies drafts, which {whose} cannot take back: use {how} ar (or auto)"
        runs = f"{', '.join(self.variants[:-1])} or {self.variants[-1]}"
        return f"{variant} verifies a tree, which {whose} cannot take: use {how} {runs} (or auto)"


def limit_of(config) -> Limit | None:
    """What a model runs where it cannot take a tree's mask (nor rows of prompts read together), or
    None. Layers with a state (Mamba, linear attention, short convolutions) read every token into
    it, a tree's siblings too: chains only, a rejected draft taken out by going back to the state
    before it and reading the accepted tokens again (CachedLM.keep), where a chain's forward gives
    what its tokens one at a time do (CHAIN_RECURRENT); plain decoding for the others.
    Attention that works position biases or scales out of cache slots or a 2D mask, instead of
    the positions and mask it is given, takes chains (each token at the slot of its position) on
    its own causal mask: ALiBi (BLOOM, MPT, Falcon with `alibi`), Llama 4 (attention scaled by
    the cache's length on its NoPE layers, chunked attention) and GPT-Neo's local layers (a window
    of slots, not positions). On the static-cache runtime, which biases, scales, chunks and windows
    by each slot's position, they take trees (Limit.transformers_only, pair_limit), as LFM2, Qwen3.5,
    Qwen3-Next, Granite 4.0-H and Nemotron-H do, whose recurrent layers read each row's path there instead of
    a state (READ_BY_PATH; Nemotron-H plain steps alone on transformers' forward)."""
    config = text_config(config)
    kind = getattr(config, "model_type", "") or ""
    if kind in RECURRENT_MODELS or RECURRENT_LAYERS & set(getattr(config, "layer_types", None) or ()):
        # (a chain read again after a state copied: CachedLM._roll_back)
        return Limit(CHAIN_VARIANTS if kind in CHAIN_RECURRENT else ("ar",), "recurrent layers", recurrent=True,
                     transformers_only=kind in READ_BY_PATH)
    attention = getattr(config, "attn_config", None)
    if kind in ("bloom", "mpt") or getattr(config, "alibi", False) or getattr(attention, "alibi", False):
        return Limit(CHAIN_VARIANTS, "ALiBi position biases", transformers_only=True)
    if kind.startswith("llama4") or getattr(config, "attention_chunk_size", None):
        return Limit(CHAIN_VARIANTS, "chunked attention scaled by the cache's length", transformers_only=True)
    if kind == "gpt_neo" and "local" in (getattr(config, "attention_layers", None) or ()):
        return Limit(CHAIN_VARIANTS, "local attention windowed by cache slots", transformers_only=True)
    return None


def long_factors_from(config) -> int | None:
    """The position from which a `longrope` model (Phi-3.5, Phi-4-mini, Phi-3's 128k models) turns
    q and k by its long factors, its original context; None for other models. transformers (as
    Microsoft's code) turns every row of a forward by the long factors where the forward reaches
    that position, by the short ones before: so the model's next-token distribution after n tokens
    is that of one forward of them, by the short factors up to n = that position and by the long
    ones after — its `generate` reads the whole sequence again, once, when it first goes past it
    (Phi3ForCausalLM.prepare_inputs_for_generation). rsd gives that distribution exactly: a prompt
    is read as one forward (`reading`); a step whose root is before that position emits no token
    past it (Decoder._emit), its rows turned each by its own position's factors (CachedLM.forward in
    two, the static-cache runtime from a table of each position's angles: compiled.CompiledModel),
    so those it emits from are turned by the short ones; and before the first step from it the
    caches read the whole sequence again by the long ones (Decoder._long_keys)."""
    parameters = getattr(text_config(config), "rope_parameters", None) or {}
    if not isinstance(parameters, dict) or parameters.get("rope_type") != "longrope":
        return None
    start = parameters.get("original_max_position_embeddings") \
        or getattr(text_config(config), "original_max_position_embeddings", None)
    return None if start is None else int(start)


def astride(positions: list[int], start: int | None) -> bool:
    """Whether a forward's rows take positions on both sides of `start` (long_factors_from)."""
    return start is not None and min(positions) < start <= max(positions)


def pair_limit(target, draft, runtimes: Runtimes | None = None) -> tuple[Limit, str] | None:
    """The tighter limit of a target and draft (limit_of) and whose it is ("the target's ALiBi
    position biases (bloom)"), or None where both take trees: a model on the static-cache runtime
    (runtimes') has none of the limits of transformers' forward alone (Limit.transformers_only)."""
    runtimes = runtimes or Runtimes()
    limits = [(limit, f"the {role}'s {limit.reason} ({model.config.model_type})")
              for role, model, runtime in (("target", target, runtimes.target), ("draft", draft, runtimes.draft))
              if (limit := limit_of(getattr(model, "config", None))) is not None
              and not (limit.transformers_only and runtime is not None)]
    return min(limits, key=lambda found: len(found[0].variants), default=None)


def every_key_cache(config):
    """transformers' DynamicCache for a model of this config, every attention layer keeping every key:
    a sliding-window layer's own cache drops the keys its window has passed, and so the slots that
    rsd's masks and `keep` count on (the window is in the masks, CachedLM.forward)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    try:
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
    except ImportError:  # (a transformers whose caches have no such layers)
        return cache
    cache.layers = [DynamicLayer() if type(layer) is DynamicSlidingWindowLayer else layer for layer in cache.layers]
    return cache


def additive_mask(visible: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """(1, 1, n, keys) float mask for transformers' attention: 0 where `visible`, dtype's min elsewhere
    (a boolean 4D mask is not honoured everywhere)."""
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible.cpu(), torch.finfo(dtype).min)
    return mask[None, None].to(device)


def slot_tables_cover(model, keys: int) -> None:
    """GPT-Neo's attention hides keys by a table of slots as large as its context (each layer's causal
    `bias`, a local layer's window cut from it), so it takes no more keys than that: a draft whose context
    is shorter than the target's failed once the answer passed it ("The size of tensor a (16) must match
    the size of tensor b (24)"). Grows each table to cover `keys` slots, as its __init__ would make it,
    one table of each kind (global, local) for all its layers, where each had its own (the rows past its
    learned positions read its last one: CachedLM.forward)."""
    made: dict[tuple, torch.Tensor] = {}  # (window or None, device) -> (1, 1, keys, keys)
    for module in model.modules():
        table = getattr(module, "bias", None)
        if not (isinstance(table, torch.Tensor) and table.dtype == torch.bool and table.dim() == 4
                and hasattr(module, "attention_type")) or table.shape[-1] >= keys:
            continue
        window = module.config.window_size if module.attention_type == "local" else None
        kind = (window, table.device)
        if kind not in made:
            causal = torch.tril(torch.ones(keys, keys, dtype=torch.bool, device=table.device))
            made[kind] = (causal if window is None else causal ^ torch.tril(causal, -window))[None, None]
        module.bias = made[kind]


def cache_argument(model) -> str:
    """The name the model's forward takes its KV cache by: "cache" since transformers 5.24 (where
    "past_key_values" warns on every call that it is deprecated, to be removed in 5.40),
    "past_key_values" before (the GPU machine's 5.17) and for models that do not name "cache", and
    "cache_params" for Mamba's family before 5.24 (which takes any other name into **kwargs unread:
    every forward would start from an empty state)."""
    import inspect

    try:
        named = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward Python cannot introspect
        return "past_key_values"
    return next((name for name in ("cache", "past_key_values", "cache_params") if name in named), "past_key_values")


class CachedLM(ChainExtension):
    """A causal LM and its KV cache (transformers' eager forward and DynamicCache), fed chains or
    tree nodes with an explicit mask."""

    def __init__(self, model, vocab_size: int):
        from .compiled import sliding_window
        from .models import input_device

        self.model = model
        self.device = input_device(model)  # a placed model's layers move what they get to their own devices
        self.vocab_size = vocab_size
        self.cache = every_key_cache(model.config)
        self.cache_argument = cache_argument(model)
        self.clock = ForwardClock(self.device)
        self.calls = 0
        self.on_cpu = in_cpu_memory(model)  # then its forwards run on the threads the governor chooses
        # a sliding-window model's layers see the keys within its window of positions (or some of its
        # layers do: masks by layer kind), which rsd's masks then say, knowing each cache slot's position
        # (a slot's position is not its index where prompts are read together); a multimodal model's
        # decoder (Gemma 3 4B and up) says its window in its text config
        cfg = text_config(model.config)
        self.window = getattr(cfg, "sliding_window", None) if sliding_window(cfg) else None
        self.masks_by_kind = self.window is not None and bool(getattr(cfg, "layer_types", None))
        # the positions it holds: rows past them read the last one, as on the runtime — a draft's whose context is
        # shorter than the target's (its q is poorer there; a step of the target's drafts no deeper than what fits,
        # Decoder._next_shape); else a table of learned positions (GPT-2's, OPT's) is indexed past its end (an
        # IndexError; a device assert on a GPU)
        self.context = getattr(cfg, "max_position_embeddings", None)
        # the keys GPT-Neo's attention's tables of slots cover (slot_tables_cover grows them past its context)
        self.slot_tables = self.context if cfg.model_type == "gpt_neo" else None
        # a model that takes no tree (limit_of) makes its own causal mask from a 2D one (forward); one
        # with a state (recurrent) goes back to the state before tokens `keep` takes back and reads the
        # kept ones again, from the tokens it read
        self.limit = limit_of(cfg)
        self.recurrent = self.limit is not None and self.limit.recurrent
        self.read: list[int] | None = [] if self.recurrent else None  # (None while a forward runs)
        self.snapshots: list[tuple[int, dict]] = []  # (length, {layer index: its state then}) before each forward
        # (taken where a chain read after a state is what its tokens one at a time give: CHAIN_RECURRENT)
        self.rolls_back = self.recurrent and self.limit.variants != ("ar",)
        # an LFM2, Qwen3.5, Qwen3-Next, Granite 4 or Nemotron-H whose layers all carry a state (a draft of its first
        # layers; Nemotron-H's MLP blocks beside them): no
        # mask of each kind, which transformers would make from the cache's length, which such a cache does not have
        # ("`get_seq_length` can only be called on Attention layers"); those take a mapping of them instead (other
        # families a 2D mask)
        kinds = set(getattr(cfg, "layer_types", None) or ())
        self.no_masks = {kind: None for kind in kinds} \
            if cfg.model_type.startswith(("lfm2", "qwen3_5", "qwen3_next", "granitemoehybrid", "nemotron_h", "bamba")) \
            and kinds and kinds - {"mlp", "moe"} <= RECURRENT_LAYERS else None
        # (off for a plain step's forward, which nothing takes back: a Qwen3.5-0.8B-sized state takes 7-9 ms
        # to copy on the 2-core Xeon; where it is wrong, keep reads the tokens afresh)
        self.copies_states = True
        self.key_positions = torch.zeros(0, dtype=torch.long)  # [cache slot] (kept for a window only)
        self.long_from = long_factors_from(cfg)  # (a `longrope` model's: forward splits forwards astride it)
        # a prompt into an empty cache goes without a mask (forward): transformers makes its own, windows
        # included, from slot indices, which are then its positions (its sdpa masks take a byte a score, or
        # none where causal: a windowed 8000-token prompt's two float masks took 512 MB)

    @property
    def forward_seconds(self) -> float:
        return self.clock.seconds

    @property
    def length(self) -> int:
        if self.recurrent:  # (a cache of states alone has no length; -1 after an interrupted forward)
            return -1 if self.read is None else len(self.read)
        return self.cache.get_seq_length()

    def forward(self, tokens: list[int] | torch.Tensor, positions: list[int], visible: torch.Tensor,
                last_only: bool = False, reading: bool = False) -> torch.Tensor:
        """Run `tokens` (a list, or an (n,) tensor on the model's device) at `positions`; visible is
        (n, length + n) bool over cache + new keys; `reading`: a prompt's tokens, read as one forward
        where a `longrope` model's other forwards astride its long factors' start are two
        (long_factors_from).

        Returns (n, V) logits, or (1, V) with last_only. Transformers wants an additive float
        mask (0 where visible, dtype min elsewhere): a boolean 4D mask is not honoured everywhere.
        A sliding-window model gets the window in it too (by layer kind where only some layers
        have one). A prompt read into an empty cache goes without one: transformers' attention then
        takes it as causal (and windowed, by slot: there its position), which torch's kernel
        computes without the hidden half of the scores (a 2000-token prompt on the 2-core Xeon 3.1
        -> 2.5 s, the same logits).
        """
        if not reading and astride(positions, self.long_from):
            return self._by_factors(tokens, positions, visible, last_only)
        if self.long_from is not None:  # (transformers turns them all by the short factors, or all by the long)
            self._note_factors(positions, max(positions) >= self.long_from)
        start = self.clock.start()
        dtype = self.model.dtype
        device = self.device
        n = len(tokens)
        # each cache slot's position, then (a window's keys are hidden by position)
        keys = torch.cat([self.key_positions, torch.tensor(positions)]) if self.window is not None else None
        if self.limit is not None:
            self._check_chain(positions, visible)
            # a 2D mask of the keys, which the model makes its own causal mask and biases from; none for layers
            # with a state (Mamba masks its new tokens' states with a 2D mask: of the new tokens alone)
            mask = self.no_masks if self.recurrent else torch.ones(1, self.length + n, dtype=torch.long, device=device)
        elif (self.length == 0 and n > 1 and positions[0] == 0 and positions[-1] == n - 1
              and torch.equal(visible, lower_triangle(n))):
            mask = None  # (a prompt at positions 0.. : ChainExtension.extend's, or prompts read together's first)
        elif self.window is not None:
            near = within_window(torch.tensor(positions), keys, self.window)
            windowed = additive_mask(visible & near.to(visible.device), dtype, device)
            mask = {"full_attention": additive_mask(visible, dtype, device),
                    "sliding_attention": windowed} if self.masks_by_kind else windowed
        else:
            mask = additive_mask(visible, dtype, device)

        if self.slot_tables is not None and self.length + n > self.slot_tables:
            self.slot_tables = max(2 * self.slot_tables, self.length + n)
            slot_tables_cover(self.model, self.slot_tables)

        def work():
            with torch.inference_mode():
                return self.model(
                    input_ids=tokens[None].to(device) if isinstance(tokens, torch.Tensor) else
                    torch.tensor([tokens], device=device),
                    position_ids=torch.tensor([positions], device=device).clamp(max=(self.context or 2**62) - 1),
                    attention_mask=mask,
                    **{self.cache_argument: self.cache},
                    use_cache=True,
                    logits_to_keep=1 if last_only else 0,
                )

        if self.rolls_back and self.copies_states:
            self._snapshot()
        read, self.read = self.read, None
        out = run_on_torch((id(self.model), n), work, on_cpu=self.on_cpu)
        if self.window is not None:
            self.key_positions = keys
        if read is not None:
            self.read = read + (tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens))
        # the logits stay on the device (a placed model's on its input device): sampling and
        # verification run there, and only a few numbers a step come to the host
        logits = full_vocabulary(out.logits[0, :, : self.vocab_size].float().to(self.device), self.vocab_size)
        self.clock.stop(start)
        self.calls += 1
        return logits

    def _by_factors(self, tokens: list[int] | torch.Tensor, positions: list[int], visible: torch.Tensor,
                    last_only: bool) -> torch.Tensor:
        """forward of rows astride a `longrope` model's long factors' start: each run of rows on one side
        of it in a forward of its own, in order (a row sees only earlier rows and itself), so that each
        row is turned by its own position's factors (those before it by the short ones, as one forward
        of their sequences turns them: long_factors_from)."""
        past, n = self.length, len(positions)
        long = [p >= self.long_from for p in positions]
        ends = [i for i in range(1, n) if long[i] != long[i - 1]] + [n]
        logits, begin = [], 0
        for end in ends:
            logits.append(self.forward(tokens[begin:end], positions[begin:end], visible[begin:end, : past + end],
                                       last_only))
            begin = end
        return logits[-1] if last_only else torch.cat(logits)

    def _check_chain(self, positions: list[int], visible: torch.Tensor) -> None:
        """That the new tokens extend the cache as a chain at their positions, the one thing a model
        that takes no tree (limit_of) reads right (else an error: a tree asked of it)."""
        past, n = self.length, len(positions)
        if list(positions) != list(range(past, past + n)) or not chain_after(visible, past):
            raise RsdError(f"the {self.model.config.model_type} model's {self.limit.reason} take chains only, "
                           "here asked for a tree")

    def _snapshot(self) -> None:
        """Copy the state of every layer that holds one (STATE_FIELDS; a layer's keys are not
        copied: cropped instead), before a forward changes it (a recurrent model's; at most
        SNAPSHOTS kept): `keep` goes back to one."""
        from transformers.cache_utils import LinearAttentionCacheLayerMixin

        self.snapshots.append((self.length, {
            i: {name: copy.deepcopy(getattr(layer, name)) for name in STATE_FIELDS if hasattr(layer, name)}
            for i, layer in enumerate(self.cache.layers) if isinstance(layer, LinearAttentionCacheLayerMixin)}))
        del self.snapshots[:-SNAPSHOTS]

    def _roll_back(self, indices: list[int]) -> None:
        """`keep` for a model with a state, which cannot give tokens back: the cache goes back to the
        latest state copied before a forward that the kept tokens all precede (the attention layers
        cropped to it), then the kept tokens after it are read again (a chain's accepted ones: a
        forward of those few tokens); without such a copy (or where a chain's forward after a state
        is not exact: rolls_back), the kept tokens are all read afresh, from an empty cache."""
        if len(indices) >= self.length:  # (nothing given back)
            self.snapshots.clear()
            return
        kept = [self.read[i] for i in indices]
        back = [(length, states) for length, states in self.snapshots
                if length <= len(indices) and (length == 0 or indices[length - 1] == length - 1)]
        self.snapshots = []
        if back:
            from transformers.cache_utils import DynamicLayer

            length, states = back[-1]
            for i, layer in enumerate(self.cache.layers):
                for name, value in states.get(i, {}).items():
                    setattr(layer, name, value)
                if getattr(layer, "keys", None) is not None and layer.get_seq_length() > length:
                    # (its keys alone: a layer holding a state too crops that only where it records its past)
                    DynamicLayer.crop(layer, length - layer.get_seq_length())
            self.read = self.read[:length]
        else:
            self.cache, self.read = every_key_cache(self.model.config), []
        if len(kept) > self.length:
            self.extend(kept[self.length:])

    def keep(self, indices: list[int]) -> None:
        """Keep only these cache positions (ascending: the prefix plus the accepted path).

        The prefix stays where it is; only the few accepted positions after it are moved down
        before the cache is cropped, so a step copies O(path) entries, not the whole cache."""
        if self.recurrent:
            self._roll_back(indices)
            return
        prefix = unchanged_prefix(indices)
        if self.window is not None:
            self.key_positions = self.key_positions[indices]
        if prefix < len(indices):
            tail = torch.tensor(indices[prefix:])
            with torch.inference_mode():  # the cache tensors were made in inference mode
                for layer in self.cache.layers:  # each on its decoder layer's device
                    if getattr(layer, "keys", None) is None:  # (a layer reading another's keys: Gemma 4's)
                        continue
                    tail = tail.to(layer.keys.device)
                    layer.keys[..., prefix : len(indices), :] = layer.keys.index_select(-2, tail)
                    layer.values[..., prefix : len(indices), :] = layer.values.index_select(-2, tail)
        if len(indices) < self.length:
            self.cache.crop(len(indices) - self.length)


@dataclass
class NodeCheck:
    """The verification at one tree node."""

    node: int
    draws: list[int]  # child node ids in the order they were tried
    decision: Decision
    inputs: tuple = field(repr=False)  # (p, q, draft tokens, rule) at this node: what the plan is made of
    computed: Plan | None = field(default=None, repr=False)

    @property
    def plan(self) -> Plan:
        """The node's full plan (every draft's acceptance probability and residual), computed when
        a consumer first asks where verification did not need it (the first draft accepted)."""
        if self.computed is None:
            self.computed = plan(*self.inputs)
        return self.computed


@dataclass
class StepEvent:
    step: int
    shape: Shape
    tree: DraftTree
    p: torch.Tensor  # (len(tree), V) target distribution at every node
    checks: list[NodeCheck]  # along the accepted path, root first
    path: list[int]  # accepted node ids, root excluded
    extra_token: int  # the correction (after a rejection) or bonus (at a leaf) token
    extra_kind: str  # "correction" | "bonus"
    emitted: list[int]  # tokens added to the output this step (truncated at EOS / max_tokens)
    draft_calls: int
    draft_seconds: float
    verify_seconds: float
    forward_seconds: float  # model forward passes only, both models (the first step: + the prompt's)
    draft_forward_seconds: float = 0.0  # the draft model's part of forward_seconds
    finished: str | None = None  # "eos" | "length" | "context" | "stop" (a stop string) once generation ends
    stop: str | None = None  # the stop string that ended generation (set by generation.complete)

    @property
    def accepted(self) -> int:
        return len(self.path)

    def token_sources(self) -> list[int]:
        """For each emitted token, the tree node whose target distribution p it was drawn from:
        an accepted node's token from its parent's, the correction or bonus from the last node's."""
        return ([0] + self.path)[: len(self.emitted)]

    @property
    def levels_tried(self) -> int:
        """Depths at which a draft was tried (an accepted level, or the final rejection)."""
        return len(self.checks)

    def status(self, node: int) -> str:
        """'root' | 'accepted' | 'rejected' | 'not reached'."""
        if node == 0:
            return "root"
        if node in self.path:
            return "accepted"
        for check in self.checks:
            if node in check.draws[: check.decision.tried]:
                return "rejected"
        return "not reached"


@dataclass
class Stats:
    steps: int = 0
    new_tokens: int = 0
    step_tokens: int = 0  # accepted + 1 per step, before truncation: block efficiency counts these
    accepted: int = 0
    levels_tried: int = 0
    target_tokens: int = 0
    draft_calls: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    forward_seconds: float = 0.0
    wall_seconds: float = 0.0
    first_token_seconds: float = 0.0  # wall time until the first step's tokens (reading the prompt, that step)
    first_step_tokens: int = 0  # the first step's tokens (what the rate after the first token leaves out)
    tried_at_depth: list[int] = field(default_factory=list)
    accepted_at_depth: list[int] = field(default_factory=list)
    shapes: dict[str, int] = field(default_factory=dict)  # steps per shape (several with --variant auto)
    forward_threads: dict[int, int] = field(default_factory=dict)  # forwards on the CPU by their threads
    cpu_threads: int = 0  # the threads the CPU's work may use (0: no forward on the CPU)

    def add(self, event: StepEvent) -> None:
        if not self.steps:
            self.first_step_tokens = len(event.emitted)
        self.steps += 1
        name = event.shape.describe()
        self.shapes[name] = self.shapes.get(name, 0) + 1
        self.new_tokens += len(event.emitted)
        self.step_tokens += event.accepted + 1
        self.accepted += event.accepted
        self.levels_tried += event.levels_tried
        self.target_tokens += len(event.tree)
        self.draft_calls += event.draft_calls
        self.draft_seconds += event.draft_seconds
        self.verify_seconds += event.verify_seconds
        self.forward_seconds += event.forward_seconds
        for depth in range(event.levels_tried):
            self._count_depth(depth, 1, int(depth < event.accepted))

    def timed(self, seconds: float) -> None:
        """The run's wall time so far, after a step: the first step's is its time to the first token."""
        self.wall_seconds = seconds
        if self.steps == 1:
            self.first_token_seconds = seconds

    def merge(self, other: "Stats") -> None:
        """Add another run's statistics into this total (wall time included)."""
        for name in ("steps", "new_tokens", "step_tokens", "accepted", "levels_tried", "target_tokens",
                     "draft_calls", "draft_seconds", "verify_seconds", "forward_seconds", "wall_seconds",
                     "first_token_seconds", "first_step_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for depth, (tried, accepted) in enumerate(zip(other.tried_at_depth, other.accepted_at_depth)):
            self._count_depth(depth, tried, accepted)
        for name, steps in other.shapes.items():
            self.shapes[name] = self.shapes.get(name, 0) + steps
        self.forward_threads = dict(sorted((Counter(self.forward_threads) + Counter(other.forward_threads)).items()))
        self.cpu_threads = max(self.cpu_threads, other.cpu_threads)

    def count_threads(self, before: Counter) -> None:
        """The run's forwards on the CPU by their threads (threads.Governor): those since `before`, a
        copy of threads.FORWARDS taken when it started."""
        ran = FORWARDS - before
        self.forward_threads = dict(sorted(ran.items()))
        self.cpu_threads = cpu_threads() if ran else 0

    def shapes_used(self) -> list[tuple[str, int]]:
        """(shape, steps) by steps, most used first."""
        return sorted(self.shapes.items(), key=lambda item: (-item[1], item[0]))

    def _count_depth(self, depth: int, tried: int, accepted: int) -> None:
        if depth >= len(self.tried_at_depth):
            self.tried_at_depth.append(0)
            self.accepted_at_depth.append(0)
        self.tried_at_depth[depth] += tried
        self.accepted_at_depth[depth] += accepted

    @property
    def block_efficiency(self) -> float:
        return self.step_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.levels_tried if self.levels_tried else 0.0

    @property
    def acceptance_per_depth(self) -> list[float]:
        return [a / t for a, t in zip(self.accepted_at_depth, self.tried_at_depth)]

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_seconds if self.wall_seconds else 0.0

    @property
    def tokens_per_second_after_first(self) -> float:
        """Tokens a second once the first step's were out: the rate without reading the prompt (0 for
        a run of one step). Merged runs: each one's after its own first token."""
        seconds = self.wall_seconds - self.first_token_seconds
        return (self.new_tokens - self.first_step_tokens) / seconds if seconds > 0 else 0.0

    def mbsu(self, draft_params: int, target_params: int) -> float:
        """Memory-bound speed-up: BE / (1 + L * N_draft / N_target), L = draft calls per step."""
        if not self.steps:
            return 0.0
        calls = self.draft_calls / self.steps
        return self.block_efficiency / (1 + calls * draft_params / target_params)

    def as_dict(self, draft_params: int | None = None, target_params: int | None = None) -> dict:
        out = {
            "steps": self.steps,
            "new_tokens": self.new_tokens,
            "shapes": dict(self.shapes_used()),  # steps per shape drafted, most used first
            "block_efficiency": self.block_efficiency,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_per_depth": self.acceptance_per_depth,
            "target_tokens_per_step": self.target_tokens / self.steps if self.steps else 0.0,
            "draft_calls_per_step": self.draft_calls / self.steps if self.steps else 0.0,
            "tokens_per_second": self.tokens_per_second,
            # time to the first token (the prompt read and the first step), and the rate after it
            "first_token_seconds": self.first_token_seconds,
            "tokens_per_second_after_first": self.tokens_per_second_after_first,
            # the counts other tools report (see the README): llama.cpp's draft_n / draft_n_accepted,
            # target forwards (tree verifications; the prompt's prefill not counted), and vLLM's
            # mean accepted length per forward, bonus token included (= block efficiency)
            "drafted_tokens": self.target_tokens - self.steps,
            "accepted_tokens": self.accepted,
            "target_forwards": self.steps,
            "mean_accepted_length": self.block_efficiency,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "forward_seconds": self.forward_seconds,
            "overhead_seconds": max(0.0, self.wall_seconds - self.forward_seconds),
            "wall_seconds": self.wall_seconds,
            # forwards on the CPU by their threads: fewer than cpu_threads where other processes held cores
            "forward_threads": {str(threads): n for threads, n in self.forward_threads.items()},
            "cpu_threads": self.cpu_threads,
        }
        if draft_params and target_params:
            out["mbsu"] = self.mbsu(draft_params, target_params)
        return out


@dataclass(frozen=True)
class Runtimes:
    """How the two models are executed: a `compiled.CompiledModel` runs one on the static-cache
    runtime (compiled or not), None on transformers' eager forward (`CachedLM`)."""

    target: object | None = None
    draft: object | None = None
    setting: str = "off"  # the --compile setting that chose them: "on" | "off" | "auto"

    def describe(self) -> str:
        target, draft = runtime_name(self.target), runtime_name(self.draft)
        return target if target == draft else f"target {target}, draft {draft}"


def runtime_name(runtime) -> str:
    """How one model runs: on a compiled.CompiledModel (which kind), or (None) transformers' eager forward."""
    if runtime is None:
        return "transformers eager"
    if runtime.graphed:
        return "static cache, compiled, CUDA graphs" if runtime.inductor else "static cache, CUDA graphs"
    if runtime.compiled:
        return "static cache, compiled"
    # (layers on quantised weights run as one call of rsd's C library each: compiled.NativeLayer)
    return "static cache, uncompiled, C layers" if runtime.native else "static cache, uncompiled"


def in_cpu_memory(model) -> bool:
    """Whether every weight of a model is in the CPU's memory (none on a GPU, none offloaded to disk)."""
    return all(p.device.type == "cpu" for p in model.parameters())


def on_the_cpu(runtime, model) -> bool:
    """Whether a model's forwards run on the CPU, every weight in its memory (runtime: its
    compiled.CompiledModel, None for transformers' forward)."""
    return in_cpu_memory(model) if runtime is None else runtime.device.type == "cpu"


@dataclass
class KeptCaches:
    """A finished generation's KV caches and the tokens they hold (see Decoder.keep_caches)."""

    target: object  # CachedLM or compiled.StaticLM
    draft: object | None  # the same kind; it holds a prefix of `tokens`
    tokens: list[int]  # what the target's cache holds, position by position
    owner: tuple  # (target model, draft model, runtimes) the caches belong to

    def release(self) -> None:
        for lm in (self.target, self.draft):
            if lm is not None:
                lm.release()


def logit_bias_beyond(sampling: SamplingParams, vocab_size: int) -> str | None:
    """What is wrong with a logit bias naming a token past the vocabulary; None where it names none."""
    beyond = [token for token, _ in sampling.logit_bias if token >= vocab_size]
    return (f"the logit bias names token id {beyond[0]}, but the models' vocabulary has {vocab_size} tokens "
            f"(ids 0-{vocab_size - 1})") if beyond else None


@dataclass
class QueuedPlain:
    """A plain step queued on the device (Decoder._queue_plain): its root's position, its drawn token
    (1,) still there, p, the function that reads the token on the host, and the target clock's
    marks before and after its forward."""
    base: int
    token: torch.Tensor
    p: torch.Tensor
    read: Callable[[], list]
    forwards: tuple[int, int]


@dataclass
class QueuedStep:
    """A chain or fan step queued on the device (Decoder._queue_chain, _queue_fan): what it leaves for
    the next step (root (1,), catch (2,), count (1,), base (1,): see fan_next), its event from its
    packed outcome once read — event(step, shape, seq, values) —, the function that reads that
    outcome on the host, the target's and the draft's clock marks before and after its forwards,
    and the host's seconds queueing it."""
    state: tuple
    event: Callable[..., StepEvent]
    read: Callable[[], list]
    forwards: tuple[int, int, int, int]
    queue_seconds: float


def check_prompt(prompt: list[int], context_length: int | None, vocab_size: int) -> None:
    """A prompt the models can read (else RsdError): not empty, shorter than the context, every id in
    the vocabulary (a tokenizer that does not fit the models: no forward could read it)."""
    if not prompt:
        raise RsdError("the prompt is empty")
    if context_length and len(prompt) >= context_length:
        raise RsdError(f"the prompt has {len(prompt)} tokens but the model's context holds {context_length}")
    if max(prompt) >= vocab_size:
        raise RsdError(f"the prompt holds token id {max(prompt)} but the models' vocabulary has "
                       f"{vocab_size} tokens: the tokenizer does not fit them")


def check_prompts(prompts: list[list[int]], context_length: int | None, vocab_size: int, source: str = "") -> None:
    """Every prompt of a list (--prompts, bench's, distill's) one the models can read, before any is
    answered (else RsdError naming which: "prompt 2 of 3: …", after `source` where given)."""
    for index, prompt in enumerate(prompts):
        try:
            check_prompt(prompt, context_length, vocab_size)
        except RsdError as e:
            raise RsdError(f"{source}{': ' if source else ''}prompt {index + 1} of {len(prompts)}: {e}") from None


class Decoder:
    """Runs one variant on a target / draft pair. Models are loaded once; caches per call, unless
    `keep_caches` is set: then a generation leaves its caches in `kept`, and a later generation
    given them (a chat's next answer, on a decoder of the same models and runtimes) reads only
    the part of its prompt they do not already hold. Reused keys and values are the ones the
    models computed for those tokens at those positions, so the output is still the target's."""

    def __init__(self, target, draft, vocab_size: int, shape: Shape, sampling: SamplingParams,
                 eos_ids: set[int], context_length: int | None = None, runtimes: Runtimes | None = None,
                 notice=lambda message: None):
        self.target_model = target
        self.draft_model = draft
        self.runtimes = runtimes or Runtimes()
        self.vocab_size = vocab_size
        self.shape = shape
        if beyond := logit_bias_beyond(sampling, vocab_size):  # (an index past the logits: a device-side assert on
            raise RsdError(beyond)  # a GPU)
        self.sampling = sampling
        self.eos_ids = eos_ids
        self.context_length = context_length
        self.long_from = long_factors_from(getattr(target, "config", None))  # (a `longrope` target's)
        self.policy = None  # auto.AutoShape for --variant auto: made at the first generate (it measures costs)
        self.keep_caches = False  # leave each generation's caches in `kept` instead of releasing them
        self.kept: KeptCaches | None = None  # caches a generation may start from (see the class docstring)
        self.ngrams: NgramIndex | None = None  # lookup's and auto's index of this generation's tokens
        self.notice = notice  # one line for the user (auto's first cost measurement)
        # `sd` chains and `rsd-c` root children drafted and decided on the device (_on_device): None
        # = where the target is not on the CPU (on a CPU a transfer costs nothing, while computing
        # every node's residual and every bonus draw does: 0.2-1.0 ms a step on a 2-core Xeon)
        self.device_steps: bool | None = None
        self.step_graphs: StepGraphs | None = None  # how device and plain steps run their maths (_maths)
        # each step queued before the outcome of the one before is read, for `ar` and `auto`'s plain steps
        # (_plain_steps_ahead), and `sd` chains and `rsd-c` fans decided on the device (_tree_steps_ahead):
        # None = where the target is not on the CPU (there nothing runs behind the host); RSD_STEPS_AHEAD=0:
        # never, one step at a time everywhere
        self.steps_ahead: bool | None = False if os.environ.get("RSD_STEPS_AHEAD", "1").strip() == "0" else None
        self._placed_constants: dict[tuple, tuple] = {}  # (_placed)
        self.answer_from = 0  # where the sequence's answer begins (_seen), set by each generation
        # what the models take where not every tree (pair_limit), and whether every step is then plain (a
        # model with a state: `auto`'s steps too)
        self.limit: tuple[Limit, str] | None = pair_limit(target, draft, self.runtimes)
        self.plain_only = self.limit is not None and self.limit[0].variants == ("ar",)

    def _next_shape(self, lag: int = 0, remaining: int | None = None, seq: list[int] = (), unread: int = 0) -> Shape:
        """This step's shape: the configured one, or auto's choice from the steps before it (lag:
        tokens the draft has not read yet; remaining: tokens the answer may still take; seq: the
        tokens so far, where auto looks for a lookup draft; unread: tokens drawn after seq that the
        host has not read yet — the continuation found is then expected to go on after them). A step
        emits at most its depth + 1 tokens: near the context's end it drafts no deeper than the tokens
        that still fit (its rows past the end would be verified for nothing; GPT-Neo's attention on
        transformers' forward failed on them before its tables of slots grew: slot_tables_cover)."""
        room = self.context_length - len(seq) - unread if self.context_length and seq else None
        if self.shape.variant != "auto":
            return self.shape if room is None else self.shape.within(room - 1)
        if self.plain_only:  # (a model with a state: no draft can be taken back)
            return PLAIN
        if room is not None:
            remaining = room if remaining is None else min(remaining, room)
        policy = self._auto_policy()
        n, continuation = self.ngrams.match(seq, policy.longest_lookup + unread) if seq else (0, [])
        return policy.next_shape(lag, remaining, lookup=(n, max(len(continuation) - unread, 0)))

    def prepare(self) -> None:
        """The one-off set-up a first generation needs: `auto`'s forward costs, measured once per
        machine (seconds on a first run). Callers that time generations run it first (complete), so
        the statistics of a first run on a machine give the generation's rate, not the measuring's."""
        if self.shape.variant == "auto" and not self.plain_only:
            self._auto_policy()

    def _auto_policy(self):
        """auto.AutoShape for --variant auto, made (its costs measured) at its first use."""
        if self.policy is None:
            from .auto import for_decoder

            self.policy = for_decoder(self, self.notice)
        return self.policy

    @property
    def greedy_ranking(self) -> bool:
        """A greedy target (p one-hot) is verified exactly whatever q is. Drafts without
        replacement then keep the draft's whole distribution to rank their candidates (top-k,
        beam search): a one-hot q would leave a single child per node. I.i.d. drafts (mss,
        spectr) would all be the mode anyway, so they keep the one-hot q of the same limit."""
        return self.sampling.greedy and self.shape.rule is Rule.WITHOUT_REPLACEMENT  # auto's shapes too

    @property
    def _ends(self) -> list[int]:
        """The tokens that end an answer (eos_ids) which the models' vocabulary holds, ascending: what
        min_tokens bars."""
        return [token for token in sorted(self.eos_ids) if token < self.vocab_size]

    @property
    def draft_sampling(self) -> SamplingParams:
        if self.greedy_ranking:  # (what bars or favours tokens still ranks the draft's candidates)
            return SamplingParams(logit_bias=self.sampling.logit_bias, min_tokens=self.sampling.min_tokens)
        return self.sampling

    def check_prompt(self, prompt: list[int]) -> None:
        check_prompt(prompt, self.context_length, self.vocab_size)

    def _threads_for(self, events: Iterator, drafts: bool) -> Iterator:
        """events, their steps' maths on one thread where every forward runs on the CPU, on threads the
        governor chooses (drafts: whether the draft's forwards run too); see threads.one_thread_maths."""
        used = [(self.runtimes.target, self.target_model)] + ([(self.runtimes.draft, self.draft_model)] if drafts else [])
        if all(on_the_cpu(runtime, model) for runtime, model in used if model is not None):
            return one_thread_maths(events)
        return events

    def takes(self, variant: str) -> bool:
        """Whether the models take this variant (limit_of): a tree only where they take one; `auto`
        always (it chooses among what they take)."""
        return self.limit is None or variant in self.limit[0].variants + ("auto",)

    def check_shape(self, how: str = "--variant") -> None:
        """A shape the models can take (takes), else the one line that refuses it (how: what sets
        the variant there)."""
        if not self.takes(self.shape.variant):
            raise RsdError(self.limit[0].refusal(self.shape.variant, self.limit[1], how))

    @property
    def drafts(self) -> bool:
        """Whether a generation runs the draft model (`auto` may choose shapes that do)."""
        return self.shape.uses_draft_model or (self.shape.variant == "auto" and not self.plain_only)

    def generate(self, prompt: list[int], max_tokens: int, seed: int | None = None) -> Iterator[StepEvent]:
        return self._threads_for(self._for_answers(max_tokens, self._generate(prompt, max_tokens, seed)), self.drafts)

    def _for_answers(self, max_tokens: int, steps: Iterator) -> Iterator:
        """steps, with `sampling` and `shape` for answers of at most max_tokens tokens while they run.
        A min_tokens that covers all of them (--ignore-eos) bars the end-of-sequence tokens at every
        position an answer reaches, as a logit bias of -inf on them does — the same processing there,
        without reading each node's context, so the steps that need none (on the device, queued ahead)
        stay open. (A tree's nodes past the answer's end are barred too; none of their tokens is
        emitted.) A step emits at most its depth + 1 tokens, so a tree deeper than max_tokens - 1
        drafts levels no answer reaches: the shape is cut to that depth (at least one level, so the
        variant stays what was asked), once for the whole answer — before any step, so that a seed's
        tokens do not depend on whether steps are queued ahead (`--draft-len 5000 -n 5` drafted 5000
        levels at every step: 4 minutes on the embedded pair)."""
        sampling, shape = self.sampling, self.shape
        if 0 < max_tokens <= sampling.min_tokens:
            bias = {**dict(sampling.logit_bias), **dict.fromkeys(self._ends, -math.inf)}
            self.sampling = replace(sampling, min_tokens=0, logit_bias=tuple(sorted(bias.items())))
        self.shape = shape.within(max(max_tokens - 1, 1))
        try:
            yield from steps
        finally:
            self.sampling, self.shape = sampling, shape

    def _generate(self, prompt: list[int], max_tokens: int, seed: int | None) -> Iterator[StepEvent]:
        self.check_prompt(prompt)
        self.check_shape()
        self.answer_from = len(prompt)  # (the presence and frequency penalties count the answer's tokens)
        self.prepare()  # (before this generation's caches hold a static-shape runtime's shared buffers)
        # static-cache buffers: room for the prompt, some answer and one tree; they double when full
        capacity = min(len(prompt) + min(max_tokens, 512), self.context_length or 2**31) + self.shape.max_nodes + 1
        drafts = self.drafts
        longest = {"lookup": self.shape.width, "auto": LOOKUP_NGRAM}.get(self.shape.variant)
        self.ngrams = NgramIndex(longest) if longest else None
        target, draft, held = self._reused(prompt, drafts)
        target = target or self._cache(self.target_model, self.runtimes.target, capacity)
        if drafts and draft is None:
            draft = self._cache(self.draft_model, self.runtimes.draft, capacity)
        # p, q and every draw live on the target's device, with a generator there (a seed gives
        # the same output on the same kind of device)
        generator = torch.Generator(device=target.device)
        generator.manual_seed(seed if seed is not None else fresh_seed())
        try:
            yield from self._steps(list(prompt), max_tokens, target, draft, generator, held)
        finally:
            caches = KeptCaches(target, draft, held, (self.target_model, self.draft_model, self.runtimes))
            # kept only between steps (an interrupted forward leaves a cache holding other tokens)
            if self.keep_caches and target.length == len(held) and (draft is None or draft.length <= len(held)):
                self.kept = caches
            else:  # a static-shape runtime's shared buffers go back to its model for the next generation
                caches.release()
            if self.policy is not None:  # what auto learnt, for the next run
                self.policy.save()

    def generate_together(self, prompts: list[list[int]], max_tokens: int, seeds: list[int],
                          ended: set[int] = frozenset()) -> Iterator[list[StepEvent | None]]:
        """Independent plain completions, one per seed, of its prompt in `prompts` (one each; equal
        prompts are read once, for all their completions), decoded together: each step is one target
        forward of every unfinished completion's last token (a row each, seeing its prompt and its
        own tokens only), then a draw per row with that completion's own generator. Yields, per
        step, each completion's event (a plain step's, as `generate` gives for `ar`) or None once it
        has finished. Where a forward of n tokens costs well under n of one (rsd's C layers on a
        CPU, any GPU), this is where extra rows pay most: every row's token is kept, where a draft's
        is accepted 41% of the time (the embedded pair at T=1).

        Each completion follows the target's distribution exactly, as alone: its draws are the
        uniforms its seed gives `generate` (`ar`), one a step, on its own row's probabilities. Its
        tokens are those `generate` gives for the seed wherever the forwards' logits agree to the
        bit; float rounding of a forward over other rows can differ, which flips a token only where
        two candidates tie that closely. What every prompt begins with is read once, then the rest of
        each prompt but its last token, one after the other (each seeing that beginning and itself,
        at its own positions); the first step reads each prompt's last token once. `ended`:
        completions the caller has ended (at a stop string), left out from the next step on."""
        return self._threads_for(self._for_answers(max_tokens, self._generate_together(prompts, max_tokens, seeds,
                                                                                       ended)), drafts=False)

    def crosses_long_factors(self, prompt: list[int], max_tokens: int) -> bool:
        """Whether an answer to `prompt` may have a step at or past a `longrope` target's long factors'
        start while the prompt's tokens but the last were read before it (long_factors_from): its
        caches are then read again on the way (_long_keys), one step at a time up to there (queued
        ahead after it, where steps are), and not with other completions (which share the keys of
        their prompts' beginning)."""
        return self.long_from is not None and len(prompt) - 2 < self.long_from <= len(prompt) + max_tokens - 2

    def _generate_together(self, prompts: list[list[int]], max_tokens: int, seeds: list[int],
                           ended: set[int]) -> Iterator[list[StepEvent | None]]:
        for prompt in prompts:
            self.check_prompt(prompt)
            if self.crosses_long_factors(prompt, max_tokens):
                raise RsdError(f"completions decoded together cannot go past position {self.long_from}, where the "
                               "target's `longrope` factors change: decode them one after the other")
        if self.limit is not None:  # (each row sees its own prompt, at slots that are not its positions)
            raise RsdError(f"completions decoded together need attention by rsd's masks, not {self.limit[1]}")
        if self.kept is not None:  # (a generation's kept caches: this one reads the prompt afresh)
            self.kept.release()
            self.kept = None
        count = len(seeds)
        distinct = list(dict.fromkeys(tuple(prompt) for prompt in prompts))  # in order of first use
        group = [distinct.index(tuple(prompt)) for prompt in prompts]  # each completion's prompt
        capacity = sum(map(len, distinct)) + count * min(max_tokens, 128) + count + 1  # (grows as answers do)
        target = self._cache(self.target_model, self.runtimes.target, capacity)
        generators = []
        for seed in seeds:
            generator = torch.Generator(device=target.device)
            generator.manual_seed(seed)
            generators.append(generator)
        seqs = [list(prompt) for prompt in prompts]
        produced, active = [0] * count, list(range(count))
        sight = torch.zeros(count, capacity, dtype=torch.bool)  # [completion, cache slot]: what its rows see
        shape = make_shape("ar")
        sums = None  # (inverse_cdf's scratch: the rows' cumulative sums, kept from step to step)
        try:
            before = target.forward_seconds
            # what every prompt begins with (a chat template's system prompt) is read once, then the rest of
            # each prompt but its last token, seeing that beginning and itself only
            common = min(min(shared_prefix(distinct[0], prompt) for prompt in distinct),
                         min(len(prompt) for prompt in distinct) - 1)
            if self.long_from is not None and max(map(len, distinct)) - 2 >= self.long_from:
                common = 0  # (a `longrope` prompt read past its long factors' start turns that beginning by them)
            if common:
                target.extend(list(distinct[0][:common]), reading=True)
            read = []  # [prompt]: the cache slots of its own tokens but the last
            for prompt in distinct:
                past, n = target.length, len(prompt) - 1 - common
                if n:
                    visible = torch.zeros(n, past + n, dtype=torch.bool)
                    visible[:, :common] = True
                    visible[:, past:] = torch.arange(n)[:, None] >= torch.arange(n)
                    target.forward(list(prompt[common:-1]), list(range(common, common + n)), visible, last_only=True,
                                   reading=True)
                read.append(range(past, past + n))
            sight[:, :common] = True
            for j in range(count):
                sight[j, read[group[j]]] = True
            prefill = target.forward_seconds - before
            step = 0
            while active:
                step += 1
                start, before = time.perf_counter(), target.forward_seconds
                first = step == 1
                # the first step: each prompt's last token, read once for all its completions
                rows = [group.index(g) for g in range(len(distinct))] if first else active
                base = target.length
                if base + len(rows) > sight.shape[1]:
                    sight = torch.cat([sight, torch.zeros(count, sight.shape[1], dtype=torch.bool)], dim=1)
                own = torch.eye(len(rows), dtype=torch.bool)
                visible = torch.cat([sight[rows, :base], own], dim=1)
                logits = target.forward([seqs[j][-1] for j in rows], [len(seqs[j]) - 1 for j in rows], visible)
                if first:
                    logits = logits[group]  # (each completion its prompt's row)
                    sight[torch.arange(count), torch.tensor([base + g for g in group])] = True
                else:
                    for r, j in enumerate(rows):
                        sight[j, base + r] = True
                context = {}
                if self.sampling.uses_context:  # (each row's own context, as a plain step's)
                    each = [self._seen(self.sampling, seqs[j], DraftTree.rooted_at(seqs[j][-1]), [0], logits.device,
                                       len(prompts[j])) for j in active]
                    context = {key: torch.cat([row[key] for row in each]) for key in each[0]}
                p = logits_to_probs(logits, self.sampling, **context)
                u = torch.cat([row_uniforms(1, generators[j], generators[j].device) for j in active])
                if sums is None or sums.shape[0] < p.shape[0]:
                    sums = torch.empty(p.shape, dtype=torch.float64, device=p.device)
                tokens = to_host(inverse_cdf(p, u, sums[: p.shape[0]]))
                forward = target.forward_seconds - before + (prefill if first else 0.0)
                events: list[StepEvent | None] = [None] * count
                for r, j in enumerate(active):
                    event = StepEvent(  # (p: a copy of its row, not a view keeping all the step's rows alive)
                        step=step, shape=shape, tree=DraftTree.rooted_at(seqs[j][-1]), p=p[r: r + 1].clone(),
                        checks=[], path=[], extra_token=tokens[r], extra_kind="bonus", emitted=[], draft_calls=0,
                        draft_seconds=0.0, verify_seconds=time.perf_counter() - start, forward_seconds=forward)
                    produced[j] += self._emit(event, seqs[j], max_tokens - produced[j])
                    events[j] = event
                yield events
                active = [j for j in active if not events[j].finished and j not in ended]
        finally:
            target.release()

    def unread(self, prompt: list[int]) -> int:
        """How many of the prompt's tokens the target still has to read: all, unless the caches
        kept from the last generation hold its beginning (see _reused)."""
        return len(prompt) - (self._kept_prefix(prompt) or 0)

    def _kept_prefix(self, prompt: list[int]) -> int | None:
        """How many of the prompt's first tokens `kept` holds (the last one is read by the first
        step); None where nothing is kept for these models and runtimes."""
        kept = self.kept
        if kept is None or kept.owner != (self.target_model, self.draft_model, self.runtimes):
            return None
        if kept.target.turned_long and len(prompt) - 2 < self.long_from:
            return None  # (keys a `longrope` target turned by its long factors, where this prompt's are short)
        return shared_prefix(kept.tokens, prompt[:-1])

    def _reused(self, prompt: list[int], drafts: bool) -> tuple:
        """(target cache, draft cache or None, the tokens the target's holds) from `kept`, cut to the
        beginning they share with this prompt; Nones and [] where nothing is kept for these models
        and runtimes."""
        common = self._kept_prefix(prompt)
        kept, self.kept = self.kept, None
        if common is None:
            if kept is not None:
                kept.release()
            return None, None, []
        kept.target.keep(list(range(common)))
        draft = kept.draft
        if draft is not None and not drafts:
            draft.release()
            draft = None
        if draft is not None:
            draft.keep(list(range(min(common, draft.length))))
        return kept.target, draft, kept.tokens[:common]

    def _steps(self, seq: list[int], max_tokens: int, target, draft, generator: torch.Generator,
               held: list[int]) -> Iterator[StepEvent]:
        """generate's loop on its caches; seq (the prompt) grows by each step's tokens, `held` is kept
        equal to the tokens the target's cache holds."""
        before = target.forward_seconds
        if len(seq) - 1 > target.length:  # (a kept cache may hold the prompt's beginning already)
            target.extend(seq[target.length: -1], reading=True)
        held[:] = seq[:-1]
        self._long_keys(seq, target, draft, held)
        prefill_seconds = target.forward_seconds - before  # reported with the first step's forwards
        kind = self._ahead_kind(target, draft)
        # (one step at a time where the caches are to be read again on the way, up to there: _long_keys)
        crossing = self.crosses_long_factors(seq, max_tokens)
        if kind is not None and not crossing:
            yield from self._ahead(kind, seq, max_tokens, target, draft, generator, held, prefill_seconds)
            return
        produced = 0
        step = 0
        while produced < max_tokens:
            step += 1
            before = target.forward_seconds
            self._long_keys(seq, target, draft, held)
            read_again = target.forward_seconds - before
            if kind is not None and len(seq) - 1 >= self.long_from:  # (past the start, read again: queued ahead)
                yield from self._ahead(kind, seq, max_tokens - produced, target, draft, generator, held,
                                       read_again + (prefill_seconds if step == 1 else 0.0), first_step=step)
                return
            lag = len(seq) - draft.length if draft is not None else 0
            event = self._step(step, self._next_shape(lag, max_tokens - produced, seq), seq, target, draft, generator)
            produced += self._settle(event, seq, held, max_tokens - produced)
            event.forward_seconds += read_again + (prefill_seconds if step == 1 else 0.0)
            yield event
            if event.finished:
                return

    def _ahead(self, kind: str, seq: list[int], max_tokens: int, target, draft, generator: torch.Generator,
               held: list[int], prefill_seconds: float, first_step: int = 1) -> Iterator[StepEvent]:
        """_steps queued ahead (_ahead_kind's kind), its steps counted from `first_step`."""
        if kind == "plain":
            return self._plain_steps_ahead(seq, max_tokens, target, draft, generator, held, prefill_seconds, first_step)
        return self._tree_steps_ahead(kind, seq, max_tokens, target, draft, generator, held, prefill_seconds,
                                      first_step)

    def _settle(self, event: StepEvent, seq: list[int], held: list[int], remaining: int) -> int:
        """What a step emits, at most `remaining` tokens and up to an end-of-sequence token: sets
        event.emitted and event.finished, appends the tokens to seq and returns how many; `held`
        becomes the tokens the target's cache holds (seq before them, and the accepted path)."""
        held[:] = seq + [event.tree.tokens[n] for n in event.path]  # the root and the accepted path
        if self.policy is not None:
            self.policy.observe(event)
        return self._emit(event, seq, remaining)

    def _emit(self, event: StepEvent, seq: list[int], remaining: int) -> int:
        """_settle's tokens: event.emitted and event.finished set, the tokens appended to seq. A step
        before a `longrope` target's long factors' start emits none past it (_long_keys)."""
        room = self._room(remaining, seq)
        emitted = [event.tree.tokens[n] for n in event.path] + [event.extra_token]
        if self.long_from is not None and len(seq) - 1 < self.long_from:
            emitted = emitted[: self.long_from + 1 - len(seq)]
        if len(emitted) >= room:
            event.finished = "length" if room == remaining else "context"
            emitted = emitted[:room]
        for i, token in enumerate(emitted):
            if token in self.eos_ids:
                emitted, event.finished = emitted[: i + 1], "eos"
                break
        event.emitted = emitted
        seq.extend(emitted)
        return len(emitted)

    def _long_keys(self, seq: list[int], target, draft, held: list[int]) -> None:
        """Before a step whose root (seq's last token) is at or past a `longrope` target's long factors'
        start while its cache holds keys turned by the short factors (long_factors_from): the target's
        cache (and a `longrope` draft's) reads seq again in one forward, its root included and then
        dropped — turned by the long factors, as transformers' generate reads it there; another draft
        keeps the tokens of seq it holds (a step before that start may have emitted fewer than it
        verified: _emit)."""
        if self.long_from is None or len(seq) - 1 < self.long_from or not target.turned_short:
            return
        for cache in (target, draft):
            if cache is None:
                continue
            if getattr(cache, "long_from", None) is not None:
                cache.keep([])
                cache.extend(seq, reading=True)
            cache.keep(list(range(min(cache.length, len(seq) - 1))))
        held[:] = seq[:-1]

    def _room(self, remaining: int, seq: list[int]) -> int:
        """How many tokens the answer may still take: `remaining`, or fewer where the context ends."""
        return min(remaining, self.context_length - len(seq)) if self.context_length else remaining

    def _ahead_kind(self, target, draft) -> str | None:
        """Whether this generation queues each step ahead, where `steps_ahead` asks for it (by default
        off the CPU): "plain" for `ar` and `auto`'s plain steps (_plain_steps_ahead), "chain" for
        `sd` and "fan" for `rsd-c` with root children only (the device steps of _on_device:
        _tree_steps_ahead) on static-shape caches whose buckets hold its forwards; sampling that
        does not depend on the context; else None."""
        wanted = self.steps_ahead if self.steps_ahead is not None else target.device.type != "cpu"
        if not wanted or self.sampling.uses_context or self.plain_only:  # (a state read ahead is read afresh)
            return None
        if self.shape.variant in ("ar", "auto"):
            return "plain"
        kind = self._on_device(self.shape, draft, target.device)
        if kind in (None, "lookup"):  # (a lookup chain is looked up in the tokens read: one step at a time)
            return None
        from .compiled import StaticLM, bucket

        fits = (isinstance(target, StaticLM) and isinstance(draft, StaticLM) and target.static and draft.static
                and not target.by_position and not draft.by_position  # (masks by the slots' positions: on the host)
                and bucket(self._drafted(kind) + 1, target.compiled.buckets) is not None
                and {1, 2} <= set(draft.compiled.buckets))
        return kind if fits else None

    def _drafted(self, kind: str) -> int:
        """How many tokens a step of this kind drafts: a fan's children, a chain's levels."""
        return min(self.shape.branching[0], self.vocab_size) if kind == "fan" else self.shape.depth

    def _tree_steps_ahead(self, kind: str, seq: list[int], max_tokens: int, target, draft,
                          generator: torch.Generator, held: list[int], prefill_seconds: float,
                          first_step: int = 1) -> Iterator[StepEvent]:
        """_steps for an `sd` chain or an `rsd-c` fan of root children on a device that runs behind
        the host (a GPU), as _plain_steps_ahead runs `ar`: everything a step needs from the one
        before — its root, its position, what the draft reads first, a fan's accepted child's move in
        the target's cache — is worked out on the device (chain_next, fan_next), and the forwards'
        inputs are made there (placed_inputs), so each step is queued before the outcome of the one
        before is read. The host reads a step's outcome (one transfer) while the device runs the
        next, and knows what the caches hold one step late: it sets their lengths when it stops.
        The uniforms are drawn in the order of one step at a time; the draft reads one token or two
        in a forward of two rows (one step at a time: of one or two), so q may differ in its last
        bits, and the tokens with it where two candidates tie that closely. A step queued past the
        end is dropped. Its steps are counted from `first_step` (after steps one at a time)."""
        shape, device = self.shape, target.device
        queue = self._queue_fan if kind == "fan" else self._queue_chain
        advance = 1 + shape.depth  # the most one step moves the root
        seconds_before_prefill = draft.forward_seconds
        if draft.length < len(seq) - 1:  # (the prompt, the first time: the steps read the root themselves)
            draft.extend(seq[draft.length: -1])
        draft_prefill = draft.forward_seconds - seconds_before_prefill
        prefill_seconds += draft_prefill
        draft_holds = len(seq) - 1  # what the draft's cache holds, as far as the host knows
        self._fits_ahead(kind, len(seq) - 1, target, draft, grow=True)
        state = (to_device([seq[-1]], device), to_device([seq[-1], 0], device), to_device([1], device),
                 to_device([len(seq) - 1], device))
        produced, step = 0, first_step - 1
        queued = queue(shape, state, target, draft, generator)
        since = time.perf_counter()  # (a step's host time: from the generator's resumption, the consumer's left out)
        try:
            while queued is not None:
                step += 1
                current, queued = queued, None
                # (this step emits a token or more: the next one follows unless this one ends the answer)
                ahead = self._room(max_tokens - produced, seq) > 1 and \
                    self._fits_ahead(kind, len(seq) - 1 + advance, target, draft)
                if ahead:
                    queued = queue(shape, current.state, target, draft, generator)
                queued_seconds = queued.queue_seconds if queued is not None else 0.0
                event = current.event(step, shape, seq, current.read())  # (its one transfer)
                before, after, draft_before, draft_after = current.forwards
                event.draft_forward_seconds = draft.clock.seconds_through(draft_after) - \
                    draft.clock.seconds_through(draft_before)
                event.forward_seconds = event.draft_forward_seconds + target.clock.seconds_through(after) - \
                    target.clock.seconds_through(before)
                event.draft_calls = draft_after - draft_before
                event.draft_seconds = current.queue_seconds  # (its verification: waiting for it, then its event)
                event.verify_seconds = max(time.perf_counter() - since - queued_seconds, 0.0)
                draft_holds = len(seq) + min(len(event.path), shape.depth - 1)  # (it read the accepted drafts)
                produced += self._settle(event, seq, held, max_tokens - produced)
                if step == first_step:
                    event.forward_seconds += prefill_seconds
                    event.draft_forward_seconds += draft_prefill
                if event.finished:
                    queued = None  # (a step queued after an end-of-sequence token: dropped)
                elif not ahead:  # (room in the caches first: they grow as far as the host knows what they hold)
                    target.keep(list(range(len(held))))
                    draft.keep(list(range(draft_holds)))
                    self._fits_ahead(kind, len(seq) - 1, target, draft, grow=True)
                    queued = queue(shape, current.state, target, draft, generator)
                yield event
                since = time.perf_counter()
        finally:  # the caches hold the tokens of the steps read, whatever was queued after them
            target.keep(list(range(len(held))))
            draft.keep(list(range(draft_holds)))

    def _fits_ahead(self, kind: str, base: int, target, draft, grow: bool = False) -> bool:
        """Whether a step with its root at position `base` writes within both caches (the target's
        verifying forward at slots base .. base + its bucket, the draft's what it missed and its
        levels up to base + max(2, depth)); with `grow`, grow them to fit (their lengths, which
        growing copies up to, set first)."""
        from .compiled import bucket

        needs = (base + bucket(self._drafted(kind) + 1, target.compiled.buckets), base + max(2, self.shape.depth))
        if grow:
            for cache, needed in zip((target, draft), needs):
                if needed > cache.capacity:
                    cache._grow(needed)
        return needs[0] <= target.capacity and needs[1] <= draft.capacity

    def _placed(self, cache, depths: list[int], sights: list[int]) -> tuple:
        """(key, (arange(capacity), depths, sights)) on the cache's device, for placed_inputs: made once
        per capacity and tree, and read by the maths of a site keyed by `key` as constants (a graph
        captures their addresses; host values are not copied in while a graph is captured: StepGraphs
        keeps them with the graph, which may outlive this decoder)."""
        key = (cache.capacity, tuple(depths), tuple(sights))
        made = self._placed_constants.get(key)
        if made is None:
            device = cache.device
            made = (torch.arange(cache.capacity, device=device), torch.tensor(depths, device=device),
                    torch.tensor(sights, device=device))
            self._placed_constants[key] = made
        return key, made

    def _read_catch(self, state: tuple, draft, maths) -> torch.Tensor:
        """The draft's forward of what it has not read (state's catch: one token or two, see
        fan_next) in two rows at their positions: its (2, V) logits, the row after the root at
        state's count - 1."""
        _, catch, count, base = state
        key, (columns, depths, sights) = self._placed(draft, [0, 1], [0, 1])
        ids, mask = maths(("catch inputs", key), lambda base, catch, count:
                          placed_inputs(columns, base + 1 - count, catch, depths, sights), base, catch, count)
        return draft.forward_placed(ids, mask, slice(0, 2))

    def _verify_placed(self, state: tuple, drafted: torch.Tensor, depths: list[int], sights: list[int], target,
                       maths) -> torch.Tensor:
        """The target's forward of the root and the drafted tokens, from inputs made on the device: the
        root at depth 0 seeing the prefix, each drafted token at its depth seeing the cache up to its
        sight (see placed_inputs: a fan's children see up to the root, a chain's each token before
        it) and itself; its (1 + drafted, V) logits."""
        from .compiled import bucket

        root, _, _, base = state
        n = 1 + drafted.shape[0]
        size = bucket(n, target.compiled.buckets)
        key, (columns, depth_row, sight_row) = self._placed(target, [0] + depths + [depths[-1]] * (size - n),
                                                            [0] + sights + [-1] * (size - n))
        ids, mask = maths(("tree inputs", key), lambda base, root, drafted:
                          placed_inputs(columns, base, tree_tokens(size, root, drafted), depth_row, sight_row),
                          base, root, drafted)
        return target.forward_placed(ids, mask, slice(0, n))

    def _queue_fan(self, shape: Shape, state: tuple, target, draft, generator: torch.Generator) -> "QueuedStep":
        """A fan step's work on the device from what the step before left (state: see fan_next): the
        draft's forward of what it has not read, the children, the target's forward of the root and
        children, the verdict, the accepted child's move in the target's cache, and the packed
        outcome's copy to the host queued. Nothing is read on the host."""
        start, maths, marks = time.perf_counter(), self._maths(target), (target.clock.count, draft.clock.count)
        k, children, verdict = self._fan_maths(shape)
        greedy, draft_sampling, sampling = self.greedy_ranking, self.draft_sampling, self.sampling
        u = torch.rand(self._fan_uniforms(k), generator=generator, dtype=torch.float64, device=generator.device)
        logits = self._read_catch(state, draft, maths)
        q, drafted, drawn = maths(("fan children from two rows", k, greedy, draft_sampling),
                                  lambda rows, count, u: children(rows.index_select(0, count - 1), u),
                                  logits, state[2], u)
        logits = self._verify_placed(state, drafted, [1] * k, [0] * k, target, maths)

        def verdict_and_next(logits, q, drafted, drawn, u, base) -> tuple:
            p, packed = verdict(logits, q, drafted, drawn, u)
            return p, packed, *fan_next(k, packed, base)

        p, packed, *after, source, destination = maths(("fan verdict and next", k, greedy, sampling), verdict_and_next,
                                                       logits, q, drafted, drawn, u, state[3])
        target.copy_slot(source, destination)
        read = to_host_soon(packed)  # (queued before the next step's replays overwrite packed)
        p, q = maths.keep(p), maths.keep(q)
        return self._queued(after, partial(self._fan_event, p=p, q=q), read, target, draft, start, marks)

    @staticmethod
    def _queued(after: list, event: Callable[..., StepEvent], read: Callable[[], list], target, draft, start: float,
                marks: tuple[int, int]) -> QueuedStep:
        """The QueuedStep of a step whose queueing began at `start`, when the target's and the draft's
        clocks stood at `marks`: their marks now close its forwards."""
        return QueuedStep(tuple(after), event, read, (marks[0], target.clock.count, marks[1], draft.clock.count),
                          time.perf_counter() - start)

    def _queue_chain(self, shape: Shape, state: tuple, target, draft, generator: torch.Generator) -> "QueuedStep":
        """A chain step's work on the device from what the step before left (state: see chain_next),
        as _queue_fan queues a fan's: the draft's forward of what it has not read, then each level's
        draw and the draft's forward of it, the target's forward of the root and the drafts, the
        verdict and the packed outcome's copy to the host."""
        start, maths, marks = time.perf_counter(), self._maths(target), (target.clock.count, draft.clock.count)
        gamma, draws, draw, verdict = self._chain_maths(shape)
        greedy, draft_sampling, sampling = self.greedy_ranking, self.draft_sampling, self.sampling
        u = torch.rand(draws + 2 * gamma + 1, generator=generator, dtype=torch.float64, device=generator.device)
        logits = self._read_catch(state, draft, maths)
        key, (columns, zero, _) = self._placed(draft, [0], [0])
        q_rows, drafted = [], []
        for index in range(gamma):
            if index == 0:  # (its logits the row after the root: the draft read one token or two)
                q, token = maths(("chain first level from two rows", greedy, draft_sampling),
                                 lambda rows, count, u: draw(rows.index_select(0, count - 1), u),
                                 logits, state[2], u[:1, None])
            else:
                q, token = maths(("chain level", index, greedy, draft_sampling), draw, logits, u[index: index + 1, None])
            q_rows.append(q)
            drafted.append(token)
            if index + 1 < gamma:  # (the draft reads its draw at the next position)
                ids, mask = maths(("level inputs", index, key), lambda base, token, index=index:
                                  placed_inputs(columns, base + 1 + index, token, zero, zero), state[3], token)
                logits = draft.forward_placed(ids, mask, slice(0, 1))
        drafted = torch.cat(drafted)
        logits = self._verify_placed(state, drafted, list(range(1, gamma + 1)), list(range(1, gamma + 1)),
                                     target, maths)

        def verdict_and_next(logits, drafted, u, base, *q_rows) -> tuple:
            p, packed = verdict(logits, drafted, u, *q_rows)
            return p, packed, *chain_next(gamma, packed, base)

        p, packed, *after = maths(("chain verdict and next", gamma, greedy, sampling), verdict_and_next, logits,
                                  drafted, u, state[3], *q_rows)
        read = to_host_soon(packed)
        p, q_rows = maths.keep(p), [maths.keep(q)[0] for q in q_rows]
        return self._queued(after, partial(self._chain_event, p=p, q_rows=q_rows), read, target, draft, start, marks)

    def _plain_steps_ahead(self, seq: list[int], max_tokens: int, target, draft, generator: torch.Generator,
                           held: list[int], prefill_seconds: float, first_step: int = 1) -> Iterator[StepEvent]:
        """_steps for `ar` and `auto` on a device that runs behind the host (a GPU): each plain step's
        forward and draw are queued from the token before it while that token is still on the
        device, before the host reads it. The host's work on a step (reading its token, its event,
        what the consumer does with it) then overlaps the device's next forward instead of leaving
        the device idle. The uniforms are drawn in the order of one step at a time, so `ar`'s tokens
        and events are the same. For `auto` the shape of the step after a plain one is chosen before
        that token is read, from the steps before it: its choices lag one step there, and a lookup
        chain is weighed on what followed the sequence without that token (its chain is looked up
        once the token is known). A shape fixed from earlier steps alone keeps the output exactly the
        target's (see auto). Drafting steps run one at a time. A plain step queued past the end (after
        an end-of-sequence token, or for a consumer that stops) is dropped from the cache, which then
        holds `held` again. Its steps are counted from `first_step` (after steps one at a time)."""
        produced, step, since = 0, first_step - 1, time.perf_counter()
        queued = None  # a plain step queued before the token of the one before was read
        chosen = None  # the next step's shape, where it was chosen before the last token was read

        def lag(ahead: int = 0) -> int:  # tokens the draft has yet to read (`ahead` more still on the device)
            return len(seq) + ahead - draft.length if draft is not None else 0

        try:
            while produced < max_tokens:
                step += 1
                if queued is not None:
                    current, shape, queued = queued, chosen, None
                else:
                    shape = chosen if chosen is not None else self._next_shape(lag(), max_tokens - produced, seq)
                    current = None if shape.depth else self._queue_plain([seq[-1]], len(seq) - 1, target, generator)
                chosen = None
                if current is None:  # a drafting step
                    event = self._step(step, shape, seq, target, draft, generator)
                else:
                    if self._room(max_tokens - produced, seq) > 1:  # (this step emits one token)
                        chosen = self._next_shape(lag(1), max_tokens - produced - 1, seq, unread=1)
                        if not chosen.depth:
                            queued = self._queue_plain(current.token, current.base + 1, target, generator)
                    event = self._plain_event(step, shape, seq, current, target, since)
                produced += self._settle(event, seq, held, max_tokens - produced)
                if step == first_step:
                    event.forward_seconds += prefill_seconds
                if event.finished and queued is not None:  # an end-of-sequence token
                    target.keep(list(range(len(held))))
                    queued = None
                yield event
                if event.finished:
                    return
                since = time.perf_counter()  # (a step's host time: the consumer's left out)
        finally:
            if queued is not None:  # a consumer that stopped reading
                target.keep(list(range(len(held))))

    def _cache(self, model, runtime, capacity: int):
        if runtime is None:
            return CachedLM(model, self.vocab_size)
        from .compiled import StaticLM

        return StaticLM(runtime, self.vocab_size, capacity)

    def _on_device(self, shape: Shape, draft, device: torch.device) -> str | None:
        """Whether this step's tree is decided on the device with one transfer at its end: "chain"
        for an `sd` chain (_chain_step), "fan" for `rsd-c` root children (_fan_step), drafted by
        the draft model with sampling that does not depend on each position's context, where
        `device_steps` asks for it (by default off the CPU), and "lookup" for a lookup chain
        (_lookup_step: no draft model, its q one-hot); else None."""
        wanted = self.device_steps if self.device_steps is not None else device.type != "cpu"
        if not wanted or shape.depth == 0 or self.sampling.uses_context:
            return None
        if shape.variant == "lookup":
            return "lookup"
        if draft is None or self.draft_sampling.uses_context:
            return None
        if shape.variant == "sd":
            return "chain"
        return "fan" if shape.variant == "rsd-c" and shape.depth == 1 else None

    @staticmethod
    def _draft_catch_up(seq: list[int], draft, device: torch.device) -> torch.Tensor:
        """The draft's catch-up on the sequence (accepted tokens it never saw, and the root): its
        (1, V) logits after the root, on `device`."""
        return draft.extend(seq[draft.length:])[-1:].to(device)

    def _fan_step(self, step: int, shape: Shape, seq: list[int], target, draft,
                  generator: torch.Generator) -> StepEvent:
        """An `rsd-c` step with b root children (depth 1) as _chain_step runs a chain: the children
        drawn on the device (Gumbel-top-b, or the draft's top b for a greedy target) and fed from
        there to the target's forward, decided at once (verification.fan_outcome), one transfer."""
        started = self._device_step_started(target, draft)
        device, base, maths = generator.device, len(seq) - 1, self._maths(target)
        k, children, verdict = self._fan_maths(shape)
        u = torch.rand(self._fan_uniforms(k), generator=generator, dtype=torch.float64, device=device)
        logits = self._draft_catch_up(seq, draft, device)
        q, drafted, drawn = maths(("fan children", k, self.greedy_ranking, self.draft_sampling), children, logits, u)
        drafted_at = time.perf_counter()
        # the root sees the prefix; each child the prefix, the root and itself
        visible = torch.zeros(k + 1, base + k + 1, dtype=torch.bool)
        visible[:, : base + 1] = True
        visible[1:, base + 1:] = torch.eye(k, dtype=torch.bool)
        logits = target.forward(torch.cat([to_device([seq[-1]], device), drafted]), [base] + [base + 1] * k,
                                visible)
        p, packed = maths(("fan verdict", k, self.greedy_ranking, self.sampling), verdict, logits, q, drafted, drawn, u)
        p, q = maths.keep(p), maths.keep(q)
        event = self._fan_event(step, shape, seq, to_host(packed), p, q)  # the step's one transfer
        target.keep(list(range(base)) + [base + n for n in [0] + event.path])
        draft.keep(list(range(len(seq))))  # (the children are leaves: the draft never read them)
        return self._device_step_timed(event, target, draft, started, drafted_at)

    @staticmethod
    def _device_step_started(target, draft) -> tuple:
        """What _device_step_timed counts a device step's numbers from: the host's clock, both models'
        forward seconds, the draft's seconds and calls."""
        return (time.perf_counter(), target.forward_seconds + draft.forward_seconds, draft.forward_seconds,
                draft.calls)

    @staticmethod
    def _device_step_timed(event: StepEvent, target, draft, started: tuple, drafted_at: float) -> StepEvent:
        """A device step's event with its draft calls and timings since `started` (drafted_at: when its
        drafts were queued)."""
        start, forward_before, draft_before, calls_before = started
        event.draft_calls = draft.calls - calls_before
        event.draft_seconds, event.verify_seconds = drafted_at - start, time.perf_counter() - drafted_at
        event.forward_seconds = target.forward_seconds + draft.forward_seconds - forward_before
        event.draft_forward_seconds = draft.forward_seconds - draft_before
        return event

    def _fan_uniforms(self, k: int) -> int:
        """How many uniforms a fan step draws, at once: the Gumbel noise (V, unless greedy), an
        acceptance for each child (k), then the correction's and each bonus's draw (k + 1)."""
        return (0 if self.greedy_ranking else self.vocab_size) + 2 * k + 1

    def _fan_maths(self, shape: Shape) -> tuple:
        """(k, children, verdict) of a fan step: its b root children (at most the vocabulary), and
        the pure functions of its maths — children: (1, V) draft logits, u -> q (1, V), drafted (k,),
        drawn (k,); verdict: (k + 1, V) target logits, q, drafted, drawn, u -> p, and (drafted,
        drawn, accepted, correction, bonus) packed in one tensor."""
        k = min(shape.branching[0], self.vocab_size)
        greedy, draft_sampling, sampling = self.greedy_ranking, self.draft_sampling, self.sampling
        noise = 0 if greedy else self.vocab_size

        def children(logits: torch.Tensor, u: torch.Tensor) -> tuple:
            q = logits_to_probs(logits, draft_sampling)
            if greedy:
                top = torch.topk(q[0], k)
                return q, top.indices, top.values > 0
            top = torch.topk(q[0].double().log() + gumbel_of(u[:noise]), k)
            return q, top.indices, torch.isfinite(top.values)

        def verdict(logits, q, drafted, drawn, u) -> tuple:
            p = logits_to_probs(logits, sampling)  # (k + 1, V): the root's row, then each child's
            accepted, correction, bonus = fan_outcome(p, q[0], drafted, drawn, u[noise: noise + k],
                                                      u[noise + k:, None])
            return p, torch.cat([drafted, drawn.long(), accepted.long(), correction, bonus])

        return k, children, verdict

    def _fan_event(self, step: int, shape: Shape, seq: list[int], values: list[int], p: torch.Tensor,
                   q: torch.Tensor) -> StepEvent:
        """A fan step's event from its packed values (see _fan_maths), p and q; its counts and
        timings are the caller's to fill in."""
        k = (len(values) - 1) // 4
        tokens, drawn = values[:k], values[k: 2 * k]
        accepted, correction, bonus = values[2 * k: 3 * k], values[3 * k], values[3 * k + 1:]
        tree = DraftTree.rooted_at(seq[-1])
        tree.q[0] = q[0]
        tried = [token for token, was in zip(tokens, drawn) if was]
        for token in tried:
            tree.add_draw(0, token)
        first = next((i for i, hit in enumerate(accepted[: len(tried)]) if hit), None)
        decision = Decision(first, len(tried) if first is None else first + 1, None if first is not None else correction)
        checks = [NodeCheck(0, list(range(1, len(tried) + 1)), decision, (p[0], q[0], tried, shape.rule))]
        path = [] if first is None else [first + 1]
        extra, kind = (correction, "correction") if first is None else (bonus[first], "bonus")
        return StepEvent(
            step=step, shape=shape, tree=tree, p=p[: len(tree)], checks=checks, path=path,
            extra_token=extra, extra_kind=kind, emitted=[], draft_calls=1, draft_seconds=0.0,
            verify_seconds=0.0, forward_seconds=0.0, draft_forward_seconds=0.0,
        )

    def _chain_step(self, step: int, shape: Shape, seq: list[int], target, draft,
                    generator: torch.Generator) -> StepEvent:
        """An `sd` step with nothing read on the host until its end: each drafted token is drawn
        on the device and fed from there to the draft's next level and to the target's verifying
        forward, every node is decided at once (verification.chain_outcome), and one transfer
        brings the drafts, decisions, corrections and bonus back. On a GPU the host then queues
        the target's forward while the draft's runs, instead of waiting for the drafts first, and
        a step makes one synchronisation instead of one per level and per tried node. The tree
        and the caches end as `_step` leaves them (a chain: both caches keep a prefix)."""
        started = self._device_step_started(target, draft)
        device, base, maths = generator.device, len(seq) - 1, self._maths(target)
        gamma, draws, draw, verdict = self._chain_maths(shape)
        greedy, draft_sampling, sampling = self.greedy_ranking, self.draft_sampling, self.sampling
        u = torch.rand(draws + 2 * gamma + 1, generator=generator, dtype=torch.float64, device=device)
        logits = self._draft_catch_up(seq, draft, device)
        q_rows, drafted = [], []
        for index in range(gamma):  # (greedy: its uniform, an acceptance's, is not read)
            q, token = maths(("chain level", index, greedy, draft_sampling), draw, logits, u[index: index + 1, None])
            q_rows.append(q)
            drafted.append(token)
            if index + 1 < gamma:
                logits = draft.extend(token).to(device)
        drafted = torch.cat(drafted)
        drafted_at = time.perf_counter()
        logits = target.extend(torch.cat([to_device([seq[-1]], device), drafted]), last_only=False)
        p, packed = maths(("chain verdict", gamma, greedy, sampling), verdict, logits, drafted, u, *q_rows)
        p, q_rows = maths.keep(p), [maths.keep(q)[0] for q in q_rows]
        event = self._chain_event(step, shape, seq, to_host(packed), p, q_rows)  # the step's one transfer
        # prune: the root and the accepted drafts follow the prefix in both caches (no copy)
        target.keep(list(range(base + 1 + len(event.path))))
        draft.keep(list(range(len(seq) + min(len(event.path), gamma - 1))))
        return self._device_step_timed(event, target, draft, started, drafted_at)

    def _chain_maths(self, shape: Shape) -> tuple:
        """(γ, draws, draw, verdict) of a chain step: its levels; how many of its uniforms are the
        levels' draws (γ, unless greedy: then an acceptance's uniform, not read, stands in), the
        others an acceptance for each node (γ) and the corrections' and the bonus's draws (γ + 1),
        all drawn at once; and the pure functions of its maths — draw: (1, V) draft logits, a (1, 1)
        uniform -> q (1, V), token (1,); verdict: (γ + 1, V) target logits, drafted (γ,), u, each
        level's q -> p, and (drafted, accepted, corrections, bonus) packed in one tensor."""
        gamma, greedy, sampling = shape.depth, self.greedy_ranking, self.sampling
        draws = 0 if greedy else gamma

        def verdict(logits, drafted, u, *q_rows) -> tuple:
            p = logits_to_probs(logits, sampling)  # (γ + 1, V): node i's row i
            accepted, corrections, bonus = chain_outcome(p, torch.cat(q_rows), drafted, u[draws: draws + gamma],
                                                         u[draws + gamma:, None])
            return p, torch.cat([drafted, accepted.long(), corrections, bonus])

        return gamma, draws, partial(probs_and_draw, self.draft_sampling, greedy), verdict

    def _chain_event(self, step: int, shape: Shape, seq: list[int], values: list[int], p: torch.Tensor,
                     q_rows: list[torch.Tensor]) -> StepEvent:
        """A chain step's event from its packed values (see _chain_maths, lookup_verdict), p and each
        level's q; its counts and timings are the caller's to fill in."""
        gamma = len(q_rows)
        tokens, accepted, corrections = values[:gamma], values[gamma: 2 * gamma], values[2 * gamma: 3 * gamma]
        tree = DraftTree.rooted_at(seq[-1])
        for node, token in enumerate(tokens):
            tree.q[node] = q_rows[node]
            tree.add_draw(node, token)
        checks, path = [], []
        for node, token in enumerate(tokens):
            decision = Decision(0, 1, None) if accepted[node] else Decision(None, 1, corrections[node])
            checks.append(NodeCheck(node, [node + 1], decision, (p[node], q_rows[node], [token], shape.rule)))
            if not accepted[node]:
                extra, kind = corrections[node], "correction"
                break
            path.append(node + 1)
        else:
            extra, kind = values[-1], "bonus"
        return StepEvent(
            step=step, shape=shape, tree=tree, p=p, checks=checks, path=path,
            extra_token=extra, extra_kind=kind, emitted=[], draft_calls=gamma if shape.uses_draft_model else 0,
            draft_seconds=0.0, verify_seconds=0.0, forward_seconds=0.0, draft_forward_seconds=0.0,
        )

    def _lookup_step(self, step: int, shape: Shape, seq: list[int], target, draft,
                     generator: torch.Generator) -> StepEvent:
        """A lookup chain's step decided as _chain_step decides an `sd` chain's, with nothing read on the
        host until its end: the root and the looked-up tokens in one target forward, every node decided
        at once (lookup_verdict), one transfer — where the host path (_tree_step) synchronises for each
        tried node and launches its decisions op by op. No draft model is called (auto's draft catches
        up at its next drafting step); a sequence with nothing to look up took a plain step (_step). Where
        the target pads its forwards to buckets, the chain is padded to fill its bucket (the same forward),
        so that its maths is one site per bucket, not per length (a CUDA graph captured for each)."""
        start, forward_before = time.perf_counter(), target.forward_seconds
        continuation = self.ngrams.continuation(seq, shape.depth)
        looked_up = time.perf_counter()
        device, base, n = generator.device, len(seq) - 1, len(continuation)
        m = self._filled(target, n)
        u = torch.rand(2 * m + 1, generator=generator, dtype=torch.float64, device=device)
        tokens = to_device([seq[-1]] + continuation + continuation[-1:] * (m - n), device)
        logits = target.extend(tokens, last_only=False)
        maths = self._maths(target)
        p, q, packed = maths(("lookup verdict", self.sampling), partial(lookup_verdict, self.sampling), logits, tokens,
                             to_device([n], device), u)
        p, q = maths.keep(p[: n + 1]), maths.keep(q[:n])
        values = to_host(packed)  # the step's one transfer
        values = values[:n] + values[m: m + n] + values[2 * m: 2 * m + n] + values[3 * m:]
        event = self._chain_event(step, shape, seq, values, p, list(q))
        target.keep(list(range(base + 1 + len(event.path))))  # (the root and the accepted tokens: a prefix)
        event.draft_seconds, event.verify_seconds = looked_up - start, time.perf_counter() - looked_up
        event.forward_seconds = target.forward_seconds - forward_before
        return event

    @staticmethod
    def _filled(target, n: int) -> int:
        """How many tokens a lookup step of n verifies: n, or more to fill the rows its forward of the root
        and n tokens computes anyway where the target pads forwards (StaticLM.padded)."""
        padded = getattr(target, "padded", None)
        return n if padded is None else padded(n + 1) - 1

    def _plain_step(self, step: int, shape: Shape, seq: list[int], target, generator: torch.Generator) -> StepEvent:
        """A step without drafts (`ar`, or auto's plain steps), sampling that does not depend on the
        context: the target's probabilities and its draw as one function (_maths: one replay of a
        graph on a GPU with compiled forwards), one transfer; the event and the numbers _tree_step
        gives, with less of its tree bookkeeping (0.45 -> 0.34 ms a step outside the forward on a
        2-core Xeon)."""
        start = time.perf_counter()
        return self._plain_event(step, shape, seq, self._queue_plain([seq[-1]], len(seq) - 1, target, generator),
                                 target, start)

    def _queue_plain(self, tokens: list[int] | torch.Tensor, base: int, target,
                     generator: torch.Generator) -> "QueuedPlain":
        """A plain step's work on the device: the target's forward of the root (a host token, or one
        still on the device) at position `base`, its probabilities and draw, the token's copy to the
        host queued. Nothing is read on the host. (Its draw by the inverse CDF even when greedy, as
        _tree_step's `sample`: the same uniforms drawn.)"""
        sampling, maths, clock = self.sampling, self._maths(target), target.clock
        before = clock.count
        logits = target.forward(tokens, [base], torch.ones(1, base + 1, dtype=torch.bool))
        u = torch.rand((1, 1), generator=generator, dtype=torch.float64, device=generator.device)
        p, token = maths(("plain", sampling), partial(probs_and_draw, sampling, False), logits, u)
        # (the token's copy and the next forward's read of it come before the next replay overwrites it)
        return QueuedPlain(base, token, maths.keep(p), to_host_soon(token), (before, clock.count))

    def _plain_event(self, step: int, shape: Shape, seq: list[int], queued: "QueuedPlain", target,
                     start: float) -> StepEvent:
        """A queued plain step's event, once its token is read (the step's one transfer)."""
        token = queued.read()[0]
        before, after = queued.forwards
        forward = target.clock.seconds_through(after) - target.clock.seconds_through(before)
        return StepEvent(
            step=step, shape=shape, tree=DraftTree.rooted_at(seq[-1]), p=queued.p, checks=[], path=[],
            extra_token=token, extra_kind="bonus", emitted=[], draft_calls=0, draft_seconds=0.0,
            verify_seconds=time.perf_counter() - start, forward_seconds=forward, draft_forward_seconds=0.0,
        )

    def _maths(self, target) -> StepGraphs:
        """Where the maths of device steps and plain steps runs: replayed as CUDA graphs (StepGraphs)
        on a GPU with compiled forwards — the model's own where the target holds its shared buffers
        (one generation at a time: graphs captured once for all its decoders), else the decoder's —,
        else directly (decided once per decoder; tests set their own)."""
        if self.step_graphs is None:
            compiled = getattr(target, "compiled", None)
            graphed = getattr(compiled, "compiled", False) and target.device.type == "cuda"
            self.step_graphs = (compiled.step_graphs(self.notice) if graphed and getattr(target, "static", False)
                                else StepGraphs(target.device, graphed, self.notice))
        return self.step_graphs

    def _step(self, step: int, shape: Shape, seq: list[int], target: CachedLM, draft: CachedLM | None,
              generator: torch.Generator) -> StepEvent:
        # (a lookup chain that finds nothing to look up drafts nothing: a plain step)
        drafts = shape.depth > 0 and (shape.variant != "lookup" or bool(self.ngrams.continuation(seq, shape.depth)))
        plain = not drafts and not self.sampling.uses_context
        if getattr(target, "rolls_back", False):  # (a plain step gives nothing back: no state copied for it)
            target.copies_states = not plain
        if plain:
            return self._plain_step(step, shape, seq, target, generator)
        kind = self._on_device(shape, draft, generator.device)
        if kind is not None:
            run = {"chain": self._chain_step, "fan": self._fan_step, "lookup": self._lookup_step}[kind]
            return run(step, shape, seq, target, draft, generator)
        return self._tree_step(step, shape, seq, target, draft, generator)

    def _tree_step(self, step: int, shape: Shape, seq: list[int], target: CachedLM, draft: CachedLM | None,
                   generator: torch.Generator) -> StepEvent:
        """Any shape's step on the host: draft the tree, verify it in one target forward, decide
        node by node, prune."""
        start = time.perf_counter()
        draft_before = draft.forward_seconds if draft else 0.0
        forward_before = target.forward_seconds + draft_before
        draft_calls_before = draft.calls if draft else 0
        tree, draft_index = self._draft(shape, seq, draft if shape.uses_draft_model else None, generator)
        drafted = time.perf_counter()

        # verify: root + every node in one target forward; node i sits at position base + depth
        base = len(seq) - 1
        visible = torch.cat([torch.ones(len(tree), base, dtype=torch.bool), tree.ancestry()], dim=1)
        logits = target.forward(tree.tokens, [base + d for d in tree.depths], visible)
        p = logits_to_probs(logits, self.sampling, **self._seen(self.sampling, seq, tree, range(len(tree)),
                                                                 logits.device))
        checks, path, node = [], [], 0
        while tree.draws[node]:
            draws = tree.draws[node]
            inputs = (p[node], tree.q[node], [tree.tokens[c] for c in draws], shape.rule)
            decision, node_plan = verify(*inputs, generator)
            checks.append(NodeCheck(node, draws, decision, inputs, node_plan))
            if decision.accepted is None:
                extra, kind = decision.correction, "correction"
                break
            node = draws[decision.accepted]
            path.append(node)
        else:
            extra, kind = sample(p[node], generator), "bonus"

        # prune: both caches keep the prefix plus the accepted path (root included)
        target.keep(list(range(base)) + [base + n for n in [0] + path])
        if draft is not None and draft_index:  # (an ar step of auto leaves the draft cache behind)
            draft.keep(list(range(len(seq))) + [draft_index[n] for n in path if n in draft_index])
        end = time.perf_counter()
        return StepEvent(
            step=step, shape=shape, tree=tree, p=p, checks=checks, path=path,
            extra_token=extra, extra_kind=kind, emitted=[],
            draft_calls=(draft.calls - draft_calls_before) if draft else 0,
            draft_seconds=drafted - start, verify_seconds=end - drafted,
            forward_seconds=target.forward_seconds + (draft.forward_seconds if draft else 0.0) - forward_before,
            draft_forward_seconds=(draft.forward_seconds if draft else 0.0) - draft_before,
        )

    def _seen(self, sampling: SamplingParams, seq: list[int], tree: DraftTree, nodes, device: torch.device,
              answer_from: int | None = None) -> dict[str, torch.Tensor]:
        """What context-dependent processing reads of each node's context — the sequence so far and
        the node's path in the tree (the node's own token included: its row is the distribution of
        the token after it) —, as logits_to_probs takes it: "seen", (len(nodes), V) bool, the
        tokens in it (the repetition penalty); "counts", how often each token is in its answer, the
        context from `answer_from` on (this generation's prompt length by default: the presence and
        frequency penalties); "barred", (len(nodes), V) bool, the end-of-sequence tokens where that
        answer is shorter than min_tokens. Empty when the processing does not depend on the context. The draft's
        q at a node gets the same context as the target's p there, so q stays close to p."""
        if not sampling.uses_context:
            return {}
        paths = [torch.tensor([tree.tokens[n] for n in tree.path_to(node)]) for node in nodes]
        context = {}
        if sampling.repetition_penalty != 1.0:
            base = torch.zeros(self.vocab_size, dtype=torch.bool)
            base[torch.tensor(seq)] = True
            seen = base.repeat(len(nodes), 1)
            for row, path in enumerate(paths):
                seen[row, path] = True
            context["seen"] = seen.to(device)
        if sampling.presence_penalty or sampling.frequency_penalty:
            start = self.answer_from if answer_from is None else answer_from
            # (seq ends with the tree's root, which each path begins with)
            answer = torch.tensor(seq[start:-1], dtype=torch.long)
            base = torch.bincount(answer, minlength=self.vocab_size)[: self.vocab_size]
            counts = base.repeat(len(nodes), 1)
            for row, path in enumerate(paths):
                counts[row].index_add_(0, path, torch.ones_like(path))
            if start >= len(seq):  # (the root is the prompt's last token: not the answer's)
                counts[:, seq[-1]] -= 1
            context["counts"] = counts.to(device)
        if sampling.min_tokens:  # a node's answer so far: the sequence's (root included) and its path below the root
            start = self.answer_from if answer_from is None else answer_from
            short = torch.tensor([len(seq) - start + len(path) - 1 < sampling.min_tokens for path in paths])
            ends = torch.zeros(self.vocab_size, dtype=torch.bool)
            ends[self._ends] = True
            context["barred"] = (short[:, None] & ends[None, :]).to(device)
        return context

    def _draft(self, shape: Shape, seq: list[int], draft: CachedLM | None, generator: torch.Generator):
        """Build this step's tree. Returns it and the draft-cache position of each node the
        draft model has processed (needed to prune the draft cache afterwards)."""
        root = seq[-1]
        if shape.variant == "lookup" and shape.depth:
            continuation = self.ngrams.continuation(seq, shape.depth)
            return lookup_tree(root, continuation, self.vocab_size, generator.device), {}
        if draft is None:
            return DraftTree.rooted_at(root), {}
        device = generator.device  # the target's: the draft's q joins p there
        root_seen = self._seen(self.draft_sampling, seq, DraftTree.rooted_at(root), [0], device)
        q_root = logits_to_probs(self._draft_catch_up(seq, draft, device), self.draft_sampling, **root_seen)[0]
        draft_index = {0: len(seq) - 1}
        base = len(seq) - 1

        def expand(tree: DraftTree, nodes: list[int]) -> torch.Tensor:
            # nodes attend to the draft cache's prefix plus their own ancestors it holds
            past = draft.length
            visible = torch.zeros(len(nodes), past + len(nodes), dtype=torch.bool)
            visible[:, : base + 1] = True
            for row, node in enumerate(nodes):
                draft_index[node] = past + row
                for ancestor in tree.path_to(node):
                    visible[row, draft_index[ancestor]] = True
            logits = draft.forward([tree.tokens[n] for n in nodes], [base + tree.depths[n] for n in nodes], visible)
            return logits_to_probs(logits.to(device), self.draft_sampling,
                                   **self._seen(self.draft_sampling, seq, tree, nodes, device))

        return build_tree(shape, root, q_root, expand, generator, self.greedy_ranking), draft_index
