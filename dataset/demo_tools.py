"""The demo's tool (`--tools dataset/demo_tools.py`): a calculator the policy can call for the products it cannot
work out itself. A tool module is plain Python: each public function, with type hints and an Args: docstring,
becomes a tool the chat template lists (trainer/tools.py)."""

from __future__ import annotations

import ast
import operator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError("only numbers, + - * / and parentheses are allowed")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / and parentheses, e.g. 37 * 8
    """
    text = expression.replace("×", "*").replace("x", "*").replace("÷", "/")
    if len(text) > 200:
        raise ValueError("the expression is too long")
    value = _eval(ast.parse(text, mode="eval").body)
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"
