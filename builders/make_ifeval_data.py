"""Write verifiable instruction-following prompts (IFEval's constraint types, dataset/ifeval.py) as RLAIF jsonl:
a short writing request on a topic plus one or two constraints, each row carrying its constraints for the reward
and, for Google's checker, the same as IFEval's instruction ids and kwargs.

    python builders/make_ifeval_data.py       # the five files below, in dataset/
    python builders/make_ifeval_data.py --train_wordings_per_type 3 --out_dir out/   # out/ifeval_train_w3.jsonl only

- ifeval_train.jsonl (2,000 rows) and ifeval_eval.jsonl (300 held-out rows): every type we train, equally often,
  each constraint worded either as IFEval words it (its build_description for the row's arguments) or in one of
  our own phrasings (about half each).
- ifeval_eval_seen_wording.jsonl (220 held-out rows): IFEval's 22 instructions that we train, in IFEval's
  description sentence only (start_phrase, which has none, is not in it). In-distribution: the round-3 training
  files use that very sentence (51% of these prompts equal a training prompt once the topic is masked), so a gain
  here is a gain on seen wording, not on IFEval's test prompts (named ifeval_eval_ifeval_wording.jsonl until #72).
- ifeval_eval_heldout_wording.jsonl (300 held-out rows): every type, each constraint worded only in the held-out
  family of WORDINGS (below), sentences that no training row uses (tests/test_ifeval_wordings.py compares the
  templates with their slot values stripped): what a gain is worth on instructions a user words in their own way.
- ifeval_eval_other_types.jsonl (60 held-out rows): the three IFEval instructions we do not train (nor can check:
  dataset/ifeval.py LEFT_OUT), one per row, in IFEval's wording, without "constraints": for scripts/judge_ifeval.py.

Each row: "conversations" (the user turn and an empty assistant slot), "constraints" (ours), "prompt" (the user
turn), "instruction_id_list" and "kwargs" (Google's, IFEval's input_data format) and "wording" ("ifeval" or "ours"
per constraint; in the held-out-wording file "heldout", with the wording id of each under "template").

Wordings: each type has a training family (IFEval's sentence, our first 2-3 PHRASINGS, and WORDINGS' "train"
templates: 10 or more) and a held-out family (WORDINGS' "heldout": 6), in several voices (terse, polite, statements
of a rule, clauses folded into the request or joined with another constraint's, before or after the request,
numbers in digits and in words, negated and positive forms, a user's typos). The shipped training file uses
IFEval's sentence and PHRASINGS only, as before the families were added; `--train_wordings_per_type N` writes a
training file worded by the first N of each training family instead (the same requests and constraints for every
N), for the curve of the held-out-wording gain against N (docs/smollm2_ifeval.md).

Train and held-out rows draw their topics from disjoint lists, so a held-out gain is not a memorised topic. Two
constraints in one row never contradict each other (e.g. quotation marks around the whole reply and a phrase it
must end with). The same seed writes the same files; nothing here imports if-verifiable
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


# ------------------------------------------------------------------------------------------------ wording families
# Beside IFEval's sentence ("ifeval") and PHRASINGS ("ours/k"), each type has new sentences in two families: "train/k"
# (may be used for training: --train_wordings_per_type) and "heldout/k" (never trained on: the held-out-wording file).
# A template is a str.format string over slots(c) (below); one that starts with "~" is a clause (lower case, no final
# stop) that a row may fold into its request ("Write a note about owls, keeping it lowercase.") or join with another
# clause in one sentence. Voices: terse, polite, clauses, statements of a rule, negated and positive forms, numbers in
# digits and in words, a user's typos ("heldout" only carries typos, in their fixed words, never in a slot's value).
_RESP = '"My answer is yes.", "My answer is no." or "My answer is maybe."'
WORDINGS: dict[str, dict[str, list[str]]] = {
    "lowercase": {
        "train": ["All lowercase, please.", "~keep every letter lowercase",
                  "Could you write it without using any uppercase letters?", "Lowercase only.",
                  "Please make sure there isn't a single capital letter in what you write.", "~write it all in small letters"],
        "heldout": ["No caps anywhere, not even at the start of a sentence.", "~stick to lower-case characters from start to finish",
                    "I'd appreciate it if every character you type were lower case.", "Capital letters are off limits here.",
                    "pls writ evrything in lowercase", "Kindly avoid upper-case characters entirely; names stay small too."]},
    "uppercase": {
        "train": ["ALL CAPS, please.", "~write every word in capital letters", "Could you answer entirely in uppercase?",
                  "Capitals only.", "Please don't use any lowercase letters.", "~type the whole thing in block capitals"],
        "heldout": ["Shout it: each letter has to be a capital.", "~keep all the letters upper-case throughout",
                    "I'd like the full response in caps lock style, no small letters whatsoever.",
                    "Lower-case letters are not permitted in this one.", "pls answr in all caps",
                    "Make each and every letter uppercase, thanks!"]},
    "number_words": {
        "train": ["Word count: {bound}.", "~use {bound_w} words", "Please write {over} words.",
                  "The response must contain {nobound} words.", "~make it {over_w} words long",
                  "Could you keep the length to {bound} words?", "Length: {over_w} words."],
        "heldout": ["Aim for {nobound_w} words in total.", "~let the word count be {bound_w}",
                    "I need {nobound} words from you, please.", "wrd limit: {bound} wrds",
                    "~write {over_w} words overall", "The reply has a length requirement of {bound_w} words."]},
    "number_paragraphs": {
        "train": ["{num_W} paragraphs, split by ***.", "~write {num} paragraphs with *** between each pair",
                  "Please use {num_w} paragraphs and put the divider *** between them.", "Paragraph count: {num}; divider: ***.",
                  "Could you break it into {num} paragraphs, each separated by ***?",
                  "~split the text into {num_w} paragraphs using *** as the separator",
                  "Exactly {num_w} paragraphs please, with a *** line dividing them."],
        "heldout": ["Give me {num_w} blocks of text, and between consecutive blocks place three asterisks (***).",
                    "~lay it out as {num} paragraphs divided by ***",
                    "I want {num} paragraphs; the only thing between two of them should be ***.",
                    "Structure: {num_w} paragraphs, markdown separator *** in between.",
                    "{num} paragrphs pls, seperated with ***", "Kindly produce {num_w} paragraphs, marking each break with ***."]},
    "paragraph_first_word": {
        "train": ["Use {num} paragraphs separated by a blank line; paragraph {nth} begins with \"{word}\".",
                  "~write {num_w} paragraphs with an empty line between them, and start the {nth_ord} one with the word {word}",
                  "Please write {num_w} paragraphs (blank line between each), the {nth_ord} opening with \"{word}\".",
                  "Paragraphs: {num}, split by blank lines. Paragraph {nth} starts with {word}.",
                  "Could you give {num} paragraphs separated by empty lines, where the {nth_ord} paragraph's first word is {word}?",
                  "~split it into {num} blank-line-separated paragraphs and open paragraph {nth} with \"{word}\"",
                  "{num_W} paragraphs, blank lines between them, paragraph number {nth} starting with '{word}'."],
        "heldout": ["I need {num_w} paragraphs divided by single empty lines, and the first word of paragraph {nth} has to be \"{word}\".",
                    "~make paragraph {nth} of {num} begin with the word \"{word}\", leaving a blank line between paragraphs",
                    "Lay out {num} paragraphs (one empty line apart); kick off the {nth_ord} of them with {word}.",
                    "{num} paragrahs with a blank line betwen them, and the {nth_ord} one startin with \"{word}\"",
                    "Kindly write {num_w} paragraphs with one blank line after each but the last, the word \"{word}\" "
                    "opening paragraph {nth}.",
                    "Format: {num_w} paragraphs, blank line in between; paragraph {nth}'s opening word = {word}."]},
    "no_comma": {
        "train": ["No commas.", "~leave out all commas", "Please don't put a comma anywhere.", "Commas are not allowed.",
                  "Could you write this with zero commas?", "~keep your text free of commas"],
        "heldout": ["Skip the commas entirely, thanks!", "~do it without any comma at all",
                    "I'd like the response to contain not even one comma.",
                    "Punctuation rule: periods are fine but the comma character must never appear.", "dont use comas pls",
                    "Zero commas allowed in the output."]},
    "end_phrase": {
        "train": ["End with: \"{phrase}\"", "~close with the exact phrase \"{phrase}\"",
                  "Please make \"{phrase}\" the very last thing you write.",
                  "The final words must be \"{phrase}\", with nothing after.", "Could you conclude with exactly this: {phrase}",
                  "~finish on the words \"{phrase}\" and add nothing after them"],
        "heldout": ["Wrap up with the sentence \"{phrase}\" and let nothing come after it.",
                    "~sign off with \"{phrase}\" as your closing line", "I want your last line to read exactly: {phrase}",
                    "Ending: {phrase} (verbatim, nothing following).", "finsh ur answer with \"{phrase}\" and stop there",
                    "Kindly let \"{phrase}\" be the concluding words of the reply."]},
    "start_phrase": {
        "train": ["Start with \"{phrase}\".", "~open with the exact words \"{phrase}\"", "Please begin your answer with: {phrase}",
                  "The first words must be \"{phrase}\".", "Could you start your reply with \"{phrase}\"?",
                  "~let your response begin with \"{phrase}\"", "Opening words: {phrase}",
                  "Make \"{phrase}\" the first thing you write."],
        "heldout": ["Kick off your reply with the phrase \"{phrase}\", exactly as written.", "~lead with the words \"{phrase}\"",
                    "I'd like the very first words you type to be: {phrase}", "Beginning: \"{phrase}\", no greeting before it.",
                    "strat ur reply with \"{phrase}\" pls", "Kindly put \"{phrase}\" at the very beginning of the response."]},
    "repeat_prompt": {  # sentences only: the request to repeat is everything before it
        "train": ["Repeat the request above exactly, then answer it (do not repeat this sentence).",
                  "Please restate my request word for word first, leaving out this sentence, and then respond.",
                  "First copy the request above verbatim (not this instruction), then answer.",
                  "Echo the request above unchanged, excluding this line, before your answer.",
                  "Could you begin by repeating the request above exactly as written, without this sentence, and then answer it?",
                  "Say the request above back to me verbatim first (this sentence excluded), then reply.",
                  "Step 1: repeat the request above word for word, without this instruction. Step 2: answer it."],
        "heldout": ["Open by writing my request above again, character for character (but not this line), and only afterwards reply to it.",
                    "I'd like you to reproduce the request above unchanged as your first words, skipping this sentence, then respond.",
                    "Before you answer, write out the exact request you were given above, minus this final instruction.",
                    "repeat my request above exacly first (not this bit), then anwser it",
                    "Kindly start with a faithful copy of the text above this sentence, and follow it with your answer.",
                    "Your opening must be the request above, reproduced without any change and without this sentence; "
                    "the answer comes after."]},
    "quotation": {
        "train": ["Answer in double quotes.", "~put the entire response between double quotation marks",
                  "Please surround your whole reply with \" marks.", "The whole reply must begin and end with a double quote (\").",
                  "Could you wrap everything you write in double quotes?", "~enclose all of it in \"double quotes\"",
                  "Double quotes around the full answer, please."],
        "heldout": ["Your output should start with the character \" and end with the character \".",
                    "~make the first and last characters of your reply double quotation marks",
                    "I'd like the complete response placed inside a pair of double quotes.",
                    "Format: one opening \" at the very start, one closing \" at the very end.",
                    "put the hole thing in double qoutes", "Kindly bracket the full text with quotation marks (\"like this\")."]},
    "number_bullets": {
        "train": ["{num_W} bullet points, using *.", "~list exactly {num} points as markdown bullets (* )",
                  "Please answer with exactly {num_w} bullets, each line starting with *.",
                  "Bullet count: exactly {num}. Use * for each.",
                  "Could you give me exactly {num} bullet points in markdown (* item)?", "~use exactly {num_w} \"* \" bullet lines"],
        "heldout": ["Present it as a bulleted list with precisely {num_w} entries, every entry on a line that begins with an asterisk.",
                    "~give {num} markdown bullets, no more and no fewer",
                    "I want a list of {num} items, each introduced by \"* \", and nothing else formatted as a list.",
                    "Layout: exactly {num_w} lines beginning with * (markdown bullets).",
                    "exactly {num} bulet points pls, with * at the start of each",
                    "Kindly break it down into {num_w} asterisk bullets, not one more, not one less."]},
    "highlighted_sections": {
        "train": ["Highlight {num}+ parts with *asterisks*.", "~mark at least {num_w} phrases in italics with *single asterisks*",
                  "Please emphasise at least {num} spans like *this*.", "At least {num} highlighted sections, markdown style (*text*).",
                  "Could you highlight at least {num_w} bits of the text using *...*?",
                  "~wrap at least {num} key phrases in asterisks, e.g. *key phrase*", "Use *emphasis* on at least {num_w} phrases."],
        "heldout": ["Make no fewer than {num_w} phrases stand out by surrounding them with single asterisks, as in *example*.",
                    "~italicise {num} or more fragments using markdown asterisks (*like so*)",
                    "I'd like {num} or more pieces of the text emphasised with *stars*.",
                    "Emphasis requirement: minimum {num} spans wrapped as *...*.", "highlite at least {num} parts with *stars* pls",
                    "Kindly set off at least {num_w} passages in markdown italics (*passage*)."]},
    "sections": {
        "train": ["{num_W} sections, each headed \"{splitter} N\".",
                  "~divide it into {num} sections titled {splitter} 1, {splitter} 2, and so on",
                  "Please organise the answer into {num_w} sections, marking each with {splitter} followed by its number.",
                  "Sections: {num}, labelled \"{splitter} 1\", \"{splitter} 2\", ...",
                  "Could you split the reply into {num} parts headed {splitter} 1, {splitter} 2 and so forth?",
                  "~start each of {num_w} sections with the label {splitter} X (X = its number)",
                  "Use {num} numbered sections: {splitter} 1, {splitter} 2..."],
        "heldout": ["Break your text into {num_w} chunks, and put a heading line like \"{splitter} 1\" above each chunk (counting up).",
                    "~give {num} headed parts, the headings reading {splitter} 1, {splitter} 2 etc.",
                    "I want {num_w} separate sections; label them in order: {splitter} 1, then {splitter} 2, onward.",
                    "Structure: {num} parts, each introduced by the marker \"{splitter}\" plus a number.",
                    "{num} sectons pls, startin each with its header ({splitter} 1, then {splitter} 2, ...)",
                    "Kindly number your {num_w} sections with headers of the form {splitter} N."]},
    "title": {
        "train": ["Title in <<double angle brackets>>.", "~add a title wrapped in << >>", "Please give it a title like <<Title Here>>.",
                  "Include a title formatted as <<...>>.",
                  "Could you put a title at the top in double angular brackets, e.g. <<A Title>>?", "~begin with a <<title>> line",
                  "Needs a title: <<like this>>."],
        "heldout": ["Head the reply with a name for it enclosed by << and >>.",
                    "~include a heading surrounded by double chevrons, for example <<Morning Light>>",
                    "I'd like a title somewhere, written between << and >>.", "Title format: <<your title>>, on its own line.",
                    "giv it a titel in <<these brackets>>", "Kindly supply a heading between double chevrons (<<heading>>)."]},
    "json": {
        "train": ["JSON only.", "~answer in JSON format", "Please format the whole reply as JSON.", "Output must be valid JSON.",
                  "Could you give your answer as a JSON object?", "~return everything as a single JSON value",
                  "Respond in JSON, nothing outside it."],
        "heldout": ["Give me machine-readable output: one JSON document and no prose around it.",
                    "~encode your entire answer as JSON (e.g. {{\"text\": \"...\"}})",
                    "I need the reply to parse with a JSON parser, start to finish.",
                    "Output format: JSON. Markdown code fences are okay.", "reply in jason format only pls (JSON)",
                    "Kindly structure the complete response as a JSON object with keys of your choice."]},
    "constrained_response": {
        "train": [f"Answer: {_RESP}", f"~reply using one of {_RESP}",
                  "Please pick one: My answer is yes. / My answer is no. / My answer is maybe.", f"Choose from {_RESP}",
                  f"Could you answer with {_RESP}?",
                  "Only these answers are allowed: My answer is yes. | My answer is no. | My answer is maybe.",
                  "Respond with one of the three: \"My answer is yes.\" / \"My answer is no.\" / \"My answer is maybe.\""],
        "heldout": [f"Your reply has to include one of these exact sentences: {_RESP}",
                    "~settle it by writing just one of these three sentences: " + " / ".join(f'"{o}"' for o in RESPONSE_OPTIONS),
                    f"I only accept {_RESP} as the answer.",
                    "Allowed responses (verbatim): My answer is yes. ; My answer is no. ; My answer is maybe.",
                    "pick one: \"My answer is yes.\" or \"My answer is no.\" or \"My answer is maybe.\" thx",
                    f"Kindly state your verdict as exactly {_RESP}"]},
    "placeholders": {
        "train": ["Include {num}+ [placeholders].", "~add at least {num_w} square-bracket placeholders such as [city]",
                  "Please leave at least {num} placeholders in brackets, like [date].", "At least {num} placeholders, written [like this].",
                  "Could you include at least {num} fill-in fields in square brackets (e.g. [name])?",
                  "~use [placeholder] slots at least {num} times", "Minimum placeholders: {num}, each in [square brackets]."],
        "heldout": ["Put {num_w} or more template fields into the text, each written inside square brackets, e.g. [your name].",
                    "~insert no fewer than {num} bracketed blanks like [time] for me to fill in",
                    "I'd like {num} or more [bracketed] gaps that a reader could fill in later.",
                    "Template requirement: a minimum of {num_w} fields in [brackets].", "add at lest {num} placeholers in [brackets] pls",
                    "Kindly include {num} or more square-bracket placeholders, for example [address]."]},
    "postscript": {
        "train": ["Add a {marker} at the end.", "~finish with a postscript beginning {marker}",
                  "Please include a postscript starting with \"{marker}\".", "Postscript required: start it with {marker}",
                  "Could you end with a {marker} note?", "~close with a short {marker} line", "Add a final line that starts with {marker}"],
        "heldout": ["After the main text, tack on an afterthought introduced by {marker}", "~append a {marker} afterthought at the bottom",
                    "I'd like one more line at the very bottom, opening with \"{marker}\".",
                    "Closing note format: {marker} followed by anything you like.", "pls put a {marker} at teh bottom",
                    "Kindly conclude with a postscript, marked {marker}"]},
    "two_responses": {
        "train": ["Two answers, separated by ******.", "~give two different responses split by six asterisks (******)",
                  "Please write two versions, with ****** between them.", "Two distinct replies; separator: ******",
                  "Could you provide two alternative answers divided by a line of ******?",
                  "~offer two separate answers with ****** in between",
                  "Write it twice, differently, separating the two with ******."],
        "heldout": ["Draft a pair of different replies with exactly six asterisks (******) in the middle and nowhere else.",
                    "~produce two distinct takes, the separator being ******",
                    "I want two unlike responses, joined only by the string ******.",
                    "Format: response A, then ******, then response B (A and B must differ).",
                    "two diffrent answers pls, with ****** betwen them",
                    "Kindly provide two contrasting responses divided by six stars: ******."]},
    "keyword_frequency": {
        "train": ["Say \"{keyword}\" {bound} times.", "~use the word {keyword} {bound_w} times",
                  "Please mention \"{keyword}\" {bound} times.", "The word \"{keyword}\" must appear {bound_w} times.",
                  "Could you use \"{keyword}\" {nobound} times?", "~repeat the word \"{keyword}\" {bound} times",
                  "Word \"{keyword}\": {bound} times."],
        "heldout": ["Work the word \"{keyword}\" into the text {nobound_w} times.", "~let \"{keyword}\" show up {bound_w} times",
                    "I want {keyword} to turn up {nobound} times in what you send back.",
                    "Frequency rule: \"{keyword}\" {cmp} {num} occurrences.", "use the wrd \"{keyword}\" {bound} times pls",
                    "Kindly ensure {keyword} occurs {bound_w} times."]},
    "include_keywords": {
        "train": ["Include: {words_and}.", "~work in the word{s} {words_q}", "Please use the word{s} {words_q}.",
                  "Required word{s}: {words_and}.", "Could you include the word{s} {words_q} somewhere?",
                  "~mention {words_and} at least once", "Must contain {words_q}."],
        "heldout": ["Somewhere in the text, drop in {words_q}.", "~make room for the term{s} {words_and} in your writing",
                    "I expect to find {words_q} in the reply.", "Keywords to cover: {words_and}.", "pls use {words_q} somwhere",
                    "Kindly weave {words_and} into what you write."]},
    "forbidden_words": {
        "train": ["Banned words: {words_and}.", "~don't use {words_q}", "Please avoid saying {words_or}.",
                  "The words {words_q} are not allowed.", "Could you write this without the words {words_and}?",
                  "~steer clear of {words_and}"],
        "heldout": ["Leave {words_q} out of your vocabulary for this one.", "~never write {words_or}",
                    "I'd rather you didn't use {words_or} at all.", "Forbidden: {words_q}.", "dont say {words_or} in ur answer",
                    "Kindly refrain from the terms {words_and}."]},
    "letter_frequency": {
        "train": ["Letter {letter}: {bound} times.", "~use the letter {letter} {bound_w} times",
                  "Please make the letter \"{letter}\" appear {bound} times.", "The letter {letter} should occur {nobound} times.",
                  "Could you use the letter '{letter}' {bound} times?", "~include the letter {letter} {nobound_w} times",
                  "Count of letter {letter}: {over}."],
        "heldout": ["Type the character \"{letter}\" {nobound_w} times across the whole reply.",
                    "~have the letter {letter} show up {bound} times in total", "I'd like the letter {letter} to appear {over} times.",
                    "Letter budget: \"{letter}\" {cmp} {num}.", "use the leter {letter} {bound} times",
                    "Kindly keep the number of {letter}'s {bound_w}."]},
}

LAYOUTS = ("after", "after", "before", "inline")  # where a row's constraints go: after its request (half the rows),
# before it, or folded into its sentence (its clauses; sentences still follow the request)
_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
         "seventeen eighteen nineteen").split()
_TENS = {2: "twenty", 3: "thirty", 4: "forty", 5: "fifty", 6: "sixty", 7: "seventy", 8: "eighty", 9: "ninety"}


def in_words(n: int) -> str:
    """n in English words (0-99; digits otherwise): 49 -> "forty-nine"."""
    if 0 <= n < 20:
        return _ONES[n]
    if 20 <= n < 100:
        tens, ones = divmod(n, 10)
        return _TENS[tens] + (f"-{_ONES[ones]}" if ones else "")
    return str(n)


def slots(c: dict) -> dict[str, str]:
    """The values a WORDINGS template may name, for constraint c. A relation is said exactly: "less than 40" is
    "at most 39" (bound), "no more than 39" (nobound), "under 40" (over); "at least 10" is "at least 10", "no fewer
    than 10", "more than 9"; _w: the number in words."""
    s = {k: str(c[k]) for k in ("phrase", "keyword", "letter", "marker", "splitter", "word", "nth") if k in c}
    if "nth" in c:
        s["nth_ord"] = _ORDINAL.get(c["nth"], f"number {c['nth']}")
    if "num" in c:
        n = c["num"]
        s.update(num=str(n), num_w=in_words(n), num_W=in_words(n).capitalize())
        if "relation" in c:
            lt = c["relation"] == "less than"
            for suffix, f in (("", str), ("_w", in_words)):
                s["bound" + suffix] = f"{'at most' if lt else 'at least'} {f(n - 1 if lt else n)}"
                s["nobound" + suffix] = f"{'no more than' if lt else 'no fewer than'} {f(n - 1 if lt else n)}"
                s["over" + suffix] = f"{'under' if lt else 'more than'} {f(n if lt else n - 1)}"
            s.update(rel=_rel(c), cmp="<" if lt else "≥")
    if "words" in c:
        ws = list(c["words"])
        s.update(words_and=_and(ws), words_or=" or ".join(ws), words_q=_and([f'"{w}"' for w in ws]),
                 s="s" if len(ws) > 1 else "")
    return s


