"""reasoning-gym's procedural tasks as prompt rows, scored by each task's own verifier (--reasoning_gym).

reasoning-gym (PyPI `reasoning-gym`, Open-Thought) generates reasoning problems from a seed, with no download: a
task is a registered `ProceduralDataset` whose entries are {"question", "answer", "metadata"} and whose
`score_answer(answer, entry)` is the task's verifier (1.0 right, 0.0 wrong, partial credit where the task gives
some). The package is optional: nothing here imports it until a task is asked for.

A spec names tasks, comma-separated, each with settings of its config after colons:

    chain_sum
    chain_sum:max_terms=3:max_digits=2,leg_counting:max_animals=3

Rows (PromptRecords, rendered by dataset/rlaif.py as any prompt file's) are a one-shot chat: reasoning-gym's "direct"
system prompt (the answer between <answer> and </answer>, no reasoning), one solved example of the task (a question
and its answer in the tags), then the row's question; under `rg` they carry what the verifier reads: {"task",
"config", "entry"}. The training rows come from a seed derived from --seed; the held-out rows from one fixed seed (the
same for every --seed and for scripts/eval_policy.py); no training row asks a held-out question, and neither asks
the example's.

Why one-shot: SmolLM2-135M-Instruct never writes the tags when only told to (0 of 24 with the system prompt alone or
an instruction in the question, docs/reasoning_gym.md), so every reward would be 0 and GRPO would have nothing to
compare; after one solved example two thirds of its replies use them.

Templates: training always asks in TRAIN_TEMPLATE (the one-shot chat above). HELD_OUT_TEMPLATES ask the same rows in
wordings and layouts the training never uses (another system prompt or none, the solved example inside the user turn,
the question reworded), rotated over the rows (scripts/eval_policy.py --rg_template heldout): an unseen-template
column, scored by the same verifier on the same entries.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import json
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where rows are built: the verifier's worker (trainer/verifier_worker.py) scores without torch
    from dataset.rlaif import PromptRecord

PACKAGE = "reasoning-gym==0.1.25"  # the version this module was written and measured against (docs/reasoning_gym.md)
HELD_OUT_ROWS = 500
HELD_OUT = "reasoning_gym:held_out"  # --eval_data_path auto resolved under --reasoning_gym: these rows, not a file
HELD_OUT_SEED = 1 << 40
EXAMPLE_SEED = HELD_OUT_SEED + (1 << 20)  # the one solved example each prompt shows (its question is kept out of the rows)
# reasoning-gym draws row i from Random(seed + i): consecutive seeds would share all rows but one, so each --seed
# starts 2^20 rows further on.
SEED_STRIDE = 1 << 20
# reasoning-gym's "direct" prompt, not its "default" one: that asks for step-by-step reasoning first, which a 135M model
# does not finish within 64 new tokens.
SYSTEM_PROMPT_NAME = "direct"


class ReasoningGymError(ValueError):
    """A bad --reasoning_gym spec or a missing package: the message is one line, without "error: "."""


@dataclass(frozen=True)
class Template:
    """How a row is asked. Fields are format strings: {question} is reasoning-gym's question, {expression} the entry's
    metadata["expression"] (the arithmetic tasks: "4 + 3"); a task without one is asked through `plain` instead of
    `question`."""

    name: str
    # The system turn ("{direct}": reasoning-gym's "direct" prompt); None: none (the chat template may then add its
    # default: SmolLM2's does).
    system: str | None
    question: str = "{question}"  # the row's (and the example's) question where the entry has an expression
    plain: str = "{question}"  # ... where it has none
    # The solved example as its own user and assistant turns (""), or the single user turn: {example} the example's
    # question, {answer} its answer, {question} the row's question (both worded as above).
    shot: str = ""


# The training template: reasoning-gym's "direct" system prompt, the example as its own turns, the question as
# reasoning-gym words it. The held-out ones differ from it in the system prompt and the question's wording, and half of
# them in the layout (the example inside the user turn).
TRAIN = "train"
TRAIN_TEMPLATE = Template(TRAIN, system="{direct}")
HELD_OUT_SET = "heldout"  # --rg_template: every held-out template, in turn
HELD_OUT_TEMPLATES = (
    Template("what_is", system="Reply with the final answer only, written inside <answer></answer> tags.",
             question="What is {expression}?", plain="{question}",
             shot="Example: {example}\nAnswer: <answer>{answer}</answer>\n\nNow you: {question}"),
    Template("compute", system="Put your final answer between <answer> and </answer>. No working, no other text.",
             question="Compute: {expression}", plain="Task: {question}"),
    Template("no_system", system=None, question="Evaluate {expression}.", plain="{question}",
             shot="Answer inside <answer></answer> tags, like this:\nQ: {example}\nA: <answer>{answer}</answer>\n\n"
                  "Q: {question}\nA:"),
    Template("polite", system="You are a helpful math assistant. Always give just the final answer, wrapped as "
                              "<answer>...</answer>.",
             question="Could you please work out {expression} for me?", plain="Please help with this one. {question}"),
)


def template_names() -> list[str]:
    """What --rg_template takes: train, heldout (every held-out template, in turn over the rows), or one of them."""
    return [TRAIN, HELD_OUT_SET, *(t.name for t in HELD_OUT_TEMPLATES)]


def templates(name: str) -> list[Template]:
    """The templates a --rg_template name stands for (rotated over the rows: row i asks in template i mod k)."""
    if name == TRAIN:
        return [TRAIN_TEMPLATE]
    if name == HELD_OUT_SET:
        return list(HELD_OUT_TEMPLATES)
    found = [t for t in HELD_OUT_TEMPLATES if t.name == name]
    if not found:
        raise ReasoningGymError(f"--rg_template {name}: no such template; one of {', '.join(template_names())}")
    return found


def _ask(template: Template, entry: dict[str, Any]) -> str:
    expression = (entry.get("metadata") or {}).get("expression")
    if isinstance(expression, str):
        return template.question.format(question=entry["question"], expression=expression)
    return template.plain.format(question=entry["question"])


def messages(template: Template, shown: dict[str, Any], entry: dict[str, Any], direct: str) -> list[dict]:
    """The chat of one row: `entry` asked in `template`, after the solved example `shown`; `direct` is reasoning-gym's
    "direct" system prompt."""
    head = [] if template.system is None else [{"role": "system", "content": template.system.format(direct=direct)}]
    if template.shot:
        user = template.shot.format(example=_ask(template, shown), answer=shown["answer"], question=_ask(template, entry))
        return [*head, {"role": "user", "content": user}]
    return [*head, {"role": "user", "content": _ask(template, shown)},
            {"role": "assistant", "content": f"<answer>{shown['answer']}</answer>"},
            {"role": "user", "content": _ask(template, entry)}]


@dataclass(frozen=True)
class TaskSpec:
    name: str
    config: tuple[tuple[str, Any], ...] = ()  # the task's config settings given in the spec

    @property
    def settings(self) -> dict[str, Any]:
        return dict(self.config)


def import_reasoning_gym() -> ModuleType:
    try:
        import reasoning_gym
    except ImportError:
        raise ReasoningGymError(f"--reasoning_gym needs the reasoning-gym package: pip install {PACKAGE}") from None
    return reasoning_gym


def available() -> bool:
    """Whether reasoning-gym can be imported."""
    try:
        import_reasoning_gym()
    except ReasoningGymError:
        return False
    return True


def version() -> str | None:
    """The installed reasoning-gym's version (its __version__ lags its releases), None where it is missing."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("reasoning-gym")
    except PackageNotFoundError:
        return None


