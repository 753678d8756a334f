"""The house's arrows: the PPO parts (trainer/*.py) never import the run's mechanics (trainer/run/), and
no package imports back into one that imports it (model, dataset <- trainer <- trainer.run <- train_ppo)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ORDER = ["model", "dataset", "trainer", "trainer.run"]  # a package may import only those before it (and itself)


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def _package(module: str) -> str | None:
    for pkg in reversed(ORDER):
        if module == pkg or module.startswith(pkg + "."):
            return pkg
    return None


def test_ppo_parts_never_import_the_run_mechanics():
    for path in sorted((ROOT / "trainer").glob("*.py")):
        bad = [m for m in _imports(path) if _package(m) == "trainer.run"]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_packages_import_one_way():
    for pkg in ORDER:
        folder = ROOT.joinpath(*pkg.split("."))
        for path in sorted(folder.glob("*.py")):
            for m in _imports(path):
                dep = _package(m)
                if dep is not None and ORDER.index(dep) > ORDER.index(pkg):
                    raise AssertionError(f"{path.relative_to(ROOT)} ({pkg}) imports {m} ({dep}): an arrow backwards")


def test_no_estimator_or_loss_name_is_compared_outside_the_registry():
    import trainer.estimators
    import trainer.losses  # noqa: F401 - both imported for their registrations (one F401 covers the shared name)
    from trainer.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES

    names = set(ADVANTAGE_ESTIMATORS) | set(POLICY_LOSSES)
    for path in [ROOT / "train_ppo.py", *sorted((ROOT / "trainer").rglob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare):
                consts = [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
                hit = names & set(consts)
                assert not hit, f"{path.relative_to(ROOT)}:{node.lineno} compares {sorted(hit)} by name"
