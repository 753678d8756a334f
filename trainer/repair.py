"""Off-policy guidance for instruction following (--ifeval_repairs K): where no sample of a group meets a constraint
of a type the policy almost never meets by chance (a reply in all lowercase, wrapped in quotes, opening with the
request, in N paragraphs...), GRPO has no success to compare against and the type never moves. Here up to K of the
group's samples are replaced, before the reward, by a sibling rewritten to meet it (dataset/ifeval.py REPAIRS: the
group's best reply that ended, lowercased, quoted, regrouped...), in place of the group's worst.

The reward then scores the rewritten reply like any other (the real checker, the EOS term, every component), so a
rewrite earns what it meets and nothing else. As in LUFFY (Yan et al. 2025, "Learning to Reason under Off-Policy
Guidance", arXiv:2504.14945) an off-policy success sits in an on-policy group; unlike LUFFY its tokens are treated as
the policy's own: their old log-probs are the policy's now, so the PPO ratio starts at 1 and the clip bounds how far
one batch moves towards it. The rewrite stays close to the policy's own words (its own reply, recased or
regrouped), which keeps that ratio's gradient near the on-policy one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from dataset import ifeval
from model.forward import attention_implementation, policy_forward
from trainer import dist as D
from trainer.rollout import Rollout, decoded
from trainer.runtime import Models, Phase

if TYPE_CHECKING:
    from trainer.config import Config


@dataclasses.dataclass(frozen=True)
class Repair:
    """One sample replaced: its row, the rewritten reply's token ids (EOS last) and the constraint types it was rewritten for."""

    row: int
    tokens: list[int]
    types: tuple[str, ...]


def plan_repairs(responses: list[str], has_eos: list[bool], prefixes: list[str], constraints: list[list[dict] | None],
                 n: int, per_group: int, encode: Callable[[str], list[int]], eos_id: int, max_tokens: int) -> list[Repair]:
    """The repairs of a batch whose group g (rows g*n .. g*n+n-1) answers a prompt with `constraints[g]`. A group
    gets up to `per_group`, one per donor: its replies that ended (has_eos), best first by the share of constraints
    met, each rewritten (ifeval.repair, the next donor as the sibling) for the types no reply of the group meets,
    replacing the worst reply not already a donor or replaced (the lowest share, a cut one first, the last of ties).
    A rewrite longer than `max_tokens` with its EOS is skipped. `encode`: text -> token ids without special tokens;
    the reply checked is the forced `prefixes[g]` + the response, as the reward sees it."""
    plan = []
    for g, cs in enumerate(constraints):
        if not cs:
            continue
        rows = range(g * n, g * n + n)
        met = {r: ifeval.results(cs, prefixes[g] + responses[r]) for r in rows}
        unmet = {c["type"] for k, c in enumerate(cs) if not any(met[r][k][1] for r in rows)} & set(ifeval.REPAIRS)
        if not unmet:
            continue
        share = {r: ifeval.share_met(met[r]) for r in rows}
        donors = sorted((r for r in rows if has_eos[r]), key=lambda r: (-share[r], r))
        worst = sorted(rows, key=lambda r: (share[r], has_eos[r], -r))
        taken: set[int] = set(donors[:per_group])
        for k, donor in enumerate(donors[:per_group]):
            sibling = responses[donors[k + 1]] if k + 1 < len(donors) else None
            text = ifeval.repair(cs, prefixes[g] + responses[donor], unmet, sibling)
            target = next((r for r in worst if r not in taken), None)
            if text is None or target is None or not text.startswith(prefixes[g]):
                continue
            tokens = encode(text[len(prefixes[g]):]) + [eos_id]
            if len(tokens) > max_tokens:
                continue
            taken.add(target)
            plan.append(Repair(target, tokens, tuple(sorted(unmet))))
    return plan


