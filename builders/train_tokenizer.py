"""Train the project's tokenizer: byte-level BPE, vocab 6400, MiniMind's special-token layout.

Rebuild (from the repository root; nothing is downloaded):

    python builders/make_demo_data.py        # the demo data (the tokenizer regenerates its text too)
    python builders/train_tokenizer.py       # writes model/tokenizer.json, model/tokenizer_config.json,
                                            # model/chat_template.jinja
    python builders/train_tokenizer.py --split_digits --out_dir out/rm_tokenizer
                                            # the reward model's copy: numbers split into single digits

Layout: <|endoftext|> = 0 (pad, unk), <|im_start|> = 1 (bos), <|im_end|> = 2 (eos), and the
added NON-special tokens <think> = 3, </think> = 4 (they survive skip_special_tokens=True).
No normalizer and no prefix space, so decode(encode(text)) == text for any string. Numbers are
cut into chunks of at most three digits before the byte-level step.

Training text, all local:
  * the demo task's own text (SFT prompts and replies of `generate_all(seed)`, train side only),
  * English docstrings parsed (not imported) from this Python's standard library,
  * dataset/tokenizer_corpus.txt: English and Chinese chatbot conversations taken from the
    chatterbot-corpus package (BSD licence); the Chinese part is repeated --zh_weight times
    because it is small. The file was made once with
        pip download --no-deps chatterbot-corpus==1.3.3 && unzip chatterbot_corpus-*.whl
        python builders/train_tokenizer.py --extract_chatterbot chatterbot_corpus/data
    (needs PyYAML). The stdlib docstrings differ between Python versions: a byte-identical
    rebuild of the shipped tokenizer needs Python 3.11 (it was built with 3.11.7).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VOCAB_SIZE = 6400
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
THINK_TOKENS = ("<think>", "</think>")
CORPUS_FILE = ROOT / "dataset" / "tokenizer_corpus.txt"

# ChatML as MiniMind renders it. `open_thinking` undefined counts as false, like MiniMind.
CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\nTo call a tool, reply with <tool_call>\\n{\\"name\\": <name>, \\"arguments\\": <arguments>}\\n</tool_call><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- elif not (tools and loop.first and message['role'] == 'system') %}
        {{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}
        {%- for call in message['tool_calls'] or [] %}
            {%- set call = call['function'] or call %}
            {{- '<tool_call>\\n{\\"name\\": \\"' + call['name'] + '\\", \\"arguments\\": ' + (call['arguments'] if call['arguments'] is string else call['arguments'] | tojson) + '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if open_thinking is defined and open_thinking %}
        {{- '<think>\\n' }}
    {%- else %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# GPT-2's split pattern with two changes: a number is cut into chunks of at most three digits
# (each may keep one leading space), so frequent small numbers become single tokens: a tiny
# model then reads "47" as one learned embedding instead of having to locate and copy single
# digits by position (with one token per digit, a 1.7M-parameter policy did not learn to copy
# operands within a 5-minute SFT budget); and a tag such as <answer> or </answer> stays one
# piece, so the reasoning format can merge into few tokens.
NUMBER_CHUNK = r" ?\p{N}{1,3}"
PRETOKENIZE_PATTERN = (r"""</?[A-Za-z_]+>|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|""" + NUMBER_CHUNK +
                       r"""| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

# Standard-library folders whose docstrings are not English prose or are version-specific.
_STDLIB_SKIP = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip",
                "pydoc_data", "encodings", "distutils", "__pycache__"}


# ---------------------------------------------------------------- training text

def stdlib_docstrings() -> list[str]:
    """Unique docstrings of the standard library, in a fixed (sorted path) order."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in lib.rglob("*.py")
                   if not set(p.relative_to(lib).parts[:-1]) & _STDLIB_SKIP
                   and not p.relative_to(lib).parts[0].startswith("config-"))
    seen: set[str] = set()
    docs = []
    for path in paths:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and doc not in seen:
                    seen.add(doc)
                    docs.append(doc)
    return docs


def read_corpus_file(path: Path) -> dict[str, list[str]]:
    """Lines of tokenizer_corpus.txt by section ("#@ zh" / "#@ en"); other '#' lines are notes."""
    if not path.is_file():
        raise SystemExit(f"train_tokenizer: {path} not found; it is shipped in the repository "
                         "(restore it with git, or rebuild it with --extract_chatterbot)")
    sections: dict[str, list[str]] = {}
    current = None
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("#@ "):
            current = sections.setdefault(line[3:].strip(), [])
        elif line.startswith("#") or not line.strip():
            continue
        elif current is None:
            raise SystemExit(f"train_tokenizer: {path}:{lineno}: text before the first '#@ <lang>' "
                             "section header")
        else:
            current.append(line)
    return sections


def chat_text(messages: list[dict]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def demo_texts(seed: int) -> list[str]:
    """The demo's SFT conversations (train side only) rendered as ChatML."""
    from dataset.demo_task import generate_all

    rows = generate_all(seed, n_eval=0, n_pairs=0, n_pairs_eval=0)["demo_sft"]
    return [chat_text(row["conversations"]) for row in rows]


