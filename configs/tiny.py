"""The embedded default: a tiny Qwen2-style model learns graded arithmetic by GRPO on a laptop CPU.

  python -m jaxrl.main --config=configs/tiny.py --workdir=runs/tiny

Builds a tokenizer and the task in code (no downloads), warm-starts the model by SFT, evaluates
held-out pass@1 / pass@8 / greedy accuracy per difficulty level, runs GRPO, evaluates again and
prints the before/after table, in minutes on 2 CPU cores. README.md quotes a run's table, its time
and its machine (bench/results/make_run.md); the warm start's trajectory, and so the figures,
depend on the CPU's rounding.

Variants (``configs/tiny.py:ARG``, comma-separated): method presets ``grpo`` (the default), ``e3``,
``dynamo``, ``eepo``, ``es`` (entropy scheduling), ``all``; sizes ``quick`` (a one-minute smoke run)
and ``test`` (unit tests); ``anneal`` adds the annealing-phase curriculum (harder levels, 2× the
rollouts per question, longer responses from 60% of the steps, or where the entropy schedule
anneals), e.g. ``configs/tiny.py:e3,anneal``; ``tools`` is the arithmetic task with a calculator
(multi-turn: the model may write ``<calc>12345*678</calc>``, the environment answers
``<result>8369910</result>``, the model copies the answer; the SFT corpus shows calls on the easy
levels, RL has to learn when to call on the hard ones), e.g. ``tiny:e3,tools``; ``tools,chat`` is
the same in a ChatML chat template, as an instruct model reads it (``chat`` alone says the same);
``countdown`` is
the countdown task (reach a target with the given numbers: a search where exploration matters),
e.g. ``tiny:e3,countdown``. ``rm`` joins the verifier with a reward model trained in code on the
task's correct and wrong answers (``model:tiny-rm``: trained on first use into the run directory,
about 30 s on a CPU; docs/rewards.md), e.g. ``tiny:rm``. Every field
stays overridable: ``--config.allocation.method=dynamo``.
"""

from jaxrl.config import default_configdict

PRESETS = ("grpo", "e3", "dynamo", "eepo", "es", "all")
SIZES = ("quick", "test")
PHASES = ("anneal",)
TASKS = ("tools", "countdown", "chat")  # chat: the tools task in a chat template
# tiny:tools' levels: those shown in its SFT corpus, and the hard ones (products and long sums a
# 0.8M model cannot compute in its head), rare in the corpus.
TOOLS_SHOWN_LEVELS = "2x1+,2x2+,2x1*,2x2*,5x1+,3x2+,3x3+,5x5-"
TOOLS_HARD_LEVELS = "3x2*,3x3*,5x5+"
TOOLS_HARD_SFT_WEIGHT = 0.1  # relative to 1 for each of the other levels
REWARDS = ("rm",)  # the verifier and a reward model trained in code
VARIANTS = PRESETS + SIZES + PHASES + TASKS + REWARDS  # listed by --help


def _apply_preset(c, name: str) -> None:
  """The methods of the four papers, each alone and all together (docs/algorithms.md §3-§7)."""
  if name in ("e3", "all"):
    c.allocation.method = "e3"  # difficulty-ranked budgets, bounds widen per epoch
    c.temperature.method = "e3"  # entropy targeting (+ annealing after 60% of the steps)
  if name == "dynamo":
    c.allocation.method = "dynamo"  # variance-driven water-level allocation
  if name in ("dynamo", "all"):
    c.modulation.enabled = True  # token-level advantage modulation
  if name in ("eepo", "all"):
    c.eepo.enabled = True  # sample → (gate) forget → sample
  if name == "es":
    c.clip.method = "adaptive"  # clip-higher steered to a constant entropy target
    c.clip.schedule = "constant"
    c.clip.h_target = 0.25
    # Two optimizer updates per step: the second is off-policy (ρ ≠ 1), so the clip can bind. With
    # one on-policy update ε_high has nothing to act on.
    c.loss.mini_batches = 2


