"""Batched sampling from left-padded prompts: a lean KV-cached decode loop over any HF causal LM.

Position ids follow the attention mask (pads do not count), so a prompt gives the same tokens
alone and inside a left-padded batch.

Why not `model.generate()`: at PPO's shapes (a handful of rows, one token per step) a decode step
costs little compute, so per-step overhead decides the rollout time. generate() adds a logits-
processor chain, stopping criteria and input preparation on every step, and samples with
torch.multinomial, which on CPU draws an exponential variate for every vocabulary entry
(~50k per step at batch 8). This loop runs only the processors PPO uses, in generate()'s order and
with its semantics (EOS suppression, temperature, top-k, top-p), and samples by inverse CDF: one
uniform per row, exactly the same categorical distribution. Greedy decoding is identical to
generate(); sampled tokens follow a different random stream than generate()'s.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

from . import decode_graphs as graphs
from .fast_decode import FastDecoder, SharedPrefix, fast_decoder
from .lora import base_of
from .modeling import kv_cache_of


@dataclass
class Samples:
    sequences: torch.Tensor  # [B, P+R] prompt (left-padded) + response (right-padded with pad_id)
    response_mask: torch.Tensor  # [B, R] 1 on real response tokens, up to and including EOS
    has_eos: torch.Tensor  # [B] bool: the row stopped by itself (else it was cut at max_new_tokens)
    logprobs: torch.Tensor | None = None  # [B, R] fp32 log pi(token) under softmax(logits / T) (return_logprobs)
    entropy: torch.Tensor | None = None  # [B, R] fp32 entropy of that distribution (return_logprobs)
    weight_version: int | None = None  # a rollout engine's: the (oldest) weight version that sampled them


class PreallocatedLayer(DynamicLayer):
    """A DynamicLayer whose keys/values live in buffers sized once for the whole generation.

    DynamicLayer re-concatenates the whole cache on every decode step (O(length^2) copying, a visible share of a CPU
    decode). Here a step copies only the new token's K/V, and attention sees a view of the filled part, so masks and
    results are the same as DynamicLayer's."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self._k: torch.Tensor | None = None  # [B, H, capacity, D], made by the first update (the prefill)
        self._v: torch.Tensor | None = None
        self._filled = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:  # K and V may differ in dtype under autocast (q/k norm runs in fp32)
            self.dtype, self.device = key_states.dtype, key_states.device
            B, H, _, Dk = key_states.shape
            self._k = key_states.new_empty(B, H, self.capacity, Dk)
            self._v = value_states.new_empty(B, value_states.shape[1], self.capacity, value_states.shape[-1])
            self._filled = 0
            self.is_initialized = True
        k, v = self.buffers()
        n, L = self._filled, key_states.shape[-2]
        if n + L > self.capacity:
            raise RuntimeError(f"PreallocatedLayer: {n + L} positions exceed the capacity {self.capacity}")
        k[:, :, n : n + L].copy_(key_states)
        v[:, :, n : n + L].copy_(value_states)
        self._filled = n + L
        self.keys, self.values = k[:, :, : n + L], v[:, :, : n + L]
        return self.keys, self.values

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The full-capacity K/V buffers [B, H, capacity, D] (filled up to `_filled`)."""
        if self._k is None or self._v is None:
            raise RuntimeError("PreallocatedLayer: no K/V buffers (before the prefill, or freed)")
        return self._k, self._v

    def filled(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The filled part of the K/V buffers [B, H, n, D]."""
        k, v = self.buffers()
        return k[:, :, : self._filled], v[:, :, : self._filled]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Row i takes row rows[i]: the distinct prompts' K/V copied to every row that repeats it, or the rows still
        decoding kept."""
        k, v = self.buffers()
        self._k, self._v = k.index_select(0, rows), v.index_select(0, rows)
        self.keys, self.values = self.filled()

    def free(self) -> None:
        """Let go of the buffers (StaticDecode copied them into its own): one copy of the K/V alive, not two."""
        self._k = self._v = self.keys = self.values = None


def kv_layers(cache: Cache) -> list[PreallocatedLayer]:
    """The layers of a cache that preallocated_cache made (transformers types a Cache's layers as any kind of layer)."""
    layers = [layer for layer in cache.layers if isinstance(layer, PreallocatedLayer)]
    if len(layers) != len(cache.layers):
        raise TypeError("kv_layers: the cache was not made by preallocated_cache")
    return layers


def distinct_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(first, inverse): the first row of each distinct (ids, mask) prompt [U], and each row's prompt index [B];
    None when every row is distinct. GRPO's groups repeat each prompt num_generations times: the sampler prefills
    each distinct prompt once and copies its K/V to the group's rows (what an engine's prefix cache does)."""
    if input_ids.shape[0] < 2:
        return None
    rows = torch.cat([input_ids, attention_mask.to(input_ids.dtype)], dim=1)
    _, inverse, counts = torch.unique(rows, dim=0, return_inverse=True, return_counts=True)
    if counts.shape[0] == rows.shape[0]:
        return None
    order = torch.sort(inverse, stable=True).indices  # rows grouped by prompt, each group in row order
    return order[counts.cumsum(0) - counts], inverse


def expand_cache(layers: list[PreallocatedLayer], inverse: torch.Tensor) -> None:
    """Each layer's rows selected: row i takes row inverse[i] (the distinct prompts' K/V copied to every row that
    repeats it; the rows still decoding kept)."""
    for layer in layers:
        layer.select_rows(inverse)


def preallocated_cache(model: nn.Module, capacity: int) -> Cache | None:
    """A cache of PreallocatedLayers for a model whose layers all use full attention; None (let the
    model build its own DynamicCache) for sliding-window, hybrid or otherwise unusual configs."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    inner = getattr(getattr(model, "model", None), "config", None)  # MiniMind wrapper: the trunk's HF config
    for cfg in (config, inner):
        if cfg is None:
            continue
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
            return None
        if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
            return None
    n_layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(n_layers, int) or n_layers < 1:
        return None
    return Cache(layers=[PreallocatedLayer(capacity) for _ in range(n_layers)])


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(token) under softmax(logits / T) in fp32, and optionally that distribution's entropy.
    logits [..., V], tokens [...] -> [...]. The one place this math lives (sampler and scorer share it)."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    lp = torch.gather(logp, -1, tokens.unsqueeze(-1)).squeeze(-1)
    return lp, (-(logp.exp() * logp).sum(-1) if with_entropy else None)