def task_names() -> list[str]:
    return sorted(import_reasoning_gym().factory.DATASETS)


def _split_top_level(text: str, sep: str) -> list[str]:
    """`text` split at `sep` outside brackets and quotes (a list value holds commas: operators=['+','-'])."""
    parts, cur, depth, quote = [], "", 0, ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        cur += ch
    return [*parts, cur]


def _value(text: str) -> Any:
    """A setting's value: a Python literal (3, False, ['+', '-']), else the text itself (format_style=natural)."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return tuple(value) if isinstance(value, list) else value  # hashable: a spec is part of a frozen value


def parse_spec(spec: str) -> list[TaskSpec]:
    """The tasks of a --reasoning_gym spec, each checked against reasoning-gym's registry and its config (built once
    with the settings, so the task's own validation runs here). ReasoningGymError (one line) otherwise."""
    rg = import_reasoning_gym()
    names = sorted(rg.factory.DATASETS)
    tasks = []
    for part in (p.strip() for p in _split_top_level(spec, ",")):
        name, *settings = (s.strip() for s in _split_top_level(part, ":"))
        if name not in rg.factory.DATASETS:
            close = difflib.get_close_matches(name, names, n=5, cutoff=0.6)
            hint = f"close: {', '.join(close)}" if close else f"the {len(names)} tasks: {', '.join(names)}"
            raise ReasoningGymError(f"--reasoning_gym {name or repr(spec)}: no such task; {hint}")
        config_cls = rg.factory.DATASETS[name][1]
        known = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]
        config = []
        for s in settings:
            key, eq, raw = s.partition("=")
            key = key.strip()
            if not eq or key not in known:
                raise ReasoningGymError(f"--reasoning_gym {part}: {name} has no setting {key!r} (expected key=value with "
                                        f"a key of {', '.join(known)})")
            config.append((key, _value(raw.strip())))
        task = TaskSpec(name, tuple(config))
        try:
            rg.create_dataset(name, seed=0, size=1, **task.settings)[0]
        except Exception as e:  # noqa: BLE001 - the task's own checks are asserts and TypeErrors: one line naming them
            why = " ".join(str(e).split()) or "invalid settings"
            raise ReasoningGymError(f"--reasoning_gym {part}: {type(e).__name__}: {why}") from None
        tasks.append(task)
    return tasks