def _apply_size(c, name: str) -> None:
  if name == "quick":  # a smoke run of the whole pipeline in about a minute
    c.steps = 4
    c.sft.steps = 20
    c.task.num_heldout_per_level = 4
    c.checkpoint.every = 2
  elif name == "test":  # the smallest meaningful run, for unit tests (seconds)
    c.steps = 6
    c.batch_questions = 4
    c.rollout.group_size = 4
    c.model.hidden_size = 32
    c.model.intermediate_size = 64
    c.model.num_layers = 2
    c.model.num_heads = 2
    c.model.num_kv_heads = 1
    c.model.head_dim = 16
    c.sft.steps = 60  # enough for some correct answers: mixed-reward groups
    c.sft.batch_size = 16
    c.sft.learning_rate = 1e-2
    c.task.levels = "1x1+,2x1+"
    c.task.digit_width = 0  # natural layout: 1-2 digit answers, short sequences
    c.rollout.max_new_tokens = 4
    c.task.num_train_per_level = 8  # 16 questions: an epoch is 4 steps (E3 re-ranks)
    c.task.num_heldout_per_level = 2
    c.eval.num_samples = 2
    c.eval.ks = "1,2"
    c.checkpoint.every = 3
    c.log.progress = False
    c.allocation.g_min = 2  # DynaMO bounds around G = 4
    c.allocation.g_max = 8
    c.allocation.e3.g_min_floor = 2
    c.clip.warmup = 1
    c.clip.window = 2
    c.eepo.alpha = 100.0  # the gate always fires, so the forgetting step runs in tests


def _apply_tools(c) -> None:
  """The arithmetic task with the calculator environment (jaxrl/tasks/envs/calculator.py): levels a
  tiny model learns in its head, and others it cannot compute there (numbers are written
  most-significant digit first, so a sum's carries come before the digits that cause them):
  3-digit sums, 5-digit differences and, hardest, 3-digit products and 5-digit sums. It solves
  those by calling the calculator and copying its result."""
  c.task.environment = "calculator"
  c.task.digit_width = 0
  c.task.reverse_answer = False
  # The SFT corpus calls on half its examples, on every level it shows. The shown levels take it
  # all but a sliver and include each hard level's operand lengths with another operator, so that
  # copying such a question into a call is shown; the hard levels are the sliver (1% each, half of
  # it calls). RL has to learn to call there, where an answer from the head is always wrong, and to
  # copy faithfully: a 0.8M model copies the operand lengths and operators it has seen copied, and
  # where no sampled call is exact (long operands, shapes never shown) GRPO has no signal.
  c.task.levels = f"{TOOLS_SHOWN_LEVELS},{TOOLS_HARD_LEVELS}"
  c.task.sft_levels = TOOLS_SHOWN_LEVELS + "".join(
    f",{level}:{TOOLS_HARD_SFT_WEIGHT}" for level in TOOLS_HARD_LEVELS.split(",")
  )
  # A first turn of up to 24 tokens, the 32-token observation block and a 24-token answer. Two
  # turns: a call and the answer (a third would need N >= 3T + 2O).
  c.rollout.max_new_tokens = 80
  c.rollout.max_turns = 2
  c.rollout.max_turn_tokens = 24
  c.rollout.max_observation_tokens = 32  # every error observation, results up to 30 digits


def _apply_chat(c) -> None:
  """tiny:tools in ChatML, as an instruct model reads it (the ``tools_chat`` vocabulary): the
  prompt a user turn, each model turn ended by <|im_end|> (sampled and trained), the calculator's
  answer a tool message followed by the next assistant header (the environment's tokens). The
  observation block holds the 22 tokens of that frame and results up to 23 characters."""
  c.task.chat_template = True
  c.rollout.max_observation_tokens = 48
  c.rollout.max_new_tokens = 96  # 24 + 48 + 24


