"""Math verifier on math-verify: 1.0 iff the model's final answer equals the gold answer.

The answer is the last ``\\boxed{}`` (or ``\\fbox{}``) of the response; without one, math-verify's
extraction finds the last answer-like expression (after "final answer is" style anchors first,
then any LaTeX or plain expression). The gold answer may be LaTeX or plain text, with or without
``$``/``\\boxed``. Equivalence is math-verify's ``verify`` (numeric within 6 decimals, symbolic,
sets, intervals, percentages).

Bounded input, unbounded time: only ``answer_window`` (at most ``MAX_ANSWER_CHARS`` characters) is
ever parsed, but sympy can still hang or exhaust memory on short inputs (``9^{9^{9^9}}``), and
math-verify's own signal timeouts do not stop C code. So ``score`` runs with those timeouts off and
is meant to be called through ``jaxrl.tasks.rewards.pool.VerifierPool``, which kills and replaces a
worker that overruns: ``VerifierPool(MATH_REWARD, prepare=answer_window, warm_up=WARM_UP)``, as the
math task builds it.
"""

from __future__ import annotations

import functools

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

# ``score`` as a ``VerifierPool`` reward spec: the math task's reward unless ``reward.fn`` is set.
MATH_REWARD = "jaxrl.tasks.rewards.math:score"
# Scored once by each pool worker before it says ready: the first parse builds math-verify's regexes
# and the LaTeX parser (~0.2-1 s): pay it before ready, not inside the first answer's time limit.
WARM_UP = ("\\boxed{\\frac{1}{2}}", "0.5")

# The longest span that is parsed: far above a boxed answer (a 3x3 matrix of fractions is ~150
# characters), small enough that regex extraction and the ANTLR parse stay in milliseconds.
MAX_ANSWER_CHARS = 1000

_BOXES = ("\\boxed", "\\fbox")
# Boxed answers take priority over "final answer is" anchors; plain expressions come last.
_EXTRACTION = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
# Delimiters that make a gold string a text math-verify extracts from as it is.
_DELIMITED = ("\\boxed", "\\fbox", "$", "\\(", "\\[")


def _box_closes(window: str) -> bool:
  """True iff the box at the start of ``window`` has its argument complete inside it."""
  rest = window[len("\\boxed") :] if window.startswith("\\boxed") else window[len("\\fbox") :]
  body = rest.lstrip()
  if not body.startswith("{"):
    return bool(body)  # `\boxed 5`: the argument is one token, present iff anything follows
  depth = 0
  for ch in body:
    # Escaped braces `\{ \}` come in pairs inside a complete box, so plain counting stays exact.
    if ch == "{":
      depth += 1
    elif ch == "}":
      depth -= 1
      if depth == 0:
        return True
  return False


def answer_window(response: str, max_chars: int = MAX_ANSWER_CHARS) -> tuple[str, bool]:
  """(the span of ``response`` that is parsed, whether the answer region was cut).

  From the last box on, at most ``max_chars`` characters: earlier boxes (drafts) are dropped, so
  the last boxed answer is the one graded. Without a box, the last ``max_chars`` characters.
  Cut means: a box whose argument does not close inside the window, or an unboxed response longer
  than the window (an answer anchor before the window is lost).
  """
  if max_chars <= 0:
    raise ValueError(f"max_chars must be positive, got {max_chars}")
  start = max(response.rfind(box) for box in _BOXES)
  if start < 0:
    return response[-max_chars:], len(response) > max_chars
  window = response[start : start + max_chars]
  return window, not _box_closes(window)


@functools.lru_cache(maxsize=4096)
def parse_gold(gold: str) -> tuple:
  """The parsed gold answer (sympy objects and the string fallback); raises if nothing parses.

  Cached: the G rollouts of a question share one gold answer.
  """
  text = gold.strip()
  if not text:
    raise ValueError("the gold answer is empty")
  boxed = "\\boxed{" + text + "}"
  # A bare gold (`\frac{1}{2}`, `[0,1)`, `2\pi`) is only extracted whole when boxed; a delimited
  # one (a reference solution) is extracted like a response, the boxed form being the fallback.
  tries = (text, boxed) if any(d in text for d in _DELIMITED) else (boxed, text)
  for candidate in tries:
    parsed = parse(candidate, _EXTRACTION, parsing_timeout=None)
    if parsed:
      return tuple(parsed)
  raise ValueError(f"the gold answer {text[:200]!r} does not parse")


def score(response: str, answer: str) -> float:
  """1.0 iff the final answer in ``response`` is equivalent to the gold ``answer``, else 0.0.

  Unbounded in time (see the module docstring): run it through ``VerifierPool``. Raises on a gold
  answer that is empty or does not parse (a data error); a response that does not parse scores 0.
  """
  if not isinstance(response, str) or not isinstance(answer, str):
    raise TypeError(
      f"response and answer must be str, got {type(response).__name__} and {type(answer).__name__}"
    )
  gold = parse_gold(answer)
  window, _ = answer_window(response)
  pred = parse(window, _EXTRACTION, parsing_timeout=None)
  if not pred:
    return 0.0
  return 1.0 if verify(list(gold), pred, timeout_seconds=None) else 0.0
