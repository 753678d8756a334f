"""Tools for multi-turn rollouts: load a tool module, parse the policy's tool calls, run them, and render what
the tools said back into the chat as the template would.

    toolbox = load_tools("dataset/demo_tools.py")     # every public function -> a JSON schema (type hints + docstring)
    calls = parse_tool_calls(text)                    # <tool_call>{"name": ..., "arguments": {...}}</tool_call>, or a [list]
    runner = ToolRunner(toolbox, timeout=5.0)         # runs them in a bounded worker process, a time limit per call
    message = runner.call(calls[0])                   # {"role": "tool", "name": ..., "content": ...}; never raises

A tool module is plain Python: functions with type hints and a Google-style docstring (transformers'
`get_json_schema` turns each into the schema the chat template renders with `tools=`). A module that defines
`TOOLS = [fn, ...]` offers exactly those; otherwise every public function defined in it.

Calls run in a worker process (trainer/tool_worker.py, one per trainer process, started on first use) bounded by
trainer/sandbox.py: its own session, rlimits, a scrubbed environment, a private folder, a time limit per call. A tool
that hangs is killed with its children at the limit, one that crashes or exits takes only the worker with it; either
way the policy reads an error message, as it does for a malformed call, an unknown tool or bad arguments. Those are
the model's mistakes, a reward signal (trainer/rewards.py), never the run's.
"""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass
from pathlib import Path

from trainer import plugins
from trainer.sandbox import Limits, Worker

# A tool's reply is cut to this many characters: a runaway result must not fill the context.
MAX_RESULT_CHARS = 2000
# What a call's JSON may be before it is parsed: json.loads recurses per bracket (RecursionError near 1,000) and
# refuses integers over 4,300 digits (ValueError); no tool needs either.
MAX_CALL_CHARS = 20_000
MAX_CALL_DEPTH = 32
_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
# The worker runs as a module with the repository root on its path: run as a script, its own folder (trainer/)
# would come first on sys.path, where a module could shadow the standard library's for the child alone.
_WORKER_MODULE = "trainer.tool_worker"


class ToolError(ValueError):
    """A tool module the run cannot use; the message names the file and what to do."""


@dataclass(frozen=True)
class Toolbox:
    """The tools of a module: name -> JSON schema (as transformers' get_json_schema writes it)."""

    path: str
    schemas: dict[str, dict]

    @property
    def names(self) -> list[str]:
        return list(self.schemas)

    def schema_list(self) -> list[dict]:
        return list(self.schemas.values())


@dataclass(frozen=True)
class ToolCall:
    """One parsed call; `error` says why it cannot run (malformed JSON, no name, ...), None when it can."""

    name: str
    arguments: dict
    error: str | None = None


def load_tools(path: str | Path) -> Toolbox:
    """The module's tools with their schemas. Refuses (ToolError, one line) a missing file, a module that does not
    import, one without tools, and a tool without type hints or a docstring (the schema the model reads)."""
    from transformers.utils import get_json_schema  # here: transformers is heavy; only tool runs need it

    path = Path(path)
    if not path.is_file():
        raise ToolError(f"--tools {path}: file not found; give a .py module of tool functions")
    try:
        module = plugins.import_file(path)
    except plugins.NotPythonSource:
        raise ToolError(f"--tools {path}: not a Python file; give a .py module of tool functions") from None
    except BaseException as e:  # noqa: BLE001 - a SyntaxError, ImportError or SystemExit in the user's module
        raise ToolError(f"--tools {path}: could not import it ({type(e).__name__}: {e}); fix the module") from None
    if hasattr(module, "TOOLS"):
        fns = list(module.TOOLS)
    else:
        fns = [f for name, f in vars(module).items() if inspect.isfunction(f) and not name.startswith("_")
               and f.__module__ == module.__name__]
    if not fns:
        raise ToolError(f"--tools {path}: no tools in it (define public functions with type hints and a docstring, "
                        f"or list them in TOOLS = [...])")
    schemas = {}
    for fn in fns:
        if not callable(fn):
            raise ToolError(f"--tools {path}: TOOLS holds {fn!r}, which is not a function")
        try:
            schema = get_json_schema(fn)
        except Exception as e:  # noqa: BLE001 - transformers' TypeHintParsingException / DocstringParsingException
            raise ToolError(f"--tools {path}: tool {fn.__name__!r} cannot be described to the model ({e}); give every "
                            f"argument a type hint and the function a docstring with an Args: section") from None
        schemas[schema["function"]["name"]] = schema
    return Toolbox(str(path), schemas)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The calls in a turn, in order: MiniMind's `<tool_call>{json}</tool_call>` and the Qwen / Hermes form
    (the same with newlines inside the tags); the SmolLM2 family's `<tool_call>[{json}, ...]</tool_call>`, a JSON
    list of calls inside one pair of tags (`[]`: no call); "arguments" an object or a JSON string of one. A call
    that cannot run is kept with its `error` (the policy is told, and the reward counts it); an opened tag never
    closed too."""
    calls = []
    for body in _CALL_RE.findall(text):
        calls += _parse_body(body.strip())
    tail = text[text.rfind("</tool_call>") + len("</tool_call>"):] if "</tool_call>" in text else text
    if "<tool_call>" in tail:
        calls.append(ToolCall("", {}, "the <tool_call> tag is not closed with </tool_call>"))
    return calls


def _depth(text: str) -> int:
    """How deep the brackets of a JSON text nest (outside its strings)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _loads(text: str) -> tuple[object, str]:
    """The JSON value of a call's text, or why there is none ("" when there is one)."""
    if len(text) > MAX_CALL_CHARS:
        return None, f"the tool call is over {MAX_CALL_CHARS} characters"
    if _depth(text) > MAX_CALL_DEPTH:
        return None, f"the tool call nests brackets over {MAX_CALL_DEPTH} deep"
    try:
        return json.loads(text), ""
    except json.JSONDecodeError as e:
        return None, f"the tool call is not valid JSON ({e.msg} at column {e.colno})"
    except (ValueError, RecursionError) as e:  # an integer over 4,300 digits; a nesting the count above missed
        return None, f"the tool call is not valid JSON ({' '.join(str(e).split())[:200]})"