def response_mask_from_tokens(responses: torch.Tensor, eos_token_id: int | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask = 1 up to and including the first EOS of each row; rows without EOS are all ones."""
    eos_ids = torch.tensor(eos_token_id if isinstance(eos_token_id, list) else [eos_token_id], device=responses.device)
    is_eos = torch.isin(responses, eos_ids)  # [B, R]
    has_eos = is_eos.any(dim=1)
    # Count EOS seen strictly before each position: tokens after the first EOS have count >= 1.
    eos_before = torch.cumsum(is_eos.int(), dim=1) - is_eos.int()
    return (eos_before == 0).long(), has_eos


_FIXED_POINT = 2.0 ** 52  # probabilities as integer multiples of 2^-52: sums of a vocabulary stay far below 2^63


def cumulative_probs(probs: torch.Tensor) -> torch.Tensor:
    """Running sums of probabilities along the last dimension, in fp64.

    Under torch.use_deterministic_algorithms (--deterministic 1) torch has no deterministic cumsum for
    floating-point CUDA tensors (it raises), so the sums are taken in 52-bit fixed point instead: integer
    cumsum is exact, hence the same on every run and device. Each entry is then a multiple of 2^-52, so a
    token below 2^-53 cannot be drawn (or kept by top-p): no visible change to the distribution. Without
    the flag: float cumsum, as runs have always sampled."""
    p = probs.double()
    if not torch.are_deterministic_algorithms_enabled():
        return p.cumsum(dim=-1)
    fixed = (p * _FIXED_POINT).round().long().cumsum(dim=-1).double() / _FIXED_POINT
    return fixed + p.sum(dim=-1, keepdim=True) * 0.0  # a non-finite row stays non-finite (the sampler checks)


def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus), as transformers' warpers do: removed entries
    become -inf. top_k keeps ties with the k-th value; top_p keeps the smallest set of most likely
    tokens whose probability reaches top_p (always at least one). fp32 in, fp32 out."""
    if temperature != 1.0:
        logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cum = cumulative_probs(sorted_logits.softmax(dim=-1))
        remove = cum <= (1 - top_p)
        remove[..., -1:] = False
        logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return logits


def kept_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0) -> torch.Tensor:
    """log-prob of each token under the distribution the sampler draws it from: softmax over filter_logits (temperature,
    then top-k, then top-p), i.e. renormalised over the kept tokens, as vLLM's --logprobs-mode processed_logprobs
    returns it; -inf for a token the filters cut. logits [..., V], tokens [...] -> [...] fp32. Without top-k / top-p
    it is token_logprobs' value bit for bit (the same ops). The sampler still records token_logprobs' full-vocabulary
    value: that is pi_old of the PPO ratio; this one is only the importance weights' (trainer/ppo.py)."""
    logp = torch.log_softmax(filter_logits(logits.float(), temperature, top_k, top_p), dim=-1)
    return torch.gather(logp, -1, tokens.unsqueeze(-1)).squeeze(-1)


_NONFINITE = "sampling: the model produced non-finite logits (nan/inf); the policy has diverged"


def host_sync_interval(device_type: str) -> int:
    """Decoded tokens between the sampler's host syncs (the all-rows-stopped and finite-logits checks).
    CPU: every token (no sync cost there; the demo's decode steps and RNG draws stay as they were).
    CUDA: a Python bool of a device tensor waits for every queued kernel, so a check per token keeps
    the GPU idle while Python launches the next step; every 8 tokens lets it run ahead."""
    return 1 if device_type == "cpu" else 8


_BLOCK = 256  # vocabulary entries per block of the two-level inverse CDF


