"""Per-token log-probs and values of given sequences: the scoring and update forwards of a policy and a critic.

Positions: a batch is `sequences [B, P+R]` = left-padded prompt [B, P] + response [B, R].
The token at position P+t is predicted by the logits at position P+t-1, so the response's
log-probs come from the last R+1 logit positions minus the final one. Only those positions
are projected onto the vocabulary (`logits_to_keep`), and the log-softmax runs in fp32 chunks
of rows so no fp32 [B, T, vocab] tensor is ever materialised. Where the response tokens outnumber one chunk of
model/logprobs.py, the LM head itself yields their log-probs chunk by chunk: no [B, R, vocab] logits at all.
--padding_free runs the same forwards on model/packing.py's rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, overload

import torch
from torch import nn
from transformers import PreTrainedConfig

from .generation import kept_logprobs
from .logprobs import fused_chunk, logprobs_from_logits, scoring_head, split_scores
from .lora import base_of
from .packing import Packing, pack_rows, unpack
from .shared_attention import NAME as SHARED_ATTENTION


def _hf_models(module: nn.Module) -> list[nn.Module]:
    """The transformers models inside a policy or critic (DDP and peft unwrapped): those whose attention kernel
    can be set, the model itself (model/lora.py's reference and old-actor wrappers too) or its children (a critic's
    trunk)."""
    module = base_of(module)
    if hasattr(module, "set_attn_implementation"):
        return [module]
    return [m for m in module.children() if hasattr(m, "set_attn_implementation")]  # CriticModel.trunk


def _config(model: nn.Module) -> PreTrainedConfig | None:
    """The transformers config of the model that runs `model`'s attention; None for a model of its own code."""
    found = _hf_models(model)
    c = getattr(found[0] if found else model, "config", None)  # an nn.Module may have none
    return c if isinstance(c, PreTrainedConfig) else None


def _size(c: PreTrainedConfig, name: str) -> int:
    """An optional size field of a config (architectures name theirs differently): 0 where absent or None."""
    return getattr(c, name, None) or 0


@contextlib.contextmanager
def attention_implementation(impl: str | None, *models: nn.Module) -> Iterator[None]:
    """Run the block with another attention kernel ("eager", "sdpa", ...), then restore each model's own.
    None leaves the models alone. Every kernel computes the same attention; they differ in speed."""
    if not impl:
        yield
        return
    found = [m for model in models for m in _hf_models(model)]
    before = [m.config._attn_implementation for m in found]
    try:
        for m in found:
            if m.config._attn_implementation != impl:
                m.set_attn_implementation(impl)
        yield
    finally:
        for m, old in zip(found, before):
            if m.config._attn_implementation != old:
                m.set_attn_implementation(old)