def family(kind: str, name: str) -> list[str]:
    """The wording ids of a family of `kind`, in order. "train": IFEval's sentence ("ifeval"; start_phrase has none),
    our first phrasings ("ours/k", PHRASINGS) and the train templates ("train/k"); "heldout": "heldout/k"."""
    if name == "heldout":
        return [f"heldout/{k}" for k in range(len(WORDINGS[kind]["heldout"]))]
    return ([] if kind == "start_phrase" else ["ifeval"]) + [f"ours/{k}" for k in range(len(PHRASINGS[kind]))] \
        + [f"train/{k}" for k in range(len(WORDINGS[kind]["train"]))]


def worded(kind: str, wid: str, c: dict) -> tuple[str, bool]:
    """(the text that asks for c in wording `wid`, whether it is a clause)."""
    if wid == "ifeval":
        return describe(c), False
    name, k = wid.split("/")
    if name == "ours":
        return PHRASINGS[kind][int(k)](c), False
    template = WORDINGS[kind][name][int(k)]
    return template.lstrip("~").format(**slots(c)), template.startswith("~")


def compose(request: str, pieces: list[tuple[str, bool]], layout: str) -> str:
    """The user turn: the request and each piece (text, is a clause). Clauses are joined into one sentence (several
    constraints in one), or with layout "inline" folded into the request's own sentence (not into a question)."""
    clauses = [t for t, is_clause in pieces if is_clause]
    texts = [t for t, is_clause in pieces if not is_clause]
    if clauses and layout == "inline" and request.endswith("."):
        request, clauses = f"{request[:-1]}, and {_stop(' and '.join(clauses))}", []
    if clauses:
        joined = " and ".join(clauses)
        texts.insert(0, _stop(joined[0].upper() + joined[1:]))
    parts = [*texts, request] if layout == "before" else [request, *texts]
    return " ".join([_stop(p) for p in parts[:-1]] + parts[-1:])  # a sentence that runs into the next one gets a stop


