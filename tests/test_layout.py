"""The repository's own layout (docs/layout.md): no module can shadow another, and every test starts Python
the way the user ran it.

A file run as a script puts its folder first on sys.path (train_ppo.py: the repository root; a script in
scripts/, builders/, benchmarks/ or examples/: that folder), and `python -m` puts the working directory
there. A module of ours named like a standard-library module or an installed dependency's top-level package
would then be imported in its place (trainer/types.py once broke the tool worker this way in every fresh
virtualenv). So no module or package of ours, wherever it sits, may have such a name.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", "out", "checkpoints", "runs", "swanlog", "__pycache__", ".pytest_cache", ".venv", "venv",
             ".whl", ".mypy_cache", ".ruff_cache"}
# A subprocess started as "python ..." runs whatever interpreter the PATH finds first (the machine's, not the
# venv's); torchrun and pytest are the same: use sys.executable (-m torch.distributed.run, -m pytest).
PATH_PROGRAMS = {"python", "python3", "torchrun", "pytest"}
# The top-level folders of our code (docs/layout.md): the library, the tests, and the runnable files by audience.
OUR_FOLDERS = {"tests", "trainer", "model", "dataset", "scripts", "builders", "benchmarks", "examples"}


def _skipped(folder: str) -> bool:
    """Not our code: build and cache folders, and virtualenvs (.venv, scripts/setup_engine.sh's .venv-engine)."""
    return folder in SKIP_DIRS or folder.startswith(".venv")


def _python_files() -> list[Path]:
    files = []
    for top, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not _skipped(d)]  # pruned: a virtualenv is not walked at all
        files += [(Path(top) / n).relative_to(ROOT) for n in names if n.endswith(".py")]
    return sorted(files)


def test_no_module_or_package_shadows_the_standard_library_or_a_dependency():
    taken = {name: "the standard library" for name in sys.stdlib_module_names}
    for top, dists in importlib.metadata.packages_distributions().items():
        taken.setdefault(top, "the installed package " + ", ".join(sorted(set(dists))))
    clashes = []
    for rel in _python_files():
        names = [(rel, rel.stem)] + [(Path(*rel.parts[: i + 1]), part) for i, part in enumerate(rel.parts[:-1])]
        for where, name in names:
            if name in taken and name != "__init__":
                clashes.append(f"{where}: rename it ('{name}' is a module of {taken[name]})")
    assert not sorted(set(clashes)), "\n".join(sorted(set(clashes)))


def test_the_checker_would_name_a_shadowing_file():
    # The rule above must bite: the names the project once had are both taken.
    assert "types" in sys.stdlib_module_names and "logging" in sys.stdlib_module_names
    assert not (ROOT / "trainer" / "types.py").exists() and not (ROOT / "trainer" / "run" / "logging.py").exists()


def _path_programs(tree: ast.AST) -> list[int]:
    """Lines where a list or tuple starts with "python", "torchrun", ...: an argv that the PATH resolves."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple)) and node.elts:
            first = node.elts[0]
            if isinstance(first, ast.Constant) and first.value in PATH_PROGRAMS:
                lines.append(node.lineno)
    return lines


def test_every_subprocess_starts_python_as_sys_executable():
    bad = []
    for rel in _python_files():
        if rel.parts[0] not in OUR_FOLDERS and rel.name != "train_ppo.py":
            continue
        if rel == Path("tests/test_readme.py"):  # holds the README's program names, not a command to run
            continue
        for line in _path_programs(ast.parse((ROOT / rel).read_text(encoding="utf-8"))):
            bad.append(f"{rel}:{line}: start the program with sys.executable (python -m ...), not from the PATH")
    assert not bad, "\n".join(bad)


def test_the_argv_check_finds_a_path_python():
    assert _path_programs(ast.parse('subprocess.run(["python", "-c", "pass"])')) == [1]
    assert _path_programs(ast.parse('subprocess.run([sys.executable, "-c", "pass"])')) == []


def test_train_ppo_stays_a_script_that_reads_as_the_algorithm():
    """The mechanics live in trainer/run/, the math in trainer/: the script itself stays short (the house rule)."""
    n = len((ROOT / "train_ppo.py").read_text(encoding="utf-8").splitlines())
    assert n <= 350, f"train_ppo.py has {n} lines (at most 350): move mechanics to trainer/run/ or math to trainer/"
