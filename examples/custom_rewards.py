"""Worked examples of custom rewards for `train_ppo.py --reward_fn FILE.py:NAME`.

    python train_ppo.py --reward_fn examples/custom_rewards.py:same_language \\
                        --reward_fn examples/custom_rewards.py:numeric_closeness

How the reward of one response is built (trainer/rewards.py, `compute_rewards`)
--------------------------------------------------------------------------------
    total = format_weight   x format     0.5 when the reply is exactly
                                         <think>\\n...\\n</think>\\n[\\n]<answer>\\n...\\n</answer>
          + tag_weight      x tags       +0.25 per tag (<think> </think> <answer> </answer>) present once
          + accuracy_weight x accuracy   1.0 when the answer equals the row's reference (numbers by
                                         value: "3.0" == "３"), 0 otherwise, nothing without a reference
          + eos_penalty     x eos        -1 when the response was cut at --max_gen_len
          + rm_weight       x rm         reward-model score, clipped to [-3, 3]
                                         (--reasoning 1: 0.4 x whole reply + 0.6 x <answer> content)
          + 1.0             x custom/<name>   for every --reward_fn (repeatable)

The first four are the rule-based rewards; set a weight to 0 to switch one off. Every component is
logged unweighted as `reward/<name>`, a custom one as `reward/custom/<function name>`. A custom
component always has weight 1: to weigh it, scale inside the function (see `LENGTH_PENALTY_SCALE`).

A custom reward function
------------------------
    fn(prompt: str, reply: str, reference: str | None) -> float

- `prompt`: the full chat-template text the policy saw, e.g. for the MiniMind template
  "<|im_start|>user\\n12 + 7 = ?<|im_end|>\\n<|im_start|>assistant\\n<think>\\n" (system prompt
  included when there is one); `last_user_message` below recovers what the user wrote.
- `reply`: the assistant's full reply: what the template forced after the assistant header (e.g.
  "<think>\\n") plus the generated text, special tokens removed.
- `reference`: the final assistant turn of the data row when it carries an answer, else None
  (placeholders such as "无" or "" are None).
- Return a finite float. A NaN or inf makes the trainer skip the whole step (no optimizer step)
  and stop after --max_nonfinite such steps in a row, so return 0.0 for "no opinion".
  An exception stops the run with the function name and row in the message.

Functions run once per response in the training process, so keep them cheap and pure.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:  # importable outside train_ppo.py too (tests, notebooks)
    sys.path.insert(0, _ROOT)

from trainer.rewards import extract_answer

_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_LATIN = re.compile(r"[A-Za-z]")
_NUMBER = re.compile(r"[-+\u2212\uff0d]?\d[\d,]*(?:\.\d+)?")
_CHATML_USER = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.DOTALL)

MAX_ANSWER_CHARS = 40  # longer answers are penalised by concise_answer
LENGTH_PENALTY_SCALE = 0.5  # the largest penalty concise_answer gives


def last_user_message(prompt: str) -> str:
    """The last user turn of a ChatML prompt; the whole prompt for other templates."""
    turns = _CHATML_USER.findall(prompt)
    return turns[-1] if turns else prompt


def is_chinese(text: str) -> bool:
    """Mostly Chinese: more CJK characters than Latin letters (digits and symbols do not count)."""
    cjk, latin = len(_CJK.findall(text)), len(_LATIN.findall(text))
    return cjk > latin


def answer_of(reply: str) -> str | None:
    """The reply's final answer (see trainer.rewards.extract_answer); None while the reply is still
    inside an unclosed <think> block, so numbers or words from cut-off reasoning never count."""
    if reply.lstrip().startswith("<think>") and "</think>" not in reply:
        return None
    return extract_answer(reply)


# ----------------------------------------------------------------------------- rule-based examples

def same_language(prompt: str, reply: str, reference: str | None) -> float:
    """Rule-based: +0.2 when the answer is in the language of the user's message (Chinese to a
    Chinese question, English to an English one), -0.2 when it is not, 0 without any letters.

    Only the answer counts (the reasoning may mix languages), and a purely numeric answer ("19")
    is neither language, so arithmetic tasks are not pushed towards wordy answers.
    """
    answer = answer_of(reply) or ""
    if not (_CJK.search(answer) or _LATIN.search(answer)):
        return 0.0
    return 0.2 if is_chinese(answer) == is_chinese(last_user_message(prompt)) else -0.2


def concise_answer(prompt: str, reply: str, reference: str | None) -> float:
    """Rule-based: 0 for an answer up to MAX_ANSWER_CHARS characters, then a penalty growing
    linearly with the excess, reaching -LENGTH_PENALTY_SCALE at twice the limit (and staying there).
    The reasoning is not counted: this shapes the answer, not how long the model thinks."""
    answer = answer_of(reply) or ""
    excess = max(0, len(answer) - MAX_ANSWER_CHARS)
    return -LENGTH_PENALTY_SCALE * min(1.0, excess / MAX_ANSWER_CHARS)


# ----------------------------------------------------------------------------- reference-based example

def _last_number(text: str) -> float | None:
    found = _NUMBER.findall(text.translate(str.maketrans("０１２３４５６７８９", "0123456789")))
    if not found:
        return None
    s = found[-1].replace(",", "").replace("\u2212", "-").replace("\uff0d", "-")
    try:
        return float(s)
    except ValueError:
        return None


def numeric_closeness(prompt: str, reply: str, reference: str | None) -> float:
    """Reads the reference answer: partial credit for numeric answers that are close.

    score = max(0, 1 - |answer - reference| / max(1, |reference|))

    so the exact number scores 1.0, "158" for 159 scores 0.994, an answer off by the reference's
    own size or more scores 0. The answer's last number is used ("159", "答案是 159。",
    "<answer>\\n159\\n</answer>"). 0.0 when the row has no reference or either side has no number,
    so rows of other tasks neither gain nor lose. With --accuracy_weight 1 the exact answer earns
    1 + 1 = 2 while a near miss earns just under 1: exactness stays worth more than closeness.
    """
    if reference is None:
        return 0.0
    ref = _last_number(extract_answer(reference) or "")
    got = _last_number(answer_of(reply) or "")
    if ref is None or got is None:
        return 0.0
    return max(0.0, 1.0 - abs(got - ref) / max(1.0, abs(ref)))
