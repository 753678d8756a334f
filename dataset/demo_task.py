"""The embedded demo task: bilingual (English / Chinese) arithmetic-style prompts with short,
verifiable answers, small enough for a ~1M-parameter policy to learn on a CPU.

Tasks (`TASKS`), each in both languages (`LANGS`):
    add    a + b            a, b in 0..99
    sub    a - b            0 <= b <= a <= 99 (answers are never negative)
    mul    a x b            a in 2..99, b in 2..9
    cmp    larger / smaller of two distinct numbers in 0..99
    count  how many times a symbol (letter or word) occurs in a list of 4..8 items

A full assistant message always starts with "<think>\\n" because the chat template opens the
thinking block in the generation prompt. Two reply styles:
    full   "<think>\\n{trace}\\n</think>\\n<answer>\\n{answer}\\n</answer>"
    plain  "<think>\\n\\n</think>\\n{answer}"
The trace is a deterministic digit-by-digit working in the prompt's language.

Train / eval are split by a SHA-256 hash of the language-free canonical problem (`problem_key`),
so the same problem in either language, phrasing or operand order stays on one side.

Everything is a pure function of its arguments; randomness comes from the `random.Random`
passed in, and `generate_all(seed)` derives one named stream per output so changing one count
does not reshuffle the other files.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass

TASKS: tuple[str, ...] = ("add", "sub", "mul", "cmp", "count")
LANGS: tuple[str, ...] = ("en", "zh")
STYLES: tuple[str, ...] = ("full", "plain")

# Share of canonical problems held out for evaluation, in permille of the hash space.
EVAL_PERMILLE = 100

THINK_OPEN = "<think>\n"
FULL_REPLY_RE = re.compile(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", re.DOTALL)
_ANSWER_TAG_RE = re.compile(r"<answer>\n?(.*?)\n?</answer>", re.DOTALL)

# Symbols for the count task: (English, Chinese). Letters read the same in both languages.
_LETTERS = tuple((c, c) for c in "abcdefghijklmnopqrstuvwxyz")
_WORDS = (
    ("cat", "猫"), ("dog", "狗"), ("fish", "鱼"), ("bird", "鸟"), ("horse", "马"),
    ("apple", "苹果"), ("pear", "梨"), ("peach", "桃"), ("tea", "茶"), ("rice", "米饭"),
    ("red", "红色"), ("blue", "蓝色"), ("green", "绿色"), ("sun", "太阳"), ("moon", "月亮"),
    ("star", "星星"), ("book", "书"), ("pen", "笔"), ("cup", "杯子"), ("tree", "树"),
)
SYMBOLS: tuple[tuple[str, str], ...] = _LETTERS + _WORDS
_N_LETTERS = len(_LETTERS)

_PROMPTS: dict[tuple[str, str], tuple[str, ...]] = {
    ("add", "en"): ("What is {a} + {b}?", "Calculate {a} plus {b}.", "{a} + {b} = ?"),
    ("add", "zh"): ("{a}加{b}等于多少？", "计算 {a} + {b}。", "{a} + {b} 等于几？"),
    ("sub", "en"): ("What is {a} - {b}?", "Calculate {a} minus {b}.", "{a} - {b} = ?"),
    ("sub", "zh"): ("{a}减{b}等于多少？", "计算 {a} - {b}。", "{a} - {b} 等于几？"),
    ("mul", "en"): ("What is {a} × {b}?", "Calculate {a} times {b}.", "{a} × {b} = ?"),
    ("mul", "zh"): ("{a}乘以{b}等于多少？", "计算 {a} × {b}。", "{a} × {b} 等于几？"),
    ("cmp_max", "en"): ("Which is larger, {a} or {b}?", "Which number is bigger: {a} or {b}?"),
    ("cmp_max", "zh"): ("{a}和{b}哪个更大？", "{a}与{b}相比，哪个数大？"),
    ("cmp_min", "en"): ("Which is smaller, {a} or {b}?", "Which number is less: {a} or {b}?"),
    ("cmp_min", "zh"): ("{a}和{b}哪个更小？", "{a}与{b}相比，哪个数小？"),
    ("count", "en"): ('How many times does "{t}" appear in: {items}?',
                      'Count the "{t}" in this list: {items}.'),
    ("count", "zh"): ("“{t}”在 {items} 中出现了几次？", "数一数：{items} 里有几个“{t}”？"),
}

# Words of the traces, per language.
_WORDING = {
    "en": {"ones": "ones: ", "tens": "tens: ", "sep": ", ", "write": "write {d}",
           "carry": " carry {c}", "borrow": ", borrow 1", "list": ", "},
    "zh": {"ones": "个位：", "tens": "十位：", "sep": "，", "write": "写{d}",
           "carry": "进{c}", "borrow": "，借1", "list": "、"},
}


@dataclass(frozen=True)
class Problem:
    """One demo problem. `operands` is task-specific (see `make_problem`); `template` picks
    the phrasing of the prompt."""

    task: str
    lang: str
    operands: tuple[int, ...]
    template: int = 0

    @property
    def prompt(self) -> str:
        return render_prompt(self)

    @property
    def answer(self) -> str:
        return reference_answer(self.task, self.operands)

    @property
    def key(self) -> str:
        return problem_key(self.task, self.operands)


# ---------------------------------------------------------------- problems and prompts

def make_problem(rng: random.Random, task: str, lang: str) -> Problem:
    """Sample one problem. Operands:
    add (a, b); sub (a, b) with a >= b; mul (a, b) with b one digit;
    cmp (a, b, want) with want 0 = larger, 1 = smaller; count (target, item, item, ...) as
    indices into SYMBOLS."""
    if lang not in LANGS:
        raise ValueError(f"unknown language {lang!r}; expected one of {LANGS}")
    if task == "add":
        operands: tuple[int, ...] = (rng.randint(0, 99), rng.randint(0, 99))
    elif task == "sub":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        operands = (max(a, b), min(a, b))
    elif task == "mul":
        operands = (rng.randint(2, 99), rng.randint(2, 9))
    elif task == "cmp":
        a, b = rng.sample(range(100), 2)
        operands = (a, b, rng.randint(0, 1))
    elif task == "count":
        # A pool of 3 symbols from one theme keeps the target frequent (mean count ~2).
        theme = range(_N_LETTERS) if rng.random() < 0.5 else range(_N_LETTERS, len(SYMBOLS))
        pool = rng.sample(theme, 3)
        items = [rng.choice(pool) for _ in range(rng.randint(4, 8))]
        operands = (rng.choice(pool), *items)
    else:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    n_templates = len(_PROMPTS[(_template_group(task, operands), lang)])
    return Problem(task, lang, operands, rng.randrange(n_templates))


def _template_group(task: str, operands: tuple[int, ...]) -> str:
    if task == "cmp":
        return "cmp_min" if operands[2] else "cmp_max"
    return task


def render_prompt(problem: Problem) -> str:
    """The user message for a problem."""
    task, lang, ops = problem.task, problem.lang, problem.operands
    template = _PROMPTS[(_template_group(task, ops), lang)][problem.template]
    if task == "count":
        names = [SYMBOLS[i][LANGS.index(lang)] for i in ops]
        return template.format(t=names[0], items=_WORDING[lang]["list"].join(names[1:]))
    return template.format(a=ops[0], b=ops[1])


def _prompt_regex(template: str) -> re.Pattern:
    fields = {"{a}": r"(?P<a>\d+)", "{b}": r"(?P<b>\d+)", "{t}": r"(?P<t>.+?)",
              "{items}": r"(?P<items>.+?)"}
    pattern = re.escape(template)
    for field, group in fields.items():
        pattern = pattern.replace(re.escape(field), group)
    return re.compile(pattern)


_PROMPT_PATTERNS = tuple((group, lang, index, _prompt_regex(template))
                         for (group, lang), templates in _PROMPTS.items()
                         for index, template in enumerate(templates))
_SYMBOL_IDS = {lang: {names[col]: i for i, names in enumerate(SYMBOLS)}
               for col, lang in enumerate(LANGS)}


def parse_prompt(prompt: str) -> Problem | None:
    """Invert `render_prompt`: the Problem behind a demo prompt, or None if it is not one.
    Lets an evaluator (or a test) recompute answers from the prompt text alone."""
    for group, lang, index, pattern in _PROMPT_PATTERNS:
        match = pattern.fullmatch(prompt)
        if match is not None:
            if group == "count":
                ids = _SYMBOL_IDS[lang]
                names = [match["t"], *match["items"].split(_WORDING[lang]["list"])]
                if not all(name in ids for name in names):
                    continue
                problem = Problem("count", lang, tuple(ids[name] for name in names), index)
            else:
                a, b = int(match["a"]), int(match["b"])
                if group.startswith("cmp"):
                    problem = Problem("cmp", lang, (a, b, int(group == "cmp_min")), index)
                else:
                    problem = Problem(group, lang, (a, b), index)
            if render_prompt(problem) == prompt:
                return problem
    return None


def reference_answer(task: str, operands: tuple[int, ...]) -> str:
    """The exact answer string, computed directly (not through the trace)."""
    if task == "add":
        return str(operands[0] + operands[1])
    if task == "sub":
        return str(operands[0] - operands[1])
    if task == "mul":
        return str(operands[0] * operands[1])
    if task == "cmp":
        a, b, want = operands
        return str(min(a, b) if want else max(a, b))
    if task == "count":
        return str(operands[1:].count(operands[0]))
    raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")


def problem_key(task: str, operands: tuple[int, ...]) -> str:
    """Language- and phrasing-free identity of a problem. Commutative operand orders and the
    order of a count list map to one key, so a held-out problem is not seen reordered."""
    if task in ("add", "mul"):
        ops: tuple[int, ...] = tuple(sorted(operands))
    elif task == "cmp":
        ops = (*sorted(operands[:2]), operands[2])
    elif task == "count":
        ops = (operands[0], *sorted(operands[1:]))
    else:
        ops = tuple(operands)
    return f"{task}:{','.join(map(str, ops))}"


def is_eval_key(key: str) -> bool:
    """Deterministic split (independent of PYTHONHASHSEED): ~10% of problems are held out."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 1000 < EVAL_PERMILLE