def _stop(text: str) -> str:
    return text if text[-1] in ".!?\"')>*:" else text + "."


def _draw_constraints(topic: str, first: str, kinds: list[str], two_share: float, rng: random.Random) -> list[dict]:
    """One constraint of type `first` and, with probability two_share, a compatible second (repeat_prompt last)."""
    cs = [sample_constraint(first, topic, rng)]
    if rng.random() < two_share:
        options = [k for k in kinds if compatible(first, k)]
        if options:
            second = sample_constraint(rng.choice(options), topic, rng)
            while _clash(cs[0], second):
                second = sample_constraint(second["type"], topic, rng)
            cs.append(second)
    cs.sort(key=lambda c: c["type"] == "repeat_prompt")  # its request is everything before its sentence
    return cs


def make_worded_rows(topics: list[str], n: int, wordings: dict[str, list[str]], seed: str,
                     kinds: list[str] | None = None, two_share: float = 0.4, ifeval_share: float = 0.0) -> list[dict]:
    """n rows on `topics`, each of `kinds` equally often as a row's first constraint, each constraint worded by one
    of wordings[type] (wording ids, `family`), drawn at random (with ifeval_share > 0: IFEval's sentence, where the
    type has one among its wordings, with that probability, else one of the others), and placed by one of LAYOUTS. Topics and constraints
    come from one stream and wordings and layouts from another, so files that differ only in `wordings` hold the
    same requests and constraints. Each row also carries "template": the wording id of each constraint."""
    kinds = kinds or KINDS
    crng, wrng = random.Random(f"{seed}/constraints"), random.Random(f"{seed}/wordings")
    rows = []
    for i in range(n):
        topic = crng.choice(topics)
        first = kinds[i % len(kinds)]
        cs = _draw_constraints(topic, first, kinds, two_share, crng)
        request = crng.choice(QUESTIONS if first == "constrained_response" else REQUESTS).format(t=topic)
        wids = [_pick(wordings[c["type"]], ifeval_share, wrng) for c in cs]
        layout = wrng.choice(LAYOUTS)
        prompt = compose(request, [worded(c["type"], w, c) for c, w in zip(cs, wids) if c["type"] != "repeat_prompt"], layout)
        if cs[-1]["type"] == "repeat_prompt":
            cs[-1]["request"] = prompt
            prompt = f"{prompt} {worded('repeat_prompt', wids[-1], cs[-1])[0]}"
        ids, kwargs = ifeval_instructions(validate(cs, f"row {i}"))
        rows.append(_row(prompt, {"constraints": cs, "instruction_id_list": ids, "kwargs": kwargs,
                                  "wording": [w.split("/")[0] for w in wids], "template": wids}))
    crng.shuffle(rows)
    return rows


