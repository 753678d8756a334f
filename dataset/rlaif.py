"""RLAIF prompt data: strict jsonl reader, prompt dataset and left-padding collate.

File format (MiniMind `rlaif.jsonl`), one JSON object per line:

    {"conversations": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...]}

The last assistant turn, if the conversation ends with one, is the slot the policy generates; its
content is either a placeholder ("无", "", "none", ...) or a reference answer. Roles are validated,
never re-assigned by position, so a mislabeled file fails loudly instead of training on a chat
with the wrong speakers. A "tool" message is a tool's reply in a worked example before the question (a few-shot
tool episode: user, assistant call, tool, assistant answer), rendered by the chat template as it renders tool
replies during an episode.
"""

from __future__ import annotations

import json
import logging
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from dataset import ifeval

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
TOOLS_PLACEHOLDER = "{tools}"  # --tools_system_prompt: replaced by the offered tools' JSON schemas

# Final-assistant contents that mean "no reference answer" (compared after strip + casefold).
PLACEHOLDER_REFERENCES = frozenset({"", "无", "none", "n/a", "na", "null", "-"})

# Suffixes the chat template may force after the assistant header. Longest first so the closed
# form is never mistaken for a shorter one.
KNOWN_ASSISTANT_PREFIXES = ("<think>\n\n</think>\n\n", "<think>\n")

DEFAULT_SYSTEM_PROMPTS: tuple[str, ...] = (
    "You are a helpful assistant.",
    "You are a knowledgeable, friendly AI assistant.",
    "You are a helpful assistant. Answer concisely and accurately.",
    "你是一个乐于助人的AI助手。",
    "你是一个知识渊博、友好的助手，请认真回答用户的问题。",
    "你是MiniMind，一个小而有用的语言模型助手。",
)

_SKIP_HINT = "fix the line or pass --skip_bad_lines 1 to skip bad lines"
_MAX_SKIP_WARNINGS = 3


class DataError(ValueError):
    """Bad RLAIF data. The message starts with "path:lineno: " (or "path: ") and says what to do."""


@dataclass
class PromptRecord:
    messages: list[dict]  # chat to condition on (system?/user/assistant... ending with a user turn)
    reference: str | None  # reference answer if the final assistant turn carried one
    where: str  # "path:lineno" for error messages / logging
    constraints: list[dict] | None = None  # verifiable instructions (dataset/ifeval.py) the reply must meet
    tools: list[dict] | None = None  # tool schemas offered in this chat (MiniMind agent rows: the system message's "tools")
    gt: list[str] | None = None  # MiniMind agent rows: values the final answer must contain (numbers by value)
    rg: dict | None = None  # a reasoning-gym row (dataset/rgym.py): {"task", "config", "entry"}, its verifier's input


def is_placeholder(content: str) -> bool:
    """True if a final assistant content means "no reference answer"."""
    return content.strip().casefold() in PLACEHOLDER_REFERENCES


