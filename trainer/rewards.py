"""Every reward component of the trainer in one place.

A "reply" is the full assistant message: the prefix the chat template forced (e.g. "<think>\\n")
plus the generated response decoded with special tokens skipped (`<think>`/`</think>` are ordinary
tokens in the MiniMind tokenizer, so they survive decoding).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import numbers
import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dataset import ifeval
from trainer import plugins, verifier
from trainer.reward_model import RewardModelScorer

__all__ = [
    "FORMAT_PATTERN",
    "format_reward",
    "tag_reward",
    "extract_answer",
    "answers_match",
    "accuracy_reward",
    "eos_reward",
    "load_reward_fn",
    "RewardFnError",
    "compute_rewards",
]

RewardFn = Callable[[str, str, "str | None"], float]
# A batch reward function (--reward_url: trainer/reward_server.py RewardFunctionServer): (prompts, replies, references)
# -> one float per row.
BatchRewardFn = Callable[[list[str], list[str], "list[str | None]"], list[float]]
# `with timer(name):` times a block and sums per name (trainer/run/timing.py PhaseTimer).
Timer = Callable[[str], contextlib.AbstractContextManager]

# One optional blank line between </think> and <answer>: the MiniMind chat template writes
# "</think>\n\n" before the answer, the R1-style format writes "</think>\n".
# The reasoning and the answer may not contain the tags themselves: without that, a reply that
# repeats a <think> block still matches the non-greedy pattern (a cheap reward hack).
_NO_TAG = r"(?:(?!</?think>|</?answer>).)*?"
FORMAT_PATTERN = re.compile(rf"^<think>\n{_NO_TAG}\n</think>\n\n?<answer>\n{_NO_TAG}\n</answer>$", re.DOTALL)
REASONING_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
BUILTIN_COMPONENTS = ("format", "tags", "rm", "accuracy", "eos", "ifeval", "ifeval_partial", "url")

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# Full-width digits/signs/separators (common in Chinese text) and U+2212 MINUS SIGN -> ASCII.
_TO_ASCII = str.maketrans(
    {**{chr(0xFF10 + i): str(i) for i in range(10)},
     "\uFF0D": "-", "\u2212": "-", "\uFF0B": "+", "\uFF0E": ".", "\uFF0C": ",", "\u3000": " "}
)
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_NUMBER_RE = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


# ----------------------------------------------------------------------------- rule-based rewards

def format_reward(reply: str) -> float:
    """0.5 when the stripped reply is exactly <think>\\n...\\n</think>\\n[\\n]<answer>\\n...\\n</answer>."""
    return 0.5 if FORMAT_PATTERN.fullmatch(reply.strip()) else 0.0


def tag_reward(reply: str) -> float:
    """+0.25 for each reasoning tag that occurs exactly once (a partial-credit shaping signal)."""
    return 0.25 * sum(reply.count(tag) == 1 for tag in REASONING_TAGS)


def extract_answer(reply: str) -> str | None:
    """The final answer: last <answer>...</answer> content, else text after the last </think>,
    else the whole reply; stripped; None when empty."""
    found = _ANSWER_RE.findall(reply)
    if found:
        text = found[-1]
    elif "</think>" in reply:
        text = reply.rsplit("</think>", 1)[1]
    else:
        text = reply
    text = text.strip()
    return text or None


def _normalise(text: str) -> str:
    text = text.strip()
    # A reference stored as "<answer>7</answer>" or with a dangling tag.
    text = text.removeprefix("<answer>").removesuffix("</answer>").strip()
    text = text.translate(_TO_ASCII)
    text = " ".join(text.split())
    text = text.rstrip(".。").strip()
    if _THOUSANDS_RE.fullmatch(text):
        text = text.replace(",", "")
    return text


def _as_number(text: str) -> Decimal | None:
    if not _NUMBER_RE.fullmatch(text):
        return None
    try:
        return Decimal(text)  # exact: "3.0" == "3", no float rounding surprises
    except InvalidOperation:
        return None


def answers_match(pred: str | None, reference: str | None) -> bool:
    """Numbers compare by value ("3.0" == "3", "７" == "7", "−3" == "-3", "1,000" == "1000"),
    anything else by case-insensitive string equality. A reference that is itself a reply in
    reasoning format is reduced to its answer first."""
    if pred is None or reference is None:
        return False
    ref = extract_answer(reference)
    if ref is None:
        return False
    p, r = _normalise(pred), _normalise(ref)
    if not p or not r:
        return False
    pn, rn = _as_number(p), _as_number(r)
    if pn is not None and rn is not None:
        return pn == rn
    return p.casefold() == r.casefold()


def accuracy_reward(reply: str, reference: str | None) -> float | None:
    """1.0 when the reply's answer matches the reference, 0.0 if not, None without a reference."""
    if reference is None:
        return None
    return 1.0 if answers_match(extract_answer(reply), reference) else 0.0


