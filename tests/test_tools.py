"""trainer/tools.py: tool modules, call parsing, and the runner (time limits, crashes, errors as messages)."""

from __future__ import annotations

import time

import pytest

from tests.helpers import ROOT
from trainer.tools import ToolCall, ToolError, ToolRunner, load_tools, parse_tool_calls

TOOLS_SRC = '''
import os
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    print("noise on stdout")  # must not garble the reply channel
    return a + b


def nap(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "awake"


def spin() -> str:
    """Never return."""
    while True:
        pass


def die() -> str:
    """Take the process down."""
    os._exit(3)


def table() -> dict:
    """A structured result."""
    return {"rows": [1, 2], "unit": "m"}


def _helper():
    return 0
'''


@pytest.fixture()
def module(tmp_path):
    p = tmp_path / "my_tools.py"
    p.write_text(TOOLS_SRC)
    return p


def test_public_functions_become_schemas(module):
    box = load_tools(module)
    assert box.names == ["add", "nap", "spin", "die", "table"]  # not _helper, not imported names
    add = box.schemas["add"]["function"]
    assert add["description"] == "Add two integers."
    assert add["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first"}
    assert add["parameters"]["required"] == ["a", "b"]


def test_a_tool_module_given_by_a_relative_path_runs_in_the_workers_own_folder(monkeypatch):
    monkeypatch.chdir(ROOT)
    runner = ToolRunner(load_tools("dataset/demo_tools.py"), timeout=5.0)  # as configs/demo_tools.yaml names it
    try:
        assert runner.call(ToolCall("calculator", {"expression": "2 * 3"}))["content"] == "6"
    finally:
        runner.close()


def test_the_demo_calculator():
    from dataset.demo_tools import calculator
    assert calculator("37 * 8") == "296" and calculator("37 × 8") == "296" and calculator("7 / 2") == "3.5"
    with pytest.raises(ValueError):
        calculator("__import__('os').system('true')")
    assert load_tools(ROOT / "dataset" / "demo_tools.py").names == ["calculator"]


@pytest.mark.parametrize("src, message", [
    ("def f(x):\n    '''Doc.\n\n    Args:\n        x: a\n    '''\n", "tool 'f' cannot be described to the model"),
    ("def f(x: int):\n    return x\n", "tool 'f' cannot be described to the model"),
    ("import json\n_x = 1\n", "no tools in it"),
    ("def f(:\n", "could not import it (SyntaxError"),
    ("import not_a_module_anywhere\n", "could not import it (ModuleNotFoundError"),
    ("raise SystemExit(2)\n", "could not import it (SystemExit"),
])
def test_bad_modules_are_one_line(tmp_path, src, message):
    p = tmp_path / "bad.py"
    p.write_text(src)
    with pytest.raises(ToolError, match=message.replace("(", r"\(")) as e:
        load_tools(p)
    assert str(p) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ToolError, match="file not found"):
        load_tools(tmp_path / "missing.py")


def test_an_explicit_tools_list_is_the_offer(tmp_path):
    p = tmp_path / "t.py"
    p.write_text("def a(x: int) -> int:\n    '''A.\n\n    Args:\n        x: x\n    '''\n    return x\n\n"
                 "def b(x: int) -> int:\n    '''B.\n\n    Args:\n        x: x\n    '''\n    return x\n\nTOOLS = [b]\n")
    assert load_tools(p).names == ["b"]


@pytest.mark.parametrize("text, calls", [
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', [("add", {"a": 1, "b": 2}, None)]),
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', [("add", {"a": 1}, None)]),  # MiniMind's
    ('x<tool_call>{"name": "a", "arguments": {}}</tool_call> y <tool_call>{"name": "b"}</tool_call>',
     [("a", {}, None), ("b", {}, None)]),
    ('<tool_call>{"function": {"name": "add", "arguments": {"a": 1}}}</tool_call>', [("add", {"a": 1}, None)]),
    ("no call here", []),
    ('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>', [("", {}, "not valid JSON")]),
    ('<tool_call>{"arguments": {}}</tool_call>', [("", {}, "needs {\"name\"")]),
    ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', [("add", {}, "not a JSON object")]),
    ('<tool_call>{"name": "add"', [("", {}, "not closed")]),
    # The SmolLM2 family's form: a JSON list of calls inside one pair of tags, [] for none.
    ('<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}]</tool_call>', [("add", {"a": 1, "b": 2}, None)]),
    ('<tool_call>[\n{"name": "a", "arguments": {}},\n{"name": "b", "arguments": {"x": 1}}\n]</tool_call>',
     [("a", {}, None), ("b", {"x": 1}, None)]),
    ('<tool_call>[]</tool_call>', []),
    ('<tool_call>[{"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]</tool_call>',
     [("add", {"a": 1}, None)]),
    ('<tool_call>[{"name": "a"}, 5, {"arguments": {}}]</tool_call>',
     [("a", {}, None), ("", {}, "needs {\"name\""), ("", {}, "needs {\"name\"")]),
    ('<tool_call>[{"name": "add", "arguments": {"a": 1}},]</tool_call>', [("", {}, "not valid JSON")]),
])
def test_parse_tool_calls(text, calls):
    got = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in got] == [(n, a) for n, a, _ in calls]
    for c, (_, _, err) in zip(got, calls):
        assert (c.error is None) if err is None else (err in c.error)


