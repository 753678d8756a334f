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
