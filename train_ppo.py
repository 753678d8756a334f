"""minippo: PPO (RLHF) for small causal language models, in one script.

    python train_ppo.py                                  # the embedded CPU demo
    python train_ppo.py --config configs/grpo_demo.yaml  # a preset; flags override it
    python train_ppo.py --from_resume 1                  # continue the last run exactly
    torchrun --nproc_per_node 8 train_ppo.py --hidden_size 768 --num_hidden_layers 8 \
        --from_weight full_sft --data_path dataset/rlaif.jsonl --reward_model_path <RM dir>

For each batch of prompts (a rollout source gives the batches and their samples: taking turns, or with
--async_rollouts K sampled K batches ahead by a rollout engine while the trainer updates; trainer/run/rollout_source.py):
  1. rollout     sample responses from the actor or its engine (temperature / top-k / top-p, stop at EOS)
  2. reward      format + tags + reward model + accuracy + EOS + custom, clipped to --reward_max_abs
                 (--filter_groups: drop groups with equal rewards, sample more prompts; DAPO)
  3. score       old log-probs (the policy that sampled), reference log-probs, critic values, the teacher's (trainer/distill.py)
  4. advantages  the registered estimator (--advantage_estimator: GAE over the critic's values, or a
                 critic-free group / batch baseline), with the KL in the reward or in the loss
  5. update      epochs x minibatches of the registered policy loss + clipped value loss (+ KL, entropy)
  6. log, evaluate on held-out prompts, checkpoint
Where things live: settings in trainer/config.py (each component's section in trainer/sections.py); the math in
trainer/ppo.py, trainer/estimators.py and trainer/losses.py (registered by name, trainer/registry.py); the Rollout in
trainer/rollout.py, its scoring forwards in model/forward.py; reward components in trainer/rewards.py; the whole update
in trainer/update.py; how a run is built, resumed, saved, logged and spread over ranks, and where its rollouts come from
(trainer/run/rollout_source.py), in trainer/run/.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from model.fast_decode import reuse_decoder
from model.forward import attention_implementation, forward_in_row_chunks, policy_forward
from trainer import dist as D
from trainer.config import Config
from trainer.distill import reward_penalty, teacher_scored
from trainer.estimators import eos_guard
from trainer.evaluate import EvalSettings, evaluate_policy, training_metrics
from trainer.multiturn import Episode, episode_components
from trainer.ppo import RewardNormalizer, masked_whiten, rollout_is_weights
from trainer.registry import estimator_spec
from trainer.repair import with_repairs
from trainer.reward_server import exits_on_reward_error
from trainer.rewards import clip_to_range, compute_rewards, overlong_penalty
from trainer.rollout import Rollout, Sampled, critic_values, decoded, group_has_signal, rollout_metrics, select_groups
from trainer.run import distributed
from trainer.run.cli import parse_args
from trainer.run.engine_sync import start_engine
from trainer.run.lifecycle import Run
from trainer.run.phases import phases
from trainer.run.rollout_source import RolloutSource, Sampling, TakingTurns, make_rollout_source
from trainer.run.setup import setup
from trainer.run.timing import PhaseTimer
from trainer.runtime import Models, Phase, Runtime, on
from trainer.tools import ToolRunner
from trainer.update import ppo_update

__all__ = ["parse_args", "main", "make_experience", "ppo_update"]


# --------------------------------------------------------------------------------------- steps 1-4
@dataclass(frozen=True)
class Experience:
    """Steps 1-4 of one PPO step: the scored rollout with its advantages, and what to log."""

    rollout: Rollout
    metrics: dict[str, float]
    metric_weights: dict[str, float]  # what each per-rank metric is a mean over (for DDP's global mean)
    samples: list[dict]  # a few rows for the sample table


@dataclass(frozen=True)
class Scores:
    """Step 3: what the update compares against, per response token [B, R]."""

    old_logprobs: torch.Tensor  # the policy that sampled
    ref_logprobs: torch.Tensor
    values: torch.Tensor | None  # the critic's (None without one)
    values_with_grad: torch.Tensor | None  # the same values with their graph (--reuse_values)
    entropy: torch.Tensor | None
    is_weights: torch.Tensor | None = None  # an engine's samples: pi_old / pi_engine, truncated (--rollout_is)
    is_stats: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # the engine/trainer gap, token means


@torch.no_grad()
def make_experience(cfg: Config, batch: dict, m: Models, rt: Runtime, kl_coef: float, custom_fns: dict, phase: Phase,
                    source: RolloutSource | None = None, reward_norm: RewardNormalizer | None = None) -> Experience:
    """Rollout, reward, score, advantages for one batch of prompts, sampled by `source` (None: now, by the policy, on
    its own: single turns, no further prompts), which with --filter_groups gives more prompts until every group of the
    batch carries signal. `reward_norm` holds --reward_norm running's moments (a fresh one when None)."""
    filter_stats, source = {}, source or TakingTurns(cfg, m, rt)
    with reuse_decoder(m.actor) if cfg.filter_groups else contextlib.nullcontext():  # rounds share one weight copy
        sampled = sample_and_reward(cfg, batch, m, custom_fns, phase, source)  # steps 1 and 2
        if cfg.filter_groups:
            sampled, filter_stats = keep_groups_with_signal(cfg, sampled, m, rt, custom_fns, phase, source)
        baseline = None
        if estimator_spec(cfg.advantage_estimator).needs_baseline_rollout:  # ReMax: a greedy reply per prompt
            baseline = greedy_baseline(cfg, sampled, m, rt, custom_fns, phase, source)
    ro = sampled.rollout
    sc = score(cfg, ro, m, rt, phase)  # 3
    ro = dataclasses.replace(ro, old_logprobs=sc.old_logprobs, ref_logprobs=sc.ref_logprobs, values=sc.values, is_weights=sc.is_weights,
                             values_with_grad=sc.values_with_grad, rewards_finite=bool(torch.isfinite(ro.rewards).all()))
    ro, distill = teacher_scored(cfg, ro, m, rt, phase)  # --teacher_*: the teacher's log-probs of the samples
    scores, baseline, norm_stats = shape_scores(cfg, ro.rewards, baseline, reward_norm, rt)
    advantages, returns = compute_advantages(cfg, ro, kl_coef, rt, scores, baseline)  # 4
    ro = dataclasses.replace(ro, advantages=advantages, returns=returns)
    metrics, weights = rollout_metrics(ro, sampled.comps, sc.entropy, kl_coef, cfg.num_generations)
    metrics.update({**filter_stats, **norm_stats, **distill, **{f"rollout/{k}": v.item() for k, v in sc.is_stats.items()}})
    weights.update({k: weights["ppo/entropy"] for k in [*(f"rollout/{k}" for k in sc.is_stats), *distill]})  # token means
    if baseline is not None:
        metrics["reward/greedy_baseline"] = baseline.float().mean().item()
    if cfg.mask_truncated:  # DAPO: a response cut off without EOS takes no part in the update
        ro = dataclasses.replace(ro, response_mask=ro.response_mask * ro.has_eos.to(ro.response_mask.dtype)[:, None])
    samples = [{"prompt": sampled.batch["prompt"][i // cfg.num_generations][-200:], "response": sampled.responses[i],
                "reward": ro.rewards[i].item(), **{k: v[i].item() for k, v in sampled.comps.items()}}
               for i in range(min(4, len(sampled.responses)))]
    return Experience(ro, metrics, weights, samples)


def sample_and_reward(cfg: Config, batch: dict, m: Models, custom_fns: dict, phase: Phase, source: RolloutSource) -> Sampled:
    """1. rollout: [B*N, P+R] sequences, N = --num_generations (with --tools, multi-turn episodes), from `source`;
    2. reward. Rank-local: a failure on some ranks only (reward function, reward model, OOM) stops every rank with its line."""
    ro, episodes = source.rollout(batch, phase)
    repaired = None
    if cfg.ifeval_repairs:  # rewrites in place of samples where none met a rare constraint (trainer/repair.py)
        ro, repaired = with_repairs(cfg, batch, ro, m, phase)
    sampled = rewarded(cfg, batch, (ro, episodes), m, custom_fns, phase)
    if repaired is not None:
        sampled.comps["repaired"] = repaired
    return sampled


def rewarded(cfg: Config, batch: dict, sampling: Sampling, m: Models, custom_fns: dict, phase: Phase,
             rep: int | None = None) -> Sampled:
    """2. reward: the samples of `batch` (`rep` per prompt, default --num_generations) with their rewards."""
    ro, episodes = sampling
    with D.unsharded(m.rm_module), phase("score", autocast=False, rank_local=True), phase("score_reward", autocast=False):
        rewards, responses, comps = score_responses(cfg, batch, ro, m, custom_fns, phase, rep=rep, episodes=episodes)
    return Sampled(dataclasses.replace(ro, rewards=rewards), batch, responses, comps)


def keep_groups_with_signal(cfg: Config, first: Sampled, m: Models, rt: Runtime, custom_fns: dict, phase: Phase,
                            source: RolloutSource) -> tuple[Sampled, dict]:
    """DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2): a group whose N rewards are all equal has zero
    advantage under a group baseline, so it only dilutes the batch. Keep the groups with signal and sample
    the next prompts (the same extra batches on every rank: the prompt stream is global) until each rank
    has --batch_size of them, at most --filter_max_rounds extra batches; then fill up with dropped groups."""
    n, want = cfg.num_generations, cfg.batch_size
    kept, dropped, rounds, cur = [], [], 0, first
    while True:
        signal = group_has_signal(cur.rollout.rewards, n).tolist()  # one host read per round
        kept += [(cur, g) for g, s_ in enumerate(signal) if s_]
        dropped += [(cur, g) for g, s_ in enumerate(signal) if not s_]
        if not D.any_rank(len(kept) < want, rt.info) or rounds == cfg.filter_max_rounds:
            break
        batch = source.more_prompts()
        if batch is None:  # the prompt data ran out (the same on every rank)
            break
        rounds += 1
        cur = sample_and_reward(cfg, batch, m, custom_fns, phase, source)
    chosen = (kept + dropped)[:want]
    stats = {"filter/groups_dropped": float(len(dropped)), "filter/extra_rollouts": float(rounds),
             "filter/groups_filled": float(max(0, want - len(kept)))}
    if rounds == 0 and len(kept) >= want:  # the first batch had signal everywhere: nothing to rebuild
        return first, stats
    return select_groups(chosen, n, m.tok.pad_token_id), stats


def greedy_baseline(cfg: Config, sampled: Sampled, m: Models, rt: Runtime, custom_fns: dict, phase: Phase,
                    source: RolloutSource | None = None) -> torch.Tensor:
    """ReMax's baseline [B]: the reward of a greedy reply to each row's prompt (one per prompt from `source`, default
    the policy now; rewarded as the samples are). Rank-local like the sampling."""
    n, ro = cfg.num_generations, sampled.rollout
    prompts = {**sampled.batch, "input_ids": ro.sequences[::n, :ro.prompt_len], "attention_mask": ro.attention_mask[::n, :ro.prompt_len]}
    greedy = (source or TakingTurns(cfg, m, rt)).greedy(prompts, phase)
    return rewarded(cfg, sampled.batch, greedy, m, custom_fns, phase, rep=1).rollout.rewards.repeat_interleave(n)


def score_responses(cfg: Config, batch: dict, ro: Rollout, m: Models, custom_fns: dict, phase: Phase,
                    rep: int | None = None, episodes: list[Episode] | None = None) -> tuple[torch.Tensor, list[str], dict]:
    """The rewards [B] (the weighted total), the decoded responses and each component [B], for `rep` responses
    per prompt (default --num_generations). Rewards see the full assistant reply: the prefix the chat template
    forced + the decoded response; of a multi-turn episode, its last turn (the answer), and the tool statistics."""
    n = rep or cfg.num_generations

    def expand(xs: list) -> list:  # prompt i's samples are rows i*N .. i*N+N-1
        return [x for x in xs for _ in range(n)]

    if episodes is None:
        responses = decoded(ro, m.tok)
        replies = [p + r for p, r in zip(expand(batch["assistant_prefix"]), responses)]
    else:  # the whole episode for the sample table (tool replies included); the last turn is the answer
        tokens, seen = ro.sequences[:, ro.prompt_len:].tolist(), ro.attention_mask[:, ro.prompt_len:].bool().tolist()
        responses = [m.tok.decode([t for t, keep in zip(row, k) if keep]) for row, k in zip(tokens, seen)]
        replies = [e.final_reply for e in episodes]
    eos = cfg.eos_penalty if cfg.eos_placement == "reward" else 0.0  # "advantage": compute_advantages adds it
    weights = {"format": cfg.format_weight, "tags": cfg.tag_weight, "rm": cfg.rm_weight, "accuracy": cfg.accuracy_weight,
               "eos": eos, "ifeval": cfg.ifeval_weight, "ifeval_partial": cfg.ifeval_partial_weight, "url": cfg.reward_url_weight}
    with exits_on_reward_error():  # the user's function or reward server, the user's to fix: one line, not a traceback
        rewards, comps = compute_rewards(
            prompts=expand(batch["prompt"]), messages=expand(batch["messages"]), replies=replies,
            references=expand(batch["reference"]), has_eos=ro.has_eos.tolist(), weights=weights,
            rm=m.rm_scorer if cfg.rm_weight else None, reasoning=bool(cfg.reasoning), custom_fns=custom_fns,
            timer=lambda name: phase(name, autocast=False), reward_url=m.reward_url,
            constraints=expand(batch.get("constraints") or [None] * len(batch["prompt"])),
            gts=expand(batch.get("gt") or [None] * len(batch["prompt"])), rg=expand(batch.get("rg") or [None] * len(batch["prompt"])))
    if cfg.overlong_buffer_len:  # DAPO: warn long responses before the cut, in proportion
        comps["overlong"] = overlong_penalty(ro.response_mask.sum(1).cpu(), cfg.max_gen_len, cfg.overlong_buffer_len)
        rewards = rewards + cfg.overlong_penalty * comps["overlong"]
    if episodes is not None:  # --tools: a call that could not run costs --tool_error_penalty, one that ran earns --tool_ok_weight
        comps.update(episode_components(episodes))
        comps["tool_error"] = -(comps["tool_failures"] > 0).float()
        rewards = rewards + cfg.tool_error_penalty * comps["tool_error"] + cfg.tool_ok_weight * comps["tool_ok"]
    rewards, comps["out_of_range"] = clip_to_range(rewards, cfg.reward_max_abs)  # before any normalisation
    return rewards.to(ro.sequences.device), responses, comps


def score(cfg: Config, ro: Rollout, m: Models, rt: Runtime, phase: Phase) -> Scores:
    """3. log-probs under the sampling distribution (fp32 softmax) of the policy that sampled and of the
    reference, and the critic's values of the sampled tokens."""
    R, temp, rows = ro.response_len, cfg.sample_temperature, cfg.forward_batch_size  # rows per scoring forward (0 = all)
    old_logprobs, entropy, values, values_with_grad, kept = ro.old_logprobs, ro.entropy, None, None, []
    keep = m.engine.kept_tokens(cfg.sampling) if m.engine else None  # vLLM's log-probs: over top-k / top-p's kept tokens
    # Each forward is rank-local work (a failure is agreed on after it); a sharded model (--strategy fsdp2) is
    # gathered whole before and freed after, one model at a time.
    with phase("score"):
        if old_logprobs is None:  # a frozen old actor, or --rollout_logprobs 0: score the samples again,
            scorer = m.old_actor or m.actor  # with the update's attention kernel: the first ratio is then exactly 1
            with D.unsharded(scorer), phase("score_old", autocast=False, rank_local=True), \
                    attention_implementation(cfg.train_attn, scorer):
                old_logprobs, entropy, *kept = forward_in_row_chunks(policy_forward, scorer, ro.sequences, ro.attention_mask, R,
                                                                     temp, True, bool(cfg.padding_free), keep=keep, rows=rows)
        with D.unsharded(m.ref), phase("score_ref", device=rt.ref_device, rank_local=True):
            ref_logprobs, _ = forward_in_row_chunks(policy_forward, m.ref, *on(rt.ref_device, ro.sequences, ro.attention_mask),
                                                    R, temp, rows=rows, padding_free=bool(cfg.padding_free))
            ref_logprobs = ref_logprobs.to(rt.device)  # [B, R]
        if m.critic is not None and not cfg.reuse_values:
            with D.unsharded(m.critic), phase("score_critic", device=rt.critic_device, rank_local=True):
                values, _ = critic_values(cfg, ro, m, rt)
    if cfg.reuse_values:  # the update's own (DDP) forward, which may talk to the other ranks: outside the rank-local block
        with phase("score"), phase("score_critic", device=rt.critic_device):
            values, values_with_grad = critic_values(cfg, ro, m, rt)
    is_weights, is_stats = (None, {}) if ro.rollout_logprobs is None else rollout_is_weights(  # the PPO ratio's pi_old: whole vocabulary
        kept[0] if kept else old_logprobs, ro.rollout_logprobs, ro.response_mask, cfg.rollout_is, cfg.rollout_is_cap)
    return Scores(old_logprobs, ref_logprobs, values, values_with_grad, entropy, is_weights, is_stats)


def shape_scores(cfg: Config, rewards: torch.Tensor, baseline: torch.Tensor | None, reward_norm: RewardNormalizer | None,
                 rt: Runtime) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """The scores [B] the estimator sees: the rewards (a non-finite one counts 0: the update skips such a step
    on every rank) after --reward_norm (over every rank's rewards) and --reward_clip; ReMax's baseline goes
    through the same map. Returns them and what to log."""
    norm = reward_norm or RewardNormalizer(cfg.reward_norm, cfg.reward_clip)
    shift, scale = norm.fit(rewards, reduce=D.rank_sum(rt.info))

    def shaped(r: torch.Tensor) -> torch.Tensor:
        return norm.apply(torch.nan_to_num(r, nan=0.0, posinf=0.0, neginf=0.0), shift, scale)

    stats = {"reward_norm/mean": shift, "reward_norm/std": scale} if cfg.reward_norm != "none" else {}
    return shaped(rewards), (None if baseline is None else shaped(baseline)), stats


def compute_advantages(cfg: Config, ro: Rollout, kl_coef: float, rt: Runtime, scores: torch.Tensor | None = None,
                       baseline: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """4. (advantages, returns) [B, R] by the registered --advantage_estimator from the scores [B] (on each
    response's last token; default: the rewards, a non-finite one as 0), the critic's values, ReMax's
    baseline, and a per-token penalty (the KL where it is in the reward, the distillation term); whitened over
    every rank's tokens where the estimator says (GAE: --whiten_advantages)."""
    spec = estimator_spec(cfg.advantage_estimator)
    kl, kl_coef = reward_penalty(cfg, ro, kl_coef)  # KL to the reference in the reward; + --distill_coef x k1 to the teacher
    if scores is None:
        scores = torch.nan_to_num(ro.rewards, nan=0.0, posinf=0.0, neginf=0.0)
    advantages, returns = spec.fn(scores, kl, ro.values, ro.response_mask, kl_coef, cfg.estimator, baseline=baseline)
    if spec.whiten == "global" or (spec.whiten == "flag" and cfg.whiten_advantages):
        advantages = masked_whiten(advantages, ro.response_mask, reduce=D.rank_sum(rt.info))
    if cfg.eos_placement == "advantage" and cfg.eos_penalty:  # beside the normalised task advantage, not scaled with it
        guard = eos_guard(ro.has_eos, cfg.eos_penalty, cfg.num_generations).to(advantages)
        advantages = advantages + guard[:, None] * ro.response_mask
    return advantages, returns


# --------------------------------------------------------------------------------------- evaluation
def evaluate(cfg: Config, m: Models, rt: Runtime, records: list, tools: ToolRunner | None = None) -> dict[str, float]:
    """Greedy replies to held-out prompts, scored as in training (format, accuracy, reward model; with --tools, multi-turn episodes and how
    often they call a tool). Runs on rank 0 only, in its own random stream: training's samples are the same with or without it."""
    with rt.autocast(), exits_on_reward_error():  # a --reward_model_url server gone: one line, as in training
        ev = evaluate_policy(m.actor, m.tok, records, EvalSettings.for_training(cfg), rm_scorer=m.rm_scorer, tools=tools)
    return training_metrics(ev, tools=tools is not None)


# --------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    built = setup(parse_args(argv))  # resolve the flags; torchrun's ranks, threads, seeds, models, data, optimizers, DDP
    cfg, rt, m, opt, kl_ctl = built.cfg, built.runtime, built.models, built.optim, built.kl_ctl

    def held_out() -> dict[str, float]:  # on rank 0; every rank gathers sharded weights first (a collective)
        with D.unsharded(m.actor, m.rm_module):
            return distributed.on_main(lambda: evaluate(cfg, m, rt, built.eval_records, built.tools), rt.info)

    source = make_rollout_source(cfg, m, rt, built.tools)  # take turns, or the engine samples K batches ahead
    with Run(cfg, built, source) as run:  # resume (the source's too), run.json, logger; marks the run's end however it ends
        if m.engine is not None:  # the engine samples the start (or resumed) weights, as version run.step
            run.logger.info(start_engine(cfg, m, rt, run.step))
        if built.eval_records and run.step == 0:
            run.log_eval(held_out(), 0)  # where the policy starts
        for batch in source.batches(run):  # this rank's prompts, from where the run left off
            if m.old_actor is not None and run.step % cfg.update_old_actor_freq == 0:
                m.old_actor.load_state_dict(m.actor.state_dict())  # MiniMind's scheme: refresh the frozen copy
            timer = PhaseTimer(rt.cuda_devices)
            phase = phases(timer, rt)
            with phase("step", autocast=False):
                exp = make_experience(cfg, batch, m, rt, kl_ctl.value, built.custom_fns, phase, source, built.reward_norm)  # 1-4
                with phase("update", autocast=False):
                    stats = ppo_update(cfg, exp.rollout, m, opt, run.step, rt, kl_ctl.value, phase)  # 5
                source.after_update(run.step, phase)  # the engine gets the updated weights when due
            times = {f"time/{k}": v for k, v in timer.wall.items()
                     if k in ("generate", "score", "update", "step", "engine_sync") or k.startswith("reward/")}
            metrics = {**exp.metrics, **stats, **times, **{f"lr/{k}": o.param_groups[0]["lr"] for k, o in opt.optims.items()}}
            # Reduce first: the adaptive KL controller must see the global kl_ref, or each rank
            # steers its own coefficient and the ranks (and the resume file) disagree.
            metrics = D.reduce_mean(metrics, rt.info, weights=exp.metric_weights)
            if built.eval_records and ((run.step + 1) % cfg.eval_interval == 0 or run.step + 1 == rt.total_steps):
                with phase("eval", autocast=False):
                    metrics.update(held_out())
                metrics["time/eval"] = timer.wall["eval"]
            if not metrics["nonfinite"]:
                kl_ctl.update(metrics["kl_ref"], cfg.batch_size * cfg.num_generations * rt.info.world_size)
            run.end_step(metrics, exp.samples)  # 6. log; checkpoint every --save_interval steps
        if built.eval_records and run.data_ran_out and run.evaluated_at != run.step:
            run.log_eval(held_out(), run.step)  # where the policy ended
        run.finish()  # saves the last step if it was not


if __name__ == "__main__":
    distributed.exit_after(main)
