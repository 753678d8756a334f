"""Per-token log-probs (and entropy) under softmax(logits / T), in fp32: from logits a few rows at a time
(logprobs_from_logits, the plain path), or straight from hidden states and the LM head, in token chunks: the scoring
and update path that never holds the [rows, tokens, vocab] logits (issue #74.4; TRL's fused LM-head log-prob kernel,
Liger's fused linear cross-entropy).

At a Qwen-class vocabulary (151,936) the logits are the largest tensor of a step: 0.6 GB in fp32 per 1,024-token
row, held from the forward to the backward, and the same again as their gradient. Here each chunk of `chunk` tokens
is projected, reduced to its log-prob (and entropy) and dropped; the backward projects each chunk again and forms
the gradients of the hidden states and of the head's weight (and bias) from it. The cost: one more head matmul in
the backward (none where the head is frozen: LoRA). The ops per chunk are model/generation.py's token_logprobs' (the
sampler's and the plain path's) in buffers reused across chunks, so the values are the plain path's to fp32 rounding.

The model's own forward still runs (`scoring_head` swaps its head's forward for the block), so DDP, FSDP2's
all-gathers (the head belongs to the root group: its weight is whole inside the forward and kept for the backward),
peft and the frozen LoRA copies work unchanged; its "logits" are then [..., 1] log-probs (+ entropy: [..., 2]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .generation import kept_logprobs, token_logprobs
from .lora import base_of

# Tokens per chunk: -1 = auto (as many as keep one fp32 [chunk, vocab] temporary within CHUNK_ELEMENTS: 110 tokens at
# 151,936; for a head that trains, only past TRAINED_HEAD_BYTES of logits, see fused_chunk), 0 = off (the plain
# [rows, tokens, vocab] logits path), N = N tokens wherever they are more than one chunk. Read at each call
# (benchmarks/bench_ppo.py's --logprob_chunk_size sets it).
CHUNK_SIZE = -1
# Auto and a trained head: chunks cost one more [tokens, H] x [H, vocab] matmul in the backward (the softmax again for
# the head's gradient), so they are taken only where the fp32 logits would pass this (1 GiB: SmolLM2's preset, 32 rows
# of 64 tokens at 49,152, 0.4 GB, stays below; 4 rows of 1,024 tokens at 151,936 are 2.5 GB, their gradient as much
# again). Past it they were no slower on a CPU (docs/speed-and-memory.md), below it the extra matmul shows.
TRAINED_HEAD_BYTES = 1 << 30
CHUNK_ELEMENTS = 1 << 24  # 64 MB per fp32 [chunk, vocab] temporary; a few are alive at once
# A GPU wants longer chunks: each projection streams the whole [V, H] weight, which costs no more than the
# chunk's matmul only from ~400 tokens on (an H100's bf16 FLOP/s over its memory bandwidth).
CHUNK_ELEMENTS_CUDA = 1 << 26
# Config fields by which a model transforms its head's output (soft-capping, scaling): such models keep the plain path.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_logit_scale")


def chunk_tokens(vocab: int, setting: int | None = None, device_type: str = "cpu") -> int:
    """Tokens per chunk for a head of `vocab` outputs on `device_type` under `setting` (CHUNK_SIZE when None);
    0 = off."""
    setting = CHUNK_SIZE if setting is None else setting
    if setting < 0:
        return max(1, (CHUNK_ELEMENTS_CUDA if device_type == "cuda" else CHUNK_ELEMENTS) // max(1, vocab))
    return setting


def _transforms_logits(model: nn.Module) -> bool:
    cfg = getattr(model, "config", None)
    cfgs = [c for c in (cfg, getattr(cfg, "get_text_config", lambda: None)()) if c is not None]
    neutral = (None, 0, 1, 1.0, False)  # logit_scale 1 / softcap None: no transform
    return any(getattr(c, k, None) not in neutral for c in cfgs for k in _LOGIT_TRANSFORMS)


def fused_chunk(model: nn.Module, head: nn.Module | None, n_tokens: int, setting: int | None = None) -> int:
    """Tokens per chunk with which `model`'s log-probs of `n_tokens` positions take the chunked path, or 0: the plain
    logits path. Plain where it saves nothing (every token fits one chunk), where the head is not a linear layer,
    where the model transforms its head's output (soft-capping, scaling), or where the model is compiled
    (torch.compile traced the head's own forward). Under auto (setting -1) chunks cost no extra matmul in scoring
    (no grad) and with a frozen head (LoRA); a head that trains here takes them only past TRAINED_HEAD_BYTES of fp32
    logits, as its backward projects every chunk again."""
    if head is None or not isinstance(head, nn.Linear) or isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        return 0
    if getattr(model, "_compiled_call_impl", None) is not None:  # module.compile()
        return 0
    setting = CHUNK_SIZE if setting is None else setting
    chunk = chunk_tokens(head.out_features, setting, head.weight.device.type)
    if chunk <= 0 or n_tokens <= chunk:
        return 0
    trains = torch.is_grad_enabled() and head.weight.requires_grad
    if setting < 0 and trains and n_tokens * head.out_features * 4 < TRAINED_HEAD_BYTES:
        return 0
    return 0 if _transforms_logits(base_of(model)) else chunk  # DDP, peft; model/lora.py's wrappers: their actor's config


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype nn.Linear would compute the logits in: autocast's where it is on, else the weight's."""
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return weight.dtype


def logprobs_from_logits(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, chunk_rows: int = 8, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(token) under softmax(logits / T), in fp32, `chunk_rows` rows at a time.

    logits [B, R, V] (any dtype), tokens [B, R] -> logprobs [B, R] fp32 (and entropy [B, R]).
    The temperature matches the sampler's, so the ratio's denominator is the policy that sampled.

    With grad (the update) _TokenLogprobs gives the same values, but autograd keeps no fp32
    log-softmax [B, R, V] alive until backward (twice the bf16 logits' size): only the logits are
    saved, the softmax is recomputed in backward. Under no_grad, this loop as it always was.
    """
    if torch.is_grad_enabled() and logits.requires_grad:
        return _TokenLogprobs.apply(logits, tokens, temperature, with_entropy)
    out, ents = [], []
    for s in range(0, logits.shape[0], chunk_rows):
        lp, ent = token_logprobs(logits[s : s + chunk_rows], tokens[s : s + chunk_rows], temperature, with_entropy)
        out.append(lp)
        ents.append(ent)
    return torch.cat(out), (torch.cat(ents) if with_entropy else None)


class _TokenLogprobs(torch.autograd.Function):
    """logprobs_from_logits for the update: the same values, a backward that recomputes the softmax.

    Forward: token_logprobs, the no-grad path's ops, one row at a time.
    Saved: the logits (which the model made anyway), the tokens and the entropy [B, R]; no fp32
    [B, R, V] tensor. Backward, one row at a time into one gradient tensor of the logits' dtype (fp32
    temporaries are [R, V]; autograd through sliced chunks would also allocate a zero-filled [B, R, V]
    gradient per chunk):
      log-prob part: autograd's own ops (gather's scatter, log_softmax's backward kernel on the
        recomputed log-softmax, / T), so the gradient is bit-identical to the plain formula's and the
        CPU fp32 demo trains exactly as before;
      entropy part (entropy_coef > 0): dH/du = -p * (logp + H), u = logits / T, equal to autograd's
        to rounding."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, tokens: torch.Tensor, temperature: float,
                with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Row by row: the fp32 temporaries are [R, V] and none outlives its row. The log-softmax and
        # entropy are per position, so the values are the no-grad path's 8-row chunks' bit for bit.
        out, ents = [], []
        for b in range(logits.shape[0]):
            lp, ent = token_logprobs(logits[b : b + 1], tokens[b : b + 1], temperature, with_entropy)
            out.append(lp)
            ents.append(ent)
        lp, ent = torch.cat(out), (torch.cat(ents) if with_entropy else None)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None, not a zero [B, R] tensor
        ctx.save_for_backward(logits, tokens, ent)
        return lp, ent

    @staticmethod
    def backward(ctx: Any, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        logits, tokens, ent = ctx.saved_tensors
        T = ctx.temperature
        if g_lp is None and g_ent is None:
            return None, None, None, None
        grad = torch.empty_like(logits)
        for b in range(logits.shape[0]):
            u = logits[b].float()  # [R, V], as token_logprobs computes it
            if T != 1.0:
                u = u / T
            logp = torch.log_softmax(u, dim=-1)
            del u
            if g_lp is not None:  # gather's backward, then log_softmax's (the kernel autograd calls)
                g_logp = torch.zeros_like(logp).scatter_add_(-1, tokens[b].unsqueeze(-1), g_lp[b].unsqueeze(-1))
                g_u = torch._log_softmax_backward_data(g_logp, logp, -1, logp.dtype)
                del g_logp
            if g_ent is not None:  # -g_H * p * (logp + H), computed in logp's memory
                p = logp.exp()
                g_h = logp.add_(ent[b].unsqueeze(-1)).mul_(p).mul_(-g_ent[b].unsqueeze(-1))
                del p
                g_u = g_u.add_(g_h) if g_lp is not None else g_h
            if T != 1.0:
                g_u = g_u / T  # DivBackward's op
            grad[b].copy_(g_u)  # to the logits' dtype, as .float()'s backward casts
        return grad, None, None, None


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                  temperature: float = 1.0, chunk: int = 128,
                  with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(target) under softmax(F.linear(hidden, weight, bias) / T) in fp32 (and that distribution's entropy),
    `chunk` tokens at a time. hidden [N, H], weight [V, H], targets [N] -> [N] fp32. Differentiable in hidden,
    weight and bias; the backward recomputes each chunk's logits."""
    cd = _compute_dtype(hidden, weight)
    return _ChunkedHeadLogprobs.apply(hidden, weight, bias, targets, float(temperature), max(1, int(chunk)),
                                      bool(with_entropy), cd, torch.is_grad_enabled())


class _Buffers:
    """Three fp32 [chunk, V] buffers every chunk of one call reuses. Fresh tensors of that size would each be
    mmap'ed and page-faulted in by glibc's malloc (past its 32 MB threshold) on every chunk."""

    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        self.a, self.b, self.c = (torch.empty(rows, vocab, dtype=torch.float32, device=device) for _ in range(3))

    def __call__(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.a[:n], self.b[:n], self.c[:n]


def _logits_into(out: torch.Tensor, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, T: float) -> None:
    """out [C, V] fp32 = F.linear(h, w, b) in w's dtype, as fp32, / T: token_logprobs' u = logits.float() / T."""
    if w.dtype == torch.float32:
        if b is None:
            torch.mm(h, w.t(), out=out)
        else:
            torch.addmm(b, h, w.t(), out=out)
    else:
        out.copy_(F.linear(h, w, b))
    if T != 1.0:
        out.div_(T)


class _ChunkedHeadLogprobs(torch.autograd.Function):
    """Forward: per chunk, the logits in the compute dtype (nn.Linear's under autocast), then token_logprobs' ops
    (model/generation.py: fp32, / T, log-softmax, gather; entropy -sum(p logp)) into reused buffers.
    Saved: hidden [N, H] (the head's input, which nn.Linear saves too), the weight, targets, entropy [N].
    Backward: per chunk, the logits again, then their gradient (_logits_grad); grad_h = g W, grad_W += g^T h (summed
    in fp32), grad_b += sum g. A frozen head: grad_h from the forward's per-token d/dh, no second projection."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                temperature: float, chunk: int, with_entropy: bool, cd: torch.dtype,
                grad_enabled: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        N = hidden.shape[0]
        lp = torch.empty(N, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(N, dtype=torch.float32, device=hidden.device) if with_entropy else None
        w, b = weight.to(cd), None if bias is None else bias.to(cd)
        # A frozen head (LoRA) with a trained trunk: each token's log-prob (and entropy) depends on its own hidden
        # state only, so d lp / d h [N, H] is formed here from the chunk's logits and the backward only scales it by
        # the incoming gradient: no second projection. A trained head needs the softmax again for its [V, H] gradient.
        jac = grad_enabled and ctx.needs_input_grad[0] and not any(ctx.needs_input_grad[1:3])
        j_lp = torch.empty_like(hidden) if jac else None
        j_ent = torch.empty_like(hidden) if jac and with_entropy else None
        buf = _Buffers(min(chunk, N), weight.shape[0], hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):  # the casts are explicit: the backward repeats them
            for s in range(0, N, chunk):
                h = hidden[s : s + chunk].to(cd)
                t = targets[s : s + chunk]
                u, logp, tmp = buf(h.shape[0])
                _logits_into(u, h, w, b, temperature)
                torch._log_softmax(u, -1, False, out=logp)
                lp[s : s + chunk] = logp.gather(-1, t.unsqueeze(-1)).squeeze(-1)
                if ent is not None:
                    torch.exp(logp, out=tmp)
                    ent[s : s + chunk] = tmp.mul_(logp).sum(-1).neg_()
                if j_lp is not None:
                    ones = torch.ones(h.shape[0], dtype=torch.float32, device=h.device)
                    j_lp[s : s + chunk] = _logits_grad(u, logp, tmp, t, temperature, ones, None, None, cd) @ w
                    if j_ent is not None and ent is not None:
                        _logits_into(u, h, w, b, temperature)  # _logits_grad used u and logp as scratch
                        torch._log_softmax(u, -1, False, out=logp)
                        j_ent[s : s + chunk] = _logits_grad(u, logp, tmp, t, temperature, None, ones,
                                                            ent[s : s + chunk], cd) @ w
        del buf
        ctx.temperature, ctx.chunk, ctx.cd = temperature, chunk, cd
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None, not a zero [N] tensor
        ctx.save_for_backward(hidden, weight, bias, targets, ent, j_lp, j_ent)
        return lp, ent

    @staticmethod
    def backward(ctx: Any, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, ent, j_lp, j_ent = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        none = (None,) * 9
        if (g_lp is None and g_ent is None) or not (need_h or need_w or need_b):
            return none
        if j_lp is not None:  # frozen head: the forward's d lp / d h (and d H / d h), scaled
            grad = torch.zeros_like(hidden) if g_lp is None else j_lp * g_lp.unsqueeze(-1).to(j_lp.dtype)
            if g_ent is not None and j_ent is not None:
                grad = grad + j_ent * g_ent.unsqueeze(-1).to(j_ent.dtype)
            return (grad, *none[1:])
        T, C, cd = ctx.temperature, ctx.chunk, ctx.cd
        N = hidden.shape[0]
        w, b = weight.to(cd), None if bias is None else bias.to(cd)
        grad_h = torch.empty_like(hidden) if need_h else None
        # fp32 sums over chunks (a bf16 running sum would lose the small chunks' terms)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b and bias is not None else None
        buf = _Buffers(min(C, N), weight.shape[0], hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, N, C):
                h = hidden[s : s + C].to(cd)
                u, logp, tmp = buf(h.shape[0])
                _logits_into(u, h, w, b, T)
                torch._log_softmax(u, -1, False, out=logp)
                g = _logits_grad(u, logp, tmp, targets[s : s + C], T,
                                 None if g_lp is None else g_lp[s : s + C], None if g_ent is None else g_ent[s : s + C],
                                 None if ent is None else ent[s : s + C], cd)
                if grad_h is not None:
                    grad_h[s : s + C] = g @ w
                if grad_w is not None:
                    if cd == torch.float32:
                        grad_w.addmm_(g.t(), h)
                    else:
                        grad_w += g.t() @ h
                if grad_b is not None:
                    grad_b += g.sum(0)
                del g, h
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None, None, None)


def _logits_grad(u: torch.Tensor, logp: torch.Tensor, tmp: torch.Tensor, targets: torch.Tensor, T: float,
                 g_lp: torch.Tensor | None, g_ent: torch.Tensor | None, ent: torch.Tensor | None,
                 cd: torch.dtype) -> torch.Tensor:
    """The gradient of one chunk's logits [C, V] (in the compute dtype `cd`) from its log-probs' and entropies'
    gradients [C], as _TokenLogprobs forms it: gather's and log_softmax's backward (the kernel
    autograd calls), dH/du = -p (logp + H) with u = logits / T, then / T. `logp` holds the chunk's log-softmax; it,
    `u` and `tmp` are overwritten (the result lives in one of them, or is a fresh `cd` tensor)."""
    g_u: torch.Tensor | None = None
    if g_lp is not None:
        g_logp = tmp.zero_().scatter_add_(-1, targets.unsqueeze(-1), g_lp.unsqueeze(-1))
        g_u = torch._log_softmax_backward_data(g_logp, logp, -1, torch.float32, out=u)
    if g_ent is not None and ent is not None:  # -g_H * p * (logp + H), computed in logp's memory
        p = torch.exp(logp, out=tmp)
        g_h = logp.add_(ent.unsqueeze(-1)).mul_(p).mul_(-g_ent.unsqueeze(-1))
        g_u = g_h if g_u is None else g_u.add_(g_h)
    assert g_u is not None
    if T != 1.0:
        g_u = g_u.div_(T)
    return g_u.to(cd)  # the plain path's logits gradient is in the logits' dtype


@torch.no_grad()
def head_kept_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                       temperature: float, chunk: int, top_k: int, top_p: float) -> torch.Tensor:
    """model/generation.py kept_logprobs (the sampler's top-k / top-p distribution, renormalised; -inf where a target
    was cut) from the head, `chunk` tokens at a time: the filters are per token over its whole vocabulary row, which a
    chunk of tokens holds. Each chunk is projected again (one more head matmul, in scoring only). hidden [N, H] -> [N].
    No gradient: it only weighs an engine's samples (trainer/ppo.py rollout_is_weights)."""
    cd = _compute_dtype(hidden, weight)
    w, b = weight.to(cd), None if bias is None else bias.to(cd)
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):
        for s in range(0, hidden.shape[0], chunk):  # the logits in the compute dtype, as nn.Linear's and the plain path's
            out[s : s + chunk] = kept_logprobs(F.linear(hidden[s : s + chunk].to(cd), w, b), targets[s : s + chunk],
                                               temperature, top_k, top_p)
    return out


@contextlib.contextmanager
def scoring_head(head: nn.Linear, targets: torch.Tensor, temperature: float, chunk: int, with_entropy: bool,
                 drop_last: bool = False, keep: tuple[int, float] | None = None) -> Iterator[None]:
    """Within the block, `head`'s forward returns, in place of logits, the log-prob of `targets` at each of its input
    positions ([..., 1], fp32) and, with_entropy, the entropy beside it ([..., 2]), by head_logprobs; `keep` (top_k,
    top_p) adds, last, the log-prob under the sampler's filtered distribution (head_kept_logprobs). Its input
    [..., H] must have targets' shape before H (after dropping the last position, `drop_last`: the padded path's
    logits_to_keep = R + 1). Hooks on the head (FSDP2's, the trainer's pre-hooks) run as before."""
    had = "forward" in head.__dict__
    before = head.__dict__.get("forward")

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if drop_last:
            hidden = hidden[..., :-1, :]
        if hidden.shape[:-1] != targets.shape:
            raise ValueError(f"scoring_head: hidden states {tuple(hidden.shape)} do not match targets {tuple(targets.shape)}")
        lp, ent = head_logprobs(hidden.reshape(-1, hidden.shape[-1]), head.weight, head.bias, targets.reshape(-1),
                                temperature, chunk, with_entropy)
        cols = [lp] if ent is None else [lp, ent]
        if keep is not None:
            cols.append(head_kept_logprobs(hidden.reshape(-1, hidden.shape[-1]), head.weight, head.bias,
                                           targets.reshape(-1), temperature, chunk, *keep))
        out = torch.stack(cols, dim=-1)
        return out.view(*targets.shape, out.shape[-1])

    head.forward = forward  # type: ignore[method-assign]  # on this instance only, put back below
    try:
        yield
    finally:
        if had:
            head.forward = before  # type: ignore[method-assign]  # the instance's own forward, as it was
        else:
            del head.forward


def split_scores(scores: torch.Tensor, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """scoring_head's output [..., 1 or 2 (+ 1 with keep, last)] -> log-probs [...] and entropy [...] (or None)."""
    return scores[..., 0], (scores[..., 1] if with_entropy else None)