# ---------------------------------------------------------------- traces and replies

def solve(problem: Problem, slip: bool = False) -> tuple[str, str]:
    """Return (trace, answer). With `slip`, the working contains one plausible mistake
    (dropped carry/borrow, a digit off by one, a flipped comparison, a missed item) and the
    answer follows the faulty working, so trace and answer stay consistent but wrong."""
    w = _WORDING[problem.lang]
    ops = problem.operands
    solver = {"add": _solve_add, "sub": _solve_sub, "mul": _solve_mul,
              "cmp": _solve_cmp, "count": _solve_count}[problem.task]
    lines, answer = solver(ops, w, slip, problem.lang)
    return "\n".join(lines), str(answer)


def _solve_add(ops: tuple[int, ...], w: dict[str, str], slip: bool,
               lang: str) -> tuple[list[str], int]:
    a, b = ops
    if a < 10 and b < 10:
        s = a + b + (1 if slip else 0)
        return [f"{a}+{b}={s}"], s
    (a1, a0), (b1, b0) = divmod(a, 10), divmod(b, 10)
    s0 = a0 + b0
    if slip and s0 < 10:  # no carry to forget: slip on the ones digit instead
        s0 = s0 + 1 if s0 < 9 else s0 - 1
    carry = s0 // 10
    ones = f"{w['ones']}{a0}+{b0}={s0}"
    if carry:
        ones += w["sep"] + w["write"].format(d=s0 % 10) + w["carry"].format(c=1)
    used_carry = carry and not slip
    tens_sum = a1 + b1 + (1 if used_carry else 0)
    tens = f"{w['tens']}{a1}+{b1}" + ("+1" if used_carry else "") + f"={tens_sum}"
    return [ones, tens], tens_sum * 10 + s0 % 10