def training_texts(seed: int, zh_weight: int, corpus_file: Path) -> list[str]:
    sections = read_corpus_file(corpus_file)
    zh, en = sections.get("zh", []), sections.get("en", [])
    if not zh or not en:
        raise SystemExit(f"train_tokenizer: {corpus_file} needs both '#@ zh' and '#@ en' sections")
    return demo_texts(seed) + stdlib_docstrings() + en + zh * zh_weight


# ---------------------------------------------------------------- tokenizer

def train_bpe(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """Train the byte-level BPE and return a `tokenizers.Tokenizer` with ids 0..4 fixed.
    The vocabulary may come out smaller than asked when the text has too few pairs to merge."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        # All five go first so they get ids 0..4 and are never split or merged into.
        special_tokens=list(SPECIAL_TOKENS + THINK_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))

    # The trainer marks every token it was given as special; <think>/</think> must not be, so
    # that decode(..., skip_special_tokens=True) keeps the reasoning format visible.
    spec = json.loads(tokenizer.to_str())
    for entry in spec["added_tokens"]:
        if entry["content"] in THINK_TOKENS:
            entry["special"] = False
    tokenizer = Tokenizer.from_str(json.dumps(spec, ensure_ascii=False))

    expected = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + THINK_TOKENS)}
    got = {tok: tokenizer.token_to_id(tok) for tok in expected}
    if got != expected:
        raise RuntimeError(f"unexpected special-token ids {got}; expected {expected}")
    return tokenizer


def wrap_and_save(tokenizer, out_dir: Path):
    """Wrap as a transformers fast tokenizer and save it (tokenizer.json, tokenizer_config.json,
    chat_template.jinja). Returns the wrapped tokenizer."""
    from transformers import PreTrainedTokenizerFast

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=SPECIAL_TOKENS[1],
        eos_token=SPECIAL_TOKENS[2],
        pad_token=SPECIAL_TOKENS[0],
        unk_token=SPECIAL_TOKENS[0],
        model_max_length=32768,
        padding_side="left",  # generation batches are left-padded
        # The default cleanup rewrites " ." -> "." and would break exact round trips.
        clean_up_tokenization_spaces=False,
        add_bos_token=False,
        add_eos_token=False,
        chat_template=CHAT_TEMPLATE,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_tokenizer.save_pretrained(str(out_dir))
    # transformers 5 records its new class name "TokenizersBackend"; "PreTrainedTokenizerFast"
    # is the same class in 5.x (an alias) and also loads in 4.x, as MiniMind's own file does.
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                           encoding="utf-8")
    return hf_tokenizer


def split_digits_copy(src_dir: Path, out_dir: Path) -> None:
    """Copy the tokenizer in `src_dir` to `out_dir` with numbers cut into single digits.

    Same vocabulary and ids; only the pre-tokenizer changes, so "106" becomes "1", "0", "6"
    instead of one token. The demo reward model reads this copy: checking that "10" and "6" in the
    working make "106" in the answer is a copy task over digits but a lookup over ~1,000 number
    tokens for a 5M-parameter model (digit-wise numbers are what PaLM and LLaMA use for arithmetic).
    """
    from tokenizers import Tokenizer

    spec = json.loads((src_dir / "tokenizer.json").read_text(encoding="utf-8"))
    split = next((p for p in spec.get("pre_tokenizer", {}).get("pretokenizers", [])
                  if p.get("type") == "Split" and NUMBER_CHUNK in p["pattern"].get("Regex", "")), None)
    if split is None:
        raise SystemExit(f"train_tokenizer: {src_dir / 'tokenizer.json'} has no {NUMBER_CHUNK!r} rule to change; "
                         "--split_digits works on the project's own tokenizer (python builders/train_tokenizer.py)")
    split["pattern"]["Regex"] = split["pattern"]["Regex"].replace(NUMBER_CHUNK, r" ?\p{N}")
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    hf_tokenizer = wrap_and_save(tokenizer, out_dir)
    if hf_tokenizer("x 106")["input_ids"] != hf_tokenizer("x 1")["input_ids"] + hf_tokenizer("06")["input_ids"]:
        raise RuntimeError("split_digits_copy: numbers did not split into digits")


# ---------------------------------------------------------------- reporting

def length_report(hf_tokenizer, seed: int) -> str:
    """Token lengths of the demo's prompts (templated, thinking open) and replies by style."""
    from dataset.demo_task import generate_all

    files = generate_all(seed, n_sft=4_000, n_pairs=0, n_pairs_eval=0)
    groups: dict[str, list[int]] = {"user message": [], "templated prompt": []}
    for row in files["demo_train"] + files["demo_eval"]:
        messages = row["conversations"][:1]
        groups["user message"].append(len(hf_tokenizer.encode(messages[0]["content"])))
        ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                               open_thinking=True, return_dict=False)
        groups["templated prompt"].append(len(ids))
    for row in files["demo_sft"]:
        reply = row["conversations"][1]["content"]
        group = groups.setdefault(f"{row['style']} reply ({row['lang']})", [])
        group.append(len(hf_tokenizer.encode(reply)))
    lines = []
    for name, lengths in sorted(groups.items()):
        lines.append(f"  {name:22s} n={len(lengths):5d} mean={statistics.mean(lengths):5.1f} "
                     f"min={min(lengths):3d} max={max(lengths):3d}")
    return "\n".join(lines)


