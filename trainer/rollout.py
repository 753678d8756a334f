"""Rollouts: the `Rollout` batch of experience and what builds it: sampling from the policy or a rollout engine
(generate_rollout), DAPO's group selection (select_groups), the critic's values at rollout time and the rollout's
metrics. Running a model over given sequences (log-probs, values, packing) lives in model/forward.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from model.forward import attention_implementation, critic_forward, forward_in_row_chunks
from model.generation import Samples, sample
from trainer.engine import IN_BLOCK, Engine, RequestDeadline, exits_on_engine_error
from trainer.ppo import masked_mean
from trainer.runtime import Models, Runtime, on

if TYPE_CHECKING:
    from trainer.config import Config


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
        return Rollout(**{k: v[idx] if isinstance(v, torch.Tensor) else v for k, v in self.__dict__.items()})


def decoded(ro: Rollout, tok: Any) -> list[str]:
    """Each row's response as text: its tokens up to and including EOS, special tokens dropped."""
    tokens, mask = ro.sequences[:, -ro.response_len:].tolist(), ro.response_mask.bool().tolist()  # one copy, not two per row
    return [tok.decode([t for t, keep in zip(row, k) if keep], skip_special_tokens=True) for row, k in zip(tokens, mask)]


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

    def pad(t: torch.Tensor, left: int, right: int, value: float = 0) -> torch.Tensor:
        return torch.nn.functional.pad(t, (left, right), value=value)

    def cat(col: list[torch.Tensor | None]) -> torch.Tensor | None:  # an optional field: None where the first has none
        return None if col[0] is None else torch.cat(col)

    seqs, atts, masks, eos, rewards = [], [], [], [], []
    optional: dict[str, list[torch.Tensor | None]] = {"old_logprobs": [], "entropy": [], "rollout_logprobs": []}
    for ro, idx in parts:
        assert ro.rewards is not None  # a rewarded rollout: DAPO selects its groups by their rewards
        p, r = P - ro.prompt_len, R - ro.response_len
        seqs.append(torch.cat([pad(ro.sequences[idx, :ro.prompt_len], p, 0, pad_token_id),
                               pad(ro.sequences[idx, ro.prompt_len:], 0, r, pad_token_id)], dim=1))
        atts.append(torch.cat([pad(ro.attention_mask[idx, :ro.prompt_len], p, 0),
                               pad(ro.attention_mask[idx, ro.prompt_len:], 0, r)], dim=1))
        masks.append(pad(ro.response_mask[idx], 0, r))
        eos.append(ro.has_eos[idx])
        rewards.append(ro.rewards[idx])
        for k, t in (("old_logprobs", ro.old_logprobs), ("entropy", ro.entropy), ("rollout_logprobs", ro.rollout_logprobs)):
            optional[k].append(None if t is None else pad(t[idx], 0, r))
    return Rollout(sequences=torch.cat(seqs), attention_mask=torch.cat(atts), response_mask=torch.cat(masks),
                   has_eos=torch.cat(eos), prompt_len=P, rewards=torch.cat(rewards), old_logprobs=cat(optional["old_logprobs"]),
                   entropy=cat(optional["entropy"]), rollout_logprobs=cat(optional["rollout_logprobs"]))


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
    deadline: RequestDeadline = IN_BLOCK,
) -> Rollout:
    """Sample `num_generations` responses per prompt (prompt i's samples are rows i*N .. i*N+N-1): in this process
    the prompt batch is repeated row-wise and generated in one call; an engine gets each prompt once with n = N.

    return_logprobs fills `old_logprobs` and `entropy` from the sampling pass itself (in this process only: an
    engine's log-probs go to `rollout_logprobs`, and the old log-probs are the trainer's forward). `generator`: the
    draws' random stream (evaluation's own); None = torch's default one, training's. `oldest_version`: an engine's
    batch sampled ahead (--async_rollouts), asked for at that weight version (Engine.sample); `deadline`: the rank-local
    deadline an engine's requests keep to (default: the block the caller is in; a batch sampled ahead: None)."""
    kw = dict(max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=pad_token_id, temperature=temperature,
              top_k=top_k, top_p=top_p, greedy=greedy, suppress_eos=suppress_eos, generator=generator)
    engine = isinstance(policy, Engine)
    prompts = input_ids, attention_mask
    if num_generations > 1:
        input_ids = input_ids.repeat_interleave(num_generations, dim=0)
        attention_mask = attention_mask.repeat_interleave(num_generations, dim=0)
    s = (draw(policy, *prompts, num_generations=num_generations, oldest_version=oldest_version, deadline=deadline, **kw)
         if engine else
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
    assert rewards is not None and ro.old_logprobs is not None and ro.ref_logprobs is not None  # a scored rollout
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
