"""The worker process of trainer/tools.py's ToolRunner: imports a tool module, then answers one JSON line per call,
bounded by trainer/sandbox.py (its own session, rlimits, a scrubbed environment, a private folder).

    python -m trainer.tool_worker SETTINGS TOOLS.py   # stdin: {"name": ..., "arguments": {...}} per line
                                                      # stdout: {"ready": true} once, then {"ok": bool, "content": str}

Imports nothing of the trainer but the standard-library modules it needs (no torch): it starts in a fraction of
a second. What a tool prints goes to the worker's stderr file, so it cannot garble the replies.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from trainer import plugins, sandbox
from trainer.tools import MAX_RESULT_CHARS


def _cut(text: str) -> str:
    # One character over the cut, so the trainer still sees that it was cut (tools.tool_message marks it).
    return text[:MAX_RESULT_CHARS + 1]


def start(args: list[str]) -> Callable[[dict], dict]:
    """Import the tool module at args[0] (whatever it raises is the worker's start failure) and return the handler."""
    module = plugins.import_file(args[0])

    def handle(req: dict) -> dict:
        try:
            result = getattr(module, req["name"])(**req["arguments"])
            text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)
            return {"ok": True, "content": _cut(text)}
        except BaseException as e:  # noqa: BLE001 - a tool's exception (even SystemExit) is the model's error message
            return {"ok": False, "content": _cut(f"{type(e).__name__}: {e}")}

    return handle


if __name__ == "__main__":
    sandbox.serve(start)