# ---------------------------------------------------------------- corpus extraction (one-off)

def extract_chatterbot(data_dir: Path, out_path: Path) -> None:
    """Write tokenizer_corpus.txt from chatterbot-corpus' YAML files (chinese/ and english/)."""
    try:
        import yaml
    except ImportError:
        raise SystemExit("train_tokenizer: --extract_chatterbot needs PyYAML (pip install pyyaml)")
    header = [
        "# Training text for builders/train_tokenizer.py (the tokenizer only; not a model data set).",
        "# Source: the chatterbot-corpus package, version 1.3.3 (PyPI, https://github.com/gunthercox/",
        "# chatterbot-corpus), BSD licence, community-contributed conversations by Gunther Cox and",
        "# contributors. Taken: every utterance of data/chinese/*.yml (simplified Chinese) and",
        "# data/english/*.yml, one per line, in sorted file order, line breaks inside an utterance",
        "# replaced by spaces. Lines starting with '#' are notes; '#@ <lang>' starts a section.",
    ]
    out = list(header)
    for lang, folder in (("zh", "chinese"), ("en", "english")):
        out.append(f"#@ {lang}")
        for path in sorted((data_dir / folder).glob("*.yml")):
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
            for conversation in data.get("conversations", []):
                for utterance in conversation:
                    text = " ".join(str(utterance).split())
                    if text and not text.startswith("#"):
                        out.append(text)
    out_path.write_text("\n".join(out) + "\n", encoding="utf-8", newline="\n")
    print(f"wrote {out_path} ({out_path.stat().st_size} bytes)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out_dir", type=Path, default=ROOT / "model")
    parser.add_argument("--seed", type=int, default=0, help="seed of the demo text (as make_demo_data)")
    parser.add_argument("--zh_weight", type=int, default=8,
                        help="times the (small) Chinese corpus section is repeated")
    parser.add_argument("--corpus_file", type=Path, default=CORPUS_FILE)
    parser.add_argument("--extract_chatterbot", type=Path, metavar="DATA_DIR",
                        help="one-off: rebuild --corpus_file from chatterbot_corpus/data and exit")
    parser.add_argument("--split_digits", action="store_true",
                        help="no training: copy --from_dir's tokenizer to --out_dir with numbers split into "
                             "single digits (the demo reward model's tokenizer)")
    parser.add_argument("--from_dir", type=Path, default=ROOT / "model", help="tokenizer that --split_digits copies")
    args = parser.parse_args(argv)

    if args.split_digits:
        if args.out_dir.resolve() == args.from_dir.resolve():
            parser.error("--split_digits: give an --out_dir other than --from_dir (e.g. out/rm_tokenizer)")
        if not (args.from_dir / "tokenizer.json").is_file():
            parser.error(f"--from_dir {args.from_dir}: no tokenizer.json there")
        split_digits_copy(args.from_dir, args.out_dir)
        print(f"saved the digit-split copy of {args.from_dir} to {args.out_dir}")
        return

    if args.extract_chatterbot is not None:
        if not (args.extract_chatterbot / "chinese").is_dir():
            parser.error(f"--extract_chatterbot {args.extract_chatterbot}: no chinese/ folder there")
        extract_chatterbot(args.extract_chatterbot, args.corpus_file)
        return
    if args.zh_weight < 1:
        parser.error("--zh_weight must be >= 1")
    # Offline by construction; also keeps transformers from looking anything up.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    start = time.perf_counter()
    texts = training_texts(args.seed, args.zh_weight, args.corpus_file)
    print(f"training text: {len(texts)} pieces, {sum(len(t) for t in texts) / 1e6:.1f} M characters "
          f"({time.perf_counter() - start:.1f} s)")
    tokenizer = train_bpe(texts)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"train_tokenizer: the training text only supports a vocab of "
                         f"{tokenizer.get_vocab_size()}, not {VOCAB_SIZE}; is {args.corpus_file} complete?")
    print(f"trained BPE: vocab {tokenizer.get_vocab_size()} ({time.perf_counter() - start:.1f} s)")
    hf_tokenizer = wrap_and_save(tokenizer, args.out_dir)
    saved = sorted(p.name for p in args.out_dir.iterdir() if p.suffix in (".json", ".jinja"))
    print(f"saved to {args.out_dir}: {', '.join(saved)}")
    print("demo token lengths:\n" + length_report(hf_tokenizer, args.seed))
    print(f"done in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
