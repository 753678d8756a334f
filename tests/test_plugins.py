"""trainer/plugins.py: the one loader of user code. Its callers' flag-worded errors are tested with them
(tests/test_rewards.py load_reward_fn, tests/test_tools.py load_tools)."""

import subprocess
import sys
from pathlib import Path

import pytest

from trainer import plugins

ROOT = Path(__file__).resolve().parents[1]


def test_two_files_with_one_stem_stay_two_modules(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "rules.py").write_text("WHO = 'a'\n")
    (tmp_path / "b" / "rules.py").write_text("WHO = 'b'\n")
    a, b = plugins.import_file(tmp_path / "a" / "rules.py"), plugins.import_file(tmp_path / "b" / "rules.py")
    assert (a.WHO, b.WHO) == ("a", "b") and a.__name__ != b.__name__
    assert sys.modules[a.__name__] is a  # registered, so dataclasses and pickle find it


def test_a_dataclass_in_a_plugin_works(tmp_path):
    p = tmp_path / "dc.py"
    p.write_text("from dataclasses import dataclass\n@dataclass\nclass Row:\n    x: int\n")
    assert plugins.import_file(p).Row(3).x == 3


def test_a_failed_import_leaves_no_module_behind(tmp_path):
    p = tmp_path / "broken.py"
    p.write_text("raise SystemExit(2)\n")
    before = set(sys.modules)
    with pytest.raises(SystemExit):
        plugins.import_file(p)
    assert set(sys.modules) == before


def test_a_file_python_cannot_load_says_so(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_text("x = 1\n")
    with pytest.raises(plugins.NotPythonSource, match="not loadable as a Python module"):
        plugins.import_file(p)


def test_targets_are_files_or_dotted_modules(tmp_path):
    assert plugins.is_file_target("x.py") and plugins.is_file_target("dir/x") and plugins.is_file_target("dir\\x")
    assert not plugins.is_file_target("package.module")
    assert plugins.import_target("examples.custom_rewards").__name__ == "examples.custom_rewards"
    assert hasattr(plugins.import_target(str(ROOT / "examples" / "custom_rewards.py")), "numeric_closeness")


def test_the_loader_imports_no_torch():
    # The tool worker imports it and must start in a fraction of a second.
    code = "import sys, trainer.plugins; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
