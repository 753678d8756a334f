"""Verifiable instruction following (a task beside the RLAIF data): IFEval's constraint types, checked as IFEval
checks them (Zhou et al. 2023, "Instruction-Following Evaluation for Large Language Models", arXiv:2311.07911;
the checks of its instructions.py, written here from its definitions), and the sentence each adds to a prompt.
tests/test_ifeval_reference.py runs Google's checker beside this one and they agree (docs/smollm2_ifeval.md).

A constraint is a dict {"type": ..., parameters}; a prompt row of the RLAIF jsonl carries its list under
"constraints" (builders/make_ifeval_data.py writes such files). `check(c, reply)` says whether `reply` meets it;
`results` / `reward(constraints, reply)` apply IFEval's strict evaluation (an empty or blank reply meets nothing)
and give the fraction met, what the ifeval reward component gives. `IFEVAL_IDS` / `ifeval_instructions` name each
constraint as Google's checker does (instruction id + build_description's kwargs), so a judge can re-check a reply.

| type | IFEval id | parameters | met when |
|---|---|---|---|
| lowercase | change_case:english_lowercase | | `str.islower()`: a cased letter, no capital ("", "123" fail) |
| uppercase | change_case:english_capital | | `str.isupper()`: a cased letter, no lowercase one |
| number_words | length_constraints:number_words | relation, num | the count of \\w+ runs is < num / >= num |
| number_paragraphs | length_constraints:number_paragraphs | num | num non-blank pieces split on `\\s?\\*\\*\\*\\s?`, no blank inner one |
| paragraph_first_word | length_constraints:nth_paragraph_first_word | num, nth, word | (1) |
| no_comma | punctuation:no_comma | | no ',' anywhere |
| end_phrase | startend:end_checker | phrase | the stripped reply less '"' at its ends ends with the phrase (2) |
| start_phrase | combination:repeat_prompt's check | phrase | the stripped reply starts with the phrase (2) |
| repeat_prompt | combination:repeat_prompt | request | the stripped reply starts with the request (2) |
| quotation | startend:quotation | | the stripped reply is longer than 1 character and starts and ends with '"' |
| number_bullets | detectable_format:number_bullet_lists | num | exactly num lines starting (after spaces) with '*' then not '*', or '-' |
| highlighted_sections | detectable_format:number_highlighted_sections | num | at least num *highlighted* or **bold** spans with text |
| sections | detectable_format:multiple_sections | splitter, num | at least num pieces follow a split on `\\s?{splitter}\\s?\\d+\\s?` |
| title | detectable_format:title | | a <<title>> on one line with more than '<', '>' and spaces inside |
| json | detectable_format:json_format | | `json.loads` takes the stripped reply less a leading ```json (or ```) and a trailing ``` |
| constrained_response | detectable_format:constrained_response | | contains "My answer is yes.", "... no." or "... maybe." |
| placeholders | detectable_content:number_placeholders | num | at least num `\\[.*?\\]` spans |
| postscript | detectable_content:postscript | marker ("P.S.") | "p.s." or "p. s." (any case; P.P.S: "p. p. s"; other markers: a regex) |
| two_responses | combination:two_responses | | two non-blank pieces around "******" that differ once stripped, none blank between |
| keyword_frequency | keywords:frequency | keyword, relation, num | the stripped keyword (a regex, any case) matches < num / >= num times |
| include_keywords | keywords:existence | words | every word (a case-insensitive regex) occurs, inside other words too |
| forbidden_words | keywords:forbidden_words | words | none of the words (regexes) occurs between word boundaries (case-insensitive) |
| letter_frequency | keywords:letter_frequency | letter, relation, num | the letter occurs in the lowercased reply < num / >= num times |

(1) exactly num non-blank pieces split on "\\n\\n", and the nth piece's first word, less leading ' then ", up to the first
of . , ? ! ' ", lowercased letter by letter, is `word` lowercased. (2) lowercased, the phrase stripped and lowercased.

Left out, of IFEval's 25 instructions (nothing here may need more than the standard library):
`language:response_language` needs langdetect, a statistical model whose answer is random unless seeded;
`length_constraints:number_sentences` counts sentences with NLTK's punkt tokenizer and
`change_case:capital_word_frequency` counts words with `nltk.word_tokenize`, which splits sentences with punkt
first: both load NLTK's `punkt_tab` data, a download (`nltk.download('punkt_tab')`), and Google's checker raises
LookupError without it, so there is nothing to agree with offline (docs/smollm2_ifeval.md).

Intended differences from Google's checker. start_phrase is not an IFEval instruction (its nearest,
multi-turn:constrained_start, is not in the registry); its check is repeat_prompt's. IFEval's lowercase and
uppercase checks also ask langdetect whether the reply is English; here only the case is checked (langdetect is
random unless seeded and calls short English replies such as "i like the sea." other languages). JSON nested too
deeply for the parser (RecursionError) is not met here; Google's checker raises there.
Keywords, words, postscript markers and section splitters are regexes, as in IFEval: `validate` rejects one that
does not compile, and any parameter for which IFEval's build_description would draw a random value instead.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

RELATIONS = ("less than", "at least")
# The answers constrained_response accepts (IFEval's _CONSTRAINED_RESPONSE_OPTIONS).
RESPONSE_OPTIONS = ("My answer is yes.", "My answer is no.", "My answer is maybe.")
_FIRST_WORD_STOP = set(".,?!'\"")  # where paragraph_first_word's first word ends


def _relation(count: int, relation: str, num: int) -> bool:
    if relation == "less than":
        return count < num
    if relation == "at least":
        return count >= num
    raise ValueError(f"unknown relation {relation!r}: expected one of {', '.join(RELATIONS)}")


def _lowercase(reply: str, c: dict) -> bool:
    return reply.islower()  # at least one cased letter, none upper: "" and "123" fail, as in IFEval


def _uppercase(reply: str, c: dict) -> bool:
    return reply.isupper()


def _number_words(reply: str, c: dict) -> bool:
    return _relation(len(re.findall(r"\w+", reply)), c["relation"], int(c["num"]))


def _number_paragraphs(reply: str, c: dict) -> bool:
    parts = re.split(r"\s?\*\*\*\s?", reply)
    if any(not p.strip() for p in parts[1:-1]):  # an empty paragraph between two dividers
        return False
    return sum(1 for p in parts if p.strip()) == int(c["num"])


def _paragraph_first_word(reply: str, c: dict) -> bool:
    parts = reply.split("\n\n")
    count = sum(1 for p in parts if p.strip())
    nth = int(c["nth"])
    if nth > count:
        return False
    text = parts[nth - 1].strip()  # the nth piece of the split, blank ones included, as IFEval indexes it
    if not text:
        return False
    word = text.split()[0].lstrip("'").lstrip('"')
    first = ""
    for ch in word:
        if ch in _FIRST_WORD_STOP:
            break
        first += ch.lower()  # per character, as IFEval: a final sigma stays 'σ'
    return count == int(c["num"]) and first == c["word"].lower()


def _no_comma(reply: str, c: dict) -> bool:
    return "," not in reply


def _end_phrase(reply: str, c: dict) -> bool:
    return reply.strip().strip('"').lower().endswith(c["phrase"].strip().lower())


def _starts_with(reply: str, text: str) -> bool:
    return reply.strip().lower().startswith(text.strip().lower())


def _start_phrase(reply: str, c: dict) -> bool:
    return _starts_with(reply, c["phrase"])


def _repeat_prompt(reply: str, c: dict) -> bool:
    return _starts_with(reply, c["request"])


def _quotation(reply: str, c: dict) -> bool:
    text = reply.strip()
    return len(text) > 1 and text[0] == '"' and text[-1] == '"'


def _number_bullets(reply: str, c: dict) -> bool:
    stars = re.findall(r"^\s*\*[^\*].*$", reply, flags=re.MULTILINE)
    dashes = re.findall(r"^\s*-.*$", reply, flags=re.MULTILINE)
    return len(stars) + len(dashes) == int(c["num"])


def _highlighted_sections(reply: str, c: dict) -> bool:
    spans = [s for s in re.findall(r"\*[^\n\*]*\*", reply) if s.strip("*").strip()]
    spans += [s for s in re.findall(r"\*\*[^\n\*]*\*\*", reply) if s.removeprefix("**").removesuffix("**").strip()]
    return len(spans) >= int(c["num"])


def _section_pattern(splitter: str) -> str:
    return r"\s?" + splitter.strip() + r"\s?\d+\s?"


def _sections(reply: str, c: dict) -> bool:
    return len(re.split(_section_pattern(c["splitter"]), reply)) - 1 >= int(c["num"])


def _title(reply: str, c: dict) -> bool:
    return any(t.lstrip("<").rstrip(">").strip() for t in re.findall(r"<<[^\n]+>>", reply))


def _json(reply: str, c: dict) -> bool:
    text = reply.strip()
    for fence in ("```json", "```Json", "```JSON", "```"):  # one after the other, as IFEval's removeprefix chain
        text = text.removeprefix(fence)
    try:
        json.loads(text.removesuffix("```").strip())
    except ValueError:
        return False
    except RecursionError:  # nested past the parser's depth: a reward must not crash the run (IFEval raises)
        return False
    return True


def _constrained_response(reply: str, c: dict) -> bool:
    return any(option in reply for option in RESPONSE_OPTIONS)


def _placeholders(reply: str, c: dict) -> bool:
    return len(re.findall(r"\[.*?\]", reply)) >= int(c["num"])


def _postscript_pattern(marker: str) -> str:
    marker = marker.strip()
    if marker == "P.P.S":
        return r"\s*p\.\s?p\.\s?s.*$"
    if marker == "P.S.":
        return r"\s*p\.\s?s\..*$"
    return r"\s*" + marker.lower() + r".*$"  # as IFEval: the marker, lowercased, is a regex ('.' any character)


def _postscript(reply: str, c: dict) -> bool:
    return bool(re.findall(_postscript_pattern(c.get("marker", "P.S.")), reply.lower(), flags=re.MULTILINE))


def _two_responses(reply: str, c: dict) -> bool:
    parts = reply.split("******")
    answers = []
    for k, part in enumerate(parts):
        if part.strip():
            answers.append(part.strip())
        elif 0 < k < len(parts) - 1:  # nothing between two separators
            return False
    return len(answers) == 2 and answers[0] != answers[1]


def _keyword_frequency(reply: str, c: dict) -> bool:
    return _relation(len(re.findall(c["keyword"].strip(), reply, flags=re.IGNORECASE)), c["relation"], int(c["num"]))


def _include_keywords(reply: str, c: dict) -> bool:
    return all(re.search(w, reply, flags=re.IGNORECASE) for w in c["words"])  # w: a regex, not stripped


def _forbidden_words(reply: str, c: dict) -> bool:
    return not any(re.search(r"\b" + w + r"\b", reply, flags=re.IGNORECASE) for w in c["words"])  # w: a regex


def _letter_frequency(reply: str, c: dict) -> bool:
    return _relation(reply.lower().count(c["letter"].lower()), c["relation"], int(c["num"]))


CHECKS: dict[str, Callable[[str, dict], bool]] = {
    "lowercase": _lowercase, "number_words": _number_words, "no_comma": _no_comma, "end_phrase": _end_phrase,
    "start_phrase": _start_phrase, "quotation": _quotation, "number_bullets": _number_bullets,
    "keyword_frequency": _keyword_frequency, "title": _title, "postscript": _postscript,
    "forbidden_words": _forbidden_words, "highlighted_sections": _highlighted_sections,
    "uppercase": _uppercase, "number_paragraphs": _number_paragraphs, "paragraph_first_word": _paragraph_first_word,
    "repeat_prompt": _repeat_prompt, "sections": _sections, "json": _json, "constrained_response": _constrained_response,
    "placeholders": _placeholders, "two_responses": _two_responses, "include_keywords": _include_keywords,
    "letter_frequency": _letter_frequency,
}
# The parameters each type needs (validated when a prompt file is read); OPTIONAL: those it may leave out.
PARAMS: dict[str, tuple[str, ...]] = {
    "lowercase": (), "number_words": ("relation", "num"), "no_comma": (), "end_phrase": ("phrase",),
    "start_phrase": ("phrase",), "quotation": (), "number_bullets": ("num",), "keyword_frequency": ("keyword", "relation", "num"),
    "title": (), "postscript": (), "forbidden_words": ("words",), "highlighted_sections": ("num",),
    "uppercase": (), "number_paragraphs": ("num",), "paragraph_first_word": ("num", "nth", "word"),
    "repeat_prompt": ("request",), "sections": ("splitter", "num"), "json": (), "constrained_response": (),
    "placeholders": ("num",), "two_responses": (), "include_keywords": ("words",),
    "letter_frequency": ("letter", "relation", "num"),
}
OPTIONAL: dict[str, dict[str, object]] = {"postscript": {"marker": "P.S."}}

# Our type -> Google's instruction id (if_verifiable.ifeval.instructions_registry.INSTRUCTION_DICT) and the kwargs
# of its build_description. start_phrase is checked by repeat_prompt's checker: the same check.
IFEVAL: dict[str, tuple[str, Callable[[dict], dict]]] = {
    "lowercase": ("change_case:english_lowercase", lambda c: {}),
    "uppercase": ("change_case:english_capital", lambda c: {}),
    "number_words": ("length_constraints:number_words", lambda c: {"num_words": c["num"], "relation": c["relation"]}),
    "number_paragraphs": ("length_constraints:number_paragraphs", lambda c: {"num_paragraphs": c["num"]}),
    "paragraph_first_word": ("length_constraints:nth_paragraph_first_word",
                             lambda c: {"num_paragraphs": c["num"], "nth_paragraph": c["nth"], "first_word": c["word"]}),
    "no_comma": ("punctuation:no_comma", lambda c: {}),
    "end_phrase": ("startend:end_checker", lambda c: {"end_phrase": c["phrase"]}),
    "start_phrase": ("combination:repeat_prompt", lambda c: {"prompt_to_repeat": c["phrase"]}),
    "repeat_prompt": ("combination:repeat_prompt", lambda c: {"prompt_to_repeat": c["request"]}),
    "quotation": ("startend:quotation", lambda c: {}),
    "number_bullets": ("detectable_format:number_bullet_lists", lambda c: {"num_bullets": c["num"]}),
    "highlighted_sections": ("detectable_format:number_highlighted_sections", lambda c: {"num_highlights": c["num"]}),
    "sections": ("detectable_format:multiple_sections", lambda c: {"section_spliter": c["splitter"], "num_sections": c["num"]}),
    "title": ("detectable_format:title", lambda c: {}),
    "json": ("detectable_format:json_format", lambda c: {}),
    "constrained_response": ("detectable_format:constrained_response", lambda c: {}),
    "placeholders": ("detectable_content:number_placeholders", lambda c: {"num_placeholders": c["num"]}),
    "postscript": ("detectable_content:postscript", lambda c: {"postscript_marker": c.get("marker", "P.S.")}),
    "two_responses": ("combination:two_responses", lambda c: {}),
    "keyword_frequency": ("keywords:frequency",
                          lambda c: {"keyword": c["keyword"], "frequency": c["num"], "relation": c["relation"]}),
    "include_keywords": ("keywords:existence", lambda c: {"keywords": list(c["words"])}),
    "forbidden_words": ("keywords:forbidden_words", lambda c: {"forbidden_words": list(c["words"])}),
    "letter_frequency": ("keywords:letter_frequency",
                         lambda c: {"letter": c["letter"], "let_frequency": c["num"], "let_relation": c["relation"]}),
}
IFEVAL_IDS: dict[str, str] = {kind: iid for kind, (iid, _) in IFEVAL.items()}
# IFEval's instructions that no type here checks, and why (docs/smollm2_ifeval.md).
LEFT_OUT: dict[str, str] = {
    "language:response_language": "needs langdetect, a statistical model whose answer is random unless seeded",
    "length_constraints:number_sentences": "counts sentences with NLTK's punkt, whose punkt_tab data is a download",
    "change_case:capital_word_frequency": "counts nltk.word_tokenize words, which splits sentences with punkt "
                                          "(punkt_tab data, a download) first",
}


def ifeval_instructions(constraints: list[dict]) -> tuple[list[str], list[dict]]:
    """(instruction_id_list, kwargs): the row's constraints as Google's checker takes them (IFEval's input_data)."""
    return [IFEVAL[c["type"]][0] for c in constraints], [IFEVAL[c["type"]][1](c) for c in constraints]


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _text(v: object) -> bool:
    return isinstance(v, str) and bool(v.strip())


def _param_error(kind: str, c: dict) -> str | None:
    """What is wrong with constraint c's parameters (each one IFEval's build_description would take as given
    rather than replace by a random draw), or None."""
    if "relation" in c and c["relation"] not in RELATIONS:
        return f"relation {c['relation']!r} is not one of {', '.join(RELATIONS)}"
    for name in ("num", "nth"):
        if name in c and not _is_count(c[name]):
            return f"{name} must be a whole number >= 0, got {c[name]!r}"
    for name in ("phrase", "keyword", "request", "splitter", "marker"):
        if name in c and not _text(c[name]):
            return f"{name} must be a non-empty string, got {c[name]!r}"
    if "words" in c and (not isinstance(c["words"], list) or not c["words"] or not all(map(_text, c["words"]))):
        return f"words must be a non-empty list of non-empty strings, got {c['words']!r}"
    if kind == "letter_frequency" and not (isinstance(c["letter"], str) and len(c["letter"]) == 1
                                           and c["letter"].isascii() and c["letter"].isalpha()):
        return f"letter must be one ASCII letter a-z or A-Z, got {c['letter']!r}"
    if kind == "paragraph_first_word":
        if not 1 <= c["nth"] <= c["num"]:
            return f"nth must be between 1 and num ({c['num']}), got {c['nth']!r}"
        w = c["word"]
        if not _text(w) or any(ch.isspace() or ch in _FIRST_WORD_STOP for ch in w):
            return f"word must be one word without spaces or . , ? ! ' \" (a reply's first word stops there), got {w!r}"
    # (the parameter as written, the regex the check builds from it)
    patterns = {"keyword_frequency": lambda: [(c["keyword"], c["keyword"].strip())],
                "include_keywords": lambda: [(w, w) for w in c["words"]],
                "forbidden_words": lambda: [(w, r"\b" + w + r"\b") for w in c["words"]],
                "postscript": lambda: [(c.get("marker", "P.S."), _postscript_pattern(c.get("marker", "P.S.")))],
                "sections": lambda: [(c["splitter"], _section_pattern(c["splitter"]))]}.get(kind, list)()
    for shown, pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as e:
            return f"{shown!r} is not a regex ({e}); IFEval reads it as one"
    return None


def validate(constraints: object, where: str) -> list[dict]:
    """The row's constraints, or ValueError("where: ...") naming what is wrong."""
    if not isinstance(constraints, list) or not constraints:
        raise ValueError(f"{where}: 'constraints' must be a non-empty list of {{\"type\": ...}} objects")
    for k, c in enumerate(constraints):
        at = f"{where}: constraints[{k}]"
        if not isinstance(c, dict) or c.get("type") not in CHECKS:
            raise ValueError(f"{at}: unknown constraint {c!r}; types: {', '.join(CHECKS)}")
        kind = c["type"]
        missing = [p for p in PARAMS[kind] if p not in c]
        if missing:
            raise ValueError(f"{at} ({kind}) needs {', '.join(missing)}")
        unknown = [p for p in c if p != "type" and p not in PARAMS[kind] and p not in OPTIONAL.get(kind, {})]
        if unknown:
            allowed = [*PARAMS[kind], *OPTIONAL.get(kind, {})]
            raise ValueError(f"{at} ({kind}): unknown parameter {', '.join(map(repr, unknown))}; "
                             f"it takes {', '.join(allowed) or 'none'}")
        error = _param_error(kind, c)
        if error:
            raise ValueError(f"{at} ({kind}): {error}")
    return constraints


def _case_share(reply: str, upper: bool) -> float:
    cased = [ch for ch in reply if ch.isupper() or ch.islower()]
    return sum(ch.isupper() == upper for ch in cased) / len(cased) if cased else 0.0


def _prefix_share(reply: str, text: str) -> float:
    want, got = text.lower().split(), reply.lower().split()
    k = 0
    while k < min(len(want), len(got)) and want[k] == got[k]:
        k += 1
    return k / len(want) if want else 0.0


# How close an unmet reply comes, in [0, 1), for the types a small model almost never meets by chance (a training
# signal only, --ifeval_partial_weight; the verdict stays check's). Other types have none.
CLOSENESS: dict[str, Callable[[str, dict], float]] = {
    "uppercase": lambda r, c: _case_share(r, True),  # the share of cased letters that are capitals
    "lowercase": lambda r, c: _case_share(r, False),
    "repeat_prompt": lambda r, c: _prefix_share(r, c["request"]),  # the share of the request's words it opens with
    "start_phrase": lambda r, c: _prefix_share(r, c["phrase"]),
    "two_responses": lambda r, c: 0.5 * ("******" in r),  # the separator, at least
}


def partial_credit(constraints: list[dict], reply: str, met: list[tuple[str, bool]] | None = None) -> float:
    """The mean over `constraints` of CLOSENESS for each one `reply` does not meet (0 for met ones and for types
    without a closeness; `met`: its `results`, when already computed): a dense reward beside `reward` for types
    whose verdict is almost always 0. A blank reply earns none."""
    if not constraints or not reply.strip():
        return 0.0
    met = met if met is not None else results(constraints, reply)
    return sum(0.0 if ok or c["type"] not in CLOSENESS else min(CLOSENESS[c["type"]](reply, c), 0.999)
               for c, (_, ok) in zip(constraints, met)) / len(constraints)


def check(c: dict, reply: str) -> bool:
    """Whether `reply` meets constraint `c` (Google's check_following for it)."""
    return CHECKS[c["type"]](reply, c)


def results(constraints: list[dict], reply: str) -> list[tuple[str, bool]]:
    """(type, met) per constraint, in order: each checked once for the reward and the per-type figures alike.
    A blank reply meets none, as in IFEval's strict evaluation (`response.strip() and check_following(...)`)."""
    return [(c["type"], bool(reply.strip()) and check(c, reply)) for c in constraints]


def share_met(met: list[tuple[str, bool]]) -> float:
    """The fraction of `results` met (1.0: every one)."""
    return sum(ok for _, ok in met) / len(met)


def reward(constraints: list[dict], reply: str) -> float:
    """The fraction of the constraints `reply` meets (1.0: every one)."""
    return share_met(results(constraints, reply))


def _words(words: list[str]) -> str:
    return str(sorted(words))  # IFEval formats the sorted Python list: "['good', 'nice']"


# IFEval's wording: what build_description returns for the same parameters (tests/test_ifeval_reference.py checks
# it against Google's). start_phrase has none; its sentence is ours.
DESCRIPTIONS: dict[str, Callable[[dict], str]] = {
    "lowercase": lambda c: ("Your entire response should be in English, and in all lowercase letters. "
                            "No capital letters are allowed."),
    "uppercase": lambda c: "Your entire response should be in English, and in all capital letters.",
    "number_words": lambda c: f"Answer with {c['relation']} {c['num']} words.",
    "number_paragraphs": lambda c: (f"There should be {c['num']} paragraphs. "
                                    f"Paragraphs are separated with the markdown divider: ***"),
    "paragraph_first_word": lambda c: (f"There should be {c['num']} paragraphs. Paragraphs and only paragraphs are "
                                       f"separated with each other by two new lines as if it was '\\n\\n' in python. "
                                       f"Paragraph {c['nth']} must start with word {c['word'].lower()}."),
    "no_comma": lambda c: "In your entire response, refrain from the use of any commas.",
    "end_phrase": lambda c: (f"Finish your response with this exact phrase {c['phrase'].strip()}. "
                             f"No other words should follow this phrase."),
    "start_phrase": lambda c: f"Start your response with this exact phrase: {c['phrase']}",
    "repeat_prompt": lambda c: ("First repeat the request word for word without change, then give your answer "
                                "(1. do not say any words or characters before repeating the request; "
                                "2. the request you need to repeat does not include this sentence)"),
    "quotation": lambda c: "Wrap your entire response with double quotation marks.",
    "number_bullets": lambda c: (f"Your answer must contain exactly {c['num']} bullet points. Use the markdown bullet points "
                                 f"such as:\n* This is point 1. \n* This is point 2"),
    "highlighted_sections": lambda c: (f"Highlight at least {c['num']} sections in your answer with markdown, "
                                       f"i.e. *highlighted section*."),
    "sections": lambda c: (f"Your response must have {c['num']} sections. Mark the beginning of each section with "
                           f"{c['splitter'].strip()} X, such as:\n{c['splitter'].strip()} 1\n[content of section 1]\n"
                           f"{c['splitter'].strip()} 2\n[content of section 2]"),
    "title": lambda c: "Your answer must contain a title, wrapped in double angular brackets, such as <<poem of joy>>.",
    "json": lambda c: "Entire output should be wrapped in JSON format. You can use markdown ticks such as ```.",
    "constrained_response": lambda c: f"Answer with one of the following options: {RESPONSE_OPTIONS}",
    "placeholders": lambda c: (f"The response must contain at least {c['num']} placeholders represented by square "
                               f"brackets, such as [address]."),
    "postscript": lambda c: ("At the end of your response, please explicitly add a postscript starting with "
                             f"{c.get('marker', 'P.S.').strip()}"),
    "two_responses": lambda c: ("Give two different responses. Responses and only responses should be separated by "
                                "6 asterisk symbols: ******."),
    "keyword_frequency": lambda c: (f"In your response, the word {c['keyword'].strip()} should appear {c['relation']} "
                                    f"{c['num']} times."),
    "include_keywords": lambda c: f"Include keywords {_words(c['words'])} in the response.",
    "forbidden_words": lambda c: f"Do not include keywords {_words(list(set(c['words'])))} in the response.",
    "letter_frequency": lambda c: (f"In your response, the letter {c['letter'].lower()} should appear {c['relation']} "
                                   f"{c['num']} times."),
}


def describe(c: dict) -> str:
    """The sentence that asks for constraint `c` in a prompt, as IFEval words it (start_phrase: ours)."""
    return DESCRIPTIONS[c["type"]](c)


# Rewrites that make a reply meet one constraint (--ifeval_repairs: a group where no sample met a type gets one
# rewritten sample, so GRPO sees a success to move towards). Each takes the reply and the constraint, and a sibling
# reply (two_responses: the second answer); None where it cannot. Uppercase is left out: the imported SmolLM2 puts
# 50-185 nats per reply on a capitalised reply (docs/smollm2_ifeval.md), past the whole KL budget.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def _regroup(reply: str, num: int) -> list[str] | None:
    """`reply` as exactly `num` non-blank paragraphs: its own blank-line paragraphs with the surplus joined onto the
    last, or, where it has fewer, its sentences dealt into `num` runs; None with fewer sentences than that."""
    paras = [p.strip() for p in re.split(r"\n\s*\n", reply) if p.strip()]
    if len(paras) >= num:
        return paras[:num - 1] + [" ".join(paras[num - 1:])]
    sentences = [s for s in _SENTENCE_END.split(" ".join(paras)) if s.strip()]
    if len(sentences) < num:
        return None
    cuts = [round(k * len(sentences) / num) for k in range(num + 1)]
    return [" ".join(sentences[a:b]) for a, b in zip(cuts, cuts[1:])]


def _with_first_word(paras: list[str] | None, c: dict) -> str | None:
    if paras is None:
        return None
    k, word = int(c["nth"]) - 1, c["word"].strip()
    if k >= len(paras) or not word:
        return None
    rest = paras[k][:1].lower() + paras[k][1:] if paras[k][1:2].islower() else paras[k]  # "The sea" -> "Word the sea"
    paras[k] = f"{word[:1].upper()}{word[1:]} {rest}"
    return "\n\n".join(paras)


def _as_bullets(reply: str, c: dict) -> str | None:
    runs = _regroup(reply.replace("\n", " "), int(c["num"]))
    return None if runs is None else "\n".join(f"* {r.lstrip('*- ').strip()}" for r in runs)


def _two(reply: str, sibling: str | None) -> str | None:
    a, b = reply.strip(), (sibling or "").strip()
    return None if not b or a == b or "******" in a + b else f"{a}\n******\n{b}"


REPAIRS: dict[str, Callable[[str, dict, str | None], str | None]] = {  # in the order they compose
    "lowercase": lambda r, c, s: r.lower(),
    "number_paragraphs": lambda r, c, s: (lambda p: None if p is None else "\n\n***\n\n".join(p))(_regroup(r, int(c["num"]))),
    "paragraph_first_word": lambda r, c, s: _with_first_word(_regroup(r, int(c["num"])), c),
    "number_bullets": lambda r, c, s: _as_bullets(r, c),
    "two_responses": lambda r, c, s: _two(r, s),
    "repeat_prompt": lambda r, c, s: f"{c['request'].strip()}\n\n{r.lstrip()}",
    "quotation": lambda r, c, s: f'"{r.strip()}"',
}


def repair(constraints: list[dict], reply: str, unmet: set[str], sibling: str | None = None) -> str | None:
    """`reply` rewritten by REPAIRS for each constraint of `constraints` whose type is in `unmet`, in REPAIRS' order;
    None where no rewrite applies, one fails, or the result does not meet more of `constraints` than `reply` does
    (so a rewrite never trades one met constraint for another)."""
    todo = sorted((c for c in constraints if c["type"] in unmet and c["type"] in REPAIRS), key=lambda c: list(REPAIRS).index(c["type"]))
    if not todo:
        return None
    text = reply
    for c in todo:
        step = REPAIRS[c["type"]](text, c, sibling)
        if step is None or not step.strip():
            return None
        text = step
    return text if reward(constraints, text) > reward(constraints, reply) else None
