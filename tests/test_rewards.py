"""Reward components on crafted English/Chinese replies (the reward model scorer itself: tests/test_reward_model.py)."""

import math
import textwrap
import time

import numpy as np
import pytest
import torch

from dataset import ifeval as F
from tests.test_reward_model import FakeGetScoreRM
from trainer.reward_model import RewardModelScorer
from trainer.rewards import (
    FORMAT_PATTERN,
    accuracy_reward,
    answers_match,
    compute_rewards,
    eos_reward,
    extract_answer,
    format_reward,
    load_reward_fn,
    overlong_penalty,
    tag_reward,
)

ZH = "<think>\n3加4等于7\n</think>\n<answer>\n7\n</answer>"
EN = "<think>\nthree plus four is seven\n</think>\n\n<answer>\n7\n</answer>"  # one blank line: allowed


# ------------------------------------------------------------------ format / tags

@pytest.mark.parametrize(
    "reply, expected",
    [
        (ZH, 0.5),
        (EN, 0.5),
        ("<think>\n三加四\n</think>\n\n<answer>\n七\n</answer>", 0.5),
        ("  \n" + ZH + "\n\n", 0.5),  # surrounding whitespace is stripped
        ("<think>\n\n</think>\n\n<answer>\n7\n</answer>", 0.5),  # empty thinking (closed-think prompt)
        ("<think>\nmulti\nline\n</think>\n<answer>\nA\nB\n</answer>", 0.5),
        ("<think>\n3加4\n</think>\n\n\n<answer>\n7\n</answer>", 0.0),  # two blank lines
        ("<think>3加4\n</think>\n<answer>\n7\n</answer>", 0.0),  # no newline after <think>
        ("<think>\n3+4\n</think><answer>\n7\n</answer>", 0.0),  # no newline after </think>
        (ZH + " extra", 0.0),  # text after </answer>
        ("<answer>\n7\n</answer>", 0.0),  # no thinking block
        ("7", 0.0),
    ],
)
def test_format_reward(reply, expected):
    assert format_reward(reply) == expected


def test_format_pattern_is_usable_with_re():
    import re

    assert re.match(FORMAT_PATTERN, ZH)
    assert FORMAT_PATTERN.fullmatch(EN)


def test_tag_reward_counts_tags_present_exactly_once():
    assert tag_reward(ZH) == 1.0
    assert tag_reward(EN) == 1.0
    assert tag_reward("<think>\n想一想") == 0.25
    assert tag_reward("plain answer 7") == 0.0
    dup = "<think>\na\n</think>\n<think>\nb\n</think>\n<answer>\n1\n</answer>"
    # <think> and </think> twice -> only the two answer tags score
    assert tag_reward(dup) == 0.5
    assert format_reward(dup) == 0.0  # a repeated think block is not the reasoning format
    assert tag_reward("<answer>1</answer><answer>2</answer>") == 0.0


# ------------------------------------------------------------------ answers

def test_extract_answer():
    assert extract_answer(ZH) == "7"
    assert extract_answer("<answer>1</answer> then <answer> 2 </answer>") == "2"  # last one
    assert extract_answer("<think>\n想\n</think>\n\n答案是 12") == "答案是 12"  # after </think>
    assert extract_answer("  just 5 ") == "just 5"
    assert extract_answer("<think>\nx\n</think>\n<answer>\n \n</answer>") is None
    assert extract_answer("   ") is None


@pytest.mark.parametrize(
    "pred, ref",
    [
        ("７", "7"),  # full-width digit
        ("－３", "-3"),  # full-width minus
        ("−3", "-3"),  # U+2212 MINUS SIGN
        ("3.0", "3"),
        ("3.", "3"),
        ("7。", "7"),
        ("1,000", "1000"),
        ("1，000", "1000"),  # full-width comma as thousands separator
        ("-0.50", "-.5"),
        ("Paris", "paris"),
        ("七", "七。"),
        ("3", "<answer>3</answer>"),
        ("42", "<think>\n6乘7\n</think>\n<answer>\n42\n</answer>"),  # reference is a full reply
    ],
)
def test_answers_match_true(pred, ref):
    assert answers_match(pred, ref)