def _solve_sub(ops: tuple[int, ...], w: dict[str, str], slip: bool,
               lang: str) -> tuple[list[str], int]:
    a, b = ops
    if a < 10:
        d = a - b
        d = (d + 1 if d < 9 else d - 1) if slip else d
        return [f"{a}-{b}={d}"], d
    (a1, a0), (b1, b0) = divmod(a, 10), divmod(b, 10)
    borrow = a0 < b0
    top = a0 + 10 if borrow else a0
    d0 = top - b0
    if slip and not borrow:  # no borrow to forget: slip on the ones digit instead
        d0 = d0 + 1 if d0 < 9 else d0 - 1
    ones = f"{w['ones']}{top}-{b0}={d0}" + (w["borrow"] if borrow else "")
    used_borrow = borrow and not slip
    d1 = a1 - b1 - (1 if used_borrow else 0)
    tens = f"{w['tens']}{a1}-{b1}" + ("-1" if used_borrow else "") + f"={d1}"
    return [ones, tens], d1 * 10 + d0


def _solve_mul(ops: tuple[int, ...], w: dict[str, str], slip: bool,
               lang: str) -> tuple[list[str], int]:
    a, b = ops
    if a < 10:
        p = a * b + (1 if slip else 0)
        return [f"{a}×{b}={p}"], p
    a1, a0 = divmod(a, 10)
    p0 = a0 * b
    carry = p0 // 10
    ones = f"{w['ones']}{a0}×{b}={p0}"
    if carry:
        ones += w["sep"] + w["write"].format(d=p0 % 10) + w["carry"].format(c=carry)
    if slip and carry:
        tens = f"{w['tens']}{a1}×{b}={a1 * b}"  # forgot to add the carry
        return [ones, tens], a1 * b * 10 + p0 % 10
    p1 = a1 * b + carry + (1 if slip else 0)  # slip: tens product off by one
    tens = f"{w['tens']}{a1}×{b}" + (f"+{carry}" if carry else "") + f"={p1}"
    return [ones, tens], p1 * 10 + p0 % 10