def gt_reward(reply: str, gt: list[str]) -> float:
    """MiniMind's agent reward: the share of the ground-truth values `gt` the reply's answer contains (a number by
    value among the answer's numbers, any other value as a case-insensitive substring)."""
    answer = _normalise(extract_answer(reply) or "")
    numbers = {_as_number(x) for x in _NUMBER_RE.findall(answer.replace(",", ""))}
    hit = 0
    for g in gt:
        value = _as_number(_normalise(g))
        hit += (value in numbers) if value is not None else (_normalise(g).casefold() in answer.casefold())
    return hit / len(gt)


def eos_reward(has_eos: bool, penalty: float) -> float:
    """-penalty for a response cut at the length limit (it never emitted EOS), else 0."""
    return 0.0 if has_eos or penalty == 0 else -float(penalty)


# ----------------------------------------------------------------------------- custom reward functions

def load_reward_fn(spec: str) -> RewardFn:
    """Load `fn(prompt, reply, reference) -> float` from "package.module:function" or
    "path/to/file.py:function" (trainer/plugins.py imports it)."""
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr:
        raise ValueError(
            f"--reward_fn {spec!r}: expected 'module:function' or 'path/to/file.py:function'"
        )
    if plugins.is_file_target(module_part) and not Path(module_part).is_file():
        raise ValueError(f"--reward_fn {spec!r}: file {module_part!r} does not exist")
    try:
        module = plugins.import_target(module_part)
    except ModuleNotFoundError as e:
        raise ValueError(f"--reward_fn {spec!r}: cannot import module {module_part!r} ({e})") from None
    except Exception as e:  # the user's module raised while importing, or the file is no module
        what = "ImportError" if isinstance(e, plugins.NotPythonSource) else type(e).__name__
        raise ValueError(f"--reward_fn {spec!r}: importing {module_part!r} failed: {what}: {e}") from e
    if not hasattr(module, attr):
        raise ValueError(f"--reward_fn {spec!r}: module {module_part!r} has no attribute {attr!r}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise ValueError(f"--reward_fn {spec!r}: {attr!r} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind("prompt", "reply", None)
    except TypeError:
        raise ValueError(
            f"--reward_fn {spec!r}: {attr} must accept (prompt, reply, reference), "
            f"its signature is {inspect.signature(fn)}"
        ) from None
    except ValueError:
        pass  # builtins without an inspectable signature: trust the user
    return fn


class RewardFnError(RuntimeError):
    """A custom reward function raised or returned a non-number. The message is one line naming the
    function, what went wrong and the row's prompt; the trainer prints it instead of a traceback."""

    def __init__(self, message: str, fn_name: str, row: int) -> None:
        super().__init__(message)
        self.fn_name = fn_name
        self.row = row


def _short(text: str, limit: int = 60) -> str:
    """One line of at most ~limit characters: whitespace runs (newlines too) become one space."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _is_number(value: Any) -> bool:
    """int/float/Fraction/numpy scalars and 0-d numeric tensors/arrays; never bool (a True is almost
    always a bug: a predicate returned instead of a score). NaN and inf count as numbers."""
    if isinstance(value, (bool, str, bytes)):
        return False
    if isinstance(value, (numbers.Real, Decimal)):
        return True
    dtype, ndim = getattr(value, "dtype", None), getattr(value, "ndim", None)
    if dtype is None or ndim != 0:  # lists, None, dicts, non-scalar tensors and arrays
        return False
    if isinstance(value, Tensor):
        return not dtype.is_complex and dtype != torch.bool
    return getattr(dtype, "kind", None) in ("i", "u", "f")  # numpy: signed/unsigned int, float (not bool)


def _call_reward_fn(name: str, fn: RewardFn, prompt: str, reply: str, reference: str | None, row: int) -> float:
    """fn(prompt, reply, reference) as a float, or RewardFnError. SystemExit (even exit 0) and other
    BaseExceptions become RewardFnError too, so a reward function cannot end a run looking successful;
    only KeyboardInterrupt (the user's Ctrl-C) passes through."""
    where = f"on row {row} (prompt: {_short(prompt)!r})"
    try:
        value = fn(prompt, reply, reference)
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        lines = str(e).strip().splitlines()
        what = f"{type(e).__name__}: {_short(lines[0], 200)}" if lines else type(e).__name__
        raise RewardFnError(f"--reward_fn {name} raised {what} {where}", name, row) from e
    if _is_number(value):
        try:
            return float(value)
        except (TypeError, ValueError, OverflowError, ArithmeticError):
            pass  # a Real whose float() fails: report it like any non-number
    raise RewardFnError(
        f"--reward_fn {name} returned {type(value).__name__} {_short(repr(value))} {where}; "
        f"it must return a number (int or float; nan/inf skip the step)", name, row,
    )


# ----------------------------------------------------------------------------- combined reward

def _answer_only(reply: str) -> str:
    found = _ANSWER_RE.findall(reply)
    return found[-1].strip() if found else reply


def overlong_penalty(lengths: Tensor, max_len: int, buffer_len: int) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), in [-1, 0]: 0 up to max_len - buffer_len
    tokens, then falling linearly to -1 at max_len, so a response is warned before it is cut.
    lengths [B] = response tokens (EOS included)."""
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"overlong buffer {buffer_len} must be in (0, {max_len}]")
    over = lengths.float() - (max_len - buffer_len)
    return -(over.clamp(min=0) / buffer_len).clamp(max=1.0)


def _verify(reply: str, row: dict) -> tuple[float, float]:
    """(score, 1.0 if it ran over --verifier_timeout else 0.0) of a reasoning-gym row, by the bounded verifier."""
    before = verifier.timeouts()
    value = verifier.score(reply, row)
    return value, float(verifier.timeouts() > before)


def clip_to_range(rewards: Tensor, max_abs: float) -> tuple[Tensor, Tensor]:
    """(rewards with every finite value outside [-max_abs, max_abs] clipped to it, 1/0 per row: was it clipped).
    NaN and inf stay as they are (the trainer skips such a step). One huge finite value (a server's 1e30) would
    otherwise dominate the step and, under --reward_norm running, the moments of every later step."""
    out = rewards.isfinite() & (rewards.abs() > max_abs)
    return torch.where(out, rewards.clamp(-max_abs, max_abs), rewards), out.float()


def compute_rewards(
    *,
    prompts: list[str],
    messages: list[list[dict]],
    replies: list[str],
    references: list[str | None],
    has_eos: list[bool],
    weights: dict[str, float],
    rm: RewardModelScorer | None,
    reasoning: bool,
    custom_fns: dict[str, RewardFn],
    timer: Timer | None = None,
    constraints: list[list[dict] | None] | None = None,
    gts: list[list[str] | None] | None = None,
    rg: list[dict | None] | None = None,
    reward_url: BatchRewardFn | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Total reward [B] (float32) and each component's raw, unweighted value [B].

    Components: "format", "tags", "accuracy" (nan where there is no reference; adds 0 there; a row with `gts`, a
    MiniMind agent row's ground truth, scores the share of it the answer contains instead; a row with `rg`, a
    reasoning-gym row, its task's own score_answer of the <answer> content, in a bounded worker: trainer/verifier.py;
    then "verifier_timeout", 1 where it ran over --verifier_timeout and scored 0), "ifeval" (when
    `constraints` has a list for any row, [] = none asked: the fraction of a row's constraints met, nan where
    it has none; adds 0 there) with "ifeval/<type>" for every type (1/0, nan where absent; weight 0: logged only),
    "ifeval_partial" (ifeval.partial_credit: how close the unmet constraints come, nan likewise),
    "eos" (-1 when cut at the length limit), "rm" (only computed when rm is given and
    weights["rm"] != 0; `rm` may score in this process or on a server, trainer/reward_server.py), "url" (a batch
    reward function's, --reward_url: only computed when given and weights["url"] != 0), and "custom/<name>" per
    custom function. Built-in weights default to 0
    when absent, custom ones (key "custom/<name>") to 1.

    A custom function that raises or returns a non-number raises RewardFnError. With `timer`, each
    custom function's calls are timed under "reward/<name>", summed over the batch, and `reward_url`'s under
    "reward/url". A reward server's failure (trainer/reward_server.py RewardServerError) passes through.
    """
    n = len(replies)
    lengths = {"prompts": len(prompts), "messages": len(messages), "references": len(references),
               "has_eos": len(has_eos)}
    bad = {k: v for k, v in lengths.items() if v != n}
    if bad:
        raise ValueError(f"compute_rewards: {n} replies but {bad}")
    allowed = set(BUILTIN_COMPONENTS) | {f"custom/{name}" for name in custom_fns}
    unknown = sorted(set(weights) - allowed)
    if unknown:
        raise ValueError(f"unknown reward weight(s) {unknown}; valid names: {sorted(allowed)}")

    def col(xs: list[float]) -> Tensor:
        return torch.tensor(xs, dtype=torch.float32)

    verified = {i: _verify(r, e) for i, (r, e) in enumerate(zip(replies, rg or [None] * n)) if e}

    components: dict[str, Tensor] = {
        "format": col([format_reward(r) for r in replies]),
        "tags": col([tag_reward(r) for r in replies]),
        "accuracy": col([
            verified[i][0] if e else gt_reward(r, g) if g else math.nan if (a := accuracy_reward(r, ref)) is None else a
            for i, (r, ref, g, e) in enumerate(zip(replies, references, gts or [None] * n, rg or [None] * n))
        ]),
        "eos": col([eos_reward(e, 1.0) for e in has_eos]),
    }
    if any(rg or []):  # 1 where the bounded verifier ran over --verifier_timeout (scored 0), nan on other rows
        components["verifier_timeout"] = col([verified[i][1] if e else math.nan for i, e in enumerate(rg or [])])
    if constraints is not None and any(cs is not None for cs in constraints):  # instruction following (dataset/ifeval.py)
        met = [ifeval.results(cs or [], r) for cs, r in zip(constraints, replies)]
        components["ifeval"] = col([ifeval.share_met(m) if m else math.nan for m in met])
        components["ifeval_partial"] = col([ifeval.partial_credit(cs or [], r, m) if m else math.nan
                                            for cs, r, m in zip(constraints, replies, met)])
        # Every type, NaN where a row does not ask for it: the same keys on every rank whatever rows it drew.
        for kind in ifeval.CHECKS:  # logged per type, weight 0
            components[f"ifeval/{kind}"] = col([next((float(ok) for t, ok in m if t == kind), math.nan) for m in met])
    if rm is not None and weights.get("rm", 0.0) != 0:
        full = [m + [{"role": "assistant", "content": r}] for m, r in zip(messages, replies)]
        if reasoning:
            answers = [m + [{"role": "assistant", "content": _answer_only(r)}]
                       for m, r in zip(messages, replies)]
            scores = rm.score(full + answers)  # one pass over both lists batches better
            components["rm"] = 0.4 * scores[:n] + 0.6 * scores[n:]
        else:
            components["rm"] = rm.score(full)
    if reward_url is not None and weights.get("url", 0.0) != 0:
        with timer("reward/url") if timer is not None else contextlib.nullcontext():
            components["url"] = col(reward_url(prompts, replies, references))
    for name, fn in custom_fns.items():
        vals = []
        for i, (p, r, ref) in enumerate(zip(prompts, replies, references)):
            with timer(f"reward/{name}") if timer is not None else contextlib.nullcontext():
                v = _call_reward_fn(name, fn, p, r, ref, i)
            # A non-finite value is passed on: the trainer skips that step and counts it.
            vals.append(v)
        components[f"custom/{name}"] = col(vals)

    total = torch.zeros(n, dtype=torch.float32)
    for key, value in components.items():
        w = weights.get(key, 1.0 if key.startswith("custom/") else 0.0)
        if w != 0:
            # nan accuracy means "no reference" and adds nothing; any other nan is real and propagates.
            v = torch.nan_to_num(value.float(), nan=0.0) if key in ("accuracy", "ifeval", "ifeval_partial") else value.float()
            total = total + float(w) * v
    return total, components