def parse_conversation(obj: Any, where: str) -> PromptRecord:
    """Validate one decoded jsonl object and split it into conditioning messages + reference."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}; {_SKIP_HINT}")
    if "conversations" not in obj:
        keys = ", ".join(map(repr, list(obj)[:5])) or "none"
        raise DataError(f"{where}: missing key 'conversations' (keys: {keys}); {_SKIP_HINT}")
    conv = obj["conversations"]
    if not isinstance(conv, list):
        raise DataError(f"{where}: 'conversations' must be a list of messages, got "
                        f"{type(conv).__name__}; {_SKIP_HINT}")

    messages: list[dict] = []
    tools = None
    for k, msg in enumerate(conv):
        at = f"{where}: conversations[{k}]"
        if not isinstance(msg, dict):
            raise DataError(f"{at} must be an object with 'role' and 'content', got "
                            f"{type(msg).__name__}; {_SKIP_HINT}")
        for key in ("role", "content"):
            if key not in msg:
                raise DataError(f"{at} has no '{key}'; {_SKIP_HINT}")
        role, content = msg["role"], msg["content"]
        if role not in ROLES:
            raise DataError(f"{at} has unknown role {role!r}; expected one of 'system', 'user', "
                            f"'assistant', 'tool' (roles are not re-assigned by position); {_SKIP_HINT}")
        if not isinstance(content, str):
            raise DataError(f"{at} ({role}) content must be a string, got "
                            f"{type(content).__name__}; {_SKIP_HINT}")
        if role == "system" and "tools" in msg:  # MiniMind's agent_rl.jsonl: the tools offered, as JSON text or a list
            tools = _parse_tools(msg["tools"], at)
        if role == "system" and k != 0:
            raise DataError(f"{at}: a system message is only allowed as the first message; "
                            f"{_SKIP_HINT}")
        # Only role and content reach the template: extra keys would change rendering silently.
        messages.append({"role": role, "content": content})

    reference: str | None = None
    if messages and messages[-1]["role"] == "assistant":
        slot = messages.pop()
        reference = None if is_placeholder(slot["content"]) else slot["content"]

    for k, msg in enumerate(messages):
        if not msg["content"].strip():
            raise DataError(f"{where}: conversations[{k}] ({msg['role']}) has empty content; only "
                            f"the final assistant turn may be empty; {_SKIP_HINT}")
    if not any(m["role"] == "user" for m in messages):
        raise DataError(f"{where}: the conversation has no user turn (nothing to prompt with); "
                        f"{_SKIP_HINT}")
    if messages[-1]["role"] != "user":
        raise DataError(f"{where}: the turn before the final assistant slot must be a user turn, "
                        f"got {messages[-1]['role']!r}; {_SKIP_HINT}")
    constraints = None
    if "constraints" in obj:  # an instruction-following row (builders/make_ifeval_data.py)
        try:
            constraints = ifeval.validate(obj["constraints"], where)
        except ValueError as e:
            raise DataError(f"{e}; {_SKIP_HINT}") from None
    gt = None
    if "gt" in obj:  # a MiniMind agent row's ground truth
        raw = obj["gt"] if isinstance(obj["gt"], list) else [obj["gt"]]
        if not raw or not all(isinstance(g, (str, int, float)) and not isinstance(g, bool) for g in raw):
            raise DataError(f"{where}: 'gt' must be a value or a non-empty list of strings / numbers the final answer "
                            f"must contain; {_SKIP_HINT}")
        gt = [str(g) for g in raw]
    return PromptRecord(messages=messages, reference=reference, where=where, constraints=constraints, tools=tools, gt=gt)


def _parse_tools(raw: Any, at: str) -> list[dict]:
    """A system message's "tools": a list of tool schemas, or that list as JSON text (MiniMind writes it so)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise DataError(f"{at}: 'tools' is not valid JSON ({e.msg} at column {e.colno}); {_SKIP_HINT}") from None
    if not isinstance(raw, list) or not all(isinstance(t, dict) and tool_name(t) for t in raw):
        raise DataError(f"{at}: 'tools' must be a list of tool schemas, each with a function name; {_SKIP_HINT}")
    return raw


def tool_name(schema: dict) -> str | None:
    """The name in a tool schema ({"type": "function", "function": {"name": ...}} or {"name": ...})."""
    fn = schema.get("function", schema)
    return fn.get("name") if isinstance(fn, dict) and isinstance(fn.get("name"), str) else None


def _json_array_message(path: Path, lineno: int) -> str:
    out = path.with_suffix(".jsonl") if path.suffix != ".jsonl" else path.with_name(path.stem + ".lines.jsonl")
    src, dst = shlex.quote(str(path)), shlex.quote(str(out))
    return (f"{path}:{lineno}: the file is a JSON array ('[' ...), not JSONL (one JSON object per line); convert it: "
            f"jq -c '.[]' {src} > {dst}  or  python -c \"import json,sys; "
            f"[print(json.dumps(o, ensure_ascii=False)) for o in json.load(open(sys.argv[1], encoding='utf-8-sig'))]\" "
            f"{src} > {dst}")