def _rel(x: int, y: int, flip: bool) -> str:
    if x == y:
        return "="
    return ">" if (x > y) != flip else "<"


def _solve_cmp(ops: tuple[int, ...], w: dict[str, str], slip: bool,
               lang: str) -> tuple[list[str], int]:
    a, b, want = ops
    (a1, a0), (b1, b0) = divmod(a, 10), divmod(b, 10)
    lines = [f"{w['tens']}{a1}{_rel(a1, b1, slip)}{b1}"]
    if a1 == b1:
        lines.append(f"{w['ones']}{a0}{_rel(a0, b0, slip)}{b0}")
    lines.append(f"{a}{_rel(a, b, slip)}{b}")
    larger, smaller = (a, b) if (a > b) != slip else (b, a)
    return lines, smaller if want else larger


def _solve_count(ops: tuple[int, ...], w: dict[str, str], slip: bool,
                 lang: str) -> tuple[list[str], int]:
    target, items = ops[0], ops[1:]
    hits = [i for i, item in enumerate(items) if item == target]
    if slip:
        # Miss the last occurrence, or (when there is none) miscount the first item.
        hits = hits[:-1] if hits else [0]
    col = LANGS.index(lang)
    parts = []
    for i, item in enumerate(items):
        name = SYMBOLS[item][col]
        if i in hits:
            number = hits.index(i) + 1
            name += f" {number}" if lang == "en" else str(number)
        parts.append(name)
    return [w["list"].join(parts)], len(hits)


def format_full(trace: str, answer: str) -> str:
    return f"{THINK_OPEN}{trace}\n</think>\n<answer>\n{answer}\n</answer>"


def format_plain(answer: str) -> str:
    return f"{THINK_OPEN}\n</think>\n{answer}"


def full_reply(problem: Problem) -> str:
    """Correct reply in the reasoning format."""
    trace, answer = solve(problem)
    return format_full(trace, answer)