def _parse_body(body: str) -> list[ToolCall]:
    """The calls between one pair of tags: one JSON object, or a JSON list of them."""
    obj, why = _loads(body)
    if why:
        return [ToolCall("", {}, why)]
    return [_parse_one(o) for o in obj] if isinstance(obj, list) else [_parse_one(obj)]


def _parse_one(obj: object) -> ToolCall:
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict):  # OpenAI's {"function": {...}} wrapper
        obj = obj["function"]
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall("", {}, 'the tool call needs {"name": <tool name>, "arguments": {...}}')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args, why = _loads(args) if args.strip() else ({}, "")
        if why:
            return ToolCall(obj["name"], {}, "the arguments are not a JSON object")
    if not isinstance(args, dict):
        return ToolCall(obj["name"], {}, "the arguments are not a JSON object")
    return ToolCall(obj["name"], args)


def tool_message(name: str, content: str) -> dict:
    """A chat message carrying a tool's reply, as chat templates take it."""
    if len(content) > MAX_RESULT_CHARS:
        content = content[:MAX_RESULT_CHARS] + " ...(cut)"
    return {"role": "tool", "name": name, "content": content}


class ToolRunner:
    """Runs calls in a worker process that imported the tool module (trainer/tool_worker.py, bounded by
    trainer/sandbox.py; started on first use, again after a tool hung or crashed it). `call` never raises: every
    failure is an error message for the policy, and `failed(message)` tells the caller it was one. `max_calls` is
    the calls an episode may make (--max_tool_calls; trainer/multiturn.py answers the rest without running them)."""

    ERROR_PREFIX = "error: "

    def __init__(self, toolbox: Toolbox, timeout: float = 5.0, max_calls: int = 8, limits: Limits | None = None) -> None:
        self.toolbox, self.timeout, self.max_calls = toolbox, float(timeout), int(max_calls)
        # Absolute: the worker runs in a folder of its own.
        self.worker = Worker(_WORKER_MODULE, [str(Path(toolbox.path).resolve())], timeout=self.timeout, noun="tool process",
                             start_timeout=max(30.0, self.timeout), limits=limits)  # the import may take a while

    def close(self) -> None:
        self.worker.close()

    # ---- calls
    def failed(self, message: dict) -> bool:
        return message["content"].startswith(self.ERROR_PREFIX)

    def refuse(self, call: ToolCall, why: str) -> dict:
        """The error message answering a call that is not run (`why`: a phrase the policy reads)."""
        return tool_message(call.name or "unknown", self.ERROR_PREFIX + why)

    def call(self, call: ToolCall) -> dict:
        """The tool message answering `call` (an error message when it could not run, raised, hung or crashed)."""
        if call.error:
            return self.refuse(call, call.error)
        if call.name not in self.toolbox.schemas:
            return self.refuse(call, f"unknown tool {call.name!r}; the tools are {', '.join(self.toolbox.names)}")
        out = self.worker.call({"name": call.name, "arguments": call.arguments})
        reply = out.reply
        if reply is None:  # hung, crashed, an overlong reply, or the worker did not start: a fresh one next time
            return self.refuse(call, f"{call.name} {out.failure}")
        if isinstance(reply.get("error"), str):  # the worker's own handler failed (a tool's exception that cannot print)
            return self.refuse(call, f"{call.name}: {reply['error']}")
        if not isinstance(reply.get("ok"), bool) or not isinstance(reply.get("content"), str):
            self.worker.close()  # a tool wrote to the reply channel itself
            return self.refuse(call, f"{call.name} garbled the tool process's reply")
        return tool_message(call.name, reply["content"] if reply["ok"] else self.ERROR_PREFIX + reply["content"])
