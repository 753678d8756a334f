"""MiniMind's six mock tools, so that its agent RL data (`agent_rl.jsonl`) drops in:

    python train_ppo.py --tools dataset/minimind_tools.py --data_path dataset/agent_rl.jsonl \\
        --advantage_estimator grpo --num_generations 4 --max_turns 3 --max_total_len 1024

The names and arguments are those of MiniMind's `trainer/train_agent.py`, and the answers come from the same
mock tables, because its rows' ground truths ("gt") were written from them: a calculator, a unit converter, and
weather, time, exchange-rate and translation look-ups. Unlike MiniMind's, a look-up this table does not have is
an error the policy reads ("error: ..."), not a made-up default, and the calculator evaluates arithmetic
without `eval`.
"""

from __future__ import annotations

import ast
import math
import operator

# MiniMind's mock data, as its agent rows assume it.
WEATHER = {"北京": ("28°C", "晴"), "上海": ("15°C", "多云"), "广州": ("32°C", "闷热"), "深圳": ("30°C", "晴"),
           "杭州": ("22°C", "阴"), "成都": ("18°C", "小雨"), "武汉": ("25°C", "多云"), "南京": ("20°C", "晴"),
           "西安": ("16°C", "大风"), "重庆": ("26°C", "阴"), "Tokyo": ("12°C", "晴"), "New York": ("8°C", "多云"),
           "London": ("5°C", "小雨"), "Paris": ("10°C", "阴"), "Sydney": ("25°C", "晴朗")}
TIMES = {"Asia/Shanghai": "2025-03-07 14:30:00", "America/New_York": "2025-03-07 01:30:00",
         "Europe/London": "2025-03-07 06:30:00", "Asia/Tokyo": "2025-03-07 15:30:00",
         "Europe/Paris": "2025-03-07 07:30:00", "Australia/Sydney": "2025-03-07 17:30:00"}
RATES = {("USD", "CNY"): 7.21, ("EUR", "CNY"): 7.85, ("GBP", "CNY"): 9.12, ("JPY", "CNY"): 0.048,
         ("USD", "EUR"): 0.92, ("USD", "GBP"): 0.79, ("CNY", "JPY"): 20.83, ("AUD", "CNY"): 4.72}
TRANSLATIONS = {("你好世界", "english"): "Hello World", ("Good morning", "chinese"): "早上好",
                ("今天天气真好", "english"): "The weather is nice today", ("I love programming", "chinese"): "我喜欢编程",
                ("机器学习很有趣", "english"): "Machine learning is interesting", ("Happy birthday", "chinese"): "生日快乐"}
# A factor per (from, to); the temperature entries are MiniMind's factors, not real conversions.
UNITS = {("km", "miles"): 0.621371, ("miles", "km"): 1.60934, ("kg", "pounds"): 2.20462, ("pounds", "kg"): 0.453592,
         ("meters", "feet"): 3.28084, ("feet", "meters"): 0.3048, ("celsius", "fahrenheit"): 1.8,
         ("fahrenheit", "celsius"): 0.5556}

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_FUNCTIONS = {name: getattr(math, name) for name in ("sqrt", "log", "log2", "log10", "exp", "sin", "cos", "tan",
                                                     "floor", "ceil", "factorial")} | {"abs": abs, "round": round}
_CONSTANTS = {"pi": math.pi, "e": math.e}
# What models write for the operators (MiniMind's substitutions).
_SPELLINGS = {"^": "**", "×": "*", "÷": "/", "−": "-", "（": "(", "）": ")"}


def _number(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _number(node.left), _number(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 100:
            raise ValueError("the exponent is too large")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_number(node.operand))
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.Call) and not node.keywords:
        fn = node.func
        name = fn.attr if isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) and fn.value.id == "math" \
            else fn.id if isinstance(fn, ast.Name) else None
        if name in _FUNCTIONS:
            return _FUNCTIONS[name](*[_number(a) for a in node.args])
    raise ValueError("only numbers, + - * / // % ** (or ^), parentheses, pi, e and math functions are allowed")


def calculate_math(expression: str) -> dict:
    """Evaluate a math expression.

    Args:
        expression: the expression, e.g. (3 + 4) * 2 ^ 3 or sqrt(16)
    """
    text = expression
    for spelled, op in _SPELLINGS.items():
        text = text.replace(spelled, op)
    if len(text) > 200:
        raise ValueError("the expression is too long")
    return {"result": str(_number(ast.parse(text.strip(), mode="eval").body))}


def unit_converter(value: float, from_unit: str, to_unit: str) -> dict:
    """Convert a value between units.

    Args:
        value: the value to convert
        from_unit: km, miles, kg, pounds, meters, feet, celsius or fahrenheit
        to_unit: the unit to convert to
    """
    key = (from_unit.lower(), to_unit.lower())
    if key not in UNITS:
        raise ValueError(f"no conversion from {from_unit} to {to_unit}; known: "
                         + ", ".join(f"{a}->{b}" for a, b in UNITS))
    return {"result": round(float(value) * UNITS[key], 4)}


def get_current_weather(location: str) -> dict:
    """Get the current weather of a city.

    Args:
        location: the city, e.g. 北京 or London
    """
    if location not in WEATHER:
        raise ValueError(f"no weather for {location}; known: {', '.join(WEATHER)}")
    temperature, condition = WEATHER[location]
    return {"city": location, "temperature": temperature, "humidity": "65%", "condition": condition}


def get_current_time(timezone: str = "Asia/Shanghai") -> dict:
    """Get the current date and time in a time zone.

    Args:
        timezone: an IANA time zone, e.g. Asia/Shanghai
    """
    if timezone not in TIMES:
        raise ValueError(f"unknown time zone {timezone}; known: {', '.join(TIMES)}")
    return {"datetime": TIMES[timezone], "timezone": timezone}


def get_exchange_rate(from_currency: str, to_currency: str) -> dict:
    """Get the exchange rate between two currencies.

    Args:
        from_currency: the currency code to convert from, e.g. USD
        to_currency: the currency code to convert to, e.g. CNY
    """
    key = (from_currency.upper(), to_currency.upper())
    if key not in RATES:
        raise ValueError(f"no rate for {from_currency}->{to_currency}")
    return {"from": key[0], "to": key[1], "rate": RATES[key]}


def translate_text(text: str, target_language: str) -> dict:
    """Translate a text.

    Args:
        text: the text to translate
        target_language: english or chinese
    """
    key = (text.strip(), target_language.lower())
    if key not in TRANSLATIONS:
        raise ValueError(f"cannot translate {text!r} into {target_language}")
    return {"translated_text": TRANSLATIONS[key]}


TOOLS = [calculate_math, unit_converter, get_current_weather, get_current_time, get_exchange_rate, translate_text]
