"""The `calculator` environment: arithmetic problems (builtin:arithmetic) where the model may
call `calculate(expression)` before it answers, scored by the reward function on its answer.

`calculate` evaluates nothing but arithmetic: the expression is parsed with `ast` and walked
over a whitelist — int and float literals, + - * / // % ** and unary + -, parentheses; names,
calls, attributes, comparisons and everything else are refused. Sizes are bounded so that no
expression can take long or much memory: at most `MAX_EXPRESSION_CHARS` characters, powers
with an exponent up to `MAX_EXPONENT`, integers up to `MAX_INT_BITS` bits. `×` and `÷` (the
arithmetic data's own signs) read as `*` and `/`.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import ClassVar

from streamrl.envs.tool_env import ToolEnvironment
from streamrl.envs.tools import tool

__all__ = ["CalculatorEnv", "calculate", "evaluate_arithmetic"]

MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 1000
MAX_INT_BITS = 4096

Number = int | float

_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}


def evaluate_arithmetic(expression: str) -> Number:
    """The value of an arithmetic expression (module docstring).

    Raises:
        ValueError: anything but arithmetic, a number too large, division by zero; the
            message says which.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    text = expression.replace("×", "*").replace("÷", "/").strip()
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"{expression!r} is not an arithmetic expression") from None
    return _value(tree.body)


def _value(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant):
        if type(node.value) in (int, float):  # bool and complex are not numbers here
            return _checked(node.value)
        raise ValueError(f"{node.value!r} is not a number")
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponents are limited to ±{MAX_EXPONENT}")
        if isinstance(node.op, ast.Pow) and _int_power_bits(left, right) > MAX_INT_BITS:
            raise ValueError(f"the result would be larger than {MAX_INT_BITS} bits")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("the result is too large") from None
        if isinstance(value, complex):
            raise ValueError("the result is not a real number")
        return _checked(value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise ValueError("^ is not a power here; write ** (2**3 is 8)")
    raise ValueError(f"{type(node).__name__} is not allowed; only numbers, + - * / // % ** ()")


def _int_power_bits(base: Number, exponent: Number) -> float:
    """About how many bits `base ** exponent` takes when both are integers (else 0)."""
    if not (isinstance(base, int) and isinstance(exponent, int)) or exponent <= 0:
        return 0.0
    return exponent * math.log2(abs(base)) if abs(base) > 1 else 0.0


def _checked(value: Number) -> Number:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ValueError(f"the result is larger than {MAX_INT_BITS} bits")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is too large")
    return value


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: The expression to evaluate, for example "(3 + 4) * 5".
    """
    value = evaluate_arithmetic(expression)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return str(value)


class CalculatorEnv(ToolEnvironment):
    """Arithmetic with a calculator tool (`calculator`); the episode ends with the first turn
    that calls no tool, scored by the reward function."""

    tools: ClassVar = (tool(calculate, example={"expression": "12 * (3 + 4)"}),)
    max_tool_calls_per_turn: ClassVar[int] = 4