def read_rlaif_jsonl(path: str | Path, skip_bad_lines: bool = False) -> tuple[list[PromptRecord], int]:
    """Read an RLAIF prompt jsonl. Returns (records, n_skipped).

    Any malformed line raises DataError("path:lineno: ...") unless skip_bad_lines, in which case it
    is skipped and counted. A file without a single usable record is always an error. Blank lines
    are ignored but still counted in line numbers so they match an editor's.
    """
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: file not found; check --data_path")
    if not path.is_file():
        raise DataError(f"{path}: not a regular file; --data_path must point to a .jsonl file")

    records: list[PromptRecord] = []
    n_skipped = 0
    first_error: str | None = None
    first_content = True
    with path.open("rb") as f:  # bytes: a bad UTF-8 line is a line error, not a file crash
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            if first_content and (head := (raw.removeprefix(b"\xef\xbb\xbf") if lineno == 1 else raw).strip()):
                first_content = False
                # A whole-file JSON array is a format mistake, not a bad line: --skip_bad_lines would
                # otherwise keep only the odd element that happens to sit on one line without a comma.
                if head.startswith(b"["):
                    raise DataError(_json_array_message(path, lineno))
            try:
                try:
                    line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start}); "
                                    f"{_SKIP_HINT}") from None
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: malformed JSON ({e.msg} at column {e.colno}); "
                                    f"{_SKIP_HINT}") from None
                records.append(parse_conversation(obj, where))
            except DataError as e:
                if not skip_bad_lines:
                    raise
                n_skipped += 1
                first_error = first_error or str(e)
                if n_skipped <= _MAX_SKIP_WARNINGS:
                    logger.warning("skipping bad line: %s", e)

    if not records:
        if n_skipped:
            raise DataError(f"{path}: no usable records: all {n_skipped} non-blank lines are bad "
                            f"(first error: {first_error})")
        raise DataError(f"{path}: no records (the file is empty or has only blank lines); "
                        f'--data_path must be a jsonl with one {{"conversations": [...]}} per line')
    if n_skipped:
        logger.warning("%s: skipped %d bad line(s), kept %d records", path, n_skipped, len(records))
    return records, n_skipped


def detect_assistant_prefix(prompt: str) -> str:
    """Text the template forced after the assistant header, i.e. how the reply already begins.

    Suffix match against the known MiniMind think prefixes: "<think>\\n" (open thinking) or
    "<think>\\n\\n</think>\\n\\n" (closed); "" for templates that add nothing after the header.
    A suffix match is safe because a generation prompt always ends with the assistant header plus
    this prefix, and no chat content can sit after it.
    """
    for prefix in KNOWN_ASSISTANT_PREFIXES:
        if prompt.endswith(prefix):
            return prefix
    return ""


def render_prompt(tokenizer: Any, messages: list[dict], open_thinking: bool, tools: list[dict] | None = None) -> str:
    """Chat-template text ending with the assistant header (+ think prefix), listing `tools` when given."""
    # transformers 5 forwards extra kwargs to the Jinja template; templates that ignore
    # `open_thinking` simply render without a think prefix.
    kw = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         open_thinking=open_thinking, **kw)


def tools_system_text(template: str, tools: list[dict]) -> str:
    """--tools_system_prompt with the tools' JSON schemas (one JSON list) in place of every "{tools}"."""
    return template.replace(TOOLS_PLACEHOLDER, json.dumps(tools, ensure_ascii=False))


def with_tools_system_prompt(messages: list[dict], template: str, tools: list[dict]) -> list[dict]:
    """The chat with --tools_system_prompt as its system message (before the row's own system text, a blank line
    between)."""
    text = tools_system_text(template, tools)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": text + "\n\n" + messages[0]["content"]}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


