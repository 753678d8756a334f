"""Tools for multi-turn rollouts: load a tool module, parse the policy's tool calls, run them, and render what
the tools said back into the chat as the template would.

    toolbox = load_tools("dataset/demo_tools.py")     # every public function -> a JSON schema (type hints + docstring)
    calls = parse_tool_calls(text)                    # <tool_call>{"name": ..., "arguments": {...}}</tool_call>, or a [list]
    runner = ToolRunner(toolbox, timeout=5.0)         # runs them in a child process, with a time limit per call
    message = runner.call(calls[0])                   # {"role": "tool", "name": ..., "content": ...}; never raises

A tool module is plain Python: functions with type hints and a Google-style docstring (transformers'
`get_json_schema` turns each into the schema the chat template renders with `tools=`). A module that defines
`TOOLS = [fn, ...]` offers exactly those; otherwise every public function defined in it.

Calls run in a child process (one per trainer process, started on first use), so a tool that hangs is killed
at its time limit and one that crashes or exits takes only the child with it; either way the policy reads an
error message, as it does for a malformed call, an unknown tool or bad arguments. Those are the model's
mistakes, a reward signal (trainer/rewards.py), never the run's.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import select
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from trainer import plugins

# A tool's reply is cut to this many characters: a runaway result must not fill the context.
MAX_RESULT_CHARS = 2000
_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
# The worker runs as a module with the repository root on its path: run as a script, its own folder (trainer/)
# would come first on sys.path, where a module could shadow the standard library's for the child alone.
_WORKER_MODULE = "trainer.tool_worker"
_ROOT = str(Path(__file__).resolve().parent.parent)


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
    from transformers.utils import get_json_schema  # noqa: PLC0415 - transformers is heavy; only tool runs need it

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


def _parse_body(body: str) -> list[ToolCall]:
    """The calls between one pair of tags: one JSON object, or a JSON list of them."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return [ToolCall("", {}, f"the tool call is not valid JSON ({e.msg} at column {e.colno})")]
    return [_parse_one(o) for o in obj] if isinstance(obj, list) else [_parse_one(obj)]


def _parse_one(obj: object) -> ToolCall:
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict):  # OpenAI's {"function": {...}} wrapper
        obj = obj["function"]
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall("", {}, 'the tool call needs {"name": <tool name>, "arguments": {...}}')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
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
    """Runs calls in a child process that imported the tool module (started on first use, again after a tool
    hung or crashed it). `call` never raises: every failure is an error message for the policy, and
    `failed(message)` tells the caller it was one."""

    ERROR_PREFIX = "error: "

    def __init__(self, toolbox: Toolbox, timeout: float = 5.0) -> None:
        self.toolbox, self.timeout = toolbox, float(timeout)
        self._proc: subprocess.Popen | None = None

    # ---- the child
    def _start(self) -> subprocess.Popen:
        path = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p)
        proc = subprocess.Popen([sys.executable, "-m", _WORKER_MODULE, self.toolbox.path], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, encoding="utf-8", bufsize=1,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path})
        ready = self._read(proc, max(30.0, self.timeout))  # the import may take a while
        if not isinstance(ready, dict) or not ready.get("ready"):
            self._kill(proc)
            why = ready.get("error") if isinstance(ready, dict) else f"it {ready}"
            raise ToolError(f"--tools {self.toolbox.path}: the tool process did not start ({why})")
        return proc

    @staticmethod
    def _read(proc: subprocess.Popen, timeout: float) -> dict | str:
        """One JSON line from the child within `timeout` seconds, else "hung" or "died"."""
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        if not ready:
            return "hung"
        line = proc.stdout.readline()
        return json.loads(line) if line else "died"

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        proc.kill()
        proc.wait()

    def close(self) -> None:
        if self._proc is not None:
            self._kill(self._proc)
            self._proc = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ---- calls
    def failed(self, message: dict) -> bool:
        return message["content"].startswith(self.ERROR_PREFIX)

    def call(self, call: ToolCall) -> dict:
        """The tool message answering `call` (an error message when it could not run, raised, hung or crashed)."""
        err = self.ERROR_PREFIX
        if call.error:
            return tool_message(call.name or "unknown", err + call.error)
        if call.name not in self.toolbox.schemas:
            return tool_message(call.name, f"{err}unknown tool {call.name!r}; the tools are {', '.join(self.toolbox.names)}")
        if self._proc is None or self._proc.poll() is not None:
            self._proc = self._start()
        try:
            self._proc.stdin.write(json.dumps({"name": call.name, "arguments": call.arguments}) + "\n")
            self._proc.stdin.flush()
            reply = self._read(self._proc, self.timeout)
        except (BrokenPipeError, OSError, ValueError):
            reply = "died"
        if not isinstance(reply, dict):  # hung, or the tool took the process with it: start a fresh one next time
            self.close()
            why = f"timed out after {self.timeout:g} s" if reply == "hung" else "crashed the tool process"
            return tool_message(call.name, f"{err}{call.name} {why}")
        return tool_message(call.name, reply["content"] if reply["ok"] else err + reply["content"])
