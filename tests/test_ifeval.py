"""dataset/ifeval.py: each constraint type against hand-written replies, edge cases included (unicode, trailing
spaces, quotes inside quotes, bullet styles), the reward, and one-line errors for malformed constraints."""

from __future__ import annotations

import re

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
    # The types added beside the first twelve (tests/test_ifeval_reference.py: Google's checker gives the same).
    ({"type": "uppercase"}, "THE CAFÉ WAS QUIET.", True),
    ({"type": "uppercase"}, "THE SEA IS cALM TODAY.", False),
    ({"type": "uppercase"}, "123 456", False),  # str.isupper(): some cased letter
    ({"type": "uppercase"}, "ÉTÉ À PARIS EST TRÈS BEAU ET CHAUD.", True),  # not English: IFEval's langdetect says no
    ({"type": "number_paragraphs", "num": 2}, "one\n***\ntwo", True),
    ({"type": "number_paragraphs", "num": 2}, "***\none\n***\ntwo\n***", True),  # blank ends do not count
    ({"type": "number_paragraphs", "num": 2}, "one\n****\ntwo", True),  # '***' then '*two'
    ({"type": "number_paragraphs", "num": 2}, "one\n***\n***\ntwo", False),  # a blank paragraph between dividers
    ({"type": "number_paragraphs", "num": 2}, "one\n* * *\ntwo", False),
    ({"type": "number_paragraphs", "num": 2}, "one\n\ntwo", False),  # blank lines are not the divider here
    ({"type": "paragraph_first_word", "num": 2, "nth": 2, "word": "Sea"}, "Intro.\n\nsea, calm.", True),
    ({"type": "paragraph_first_word", "num": 2, "nth": 2, "word": "Sea"}, "Intro.\n\n'\"Sea is calm.", True),  # ' then "
    ({"type": "paragraph_first_word", "num": 2, "nth": 2, "word": "Sea"}, "Intro.\n\n\"'Sea is calm.", False),
    ({"type": "paragraph_first_word", "num": 2, "nth": 2, "word": "Sea"}, "Intro.\n\nSea-side is calm.", False),
    ({"type": "paragraph_first_word", "num": 2, "nth": 2, "word": "Sea"}, "Intro.\n\n\n\nSea is calm.", False),  # a blank piece
    ({"type": "paragraph_first_word", "num": 2, "nth": 2, "word": "Sea"}, "Intro.\n\nSea.\n\nOutro.", False),
    ({"type": "paragraph_first_word", "num": 1, "nth": 1, "word": "ΟΔΟΣ"}, "ΟΔΟΣ είναι", False),  # lowered per letter: σ, not ς
    ({"type": "paragraph_first_word", "num": 1, "nth": 1, "word": "ΟΔΟΣ"}, "οδος είναι", True),
    ({"type": "start_phrase", "phrase": "My answer is"}, "MY ANSWER IS", True),
    ({"type": "start_phrase", "phrase": "My answer is"}, '"My answer is yes."', False),
    ({"type": "repeat_prompt", "request": "Write a short note about the sea."}, "write a short note about the sea.\nIt is blue.", True),
    ({"type": "repeat_prompt", "request": "Write a short note about the sea."}, "Sure! Write a short note about the sea.", False),
    ({"type": "sections", "splitter": "Section", "num": 2}, "Section 1\nabout\nSection 2\nmore", True),
    ({"type": "sections", "splitter": "Section", "num": 2}, "SECTION 1\na\nSECTION 2\nb", False),  # case-sensitive
    ({"type": "sections", "splitter": "Section", "num": 2}, "Section1 a Section2 b", True),
    ({"type": "sections", "splitter": "Section", "num": 2}, "Section  1 a Section 2 b", False),  # one space at most
    ({"type": "sections", "splitter": "Part|Chapter", "num": 2}, "Part 1 a Chapter 2 b", True),  # a regex
    ({"type": "json"}, '```json\n{"a": 1}\n```', True),
    ({"type": "json"}, '```json```{"a": 1}', True),  # the fences come off one after the other
    ({"type": "json"}, "NaN", True),  # Python's json.loads, as IFEval
    ({"type": "json"}, "{'a': 1}", False),
    ({"type": "json"}, '```python\n{}\n```', False),
    ({"type": "json"}, "[" * 100_000 + "]" * 100_000, False),  # past the parser's depth (Google's checker raises)
    ({"type": "constrained_response"}, "Well... My answer is maybe. Because.", True),
    ({"type": "constrained_response"}, "my answer is no.", False),
    ({"type": "constrained_response"}, "My answer is yes!", False),
    ({"type": "placeholders", "num": 2}, "[name] lives at [address].", True),
    ({"type": "placeholders", "num": 2}, "[] and []", True),
    ({"type": "placeholders", "num": 2}, "[a\nb] [c]", False),
    ({"type": "placeholders", "num": 2}, "[[nested]]", False),
    ({"type": "two_responses"}, "The sea is calm.\n******\nThe sea is wild.", True),
    ({"type": "two_responses"}, "one ****** one ", False),  # the same once stripped
    ({"type": "two_responses"}, "******one******two******", True),
    ({"type": "two_responses"}, "one\n******\n\n******\ntwo", False),  # nothing between two separators
    ({"type": "two_responses"}, "one ************ two", False),
    ({"type": "include_keywords", "words": ["sea", "storm"]}, "The SEA and a STORM", True),
    ({"type": "include_keywords", "words": ["sea", "storm"]}, "the season of brainstorms", True),  # inside words too
    ({"type": "include_keywords", "words": ["sea", "storm"]}, "storm only", False),
    ({"type": "letter_frequency", "letter": "e", "relation": "at least", "num": 3}, "EeE", True),
    ({"type": "letter_frequency", "letter": "e", "relation": "at least", "num": 3}, "éée", False),
    ({"type": "letter_frequency", "letter": "Z", "relation": "less than", "num": 2}, "Z", True),
    ({"type": "letter_frequency", "letter": "i", "relation": "at least", "num": 2}, "İİ", True),  # 'İ'.lower() is 'i' + a dot
]


