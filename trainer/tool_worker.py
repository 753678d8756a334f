"""The child process of trainer/tools.py's ToolRunner: imports a tool module, then answers one JSON line per call.

    python -m trainer.tool_worker TOOLS.py    # stdin: {"name": ..., "arguments": {...}} per line
                                              # stdout: {"ready": true} once, then {"ok": bool, "content": str} per call

Imports nothing of the trainer but its plug-in loader (no torch): it starts in a fraction of a second. What a
tool prints goes to stderr, so it cannot garble the replies.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys

from trainer import plugins  # standard library only, like this worker


def main(path: str) -> None:
    out = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")  # the reply channel
    os.dup2(2, 1)  # a tool's print() lands on stderr
    sys.stdout = sys.stderr
    # Ctrl-C and a scheduler's SIGTERM reach the whole process group: they are the trainer's to handle (it finishes
    # its step, whose tool calls must still run, then stops us). Should the trainer die instead, so do we (Linux).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def reply(**kw) -> None:
        out.write(json.dumps(kw, ensure_ascii=False) + "\n")

    try:
        module = plugins.import_file(path)
    except BaseException as e:  # noqa: BLE001
        reply(ready=False, error=f"{type(e).__name__}: {e}")
        return
    reply(ready=True)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            result = getattr(module, req["name"])(**req["arguments"])
            text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)
            reply(ok=True, content=text)
        except BaseException as e:  # noqa: BLE001 - a tool's exception (even SystemExit) is the model's error message
            reply(ok=False, content=f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    main(sys.argv[1])