def generate(spec: str, n: int, seed: int, exclude: frozenset[str] = frozenset(),
             template: str = TRAIN) -> list[PromptRecord]:
    """`n` rows of the spec's tasks, taken in turn (row i of k tasks: task i mod k), from `seed`; a row whose question
    is in `exclude` is dropped (so fewer rows may come back). A task's j-th row is asked in the j-th of the `template`
    name's templates, in turn; its rg payload names it ("template")."""
    from dataset.rlaif import PromptRecord  # here: it imports torch; see the import at the top

    asked = templates(template)
    rg = import_reasoning_gym()
    tasks = parse_spec(spec)
    per_task = -(-n // len(tasks))
    generators = [rg.create_dataset(t.name, seed=seed, size=per_task, **t.settings) for t in tasks]
    examples = [example(t) for t in tasks]
    exclude = exclude | {e["question"] for e in examples}
    system = rg.utils.SYSTEM_PROMPTS[SYSTEM_PROMPT_NAME].strip()
    records = []
    for i in range(n):
        task, ds, shown = tasks[i % len(tasks)], generators[i % len(tasks)], examples[i % len(tasks)]
        entry = ds[i // len(tasks)]
        if entry["question"] in exclude:
            continue
        how = asked[(i // len(tasks)) % len(asked)]  # each task's rows in turn, so each task meets every template
        records.append(PromptRecord(
            messages=messages(how, shown, entry, system),
            reference=None,  # the task's verifier scores the reply (accuracy reward), not answers_match
            where=f"reasoning_gym {task.name} seed {seed} row {i // len(tasks)}",
            rg={"task": task.name, "config": task.settings, "entry": entry, "template": how.name},
        ))
    return records


def example(task: TaskSpec) -> dict[str, Any]:
    """The solved example a task's prompts show: row 0 of the example seed, with the task's settings."""
    return import_reasoning_gym().create_dataset(task.name, seed=EXAMPLE_SEED, size=1, **task.settings)[0]


def held_out(spec: str, n: int = HELD_OUT_ROWS, template: str = TRAIN) -> list[PromptRecord]:
    """The held-out rows: the first `n` of the fixed held-out seed (at most HELD_OUT_ROWS are kept out of training),
    asked in the `template` name's templates (the same entries whatever the template)."""
    return generate(spec, min(n, HELD_OUT_ROWS), HELD_OUT_SEED, template=template)


def training(spec: str, n: int, seed: int) -> list[PromptRecord]:
    """The training rows for --seed `seed`: none asks a question of the held-out rows."""
    exclude = frozenset(r.rg["entry"]["question"] for r in held_out(spec) if r.rg)
    return generate(spec, n, seed * SEED_STRIDE, exclude)


@functools.cache
def _scorer(task: str, config_json: str) -> Any:
    """The task's dataset built with the row's config (a verifier may read its config: puzzle24's bounds)."""
    return import_reasoning_gym().create_dataset(task, seed=0, size=1, **json.loads(config_json))


def tagged(reply: str) -> bool:
    """Whether the reply gives an answer the verifier reads (reasoning-gym's extract_answer finds <answer> tags)."""
    return import_reasoning_gym().utils.extract_answer(reply) is not None


def score(reply: str, row: dict) -> float:
    """The task's own score_answer of the reply's answer: the last <answer>...</answer> content, as reasoning-gym's
    extract_answer takes it (None without the tags: 0). Unbounded, in this process: some verifiers eval the answer
    (sympy's parse_expr), so the trainer calls this only inside its bounded worker (trainer/verifier.py)."""
    rg = import_reasoning_gym()
    answer = rg.utils.extract_answer(reply)
    ds = _scorer(row["task"], json.dumps(row["config"], sort_keys=True))
    try:
        return float(ds.score_answer(answer, row["entry"]))
    except Exception:  # noqa: BLE001 - an answer the task's parser chokes on is a wrong answer, not a failed run
        return 0.0
