"""Rollout mechanics: sample responses, then per-token log-probs and values for given sequences.

Positions: a batch is `sequences [B, P+R]` = left-padded prompt [B, P] + response [B, R].
The token at position P+t is predicted by the logits at position P+t-1, so the response's
log-probs come from the last R+1 logit positions minus the final one. Only those positions
are projected onto the vocabulary (`logits_to_keep`), and the log-softmax runs in fp32 chunks
of rows so no fp32 [B, T, vocab] tensor is ever materialised. Where the response tokens outnumber one chunk of
model/logprobs.py, the LM head itself yields their log-probs chunk by chunk: no [B, R, vocab] logits at all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, overload

import torch
from torch import nn

from model.generation import Samples, distinct_prompts, kept_logprobs, sample, token_logprobs
from model.logprobs import fused_chunk, scoring_head, split_scores
from model.shared_attention import NAME as SHARED_ATTENTION
from model.shared_attention import SharedLayout
from trainer.engine import Engine, exits_on_engine_error
from trainer.ppo import masked_mean
from trainer.runtime import Models, Runtime, on

if TYPE_CHECKING:
    from trainer.config import Config


def _hf_models(module: nn.Module) -> list[nn.Module]:
    """The transformers models inside a (DDP-wrapped) policy or critic."""
    module = getattr(module, "module", module)
    if hasattr(module, "set_attn_implementation"):
        return [module]
    return [m for m in module.children() if hasattr(m, "set_attn_implementation")]  # CriticModel.trunk


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


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """RoPE positions that skip left pads: the first real token is position 0 in every row."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


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
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, temperature: float,
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
    def backward(ctx, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
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


@dataclass(frozen=True)
class Packing:
    """A padded batch's real tokens packed into fewer, shorter rows (--padding_free; TRL's padding_free, verl's
    remove-padding): rows are placed whole, first-fit by decreasing length, into bins of one width (pack_rows);
    each keeps its own positions from 0, and transformers keeps attention within each of them (masking_utils'
    `find_packed_sequence_indices`: with no 2D attention mask, a position that does not follow its left
    neighbour by 1 starts a new sequence; the tail of a bin that no row fills is a sequence of its own).

    input_ids, position_ids [bins, C]: the model's input. `at` [B, R]: each real response-region token
    (attention_mask 1) with a real token before it in its row (its prompt, or its earlier turns); `before`:
    the flat index into the packed [bins * C] of the token before each of those, in `at`'s row-major order:
    the position whose logits (whose value) belong to it, as position P+t-1 in the padded layout.

    `shared` (GRPO's groups: rows that share a prompt): one packed row holding each group's prompt once, then its
    rows' response regions, each at its padded-path position; the forward runs model/shared_attention.py's
    attention over it (a response reads its prompt and itself), so the log-probs, values and gradients are the
    padded path's to rounding with each prompt token run once. None: every row whole, transformers finding the
    rows from position_ids."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    at: torch.Tensor
    before: torch.Tensor
    shared: SharedLayout | None = None

    @property
    def kept(self) -> int:
        """Token slots of the packed rows (real tokens + the bins' unused tails)."""
        return self.input_ids.numel()


def attention_break_even(model: nn.Module) -> float:
    """The context length c0 at which a token's attention costs its layer's matmuls: attention is 4 x heads x
    head_dim flops per (token, context token), the projections and MLP 2 x their weights per token, so
    c0 = weights / (2 x heads x head_dim) (SmolLM2-135M ~3,000, MiniMind 512x8 ~3,200). What pack_rows
    weighs a longer packed row's attention against fewer rows with.

    Infinite under a flash-attention kernel: its varlen kernel attends within each sequence (no C^2 square), and
    transformers reads packed sequences' bounds from position_ids only in a batch of one row (modeling_flash_
    attention_utils._is_packed_sequence), which an infinite c0 makes pack_rows choose."""
    found = _hf_models(model)
    c = getattr(found[0] if found else model, "config", None)
    if "flash" in str(getattr(c, "_attn_implementation", "")):
        return float("inf")
    h = getattr(c, "hidden_size", None)
    if not h:
        return 1024.0
    nh = getattr(c, "num_attention_heads", None) or max(1, h // 64)
    hd = getattr(c, "head_dim", None) or h // nh
    nkv = getattr(c, "num_key_value_heads", None) or nh
    mlp = (getattr(c, "moe_intermediate_size", 0) * getattr(c, "num_experts_per_tok", 0)
           or getattr(c, "intermediate_size", 0) or 4 * h)
    weights = h * hd * (2 * nh + 2 * nkv) + 3 * h * mlp
    return weights / (2 * nh * hd)


def _first_fit(lengths: list[int], capacity: int) -> tuple[list[int], list[int]]:
    """Rows placed whole, first-fit by decreasing length (ties in row order), into bins of `capacity`: each row's
    first flat index in the packed [bins * capacity], and the tokens in each bin."""
    used: list[int] = []
    start = [0] * len(lengths)
    for b in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        k = next((i for i, u in enumerate(used) if u + lengths[b] <= capacity), len(used))
        if k == len(used):
            used.append(0)
        start[b] = k * capacity + used[k]
        used[k] += lengths[b]
    return start, used


PACK_TRIES = 16  # packed row widths tried per batch


def _widths(lengths: list[int]) -> list[int]:
    """The packed row widths pack_rows tries: the longest row's length (never more work than padded), and the
    total's share of k rows for k from 1 up to the rows' count in PACK_TRIES geometric steps (wider rows pack
    tighter, at the cost of attention over more context)."""
    longest, total, B = max(max(lengths), 1), sum(lengths), len(lengths)
    ks = {max(1, round(B ** (i / (PACK_TRIES - 1)))) for i in range(PACK_TRIES)}
    return sorted({longest} | {max(longest, -(-total // k)) for k in ks})


def pack_rows(sequences: torch.Tensor, attention_mask: torch.Tensor, response_len: int,
              break_even: float = 1024.0, share_prompts: str | None = None) -> Packing | None:
    """The padding-free layout of a padded batch [B, P+R] (left-padded prompts, right-padded or multi-turn
    responses: any row whose attention_mask marks its real tokens), or None where it would not be cheaper.

    Bins of width C (_widths: at the longest row's length two rows share a bin only if they fit in it, so wider
    bins pack tighter) cost bins x C x (1 + C / c0) in the model, c0 = `break_even` (attention_break_even:
    attention, all C x C of it under a packed mask, against the matmuls per token); the cheapest width wins if it
    is cheaper than the padded B x T x (1 + T / c0). `share_prompts` (the attention kernel, "eager" or "sdpa",
    where the model may share them: `shares_prompts`): rows that repeat a prompt may instead pack as one row with
    each prompt once (Packing.shared), which costs its tokens plus the attention each row reads / c0. One host
    read of the row lengths; the placement is deterministic."""
    real = attention_mask.bool()
    B, T = real.shape
    P = T - response_len
    lengths = real.sum(1).tolist()
    cost = lambda rows, width: rows * width * (1.0 + width / break_even)  # noqa: E731
    best: tuple[float, tuple[int, list[int], list[int]] | None] = (cost(B, T), None)
    one_row = break_even == float("inf")  # flash-attention: one row, also where more would tie (attention_break_even)
    for C in [sum(lengths)] if one_row else _widths(lengths):
        start, used = _first_fit(lengths, C)
        if cost(len(used), C) < best[0]:
            best = (cost(len(used), C), (C, start, used))
    groups = _prompt_groups(sequences, real, P) if share_prompts and P > 0 else None
    if groups is not None:
        p_len, r_len = real[:, :P].sum(1).tolist(), real[:, P:].sum(1).tolist()
        tokens = sum(p_len[g[0]] + sum(r_len[b] for b in g) for g in groups)
        pairs = sum(p_len[g[0]] ** 2 / 2 + sum(r_len[b] * (p_len[b] + r_len[b] / 2) for b in g) for g in groups)
        if tokens * (1.0 + (pairs / tokens) / break_even) < best[0]:
            return _pack_groups(sequences, real, P, groups, share_prompts)
    if best[1] is None:
        return None
    C, start, used = best[1]
    dev = sequences.device
    j = real.long().cumsum(1) - 1  # each real token's position in its row (the padded path's position ids)
    flat = torch.tensor(start, device=dev)[:, None] + j  # [B, T], meaningful where real
    n = len(used) * C
    input_ids = torch.zeros(n, dtype=sequences.dtype, device=dev).index_put_((flat[real],), sequences[real])
    tail = (torch.arange(C, device=dev)[None, :] - torch.tensor(used, device=dev)[:, None]).clamp(min=0)
    position_ids = tail.flatten().index_put_((flat[real],), j[real])  # a bin's tail counts from 0: its own sequence
    at = real[:, P:] & (j[:, P:] > 0)
    return Packing(input_ids.view(-1, C), position_ids.view(-1, C), at, flat[:, P:][at] - 1)


def _prompt_groups(sequences: torch.Tensor, real: torch.Tensor, P: int) -> list[list[int]] | None:
    """The rows of each distinct prompt region (tokens and mask), each group in row order; None where no two
    rows share one."""
    found = distinct_prompts(sequences[:, :P], real[:, :P].long())
    if found is None:
        return None
    first, inverse = found
    groups: list[list[int]] = [[] for _ in range(first.shape[0])]
    for b, u in enumerate(inverse.tolist()):
        groups[u].append(b)
    return groups


def _padded_index(lists: list[list[int]], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged lists of flat indices -> [n, longest] (padded with 0) and which entries are real."""
    width = max(1, max(len(x) for x in lists))
    at = torch.zeros(len(lists), width, dtype=torch.long)
    for i, x in enumerate(lists):
        at[i, :len(x)] = torch.tensor(x, dtype=torch.long)
    ok = torch.arange(width)[None, :] < torch.tensor([len(x) for x in lists])[:, None]
    return at.to(dev), ok.to(dev)


def _pack_groups(sequences: torch.Tensor, real: torch.Tensor, P: int, groups: list[list[int]], kernel: str) -> Packing:
    """One packed row: each group's prompt (its real tokens, from its first row), then each of its rows' real
    response-region tokens, every token at its padded-path position; Packing.shared says where each sits."""
    dev = sequences.device
    B = real.shape[0]
    j = real.long().cumsum(1) - 1  # padded-path positions: the prompt's 0..p-1, then p.. for the response region
    host = real.cpu()  # one host read of the layout (a device sync per row would stall a GPU B times)
    cols = [torch.nonzero(host[b]).flatten().tolist() for b in range(B)]
    ids: list[torch.Tensor] = []
    prompt_at: list[list[int]] = []
    response_at: list[list[int]] = [[] for _ in range(B)]
    group = [0] * B
    before: list[list[int]] = [[] for _ in range(B)]
    n = 0
    for g, rows in enumerate(groups):
        pc = [c for c in cols[rows[0]] if c < P]
        prompt_at.append(list(range(n, n + len(pc))))
        ids.append(sequences[rows[0], pc] if pc else sequences.new_zeros(0))
        last = n + len(pc) - 1  # the prompt's last token: its logits predict each response's first
        n += len(pc)
        for b in rows:
            rc = [c for c in cols[b] if c >= P]
            group[b] = g
            response_at[b] = list(range(n, n + len(rc)))
            ids.append(sequences[b, rc] if rc else sequences.new_zeros(0))
            # the token before each of `at`'s (a response's first: the prompt's last; none without a prompt)
            before[b] = ([last] if pc else []) + response_at[b][:-1] if rc else []
            n += len(rc)
    input_ids = torch.cat(ids).view(1, n)
    position_ids = torch.empty(n, dtype=torch.long, device=dev)
    for g, rows in enumerate(groups):
        position_ids[prompt_at[g]] = j[rows[0], :P][real[rows[0], :P]]
        for b in rows:
            position_ids[response_at[b]] = j[b, P:][real[b, P:]]
    pa, pok = _padded_index(prompt_at, dev)
    ra, rok = _padded_index(response_at, dev)
    layout = SharedLayout.build(pa, pok, ra, rok, torch.tensor(group, device=dev), kernel)
    at = real[:, P:] & (j[:, P:] > 0)
    flat_before = torch.tensor([i for x in before for i in x], dtype=torch.long, device=dev)
    return Packing(input_ids, position_ids.view(1, n), at, flat_before, layout)


def shares_prompts(model: nn.Module) -> str | None:
    """The attention kernel ("eager" or "sdpa") with which a packed forward of `model` may run a group's prompt once
    (Packing.shared, model/shared_attention.py), or None: its attention is another kernel (flash's varlen packing
    needs none of this) or some layer attends through a sliding window."""
    found = _hf_models(model)
    base = found[0] if found else model
    c = getattr(base, "config", None)
    impl = str(getattr(c, "_attn_implementation", ""))
    if c is None or impl not in ("sdpa", "eager"):
        return None
    inner = getattr(getattr(base, "model", None), "config", None)  # MiniMind's wrapper: the trunk's own config
    cfgs = [x for x in (c, getattr(c, "get_text_config", lambda: c)(), inner) if x is not None]
    if any(getattr(x, "sliding_window", None) and getattr(x, "use_sliding_window", True) for x in cfgs):
        return None
    return impl if all(t == "full_attention" for x in cfgs for t in (getattr(x, "layer_types", None) or [])) else None


def _packed_call(model: nn.Module, pk: Packing, **kwargs: Any) -> Any:
    """model(packed rows): under the shared-prompt attention with its layout where pk has one."""
    if pk.shared is None:
        return model(input_ids=pk.input_ids, attention_mask=None, position_ids=pk.position_ids, **kwargs)
    with attention_implementation(SHARED_ATTENTION, model):
        return model(input_ids=pk.input_ids, attention_mask=None, position_ids=pk.position_ids, shared_layout=pk.shared,
                     **kwargs)


def unpack(values: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """Per-token values [N] of a packing's `at` positions -> [B, R], 0 elsewhere (differentiable)."""
    return torch.zeros(at.shape, dtype=values.dtype, device=values.device).masked_scatter(at, values)


def _output_head(model: nn.Module) -> nn.Module | None:
    """The LM head (output embeddings) of a policy: DDP / peft / fsdp2 / a LoRA reference or old-actor wrapper;
    None where the model names none (its own code): then the padded forward runs."""
    from model.lora import base_of

    model = getattr(model, "module", model)
    inner = getattr(model, "_actor", None)  # model/lora.py's AdaptersOff / AdapterSnapshot
    base = base_of(inner[0] if inner else model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    return head if isinstance(head, nn.Module) else None


@contextlib.contextmanager
def _head_reads(head: nn.Module, rows: torch.Tensor) -> Iterator[None]:
    """Within the block, `head` projects only the hidden states at flat indices `rows` [M, R] (of its input's
    [bins * C] positions): the packed twin of logits_to_keep, the vocabulary projection of the needed tokens only."""
    def pre(module: nn.Module, args: tuple) -> tuple:
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
    head = _output_head(model)
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


@dataclass
class Rollout:
    """One batch of experience; every [B, R] tensor is aligned with `response_mask`."""

    sequences: torch.Tensor  # [B, P+R]
    attention_mask: torch.Tensor  # [B, P+R] 1 on real prompt tokens and real response tokens
    response_mask: torch.Tensor  # [B, R]
    has_eos: torch.Tensor  # [B]
    prompt_len: int
    old_logprobs: torch.Tensor | None = None  # [B, R] policy that sampled (temperature-scaled)
    ref_logprobs: torch.Tensor | None = None  # [B, R]
    teacher_logprobs: torch.Tensor | None = None  # [B, R] the distillation teacher's (--teacher_model_path / --teacher_url)
    values: torch.Tensor | None = None  # [B, R] critic at rollout time (old_values in the loss)
    values_with_grad: torch.Tensor | None = None  # [B, R] the same values with their graph (--reuse_values)
    rewards: torch.Tensor | None = None  # [B] scalar reward per response
    advantages: torch.Tensor | None = None  # [B, R]
    returns: torch.Tensor | None = None  # [B, R]
    entropy: torch.Tensor | None = None  # [B, R] policy entropy per token, from the sampling pass (return_logprobs)
    rollout_logprobs: torch.Tensor | None = None  # [B, R] a rollout engine's log-probs of its samples (trainer/engine.py)
    is_weights: torch.Tensor | None = None  # [B, R] their truncated importance weights pi_old / mu (--rollout_is)
    rewards_finite: bool = True  # False: a reward was NaN/inf, and the update skips this step on every rank
    weight_version: int | None = None  # a rollout engine's samples: the weight version (updates) that sampled them
    staleness: int | None = None  # --async_rollouts: updates between those weights and the ones it trains

    @property
    def response_len(self) -> int:
        return self.response_mask.shape[1]

    def index(self, idx: torch.Tensor) -> "Rollout":
        """A minibatch view (rows `idx`) of every tensor field."""
        pick = lambda t: t[idx] if isinstance(t, torch.Tensor) else t
        return Rollout(**{k: pick(v) for k, v in self.__dict__.items()})


def group_has_signal(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[B] rewards -> [B/G] bool: the group's rewards are not all equal (DAPO's dynamic sampling keeps
    these: an all-equal group has zero group-relative advantage). NaN counts as different (kept), so a
    non-finite reward still reaches the step's non-finite check."""
    g = rewards.view(-1, group_size)
    return ~(g == g[:, :1]).all(dim=1)


def cat_rollouts(parts: list[tuple[Rollout, torch.Tensor]], pad_token_id: int) -> Rollout:
    """Rows `idx` of each rollout, stacked into one batch: prompts left-padded and responses right-padded
    to the longest (masks 0 there, so every row's log-probs and rewards are unchanged). Only the fields a
    rollout has before scoring (sampling, rewards) are carried."""
    P = max(ro.prompt_len for ro, _ in parts)
    R = max(ro.response_len for ro, _ in parts)

    def pad(t: torch.Tensor | None, left: int, right: int, value: float = 0) -> torch.Tensor | None:
        return None if t is None else torch.nn.functional.pad(t, (left, right), value=value)

    cols: dict[str, list] = {k: [] for k in ("sequences", "attention_mask", "response_mask", "has_eos", "old_logprobs",
                                             "entropy", "rewards", "rollout_logprobs")}
    for ro, idx in parts:
        p, r = P - ro.prompt_len, R - ro.response_len
        seq = torch.cat([pad(ro.sequences[idx, :ro.prompt_len], p, 0, pad_token_id),
                         pad(ro.sequences[idx, ro.prompt_len:], 0, r, pad_token_id)], dim=1)
        att = torch.cat([pad(ro.attention_mask[idx, :ro.prompt_len], p, 0), pad(ro.attention_mask[idx, ro.prompt_len:], 0, r)], dim=1)
        for k, v in (("sequences", seq), ("attention_mask", att), ("response_mask", pad(ro.response_mask[idx], 0, r)),
                     ("has_eos", ro.has_eos[idx]), ("rewards", ro.rewards[idx]),
                     ("old_logprobs", None if ro.old_logprobs is None else pad(ro.old_logprobs[idx], 0, r)),
                     ("entropy", None if ro.entropy is None else pad(ro.entropy[idx], 0, r)),
                     ("rollout_logprobs", None if ro.rollout_logprobs is None else pad(ro.rollout_logprobs[idx], 0, r))):
            cols[k].append(v)
    joined = {k: (None if v[0] is None else torch.cat(v)) for k, v in cols.items()}
    return Rollout(prompt_len=P, **joined)


@dataclass(frozen=True)
class Sampled:
    """Steps 1 and 2 of a PPO step for some prompts: the rollout with its rewards [B], its prompts' fields of the
    batch, the decoded responses and each reward component [B]."""

    rollout: Rollout
    batch: dict
    responses: list[str]
    comps: dict[str, torch.Tensor]

    def rows(self, groups: list[int], n: int) -> tuple[torch.Tensor, dict]:
        """The row indices of prompt groups `groups` (N rows each), and those prompts' fields of the batch."""
        idx = (torch.tensor(groups)[:, None] * n + torch.arange(n)).flatten()
        return idx, {k: [v[g] for g in groups] for k, v in self.batch.items() if isinstance(v, list)}


def select_groups(chosen: list[tuple[Sampled, int]], n: int, pad_token_id: int) -> Sampled:
    """DAPO's bookkeeping: the chosen prompt groups ((source, group index), N rows each) of one or more sampling
    rounds as one Sampled, source by source in order of first appearance (rows, prompt fields, responses, reward
    components kept together)."""
    by_source: dict[int, list] = {}
    for src, g in chosen:
        by_source.setdefault(id(src), [src, []])[1].append(g)
    parts, responses = [], []
    fields: dict[str, list] = {}
    comps: dict[str, list[torch.Tensor]] = {}
    for src, groups in by_source.values():
        idx, prompt_fields = src.rows(groups, n)
        parts.append((src.rollout, idx))
        for k, v in prompt_fields.items():
            fields.setdefault(k, []).extend(v)
        responses += [src.responses[i] for i in idx.tolist()]
        for k, v in src.comps.items():
            comps.setdefault(k, []).append(v[idx])
    return Sampled(cat_rollouts(parts, pad_token_id), fields, responses, {k: torch.cat(v) for k, v in comps.items()})


def draw(policy: nn.Module | Engine, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs: Any) -> Samples:
    """model.generation.sample's draws from the policy's weights in this process, or from a rollout engine serving
    them (its Samples carry the engine's log-probs). An engine that fails (unreachable, a refused request, another
    weight version than the last push) stops the run with its one line."""
    if isinstance(policy, Engine):
        with exits_on_engine_error():  # an engine gone, or serving other weights, mid-run
            return policy.sample(input_ids, attention_mask, **kwargs)
    return sample(policy, input_ids, attention_mask, **kwargs)


@torch.no_grad()
def generate_rollout(
    policy: nn.Module | Engine,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_id: int | list[int],
    pad_token_id: int,
    temperature: float,
    top_k: int,
    top_p: float,
    greedy: bool = False,
    suppress_eos: bool = False,
    num_generations: int = 1,
    return_logprobs: bool = False,
    fast_decode: bool = True,
    cuda_graphs: bool = True,
    generator: torch.Generator | None = None,
    oldest_version: int | None = None,
) -> Rollout:
    """Sample `num_generations` responses per prompt (prompt i's samples are rows i*N .. i*N+N-1): in this process
    the prompt batch is repeated row-wise and generated in one call; an engine gets each prompt once with n = N.

    return_logprobs fills `old_logprobs` and `entropy` from the sampling pass itself (in this process only: an
    engine's log-probs go to `rollout_logprobs`, and the old log-probs are the trainer's forward). `generator`: the
    draws' random stream (evaluation's own); None = torch's default one, training's. `oldest_version`: an engine's
    batch sampled ahead (--async_rollouts), asked for at that weight version (Engine.sample)."""
    kw = dict(max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=pad_token_id, temperature=temperature,
              top_k=top_k, top_p=top_p, greedy=greedy, suppress_eos=suppress_eos, generator=generator)
    engine = isinstance(policy, Engine)
    prompts = input_ids, attention_mask
    if num_generations > 1:
        input_ids = input_ids.repeat_interleave(num_generations, dim=0)
        attention_mask = attention_mask.repeat_interleave(num_generations, dim=0)
    s = (draw(policy, *prompts, num_generations=num_generations, oldest_version=oldest_version, **kw) if engine else
         draw(policy, input_ids, attention_mask, return_logprobs=return_logprobs, fast_decode=fast_decode,
              cuda_graphs=cuda_graphs, **kw))
    full_mask = torch.cat([attention_mask, s.response_mask.to(attention_mask.dtype)], dim=1)  # [B, P+R]
    return Rollout(
        sequences=s.sequences, attention_mask=full_mask, response_mask=s.response_mask.float(), has_eos=s.has_eos,
        prompt_len=input_ids.shape[1], old_logprobs=None if engine else s.logprobs, entropy=s.entropy,
        rollout_logprobs=s.logprobs if engine else None, weight_version=s.weight_version,
    )


def rollout_metrics(ro: Rollout, comps: dict[str, torch.Tensor], entropy: torch.Tensor, kl_coef: float,
                    num_generations: int) -> tuple[dict[str, float], dict[str, float]]:
    """This rank's metrics of a scored rollout, and what each is a mean over (its token count, or the
    rows where it is defined), so DDP's reduction (trainer.dist.reduce_mean) is the global mean.
    comps: each reward component [B] (NaN where undefined), entropy [B, R] of the sampling policy."""
    mask, rewards = ro.response_mask, ro.rewards
    n_tok = mask.sum(1)
    counted = {k: torch.isfinite(v).sum().item() for k, v in comps.items()}  # NaN = component not defined for a row
    weights = {"ppo/entropy": n_tok.sum().item(), **{f"reward/{k}": n for k, n in counted.items()}}
    weights["accuracy"] = counted["accuracy"]
    metrics = {
        "reward/total": rewards.mean().item(),
        **{f"reward/{k}": (v.nanmean().item() if counted[k] else float("nan")) for k, v in comps.items()},
        "format_rate": (comps["format"] > 0).float().mean().item(),
        "kl_ref": ((ro.old_logprobs - ro.ref_logprobs) * mask).sum(1).mean().item(),  # k1 summed per response
        "kl_coef": kl_coef,
        "ppo/entropy": masked_mean(entropy, mask).item(),
        "response/length": n_tok.float().mean().item(),
        "response/eos_rate": ro.has_eos.float().mean().item(),
    }
    # Always present (NaN with weight 0 where no row had a reference): every rank must reduce the same keys.
    metrics["accuracy"] = metrics["reward/accuracy"]
    if num_generations > 1:  # spread of rewards among the responses to the same prompt
        metrics["reward/group_std"] = rewards.view(-1, num_generations).std(dim=1).mean().item()
    metrics["tokens_generated"] = float(n_tok.sum().item())
    if ro.staleness is not None:  # --async_rollouts: how far behind the weights that sampled the batch are
        metrics["rollout/staleness"] = float(ro.staleness)
    return metrics, weights


def critic_values(cfg: Config, ro: Rollout, m: Models, rt: Runtime) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The critic's values [B, R] of the sampled tokens, and with --reuse_values the same values with their
    graph: the update's own forward, so the update does not run it again."""
    seqs, mask = on(rt.critic_device, ro.sequences, ro.attention_mask)
    if cfg.reuse_values:
        with torch.enable_grad(), attention_implementation(cfg.train_attn, m.critic_train):
            graph = critic_forward(m.critic_train, seqs, mask, ro.response_len, padding_free=bool(cfg.padding_free))
        return graph.detach().float().to(rt.device), graph
    values = forward_in_row_chunks(critic_forward, m.critic, seqs, mask, ro.response_len, rows=cfg.forward_batch_size,
                                   padding_free=bool(cfg.padding_free))
    return values.float().to(rt.device), None