def plain_reply(problem: Problem) -> str:
    """Correct reply without reasoning or answer tags."""
    return format_plain(problem.answer)


def wrong_answer(problem: Problem, rng: random.Random) -> str:
    """A plausible wrong final answer (never the reference)."""
    ref = problem.answer
    if problem.task == "cmp":
        a, b, _ = problem.operands
        return str(a if str(b) == ref else b)
    value = int(ref)
    steps = (1, -1) if problem.task == "count" else (1, -1, 10, -10)
    candidates = [value + s for s in steps if value + s >= 0]
    return str(rng.choice(candidates))


def wrong_full_reply(problem: Problem, rng: random.Random) -> str:
    """Reasoning-format reply with a wrong answer: either a consistent slip in the working,
    or a correct working whose final answer is miscopied."""
    trace, answer = solve(problem, slip=True)
    if answer == problem.answer or rng.random() < 0.3:
        trace, _ = solve(problem)
        answer = wrong_answer(problem, rng)
    return format_full(trace, answer)


def wrong_plain_reply(problem: Problem, rng: random.Random) -> str:
    return format_plain(wrong_answer(problem, rng))


def broken_reply(problem: Problem, rng: random.Random) -> str:
    """A degenerate reply: cut off mid-way, looping on the working, or with an empty answer."""
    full = full_reply(problem)
    trace, _ = solve(problem)
    kind = rng.randrange(3)
    if kind == 0:
        cut = rng.randint(len(THINK_OPEN) + 1, full.index("</answer>"))
        return full[:cut]
    if kind == 1:
        first_line = trace.split("\n")[0]
        return THINK_OPEN + "\n".join([first_line] * rng.randint(3, 6))
    return format_full(trace, "")


# ---------------------------------------------------------------- checking replies

def format_ok(reply: str) -> bool:
    """True when a full assistant message (starting with "<think>\\n") is in the reasoning
    format. A policy's generated text lacks the "<think>\\n" the prompt opened: prepend it."""
    return FULL_REPLY_RE.match(reply) is not None


def extract_answer(reply: str) -> str | None:
    """The final answer of a reply: the <answer> block if there is one, else whatever follows
    the last </think> (plain style); None when neither exists."""
    match = _ANSWER_TAG_RE.search(reply)
    if match:
        return match.group(1).strip()
    if "</think>" in reply:
        return reply.rsplit("</think>", 1)[1].strip()
    return None


# ---------------------------------------------------------------- data set generation

def _rng(seed: int, stream: str) -> random.Random:
    # A str seed is hashed with SHA-512 by `random`, so this is stable across processes.
    return random.Random(f"minippo-demo:{seed}:{stream}")


def _sample(rng: random.Random, task: str, lang: str, want_eval: bool,
            exclude: set[str] | None = None) -> Problem:
    for _ in range(100_000):
        problem = make_problem(rng, task, lang)
        if is_eval_key(problem.key) == want_eval and (exclude is None or problem.prompt not in exclude):
            return problem
    raise RuntimeError(f"could not sample enough distinct {task}/{lang} problems; lower the count")


def _balanced(n: int, *axes: tuple[str, ...]) -> list[tuple[str, ...]]:
    """n combinations cycling through the product of the axes, first axis fastest, so every
    prefix of the list is balanced over the first axes (and, after a full cycle, over all)."""
    combos = []
    for i in range(n):
        combo = []
        for axis in axes:
            i, position = divmod(i, len(axis))
            combo.append(axis[position])
        combos.append(tuple(combo))
    return combos


def _rlaif_row(problem: Problem) -> dict:
    return {"conversations": [{"role": "user", "content": problem.prompt},
                              {"role": "assistant", "content": problem.answer}],
            "task": problem.task, "lang": problem.lang}