def widened(ro: Rollout, response_len: int, pad_token_id: int) -> Rollout:
    """`ro` with its response region padded on the right to `response_len` tokens (masks, log-probs 0 there)."""
    extra = response_len - ro.response_len
    if extra <= 0:
        return ro

    def pad(t: torch.Tensor | None, value: float = 0) -> torch.Tensor | None:
        return None if t is None else torch.nn.functional.pad(t, (0, extra), value=value)

    return dataclasses.replace(ro, sequences=pad(ro.sequences, pad_token_id), attention_mask=pad(ro.attention_mask),
                               response_mask=pad(ro.response_mask), old_logprobs=pad(ro.old_logprobs), entropy=pad(ro.entropy),
                               rollout_logprobs=pad(ro.rollout_logprobs))


def apply_repairs(ro: Rollout, plan: list[Repair], pad_token_id: int) -> Rollout:
    """A copy of `ro` with each repair's row holding its prompt and the rewritten reply (ended: has_eos), the response
    region widened to the longest; its old log-probs and entropy there 0 until `rescored` fills them."""
    if not plan:
        return ro
    ro = widened(ro, max(len(p.tokens) for p in plan), pad_token_id)
    ro = dataclasses.replace(ro, **{k: v.clone() for k, v in vars(ro).items() if isinstance(v, torch.Tensor)})
    P = ro.prompt_len
    for p in plan:
        L = len(p.tokens)
        ro.sequences[p.row, P:] = pad_token_id
        ro.sequences[p.row, P:P + L] = torch.tensor(p.tokens, dtype=ro.sequences.dtype)
        for t in (ro.attention_mask[:, P:], ro.response_mask):
            t[p.row] = 0
            t[p.row, :L] = 1
        ro.has_eos[p.row] = True
        for t in (ro.old_logprobs, ro.entropy, ro.rollout_logprobs):
            if t is not None:
                t[p.row] = 0
    return ro


def rescored(ro: Rollout, rows: list[int], logprobs: torch.Tensor, entropy: torch.Tensor | None) -> Rollout:
    """`ro` with the policy's log-probs [len(rows), R] (and entropy) of the rewritten rows as their old log-probs (and, for
    a rollout engine's samples, as the engine's: an importance weight of 1), masked to their tokens."""
    idx = torch.tensor(rows, device=ro.sequences.device)
    mask = ro.response_mask[idx].bool()
    for name, value in (("old_logprobs", logprobs), ("entropy", entropy), ("rollout_logprobs", logprobs)):
        t = getattr(ro, name)
        if t is not None and value is not None:
            t[idx] = torch.where(mask, value.to(t), torch.zeros_like(t[idx]))
    return ro


def with_repairs(cfg: Config, batch: dict, ro: Rollout, m: Models, phase: Phase) -> tuple[Rollout, torch.Tensor]:
    """--ifeval_repairs: the rollout with rewrites in place of samples (plan_repairs), and [B] 1 on their rows. Where
    the sampling pass gave the old log-probs, the rewrites' are the policy's now, by the update's forward; every rank
    gathers a sharded actor for it, rewrites or not (a collective)."""
    plan = plan_repairs(decoded(ro, m.tok), ro.has_eos.tolist(), batch["assistant_prefix"],
                        batch.get("constraints") or [None] * len(batch["prompt"]), cfg.num_generations, cfg.ifeval_repairs,
                        lambda s: m.tok(s, add_special_tokens=False)["input_ids"], m.eos_ids[0], cfg.max_gen_len)
    ro, rows = apply_repairs(ro, plan, m.tok.pad_token_id), [p.row for p in plan]
    if ro.old_logprobs is not None:
        with D.unsharded(m.actor), phase("score", autocast=False, rank_local=True), \
                phase("score_old", autocast=False), attention_implementation(cfg.train_attn, m.actor):
            if rows:
                logprobs, entropy = policy_forward(m.actor, ro.sequences[rows], ro.attention_mask[rows], ro.response_len,
                                                   cfg.sample_temperature, ro.entropy is not None, bool(cfg.padding_free))
                ro = rescored(ro, rows, logprobs, entropy)
    flags = torch.zeros(len(ro.has_eos))
    flags[rows] = 1.0
    return ro, flags