@pytest.mark.parametrize(
    "pred, ref",
    [("3", "4"), ("1,2", "12"), ("-3", "3"), ("7", "七"), (None, "3"), ("3", None), ("", "3"), ("3", "  ")],
)
def test_answers_match_false(pred, ref):
    assert not answers_match(pred, ref)


def test_accuracy_and_eos_rewards():
    assert accuracy_reward(ZH, "7") == 1.0
    assert accuracy_reward(ZH, "８") == 0.0
    assert accuracy_reward(ZH, None) is None
    assert accuracy_reward("<think>\n6*7\n</think>\n\n<answer>\n42.0\n</answer>", "42") == 1.0
    assert eos_reward(True, 0.5) == 0.0
    assert eos_reward(False, 0.5) == -0.5


# ------------------------------------------------------------------ custom reward functions

def _write(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body), encoding="utf-8")
    return path


def test_load_reward_fn_from_file_and_module(tmp_path, monkeypatch):
    path = _write(
        tmp_path,
        "my_reward.py",
        """
        def length_bonus(prompt, reply, reference):
            return len(reply) / 10
        """,
    )
    fn = load_reward_fn(f"{path}:length_bonus")
    assert fn("p", "abcde", None) == 0.5
    monkeypatch.syspath_prepend(str(tmp_path))
    fn2 = load_reward_fn("my_reward:length_bonus")
    assert fn2("p", "ab", "x") == pytest.approx(0.2)


def test_load_reward_fn_errors_name_the_flag(tmp_path):
    path = _write(
        tmp_path,
        "bad_reward.py",
        """
        NOT_A_FUNCTION = 3
        def one_arg(reply):
            return 0.0
        """,
    )
    broken = _write(tmp_path, "broken_reward.py", "raise RuntimeError('boom')\n")
    specs = [
        "no_colon_here",
        ":fn",
        f"{path}:",
        "no_such_module_minippo_xyz:fn",
        f"{tmp_path / 'missing.py'}:fn",
        f"{path}:missing_attr",
        f"{path}:NOT_A_FUNCTION",
        f"{path}:one_arg",
        f"{broken}:fn",
    ]
    for spec in specs:
        with pytest.raises(ValueError, match="--reward_fn"):
            load_reward_fn(spec)


# ------------------------------------------------------------------ compute_rewards

R0 = ZH  # right answer, formatted
R1 = "<think>\nthe sum is 9\n</think>\n\n<answer>\n8\n</answer>"  # formatted, wrong
R2 = "<think>\nlet me think"  # cut at max length, no reference


def _batch():
    msgs = [[{"role": "user", "content": "3加4?"}], [{"role": "user", "content": "4+5?"}],
            [{"role": "user", "content": "hi"}]]
    return dict(
        prompts=["3加4?", "4+5?", "hi"],
        messages=msgs,
        replies=[R0, R1, R2],
        references=["7", "9", None],
        has_eos=[True, True, False],
    )


def test_compute_rewards_weighting_and_nan_accuracy():
    def has_seven(prompt, reply, reference):
        return 1.0 if "7" in reply else 0.0

    weights = {"format": 1.0, "tags": 0.5, "accuracy": 2.0, "eos": 0.3}
    total, comps = compute_rewards(
        **_batch(), weights=weights, rm=None, reasoning=True, custom_fns={"seven": has_seven}
    )
    assert total.dtype == torch.float32
    torch.testing.assert_close(comps["format"], torch.tensor([0.5, 0.5, 0.0]))
    torch.testing.assert_close(comps["tags"], torch.tensor([1.0, 1.0, 0.25]))
    torch.testing.assert_close(comps["eos"], torch.tensor([0.0, 0.0, -1.0]))
    torch.testing.assert_close(comps["custom/seven"], torch.tensor([1.0, 0.0, 0.0]))
    acc = comps["accuracy"]
    assert acc[0] == 1.0 and acc[1] == 0.0 and math.isnan(acc[2])
    assert "rm" not in comps
    # row 0: 1*0.5 + 0.5*1.0 + 2*1 + 0.3*0 + 1*1 (custom default weight) = 4.0
    # row 1: 0.5 + 0.5 + 0 + 0 + 0 = 1.0
    # row 2: 0 + 0.5*0.25 + 0 (no reference) + 0.3*(-1) + 0 = -0.175
    torch.testing.assert_close(total, torch.tensor([4.0, 1.0, -0.175]))

    # zero / explicit custom weight; missing built-in weights count as 0
    total2, _ = compute_rewards(
        **_batch(), weights={"accuracy": 1.0, "custom/seven": 0.0}, rm=None, reasoning=True,
        custom_fns={"seven": has_seven},
    )
    torch.testing.assert_close(total2, torch.tensor([1.0, 0.0, 0.0]))