TOOLS_UNSEEN = ("the chat template ignores tools= (it has no tool section), so the model would never see the tools: "
                "give --tools_system_prompt TEXT, a system prompt in which {tools} becomes their JSON schemas "
                "(configs/smollm2_tools.yaml has one)")


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template shows `tools=` to the model (SmolLM2-135M-Instruct's plain ChatML ignores it)."""
    probe = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "probe_tool_x9", "description": "d",
                                             "parameters": {"type": "object", "properties": {}}}}
    try:
        with_tools = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True, tools=[tool])
    except Exception:  # noqa: BLE001 - a template that raises on tools= does not render them either
        return False
    return with_tools != tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)


def generation_tail_len(tokenizer: Any, open_thinking: bool) -> int:
    """Tokens the template appends for add_generation_prompt (assistant header + think prefix).

    Measured on a probe chat as the text difference between rendering with and without the
    generation prompt; the header starts with a special token in ChatML, so tokenizing it alone
    gives the same tokens as inside the full prompt.
    """
    probe = [{"role": "user", "content": "hi"}]
    with_gen = render_prompt(tokenizer, probe, open_thinking)
    without = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=False,
                                            open_thinking=open_thinking)
    tail = with_gen[len(without):] if with_gen.startswith(without) else \
        detect_assistant_prefix(with_gen)
    return len(tokenizer.encode(tail, add_special_tokens=False)) if tail else 0


