"""Write arithmetic word problems for tool use (configs/smollm2_tools.yaml) as RLAIF jsonl: a product of a two- or
three-digit number and a two-digit one, too large for a 135M model to work out in its head, so calling the
calculator (dataset/demo_tools.py) pays.

    python builders/make_tools_data.py    # dataset/smollm2_tools_{train,eval,eval_unseen}.jsonl

- `smollm2_tools_train.jsonl`: 600 rows in the 8 training phrasings (TRAIN_TEMPLATES);
- `smollm2_tools_eval.jsonl`: 200 held-out rows in the same phrasings, with operand pairs no training row has;
- `smollm2_tools_eval_unseen.jsonl`: 200 held-out rows in 8 other phrasings (UNSEEN_TEMPLATES: other stories, other
  sentence shapes, bare "multiply" questions), operand pairs likewise new.

Every row opens with the same worked example (the first --shots of SHOTS, phrased unlike both sets): a question,
the assistant's call in the SmolLM2 family's form (`<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>`), the
tool's reply (a "tool" message) and "The answer is ...". Told in words alone (the system prompt), SmolLM2-135M-Instruct
never calls; how many examples, and how their answer is worded, moves its start a lot (docs/smollm2_tools.md). A row's
"gt" is the product (the accuracy reward: the final answer contains it, by value); "task" names its phrasing. The
same seed writes the same files.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# {a}: 12-999, {b}: 12-99.
TRAIN_TEMPLATES = [
    "A bakery packs {a} cookies into each of {b} boxes. How many cookies are there in all?",
    "Each of {b} buses carries {a} students. How many students ride the buses?",
    "A farmer plants {b} rows of corn with {a} plants in each row. How many plants does he plant?",
    "A library has {b} shelves holding {a} books each. How many books are on the shelves?",
    "Tickets cost {a} dollars each and {b} people bought one. How many dollars were collected?",
    "A printer prints {a} pages a minute. How many pages does it print in {b} minutes?",
    "There are {b} crates of apples with {a} apples in each crate. How many apples are there altogether?",
    "A runner trains {a} minutes a day for {b} days. How many minutes does she train in total?",
]
UNSEEN_TEMPLATES = [
    "What do you get when you multiply {a} by {b}?",
    "Find the area, in square meters, of a field {a} meters long and {b} meters wide.",
    "A stadium is split into {b} sections, and every section seats {a} fans. Work out how many fans the stadium holds.",
    "Compute the product of {a} and {b}.",
    "If a single box of nails weighs {a} grams, what is the weight in grams of {b} such boxes?",
    "Sam saves {a} cents every week. After {b} weeks, how many cents has he saved?",
    "{b} friends each paid {a} dollars for a trip. What was the total paid, in dollars?",
    "How many flowers does a bee visit in {b} hours if it visits {a} flowers every hour?",
]
# The worked examples every prompt shows: (question, a, b, answer sentence with {p} for the product).
SHOTS = [
    ("A shop sells 24 boxes of pens with 156 pens in each box. How many pens does it sell?", 24, 156,
     "The answer is {p} pens."),
    ("A train has 38 cars and each car seats 112 people. How many people can the train seat?", 38, 112,
     "The answer is {p} people."),
    ("A hotel has 17 floors with 136 rooms on each floor. How many rooms does the hotel have?", 17, 136,
     "The answer is {p} rooms."),
]
TOOL = "calculator"


def call_text(a: int, b: int) -> str:
    """The assistant's turn that calls the calculator, in the SmolLM2 family's form."""
    return "<tool_call>" + json.dumps([{"name": TOOL, "arguments": {"expression": f"{a} * {b}"}}]) + "</tool_call>"


def shot_messages(n: int) -> list[dict]:
    msgs = []
    for q, a, b, answer in SHOTS[:n]:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": call_text(a, b)},
                 {"role": "tool", "content": str(a * b)}, {"role": "assistant", "content": answer.format(p=a * b)}]
    return msgs


def operands(rng: random.Random) -> tuple[int, int]:
    return rng.randint(12, 999), rng.randint(12, 99)


def rows(templates: list[str], prefix: str, n: int, rng: random.Random, taken: set[tuple[int, int]],
         shots: int) -> list[dict]:
    """`n` rows, the templates in turn, each with an operand pair not in `taken` (which it adds to)."""
    out = []
    for i in range(n):
        while (ab := operands(rng)) in taken:
            pass
        taken.add(ab)
        a, b = ab
        k = i % len(templates)
        question = templates[k].format(a=a, b=b)
        out.append({"conversations": [*shot_messages(shots), {"role": "user", "content": question},
                                      {"role": "assistant", "content": ""}],
                    "gt": [str(a * b)], "task": f"{prefix}{k}"})
    return out


def build(seed: int = 0, n_train: int = 600, n_eval: int = 200, shots: int = 1) -> dict[str, list[dict]]:
    """The three files' rows: held-out operand pairs are drawn first and kept out of training, and neither set
    asks a worked example's question."""
    rng = random.Random(seed)
    taken = {(a, b) for _, a, b, _ in SHOTS} | {(b, a) for _, a, b, _ in SHOTS}
    held = rows(TRAIN_TEMPLATES, "train_phrasing_", n_eval, rng, taken, shots)
    unseen = rows(UNSEEN_TEMPLATES, "unseen_phrasing_", n_eval, rng, taken, shots)
    train = rows(TRAIN_TEMPLATES, "train_phrasing_", n_train, rng, taken, shots)
    return {"smollm2_tools_train.jsonl": train, "smollm2_tools_eval.jsonl": held,
            "smollm2_tools_eval_unseen.jsonl": unseen}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out_dir", default=str(ROOT / "dataset"))
    p.add_argument("--n_train", type=int, default=600)
    p.add_argument("--n_eval", type=int, default=200, help="rows in each held-out file")
    p.add_argument("--shots", type=int, default=1, choices=range(len(SHOTS) + 1),
                   help="worked examples at the start of every prompt")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, rs in build(args.seed, args.n_train, args.n_eval, args.shots).items():
        (out / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rs), encoding="utf-8")
        print(f"wrote {out / name} ({len(rs)} rows)")


if __name__ == "__main__":
    main()