def test_compute_rewards_reward_model_mix_and_skip():
    fake = FakeGetScoreRM()
    rm = RewardModelScorer(fake, None, clip=100.0)
    b = _batch()
    total, comps = compute_rewards(**b, weights={"rm": 2.0}, rm=rm, reasoning=True, custom_fns={})
    # reasoning: 0.4 * score(whole reply) + 0.6 * score(<answer> content, or whole reply if none)
    # fake score = len(content) / 10; answers: "7", "8", and R2 has no tags -> whole reply
    expected = torch.tensor([
        0.4 * len(R0) / 10 + 0.6 * 0.1,
        0.4 * len(R1) / 10 + 0.6 * 0.1,
        len(R2) / 10,
    ])
    torch.testing.assert_close(comps["rm"], expected)
    torch.testing.assert_close(total, 2.0 * expected)
    # the RM saw the prompt messages followed by the assistant reply
    assert fake.calls[0][1] == b["messages"][0] + [{"role": "assistant", "content": R0}]
    assert fake.calls[3][1] == b["messages"][0] + [{"role": "assistant", "content": "7"}]

    fake.calls.clear()
    _, comps = compute_rewards(**b, weights={"rm": 1.0}, rm=rm, reasoning=False, custom_fns={})
    torch.testing.assert_close(comps["rm"], torch.tensor([len(R0), len(R1), len(R2)]) / 10.0)
    assert len(fake.calls) == 3

    fake.calls.clear()
    _, comps = compute_rewards(**b, weights={"rm": 0.0, "format": 1.0}, rm=rm, reasoning=True, custom_fns={})
    assert fake.calls == [] and "rm" not in comps
    _, comps = compute_rewards(**b, weights={"rm": 1.0}, rm=None, reasoning=True, custom_fns={})
    assert "rm" not in comps


def test_compute_rewards_bad_input():
    b = _batch()
    with pytest.raises(ValueError, match="unknown reward weight"):
        compute_rewards(**b, weights={"fromat": 1.0}, rm=None, reasoning=False, custom_fns={})
    b2 = dict(b, has_eos=[True])
    with pytest.raises(ValueError, match="has_eos"):
        compute_rewards(**b2, weights={}, rm=None, reasoning=False, custom_fns={})

    def nan_fn(prompt, reply, reference):
        return float("nan")

    # A non-finite custom reward is passed through (the trainer skips and counts such steps).
    total, comps = compute_rewards(**b, weights={}, rm=None, reasoning=False, custom_fns={"nan_fn": nan_fn})
    assert torch.isnan(comps["custom/nan_fn"]).all() and torch.isnan(total).all()


# ------------------------------------------------------------------ custom functions that misbehave

LONG_PROMPT = "<|im_start|>user\n" + "why is the sky blue? " * 10 + "<|im_end|>\n<|im_start|>assistant\n<think>\n"


def _custom_batch(prompt: str = LONG_PROMPT, first: str = "ok") -> dict:
    return dict(prompts=[first, prompt], messages=[[], []], replies=["a", "b"], references=[None, None],
                has_eos=[True, True], weights={}, rm=None, reasoning=False)


class _Custom(BaseException):
    pass


def _fails_on_second_row(make_exc):
    """A reward fn that scores row 0 ("ok") and raises make_exc() on row 1."""
    def fn(prompt, reply, reference):
        if prompt == "ok":
            return 0.0
        raise make_exc()
    return fn