@pytest.mark.parametrize("constraint, reply, met", CASES)
def test_each_constraint_type_by_hand(constraint, reply, met):
    assert F.check(constraint, reply) is met


def test_every_type_is_tested_described_and_named_as_ifeval_names_it():
    assert {c["type"] for c, _, _ in CASES} == set(F.CHECKS) == set(F.PARAMS) == set(F.DESCRIPTIONS) == set(F.IFEVAL)
    for c, _, _ in CASES:
        assert F.describe(c) and F.validate([c], "case") == [c]
    # 22 of IFEval's 25 instructions (start_phrase is checked by repeat_prompt's), the other 3 left out with a reason
    assert len(set(F.IFEVAL_IDS.values())) == 22 and len(F.LEFT_OUT) == 3
    assert not set(F.IFEVAL_IDS.values()) & set(F.LEFT_OUT)


def test_constraints_as_googles_checker_takes_them():
    ids, kwargs = F.ifeval_instructions([
        {"type": "number_words", "relation": "at least", "num": 10}, {"type": "start_phrase", "phrase": "I think"},
        {"type": "paragraph_first_word", "num": 3, "nth": 2, "word": "the"}, {"type": "postscript"}])
    assert ids == ["length_constraints:number_words", "combination:repeat_prompt", "length_constraints:nth_paragraph_first_word",
                   "detectable_content:postscript"]
    assert kwargs == [{"num_words": 10, "relation": "at least"}, {"prompt_to_repeat": "I think"},
                      {"num_paragraphs": 3, "nth_paragraph": 2, "first_word": "the"}, {"postscript_marker": "P.S."}]