def sample_prompts(rng: random.Random, n: int, want_eval: bool) -> list[Problem]:
    """n distinct prompts (by text) from one side of the split, balanced over task x language."""
    seen: set[str] = set()
    problems = []
    for task, lang in _balanced(n, TASKS, LANGS):
        problem = _sample(rng, task, lang, want_eval, exclude=seen)
        seen.add(problem.prompt)
        problems.append(problem)
    rng.shuffle(problems)
    return problems


def make_sft(rng: random.Random, n: int) -> list[dict]:
    """SFT conversations from the train side; half full replies, half plain."""
    rows = []
    for task, lang, style in _balanced(n, TASKS, LANGS, STYLES):
        problem = _sample(rng, task, lang, want_eval=False)
        reply = full_reply(problem) if style == "full" else plain_reply(problem)
        rows.append({"conversations": [{"role": "user", "content": problem.prompt},
                                       {"role": "assistant", "content": reply}],
                     "style": style, "task": task, "lang": lang})
    rng.shuffle(rows)
    return rows


# Preference-pair kinds with their share out of 20.
PAIR_KINDS: tuple[tuple[str, int], ...] = (
    ("full_vs_wrong_full", 6),
    ("full_vs_plain", 4),
    ("plain_vs_wrong_plain", 4),
    ("full_vs_wrong_plain", 3),
    ("correct_vs_broken", 3),
)


def make_pair(problem: Problem, kind: str, rng: random.Random) -> tuple[str, str]:
    """(chosen, rejected) replies of one preference pair."""
    if kind == "full_vs_wrong_full":
        return full_reply(problem), wrong_full_reply(problem, rng)
    if kind == "full_vs_plain":
        return full_reply(problem), plain_reply(problem)
    if kind == "plain_vs_wrong_plain":
        return plain_reply(problem), wrong_plain_reply(problem, rng)
    if kind == "full_vs_wrong_plain":
        return full_reply(problem), wrong_plain_reply(problem, rng)
    if kind == "correct_vs_broken":
        chosen = full_reply(problem) if rng.random() < 0.5 else plain_reply(problem)
        return chosen, broken_reply(problem, rng)
    raise ValueError(f"unknown pair kind {kind!r}")


def make_pairs(rng: random.Random, n: int, want_eval: bool) -> list[dict]:
    # Spread each kind's slots evenly over the cycle so that short runs still mix all kinds.
    slots = sorted(((j + 0.5) / share, k) for k, share in PAIR_KINDS for j in range(share))
    kinds = tuple(k for _, k in slots)
    rows = []
    for task, lang, kind in _balanced(n, TASKS, LANGS, kinds):
        problem = _sample(rng, task, lang, want_eval)
        chosen, rejected = make_pair(problem, kind, rng)
        rows.append({"conversations": [{"role": "user", "content": problem.prompt}],
                     "chosen": chosen, "rejected": rejected, "kind": kind,
                     "task": task, "lang": lang})
    rng.shuffle(rows)
    return rows


# ---------------------------------------------------------------- the tool task (--tools dataset/demo_tools.py)
# Products the policy gets wrong on its own; a calculator call gets them right. Episodes of the SFT data:
#   turn 1  "<think>\n{why}\n</think>\n<tool_call>\n{call json}\n</tool_call>"   (then the tool's reply)
#   turn 2  "<think>\n{read}\n</think>\n<answer>\n{product}\n</answer>"
TOOL_TASK = "mul"
# The result stands on a line of its own, as in the tool reply: "\n132" is one token there and here, while " 132"
# would be two others, a mapping a 1.7M-parameter policy copies badly.
_TOOL_WORDS = {"en": ("Use the calculator for {a} × {b}.", "The calculator says:\n{p}"),
               "zh": ("用计算器算 {a} × {b}。", "计算器得出：\n{p}")}


def tool_call_turn(problem: Problem) -> str:
    """The first turn of a tool episode: a calculator call for the product."""
    a, b = problem.operands
    call = {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}
    why = _TOOL_WORDS[problem.lang][0].format(a=a, b=b)
    return f"{THINK_OPEN}{why}\n</think>\n<tool_call>\n{json.dumps(call)}\n</tool_call>"


