"""The floors of docs/layout.md, checked from the source: an import points down, never up.

model/ (the networks, their weights and sampling) is the bottom floor; trainer/ (PPO's parts) stands on it;
trainer/run/ (how a run is built and kept) on those; scripts/, builders/ and benchmarks/ (the runnable files) on
top. So model/ imports nothing from trainer/ or the runnable folders, trainer/ nothing from the runnable folders,
and PPO's parts (the modules directly in trainer/) nothing from trainer/run/: a part that reached into the run's
mechanics could no longer be used, tested or read without them. benchmarks/ may import anything.

Read with `ast`, nothing imported or run: every import statement counts, inside functions and under
`if TYPE_CHECKING:` too (a deferred import is still an arrow), relative imports resolved against the file's
package, and `importlib.import_module("...")` / `__import__("...")` with a literal name.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNNABLE = ("scripts", "benchmarks", "builders")

# (which files, the modules they must not import, why): a file is named by its path under the root.
RULES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("model/**/*.py", ("trainer", *RUNNABLE), "model/ is the bottom floor: it imports nothing from trainer/ or the runnable folders"),
    ("trainer/**/*.py", RUNNABLE, "trainer/ imports nothing from the runnable folders (scripts/, benchmarks/, builders/)"),
    ("trainer/*.py", ("trainer.run",), "PPO's parts (trainer/*.py) import nothing from trainer/run/, the run's mechanics"),
)


def _package(rel: Path) -> list[str]:
    """The package a file's relative imports start from (its folder, __init__.py included)."""
    return list(rel.parts[:-1])


def imports(tree: ast.AST, rel: Path) -> Iterator[tuple[ast.AST, list[str]]]:
    """(statement, the dotted modules it may import) for every import in the tree. `from a import b` may import
    a or a.b (b may be a module: `from trainer import run`)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield node, [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = _package(rel)
                base = ".".join(pkg[: len(pkg) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            yield node, [base] + [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if name in ("import_module", "__import__"):
                yield node, [node.args[0].value]


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations(root: Path) -> list[tuple[str, str, str, str]]:
    """Every upward import under `root`: (file:line, the statement, the module it reaches, the rule it breaks)."""
    found = []
    for pattern, forbidden, why in RULES:
        for path in sorted(root.glob(pattern)):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(root)
            for node, modules in imports(ast.parse(path.read_text(encoding="utf-8"), filename=str(rel)), rel):
                hit = next((m for m in modules if any(_within(m, p) for p in forbidden)), None)
                if hit is not None:
                    found.append((f"{rel.as_posix()}:{getattr(node, 'lineno', 0)}", ast.unparse(node), hit, why))
    return found


def test_imports_point_down_the_floors():
    bad = [f"{where}: `{statement}` imports {module}: {why}" for where, statement, module, why in violations(ROOT)]
    assert not bad, "imports that point up a floor (docs/layout.md):\n" + "\n".join(bad)


def test_the_checker_names_every_kind_of_upward_import(tmp_path: Path):
    # The rule must bite: a tree with one upward import of each kind, each named with its file and line.
    files = {
        "model/a.py": "import trainer.ppo\n",
        "model/sub/b.py": "def f():\n    from scripts.convert_model import policy_to_hf\n",  # inside a function
        "model/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from builders import train_sft\n",
        "trainer/d.py": "from trainer import run\n",  # a module imported by name from its package
        "trainer/e.py": "from .run.checkpoint import save_resume\n",  # relative
        "trainer/f.py": "import importlib\nx = importlib.import_module('benchmarks.bench_ppo')\n",
        "trainer/run/g.py": "from scripts import eval_policy\n",
        # Allowed: the run's mechanics use PPO's parts and each other; trainer.runtime is not trainer.run.
        "trainer/run/h.py": "from trainer.run import cli\nfrom trainer import ppo\n",
        "trainer/i.py": "from trainer.runtime import Models\nimport model.loader\n",
        "benchmarks/j.py": "from scripts.convert_model import policy_to_hf\nimport trainer.run.setup\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    got = sorted((where, statement, module) for where, statement, module, _ in violations(tmp_path))
    assert got == sorted([
        ("model/a.py:1", "import trainer.ppo", "trainer.ppo"),
        ("model/sub/b.py:2", "from scripts.convert_model import policy_to_hf", "scripts.convert_model"),
        ("model/c.py:3", "from builders import train_sft", "builders"),
        ("trainer/d.py:1", "from trainer import run", "trainer.run"),
        ("trainer/e.py:1", "from .run.checkpoint import save_resume", "trainer.run.checkpoint"),
        ("trainer/f.py:2", "importlib.import_module('benchmarks.bench_ppo')", "benchmarks.bench_ppo"),
        ("trainer/run/g.py:1", "from scripts import eval_policy", "scripts"),
    ]), got
