"""dataset/ifeval.py: each constraint type against hand-written replies, edge cases included (unicode, trailing
spaces, quotes inside quotes, bullet styles), the reward, and one-line errors for malformed constraints."""

from __future__ import annotations

import pytest

from dataset import ifeval as F

CASES = [
    # (constraint, reply, met)
    ({"type": "lowercase"}, "the sea is calm today.", True),
    ({"type": "lowercase"}, "the sea is Calm today.", False),
    ({"type": "lowercase"}, "café au lait, déjà vu", True),
    ({"type": "lowercase"}, "café au lait, DÉJÀ vu", False),  # unicode capitals count
    ({"type": "lowercase"}, "numbers 123 and symbols #!", True),
    # str.islower(), as IFEval: no cased letter at all fails
    ({"type": "lowercase"}, "123 456", False),
    ({"type": "lowercase"}, "", False),
    ({"type": "lowercase"}, "!!!", False),
    ({"type": "lowercase"}, "日本", False),
    ({"type": "number_words", "relation": "less than", "num": 5}, "one two three four", True),
    ({"type": "number_words", "relation": "less than", "num": 4}, "one two three four", False),
    ({"type": "number_words", "relation": "at least", "num": 4}, "one, two; three - four!", True),
    ({"type": "number_words", "relation": "at least", "num": 4}, "don't stop", False),  # \w+ runs: don, t, stop
    ({"type": "number_words", "relation": "at least", "num": 3}, "don't stop", True),
    ({"type": "no_comma"}, "no commas here.", True),
    ({"type": "no_comma"}, "one, two", False),
    ({"type": "no_comma"}, "a full-width comma，is not ','", False),  # the ASCII one inside quotes still counts
    ({"type": "end_phrase", "phrase": "Is there anything else I can help with?"},
     "The sea is calm. is there anything else i can help with?   \n", True),  # trailing spaces, case
    ({"type": "end_phrase", "phrase": "Any other questions?"}, "Any other questions? Bye.", False),
    # IFEval strips '"' from the ends first (tests/test_ifeval_reference.py found these against Google's checker)
    ({"type": "end_phrase", "phrase": "Any other questions?"}, '"Done. Any other questions?"', True),
    ({"type": "end_phrase", "phrase": "Any other questions?"}, 'Done. Any other questions?""', True),
    ({"type": "end_phrase", "phrase": "Any other questions?"}, '"Done. Any other questions? "', False),  # space inside
    ({"type": "start_phrase", "phrase": "My answer is"}, "  my answer is yes.", True),
    ({"type": "start_phrase", "phrase": "My answer is"}, "Well, my answer is yes.", False),
    ({"type": "quotation"}, '"The sea is calm."', True),
    ({"type": "quotation"}, '  "He said "hi" to me."  ', True),  # quotes inside quotes: only the ends matter
    ({"type": "quotation"}, '"', False),
    ({"type": "quotation"}, '"The sea is calm."\nBye', False),
    ({"type": "quotation"}, "\u201cCurly quotes\u201d", False),  # IFEval asks for the ASCII double quote
    ({"type": "number_bullets", "num": 2}, "* first\n* second", True),
    ({"type": "number_bullets", "num": 2}, "Intro\n  * first\n- second\n", True),  # indented, dash bullets count
    ({"type": "number_bullets", "num": 2}, "* first\n* second\n* third", False),
    ({"type": "number_bullets", "num": 2}, "**Bold** line\n* first\n* second", True),  # '**' is not a bullet
    ({"type": "number_bullets", "num": 2}, "1. first\n2. second", False),
    ({"type": "keyword_frequency", "keyword": "sea", "relation": "at least", "num": 2}, "The Sea and the sea.", True),
    ({"type": "keyword_frequency", "keyword": "sea", "relation": "at least", "num": 2}, "The season.", False),
    # a regex: substrings count
    ({"type": "keyword_frequency", "keyword": "sea", "relation": "at least", "num": 2}, "The season by the sea.", True),
    ({"type": "keyword_frequency", "keyword": "sea", "relation": "less than", "num": 2}, "The sea.", True),
    ({"type": "keyword_frequency", "keyword": " sea ", "relation": "at least", "num": 2}, "The sea and the sea.", True),
    ({"type": "title"}, "<<Ode to the Sea>>\nThe waves...", True),
    ({"type": "title"}, "<<>> nothing inside", False),
    ({"type": "title"}, "<<broken\ntitle>>", False),
    ({"type": "title"}, "<<><>>", True),  # IFEval strips '<' from the left, '>' from the right: '><' is left
    ({"type": "postscript", "marker": "P.S."}, "Body.\nP.S. See you.", True),
    ({"type": "postscript", "marker": "P.S."}, "Body.\np. s. see you.", True),
    ({"type": "postscript", "marker": "P.S."}, "Body with no postscript.", False),
    ({"type": "postscript", "marker": "P.S."}, "Body. P.S. inline", True),  # anywhere, not only at a line's start
    ({"type": "postscript", "marker": "P.P.S"}, "Body.\nP. P. S later", True),
    ({"type": "postscript", "marker": " P.S. "}, "Body.\np. s. hi", True),  # the marker is stripped
    ({"type": "postscript", "marker": "p.s."}, "Body.\npxsx hi", True),  # not "P.S.": a regex, '.' any character
    ({"type": "postscript", "marker": "p.s."}, "Body.\np. s. hi", False),
    ({"type": "forbidden_words", "words": ["storm", "wave"]}, "A calm day; waves rolled in.", True),  # whole words only
    ({"type": "forbidden_words", "words": ["storm", "wave"]}, "A Storm came.", False),
    ({"type": "forbidden_words", "words": ["e.g", "very"]}, "eXg is odd", False),  # a word is a regex, as in IFEval
    ({"type": "highlighted_sections", "num": 2}, "*one* and **two** here", True),
    ({"type": "highlighted_sections", "num": 2}, "*one* and ** ** here", False),
    ({"type": "highlighted_sections", "num": 1}, "no highlights", False),
]


@pytest.mark.parametrize("constraint, reply, met", CASES)
def test_each_constraint_type_by_hand(constraint, reply, met):
    assert F.check(constraint, reply) is met


def test_every_type_is_tested_and_described():
    assert {c["type"] for c, _, _ in CASES} == set(F.CHECKS) == set(F.PARAMS) == set(F.DESCRIPTIONS)
    for c, _, _ in CASES:
        assert F.describe(c)


def test_reward_is_the_fraction_met():
    cs = [{"type": "lowercase"}, {"type": "no_comma"}, {"type": "number_words", "relation": "less than", "num": 3}]
    assert F.reward(cs, "hi there") == 1.0
    assert F.reward(cs, "Hi, there") == pytest.approx(1 / 3)
    assert F.reward(cs, "Hi, there you all") == 0.0


@pytest.mark.parametrize("constraints, message", [
    ([], "must be a non-empty list"),
    ("lowercase", "must be a non-empty list"),
    ([{"type": "shout"}], "constraints[0]: unknown constraint"),
    ([{"type": "number_words", "num": 3}], "constraints[0] (number_words) needs relation"),
    ([{"type": "number_words", "num": 3, "relation": "at most"}], "relation 'at most' is not one of less than, at least"),
    ([{"type": "forbidden_words", "words": ["ok", "oops("]}], "constraints[0] (forbidden_words): 'oops(' is not a regex"),
    ([{"type": "keyword_frequency", "keyword": "(", "relation": "at least", "num": 1}], "'(' is not a regex"),
])
def test_malformed_constraints_are_one_line(constraints, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        F.validate(constraints, "data.jsonl:3")
