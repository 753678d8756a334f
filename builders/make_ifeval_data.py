"""Write verifiable instruction-following prompts (IFEval's constraint types, dataset/ifeval.py) as RLAIF jsonl:
a short writing request on a topic plus one or two constraints, each row carrying its constraints for the reward
and, for Google's checker, the same as IFEval's instruction ids and kwargs.

    python builders/make_ifeval_data.py       # the four files below, in dataset/

- ifeval_train.jsonl (2,000 rows) and ifeval_eval.jsonl (300 held-out rows): every type we train, equally often,
  each constraint worded either as IFEval words it (its build_description for the row's arguments) or in one of
  our own phrasings (about half each).
- ifeval_eval_ifeval_wording.jsonl (220 held-out rows): IFEval's 22 instructions that we train, in IFEval's
  wording only (start_phrase, which has none, is not in it).
- ifeval_eval_other_types.jsonl (60 held-out rows): the three IFEval instructions we do not train (nor can check:
  dataset/ifeval.py LEFT_OUT), one per row, in IFEval's wording, without "constraints": for scripts/judge_ifeval.py.

Each row: "conversations" (the user turn and an empty assistant slot), "constraints" (ours), "prompt" (the user
turn), "instruction_id_list" and "kwargs" (Google's, IFEval's input_data format) and "wording" ("ifeval" or "ours"
per constraint). Train and held-out rows draw their topics from disjoint lists, so a held-out gain is not a
memorised topic. Two constraints in one row never contradict each other (e.g. quotation marks around the whole
reply and a phrase it must end with). The same seed writes the same files; nothing here imports if-verifiable
(tests/test_ifeval_reference.py checks IFEval's wording against its build_description).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dataset.ifeval import CHECKS, LEFT_OUT, RESPONSE_OPTIONS, describe, ifeval_instructions, validate

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
# constrained_response asks for "My answer is yes / no / maybe.": its rows ask a yes-or-no question instead.
QUESTIONS = ["Is {t} worth writing about?", "Would you recommend {t} to a friend?", "Do most people enjoy {t}?"]
END_PHRASES = ["Any other questions?", "Is there anything else I can help with?", "That is all."]
START_PHRASES = ["My answer is", "Here is my note", "I think"]
FORBIDDEN = [["very", "really"], ["good", "nice"], ["beautiful", "lovely"], ["many", "some"]]
KEYWORDS = ["light", "morning", "water", "colour", "quiet", "story", "friend", "memory", "simple", "warm"]
FIRST_WORDS = ["the", "today", "first", "also", "finally", "every", "when", "in"]
COMMON_LETTERS, RARE_LETTERS = "eaot", "zxj"  # "at least" asks for common letters, "less than" for rare ones
LANGUAGES = {"es": "Spanish", "fr": "French", "de": "German", "it": "Italian", "pt": "Portuguese"}  # IFEval's names

KINDS = list(CHECKS)  # every type, equally often
# Pairs that cannot both hold: the quotation mark must be the reply's first and last character; "Section" has a
# capital and a lower-case letter; IFEval's own conflicts (its INSTRUCTION_CONFLICTS) for the rest.
CONFLICTS = {frozenset(p) for p in (
    ("quotation", "end_phrase"), ("quotation", "start_phrase"), ("quotation", "number_bullets"), ("quotation", "title"),
    ("quotation", "postscript"), ("lowercase", "uppercase"), ("lowercase", "sections"), ("uppercase", "sections"),
    ("number_paragraphs", "paragraph_first_word"), ("sections", "highlighted_sections"),
    ("start_phrase", "paragraph_first_word"))}
# Types that shape the whole reply pair only with these (IFEval's conflicts: json with all but keywords, ...).
ONLY_WITH = {"json": {"forbidden_words", "include_keywords"}, "constrained_response": set(),
             "two_responses": {"forbidden_words", "include_keywords", "title", "no_comma"},
             "repeat_prompt": {"include_keywords", "title", "no_comma"}}


def compatible(a: str, b: str) -> bool:
    if a == b or frozenset((a, b)) in CONFLICTS:
        return False
    return all(y in ONLY_WITH[x] for x, y in ((a, b), (b, a)) if x in ONLY_WITH)


def _clash(a: dict, b: dict) -> bool:
    """Parameters that contradict: a rare letter that a required word contains."""
    for x, y in ((a, b), (b, a)):
        if x["type"] == "letter_frequency" and x["relation"] == "less than":
            words = [y.get("keyword", ""), y.get("word", ""), *y.get("words", [])] if y["type"] != "forbidden_words" else []
            if any(x["letter"] in w.lower() for w in words):
                return True
    return False


def sample_constraint(kind: str, topic: str, rng: random.Random) -> dict:
    """One constraint of `kind` for a prompt on `topic` (repeat_prompt's request is the row's text, set by make_rows)."""
    if kind == "number_words":
        relation = rng.choice(["less than", "at least"])
        return {"type": kind, "relation": relation, "num": rng.choice([20, 30, 40, 50] if relation == "less than" else [10, 20, 30])}
    if kind in ("end_phrase", "start_phrase"):
        return {"type": kind, "phrase": rng.choice(END_PHRASES if kind == "end_phrase" else START_PHRASES)}
    if kind in ("number_bullets", "number_paragraphs", "sections", "placeholders", "highlighted_sections"):
        c: dict = {"type": kind, "num": rng.choice({"number_bullets": [2, 3, 4], "number_paragraphs": [2, 3],
                                                    "sections": [2, 3], "placeholders": [1, 2, 3],
                                                    "highlighted_sections": [1, 2, 3]}[kind])}
        if kind == "sections":
            c = {"type": kind, "splitter": rng.choice(["Section", "SECTION"]), "num": c["num"]}
        return c
    if kind == "paragraph_first_word":
        num = rng.choice([2, 3])
        return {"type": kind, "num": num, "nth": rng.randint(1, num), "word": rng.choice(FIRST_WORDS)}
    if kind == "keyword_frequency":
        return {"type": kind, "keyword": topic.split()[-1], "relation": "at least", "num": rng.choice([2, 3])}
    if kind == "include_keywords":
        return {"type": kind, "words": rng.sample(KEYWORDS, rng.choice([1, 2]))}
    if kind == "letter_frequency":
        if rng.random() < 0.5:
            return {"type": kind, "letter": rng.choice(COMMON_LETTERS), "relation": "at least", "num": rng.randint(5, 10)}
        return {"type": kind, "letter": rng.choice(RARE_LETTERS), "relation": "less than", "num": rng.randint(1, 3)}
    if kind == "postscript":
        return {"type": kind, "marker": rng.choice(["P.S.", "P.P.S"])}
    if kind == "forbidden_words":
        return {"type": kind, "words": rng.choice(FORBIDDEN)}
    if kind == "repeat_prompt":
        return {"type": kind, "request": f"Write a short note about {topic}."}
    return {"type": kind}


def _rel(c: dict) -> str:
    return "fewer than" if c["relation"] == "less than" else "at least"


def _and(words: list[str]) -> str:
    return ", ".join(words[:-1]) + " and " + words[-1] if len(words) > 1 else words[0]


_ORDINAL = {1: "first", 2: "second", 3: "third", 4: "fourth", 5: "fifth"}
# Our own sentences for each type, beside IFEval's (dataset/ifeval.py describe).
PHRASINGS: dict[str, list[Callable[[dict], str]]] = {
    "lowercase": [lambda c: "Write your whole answer in lowercase letters only, with no capital letters.",
                  lambda c: "Use only lowercase letters in your reply: no capitals anywhere.",
                  lambda c: "Do not use any capital letters; everything must be lowercase."],
    "uppercase": [lambda c: "Write your entire answer in capital letters.",
                  lambda c: "Your whole reply must be in uppercase letters, with no lowercase letters at all.",
                  lambda c: "Use only capital letters, from the first word to the last."],
    "number_words": [lambda c: f"Use {_rel(c)} {c['num']} words.",
                     lambda c: f"Your reply should be {'under' if c['relation'] == 'less than' else 'at least'} {c['num']} words long.",
                     lambda c: f"Keep your answer to {_rel(c)} {c['num']} words."],
    "number_paragraphs": [lambda c: f"Write exactly {c['num']} paragraphs and separate them with a line containing only ***.",
                          lambda c: f"Your answer must have {c['num']} paragraphs, with the markdown divider *** between them."],
    "paragraph_first_word": [
        lambda c: (f"Write exactly {c['num']} paragraphs separated by blank lines, and begin paragraph {c['nth']} "
                   f"with the word \"{c['word']}\"."),
        lambda c: (f"Split your answer into {c['num']} paragraphs with one empty line between them; the "
                   f"{_ORDINAL[c['nth']]} paragraph must start with the word {c['word']}.")],
    "no_comma": [lambda c: "Do not use any commas.", lambda c: "Write your answer without a single comma.",
                 lambda c: "Avoid commas entirely in your reply."],
    "end_phrase": [lambda c: f"Finish your response with this exact phrase: {c['phrase']} No other words should follow this phrase.",
                   lambda c: f"End your reply with the exact words \"{c['phrase']}\" and nothing after them.",
                   lambda c: f"The last words of your answer must be: {c['phrase']}"],
    "start_phrase": [lambda c: f"Begin your reply with the words \"{c['phrase']}\".",
                     lambda c: f"Your answer must open with: {c['phrase']}"],
    "repeat_prompt": [lambda c: "Before answering, repeat the request above word for word (without this sentence), then give your answer.",
                      lambda c: "Start by copying the request exactly as written, leaving out this instruction, and then answer it."],
    "quotation": [lambda c: "Put your whole answer inside double quotation marks.",
                  lambda c: "Enclose the entire reply in double quotes (\")."],
    "number_bullets": [lambda c: (f"Your answer must contain exactly {c['num']} bullet points. Use the markdown bullet points "
                                  f"such as:\n* This is point 1.\n* This is point 2"),
                       lambda c: f"Give exactly {c['num']} bullet points, each on its own line starting with \"* \".",
                       lambda c: f"Format your answer as a markdown list of exactly {c['num']} items (lines starting with *)."],
    "highlighted_sections": [lambda c: f"Use markdown to highlight at least {c['num']} parts of your answer, like *this part*.",
                             lambda c: f"Mark at least {c['num']} phrases with single asterisks, e.g. *important*."],
    "sections": [lambda c: (f"Divide your answer into {c['num']} sections, each starting with a line "
                            f"\"{c['splitter']} N\" (N = 1, 2, ...)."),
                 lambda c: f"Organise the reply in {c['num']} parts labelled {c['splitter']} 1, {c['splitter']} 2 and so on."],
    "title": [lambda c: "Give your answer a title in double angular brackets, like <<my title>>.",
              lambda c: "Start with a title wrapped in << and >>."],
    "json": [lambda c: "Reply with valid JSON only (a markdown code fence around it is allowed).",
             lambda c: "Format your entire output as a JSON object."],
    "constrained_response": [lambda c: "Reply with exactly one of these: " + ", ".join(f'"{o}"' for o in RESPONSE_OPTIONS) + ".",
                             lambda c: "Your answer must be one of: " + " / ".join(RESPONSE_OPTIONS)],
    "placeholders": [lambda c: f"Include at least {c['num']} placeholders in square brackets, like [name].",
                     lambda c: f"Leave at least {c['num']} blanks for the reader to fill in, written as [placeholder]."],
    "postscript": [lambda c: f"End with a postscript that starts with {c['marker']}",
                   lambda c: f"Add a note at the very end beginning with \"{c['marker']}\"."],
    "two_responses": [lambda c: "Write two different answers, separated by a line of six asterisks (******).",
                      lambda c: "Give two alternative replies and put ****** between them (and nowhere else)."],
    "keyword_frequency": [lambda c: f"Use the word \"{c['keyword']}\" {_rel(c)} {c['num']} times.",
                          lambda c: f"Mention {c['keyword']} {_rel(c)} {c['num']} times in your answer."],
    "include_keywords": [lambda c: f"Make sure your answer mentions {_and(c['words'])}.",
                         lambda c: f"Use the word{'s' if len(c['words']) > 1 else ''} {_and(c['words'])} somewhere in your reply."],
    "forbidden_words": [lambda c: f"Do not include the words {', '.join(c['words'])} in the response.",
                        lambda c: f"Avoid the words {_and(c['words'])}.", lambda c: f"Never use the words {', '.join(c['words'])}."],
    "letter_frequency": [lambda c: f"Use the letter {c['letter']} {_rel(c)} {c['num']} times.",
                         lambda c: f"The letter \"{c['letter']}\" must occur {_rel(c)} {c['num']} times in your answer."],
}


def sentence(c: dict, style: str, rng: random.Random) -> tuple[str, str]:
    """(the sentence that asks for c, "ifeval" or "ours"): IFEval's wording, or one of ours drawn by rng."""
    if style == "ifeval" and c["type"] != "start_phrase":  # start_phrase has no IFEval wording
        return describe(c), "ifeval"
    return rng.choice(PHRASINGS[c["type"]])(c), "ours"


