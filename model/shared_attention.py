"""Shared-prompt attention for the training forwards (scoring and the update): GRPO's rows repeat each prompt
num_generations times, so a padding-free batch holds each group's prompt once and every response of the group
attends to it (cascade attention, as model/fast_decode.py's SharedPrefix does while decoding). The trunk's
matmuls then run each prompt token once instead of once per row, and attention computes only what a row reads:
a prompt over itself (causal), a response over its prompt and itself (causal), never the responses beside it.

Registered with transformers' AttentionInterface as NAME. The packed layout (model/packing.py pack_rows) is a
SharedLayout, passed as the forward's `shared_layout` keyword, which transformers hands to every attention call;
the caller switches the model's attention implementation to NAME for that forward (`attention_implementation`).
Each attention call gathers the group's prompt queries, keys and values and each row's response ones from the
packed [bins * C] positions, attends (`kernel`: eager's math, or torch's SDPA), and scatters the outputs back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface

NAME = "minippo_shared_prompt"


@dataclass(frozen=True)
class SharedLayout:
    """Where each group's prompt and each row's response region sit in a packed batch (flat indices into its
    [bins * C] positions), and the masks of the two attentions. `kernel`: "eager" or "sdpa", the model's own."""

    prompt_at: torch.Tensor  # [G, Pm] each group's prompt tokens in order, padded with index 0
    prompt_ok: torch.Tensor  # [G, Pm] which are real
    response_at: torch.Tensor  # [B, Rm] each row's response-region tokens in order, padded with index 0
    response_ok: torch.Tensor  # [B, Rm]
    group: torch.Tensor  # [B] each row's group
    prompt_mask: torch.Tensor  # [G, 1, Pm, Pm] True: attend (causal over the real prompt; a pad query reads all)
    response_mask: torch.Tensor  # [B, 1, Rm, Pm + Rm] its group's real prompt, then its own real tokens causally
    kernel: str = "eager"

    @classmethod
    def build(cls, prompt_at: torch.Tensor, prompt_ok: torch.Tensor, response_at: torch.Tensor,
              response_ok: torch.Tensor, group: torch.Tensor, kernel: str) -> "SharedLayout":
        Pm, Rm = prompt_at.shape[1], response_at.shape[1]
        causal_p = torch.ones(Pm, Pm, dtype=torch.bool, device=prompt_at.device).tril()
        causal_r = torch.ones(Rm, Rm, dtype=torch.bool, device=prompt_at.device).tril()
        pm = causal_p[None] & prompt_ok[:, None, :]
        pm = pm | ~prompt_ok[:, :, None]  # a pad query reads everything: finite, and never scattered back
        own = causal_r[None] & response_ok[:, None, :]
        rm = torch.cat([prompt_ok[group][:, None, :].expand(-1, Rm, -1), own], dim=2)
        rm = rm | ~response_ok[:, :, None]
        return cls(prompt_at, prompt_ok, response_at, response_ok, group, pm[:, None], rm[:, None], kernel)


def _attend(module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float,
            dropout: float, kernel: str) -> torch.Tensor:
    """q [N, Lq, H, d], k/v [N, Lk, Hkv, d], mask [N, 1, Lq, Lk] -> [N, Lq, H, d]."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    rep = q.shape[1] // k.shape[1]
    if kernel == "sdpa":
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout if module.training else 0.0,
                                             scale=scaling, enable_gqa=rep > 1)
        return out.transpose(1, 2)
    if rep > 1:  # grouped-query attention: each key/value head serves `rep` query heads (eager's repeat_kv)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling
    weights = F.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, v).transpose(1, 2)


def shared_prompt_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                            shared_layout: SharedLayout | None = None, **kwargs: object) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [bins, H, C, d], key/value [bins, Hkv, C, d] -> ([bins, C, H, d],
    None). Needs `shared_layout`; the unused tails of the packed rows get zeros."""
    if shared_layout is None:
        raise RuntimeError(f"attention implementation {NAME!r} needs the forward's shared_layout keyword")
    lay = shared_layout
    bins, H, C, d = query.shape
    q = query.transpose(1, 2).reshape(bins * C, H, d)
    k = key.transpose(1, 2).reshape(bins * C, key.shape[1], d)
    v = value.transpose(1, 2).reshape(bins * C, value.shape[1], d)
    kp, vp = k[lay.prompt_at], v[lay.prompt_at]  # [G, Pm, Hkv, d]
    out_p = _attend(module, q[lay.prompt_at], kp, vp, lay.prompt_mask, scaling, dropout, lay.kernel)
    kr = torch.cat([kp[lay.group], k[lay.response_at]], dim=1)  # its group's prompt, then its own tokens
    vr = torch.cat([vp[lay.group], v[lay.response_at]], dim=1)
    out_r = _attend(module, q[lay.response_at], kr, vr, lay.response_mask, scaling, dropout, lay.kernel)
    out = out_p.new_zeros(bins * C, H, d)  # the attention's dtype (bf16 under autocast, where q may be fp32)
    out = out.index_put((lay.prompt_at[lay.prompt_ok],), out_p[lay.prompt_ok])
    out = out.index_put((lay.response_at[lay.response_ok],), out_r[lay.response_ok])
    return out.view(bins, C, H, d), None


AttentionInterface.register(NAME, shared_prompt_attention)
