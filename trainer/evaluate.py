"""Held-out evaluation of a policy: sample replies to RLAIF prompts and score them.

    from trainer.evaluate import EvalSettings, evaluate_policy
    metrics = evaluate_policy(policy, tokenizer, records, EvalSettings(temperature=0.0), rm_scorer=scorer)
    metrics["format_rate"], metrics["accuracy"], metrics["rm_score_mean"], ...

A "reply" is what the reward functions see during PPO: the assistant prefix the chat template
forced (e.g. "<think>\\n") plus the generated tokens decoded with special tokens skipped, so the
figures here are the same quantities the trainer optimises. Replies are sampled and scored through
training's own functions (trainer/rollout.py generate_rollout, model/forward.py policy_forward; trainer/multiturn.py with
tools).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dataset import ifeval
from dataset.rlaif import PromptRecord, RLAIFDataset, collate_left_pad
from model.forward import policy_forward
from trainer import verifier
from trainer.multiturn import Episode, generate_episodes
from trainer.reward_model import RewardModelScorer
from trainer.rewards import answers_match, extract_answer, format_reward, gt_reward
from trainer.rollout import Rollout, generate_rollout
from trainer.tools import ToolRunner


def _rate(hits: Sequence[bool]) -> float | None:
    """Share of True values; None (not NaN, so it stays valid JSON) when there is nothing to count."""
    return sum(hits) / len(hits) if hits else None


def score_instructions(replies: Sequence[str], constraints: Sequence[list[dict] | None]) -> dict[str, Any]:
    """IFEval's figures over the rows that carry constraints (dataset/ifeval.py): ifeval_pass_rate (every
    constraint met: IFEval's strict prompt-level accuracy), ifeval_constraint_rate (instruction-level) and
    ifeval_by_type; None where no row has constraints."""
    met = [ifeval.results(cs, r) for r, cs in zip(replies, constraints) if cs]
    by_type: dict[str, list[bool]] = {}
    for kind, ok in (x for m in met for x in m):
        by_type.setdefault(kind, []).append(ok)
    return {"ifeval_pass_rate": _rate([all(ok for _, ok in m) for m in met]),
            "ifeval_constraint_rate": _rate([ok for m in met for _, ok in m]),
            "ifeval_by_type": {k: _rate(v) for k, v in sorted(by_type.items())} if by_type else None}


def text_diversity(replies: Sequence[str]) -> dict[str, float]:
    """mean_words (whitespace words per reply) and distinct_2 (distinct word bigrams / all bigrams over the
    replies): a policy collapsing onto one phrasing shows it here first."""
    words = [r.split() for r in replies]
    bigrams = [tuple(ws[i:i + 2]) for ws in words for i in range(len(ws) - 1)]
    return {"mean_words": sum(map(len, words)) / max(len(words), 1),
            "distinct_2": len(set(bigrams)) / len(bigrams) if bigrams else 0.0}


def score_replies(
    replies: Sequence[str],
    references: Sequence[str | None],
    tasks: Sequence[str | None] | None = None,
    gts: Sequence[list[str] | None] | None = None,
    rg: Sequence[dict | None] | None = None,
) -> dict[str, Any]:
    """Rule-based bookkeeping for a list of replies (a row with `gts`, a MiniMind agent row's ground truth, is
    correct when its answer contains all of it; a reasoning-gym row `rg` when its task's score_answer gives 1).

    Returns n, format_rate (format_reward > 0), accuracy over rows that have a reference
    (None if none has one), n_with_reference, accuracy split by whether the reply used the
    reasoning format (accuracy_formatted / accuracy_unformatted; None when that group is empty),
    the per-row flags `format_ok` and `correct` (None without a reference), and `by_task`
    ({task: {n, format_rate, accuracy}}) when `tasks` is given.
    """
    if len(replies) != len(references):
        raise ValueError(f"score_replies: {len(replies)} replies but {len(references)} references")
    if tasks is not None and len(tasks) != len(replies):
        raise ValueError(f"score_replies: {len(replies)} replies but {len(tasks)} task labels")
    format_ok = [format_reward(r) > 0 for r in replies]
    n = len(replies)
    correct: list[bool | None] = [
        verifier.score(r, e) == 1.0 if e else gt_reward(r, g) == 1.0 if g else None if ref is None
        else answers_match(extract_answer(r), ref)
        for r, ref, g, e in zip(replies, references, gts or [None] * n, rg or [None] * n)
    ]
    graded = [(f, c) for f, c in zip(format_ok, correct) if c is not None]
    out: dict[str, Any] = {
        "n": len(replies),
        "format_rate": _rate(format_ok),
        "accuracy": _rate([c for _, c in graded]),
        "n_with_reference": len(graded),
        "accuracy_formatted": _rate([c for f, c in graded if f]),
        "accuracy_unformatted": _rate([c for f, c in graded if not f]),
        "format_ok": format_ok,
        "correct": correct,
    }
    if tasks is not None:
        by_task: dict[str, dict[str, Any]] = {}
        for name in sorted({t for t in tasks if t is not None}):
            rows = [i for i, t in enumerate(tasks) if t == name]
            graded_rows = [c for i in rows if (c := correct[i]) is not None]
            by_task[name] = {
                "n": len(rows),
                "format_rate": _rate([format_ok[i] for i in rows]),
                "accuracy": _rate(graded_rows),
            }
        out["by_task"] = by_task
    return out


@dataclass(frozen=True)
class EvalSettings:
    """How evaluate_policy samples: prompts rendered as in training (max_prompt_len, thinking_ratio), one reply
    each (temperature 0 = greedy), `batch_size` prompts at a time; with tools, episodes of up to max_turns turns
    and max_total_len tokens, the tools listed by tools_system_prompt where given (--tools_system_prompt). `seed`
    seeds the rendering and a generator of evaluation's own."""

    batch_size: int = 64
    max_prompt_len: int = 256
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    thinking_ratio: float = 1.0
    max_turns: int = 3
    max_total_len: int = 1024
    tools_system_prompt: str | None = None

    @classmethod
    def for_training(cls, cfg: Any) -> EvalSettings:
        """train_ppo's held-out evaluation: greedy, prompts rendered as the run renders them (a Config)."""
        return cls(batch_size=64, max_prompt_len=cfg.max_seq_len, max_new_tokens=cfg.max_gen_len, temperature=0.0,
                   seed=cfg.seed, thinking_ratio=cfg.thinking_ratio, max_turns=cfg.max_turns, max_total_len=cfg.max_total_len,
                   tools_system_prompt=cfg.tools_system_prompt)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.batch_size < 1 or self.max_new_tokens < 1:
            raise ValueError(f"batch_size ({self.batch_size}) and max_new_tokens ({self.max_new_tokens}) must be >= 1")


@torch.no_grad()
def _sample_batch(policy: nn.Module, tokenizer: Any, batch: dict, s: EvalSettings, tools: ToolRunner | None,
                  generator: torch.Generator, device: torch.device) -> tuple[Rollout, Tensor, list[str], list[Episode]]:
    """One batch through training's samplers (trainer/rollout.py; trainer/multiturn.py with tools): the rollout,
    the response mask the lengths are counted on, the replies as the reward functions see them, the episodes."""
    greedy = s.temperature == 0.0
    sampling = dict(max_new_tokens=s.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id, temperature=s.temperature if not greedy else 1.0, top_p=s.top_p,
                    greedy=greedy, generator=generator)
    if tools is not None:
        ro, eps = generate_episodes(policy, tokenizer, tools, batch, max_turns=s.max_turns,
                                    max_total_len=s.max_total_len, device=device, **sampling)
        return ro, ro.response_mask, [e.final_reply for e in eps], eps
    ro = generate_rollout(policy, batch["input_ids"].to(device), batch["attention_mask"].to(device), top_k=0, **sampling)
    mask = ro.response_mask.long()  # integer lengths, as the sampler counts them
    responses = ro.sequences[:, ro.prompt_len:]  # [B, R]
    texts = tokenizer.batch_decode([row[m.bool()].tolist() for row, m in zip(responses.cpu(), mask.cpu())],
                                   skip_special_tokens=True)
    return ro, mask, [prefix + text for prefix, text in zip(batch["assistant_prefix"], texts)], []


@torch.no_grad()
def _kl_to(policy: nn.Module, ref_policy: nn.Module, ro: Rollout, mask: Tensor) -> list[float]:
    """Per row, the summed logp_policy - logp_ref of the policy's own tokens (a tool's reply is not the policy's),
    fp32 at temperature 1, through training's log-prob forward."""
    logprobs, _ = policy_forward(policy, ro.sequences, ro.attention_mask, ro.response_len)  # [B, R]
    ref_logprobs, _ = policy_forward(ref_policy, ro.sequences, ro.attention_mask, ro.response_len)  # [B, R]
    return ((logprobs - ref_logprobs) * mask).sum(dim=1).tolist()


def evaluate_policy(
    policy: nn.Module,
    tokenizer: Any,
    records: Sequence[PromptRecord],
    settings: EvalSettings = EvalSettings(),
    *,
    rm_scorer: RewardModelScorer | None = None,
    ref_policy: nn.Module | None = None,
    tools: ToolRunner | None = None,
    tasks: Sequence[str | None] | None = None,
    return_rows: bool = False,
) -> dict[str, Any]:
    """Sample one reply per record (EvalSettings: temperature 0 = greedy) and score it.

    Keys: n, format_rate, accuracy, n_with_reference, accuracy_formatted, accuracy_unformatted,
    ifeval_pass_rate / ifeval_constraint_rate / ifeval_by_type (rows with constraints; None without),
    mean_words, distinct_2, mean_response_len (tokens incl. EOS), eos_rate, rm_score_mean (None without rm_scorer),
    kl_ref (mean over rows of the summed per-token logp_policy - logp_ref on the sampled tokens,
    fp32 and temperature 1; None without ref_policy), by_task (when `tasks` gives a task name per
    record, e.g. the demo files' "task" key), rows (per-row details, when return_rows).
    With `tools` (a ToolRunner) every reply is a multi-turn episode (trainer/multiturn.py) scored on its last turn,
    and tool_call_rate (episodes that called a tool) and tool_ok_rate (called, and every call ran) are added.

    Deterministic given the settings' seed: sampling draws from a generator of its own on the policy's device,
    seeded with it, so the caller's random state (a training run's, on the CPU and on every GPU) is
    neither used, advanced nor reseeded.
    """
    s = settings
    if not records:
        raise ValueError("evaluate_policy: no records to evaluate (check --data_path / --n)")
    if tasks is not None and len(tasks) != len(records):
        raise ValueError(f"evaluate_policy: {len(records)} records but {len(tasks)} task labels")
    dataset = RLAIFDataset(list(records), tokenizer, s.max_prompt_len, thinking_ratio=s.thinking_ratio, seed=s.seed,
                           tools=tools.toolbox.schema_list() if tools is not None else None,
                           tools_system_prompt=s.tools_system_prompt)
    device = next(policy.parameters()).device

    replies: list[str] = []
    references: list[str | None] = []
    gts: list[list[str] | None] = []
    rg: list[dict | None] = []
    constraints: list[list[dict] | None] = []
    lengths: list[int] = []
    eos_flags: list[bool] = []
    rm_scores: list[float] = []
    kls: list[float] = []
    rows: list[dict[str, Any]] = []
    episodes: list[Episode] = []
    # Not torch.manual_seed: it reseeds every GPU's default generator too, and training would sample
    # from its step-0 stream again after each evaluation.
    generator = torch.Generator(device).manual_seed(s.seed)
    for start in range(0, len(dataset), s.batch_size):
        batch = collate_left_pad([dataset[i] for i in range(start, min(start + s.batch_size, len(dataset)))],
                                 tokenizer.pad_token_id)
        ro, mask, batch_replies, eps = _sample_batch(policy, tokenizer, batch, s, tools, generator, device)
        episodes += eps
        replies += batch_replies
        references += batch["reference"]
        gts += batch["gt"]
        rg += batch["rg"]
        constraints += batch["constraints"]
        lengths += mask.sum(dim=1).tolist()
        eos_flags += ro.has_eos.tolist()
        if rm_scorer is not None:
            convs = [msgs + [{"role": "assistant", "content": r}] for msgs, r in zip(batch["messages"], batch_replies)]
            rm_scores += rm_scorer.score(convs).tolist()
        if ref_policy is not None:
            kls += _kl_to(policy, ref_policy, ro, mask)
        if return_rows:
            rows += [
                {"prompt": p, "reply": r, "reference": ref}
                for p, r, ref in zip(batch["prompt"], batch_replies, batch["reference"])
            ]

    scored = score_replies(replies, references, tasks, gts, rg)
    metrics: dict[str, Any] = {k: v for k, v in scored.items() if k not in ("format_ok", "correct")}
    metrics.update(score_instructions(replies, constraints), **text_diversity(replies))
    metrics["mean_response_len"] = sum(lengths) / len(lengths)
    metrics["eos_rate"] = sum(eos_flags) / len(eos_flags)
    metrics["rm_score_mean"] = sum(rm_scores) / len(rm_scores) if rm_scorer is not None else None
    metrics["kl_ref"] = sum(kls) / len(kls) if ref_policy is not None else None
    if tools is not None:
        metrics["tool_call_rate"] = sum(e.calls > 0 for e in episodes) / len(episodes)
        metrics["tool_ok_rate"] = sum(e.calls > 0 and e.failed == 0 for e in episodes) / len(episodes)
    if return_rows:
        for i, row in enumerate(rows):
            row.update(format_ok=scored["format_ok"][i], correct=scored["correct"][i], length=lengths[i],
                       has_eos=eos_flags[i])
            if ref_policy is not None:
                row["kl_ref"] = kls[i]
            if tools is not None:
                row.update(turns=list(episodes[i].turns), tool_calls=episodes[i].calls, tool_failures=episodes[i].failed)
            if rm_scorer is not None:
                row["rm_score"] = rm_scores[i]
            if tasks is not None:
                row["task"] = tasks[i]
        metrics["rows"] = rows
    for key in ("mean_response_len", "rm_score_mean", "kl_ref"):
        if metrics[key] is not None and not math.isfinite(metrics[key]):
            raise FloatingPointError(f"evaluate_policy: {key} is {metrics[key]} (the model produced non-finite values)")
    return metrics


__all__ = ["EvalSettings", "evaluate_policy", "score_replies", "score_instructions", "text_diversity"]


def training_metrics(ev: dict[str, Any], tools: bool = False) -> dict[str, float]:
    """evaluate_policy's result as the run logs it: eval/* keys, nan where a figure does not apply."""
    def num(x: float | None) -> float:
        return float("nan") if x is None else x

    tool_rates = {"eval/tool_call_rate": ev["tool_call_rate"], "eval/tool_ok_rate": ev["tool_ok_rate"]} if tools else {}
    return {**tool_rates, "eval/accuracy": num(ev["accuracy"]), "eval/format_rate": ev["format_rate"],
            "eval/reward/rm": num(ev["rm_score_mean"]), "eval/response_length": ev["mean_response_len"],
            "eval/eos_rate": ev["eos_rate"], "eval/ifeval_pass_rate": num(ev["ifeval_pass_rate"]),
            "eval/distinct_2": ev["distinct_2"]}
