"""The worker process of trainer/verifier.py: imports reasoning-gym once, then scores one reply per JSON line with the
task's own verifier (dataset/rgym.py `score`), bounded by trainer/sandbox.py.

    python -m trainer.verifier_worker SETTINGS   # stdin: {"reply": str, "row": base64 pickle of the row's rg} per line
                                                 # stdout: {"ready": true} once, then {"score": float} per line

Imports no torch (dataset/rgym.py imports the prompt-row type only where it builds rows).
"""

from __future__ import annotations

import base64
import pickle
from collections.abc import Callable

from dataset import rgym
from trainer import sandbox


def start(args: list[str]) -> Callable[[dict], dict]:
    """Import reasoning-gym (a ReasoningGymError here is the worker's start failure) and return the handler."""
    rgym.import_reasoning_gym()

    def handle(req: dict) -> dict:
        row = pickle.loads(base64.b64decode(req["row"]))  # noqa: S301 - the trainer's own row (trainer/verifier.py), never the policy's
        return {"score": rgym.score(req["reply"], row)}

    return handle


if __name__ == "__main__":
    sandbox.serve(start)
