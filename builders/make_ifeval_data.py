"""Write verifiable instruction-following prompts (IFEval's constraint types, dataset/ifeval.py) as RLAIF jsonl:
a short writing request on a topic plus one or two constraints, each row carrying its constraints for the reward.

    python builders/make_ifeval_data.py       # dataset/ifeval_train.jsonl (2000 rows), dataset/ifeval_eval.jsonl (300 rows)

Train and held-out rows draw their topics from disjoint lists, so a held-out gain is not a memorised topic.
Two constraints in one row never contradict each other (e.g. quotation marks around the whole reply and a
phrase it must end with). The same seed writes the same files.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dataset.ifeval import describe, validate

TRAIN_TOPICS = [
    "the sea", "autumn leaves", "a city at night", "coffee", "learning to swim", "mountains", "a rainy day", "bicycles",
    "the moon", "gardening", "trains", "friendship", "a library", "winter mornings", "cats", "baking bread", "the desert",
    "music", "a lighthouse", "rivers", "kites", "a market", "the stars", "tea", "old photographs", "bridges", "snow",
    "a forest walk", "birds", "the first day of school", "cooking soup", "a summer festival", "clocks", "islands",
    "painting", "a thunderstorm", "honey bees", "a quiet morning", "board games", "the wind", "candles", "chess",
    "a small village", "fishing", "sunflowers", "maps", "a long journey", "apples", "the ocean floor", "rain boots",
]
EVAL_TOPICS = [
    "volcanoes", "a train station", "penguins", "a bakery", "the night sky", "waterfalls", "a school garden",
    "chocolate", "hot air balloons", "a museum", "owls", "the harbour", "pancakes", "a bookshop", "fireflies",
    "a snowy mountain", "dolphins", "a picnic", "street lamps", "the spring rain",
]
REQUESTS = [
    "Write a short note about {t}.", "Describe {t} in a few sentences.", "Tell me about {t}.",
    "Write a short paragraph about {t}.", "Write a few lines about {t} for a friend.", "Explain why people like {t}.",
]
END_PHRASES = ["Any other questions?", "Is there anything else I can help with?", "That is all."]
START_PHRASES = ["My answer is", "Here is my note", "I think"]
FORBIDDEN = [["very", "really"], ["good", "nice"], ["beautiful", "lovely"], ["many", "some"]]
# Pairs that cannot both hold (the quotation mark must be the reply's first and last character).
CONFLICTS = {frozenset(p) for p in (("quotation", "end_phrase"), ("quotation", "start_phrase"), ("quotation", "number_bullets"),
                                     ("quotation", "title"), ("quotation", "postscript"))}


def sample_constraint(kind: str, topic: str, rng: random.Random) -> dict:
    if kind == "number_words":
        relation = rng.choice(["less than", "at least"])
        return {"type": kind, "relation": relation, "num": rng.choice([20, 30, 40, 50] if relation == "less than" else [10, 20, 30])}
    if kind in ("end_phrase", "start_phrase"):
        return {"type": kind, "phrase": rng.choice(END_PHRASES if kind == "end_phrase" else START_PHRASES)}
    if kind == "number_bullets":
        return {"type": kind, "num": rng.choice([2, 3, 4])}
    if kind == "keyword_frequency":
        return {"type": kind, "keyword": topic.split()[-1], "relation": "at least", "num": rng.choice([2, 3])}
    if kind == "postscript":
        return {"type": kind, "marker": "P.S."}
    if kind == "forbidden_words":
        return {"type": kind, "words": rng.choice(FORBIDDEN)}
    if kind == "highlighted_sections":
        return {"type": kind, "num": rng.choice([1, 2])}
    return {"type": kind}


KINDS = ["lowercase", "number_words", "no_comma", "end_phrase", "start_phrase", "quotation", "number_bullets",
         "keyword_frequency", "title", "postscript", "forbidden_words", "highlighted_sections"]


def make_rows(topics: list[str], n: int, rng: random.Random, two_share: float = 0.4) -> list[dict]:
    rows = []
    for i in range(n):
        topic = rng.choice(topics)
        kinds = [KINDS[i % len(KINDS)]]  # every type equally often
        if rng.random() < two_share:
            kinds.append(rng.choice([k for k in KINDS if k not in kinds and frozenset((kinds[0], k)) not in CONFLICTS]))
        constraints = [sample_constraint(k, topic, rng) for k in kinds]
        prompt = " ".join([rng.choice(REQUESTS).format(t=topic), *map(describe, constraints)])
        rows.append({"conversations": [{"role": "user", "content": prompt}, {"role": "assistant", "content": ""}],
                     "constraints": validate(constraints, f"row {i}")})
    rng.shuffle(rows)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out_dir", default=str(ROOT / "dataset"), help="where ifeval_train.jsonl and ifeval_eval.jsonl go")
    p.add_argument("--n_train", type=int, default=2000)
    p.add_argument("--n_eval", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    rng = random.Random(a.seed)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, topics, n in (("ifeval_train.jsonl", TRAIN_TOPICS, a.n_train), ("ifeval_eval.jsonl", EVAL_TOPICS, a.n_eval)):
        rows = make_rows(topics, n, rng)
        (out / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        print(f"wrote {n} rows to {out / name}")


if __name__ == "__main__":
    main()
