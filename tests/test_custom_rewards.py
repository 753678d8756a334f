"""examples/custom_rewards.py: the worked --reward_fn examples (rule-based and reference-based)."""

from __future__ import annotations

import math

import pytest
import torch

from examples import custom_rewards as cr
from trainer.rewards import compute_rewards, load_reward_fn

ZH_PROMPT = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
             "<|im_start|>user\n8和74哪个更大？<|im_end|>\n<|im_start|>assistant\n<think>\n")
EN_PROMPT = ("<|im_start|>system\n你是一个乐于助人的AI助手。<|im_end|>\n"
             "<|im_start|>user\nWhich is larger, 8 or 74?<|im_end|>\n<|im_start|>assistant\n<think>\n")


def _reply(answer: str, think: str = "compare the tens") -> str:
    return f"<think>\n{think}\n</think>\n\n<answer>\n{answer}\n</answer>"


def test_last_user_message_ignores_the_system_prompt():
    assert cr.last_user_message(ZH_PROMPT) == "8和74哪个更大？"
    two_turns = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nhi<|im_end|>\n<|im_start|>user\n你好<|im_end|>\n"
    assert cr.last_user_message(two_turns) == "你好"
    assert cr.last_user_message("user: hi\nassistant:") == "user: hi\nassistant:"  # other templates: whole prompt


@pytest.mark.parametrize("prompt, answer, expected", [
    (ZH_PROMPT, "74更大", 0.2),  # Chinese to Chinese (the English system prompt does not count)
    (ZH_PROMPT, "74 is larger", -0.2),
    (EN_PROMPT, "74 is larger", 0.2),  # English to English (the Chinese system prompt does not count)
    (EN_PROMPT, "七十四", -0.2),
    (ZH_PROMPT, "74", 0.0),  # a bare number is neither language
])
def test_same_language(prompt, answer, expected):
    assert cr.same_language(prompt, _reply(answer), None) == expected


def test_same_language_ignores_cut_off_reasoning():
    assert cr.same_language(ZH_PROMPT, "<think>\nthe answer is seventy-four", None) == 0.0


@pytest.mark.parametrize("n_chars, expected", [(10, 0.0), (40, 0.0), (60, -0.25), (80, -0.5), (400, -0.5)])
def test_concise_answer(n_chars, expected):
    long_think = "x" * 500  # thinking is free
    assert cr.concise_answer(EN_PROMPT, _reply("y" * n_chars, think=long_think), None) == pytest.approx(expected)


@pytest.mark.parametrize("answer, reference, expected", [
    ("159", "159", 1.0),
    ("158", "159", 1 - 1 / 159),
    ("答案是 １５９。", "159", 1.0),  # last number, full-width digits
    ("1,000", "1000", 1.0),
    ("−3", "-3", 1.0),  # U+2212 minus
    ("0.4", "0.5", 0.9),  # small references: distance over max(1, |ref|)
    ("400", "159", 0.0),  # off by more than the reference itself: no credit
    ("seventy-four", "74", 0.0),  # no number in the answer
    ("74", "无 reference number", 0.0),
])
def test_numeric_closeness(answer, reference, expected):
    assert cr.numeric_closeness(EN_PROMPT, _reply(answer), reference) == pytest.approx(expected)


def test_numeric_closeness_needs_a_reference_and_a_finished_reply():
    assert cr.numeric_closeness(EN_PROMPT, _reply("74"), None) == 0.0
    assert cr.numeric_closeness(EN_PROMPT, "<think>\n8 < 74 so 74", "74") == 0.0  # reasoning cut off: no answer yet
    # A reference written as a reasoning-format reply is reduced to its answer.
    assert cr.numeric_closeness(EN_PROMPT, _reply("74"), _reply("74", think="7 > 0, 99 steps")) == 1.0


def test_loaded_by_flag_syntax_and_weighted_one():
    fns = {name: load_reward_fn(f"examples/custom_rewards.py:{name}") for name in ("numeric_closeness", "same_language")}
    replies = [_reply("158"), _reply("74 is larger")]
    total, comps = compute_rewards(
        prompts=[EN_PROMPT, ZH_PROMPT], messages=[[], []], replies=replies, references=["159", None],
        has_eos=[True, True], weights={"format": 0.0, "tags": 0.0, "accuracy": 0.0, "eos": 0.0}, rm=None,
        reasoning=True, custom_fns=fns)
    assert torch.allclose(comps["custom/numeric_closeness"], torch.tensor([1 - 1 / 159, 0.0]))
    assert torch.allclose(comps["custom/same_language"], torch.tensor([0.0, -0.2]))  # "158" has no language
    assert torch.allclose(total, torch.tensor([1 - 1 / 159, -0.2]))  # each custom component at weight 1
    assert all(math.isfinite(v) for v in total.tolist())
