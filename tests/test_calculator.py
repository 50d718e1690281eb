"""The calculator tool (jaxrl/tasks/envs/calculator.py): its parser against Python's integer
arithmetic on random expressions (an oracle that walks the same tree), its bounds, and that it
never evaluates anything but arithmetic."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl.tasks.envs.calculator import (
  MAX_DIGITS,
  MAX_EXPRESSION_CHARS,
  CalcError,
  calculate,
  evaluate,
)
from jaxrl.tasks.envs.tool import MAX_RESULT_CHARS, tool_text
from jaxrl.tasks.worker_process import BadResult


@pytest.mark.parametrize(
  "expression,value",
  [
    ("12345*678", 8369910),
    ("1+2*3", 7),
    ("(1+2)*3", 9),
    ("10-4-3", 3),  # left-associative
    ("2*3*4", 24),
    ("100/5/2", 10),
    ("-5+3", -2),
    ("--5", 5),
    ("-(2+3)*4", -20),
    ("7*-2", -14),
    (" 12 +  30 ", 42),
    ("007", 7),
    ("0*99999999", 0),
    ("((((1))))", 1),
    ("9" * MAX_DIGITS, int("9" * MAX_DIGITS)),
  ],
)
def test_values(expression, value):
  assert evaluate(expression) == value
  assert calculate(expression) == str(value)


@pytest.mark.parametrize(
  "expression,reason",
  [
    ("", "empty"),
    ("   ", "empty"),
    ("1+", "syntax"),
    ("(1+2", "syntax"),
    ("1+2)", "syntax"),
    ("()", "syntax"),
    ("1 2", "syntax"),
    ("2**10", "syntax"),  # no power: nothing huge can be built
    ("1.5+1", "syntax"),
    ("x+1", "syntax"),
    ("__import__('os')", "syntax"),  # never evaluated as Python
    ("1_000", "syntax"),
    ("٣+1", "syntax"),  # a non-ASCII digit
    ("7/0", "division by zero"),
    ("7/2", "inexact division"),
    ("9" * (MAX_DIGITS + 1), "too large"),
    ("9" * 30 + "*" + "9" * 30, "too large"),
    ("1+" * 40 + "1", "too long"),
  ],
)
def test_errors_are_observations(expression, reason):
  with pytest.raises(CalcError, match=f"^{reason}$"):
    evaluate(expression)
  assert calculate(expression) == f"error: {reason}"


def test_error_reasons_are_spelled_by_the_tools_vocabulary():
  from jaxrl.tasks.data.tokenizer import TOOLS_VOCAB

  for expression in ("", "1+", "7/0", "7/2", "9" * 50, "1+" * 40):
    assert set(calculate(expression)) <= set(TOOLS_VOCAB), calculate(expression)


def test_nesting_to_the_length_bound_does_not_recurse_too_deep():
  depth = (MAX_EXPRESSION_CHARS - 1) // 2
  assert evaluate("(" * depth + "1" + ")" * depth) == 1
  assert evaluate("-" * (MAX_EXPRESSION_CHARS - 1) + "1") == -1


def test_tool_text_bounds_a_value():
  assert tool_text("12") == "12"
  assert len(tool_text("7" * 1_000_000)) == MAX_RESULT_CHARS
  with pytest.raises(BadResult, match="returned int, not str"):
    tool_text(12)


# -- property test: random expression trees against Python integers ----------------------------


@dataclasses.dataclass(frozen=True)
class Num:
  value: int


@dataclasses.dataclass(frozen=True)
class Neg:
  operand: object


@dataclasses.dataclass(frozen=True)
class Bin:
  op: str
  left: object
  right: object


_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


def render(node, min_precedence: int = 0, right: bool = False) -> str:
  """The expression with only the parentheses the tree needs (and a few it does not)."""
  if isinstance(node, Num):
    return str(node.value)
  if isinstance(node, Neg):
    return "-" + render(node.operand, 3)
  p = _PRECEDENCE[node.op]
  text = f"{render(node.left, p)}{node.op}{render(node.right, p, right=True)}"
  # Same precedence on the right needs parentheses: a-(b-c), a/(b*c).
  if p < min_precedence or (right and p == min_precedence):
    return f"({text})"
  return text


class Refused(Exception):
  pass


def oracle(node) -> int:
  """Python integer arithmetic over the tree, refusing what the calculator refuses, in the same
  order (left operand, right operand, then the operation)."""
  if isinstance(node, Num):
    if len(str(node.value)) > MAX_DIGITS:
      raise Refused("too large")
    return node.value
  if isinstance(node, Neg):
    return -oracle(node.operand)
  a, b = oracle(node.left), oracle(node.right)
  if node.op == "/":
    if b == 0:
      raise Refused("division by zero")
    if a % b:
      raise Refused("inexact division")
    value = a // b
  else:
    value = a + b if node.op == "+" else a - b if node.op == "-" else a * b
  if len(str(abs(value))) > MAX_DIGITS:
    raise Refused("too large")
  return value


numbers = st.one_of(
  st.integers(0, 12), st.integers(0, 10**6), st.integers(0, 10**25), st.integers(0, 10**45)
).map(Num)
trees = st.recursive(
  numbers,
  lambda sub: st.one_of(
    sub.map(Neg),
    st.tuples(st.sampled_from("+-*/"), sub, sub).map(lambda t: Bin(*t)),
  ),
  max_leaves=12,
)


@settings(max_examples=400, deadline=None)
@given(trees, st.booleans())
def test_matches_python_integer_arithmetic(tree, spaced):
  text = render(tree)
  if spaced:  # spaces around every operator and parenthesis
    text = "".join(f" {c} " if c in "+-*/()" else c for c in text)
  if len(text) > MAX_EXPRESSION_CHARS:
    expected = "error: too long"
  else:
    try:
      expected = str(oracle(tree))
    except Refused as e:
      expected = f"error: {e}"
  assert calculate(text) == expected, text


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="0123456789+-*/() x.", max_size=80))
def test_any_text_is_answered_with_a_value_or_an_error(text):
  answer = calculate(text)
  assert answer.startswith("error: ") or int(answer) == evaluate(text)
  assert len(answer) <= MAX_DIGITS + 1 or answer.startswith("error: ")