def draw_from_probs(probs: torch.Tensor, generator: torch.Generator | None = None,
                    finite: torch.Tensor | None = None, draw_rows: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """One token per row from unnormalised probabilities [B, V] (>= 0) by inverse CDF: u ~ U(0, total), the index
    of the first cumulative probability above u. Entries of probability 0 are never drawn.

    Two levels, the same categorical distribution: the running sums of blocks of 256 entries (fp64) find u's block,
    then the running sums inside that block alone find its token. Why: a full fp64 running sum over a large
    vocabulary, every row, every decoded token, is a visible share of a CPU decode step; this reads the probabilities
    once for the block sums and sums 256 of them per row. The drawn token equals the full running sum's except where u lies
    within fp64 rounding of a boundary.

    Non-finite probabilities raise at once; with `finite` (a 0-dim bool device tensor) the check is ANDed into it
    instead, without a host sync, for the caller to raise on later (indices stay in range meanwhile).

    draw_rows (rows, n): `probs` holds rows `rows` of a batch of n; the uniforms are drawn for all n rows and these
    rows' kept, so each row draws what it would in the whole batch (sample() drops finished rows mid-generation)."""
    B, V = probs.shape
    nb = -(-V // _BLOCK)
    padded = F.pad(probs, (0, nb * _BLOCK - V)) if nb * _BLOCK != V else probs  # zeros: never drawn
    blocks = padded.view(B, nb, _BLOCK)
    sums = blocks.sum(dim=-1, dtype=torch.float64)  # [B, nb]
    cdf = cumulative_probs(sums)
    total = cdf[:, -1:]
    if finite is None:
        if not bool(torch.isfinite(total).all()):
            raise RuntimeError(_NONFINITE)
    else:
        finite.logical_and_(torch.isfinite(total).all())
    if draw_rows is None:
        u = torch.rand(total.shape, dtype=torch.float64, device=probs.device, generator=generator) * total  # [B, 1]
    else:
        rows, n = draw_rows
        u = torch.rand((n, 1), dtype=torch.float64, device=probs.device, generator=generator).index_select(0, rows) * total
    block = torch.searchsorted(cdf, u, right=True).clamp_(max=nb - 1)  # [B, 1]
    below = torch.where(block > 0, cdf.gather(1, (block - 1).clamp(min=0)), torch.zeros_like(u))  # the CDF before it
    inside = blocks.gather(1, block[:, :, None].expand(B, 1, _BLOCK)).squeeze(1)  # [B, 256]
    at = torch.searchsorted(cumulative_probs(inside), u - below, right=True)  # [B, 1]
    # Rounding may put u - below past the block's own running sum: then its last entry with probability > 0.
    last = (torch.arange(1, _BLOCK + 1, device=probs.device) * (inside > 0)).argmax(dim=-1, keepdim=True)
    return (block * _BLOCK + torch.minimum(at, last)).clamp_(max=V - 1).squeeze(-1)


def sample_from_logits(logits: torch.Tensor, generator: torch.Generator | None = None,
                       finite: torch.Tensor | None = None, draw_rows: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """One token per row from softmax(logits) [B, V] (`draw_from_probs`). Entries at -inf (probability 0) are
    never drawn. Non-finite logits raise, or with `finite` are ANDed into it (see draw_from_probs)."""
    return draw_from_probs(torch.softmax(logits.float(), dim=-1), generator, finite, draw_rows)


def choose_tokens(raw: torch.Tensor, *, finished: torch.Tensor, pad_token_id: int, eos_t: torch.Tensor,
                  temperature: float, top_k: int, top_p: float, greedy: bool, suppress_eos: bool, return_logprobs: bool,
                  score_temp: float, generator: torch.Generator | None, finite: torch.Tensor | None,
                  draw_rows: tuple[torch.Tensor, int] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The next token of each row from fp32 logits raw [B, V] (pad_token_id where `finished`), and (return_logprobs)
    its log-prob and the entropy under softmax(raw / score_temp): sample()'s loop body and StaticDecode's, in one
    place.

    Plain temperature sampling (no top-k / top-p: the presets' case) takes one log-softmax for both: the draw reads
    its exp (with EOS zeroed under suppress_eos: the same distribution as EOS at -inf), and the log-prob and entropy
    are token_logprobs' own operations on it, so they equal token_logprobs bit for bit. draw_rows: see draw_from_probs."""
    if not greedy and top_k <= 0 and top_p >= 1.0 and score_temp == temperature:
        logp = torch.log_softmax(raw / temperature if temperature != 1.0 else raw, dim=-1)
        probs = logp.exp()
        ent = -(probs * logp).sum(-1) if return_logprobs else None
        nxt = draw_from_probs(probs.index_fill_(-1, eos_t, 0.0) if suppress_eos else probs, generator, finite, draw_rows)
        nxt = torch.where(finished, torch.full_like(nxt, pad_token_id), nxt)
        return nxt, torch.gather(logp, -1, nxt[:, None]).squeeze(-1) if return_logprobs else None, ent
    logits = raw.index_fill(-1, eos_t, float("-inf")) if suppress_eos else raw
    if greedy:
        nxt = logits.argmax(dim=-1)
    else:
        nxt = sample_from_logits(filter_logits(logits, temperature, top_k, top_p), generator, finite, draw_rows)
    nxt = torch.where(finished, torch.full_like(nxt, pad_token_id), nxt)
    if not return_logprobs:
        return nxt, None, None
    lp, ent = token_logprobs(raw, nxt, score_temp, with_entropy=True)
    return nxt, lp, ent


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        print(f"warning: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class TokenChoice:
    """How the next token of each row is chosen: sample()'s arguments as StaticDecode takes them (hashable: part of a
    cached graph's key)."""

    pad_token_id: int
    temperature: float
    top_k: int
    top_p: float
    greedy: bool
    suppress_eos: bool
    return_logprobs: bool
    score_temp: float  # the temperature of the recorded log-probs and entropy (1 when greedy)


class StaticDecode:
    """The decode loop of `sample()` with the fast decoder as one fixed-shape step: decode the previous token
    (FastDecoder.step's static form: full-length K/V written with index_copy_, one mask), then sample the next
    token inside the same step (EOS suppression, filters, inverse-CDF draw, log-probs, the finished rows), its
    outputs written into [rows, capacity] buffers at a device-side column. No value reaches the host and every
    tensor keeps its address, so on CUDA the step is captured in a CUDA graph and replayed for every token; eager
    otherwise. The operations are sample()'s own eager loop's, in its order, with the same random draws (one
    torch.rand per sampled token; a graph draws from its device's own generator, which takes the caller's state
    before and hands it back after: model/decode_graphs.py DeviceGraphs.drawing_from).

    Its buffers outlive a rollout: on CUDA `rows` and `capacity` are the batch and cache length rounded up to a
    bucket (model/decode_graphs.py graph_shape), and `load` fills them with each rollout's prompts, so one graph
    serves every rollout of its bucket. Rows past the batch attend only to the tokens they decode themselves and
    count as finished from the start; positions past a row's prompt and decoded tokens are masked: neither changes
    a real row's tokens (tests/test_decode_graphs.py).

    Why: a decode step of a small model launches ~500 kernels of a few microseconds each; launched one by one from
    Python the GPU waits for the launches, replayed from a graph it does not."""

    captured = 0  # graphs captured in this process (tests and benchmarks/gpu_check.py count them)

    def __init__(self, kv: list[tuple[torch.Tensor, torch.Tensor]], rows: int, capacity: int, *, eos_t: torch.Tensor,
                 choice: TokenChoice, generator: torch.Generator | None) -> None:
        """kv: each layer's (keys, values) buffers [rows, Hkv, capacity, D], filled by `load`."""
        device = eos_t.device
        self.kv, self.rows, self.capacity, self.generator = kv, rows, capacity, generator
        self.fast: FastDecoder | None = None  # the decoder of the rollout under way (set by load; a cached one drops it after)
        self.eos_t, self.choice = eos_t.clone(), choice
        self.prompt_mask = torch.zeros(rows, capacity, dtype=torch.bool, device=device)  # slots a row may attend to
        self.arange = torch.arange(capacity, device=device)
        self.base = torch.zeros(1, dtype=torch.long, device=device)  # P - 1: the cache slot of the prompt's last token
        self.position = torch.zeros(rows, 1, dtype=torch.long, device=device)  # [rows, 1]: the last token's
        self.col = torch.zeros(1, dtype=torch.long, device=device)  # the response column sampled next
        self.prev = torch.zeros(rows, dtype=torch.long, device=device)  # the token sampled last
        self.finished = torch.zeros(rows, dtype=torch.bool, device=device)
        self.finite = torch.ones((), dtype=torch.bool, device=device)
        self.tokens = torch.full((rows, capacity), choice.pad_token_id, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(rows, capacity, dtype=torch.float32, device=device)
        self.entropy = torch.zeros(rows, capacity, dtype=torch.float32, device=device)

    def state(self) -> list[torch.Tensor]:
        """What a step changes besides the K/V slot it writes."""
        return [self.position, self.col, self.prev, self.finished, self.finite, self.tokens, self.logprobs, self.entropy]

    def load(self, fast: FastDecoder, layers: list[PreallocatedLayer], prompt_mask: torch.Tensor,
             position: torch.Tensor) -> None:
        """A rollout's batch into the buffers: the prefill's K/V [B, Hkv, >= P, D] (`layers`), its mask [B, P] and
        last positions [B, 1]. Everything else is reset: slots not yet decoded and padded rows hold zeros (finite:
        masked keys weigh 0, and 0 x NaN would not be 0), padded rows attend only to their own decoded slots."""
        B, P = prompt_mask.shape
        self.fast = fast
        for (k, v), layer in zip(self.kv, layers, strict=True):
            for dst, src in zip((k, v), layer.buffers()):
                if dst.data_ptr() != src.data_ptr():  # not the prefill's own buffers (a CPU's exact shapes)
                    dst[:B, :, :P].copy_(src[:, :, :P])
                    dst[B:, :, :P].zero_()
                dst[:, :, P:].zero_()
        self.prompt_mask[:B, :P].copy_(prompt_mask.bool())
        self.prompt_mask[B:, :P] = False
        self.prompt_mask[:, P:] = True  # decoded slots; those not yet decoded are cut by `arange <= slot`
        self.base.fill_(P - 1)
        self.position.zero_()
        self.position[:B].copy_(position)
        self.col.zero_()
        self.prev.zero_()
        self.finished.zero_()
        self.finished[B:] = True
        self.finite.fill_(True)
        self.tokens.fill_(self.choice.pad_token_id)
        self.logprobs.zero_()
        self.entropy.zero_()

    def take(self, last: torch.Tensor) -> None:
        """Sample column `col` from logits `last` [B <= rows, V] (sample()'s loop body), then advance the column."""
        if last.shape[0] < self.rows:  # padded rows: any finite logits (they are finished: they sample pads)
            last = torch.cat([last, last.new_zeros(self.rows - last.shape[0], last.shape[1])])
        c = self.choice
        nxt, lp, ent = choose_tokens(last.float(), finished=self.finished, pad_token_id=c.pad_token_id, eos_t=self.eos_t,
                                     temperature=c.temperature, top_k=c.top_k, top_p=c.top_p, greedy=c.greedy,
                                     suppress_eos=c.suppress_eos, return_logprobs=c.return_logprobs,
                                     score_temp=c.score_temp, generator=self.generator, finite=self.finite)
        self.tokens.index_copy_(1, self.col, nxt[:, None])
        if lp is not None and ent is not None:
            self.logprobs.index_copy_(1, self.col, lp[:, None])
            self.entropy.index_copy_(1, self.col, ent[:, None])
        if not c.suppress_eos:
            self.finished.logical_or_(torch.isin(nxt, self.eos_t))
        self.prev.copy_(nxt)
        self.col.add_(1)

    def step(self) -> None:
        """Decode the token sampled last (it goes to cache slot P + col - 1), then sample the next column."""
        assert self.fast is not None, "StaticDecode.step before load"
        self.position.add_(1)
        slot = self.col + self.base
        mask = self.prompt_mask & (self.arange <= slot)  # [rows, capacity]: the prompt's tokens and those decoded
        self.take(self.fast.step(self.prev, self.position, mask, self.kv, slot=slot))


def _capture(dec: StaticDecode, dev: graphs.DeviceGraphs, key: tuple) -> Any:
    """`dec.step` as a CUDA graph of `dev`, or None (the step then runs eagerly, with one warning, and its bucket
    is not asked again). A warm-up step runs first on the capture stream (as torch.cuda.graph asks) with host syncs
    made errors: a step that would wait for the GPU (e.g. a rotary embedding that checks its length on the host)
    raises there and no capture is started. The warm-up's effects are undone (the small state and the random
    stream; the K/V it wrote are those the first replay writes again). Where a capture fails all the same, what it
    leaves in torch is cleaned up (DeviceGraphs.capture) so the eager steps after it draw and sample as they would."""
    backend = dev.backend
    state = dec.state()
    saved = [t.clone() for t in state]
    generator = dec.generator
    assert generator is not None  # a cached graph's StaticDecode draws from its device's generator
    rng = generator.get_state()

    def undo() -> None:
        for t, v in zip(state, saved):
            t.copy_(v)
        generator.set_state(rng)

    try:
        with backend.side_stream(dev.stream, dev.device), backend.no_host_syncs():
            dec.step()
    except RuntimeError as e:
        undo()
        dev.refuse(key)
        _warn_once(f"sampling: the decode step waits for the GPU inside ({str(e).splitlines()[0][:200]}), so it cannot be "
                   "captured in a CUDA graph; it runs eagerly (same tokens, slower; --cuda_graphs 0 silences this)")
        return None
    undo()
    try:
        graph = dev.capture(dec.step, generator)
    except graphs.CaptureFailed as e:
        undo()
        dev.refuse(key)
        _warn_once(f"sampling: the decode step could not be captured in a CUDA graph ({str(e)[:200]}); "
                   "it runs eagerly (same tokens, slower; --cuda_graphs 0 silences this)")
        return None
    StaticDecode.captured += 1
    return graph


def _accepts(model: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class DecodeOptions:
    """How sample()'s decode runs, never what it samples: each switch turns off one way of saving work, so tests and
    benchmarks can compare it with the plain path (the defaults are what the trainer runs).

    static_step: None = StaticDecode (the fast decoder's step as one fixed-shape step, sampling inside it) on CUDA
    only; True = StaticDecode on a CPU too, run eagerly in the exact shapes (the CPU tests compare it with the decode
    loop: equal up to the rounding of attention's sums over more, masked, slots); False = never.

    share_prefill: rows with the same prompt (GRPO's groups) share one prefill: each distinct prompt runs once and
    its K/V and last logits are copied to its rows. The logits equal a prefill of every row up to the rounding of a
    smaller batch's matmuls (tests/test_generation.py); False prefills every row.

    shared_attention: with share_prefill, the fast decoder's loop (not the static step) keeps each distinct prompt's
    K/V once and attends over it for all of its rows (model.fast_decode.SharedPrefix) where every prompt repeats
    equally often; False copies the prompt's K/V to each row.

    drop_finished: on the fast decoder's loop with a host check every token (a CPU's), rows that have stopped leave
    the decode batch once they are a quarter of it (their cache rows dropped, one copy): a batch decodes until its
    longest reply, and many of its row-steps come after a row's EOS. Each row still draws the uniform it would draw
    in the whole batch, so the tokens are the whole batch's up to the rounding of a smaller batch's matmuls. (Past a
    row's EOS, outside its response mask, log-prob and entropy are 0 always.)"""

    static_step: bool | None = None
    share_prefill: bool = True
    shared_attention: bool = True
    drop_finished: bool = True


@torch.no_grad()
def sample(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_id: int | list[int],
    pad_token_id: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
    suppress_eos: bool = False,
    return_logprobs: bool = False,
    fast_decode: bool = True,
    cuda_graphs: bool = True,
    sync_interval: int | None = None,
    generator: torch.Generator | None = None,
    decode: DecodeOptions = DecodeOptions(),
) -> Samples:
    """Sample responses for a left-padded batch [B, P]; per-row stop at EOS, pads after it.

    Only the arguments decide the distribution (never the model's generation_config). With
    suppress_eos every EOS id gets probability 0, so each row runs to max_new_tokens.

    return_logprobs also returns each sampled token's log-prob and the entropy under softmax(logits / T)
    (T = 1 when greedy), taken before EOS suppression and top-k/top-p, i.e. the distribution a full
    forward pass scores: PPO can use them as old_logprobs instead of running the policy again.

    fast_decode runs the decode steps with model.fast_decode.FastDecoder when the model is a dense
    Qwen3/Llama trunk (same math, fewer ops); otherwise, or with False, transformers' forward.

    On CUDA the fast decoder's steps run as `StaticDecode` (attention over the full-length K/V buffers, sampling
    inside the step) in shapes rounded up to a bucket: with cuda_graphs replayed per token from the bucket's CUDA
    graph (captured on the bucket's first rollout, kept across rollouts: model/decode_graphs.py), without it
    launched op by op; the two give the same tokens and log-probs bit for bit (the same kernels on the same
    shapes). A CPU runs the decode loop below (DecodeOptions.static_step changes that rule).

    sync_interval: tokens between host checks of "every row stopped" and "logits finite" (None =
    `host_sync_interval` of the device: 1 on CPU, 8 on CUDA). With k > 1 up to k-1 steps may run after
    the last row stopped; they decode pads into finished rows and are cut off before returning, so the
    outputs equal the every-token schedule's (a sampled batch under the same seed included). Those
    steps still draw from the device RNG, so later draws differ from a k = 1 run's (deterministic all
    the same). Non-finite logits raise at the next check instead of at once.

    generator: the random stream of the draws (on the inputs' device); None = torch's default one.

    decode: the switches that tests and benchmarks turn to compare decode paths (DecodeOptions)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    interval = sync_interval if sync_interval is not None else host_sync_interval(input_ids.device.type)
    if interval < 1:
        raise ValueError(f"sync_interval must be >= 1, got {interval}")
    model = base_of(model)  # the causal LM itself: DDP wraps only the training forward; a peft model's base runs its adapters
    eos_ids = list(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    eos_t = torch.tensor(eos_ids, device=input_ids.device)
    keep = {"logits_to_keep": 1} if _accepts(model, "logits_to_keep") else {}  # only the last position's logits
    B, P = input_ids.shape
    mask = attention_mask
    position = (mask.long().cumsum(-1) - 1).clamp(min=0)
    was_training = model.training
    model.eval()
    tokens: list[torch.Tensor] = []
    step_logprobs: list[torch.Tensor] = []
    step_entropy: list[torch.Tensor] = []
    score_temp = 1.0 if greedy else temperature
    try:
        cache = preallocated_cache(model, P + max_new_tokens)
        layers = kv_layers(cache) if cache is not None else []  # [] when the model builds its own cache
        # transformers 5.x renamed the forward's cache argument (past_key_values -> cache, the old name deprecated)
        cache_arg = "cache" if _accepts(model, "cache") else "past_key_values"
        extra = {cache_arg: cache} if cache is not None else {}
        device_type = input_ids.device.type
        fast = fast_decoder(model, device_type) if fast_decode and cache is not None else None
        # With the fast decoder, the prefill is the only forward to cast the weights: autocast's cache would
        # keep a second low-precision copy of them alive for the whole generation, unused.
        prefill_cast = (torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=False)
                        if fast is not None and torch.is_autocast_enabled(device_type) else contextlib.nullcontext())
        # Each distinct prompt is prefilled once, its K/V then copied to every row that repeats it.
        shared = distinct_prompts(input_ids, mask) if cache is not None and decode.share_prefill else None
        at, inverse = shared if shared is not None else (slice(None), None)
        with prefill_cast:
            out = model(input_ids=input_ids[at], attention_mask=mask[at], position_ids=position[at], use_cache=True,
                        **keep, **extra)
        last = out.logits[:, -1, :]
        static = fast is not None and (decode.static_step if decode.static_step is not None else device_type == "cuda")
        prefix = None
        if inverse is not None:
            if decode.shared_attention and fast is not None and not static and SharedPrefix.applies(inverse):
                prefix = SharedPrefix([layer.filled() for layer in layers], mask[at], inverse, max_new_tokens,
                                      fast.compute_dtype)
            else:
                expand_cache(layers, inverse)
            last = last.index_select(0, inverse)
        if fast is not None:  # the whole-generation key mask, sliced per step: [B, P + max_new_tokens]
            kv_mask = torch.cat([mask.bool(), mask.new_ones(B, max_new_tokens, dtype=torch.bool)], dim=1)
        position = position[:, -1:]
        if static:
            assert fast is not None  # static needs the fast decoder
            choice = TokenChoice(pad_token_id=pad_token_id, temperature=temperature, top_k=top_k, top_p=top_p,
                                 greedy=greedy, suppress_eos=suppress_eos, return_logprobs=return_logprobs,
                                 score_temp=score_temp)
            return _static_decode(model, fast, layers, mask, position, last, input_ids, max_new_tokens, eos_ids, eos_t,
                                  interval, cuda_graphs, generator, choice)
        finished = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
        # interval 1 checks finiteness per token inside the draw (a sync), as it always has.
        finite = torch.ones((), dtype=torch.bool, device=input_ids.device) if interval > 1 else None
        rows: torch.Tensor | None = None  # the rows still in the decode batch (drop_finished); None: every row
        dropping = decode.drop_finished and fast is not None and interval == 1 and not suppress_eos
        for step in range(max_new_tokens):
            live = finished if rows is None else finished.index_select(0, rows)
            nxt, lp, ent = choose_tokens(last.float(), finished=live, pad_token_id=pad_token_id, eos_t=eos_t,
                                         temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy,
                                         suppress_eos=suppress_eos, return_logprobs=return_logprobs,
                                         score_temp=score_temp, generator=generator, finite=finite,
                                         draw_rows=None if rows is None else (rows, B))  # finished rows: pads
            step_tokens = nxt  # the decode batch's
            if rows is not None:  # back to every row: the dropped ones decode pads (log-prob and entropy 0)
                nxt = torch.full((B,), pad_token_id, dtype=nxt.dtype, device=nxt.device).index_copy_(0, rows, nxt)
                if lp is not None and ent is not None:
                    lp, ent = lp.new_zeros(B).index_copy_(0, rows, lp), ent.new_zeros(B).index_copy_(0, rows, ent)
            tokens.append(nxt)
            if lp is not None and ent is not None:
                step_logprobs.append(lp)
                step_entropy.append(ent)
            if not suppress_eos:
                finished = finished | torch.isin(nxt, eos_t)
            if (step + 1) % interval == 0:  # the host syncs: every token on CPU
                if finite is not None and not bool(finite):
                    raise RuntimeError(_NONFINITE)
                if not suppress_eos and bool(finished.all()):
                    break
            if step == max_new_tokens - 1:
                break
            position = position + 1
            if dropping:
                done = finished if rows is None else finished.index_select(0, rows)
                n_done = int(done.sum())  # a host read, as the check above
                if 4 * n_done >= done.shape[0]:
                    still = (~done).nonzero().squeeze(1)
                    rows = still if rows is None else rows.index_select(0, still)
                    step_tokens, position, kv_mask = step_tokens[still], position[still], kv_mask[still]
                    if prefix is not None:
                        prefix.keep(still)
                    else:
                        expand_cache(layers, still)
            if fast is not None and cache is not None:  # (the fast decoder runs on the preallocated cache only)
                last = fast.step(step_tokens, position, kv_mask[:, : P + step + 1], cache, prefix=prefix)
            else:
                mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1)
                out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=position,
                            use_cache=True, **keep, **{cache_arg: kv_cache_of(out)})
                last = out.logits[:, -1, :]
    finally:
        model.train(was_training)
    if finite is not None and not bool(finite):
        raise RuntimeError(_NONFINITE)
    responses = torch.stack(tokens, dim=1)  # [B, R]; R < max_new_tokens when every row hit EOS
    logprobs = torch.stack(step_logprobs, dim=1) if return_logprobs else None
    entropy = torch.stack(step_entropy, dim=1) if return_logprobs else None
    return _finish(input_ids, responses, logprobs, entropy, eos_ids, pad_token_id, interval, suppress_eos)


def _static_decode(lm: nn.Module, fast: FastDecoder, layers: list[PreallocatedLayer], mask: torch.Tensor,
                   position: torch.Tensor, last: torch.Tensor, input_ids: torch.Tensor, max_new_tokens: int,
                   eos_ids: list[int], eos_t: torch.Tensor, interval: int, cuda_graphs: bool,
                   generator: torch.Generator | None, choice: TokenChoice) -> Samples:
    """sample()'s decode with StaticDecode. A CPU: the exact shapes, in the prefill's own cache buffers, eager. CUDA:
    the bucket's shapes (graph_shape), graphs or not, so a graph and the eager step (--cuda_graphs 0, or a bucket
    that cannot be captured) run the same kernels on the same shapes: the same bits. With cuda_graphs the bucket's
    graph is taken from the device's cache (model/decode_graphs.py), captured on first use."""
    B, P = mask.shape
    device = input_ids.device
    samples = functools.partial(_static_samples, last=last, input_ids=input_ids, max_new_tokens=max_new_tokens,
                                eos_ids=eos_ids, pad_token_id=choice.pad_token_id, interval=interval,
                                suppress_eos=choice.suppress_eos, return_logprobs=choice.return_logprobs)
    if not graphs.BACKEND.applies(device):
        dec = StaticDecode([layer.buffers() for layer in layers], B, P + max_new_tokens, eos_t=eos_t, choice=choice,
                           generator=generator)
        dec.load(fast, layers, mask, position)
        return samples(dec)
    rows, capacity = graphs.graph_shape(B, P + max_new_tokens)
    layout: list[tuple[tuple[int, ...], torch.dtype]] = [
        ((rows, t.shape[1], capacity, t.shape[-1]), t.dtype) for layer in layers for t in layer.buffers()]
    dev = graphs.device_graphs(device) if cuda_graphs and max_new_tokens > 1 else None
    key: tuple = ()
    signature: tuple = ()
    if dev is not None:
        dev.bind(lm)
        signature = dev.signature(fast)
        key = (rows, capacity, tuple(layout), signature, tuple(eos_ids), choice, torch.is_autocast_enabled(device.type),
               torch.get_autocast_dtype(device.type), torch.are_deterministic_algorithms_enabled())
    if dev is None or key in dev.refused:  # eager: buffers of this call's own
        kv = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in layout]
        dec = StaticDecode(list(zip(kv[0::2], kv[1::2])), rows, capacity, eos_t=eos_t, choice=choice, generator=generator)
        dec.load(fast, layers, mask, position)
        _free_kv(layers)
        return samples(dec)
    static_fast = dev.decoder(fast, signature)
    entry = dev.get(key)
    if entry is None:
        kv = dev.kv(layout)
        entry = graphs.Entry(StaticDecode(list(zip(kv[0::2], kv[1::2])), rows, capacity, eos_t=eos_t, choice=choice,
                                          generator=dev.generator))
    dec = entry.dec
    dec.load(static_fast, layers, mask, position)
    _free_kv(layers)

    def graphed() -> Callable[[], None] | None:
        if entry.graph is None:
            entry.graph = _capture(dec, dev, key)
            if entry.graph is None:
                return None
            dev.keep(key, entry)
        return functools.partial(dev.backend.replay, entry.graph)

    try:
        with dev.drawing_from(generator if generator is not None else dev.backend.default_generator(device)):
            return samples(dec, graphed=graphed)
    finally:
        dec.fast = None  # the cache keeps no reference to the model


def _free_kv(layers: list[PreallocatedLayer]) -> None:
    """The prefill's K/V freed once StaticDecode.load copied them into its buffers (sample() reads them no more):
    one copy of the K/V alive while decoding, not two."""
    for layer in layers:
        layer.free()


def _static_samples(dec: StaticDecode, *, last: torch.Tensor, input_ids: torch.Tensor, max_new_tokens: int,
                    eos_ids: list[int], pad_token_id: int, interval: int, suppress_eos: bool, return_logprobs: bool,
                    graphed: Callable[[], Callable[[], None] | None] | None = None) -> Samples:
    """sample()'s loop with StaticDecode: the first token from the prefill's logits, then one step per token, the
    host checks every `interval` tokens as in the loop. `graphed` (after the first token) gives the graph replay to
    run as each step, or None: the step runs eagerly."""
    B = input_ids.shape[0]
    dec.take(last)
    steps = 1
    run = (graphed() if graphed is not None and max_new_tokens > 1 else None) or dec.step
    while steps < max_new_tokens:
        if steps % interval == 0:  # the host syncs, at the loop's points
            if not bool(dec.finite):
                raise RuntimeError(_NONFINITE)
            if not suppress_eos and bool(dec.finished.all()):
                break
        run()
        steps += 1
    if not bool(dec.finite):
        raise RuntimeError(_NONFINITE)
    # Slices of buffers a cached graph writes again next rollout: _finish returns new tensors made from them.
    lp = dec.logprobs[:B, :steps] if return_logprobs else None
    ent = dec.entropy[:B, :steps] if return_logprobs else None
    return _finish(input_ids, dec.tokens[:B, :steps], lp, ent, eos_ids, pad_token_id, interval, suppress_eos)


def _finish(input_ids: torch.Tensor, responses: torch.Tensor, logprobs: torch.Tensor | None, entropy: torch.Tensor | None,
            eos_ids: list[int], pad_token_id: int, interval: int, suppress_eos: bool) -> Samples:
    """Samples from the decoded columns [B, R]: masks, the steps run after the last row stopped cut off, pads."""
    response_mask, has_eos = response_mask_from_tokens(responses, eos_ids)
    if interval > 1 and not suppress_eos:  # drop the steps run after the last row stopped (one sync)
        R = int(response_mask.sum(dim=1).max())  # = the every-token schedule's step count
        responses, response_mask = responses[:, :R], response_mask[:, :R]
        if logprobs is not None and entropy is not None:
            logprobs, entropy = logprobs[:, :R], entropy[:, :R]
    if suppress_eos:
        has_eos = torch.zeros_like(has_eos)
    responses = torch.where(response_mask.bool(), responses, torch.full_like(responses, pad_token_id))
    if logprobs is not None and entropy is not None:  # past a row's EOS: 0, however the steps ran (drop_finished)
        logprobs = torch.where(response_mask.bool(), logprobs, torch.zeros_like(logprobs))
        entropy = torch.where(response_mask.bool(), entropy, torch.zeros_like(entropy))
    return Samples(sequences=torch.cat([input_ids, responses], dim=1), response_mask=response_mask, has_eos=has_eos,
                   logprobs=logprobs, entropy=entropy)