def _row(prompt: str, extra: dict) -> dict:
    return {"conversations": [{"role": "user", "content": prompt}, {"role": "assistant", "content": ""}], "prompt": prompt, **extra}


def make_rows(topics: list[str], n: int, rng: random.Random, kinds: list[str] | None = None, wording: str = "mixed",
              two_share: float = 0.4) -> list[dict]:
    """n rows on `topics`, each of `kinds` equally often as a row's first constraint; wording "mixed" (IFEval's or
    ours, half each) or "ifeval"."""
    kinds = kinds or KINDS
    rows = []
    for i in range(n):
        topic = rng.choice(topics)
        first = kinds[i % len(kinds)]
        cs = [sample_constraint(first, topic, rng)]
        if rng.random() < two_share:
            options = [k for k in kinds if compatible(first, k)]
            if options:
                second = sample_constraint(rng.choice(options), topic, rng)
                while _clash(cs[0], second):
                    second = sample_constraint(second["type"], topic, rng)
                cs.append(second)
        cs.sort(key=lambda c: c["type"] == "repeat_prompt")  # its request is everything before its sentence
        template = QUESTIONS if first == "constrained_response" else REQUESTS
        parts, styles = [rng.choice(template).format(t=topic)], []
        for c in cs:
            if c["type"] == "repeat_prompt":
                c["request"] = " ".join(parts)
            text, style = sentence(c, "ifeval" if wording == "ifeval" else rng.choice(["ifeval", "ours"]), rng)
            parts.append(text)
            styles.append(style)
        ids, kwargs = ifeval_instructions(validate(cs, f"row {i}"))
        rows.append(_row(" ".join(parts), {"constraints": cs, "instruction_id_list": ids, "kwargs": kwargs, "wording": styles}))
    rng.shuffle(rows)
    return rows


