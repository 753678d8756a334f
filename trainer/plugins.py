"""The one way user code is loaded: a Python file by its path (--tools FILE.py, --reward_fn FILE.py:fn) or an
importable module by its dotted name (--reward_fn package.module:fn).

Standard library only: the tool worker (trainer/tool_worker.py) imports it and must start without torch.
Callers word their own errors (each names its flag); whatever the user's module raises passes through.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


class NotPythonSource(ImportError):
    """The path is no module importlib can load (no loader for its suffix)."""


def is_file_target(target: str) -> bool:
    """Whether `target` names a file ("x.py", "dir/x") rather than a dotted module name."""
    return target.endswith(".py") or "/" in target or "\\" in target


def import_file(path: str | Path) -> ModuleType:
    """Import the Python file at `path` as a module of its own. Raises NotPythonSource when it cannot be one,
    and whatever the module raises while it runs (SystemExit too: the caller decides)."""
    path = Path(path)
    resolved = path.resolve()
    # Unique per path so two files with the same stem do not replace each other.
    name = f"_minippo_plugin_{resolved.stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise NotPythonSource(f"{str(path)!r} is not loadable as a Python module")
    module = importlib.util.module_from_spec(spec)
    # Registered before exec as importlib's recipe does (dataclasses/pickle look modules up there).
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def import_target(target: str) -> ModuleType:
    """A file (see is_file_target) through import_file, else the module `target` names through importlib."""
    return import_file(target) if is_file_target(target) else importlib.import_module(target)