@pytest.mark.parametrize("make_exc, what", [
    (lambda: ZeroDivisionError("division by zero"), "raised ZeroDivisionError: division by zero on row 1"),
    (lambda: RuntimeError("first line\nsecond line"), "raised RuntimeError: first line on row 1"),
    (lambda: SystemExit(0), "raised SystemExit: 0 on row 1"),
    (lambda: SystemExit(3), "raised SystemExit: 3 on row 1"),
    (lambda: SystemExit(), "raised SystemExit on row 1"),
    (lambda: _Custom("not an Exception"), "raised _Custom: not an Exception on row 1"),
], ids=["ZeroDivisionError", "multiline", "SystemExit0", "SystemExit3", "SystemExit-no-code", "BaseException"])
def test_raising_reward_fn_is_one_line_reward_fn_error(make_exc, what):
    """A raising custom reward (SystemExit 0 and other BaseExceptions included) becomes one
    RewardFnError line naming the function, the exception and the row's shortened prompt."""
    from trainer.rewards import RewardFnError

    with pytest.raises(RewardFnError) as info:
        compute_rewards(**_custom_batch(), custom_fns={"myfn": _fails_on_second_row(make_exc)})
    msg = str(info.value)
    assert isinstance(info.value, RuntimeError) and "\n" not in msg
    assert "--reward_fn myfn" in msg and what in msg and "second line" not in msg
    # The prompt, newlines removed and cut to ~60 characters.
    assert "<|im_start|>user why is the sky blue?" in msg and "<think>" not in msg
    quoted = msg.split("prompt: ")[1]
    assert len(quoted) <= 70, quoted
    assert info.value.fn_name == "myfn" and info.value.row == 1


def test_keyboard_interrupt_in_reward_fn_passes_through():
    def ctrl_c(prompt, reply, reference):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        compute_rewards(**_custom_batch(), custom_fns={"ctrl_c": ctrl_c})


@pytest.mark.parametrize("value, shown", [
    ("0.5", "str '0.5'"),
    (None, "NoneType None"),
    ([1.0, 2.0], "list [1.0, 2.0]"),
    (True, "bool True"),
    (np.bool_(False), "bool np.False_"),
    (torch.tensor([1.0, 2.0]), "Tensor"),
    (torch.tensor(True), "Tensor"),
    (1 + 2j, "complex"),
    pytest.param("x" * 500, "str 'xxxx", id="long-str"),
])
def test_non_number_from_reward_fn_is_refused(value, shown):
    from trainer.rewards import RewardFnError

    with pytest.raises(RewardFnError) as info:
        compute_rewards(**_custom_batch(first="short\nprompt"), custom_fns={"bad": lambda p, r, ref: value})
    msg = str(info.value)
    assert "\n" not in msg and "--reward_fn bad returned " + shown in msg and "'short prompt'" in msg
    assert "must return a number" in msg and len(msg) < 250  # a long repr is shortened


@pytest.mark.parametrize("value", [1, 0.25, math.nan, math.inf, -math.inf, np.float32(0.5), np.int64(2),
                                   torch.tensor(0.75), np.array(1.5)])
def test_numbers_from_reward_fn_are_accepted(value):
    """ints, floats (NaN/inf too: the trainer skips such steps), numpy scalars and 0-d tensors."""
    _, comps = compute_rewards(**_custom_batch(), custom_fns={"num": lambda p, r, ref: value})
    expected = torch.full((2,), float(value), dtype=torch.float32)
    torch.testing.assert_close(comps["custom/num"], expected, equal_nan=True)


def test_compute_rewards_times_each_custom_fn():
    from trainer.run.timing import PhaseTimer

    calls = []

    def slow(prompt, reply, reference):
        calls.append(prompt)
        time.sleep(0.02)
        return 1.0

    timer = PhaseTimer()
    b = _batch()
    total, comps = compute_rewards(**b, weights={"format": 1.0}, rm=None, reasoning=False,
                                   custom_fns={"slow": slow, "fast": lambda p, r, ref: 0.0}, timer=timer)
    assert len(calls) == 3
    assert set(timer.wall) == {"reward/slow", "reward/fast"}
    assert 0.06 <= timer.wall["reward/slow"] < 1.0  # three calls of 20 ms, summed over the batch
    assert timer.wall["reward/fast"] < 0.02
    # Same outputs as without a timer.
    total2, comps2 = compute_rewards(**b, weights={"format": 1.0}, rm=None, reasoning=False,
                                     custom_fns={"slow": slow, "fast": lambda p, r, ref: 0.0})
    torch.testing.assert_close(total, total2)
    assert comps.keys() == comps2.keys()


