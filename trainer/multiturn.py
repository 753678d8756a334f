"""Multi-turn tool-use rollouts (`--tools`): the policy samples a turn, its tool calls run, the tools' replies are
appended as the chat template renders them, and the policy samples again, until a turn makes no call, --max_turns
turns were sampled, or the episode reaches --max_total_len tokens.

Layout: one episode is one row of a Rollout, `sequences [B, P+R]` = left-padded prompt + everything after it:

    prompt | turn 1 (policy) | observation (template + tool replies + next header) | turn 2 (policy) | ... | pads
    response_mask:  1 ... 1    |  0 ............................................. 0 | 1 ... 1          | 0
    attention_mask: 1 on every real token (the policy reads the tools' replies), 0 on pads

Only the policy's own tokens (response_mask) carry log-probs, values, KL, advantages and loss; the observation
tokens are context, like the prompt. The policy's tokens are never re-tokenised: an observation is the text the
template puts after the assistant's end-of-turn token, tokenised on its own (a chat template's special tokens
are hard boundaries, so these are the tokens the whole conversation would have there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from dataset.rlaif import detect_assistant_prefix
from trainer.engine import Engine
from trainer.rollout import Rollout, draw
from trainer.tools import ToolError, ToolRunner, parse_tool_calls

T = TypeVar("T")


@dataclass(frozen=True)
class Episode:
    """What a row's episode did: the policy's turns as text (each with the prefix its template header forced),
    its tool calls, how many of them failed (malformed, unknown tool, bad arguments, raised, hung, or refused),
    whether it ended by itself (a turn without a call) rather than at --max_turns or --max_total_len, and how many
    calls were refused, not run, past --max_tool_calls (counted in `failed` too)."""

    turns: tuple[str, ...]
    calls: int
    failed: int
    finished: bool
    refused: int = 0

    @property
    def final_reply(self) -> str:
        """The last turn: what the answer is read from ("" when the prompt left no room for a turn)."""
        return self.turns[-1] if self.turns else ""


def observation(tok: Any, messages: list[dict], tool_messages: list[dict], tools: list[dict] | None,
                open_thinking: bool) -> tuple[str, str]:
    """The text after the assistant's end-of-turn token of `messages[-1]` through the next generation prompt, with
    the tools' replies between; and the prefix that prompt forces (e.g. "<think>\\n")."""
    kw = {"tools": tools} if tools else {}
    before = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, open_thinking=open_thinking, **kw)
    after = tok.apply_chat_template(messages + tool_messages, tokenize=False, add_generation_prompt=True,
                                    open_thinking=open_thinking, **kw)
    if not after.startswith(before):
        raise ToolError("the chat template renders a conversation differently once tool replies follow it; a template "
                        "for tool use must only append (render 'tool' messages after the others)")
    eos = tok.eos_token or ""
    cut = before.rfind(eos) if eos else -1
    trailing = before[cut + len(eos):] if cut >= 0 else ""
    return trailing + after[len(before):], detect_assistant_prefix(after)


