"""Verifiable instruction following (a task beside the RLAIF data): IFEval's constraint types, checked as IFEval
checks them (Zhou et al. 2023, "Instruction-Following Evaluation for Large Language Models", arXiv:2311.07911;
the strict check of its instructions.py, written here from its definitions), and the sentence each adds to a prompt.
tests/test_ifeval_reference.py runs Google's checker beside this one and they agree (docs/smollm2_ifeval.md).

A constraint is a dict {"type": ..., parameters}; a prompt row of the RLAIF jsonl carries its list under
"constraints" (builders/make_ifeval_data.py writes such files). `check(c, reply)` says whether `reply` meets it;
`reward(constraints, reply)` is the fraction met, what the ifeval reward component gives.

| type | parameters | met when (IFEval's strict check) |
|---|---|---|
| lowercase | | `str.islower()`: some cased letter and no capital ("" or "123" fail) |
| number_words | relation ("less than" / "at least"), num | the count of \\w+ runs is < num / >= num |
| no_comma | | no ',' anywhere |
| end_phrase | phrase | the stripped reply, less '"' at its ends, lowercased, ends with the stripped phrase, lowercased |
| start_phrase | phrase | the stripped reply, lowercased, starts with the stripped phrase, lowercased |
| quotation | | the stripped reply is longer than one character and starts and ends with '"' |
| number_bullets | num | exactly num lines that start (after whitespace) with '*' and then not '*', or with '-' |
| keyword_frequency | keyword, relation, num | the stripped keyword, a case-insensitive regex, matches < num / >= num times |
| title | | a <<title>> on one line with more than '<', '>' and spaces inside |
| postscript | marker ("P.S.") | "p.s." or "p. s." anywhere (case-insensitive; "P.P.S": "p.p.s", "p. p. s"; other markers: a regex) |
| forbidden_words | words | none of the words (each a regex) occurs between word boundaries (case-insensitive) |
| highlighted_sections | num | at least num *highlighted* (or **bold**) spans with text in them |

start_phrase is not in IFEval's list (its nearest is the first word of a paragraph): it is end_phrase's
mirror. IFEval's lowercase check also asks langdetect whether the reply is English; here only the case is checked
(langdetect is random unless seeded and calls short English replies such as "i like the sea." other languages).
Keywords, forbidden words and postscript markers are regexes, as in IFEval: `validate` rejects one that does not compile.
"""

from __future__ import annotations

import re
from collections.abc import Callable

RELATIONS = ("less than", "at least")


def _relation(count: int, relation: str, num: int) -> bool:
    if relation == "less than":
        return count < num
    if relation == "at least":
        return count >= num
    raise ValueError(f"unknown relation {relation!r}: expected one of {', '.join(RELATIONS)}")


def _lowercase(reply: str, c: dict) -> bool:
    return reply.islower()  # at least one cased letter, none upper: "" and "123" fail, as in IFEval


def _number_words(reply: str, c: dict) -> bool:
    return _relation(len(re.findall(r"\w+", reply)), c["relation"], int(c["num"]))


def _no_comma(reply: str, c: dict) -> bool:
    return "," not in reply


def _end_phrase(reply: str, c: dict) -> bool:
    return reply.strip().strip('"').lower().endswith(c["phrase"].strip().lower())


def _start_phrase(reply: str, c: dict) -> bool:
    return reply.strip().lower().startswith(c["phrase"].strip().lower())


def _quotation(reply: str, c: dict) -> bool:
    text = reply.strip()
    return len(text) > 1 and text[0] == '"' and text[-1] == '"'


def _number_bullets(reply: str, c: dict) -> bool:
    stars = re.findall(r"^\s*\*[^\*].*$", reply, flags=re.MULTILINE)
    dashes = re.findall(r"^\s*-.*$", reply, flags=re.MULTILINE)
    return len(stars) + len(dashes) == int(c["num"])


def _keyword_frequency(reply: str, c: dict) -> bool:
    return _relation(len(re.findall(c["keyword"].strip(), reply, flags=re.IGNORECASE)), c["relation"], int(c["num"]))


def _title(reply: str, c: dict) -> bool:
    return any(t.lstrip("<").rstrip(">").strip() for t in re.findall(r"<<[^\n]+>>", reply))


def _postscript(reply: str, c: dict) -> bool:
    marker = c.get("marker", "P.S.").strip()
    if marker == "P.P.S":
        pattern = r"\s*p\.\s?p\.\s?s.*$"
    elif marker == "P.S.":
        pattern = r"\s*p\.\s?s\..*$"
    else:  # as IFEval: the marker, lowercased, is a regex ('.' matches any character)
        pattern = r"\s*" + marker.lower() + r".*$"
    return bool(re.findall(pattern, reply.lower(), flags=re.MULTILINE))


def _forbidden_words(reply: str, c: dict) -> bool:
    return not any(re.search(r"\b" + w + r"\b", reply, flags=re.IGNORECASE) for w in c["words"])  # w: a regex