def test_overlong_penalty_is_dapos_linear_ramp():
    # max 64 tokens, buffer 16: 0 up to 48 tokens, then -(L - 48) / 16, -1 at 64.
    got = overlong_penalty(torch.tensor([10, 48, 52, 56, 64]), max_len=64, buffer_len=16)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(torch.tensor([1]), max_len=8, buffer_len=0)


def test_ifeval_reward_is_the_share_met_logged_per_type_and_absent_rows_add_nothing():
    b = _batch()
    cons = [[{"type": "no_comma"}, {"type": "number_words", "relation": "less than", "num": 3}], None,
            [{"type": "lowercase"}]]
    replies = ["one, two", "Anything.", "all lower"]
    total, comps = compute_rewards(**{**b, "replies": replies}, weights={"ifeval": 2.0}, rm=None, reasoning=True,
                                   custom_fns={}, constraints=cons)
    assert comps["ifeval"][0] == 0.5 and math.isnan(comps["ifeval"][1]) and comps["ifeval"][2] == 1.0
    assert comps["ifeval/no_comma"][0] == 0.0 and comps["ifeval/number_words"][0] == 1.0
    assert math.isnan(comps["ifeval/lowercase"][0]) and comps["ifeval/lowercase"][2] == 1.0
    torch.testing.assert_close(total, torch.tensor([1.0, 0.0, 2.0]))  # per-type components are logged only
    _, plain = compute_rewards(**b, weights={"ifeval": 2.0}, rm=None, reasoning=True, custom_fns={})
    assert not any(k.startswith("ifeval") for k in plain)  # no constraints anywhere: no component


def test_ifeval_components_are_the_same_keys_whatever_rows_a_rank_drew():
    """Under DDP every rank reduces the same metric keys: an instruction-following batch whose rows ask for nothing
    ([]) or for other types still has every ifeval component (NaN), a file without constraints (None) has none."""
    b = _batch()
    _, asks = compute_rewards(**b, weights={}, rm=None, reasoning=True, custom_fns={}, constraints=[[{"type": "title"}], [], []])
    _, empty = compute_rewards(**b, weights={}, rm=None, reasoning=True, custom_fns={}, constraints=[[], [], []])
    _, plain = compute_rewards(**b, weights={}, rm=None, reasoning=True, custom_fns={}, constraints=[None] * 3)
    assert set(asks) == set(empty) and {k for k in asks if k.startswith("ifeval/")} == {f"ifeval/{k}" for k in F.CHECKS}
    assert torch.isnan(empty["ifeval"]).all() and not any(k.startswith("ifeval") for k in plain)


def test_ifeval_partial_credit_is_its_own_weighted_component():
    b = _batch()
    cons = [[{"type": "uppercase"}], None, [{"type": "uppercase"}, {"type": "no_comma"}]]
    replies = ["ABcd", "Anything.", "SHOUT"]
    total, comps = compute_rewards(**{**b, "replies": replies}, weights={"ifeval": 1.0, "ifeval_partial": 0.5}, rm=None,
                                   reasoning=True, custom_fns={}, constraints=cons)
    assert comps["ifeval_partial"][0] == 0.5 and math.isnan(comps["ifeval_partial"][1]) and comps["ifeval_partial"][2] == 0.0
    torch.testing.assert_close(total, torch.tensor([0.25, 0.0, 1.0]))  # 0 met + 0.5 x 0.5; none asked; all met
    _, off = compute_rewards(**{**b, "replies": replies}, weights={"ifeval": 1.0}, rm=None, reasoning=True,
                             custom_fns={}, constraints=cons)
    torch.testing.assert_close(off["ifeval_partial"], comps["ifeval_partial"], equal_nan=True)  # logged at weight 0


def test_clip_to_range_clips_huge_finite_rewards_and_flags_them():
    from trainer.rewards import clip_to_range

    r = torch.tensor([1e30, -1e30, 3.0, float("nan"), float("inf"), -1e4])
    out, flags = clip_to_range(r, 1e4)
    assert out[:3].tolist() == [1e4, -1e4, 3.0] and out[5].item() == -1e4
    assert math.isnan(out[3].item()) and out[4].item() == math.inf  # non-finite: the step is skipped, as before
    assert flags.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
