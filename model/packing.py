"""Padding-free layouts (--padding_free; TRL's padding_free, verl's remove-padding): a padded batch's real tokens
packed into fewer, shorter rows. Pure functions of the attention mask, the token ids and two numbers read off the
model beforehand (model/forward.py attention_break_even and shares_prompts): nothing here runs a model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .generation import distinct_prompts
from .shared_attention import SharedLayout


@dataclass(frozen=True)
class Packing:
    """A padded batch's real tokens packed into fewer, shorter rows: rows are placed whole, first-fit by decreasing
    length, into bins of one width (pack_rows); each keeps its own positions from 0, and transformers keeps attention
    within each of them (masking_utils' `find_packed_sequence_indices`: with no 2D attention mask, a position that
    does not follow its left neighbour by 1 starts a new sequence; the tail of a bin that no row fills is a sequence
    of its own).

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

    def cost(rows: int, width: int) -> float:
        return rows * width * (1.0 + width / break_even)

    best: tuple[float, tuple[int, list[int], list[int]] | None] = (cost(B, T), None)
    one_row = break_even == float("inf")  # flash-attention: one row, also where more would tie (attention_break_even)
    for C in [sum(lengths)] if one_row else _widths(lengths):
        start, used = _first_fit(lengths, C)
        if cost(len(used), C) < best[0]:
            best = (cost(len(used), C), (C, start, used))
    groups = _prompt_groups(sequences, real, P) if share_prompts and P > 0 else None
    if share_prompts and groups is not None:
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


def unpack(values: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """Per-token values [N] of a packing's `at` positions -> [B, R], 0 elsewhere (differentiable)."""
    return torch.zeros(at.shape, dtype=values.dtype, device=values.device).masked_scatter(at, values)