# IFEval's instructions that we do not train: their build_description kwargs and wording (checked against Google's
# by tests/test_ifeval_reference.py), for held-out rows only a judge with Google's checker can score.
OTHER_TYPES = list(LEFT_OUT)


def other_kwargs(iid: str, rng: random.Random) -> dict:
    if iid == "language:response_language":
        return {"language": rng.choice(sorted(LANGUAGES))}
    relation = rng.choice(["less than", "at least"])
    if iid == "length_constraints:number_sentences":
        return {"num_sentences": rng.randint(2, 6), "relation": relation}
    return {"capital_frequency": rng.randint(2, 10), "capital_relation": relation}  # change_case:capital_word_frequency


def other_description(iid: str, kw: dict) -> str:
    if iid == "language:response_language":
        return f"Your ENTIRE response should be in {LANGUAGES[kw['language']]} language, no other language is allowed."
    if iid == "length_constraints:number_sentences":
        return f"Your response should contain {kw['relation']} {kw['num_sentences']} sentences."
    return f"In your response, words with all capital letters should appear {kw['capital_relation']} {kw['capital_frequency']} times."


def make_other_rows(topics: list[str], n: int, rng: random.Random) -> list[dict]:
    rows = []
    for i in range(n):
        iid = OTHER_TYPES[i % len(OTHER_TYPES)]
        kw = other_kwargs(iid, rng)
        prompt = f"{rng.choice(REQUESTS).format(t=rng.choice(topics))} {other_description(iid, kw)}"
        rows.append(_row(prompt, {"instruction_id_list": [iid], "kwargs": [kw], "wording": ["ifeval"]}))
    rng.shuffle(rows)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out_dir", default=str(ROOT / "dataset"), help="where the ifeval_*.jsonl files go")
    p.add_argument("--n_train", type=int, default=2000)
    p.add_argument("--n_eval", type=int, default=300)
    p.add_argument("--n_eval_ifeval_wording", type=int, default=220)
    p.add_argument("--n_eval_other_types", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    rng = random.Random(a.seed)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ifeval_kinds = [k for k in KINDS if k != "start_phrase"]
    files = [("ifeval_train.jsonl", lambda: make_rows(TRAIN_TOPICS, a.n_train, rng)),
             ("ifeval_eval.jsonl", lambda: make_rows(EVAL_TOPICS, a.n_eval, rng)),
             ("ifeval_eval_ifeval_wording.jsonl", lambda: make_rows(EVAL_TOPICS, a.n_eval_ifeval_wording, rng,
                                                                    kinds=ifeval_kinds, wording="ifeval")),
             ("ifeval_eval_other_types.jsonl", lambda: make_other_rows(EVAL_TOPICS, a.n_eval_other_types, rng))]
    for name, make in files:
        rows = make()
        (out / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        print(f"wrote {len(rows)} rows to {out / name}")


if __name__ == "__main__":
    main()
