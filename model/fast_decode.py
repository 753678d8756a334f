"""A lean single-token decode step for dense Qwen3 / Llama trunks (MiniMind's two architectures).

Why: at PPO's rollout shapes (a handful of rows, one new token per step) a decode step is a few
MFLOP per layer, so its time is weight bandwidth plus per-call overhead; transformers' layer runs
~25 small ops (norms upcast and downcast, separate q/k/v and gate/up projections, mask building,
cache bookkeeping). This step runs the same math with the q/k/v and gate/up weights concatenated
(one matmul each) and the mask built once per token; the rotary helper and embedding are
transformers' own, the norms read their weight and eps off transformers' modules. Under bf16
autocast the weights are cast once per `sample()` call instead of on every matmul, and on a CPU
they are also reordered once into oneDNN's blocked layout (`onednn_prepack`) and the grouped K/V
heads are packed for SDPA (`pack_gqa_heads`). In fp32 the matmuls are weight-bandwidth bound and
it gains little (measurements: docs/speed-and-memory.md).

Exactness: the same operations in the same dtypes as transformers' Qwen3/Llama layers (norms in
fp32 then cast back to the input dtype, rotary in the residual dtype, SDPA with a boolean padding
mask; grouped K/V heads as `decode_attention` lays them out per device). Concatenated matmuls may
round differently in the last bit: fp32 logits agree to ~1e-6, bf16 to one bf16 step
(tests/test_generation.py::test_fast_decode_*).

LoRA (peft) layers: each adapter is folded into its layer's weight once per `sample()` call
(W + B A scale, model/lora.py `effective_weight`), so a LoRA policy decodes at the speed of a plain
one; x (W + B A s) rounds differently from peft's x W + s (x A) B in the last bits (fp32 log-probs
agree to ~1e-6: tests/test_lora.py).

Rows that repeat a prompt (GRPO's groups): `SharedPrefix` attends over each distinct prompt's K/V once for all of
its rows instead of over a copy per row (cascade attention; fp32 from the cached values, equal to the copy to fp32
rounding).

Anything else (MoE, biases, sliding windows, other model types, hub kernels) returns None from
`fast_decoder` and `sample()` keeps transformers' forward.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache

from .lora import adapter_parts, base_of, effective_weight, foldable

_SUPPORTED = ("Qwen3Model", "LlamaModel")
_FUSED = ("qkv", "o", "gate_up", "down")  # each layer's fused weights


def pack_gqa_heads(device_type: str, dtype: torch.dtype | None = None) -> bool:
    """How a decode step gives SDPA grouped K/V heads (GQA). True: each K/V head's query heads become
    that head's query rows (transformers' `pack_gqa`, its own choice for one-token decode on CUDA).
    False: `enable_gqa=True`. Packed on CUDA, and on a CPU under bf16/fp16 (`dtype`, the autocast
    dtype); CPU fp32 keeps enable_gqa (the demo's numerics).

    Why not enable_gqa on CUDA: SDPA with an attention mask and enable_gqa has no fused CUDA kernel
    (flash takes no mask; torch documents GQA for the flash and math kernels only), so it falls back
    to the math kernel. Packed, no enable_gqa is needed and the memory-efficient kernel runs; unlike
    repeat_kv, nothing copies the K/V cache n_rep times per layer on every decoded token.
    Why on a CPU under bf16: torch's CPU SDPA with enable_gqa is several times slower in bf16 than the packed
    heads at decode shapes; in fp32 the two differ in the last bits, so fp32 is left as it was."""
    return device_type == "cuda" or (dtype is not None and dtype != torch.float32)


def onednn_prepack(weight: torch.Tensor, device_type: str) -> torch.Tensor | None:
    """`weight` [out, in] bf16 reordered once into oneDNN's blocked layout (what inductor's weight
    freezing does on a CPU), or None where that does not apply (not a CPU, not bf16, no oneDNN).
    Why: F.linear on a plain bf16 weight reorders it inside oneDNN on every call; at decode shapes
    (a handful of rows, the weights streamed from memory each token) that reorder is a large part of
    the matmul. The prepacked matmul gives bit-identical outputs (the same oneDNN kernel;
    tests/test_generation.py)."""
    if device_type != "cpu" or weight.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return None
    try:
        # oneDNN's bf16 ops refuse CPUs without the AVX-512 subsets they need (at call time): check first.
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return None
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
    except (RuntimeError, AttributeError):  # a torch build without oneDNN's bf16 linear
        return None


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """F.linear(x, W) under bf16 autocast, for a weight from onednn_prepack: the same input cast, the
    same kernel, bf16 out."""
    return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed, None, "none", [], "")


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
                     pack: bool) -> torch.Tensor:
    """One query token's attention over grouped K/V heads. q [B, Hq, 1, D], keys/values [B, Hkv, n, D],
    mask [B, 1, 1, n] bool (the same for every head, as a padding mask is) -> [B, Hq, 1, D].
    Query head h reads K/V head h // (Hq // Hkv), as repeat_kv and enable_gqa both lay them out."""
    if not pack:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    B, Hq, _, D = q.shape
    Hkv = keys.shape[1]
    # [B, Hkv, n_rep, D]: the group's query heads become query rows; the [B, 1, 1, n] mask broadcasts over them.
    o = F.scaled_dot_product_attention(q.reshape(B, Hkv, Hq // Hkv, D), keys, values, attn_mask=mask, scale=scale)
    return o.reshape(B, Hq, 1, values.shape[-1])


def _rms(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """transformers' Qwen3RMSNorm / LlamaRMSNorm forward, inlined (skips nn.Module call overhead):
    fp32 statistics, cast back to the input dtype, then the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


class FastDecoder:
    """Decode steps over the PreallocatedLayer buffers a transformers prefill has filled."""

    def __init__(self, lm: nn.Module, compute_dtype: torch.dtype | None, device_type: str = "cpu",
                 prepack: bool = True) -> None:
        trunk = lm.model
        self.compute_dtype = compute_dtype
        self.pack_gqa = pack_gqa_heads(device_type, compute_dtype)
        cfg = trunk.config
        self.trunk = trunk
        # transformers' own rotary helper for this model type (Qwen3 and Llama each define one).
        self.apply_rotary = sys.modules[type(trunk.layers[0].self_attn).__module__].apply_rotary_pos_emb
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = trunk.layers[0].self_attn.head_dim
        # Under autocast F.linear would cast these on every call; cast once here (same rounding).
        cast = (lambda w: w.detach().to(compute_dtype)) if compute_dtype is not None else (lambda w: w.detach())
        self.weights: list[dict[str, torch.Tensor]] = []  # per layer, by _FUSED name
        self.adapters: list[dict[str, list | None]] = []  # per layer and fused weight: its parts' (A, B, scale)s
        # LoRA layers: in fp32 each adapter is folded into its weight (W + B A s agrees with peft to ~1e-6).
        # In a low precision the folded weight rounds differently from peft's x W + s (x A) B by more than
        # one PPO step moves a LoRA policy (benchmarks/measure_logprob_gap.py), so the adapters stay apart
        # and are applied as peft does.
        unfold = compute_dtype is not None and compute_dtype != torch.float32

        def parts(m: nn.Module) -> tuple[torch.Tensor, list]:
            if not unfold:
                return effective_weight(m), []
            found = adapter_parts(m)
            assert found is not None  # fast_decoder builds a decoder only where every layer is foldable
            w, ads = found
            return w, [(cast(a), cast(b), s) for a, b, s in ads]

        def group(*ps: tuple[torch.Tensor, list]) -> list | None:
            """Each part's adapters and output width, for one fused weight; None: no adapter anywhere."""
            return [(ads, w.shape[0]) for w, ads in ps] if any(ads for _, ads in ps) else None

        for layer in trunk.layers:
            a, mlp = layer.self_attn, layer.mlp
            q, k, v, o = parts(a.q_proj), parts(a.k_proj), parts(a.v_proj), parts(a.o_proj)
            g, u, d = parts(mlp.gate_proj), parts(mlp.up_proj), parts(mlp.down_proj)
            self.weights.append({
                "qkv": cast(torch.cat([q[0], k[0], v[0]])),
                "o": cast(o[0]),
                "gate_up": cast(torch.cat([g[0], u[0]])),
                "down": cast(d[0]),
            })
            self.adapters.append({"qkv": group(q, k, v), "o": group(o), "gate_up": group(g, u), "down": group(d)})
        self.head = cast(lm.lm_head.weight)
        # On a CPU under bf16, every decode matmul takes oneDNN's prepacked weight (onednn_prepack).
        self.linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear
        head = onednn_prepack(self.head, device_type) if prepack and compute_dtype == torch.bfloat16 else None
        if head is not None:  # the head stands for every weight: same dtype, device and oneDNN support
            self.weights = [{k: onednn_prepack(v, device_type) for k, v in w.items()} for w in self.weights]
            self.head, self.linear = head, _onednn_linear

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this decoder holds and its step reads, in a fixed order: each layer's fused weights, the head,
        the low-precision LoRA factors. (The model's own modules it reads are not among them.)"""
        out = [w[k] for w in self.weights for k in _FUSED]
        out.append(self.head)
        for ads in self.adapters:
            for k in _FUSED:
                for part, _width in ads[k] or []:
                    for a, b, _s in part:
                        out += [a, b]
        return out

    def reading(self, tensors: list[torch.Tensor]) -> FastDecoder:
        """A shallow copy of this decoder reading `tensors` (in `tensors()`'s order) instead of its own: CUDA graphs
        read a weight copy at fixed addresses (model/decode_graphs.py)."""
        it = iter(tensors)
        new = copy.copy(self)
        new.weights = [{k: next(it) for k in _FUSED} for _ in self.weights]
        new.head = next(it)
        new.adapters = [{k: None if ads[k] is None else [([(next(it), next(it), s) for _a, _b, s in part], width)
                                                         for part, width in ads[k] or []] for k in _FUSED}
                        for ads in self.adapters]
        return new

    def lora_scales(self) -> tuple[float, ...]:
        """The LoRA scales the step applies (low precision: the adapters stay apart), in `tensors()`'s order."""
        return tuple(s for ads in self.adapters for k in _FUSED for part, _w in ads[k] or [] for _a, _b, s in part)

    def _proj(self, x: torch.Tensor, w: dict, ads: dict, name: str) -> torch.Tensor:
        """x through fused weight `name`, plus its parts' LoRA terms as peft adds them: y + s (x A) B."""
        y = self.linear(x, w[name])
        group = ads[name]
        if group is None:
            return y
        deltas = []
        for part, width in group:
            delta = None
            for A, B, s in part:
                t = F.linear(F.linear(x, A), B) * s
                delta = t if delta is None else delta + t
            deltas.append(delta if delta is not None else y.new_zeros(*y.shape[:-1], width))
        return y + torch.cat(deltas, dim=-1).to(y.dtype)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, position: torch.Tensor, kv_mask: torch.Tensor,
             cache: Cache | Sequence[tuple[torch.Tensor, torch.Tensor]], slot: torch.Tensor | None = None,
             prefix: SharedPrefix | None = None) -> torch.Tensor:
        """tokens [B], position [B, 1], kv_mask [B, n+1] bool (True = attend; n = cached length)
        -> logits [B, V] for the next token. Appends this token's K/V to `cache` (a Cache of the prefill's
        PreallocatedLayers). Call it under the same autocast context the decoder was built in: autocast casts the
        activations, as in transformers.

        The static form (`slot`, a [1] long device tensor: the new token's position in the cache; `cache`: each
        layer's full-length (keys, values) buffers): K/V are written into the buffers at `slot` (index_copy_) and
        attention reads the whole buffers, kv_mask [B, capacity] saying which slots count. Every shape and address
        is then the same on every token, and no value reaches the host: the step can be captured in a CUDA graph
        (model/generation.py). The slots past `slot` must hold finite numbers (the caller zeroes them): masked keys
        weigh 0, and 0 x NaN would not be 0.

        With `prefix` (a SharedPrefix), attention reads each distinct prompt's K/V once and the rows' own decoded
        K/V from the prefix's buffers; `cache` and `kv_mask` are not read."""
        B = tokens.shape[0]
        nq, nk = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        h = self.trunk.embed_tokens(tokens[:, None])  # [B, 1, H], the residual dtype
        cos, sin = self.trunk.rotary_emb(h, position)  # [B, 1, head_dim]
        mask = kv_mask[:, None, None, :]  # [B, 1, 1, n+1]
        for w, ads, layer in zip(self.weights, self.adapters, self.trunk.layers):
            a = layer.self_attn
            qkv = self._proj(_rms(h, layer.input_layernorm), w, ads, "qkv")  # [B, 1, nq + 2 nk]
            q = qkv[..., :nq].view(B, 1, self.n_heads, self.head_dim)
            k = qkv[..., nq : nq + nk].view(B, 1, self.n_kv, self.head_dim)
            v = qkv[..., nq + nk :].view(B, 1, self.n_kv, self.head_dim).transpose(1, 2)
            if hasattr(a, "q_norm"):  # Qwen3's per-head q/k norm
                q, k = _rms(q, a.q_norm), _rms(k, a.k_norm)
            q, k = self.apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [B, heads, 1, hd]
            if prefix is not None:
                o = prefix.attend(a.layer_idx, q, k, v, a.scaling)
            else:
                if isinstance(cache, Cache):
                    keys, values = cache.update(k, v, a.layer_idx)  # [B, nkv, n+1, hd]
                else:
                    assert slot is not None  # the static form: buffers are written at a slot
                    keys, values = cache[a.layer_idx]  # [B, nkv, capacity, hd], as copy_ casts it in update()
                    keys.index_copy_(2, slot, k.to(keys.dtype))
                    values.index_copy_(2, slot, v.to(values.dtype))
                o = decode_attention(q, keys, values, mask, a.scaling, self.pack_gqa)
            h = h + self._proj(o.transpose(1, 2).reshape(B, 1, nq), w, ads, "o")
            gate, up = self._proj(_rms(h, layer.post_attention_layernorm), w, ads, "gate_up").chunk(2, dim=-1)
            h = h + self._proj(F.silu(gate) * up, w, ads, "down")
        if prefix is not None:
            prefix.advance()
        return self.linear(_rms(h, self.trunk.norm), self.head)[:, -1]


class SharedPrefix:
    """Decode attention for rows that repeat a prompt (GRPO's groups): each distinct prompt's K/V is read once for
    all of its rows, not once per row from a copy (cascade attention, as inference engines run shared prefixes).

    Each query row attends over its prompt's K/V (kept once per distinct prompt, [U, Hkv, P, D]) and over the tokens
    it decoded itself (its own [Hkv, n, D]); one softmax over both, so the result is attention over the row's whole
    cache, as a per-row copy gives. The group's query rows go through the prompt part as one matmul per K/V head:
    [g rows x heads per K/V head] queries against the prompt's P keys. Computed in fp32 from the cached values
    (SDPA under bf16 autocast takes bf16 inputs): outputs agree with SDPA over the copied cache to bf16 rounding.

    Why: with long prompts shared by many rows (GRPO's groups), SDPA's CPU kernel over every row's copy reads the
    same prompt K/V once per row, a large part of a decode step.
    Needs every prompt repeated equally often (GRPO's groups); rows may come in any order."""

    def __init__(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], prompt_mask: torch.Tensor, inverse: torch.Tensor,
                 max_new_tokens: int, dtype: torch.dtype | None) -> None:
        """kv: each layer's (keys, values) [U, Hkv, P, D] from a prefill of the U distinct prompts; prompt_mask [U, P]
        their attention masks; inverse [B]: each row's prompt index (distinct_prompts); dtype: the attention output's
        (the decoder's compute dtype, None = the queries')."""
        B, U = inverse.shape[0], prompt_mask.shape[0]
        self.B, self.U, self.g, self.dtype = B, U, B // U, dtype
        order = torch.sort(inverse, stable=True).indices  # grouped position -> row
        grouped = torch.equal(order, torch.arange(B, device=order.device))
        # Each decoding row's position in the grouped layout [U x g] the prompt part runs in; None: row i is at i.
        self.pos: torch.Tensor | None = None if grouped else torch.argsort(order)
        self.bias = torch.zeros(U, 1, 1, prompt_mask.shape[1], device=prompt_mask.device).masked_fill(
            ~prompt_mask.bool()[:, None, None, :], float("-inf"))
        self.keys_t: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.own_k: list[torch.Tensor] = []
        self.own_v: list[torch.Tensor] = []
        for k, v in kv:
            self.keys_t.append(k.float().transpose(-1, -2).contiguous())  # [U, Hkv, D, P]
            self.values.append(v.float())  # [U, Hkv, P, Dv]
            self.own_k.append(k.new_zeros(B, k.shape[1], max_new_tokens, k.shape[-1], dtype=torch.float32))
            self.own_v.append(v.new_zeros(B, v.shape[1], max_new_tokens, v.shape[-1], dtype=torch.float32))
        self.n = 0  # tokens decoded so far

    @staticmethod
    def applies(inverse: torch.Tensor) -> bool:
        """Every distinct prompt repeated equally often (rows in any order)."""
        counts = torch.bincount(inverse)
        return bool((counts == counts[0]).all()) and int(counts[0]) > 1

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, Hq, 1, D], this token's k [B, Hkv, 1, D], v [B, Hkv, 1, Dv] -> [B, Hq, 1, Dv]; k, v are kept."""
        out_dtype = self.dtype or q.dtype
        U, g, n, pos = self.U, self.g, self.n, self.pos
        with torch.autocast(q.device.type, enabled=False):
            Bd, Hq, _, D = q.shape  # the decoding rows (fewer than B once finished rows are dropped)
            Hkv, P = k.shape[1], self.bias.shape[-1]
            rep = Hq // Hkv
            own_k, own_v = self.own_k[layer], self.own_v[layer]
            own_k[:, :, n] = k[:, :, 0]
            own_v[:, :, n] = v[:, :, 0]
            qr = q.float().reshape(Bd, Hkv, rep, D) * scale  # query head h reads K/V head h // rep
            # The prompt part in the grouped layout (a dropped row's slot holds zeros, its result unread).
            qf = qr if pos is None else qr.new_zeros(self.B, Hkv, rep, D).index_copy_(0, pos, qr)
            qg = qf.view(U, g, Hkv, rep, D).transpose(1, 2).reshape(U, Hkv, g * rep, D)
            s_prompt = torch.matmul(qg, self.keys_t[layer]).add_(self.bias)  # [U, Hkv, g rep, P]
            s_prompt = s_prompt.view(U, Hkv, g, rep, P).transpose(1, 2).reshape(self.B, Hkv, rep, P)
            if pos is not None:
                s_prompt = s_prompt.index_select(0, pos)
            s_own = torch.matmul(qr, own_k[:, :, : n + 1].transpose(-1, -2))  # [Bd, Hkv, rep, n+1]
            w = torch.softmax(torch.cat([s_prompt, s_own], dim=-1), dim=-1)
            w_prompt = w[..., :P]
            if pos is not None:
                w_prompt = w_prompt.new_zeros(self.B, Hkv, rep, P).index_copy_(0, pos, w_prompt)
            w_prompt = w_prompt.reshape(U, g, Hkv, rep, P).transpose(1, 2).reshape(U, Hkv, g * rep, P)
            o = torch.matmul(w_prompt, self.values[layer])  # [U, Hkv, g rep, Dv]
            Dv = o.shape[-1]
            o = o.view(U, Hkv, g, rep, Dv).transpose(1, 2).reshape(self.B, Hkv, rep, Dv)
            if pos is not None:
                o = o.index_select(0, pos)
            o = (o + torch.matmul(w[..., P:], own_v[:, :, : n + 1])).reshape(Bd, Hq, 1, Dv)
        return o.to(out_dtype)

    def keep(self, keep: torch.Tensor) -> None:
        """Only the decoding rows at indices `keep` (of those decoding now) go on: their own K/V buffers are kept."""
        pos = self.pos if self.pos is not None else torch.arange(self.own_k[0].shape[0], device=keep.device)
        self.pos = pos.index_select(0, keep)
        self.own_k = [t.index_select(0, keep) for t in self.own_k]
        self.own_v = [t.index_select(0, keep) for t in self.own_v]

    def advance(self) -> None:
        self.n += 1


def fast_decoder(lm: nn.Module, device_type: str) -> FastDecoder | None:
    """A FastDecoder for a dense Qwen3/Llama causal LM (MiniMind's or transformers' own), with the
    current autocast dtype on `device_type`; None for anything it does not reproduce exactly."""
    trunk, head = getattr(lm, "model", None), getattr(lm, "lm_head", None)
    if trunk is None or type(trunk).__name__ not in _SUPPORTED or not isinstance(head, nn.Linear) or head.bias is not None:
        return None
    cfg = trunk.config
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return None
    if getattr(cfg, "_attn_implementation", "sdpa") != "sdpa":
        return None  # eager/flex/hub kernels round differently
    for layer in trunk.layers:
        a, mlp = layer.self_attn, layer.mlp
        linears = [a.q_proj, a.k_proj, a.v_proj, a.o_proj, getattr(mlp, "gate_proj", None),
                   getattr(mlp, "up_proj", None), getattr(mlp, "down_proj", None)]
        if any(m is None or not foldable(m) for m in linears):
            return None  # MoE blocks, attention/MLP biases, LoRA layers in train mode or of other kinds
        if getattr(a, "sliding_window", None):
            return None  # a sliding-window layer (Qwen3 sets it per layer from layer_types)
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    if dtype is None and head.weight.dtype != torch.float32:
        return None  # low-precision weights without autocast: leave it to transformers
    reused = _REUSED.get(lm)
    if reused is None:
        return FastDecoder(lm, dtype, device_type)
    key = (device_type, dtype, tuple(p._version for p in lm.parameters()))  # in-place updates bump _version
    if reused.key != key:
        reused.key, reused.decoder = key, FastDecoder(lm, dtype, device_type)
    assert reused.decoder is not None
    return reused.decoder


@dataclass
class _Reused:
    """The decoder a reuse_decoder block shares, and what it was built from (device, dtype, weight versions)."""

    key: tuple | None = None
    decoder: FastDecoder | None = None


# The models inside a reuse_decoder block (weak: the cache never keeps a model alive).
_REUSED: weakref.WeakKeyDictionary[nn.Module, _Reused] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def reuse_decoder(model: nn.Module) -> Iterator[None]:
    """Within the block, every sample() of `model` decodes with one FastDecoder (one copy of the weights
    in the decode dtype) while the weights stay as they are: a step's rollout rounds (--filter_groups)
    share it. Rebuilt if the weights change in between; dropped at the end, so the copy never lives
    through the update."""
    lm = base_of(model)
    _REUSED[lm] = _Reused()
    try:
        yield
    finally:
        del _REUSED[lm]