def _pick(wids: list[str], ifeval_share: float, rng: random.Random) -> str:
    """One of `wids`: uniformly, or IFEval's sentence with probability ifeval_share where it is among them."""
    if ifeval_share <= 0 or "ifeval" not in wids or len(wids) == 1:
        return rng.choice(wids)
    return "ifeval" if rng.random() < ifeval_share else rng.choice([w for w in wids if w != "ifeval"])


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
        cs = _draw_constraints(topic, first, kinds, two_share, rng)
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
    p.add_argument("--n_eval_heldout_wording", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train_wordings_per_type", type=int, default=0, metavar="N",
                   help="write only ifeval_train_wN.jsonl: --n_train rows whose constraints are worded by the first N "
                        "wordings of each type's training family (1 = IFEval's sentence only), for a curve of the "
                        "held-out-wording gain against N; 0: the five files above")
    p.add_argument("--ifeval_share", type=float, default=0.0, metavar="P",
                   help="with --train_wordings_per_type: word a constraint by IFEval's own sentence with probability P "
                        "(the rest by the type's other wordings) and write ifeval_train_wN_ifevalP.jsonl (P in percent); "
                        "0: every wording equally often")
    a = p.parse_args(argv)
    if not 0 <= a.ifeval_share < 1:
        p.error(f"--ifeval_share must be in [0, 1), got {a.ifeval_share}")
    if a.ifeval_share and not a.train_wordings_per_type:
        p.error("--ifeval_share needs --train_wordings_per_type N (it shapes only the wordings file)")
    most = min(len(family(k, "train")) for k in KINDS)
    if not 0 <= a.train_wordings_per_type <= most:
        p.error(f"--train_wordings_per_type must be between 1 and {most} (the wordings each type has for training), "
                f"or 0 for the shipped files; got {a.train_wordings_per_type}")
    rng = random.Random(a.seed)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if a.train_wordings_per_type:
        n = a.train_wordings_per_type
        rows = make_worded_rows(TRAIN_TOPICS, a.n_train, {k: family(k, "train")[:n] for k in KINDS}, f"train_wordings/{a.seed}",
                                ifeval_share=a.ifeval_share)
        suffix = f"_ifeval{round(100 * a.ifeval_share)}" if a.ifeval_share else ""
        _write(out / f"ifeval_train_w{n}{suffix}.jsonl", rows)
        return
    ifeval_kinds = [k for k in KINDS if k != "start_phrase"]
    files = [("ifeval_train.jsonl", lambda: make_rows(TRAIN_TOPICS, a.n_train, rng)),
             ("ifeval_eval.jsonl", lambda: make_rows(EVAL_TOPICS, a.n_eval, rng)),
             ("ifeval_eval_seen_wording.jsonl", lambda: make_rows(EVAL_TOPICS, a.n_eval_ifeval_wording, rng,
                                                                    kinds=ifeval_kinds, wording="ifeval")),
             ("ifeval_eval_other_types.jsonl", lambda: make_other_rows(EVAL_TOPICS, a.n_eval_other_types, rng)),
             # its own streams (make_worded_rows): the four files above are what they were before it was added
             ("ifeval_eval_heldout_wording.jsonl", lambda: make_worded_rows(
                 EVAL_TOPICS, a.n_eval_heldout_wording, {k: family(k, "heldout") for k in KINDS}, f"heldout_wording/{a.seed}"))]
    for name, make in files:
        _write(out / name, make())


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