def tool_answer_turn(problem: Problem) -> str:
    """The turn after the calculator's reply: its result as the answer."""
    return format_full(_TOOL_WORDS[problem.lang][1].format(p=problem.answer), problem.answer)


def make_tool_sft(rng: random.Random, n: int, tool_share: float = 0.2, wide_share: float = 0.5) -> list[dict]:
    """SFT conversations for the tool task, train side only. `tool_share` of the demo's products (b one digit) are a
    calculator episode (user, assistant call, tool reply, assistant answer), the rest answered directly (half full,
    half plain), so the policy starts out calling the tool on some prompts and PPO can find that it pays.
    `wide_share` of all rows are calculator episodes on products with a two-digit b: there are too many of them to
    memorise, so the answer turn learns to copy the tool's reply (on the demo's products alone it learned their
    results from the question instead, and a held-out product's tool reply went unread)."""
    rows = []
    for (lang,) in _balanced(n, LANGS):
        if rng.random() < wide_share:
            demo = make_problem(rng, TOOL_TASK, lang)
            problem, tool = Problem(TOOL_TASK, lang, (rng.randint(10, 99), rng.randint(10, 99)), demo.template), True
        else:
            problem, tool = _sample(rng, TOOL_TASK, lang, want_eval=False), rng.random() < tool_share
        user = {"role": "user", "content": problem.prompt}
        if tool:
            conv = [user, {"role": "assistant", "content": tool_call_turn(problem)},
                    {"role": "tool", "name": "calculator", "content": problem.answer},
                    {"role": "assistant", "content": tool_answer_turn(problem)}]
            style = "tool"
        else:
            style = "full" if rng.random() < 0.5 else "plain"
            conv = [user, {"role": "assistant", "content": full_reply(problem) if style == "full" else plain_reply(problem)}]
        rows.append({"conversations": conv, "style": style, "task": TOOL_TASK, "lang": lang})
    return rows


def sample_task_prompts(rng: random.Random, task: str, n: int, want_eval: bool) -> list[Problem]:
    """n distinct prompts (by text) of one task from one side of the split, balanced over language."""
    seen: set[str] = set()
    problems = []
    for (lang,) in _balanced(n, LANGS):
        problem = _sample(rng, task, lang, want_eval, exclude=seen)
        seen.add(problem.prompt)
        problems.append(problem)
    return problems


def generate_all(seed: int = 0, n_train: int = 10_000, n_eval: int = 500,
                 n_sft: int = 40_000, n_pairs: int = 60_000,
                 n_pairs_eval: int = 1_000, n_tool_train: int = 2_000, n_tool_eval: int = 200,
                 n_tool_sft: int = 8_000) -> dict[str, list[dict]]:
    """All demo files as rows, keyed by file stem (demo_train, demo_eval, demo_sft, demo_pairs, demo_pairs_eval,
    and the tool task's demo_tools_train, demo_tools_eval, demo_tools_sft). Same arguments -> identical rows."""
    train = sample_prompts(_rng(seed, "train"), n_train, want_eval=False)
    evals = sample_prompts(_rng(seed, "eval"), n_eval, want_eval=True)
    return {
        "demo_train": [_rlaif_row(p) for p in train],
        "demo_eval": [_rlaif_row(p) for p in evals],
        "demo_sft": make_sft(_rng(seed, "sft"), n_sft),
        "demo_pairs": make_pairs(_rng(seed, "pairs"), n_pairs, want_eval=False),
        "demo_pairs_eval": make_pairs(_rng(seed, "pairs_eval"), n_pairs_eval, want_eval=True),
        "demo_tools_train": [_rlaif_row(p) for p in sample_task_prompts(_rng(seed, "tools_train"), TOOL_TASK, n_tool_train, False)],
        "demo_tools_eval": [_rlaif_row(p) for p in sample_task_prompts(_rng(seed, "tools_eval"), TOOL_TASK, n_tool_eval, True)],
        "demo_tools_sft": make_tool_sft(_rng(seed, "tools_sft"), n_tool_sft),
    }