def _highlighted_sections(reply: str, c: dict) -> bool:
    spans = [s for s in re.findall(r"\*[^\n\*]*\*", reply) if s.strip("*").strip()]
    spans += [s for s in re.findall(r"\*\*[^\n\*]*\*\*", reply) if s.removeprefix("**").removesuffix("**").strip()]
    return len(spans) >= int(c["num"])


CHECKS: dict[str, Callable[[str, dict], bool]] = {
    "lowercase": _lowercase, "number_words": _number_words, "no_comma": _no_comma, "end_phrase": _end_phrase,
    "start_phrase": _start_phrase, "quotation": _quotation, "number_bullets": _number_bullets,
    "keyword_frequency": _keyword_frequency, "title": _title, "postscript": _postscript,
    "forbidden_words": _forbidden_words, "highlighted_sections": _highlighted_sections,
}
# The parameters each type needs (validated when a prompt file is read).
PARAMS: dict[str, tuple[str, ...]] = {
    "lowercase": (), "number_words": ("relation", "num"), "no_comma": (), "end_phrase": ("phrase",),
    "start_phrase": ("phrase",), "quotation": (), "number_bullets": ("num",), "keyword_frequency": ("keyword", "relation", "num"),
    "title": (), "postscript": (), "forbidden_words": ("words",), "highlighted_sections": ("num",),
}


def validate(constraints: object, where: str) -> list[dict]:
    """The row's constraints, or ValueError("where: ...") naming what is wrong."""
    if not isinstance(constraints, list) or not constraints:
        raise ValueError(f"{where}: 'constraints' must be a non-empty list of {{\"type\": ...}} objects")
    for k, c in enumerate(constraints):
        at = f"{where}: constraints[{k}]"
        if not isinstance(c, dict) or c.get("type") not in CHECKS:
            raise ValueError(f"{at}: unknown constraint {c!r}; types: {', '.join(CHECKS)}")
        missing = [p for p in PARAMS[c["type"]] if p not in c]
        if missing:
            raise ValueError(f"{at} ({c['type']}) needs {', '.join(missing)}")
        if "relation" in c and c["relation"] not in RELATIONS:
            raise ValueError(f"{at}: relation {c['relation']!r} is not one of {', '.join(RELATIONS)}")
        patterns = {"keyword_frequency": [c.get("keyword")], "forbidden_words": list(c.get("words", [])),
                    "postscript": [c.get("marker", "P.S.")]}.get(c["type"], [])
        for pattern in patterns:
            try:
                re.compile(str(pattern).strip().lower())
            except re.error as e:
                raise ValueError(f"{at} ({c['type']}): {pattern!r} is not a regex ({e}); IFEval reads it as one") from None
    return constraints


def check(c: dict, reply: str) -> bool:
    """Whether `reply` meets constraint `c`."""
    return CHECKS[c["type"]](reply, c)


def results(constraints: list[dict], reply: str) -> list[tuple[str, bool]]:
    """(type, met) per constraint, in order: each checked once for the reward and the per-type figures alike."""
    return [(c["type"], check(c, reply)) for c in constraints]


def share_met(met: list[tuple[str, bool]]) -> float:
    """The fraction of `results` met (1.0: every one)."""
    return sum(ok for _, ok in met) / len(met)


def reward(constraints: list[dict], reply: str) -> float:
    """The fraction of the constraints `reply` meets (1.0: every one)."""
    return share_met(results(constraints, reply))


DESCRIPTIONS: dict[str, Callable[[dict], str]] = {
    "lowercase": lambda c: ("Your entire response should be in English, and in all lowercase letters. "
                            "No capital letters are allowed."),
    "number_words": lambda c: f"Answer with {c['relation']} {c['num']} words.",
    "no_comma": lambda c: "In your entire response, refrain from the use of any commas.",
    "end_phrase": lambda c: (f"Finish your response with this exact phrase: {c['phrase']} "
                             f"No other words should follow this phrase."),
    "start_phrase": lambda c: f"Start your response with this exact phrase: {c['phrase']}",
    "quotation": lambda c: "Wrap your entire response with double quotation marks.",
    "number_bullets": lambda c: (f"Your answer must contain exactly {c['num']} bullet points. Use the markdown bullet points "
                                 f"such as:\n* This is point 1.\n* This is point 2"),
    "keyword_frequency": lambda c: f"In your response, the word {c['keyword']} should appear {c['relation']} {c['num']} times.",
    "title": lambda c: "Your answer must contain a title, wrapped in double angular brackets, such as <<poem of joy>>.",
    "postscript": lambda c: ("At the end of your response, please explicitly add a postscript starting with "
                             f"{c.get('marker', 'P.S.')}"),
    "forbidden_words": lambda c: f"Do not include the words {', '.join(c['words'])} in the response.",
    "highlighted_sections": lambda c: (f"Highlight at least {c['num']} sections in your answer with markdown, "
                                       f"i.e. *highlighted section*."),
}


def describe(c: dict) -> str:
    """The sentence that asks for constraint `c` in a prompt (IFEval's wording where it has one)."""
    return DESCRIPTIONS[c["type"]](c)