def attention_break_even(model: nn.Module) -> float:
    """The context length c0 at which a token's attention costs its layer's matmuls: attention is 4 x heads x
    head_dim flops per (token, context token), the projections and MLP 2 x their weights per token, so
    c0 = weights / (2 x heads x head_dim) (SmolLM2-135M ~3,000, MiniMind 512x8 ~3,200). What pack_rows
    weighs a longer packed row's attention against fewer rows with.

    Infinite under a flash-attention kernel: its varlen kernel attends within each sequence (no C^2 square), and
    transformers reads packed sequences' bounds from position_ids only in a batch of one row (modeling_flash_
    attention_utils._is_packed_sequence), which an infinite c0 makes pack_rows choose."""
    c = _config(model)
    if c is None:
        return 1024.0
    if "flash" in str(c._attn_implementation):
        return float("inf")
    h = _size(c, "hidden_size")
    if not h:
        return 1024.0
    nh = _size(c, "num_attention_heads") or max(1, h // 64)
    hd = _size(c, "head_dim") or h // nh
    nkv = _size(c, "num_key_value_heads") or nh
    mlp = _size(c, "moe_intermediate_size") * _size(c, "num_experts_per_tok") or _size(c, "intermediate_size") or 4 * h
    weights = h * hd * (2 * nh + 2 * nkv) + 3 * h * mlp
    return weights / (2 * nh * hd)


def shares_prompts(model: nn.Module) -> str | None:
    """The attention kernel ("eager" or "sdpa") with which a packed forward of `model` may run a group's prompt once
    (Packing.shared, model/shared_attention.py), or None: its attention is another kernel (flash's varlen packing
    needs none of this) or some layer attends through a sliding window."""
    c = _config(model)
    impl = "" if c is None else str(c._attn_implementation)
    if c is None or impl not in ("sdpa", "eager"):
        return None
    found = _hf_models(model)
    base = found[0] if found else model
    # MiniMind's wrapper: its trunk's own config too (transformers' `base_model`; also through torch.compile)
    trunk = base.base_model.config if hasattr(base, "base_model") else None
    cfgs = [c, c.get_text_config(), *([trunk] if trunk is not None else [])]
    if any(getattr(x, "sliding_window", None) and getattr(x, "use_sliding_window", True) for x in cfgs):
        return None
    return impl if all(t == "full_attention" for x in cfgs for t in (getattr(x, "layer_types", None) or [])) else None


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """RoPE positions that skip left pads: the first real token is position 0 in every row."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def output_head(model: nn.Module) -> nn.Module | None:
    """The LM head (output embeddings) of a policy, through DDP, peft, FSDP2, torch.compile and model/lora.py's
    reference and old-actor wrappers (whose head is their actor's): the layer the chunked log-probs
    (model/logprobs.py) and the packed forwards project with. None where the model names none (its own code): the
    padded forward then runs, with the full logits."""
    base = base_of(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    return head if isinstance(head, nn.Module) else None


def _packed_call(model: nn.Module, pk: Packing, **kwargs: Any) -> Any:
    """model(packed rows): under the shared-prompt attention with its layout where pk has one."""
    if pk.shared is None:
        return model(input_ids=pk.input_ids, attention_mask=None, position_ids=pk.position_ids, **kwargs)
    with attention_implementation(SHARED_ATTENTION, model):
        return model(input_ids=pk.input_ids, attention_mask=None, position_ids=pk.position_ids, shared_layout=pk.shared,
                     **kwargs)


@contextlib.contextmanager
def _head_reads(head: nn.Module, rows: torch.Tensor) -> Iterator[None]:
    """Within the block, `head` projects only the hidden states at flat indices `rows` [M, R] (of its input's
    [bins * C] positions): the packed twin of logits_to_keep, the vocabulary projection of the needed tokens only."""
    def pre(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        h = args[0]
        return (h.reshape(-1, h.shape[-1])[rows], *args[1:])

    handle = head.register_forward_pre_hook(pre)
    try:
        yield
    finally:
        handle.remove()


Keep = tuple[int, float]  # (top_k, top_p): the sampler's filters (model/generation.py filter_logits)
Scored = tuple[torch.Tensor, torch.Tensor | None]  # log-probs [B, R] and entropy [B, R] (or None)


def _with_kept(scored: Scored, kept: torch.Tensor | None) -> Any:
    """policy_forward's outputs: (log-probs, entropy), + the kept log-probs where asked for (keep)."""
    return scored if kept is None else (*scored, kept)


def _kept_from_logits(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, keep: Keep,
                      chunk_rows: int = 8) -> torch.Tensor:
    """kept_logprobs [B, R] from logits [B, R, V], `chunk_rows` rows at a time (its fp32 temporaries are [rows, R, V])."""
    return torch.cat([kept_logprobs(logits[s : s + chunk_rows], tokens[s : s + chunk_rows], temperature, *keep)
                      for s in range(0, logits.shape[0], chunk_rows)])


def _packed_policy_forward(model: nn.Module, head: nn.Module, sequences: torch.Tensor, pk: Packing, temperature: float,
                           with_entropy: bool, keep: Keep | None) -> Any:
    R = pk.at.shape[1]
    tokens = sequences[:, -R:][pk.at]  # [N]
    N = tokens.numel()
    chunk = fused_chunk(model, head, N)
    if chunk and isinstance(head, nn.Linear):  # model/logprobs.py: the N positions by chunks, no [M, R, vocab] logits
        with _head_reads(head, pk.before.view(1, N)), scoring_head(head, tokens.view(1, N), temperature, chunk,
                                                                   with_entropy, keep=keep):
            out = _packed_call(model, pk, use_cache=False, logits_to_keep=0)
        lp, ent = split_scores(out.logits[0], with_entropy)
        return _with_kept((unpack(lp, pk.at), (unpack(ent, pk.at) if ent is not None else None)),
                          None if keep is None else unpack(out.logits[0][..., -1], pk.at))
    M = max(1, -(-N // R))  # the needed positions in rows of R, as the padded path's [B, R] logits (its memory)
    rows = torch.nn.functional.pad(pk.before, (0, M * R - N)).view(M, R)  # the fill reads position 0, unused
    with _head_reads(head, rows):
        out = _packed_call(model, pk, use_cache=False, logits_to_keep=0)
    padded = torch.nn.functional.pad(tokens, (0, M * R - N)).view(M, R)
    lp, ent = logprobs_from_logits(out.logits, padded, temperature, with_entropy=with_entropy)
    return _with_kept((unpack(lp.flatten()[:N], pk.at), (unpack(ent.flatten()[:N], pk.at) if ent is not None else None)),
                      None if keep is None else unpack(_kept_from_logits(out.logits, padded, temperature, keep).flatten()[:N], pk.at))


@overload
def policy_forward(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor, response_len: int,
                   temperature: float = ..., with_entropy: bool = ..., padding_free: bool = ...,
                   keep: None = None) -> Scored: ...
@overload
def policy_forward(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor, response_len: int,
                   temperature: float = ..., with_entropy: bool = ..., padding_free: bool = ...,
                   *, keep: Keep) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]: ...
def policy_forward(
    model: nn.Module,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    padding_free: bool = False,
    keep: Keep | None = None,
) -> Any:
    """Per-token log-probs [B, R] (and entropy) of the last `response_len` tokens of `sequences`. `padding_free`:
    on the rows packed without pad tokens (pack_rows) where that removes any; the same values to rounding at
    every real response token, 0 at the response region's pads (the padded forward leaves unused values there).

    `keep` (top_k, top_p; scoring only, no gradient): a third output [B, R] from the same forward, each token's
    log-prob under the sampler's filtered distribution (model/generation.py kept_logprobs: renormalised over the
    kept tokens, as vLLM's processed log-probs are): the old log-probs of the rollout-IS weights (train_ppo.py score)."""
    head = output_head(model)
    pk = pack_rows(sequences, attention_mask, response_len, attention_break_even(model),
                   shares_prompts(model)) if head is not None and padding_free else None
    if head is not None and pk is not None:
        return _packed_policy_forward(model, head, sequences, pk, temperature, with_entropy, keep)
    tokens = sequences[:, -response_len:]
    chunk = fused_chunk(model, head, tokens.numel())
    kw = dict(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask),
              use_cache=False, logits_to_keep=response_len + 1)
    if chunk and isinstance(head, nn.Linear):  # model/logprobs.py: by chunks of tokens, no [B, R, vocab] logits
        with scoring_head(head, tokens, temperature, chunk, with_entropy, drop_last=True, keep=keep):
            scores = model(**kw).logits
        return _with_kept(split_scores(scores, with_entropy), None if keep is None else scores[..., -1])
    out = model(**kw)
    logits = out.logits[:, :-1, :]  # [B, R, V]: position P+t-1 predicts response token t
    return _with_kept(logprobs_from_logits(logits, tokens, temperature, with_entropy=with_entropy),
                      None if keep is None else _kept_from_logits(logits, tokens, temperature, keep))


def critic_forward(critic: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor, response_len: int,
                   padding_free: bool = False) -> torch.Tensor:
    """Values [B, R]: V(s_t) read at the position of the token *before* response token t.

    The state before emitting response token t is the prefix ending at position P+t-1, which is
    where the policy's logits for token t come from; values use the same alignment. `padding_free`: as
    policy_forward's (0 at the response region's pads).
    """
    pk = pack_rows(sequences, attention_mask, response_len, attention_break_even(critic),
                   shares_prompts(critic)) if padding_free else None
    if pk is not None:  # the head is one [hidden, 1] matmul: every packed position, then the needed ones
        packed = _packed_call(critic, pk, values_to_keep=0)
        return unpack(packed.flatten()[pk.before], pk.at)
    values = critic(
        sequences, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask),
        values_to_keep=response_len + 1,
    )  # [B, R+1]
    return values[:, :-1]


def forward_in_row_chunks(fn: Callable[..., Any], model: nn.Module, sequences: torch.Tensor,
                          attention_mask: torch.Tensor, *args: Any, rows: int = 0, **kwargs: Any) -> Any:
    """fn(model, sequences, attention_mask, *args, **kwargs) over `rows` rows at a time (< 1: all at
    once, one call exactly as before), its tensor outputs (or each tensor of a tuple; None stays None)
    concatenated along rows. For the scoring forwards under no_grad: a forward over every row of the
    rollout holds [rows, R, vocab] logits at once (tens of GB at a 150k vocabulary, 64 rows x 512
    tokens); in chunks the peak is one chunk's. Rows are independent (per-row masks and positions)."""
    n = sequences.shape[0]
    if rows < 1 or rows >= n:
        return fn(model, sequences, attention_mask, *args, **kwargs)
    parts = [fn(model, sequences[s : s + rows], attention_mask[s : s + rows], *args, **kwargs) for s in range(0, n, rows)]
    if isinstance(parts[0], tuple):
        return tuple(None if col[0] is None else torch.cat(col) for col in zip(*parts))
    return torch.cat(parts)
