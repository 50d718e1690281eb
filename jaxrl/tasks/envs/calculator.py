"""The calculator tool: integer arithmetic read by a small recursive-descent parser, never ``eval``.

Grammar (spaces are allowed between tokens)::

  expr   := term (("+" | "-") term)*
  term   := unary (("*" | "/") unary)*
  unary  := "-" unary | atom
  atom   := NUMBER | "(" expr ")"

``/`` is exact integer division: a remainder or a zero divisor is an error, never a rounded value.
Bounded by construction: an expression of at most ``MAX_EXPRESSION_CHARS`` characters (which also
bounds the recursion), and every number, literal or intermediate, of at most ``MAX_DIGITS``
digits; with no power operator a product of two such numbers is small, so nothing a model writes
can make the parser build a huge integer. Errors are short phrases of lowercase letters and
spaces, which the tools vocabulary spells (``jaxrl.tasks.data.tokenizer``).

This module imports nothing but the standard library: tool workers load it (``TOOL``).
"""

from __future__ import annotations

NAME = "calculator"  # its name in tasks.envs.registry.ENVIRONMENTS (task.environment)
TOOL = "jaxrl.tasks.envs.calculator:calculate"  # the tool as a worker loads it
# The model writes CALL_OPEN expression CALL_CLOSE and reads RESULT_OPEN value RESULT_CLOSE; the
# tools vocabulary (jaxrl.tasks.data.tokenizer) holds each tag as one token.
CALL_OPEN, CALL_CLOSE, RESULT_OPEN, RESULT_CLOSE = "<calc>", "</calc>", "<result>", "</result>"
MAX_EXPRESSION_CHARS = 64
MAX_DIGITS = 40
_OPERATORS = frozenset("+-*/()")


class CalcError(ValueError):
  """An expression the calculator does not answer; the message is the reason the model reads."""


def _tokens(expression: str) -> list[str]:
  """Numbers (digit runs) and single-character operators; spaces dropped."""
  out: list[str] = []
  i = 0
  while i < len(expression):
    c = expression[i]
    if c.isascii() and c.isdigit():
      j = i
      while j < len(expression) and expression[j].isascii() and expression[j].isdigit():
        j += 1
      out.append(expression[i:j])
      i = j
    elif c in _OPERATORS:
      out.append(c)
      i += 1
    elif c == " ":
      i += 1
    else:
      raise CalcError("syntax")
  return out


def _bounded(value: int) -> int:
  if len(str(abs(value))) > MAX_DIGITS:
    raise CalcError("too large")
  return value


class _Parser:
  """One expression's tokens and the read position; each rule returns its value."""

  def __init__(self, tokens: list[str]):
    self.tokens, self.i = tokens, 0

  def peek(self) -> str | None:
    return self.tokens[self.i] if self.i < len(self.tokens) else None

  def take(self) -> str:
    token = self.peek()
    if token is None:
      raise CalcError("syntax")
    self.i += 1
    return token

  def expr(self) -> int:
    value = self.term()
    while self.peek() in ("+", "-"):
      op, rhs = self.take(), self.term()
      value = _bounded(value + rhs if op == "+" else value - rhs)
    return value

  def term(self) -> int:
    value = self.unary()
    while self.peek() in ("*", "/"):
      op, rhs = self.take(), self.unary()
      value = _bounded(value * rhs if op == "*" else _divide(value, rhs))
    return value

  def unary(self) -> int:
    if self.peek() == "-":
      self.take()
      return -self.unary()
    return self.atom()

  def atom(self) -> int:
    token = self.take()
    if token == "(":
      value = self.expr()
      if self.take() != ")":
        raise CalcError("syntax")
      return value
    if not token.isdigit():
      raise CalcError("syntax")
    if len(token.lstrip("0")) > MAX_DIGITS:
      raise CalcError("too large")
    return int(token)


def _divide(a: int, b: int) -> int:
  if b == 0:
    raise CalcError("division by zero")
  if a % b:
    raise CalcError("inexact division")
  return a // b


def evaluate(expression: str) -> int:
  """The value of ``expression``; ``CalcError`` (its reason as the message) when it has none."""
  if len(expression) > MAX_EXPRESSION_CHARS:
    raise CalcError("too long")
  tokens = _tokens(expression)
  if not tokens:
    raise CalcError("empty")
  parser = _Parser(tokens)
  value = parser.expr()
  if parser.peek() is not None:
    raise CalcError("syntax")
  return value


def calculate(call: str) -> str:
  """The tool: the value of the call's expression in decimal, or ``"error: REASON"``."""
  try:
    return str(evaluate(call))
  except CalcError as e:
    return f"error: {e}"