def _apply_countdown(c) -> None:
  """Countdown (jaxrl/tasks/data/countdown.py): reach a target with 2 to 5 given numbers, each once,
  with + - * and parentheses. Many expressions are right and few of those sampled are: after the
  warm start the upper half of the levels (4 and 5 numbers) is rarely solved at pass@1, more often
  at pass@32, so which rollouts a method samples decides what it learns."""
  c.task.name = "countdown"
  c.task.levels = "2n9,2n19,3n9,3n19,4n9,4n19,5n9,5n19"  # 2 to 5 numbers, each up to 9 or 19
  c.task.digit_width = 0
  c.rollout.max_new_tokens = 24  # the longest reference solution (5 two-digit numbers) is 20 + EOS
  c.eval.num_samples = 32  # what exploration changes shows at large k
  c.eval.ks = "1,8,32"
  # The corpus shows one of many solutions (the chain the problem was made from), so its loss has
  # a floor far above the arithmetic task's: the warm start runs its steps.
  c.sft.target_loss = 0.0


def _apply_rm(c) -> None:
  """The verifier and ``model:tiny-rm`` (jaxrl/tasks/rewards/train_rm.py), a reward model trained on
  this task's training questions to score the reference answer above one with a digit changed.
  Each term becomes its own group advantage before the weighted sum (normalise-then-sum): the
  model's scores are logits on a scale of their own, and the weight alone says how much it counts.
  Held-out evaluation reads the verifier alone: what the policy learned."""
  c.reward.terms = "verifier, model:tiny-rm*0.5"
  c.reward.combine = "normalise-then-sum"
  c.reward.model_max_tokens = 64  # a question and its answer: under 20 tokens


def _apply_anneal_phase(c) -> None:
  """The annealing-phase curriculum (Entropy Scheduling §5): where the entropy schedule anneals
  (E3: 60% of the steps), switch to the harder half of the levels with twice the rollouts per
  question and room for longer answers."""
  levels = [x.strip() for x in c.task.levels.split(",")]
  c.anneal_phase.enabled = True
  c.anneal_phase.mixture = ",".join(levels[len(levels) // 2 :])
  c.anneal_phase.group_size = 2 * c.rollout.group_size
  c.anneal_phase.max_new_tokens = c.rollout.max_new_tokens + 4


def get_config(arg: str = ""):
  """``arg``: a comma-separated list of at most one preset and one size, e.g. "e3" or "e3,test"."""
  c = default_configdict()
  c.seed = 0
  c.steps = 300
  c.batch_questions = 16
  c.rollout.group_size = 8
  # Aligned layout: numbers zero-padded to 5 digits, least-significant digit first. The tiny model
  # learns one digit-wise rule for every level (the natural layout needs a length-dependent alignment
  # per level and left the hard levels at 0% after SFT); a level's difficulty is then how many digit
  # positions and carries it uses.
  c.task.digit_width = 5
  c.task.levels = "2x1+,2x2+,3x2+,3x3+,4x3+,4x4+,5x4+,5x5+"  # 1+1 has only ~10 held-out problems
  c.rollout.max_new_tokens = 8
  c.eval.num_samples = 16  # pass@1 = mean accuracy of 16 samples at τ = 1; pass@8 unbiased
  # Stop the warm start while the model is partly capable (most levels 20-80% pass@1).
  c.sft.target_loss = 0.25
  names = list(filter(None, (part.strip() for part in arg.split(","))))
  for name in names:
    if name in PRESETS:
      _apply_preset(c, name)
    elif name in SIZES:
      _apply_size(c, name)
    elif name not in PHASES + TASKS + REWARDS:
      raise ValueError(
        f"unknown variant {name!r} of configs/tiny.py (presets: {', '.join(PRESETS)}; "
        f"sizes: {', '.join(SIZES)}; phases: {', '.join(PHASES)}; tasks: {', '.join(TASKS)}; "
        f"rewards: {', '.join(REWARDS)})"
      )
  if "tools" in names:  # after the sizes: its levels and lengths are the task's own
    _apply_tools(c)
  if "chat" in names:  # the tools task in a chat template: tiny:chat = tiny:tools,chat
    if "countdown" in names:
      raise ValueError("chat is the tools task in a chat template; countdown has no chat form")
    _apply_tools(c)
    _apply_chat(c)
  if "countdown" in names:
    _apply_countdown(c)
  if "rm" in names:
    if set(names) & set(TASKS):
      raise ValueError("rm's reward model is trained on the arithmetic task without tools")
    _apply_rm(c)
  if "anneal" in names:  # last: it derives from the levels and sizes chosen above
    _apply_anneal_phase(c)
  return c