def test_runner_turns_every_failure_into_a_message(module):
    runner = ToolRunner(load_tools(module), timeout=1.0)
    try:
        ok = runner.call(ToolCall("add", {"a": 2, "b": 3}))
        assert ok == {"role": "tool", "name": "add", "content": "5"} and not runner.failed(ok)
        assert runner.call(ToolCall("table", {}))["content"] == '{"rows": [1, 2], "unit": "m"}'
        for call, text in [(ToolCall("add", {"a": 1}), "TypeError"), (ToolCall("nope", {}), "unknown tool 'nope'"),
                           (ToolCall("", {}, "the tool call is not valid JSON"), "not valid JSON")]:
            msg = runner.call(call)
            assert runner.failed(msg) and text in msg["content"]
        t0 = time.time()
        hung = runner.call(ToolCall("spin", {}))
        assert runner.failed(hung) and "timed out after 1 s" in hung["content"] and time.time() - t0 < 5
        assert runner.call(ToolCall("add", {"a": 1, "b": 1}))["content"] == "2"  # a fresh process after the kill
        crashed = runner.call(ToolCall("die", {}))
        assert runner.failed(crashed) and "crashed the tool process" in crashed["content"]
        assert runner.call(ToolCall("nap", {"seconds": 0.01}))["content"] == "awake"
    finally:
        runner.close()


# ---------------------------------------------------------------- a tool acting as an attacker
ATTACKER_SRC = '''
import json
import os
import sys
import time


def fork_and_hang(pid_file: str) -> str:
    """Leave a sleeping grandchild behind, then hang.

    Args:
        pid_file: where the grandchild's pid goes
    """
    child = os.fork()
    if child == 0:
        time.sleep(600)
        os._exit(0)
    with open(pid_file, "w") as f:
        f.write(str(child))
    time.sleep(600)
    return "never"


def secrets() -> str:
    """Every variable that looks like a credential."""
    return json.dumps({k: v for k, v in os.environ.items()
                       if k.endswith(("_TOKEN", "_KEY")) or k.startswith(("HF_", "WANDB_", "SWANLAB_"))})


def flood(mb: int) -> str:
    """Print `mb` megabytes.

    Args:
        mb: how many
    """
    chunk = "x" * (1 << 20)
    for _ in range(mb):
        sys.stdout.write(chunk)
    sys.stdout.flush()
    return "flooded"


def huge() -> str:
    """A 10 MB reply."""
    return "y" * (10 << 20)
'''


@pytest.fixture()
def attacker(tmp_path):
    p = tmp_path / "attacker_tools.py"
    p.write_text(ATTACKER_SRC)
    runner = ToolRunner(load_tools(p), timeout=1.0)
    yield runner
    runner.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie nobody reaps has exited
    except (OSError, IndexError):
        return False


def test_a_tools_grandchild_dies_with_it_at_the_timeout(attacker, tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    msg = attacker.call(ToolCall("fork_and_hang", {"pid_file": str(pid_file)}))
    assert attacker.failed(msg) and "timed out after 1 s" in msg["content"]
    grandchild = int(pid_file.read_text())
    deadline = time.time() + 2
    while _alive(grandchild) and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def test_a_tool_sees_none_of_the_trainers_credentials(attacker, monkeypatch):
    for k in ("HF_TOKEN", "MY_SERVICE_TOKEN", "WANDB_API_KEY", "SWANLAB_API_KEY", "OPENAI_API_KEY", "HF_ENDPOINT"):
        monkeypatch.setenv(k, "secret")
    attacker.close()  # a fresh worker, started with the variables above set in the trainer
    assert attacker.call(ToolCall("secrets", {}))["content"] == "{}"


def test_a_flood_on_stdout_and_a_huge_reply_are_bounded_and_cut(attacker, capfd):
    capfd.readouterr()
    flooded = attacker.call(ToolCall("flood", {"mb": 100}))  # past the 64 MiB file-size limit of the worker's log
    assert attacker.failed(flooded) and "File too large" in flooded["content"]
    assert len(capfd.readouterr().err) < 1000  # none of it reached the trainer's stderr
    huge = attacker.call(ToolCall("huge", {}))
    assert not attacker.failed(huge) and huge["content"] == "y" * 2000 + " ...(cut)"


def test_a_deeply_nested_or_huge_call_is_an_error_message_not_an_exception():
    deep = "[" * 100_000 + "]" * 100_000
    for body in (deep, '{"name": "add", "arguments": ' + "[" * 900 + "]" * 900 + "}",
                 '{"name": "add", "arguments": {"a": ' + "9" * 5000 + "}}", '{"name": "add", "arguments": "' + "[" * 1000 + '"}'):
        calls = parse_tool_calls(f"<tool_call>{body}</tool_call>")
        assert len(calls) == 1 and calls[0].error, body[:40]
    args = "{\\\"a\\\": " * 2000 + "1" + "}" * 2000  # a JSON string holding 2,000 nested objects
    nested_args = parse_tool_calls('<tool_call>{"name": "add", "arguments": "' + args + '"}</tool_call>')
    assert nested_args == [ToolCall("add", {}, "the arguments are not a JSON object")]


def test_a_worker_that_fails_to_start_is_an_error_message_not_an_exception(tmp_path, monkeypatch):
    p = tmp_path / "needs_a_token.py"
    p.write_text("import os\n\nif 'MY_TOOL_TOKEN' not in os.environ:\n    raise RuntimeError('no token')\n\n\n"
                 "def add(a: int) -> int:\n    '''Add.\n\n    Args:\n        a: a\n    '''\n    return a\n")
    monkeypatch.setenv("MY_TOOL_TOKEN", "x")  # the trainer has it (load_tools imports the module here); the worker not
    runner = ToolRunner(load_tools(p), timeout=1.0)
    try:
        for _ in range(2):
            msg = runner.call(ToolCall("add", {"a": 1}))
            assert runner.failed(msg) and "could not start the tool process (RuntimeError: no token)" in msg["content"]
    finally:
        runner.close()