def test_a_blank_reply_meets_nothing_as_in_ifevals_strict_evaluation():
    cs = [{"type": "no_comma"}, {"type": "number_words", "relation": "less than", "num": 3}]
    assert F.check(cs[0], "  \n") is True  # the check itself, as Google's check_following
    assert F.results(cs, "  \n") == [("no_comma", False), ("number_words", False)] and F.reward(cs, "") == 0.0


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
    # parameters IFEval's build_description would replace by a random draw, or that can never be met
    ([{"type": "number_bullets", "num": -1}], "constraints[0] (number_bullets): num must be a whole number >= 0, got -1"),
    ([{"type": "number_bullets", "num": "3"}], "num must be a whole number >= 0, got '3'"),
    ([{"type": "number_bullets", "num": True}], "num must be a whole number >= 0, got True"),
    ([{"type": "no_comma", "num": 3}], "constraints[0] (no_comma): unknown parameter 'num'; it takes none"),
    ([{"type": "postscript", "markr": "P.S."}], "unknown parameter 'markr'; it takes marker"),
    ([{"type": "end_phrase", "phrase": "  "}], "phrase must be a non-empty string"),
    ([{"type": "repeat_prompt", "request": ""}], "request must be a non-empty string"),
    ([{"type": "forbidden_words", "words": []}], "words must be a non-empty list of non-empty strings"),
    ([{"type": "include_keywords", "words": "sea"}], "words must be a non-empty list of non-empty strings"),
    ([{"type": "include_keywords", "words": ["sea", "[a-"]}], "'[a-' is not a regex"),
    ([{"type": "letter_frequency", "letter": "ab", "relation": "at least", "num": 2}], "letter must be one ASCII letter"),
    ([{"type": "letter_frequency", "letter": "é", "relation": "at least", "num": 2}], "letter must be one ASCII letter"),
    ([{"type": "paragraph_first_word", "num": 2, "nth": 3, "word": "the"}], "nth must be between 1 and num (2), got 3"),
    ([{"type": "paragraph_first_word", "num": 2, "nth": 0, "word": "the"}], "nth must be between 1 and num (2), got 0"),
    ([{"type": "paragraph_first_word", "num": 2, "nth": 1, "word": "don't"}], "word must be one word"),
    ([{"type": "paragraph_first_word", "num": 2, "nth": 1, "word": "two words"}], "word must be one word"),
    ([{"type": "sections", "splitter": "Section(", "num": 2}], "(sections): 'Section(' is not a regex"),
    ([{"type": "sections", "num": 2}], "(sections) needs splitter"),
])
def test_malformed_constraints_are_one_line(constraints, message):
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        F.validate(constraints, "data.jsonl:3")
    assert str(e.value).startswith("data.jsonl:3: ") and "\n" not in str(e.value)


def test_partial_credit_measures_how_close_an_unmet_constraint_comes():
    up, rep = {"type": "uppercase"}, {"type": "repeat_prompt", "request": "Write a note about owls."}
    assert F.partial_credit([up], "ABCd") == pytest.approx(0.75)  # 3 of 4 cased letters are capitals
    assert F.partial_credit([up], "ABC!") == 0.0 and F.reward([up], "ABC!") == 1.0  # met: the verdict counts, not this
    assert F.partial_credit([rep], "write a note about cats.") == pytest.approx(4 / 5)  # 4 of 5 words, in order
    assert F.partial_credit([rep], "Hello. Write a note about owls.") == 0.0  # not an opening
    assert F.partial_credit([{"type": "two_responses"}], "one ****** one") == 0.5  # separator, same answers: unmet
    assert F.partial_credit([{"type": "no_comma"}, up], "a, b") == 0.0  # no closeness for no_comma; "a, b" no capitals
    assert F.partial_credit([{"type": "no_comma"}, up], "A, B") == 0.0  # uppercase met: 0 for it, no_comma none
    assert F.partial_credit([up], "   ") == 0.0 and F.partial_credit([], "ABC") == 0.0
    assert set(F.CLOSENESS) <= set(F.CHECKS)


def test_partial_credit_stays_below_a_pass():
    """An unmet constraint earns less than a met one, however close: 'Ab' is 1/2 uppercase, 'A'*999+'b' almost all."""
    assert F.partial_credit([{"type": "uppercase"}], "A" * 999 + "b") < 1.0