class RLAIFDataset(Dataset):
    """Renders PromptRecords into generation prompts.

    Per-sample randomness (open thinking with probability `thinking_ratio`; a random system prompt
    from `system_prompts` with probability `system_prompt_ratio` when the record has none) is drawn
    from numpy.default_rng([seed, index]): a pure function of (seed, index), so resumed runs,
    DataLoader workers and multiple processes all see identical prompts, whatever the access order.
    """

    def __init__(self, records: list[PromptRecord], tokenizer: Any, max_prompt_len: int,
                 thinking_ratio: float = 1.0, system_prompt_ratio: float = 0.0,
                 system_prompts: Sequence[str] = DEFAULT_SYSTEM_PROMPTS, seed: int = 0,
                 tools: list[dict] | None = None, tools_system_prompt: str | None = None) -> None:
        if not 0.0 <= thinking_ratio <= 1.0:
            raise ValueError(f"thinking_ratio must be in [0, 1], got {thinking_ratio} "
                             f"(check --thinking_ratio)")
        if not 0.0 <= system_prompt_ratio <= 1.0:
            raise ValueError(f"system_prompt_ratio must be in [0, 1], got {system_prompt_ratio}")
        if system_prompt_ratio > 0 and not system_prompts:
            raise ValueError("system_prompt_ratio > 0 needs at least one system prompt")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if not isinstance(max_prompt_len, int) or max_prompt_len <= 0:
            raise ValueError(f"max_prompt_len must be a positive int, got {max_prompt_len!r} "
                             f"(derived from --max_seq_len)")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat_template; use a tokenizer directory whose "
                             "tokenizer_config.json defines one")

        self.records = records
        # An instruction-following file: every row says what it asks ([] = nothing), so every rank's batches carry
        # the same reward components whatever rows it drew; a file without constraints carries None.
        self.has_constraints = any(r.constraints for r in records)
        self.tokenizer = tokenizer
        self.max_prompt_len = max_prompt_len
        self.thinking_ratio = float(thinking_ratio)
        self.system_prompt_ratio = float(system_prompt_ratio)
        self.system_prompts = tuple(system_prompts)
        self.seed = seed
        self.tools = tools  # --tools: offered in every chat whose row names none (MiniMind agent rows name theirs)
        # --tools_system_prompt: the offered tools are listed in this system prompt instead of through tools=
        self.tools_system_prompt = tools_system_prompt
        self.tool_rows = tools is not None or any(r.tools for r in records)

        # Fail at construction, not mid-training: truncation must never eat the assistant header.
        modes = [m for m, used in ((True, thinking_ratio > 0), (False, thinking_ratio < 1)) if used]
        tail = max(generation_tail_len(tokenizer, m) for m in modes)
        if max_prompt_len < tail:
            raise ValueError(f"max_prompt_len={max_prompt_len} is smaller than the {tail} tokens of "
                             f"the assistant header + think prefix; raise --max_seq_len (or "
                             f"max_prompt_len) to leave room for the prompt")

    def __len__(self) -> int:
        return len(self.records)

    def sample_choices(self, i: int) -> tuple[bool, str | None]:
        """(open_thinking, injected system prompt or None) for index i; pure in (seed, i)."""
        rng = np.random.default_rng([self.seed, i])
        # Always draw all three numbers in a fixed order so each decision is independent of the
        # other ratio's value.
        u_think, u_sys = rng.random(2)
        pick = int(rng.integers(len(self.system_prompts))) if self.system_prompts else 0
        open_thinking = bool(u_think < self.thinking_ratio)
        has_system = self.records[i].messages[0]["role"] == "system"
        inject = (not has_system) and bool(u_sys < self.system_prompt_ratio)
        return open_thinking, (self.system_prompts[pick] if inject else None)

    def __getitem__(self, i: int) -> dict:
        n = len(self.records)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {n} records")
        i = i % n  # canonical index: the RNG is keyed on it
        record = self.records[i]
        open_thinking, system_prompt = self.sample_choices(i)
        messages = [dict(m) for m in record.messages]  # copies: callers may mutate the result
        if system_prompt is not None:
            messages.insert(0, {"role": "system", "content": system_prompt})

        tools = record.tools or self.tools
        if tools and self.tools_system_prompt is not None:  # listed in the system message; tools= stays unused
            messages, tools = with_tools_system_prompt(messages, self.tools_system_prompt, tools), None
        prompt = render_prompt(self.tokenizer, messages, open_thinking, tools)
        ids = list(self.tokenizer.encode(prompt, add_special_tokens=False))
        # Left truncation keeps the end of the chat (latest user turn, header, think prefix).
        num_truncated = max(0, len(ids) - self.max_prompt_len)
        if num_truncated:
            ids = ids[num_truncated:]
        return {
            "index": i,
            "prompt": prompt,  # full rendered text, before truncation
            "input_ids": ids,
            "messages": messages,
            "reference": record.reference,
            "constraints": (record.constraints or []) if self.has_constraints else None,
            "assistant_prefix": detect_assistant_prefix(prompt),
            "num_truncated": num_truncated,
            "open_thinking": open_thinking,
            "tools": tools,
            "gt": record.gt,
            "rg": record.rg,
        }


def collate_left_pad(batch: list[dict], pad_id: int) -> dict:
    """Left-pad prompts so every row ends at the same column (generation appends on the right)."""
    if not batch:
        raise ValueError("cannot collate an empty batch")
    width = max(len(item["input_ids"]) for item in batch)
    # input_ids, attention_mask: [B, P] int64, P = longest prompt in the batch; pads on the left.
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, item in enumerate(batch):
        n = len(item["input_ids"])
        if n:
            input_ids[row, width - n:] = torch.tensor(item["input_ids"], dtype=torch.long)
            attention_mask[row, width - n:] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "prompt": [item["prompt"] for item in batch],
        "messages": [item["messages"] for item in batch],
        "reference": [item["reference"] for item in batch],
        "constraints": [item.get("constraints") for item in batch],
        "assistant_prefix": [item["assistant_prefix"] for item in batch],
        "index": [item["index"] for item in batch],
        "num_truncated": [item.get("num_truncated", 0) for item in batch],
        "open_thinking": [item.get("open_thinking", True) for item in batch],
        "tools": [item.get("tools") for item in batch],
        "gt": [item.get("gt") for item in batch],
        "rg": [item.get("rg") for item in batch],
    }