@torch.no_grad()
def generate_episodes(policy: nn.Module | Engine, tok: Any, runner: ToolRunner, batch: dict, *, max_turns: int, max_total_len: int,
                      max_new_tokens: int, eos_token_id: int | list[int], pad_token_id: int, num_generations: int = 1,
                      generator: torch.Generator | None = None, device: torch.device | None = None,
                      **sampling: Any) -> tuple[Rollout, list[Episode]]:
    """Sample `num_generations` episodes per prompt of `batch` (a collated RLAIF batch: input_ids, attention_mask,
    messages, assistant_prefix, open_thinking, tools); prompt i's episodes are rows i*N .. i*N+N-1. `sampling`:
    temperature, top_k, top_p, greedy, suppress_eos, fast_decode (as model.generation.sample takes them).
    Rank-local: no collective, whatever the number of turns. The rollout is on `device` (default: the batch's).
    An episode runs at most `runner.max_calls` calls (--max_tool_calls); the policy reads an error for each past it."""
    device = device or batch["input_ids"].device
    engine = isinstance(policy, Engine)

    def rep(xs: Sequence[T]) -> list[T]:  # each prompt's row N times: its episodes are rows i*N .. i*N+N-1
        return [x for x in xs for _ in range(num_generations)]

    prompts = [row[m.bool()].tolist() for row, m in zip(batch["input_ids"].cpu(), batch["attention_mask"].cpu())]
    prompts, messages = rep(prompts), [[dict(m) for m in ms] for ms in rep(batch["messages"])]
    prefixes, thinking, tools = rep(batch["assistant_prefix"]), rep(batch["open_thinking"]), rep(batch["tools"])
    B = len(prompts)
    resp: list[list[int]] = [[] for _ in range(B)]
    mask: list[list[int]] = [[] for _ in range(B)]
    lps: list[list[float]] = [[] for _ in range(B)]  # an engine's log-probs of the policy's tokens (0 at tool replies)
    turns: list[list[str]] = [[] for _ in range(B)]
    calls, failed, finished, has_eos, refused = [0] * B, [0] * B, [False] * B, [False] * B, [0] * B
    active = list(range(B))
    for turn in range(max_turns):
        room = {i: max_total_len - len(prompts[i]) - len(resp[i]) for i in active}
        active = [i for i in active if room[i] > 0]
        if not active:
            break
        ctx = [prompts[i] + resp[i] for i in active]
        width = max(map(len, ctx))
        ids = torch.full((len(active), width), pad_token_id, dtype=torch.long)
        att = torch.zeros((len(active), width), dtype=torch.long)
        for r, c in enumerate(ctx):
            ids[r, width - len(c):], att[r, width - len(c):] = torch.tensor(c), 1
        s = draw(policy, ids.to(device), att.to(device), max_new_tokens=min(max_new_tokens, max(room.values())),
                 eos_token_id=eos_token_id, pad_token_id=pad_token_id, generator=generator, **sampling)
        new = s.sequences[:, width:].cpu()
        new_lps = None
        if engine:
            assert s.logprobs is not None  # an engine's Samples always carry its log-probs of the tokens it drew
            new_lps = s.logprobs.cpu()
        new_mask, eos = s.response_mask.cpu().bool(), s.has_eos.cpu().tolist()
        still = []
        for r, i in enumerate(active):
            toks = new[r][new_mask[r]].tolist()[: room[i]]
            ended = bool(eos[r]) and len(toks) == int(new_mask[r].sum())  # stopped by itself, inside the budget
            resp[i] += toks
            mask[i] += [1] * len(toks)
            if new_lps is not None:
                lps[i] += new_lps[r][new_mask[r]].tolist()[: room[i]]
            text = prefixes[i] + tok.decode(toks, skip_special_tokens=True)
            turns[i].append(text)
            has_eos[i] = ended
            found = parse_tool_calls(text) if ended else []
            if not found:  # an answer (or a cut turn): the episode is over
                finished[i] = ended
                continue
            calls[i] += len(found)
            if turn == max_turns - 1:  # no turn left to read the replies
                continue
            replies: list[dict] = []
            for c in found:
                if calls[i] - len(found) + len(replies) >= runner.max_calls:  # the calls before this one, all turns
                    replies.append(runner.refuse(c, f"not run: over --max_tool_calls {runner.max_calls} calls this episode"))
                    refused[i] += 1
                else:
                    replies.append(runner.call(c))
            failed[i] += sum(runner.failed(m) for m in replies)
            messages[i].append({"role": "assistant", "content": text})
            obs_text, prefixes[i] = observation(tok, messages[i], replies, tools[i], thinking[i])
            obs = list(tok.encode(obs_text, add_special_tokens=False))
            if len(prompts[i]) + len(resp[i]) + len(obs) >= max_total_len:  # no room to answer after the replies
                continue
            messages[i] += replies
            resp[i] += obs
            mask[i] += [0] * len(obs)
            lps[i] += [0.0] * len(obs)
            still.append(i)
        active = still

    P, R = max(map(len, prompts)), max(map(len, resp))
    seqs = torch.full((B, P + R), pad_token_id, dtype=torch.long)
    attention = torch.zeros((B, P + R), dtype=torch.long)
    response_mask = torch.zeros((B, R), dtype=torch.float32)
    rollout_lps = torch.zeros((B, R), dtype=torch.float32) if engine else None
    for i in range(B):
        p, n = len(prompts[i]), len(resp[i])
        seqs[i, P - p:P], attention[i, P - p:P] = torch.tensor(prompts[i]), 1
        seqs[i, P:P + n], attention[i, P:P + n] = torch.tensor(resp[i], dtype=torch.long), 1
        response_mask[i, :n] = torch.tensor(mask[i], dtype=torch.float32)
        if rollout_lps is not None:
            rollout_lps[i, :n] = torch.tensor(lps[i], dtype=torch.float32)
    ro = Rollout(sequences=seqs.to(device), attention_mask=attention.to(device), response_mask=response_mask.to(device),
                 has_eos=torch.tensor(has_eos, device=device), prompt_len=P,
                 rollout_logprobs=None if rollout_lps is None else rollout_lps.to(device))
    episodes = [Episode(tuple(turns[i]), calls[i], failed[i], finished[i], refused[i]) for i in range(B)]
    return ro, episodes


def episode_components(episodes: list[Episode]) -> dict[str, torch.Tensor]:
    """Per-row tool statistics [B], logged with the reward components: tool_calls, tool_failures, tool_refused
    (calls past --max_tool_calls, not run), turns, and tool_ok (1 when the episode called a tool and every call ran)."""
    def col(xs: list[float]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.float32)

    return {"tool_calls": col([e.calls for e in episodes]), "tool_failures": col([e.failed for e in episodes]),
            "tool_refused": col([e.refused for e in episodes]),
            "tool_ok": col([float(e.calls > 0 and e.failed == 0) for e in episodes]),
            "turns": col([len(e.turns) for e in episodes])}
