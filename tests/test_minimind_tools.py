"""dataset/minimind_tools.py: MiniMind's six mock tools, under the names, arguments and answers its agent rows expect."""

from __future__ import annotations

import json

import pytest

from dataset.minimind_tools import calculate_math, get_current_time, get_current_weather, get_exchange_rate, translate_text, unit_converter
from dataset.rlaif import read_rlaif_jsonl
from tests.helpers import ROOT
from trainer.run.setup import check_tool_rows
from trainer.tools import ToolRunner, load_tools, parse_tool_calls

MODULE = ROOT / "dataset" / "minimind_tools.py"
# The names and required arguments of MiniMind's trainer/train_agent.py TOOLS.
MINIMIND = {"calculate_math": ["expression"], "unit_converter": ["value", "from_unit", "to_unit"],
            "get_current_weather": ["location"], "get_current_time": [],
            "get_exchange_rate": ["from_currency", "to_currency"], "translate_text": ["text", "target_language"]}


def test_the_six_tools_with_minimind_names_and_arguments():
    box = load_tools(MODULE)
    assert box.names == list(MINIMIND)
    for name, required in MINIMIND.items():
        params = box.schemas[name]["function"]["parameters"]
        assert sorted(params.get("required", [])) == sorted(required), name


def test_answers_are_minimind_mock_values():
    assert calculate_math("(3 + 4) * 2 ^ 3") == {"result": "56"}
    assert calculate_math("37 × 8 − 6") == {"result": "290"}
    assert calculate_math("sqrt(16) + math.floor(2.7)") == {"result": "6.0"}
    assert calculate_math("10 / 4") == {"result": "2.5"}
    assert unit_converter(10, "KM", "miles") == {"result": 6.2137}
    assert get_current_weather("北京") == {"city": "北京", "temperature": "28°C", "humidity": "65%", "condition": "晴"}
    assert get_current_time() == {"datetime": "2025-03-07 14:30:00", "timezone": "Asia/Shanghai"}
    assert get_exchange_rate("usd", "CNY") == {"from": "USD", "to": "CNY", "rate": 7.21}
    assert translate_text("你好世界", "English") == {"translated_text": "Hello World"}


@pytest.mark.parametrize("expression", ["__import__('os').system('true')", "2 ** 10000", "open('x')", "x + 1",
                                        "1" * 300])
def test_the_calculator_refuses_what_is_not_arithmetic(expression):
    with pytest.raises(ValueError):
        calculate_math(expression)


def test_unknown_lookups_are_errors_the_model_reads():
    runner = ToolRunner(load_tools(MODULE), timeout=10)
    try:
        text = ('<tool_call>{"name": "get_current_weather", "arguments": {"location": "Atlantis"}}</tool_call>'
                '<tool_call>{"name": "get_current_time", "arguments": "{}"}</tool_call>')
        bad, good = [runner.call(c) for c in parse_tool_calls(text)]
    finally:
        runner.close()
    assert runner.failed(bad) and "no weather for Atlantis" in bad["content"]
    assert not runner.failed(good) and json.loads(good["content"])["datetime"] == "2025-03-07 14:30:00"


def test_a_minimind_agent_row_offering_all_six_is_accepted(tmp_path):
    box = load_tools(MODULE)
    row = {"conversations": [{"role": "system", "content": "你可以使用工具。", "tools": json.dumps(box.schema_list(),
                                                                                          ensure_ascii=False)},
                             {"role": "user", "content": "北京今天天气怎么样？"}, {"role": "assistant", "content": ""}],
           "gt": ["28°C"]}
    path = tmp_path / "agent_rl.jsonl"
    path.write_text(json.dumps(row, ensure_ascii=False) + "\n", encoding="utf-8")
    records, _ = read_rlaif_jsonl(path)
    check_tool_rows(records, box)  # no error: the module defines every tool the row offers
    assert records[0].gt == ["28°C"] and len(records[0].tools) == 6
