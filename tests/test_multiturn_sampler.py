"""Multi-turn generation (jaxrl.rollout.multiturn) against independent oracles.

Oracles: the callback's own record of what it was shown and what it answered (the response is
their exact concatenation), a float64 log-softmax of a no-cache forward over prompt ++ the
compacted response (the gaps must be invisible), the single-turn sampler (a run that never calls
the environment), and JAX's trace events (each program compiles once).
"""

from __future__ import annotations

import dataclasses
import functools
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from rounding import U, chain_terms, entropy_atol, logp_atol  # noqa: E402

from jaxrl.nn import model  # noqa: E402
from jaxrl.rl import scoring  # noqa: E402
from jaxrl.rollout import multiturn, sampler  # noqa: E402
from jaxrl.rollout.engine import JaxEngine, SampleRequest, eval_version  # noqa: E402
from jaxrl.run.compiles import CompileCounter  # noqa: E402
from jaxrl.run.heldout import engine_sampler  # noqa: E402
from jaxrl.run.loop_state import _restored_rollouts  # noqa: E402

PAD, EOS, CALL_END = 0, 1, 2  # CALL_END plays the id of ``</calc>``: the model's turn-stop
# The tiny model of tests/test_sampler.py: a vocabulary of 16, so EOS and the turn-stop are sampled
# often and every kind of row (stopped, asked, waiting, truncated) appears in a few rows.
CFG = model.ModelConfig(
  vocab_size=16,
  hidden_size=32,
  intermediate_size=64,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  rope_theta=1e6,
  tie_embeddings=False,
)
PROMPTS = [[5, 9, 12, 3, 7, 11, 4], [7, 3, 10], [14, 8, 8, 6, 2]]
P, N = 7, 30
TURNS = multiturn.TurnConfig(
  stop_ids=(CALL_END,), max_turn_tokens=6, max_observation_tokens=3, max_turns=4
)
# Observation tokens: an EOS and a turn-stop among them, which must not end anything there.
OBSERVATION = np.array([15, CALL_END, EOS], np.int32)
TAU = 1.3  # spreads the tiny model's draws: every kind of turn end in a few rows


def _left_pad(prompts, p):
  ids = np.full((len(prompts), p), PAD, np.int32)
  mask = np.zeros_like(ids, bool)
  for i, row in enumerate(prompts):
    ids[i, p - len(row) :] = row
    mask[i, p - len(row) :] = True
  return ids, mask


@pytest.fixture(scope="module")
def tiny():
  return model.create(CFG, seed=0)


class Echo:
  """A deterministic environment: call c gives row r the first (r + c) % (O + 1) tokens of
  ``OBSERVATION`` (empty ones too); a row in ``done_at`` (row -> k) is done at its k-th answer
  (from 0).
  It records, per row in order, the turn it was shown, its answer and whether it ended the row."""

  def __init__(self, o=TURNS.max_observation_tokens, done_at=None):
    self.o, self.done_at, self.calls = o, done_at or {}, 0
    self.asked: dict[int, list[tuple[np.ndarray, np.ndarray, bool]]] = {}

  def __call__(self, asked_R, turn_tokens):
    assert len(turn_tokens) == len(asked_R)
    observations, done_R = [], np.zeros(len(asked_R), bool)
    for r, asked in enumerate(asked_R):
      obs = OBSERVATION[: (r + self.calls) % (self.o + 1)]
      observations.append(obs if asked else np.zeros(0, np.int32))
      if asked:
        assert turn_tokens[r][-1] == CALL_END  # the turn ended at its stop
        done_R[r] = self.done_at.get(r) == len(self.asked.get(r, []))
        self.asked.setdefault(r, []).append((np.array(turn_tokens[r]), obs, bool(done_R[r])))
      else:
        assert len(turn_tokens[r]) == 0
    self.calls += 1
    return observations, done_R


def _gen(tiny, counts, respond, key=0, tau=TAU, *, n=N, turns=TURNS, prompts=PROMPTS, greedy=False):
  graphdef, params = tiny
  ids, mask = _left_pad(prompts, P)
  return multiturn.generate(
    graphdef,
    params,
    ids,
    mask,
    np.asarray(counts),
    jax.random.key(key),
    tau,
    1.0,
    respond,
    num_rollouts=int(np.sum(counts)),
    max_new_tokens=n,
    turns=turns,
    eos_id=EOS,
    pad_id=PAD,
    model_cfg=CFG,
    greedy=greedy,
  )


def _host(out):
  return jax.tree.map(np.asarray, out)


def _compact(out):
  """Each row's real tokens, moved to the left (the gaps removed): tokens, loss mask, real mask."""
  r, n = out.tokens_RxN.shape
  tokens, loss = np.full((r, n), PAD, np.int32), np.zeros((r, n), bool)
  real = np.arange(n)[None, :] < out.mask_RxN.sum(1, keepdims=True)
  for i in range(r):
    k, keep = int(real[i].sum()), out.mask_RxN[i]
    tokens[i, :k], loss[i, :k] = out.tokens_RxN[i][keep], out.loss_mask_RxN[i][keep]
  return tokens, loss, real


def _interior_gaps(mask_RxN) -> int:
  """Masked positions with a real one after them, in all rows."""
  real_after = np.cumsum(mask_RxN[:, ::-1], axis=1)[:, ::-1] > 0
  return int(np.sum(~mask_RxN & real_after))


def _check_layout(out, echo: Echo, turns=TURNS):
  """Every row is its turns and the callback's observations, exactly; the masks and zeros."""
  tokens, loss, real = _compact(out)
  assert np.all(out.loss_mask_RxN <= out.mask_RxN)
  assert np.all(out.tokens_RxN[~out.mask_RxN] == PAD)
  np.testing.assert_array_equal(out.lengths_R, out.mask_RxN.sum(1))
  for field in (out.behaviour_logp_RxN, out.entropy_RxN):  # 0 off the model's tokens
    assert np.all(field[~out.loss_mask_RxN] == 0)
  assert np.all(out.behaviour_logp_RxN[out.loss_mask_RxN] < 0)
  for r in range(len(tokens)):
    k = int(out.lengths_R[r])
    want_tokens, want_loss = [], []
    for turn, obs, _ in echo.asked.get(r, []):
      want_tokens += [turn, obs]
      want_loss += [np.ones(len(turn), bool), np.zeros(len(obs), bool)]
    asked = sum(len(t) for t in want_tokens)
    np.testing.assert_array_equal(tokens[r, :asked], np.concatenate([[], *want_tokens]))
    np.testing.assert_array_equal(loss[r, :asked], np.concatenate([[], *want_loss]))
    last = tokens[r, asked:k]  # the last model turn, which no observation answered
    assert loss[r, asked:k].all() and len(last) <= turns.max_turn_tokens
    if (hits := np.flatnonzero(np.isin(last, [EOS, CALL_END]))).size:
      assert hits[0] == len(last) - 1  # a turn ends at its first stop
    assert not real[r, k:].any()


@functools.partial(jax.jit, static_argnames="chunk")
def _training_logp(graphdef, params, ids, mask, tokens, token_mask, tau, chunk=16):
  """The update's log-probs (``rl/scoring.py``): one no-cache forward over prompt ++ response."""
  return scoring.logp_responses(graphdef, params, ids, mask, tokens, token_mask, tau, chunk)


@jax.jit
def _full_logits(graphdef, params, ids_BxT, mask_BxT):
  hidden, lm_head, _ = model.forward(
    graphdef, params, ids_BxT, model.positions_from_mask(mask_BxT), mask_BxT
  )
  return hidden @ lm_head.T


def _np_log_softmax(z):
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def sampled(tiny):
  """Three sampled batches of 12 rows (up to 3 turns each) with their environments' records."""
  runs = []
  for key in range(3):
    echo = Echo(done_at={0: 1, 4: 0, 5: 0, 9: 1})
    runs.append((_host(_gen(tiny, [4, 4, 4], echo, key=10 + key)), echo))
  return runs


def test_response_is_turns_and_observations_exactly(sampled):
  asked = waited = inert = 0
  for out, echo in sampled:
    _check_layout(out, echo)
    tools = np.array([len(echo.asked.get(r, [])) for r in range(len(out.lengths_R))])
    np.testing.assert_array_equal(out.tool_calls_R, tools)
    assert np.all((out.turns_R >= tools) & (out.turns_R <= tools + 1))
    asked += tools.sum()
    waited += _interior_gaps(out.mask_RxN)
    # observations holding a turn-stop (and EOS) that ended nothing: the model went on after them
    inert += sum(len(o) >= 2 and d is False for calls in echo.asked.values() for _, o, d in calls)
  assert asked >= 12 and waited > 0 and inert > 0, (asked, waited, inert)


def test_done_rows_stop_after_their_observation(sampled):
  ended = 0
  for out, echo in sampled:
    tokens, loss, _ = _compact(out)
    for r, calls in echo.asked.items():
      if not any(done for _, _, done in calls):
        continue
      # the environment ended this row: its observation is the response's end
      assert calls[-1][2] and out.finished_R[r] and out.tool_calls_R[r] == len(calls)
      k, obs = int(out.lengths_R[r]), calls[-1][1]
      np.testing.assert_array_equal(tokens[r, k - len(obs) : k], obs)
      assert tokens[r, k - len(obs) - 1] == CALL_END and loss[r, k - len(obs) - 1]
      ended += 1
  assert ended >= 2, ended


def test_finished_means_eos_or_done(sampled):
  for out, echo in sampled:
    tokens, loss = _compact(out)[:2]
    for r in range(len(tokens)):
      k = int(out.lengths_R[r])
      ends_at_eos = bool(loss[r, k - 1]) and tokens[r, k - 1] == EOS
      done = any(d for _, _, d in echo.asked.get(r, []))
      assert out.finished_R[r] == (ends_at_eos or done), r


def test_behaviour_logp_equals_no_cache_forward(tiny, sampled):
  """The sampler's ℓ_μ at the model's tokens equals (a) a float64 log-softmax of a no-cache forward
  over prompt ++ the compacted response, (b) the update's own forward over the gapped response."""
  graphdef, params = tiny
  for out, _ in sampled:
    tokens, loss, real = _compact(out)
    ids = np.concatenate([out.prompt_ids_RxP, tokens], 1)
    mask = np.concatenate([out.prompt_mask_RxP, real], 1)
    logits = np.asarray(_full_logits(graphdef, params, ids, mask), np.float64)[:, P - 1 : -1] / TAU
    ref = _np_log_softmax(logits)
    want_logp = np.take_along_axis(ref, tokens[..., None], -1)[..., 0]
    want_entropy = -(np.exp(ref) * ref).sum(-1)
    z_scale = float(np.max(np.abs(logits[real])))
    atol = logp_atol(CFG, P + N, z_scale)
    got = out.behaviour_logp_RxN[out.loss_mask_RxN]  # row-major: the same order as compacted
    np.testing.assert_allclose(got, want_logp[loss], rtol=0, atol=atol)
    np.testing.assert_allclose(
      out.entropy_RxN[out.loss_mask_RxN],
      want_entropy[loss],
      rtol=0,
      atol=entropy_atol(CFG, P + N, z_scale),
    )
    # The update's forward over the response as sampled, gaps and all: every real token
    # (the environment's too) predicted as in the compacted sequence.
    train_logp, _ = _training_logp(
      graphdef, params, out.prompt_ids_RxP, out.prompt_mask_RxP, out.tokens_RxN, out.mask_RxN, TAU
    )
    train_logp = np.asarray(train_logp)
    np.testing.assert_allclose(train_logp[out.mask_RxN], want_logp[real], rtol=0, atol=atol)


def test_predictors_without_gaps_are_the_slice(tiny):
  """Single-turn rows (no gap inside a response): the update's hidden states are the rows of the
  slice P-1 .. P+N-2, bit for bit, masked positions included."""
  graphdef, params = tiny
  rng = np.random.default_rng(0)
  ids, pmask = _left_pad(PROMPTS * 2, P)
  resp = rng.integers(1, 16, (6, 8)).astype(np.int32)
  rmask = np.arange(8)[None] < np.array([8, 1, 5, 0, 3, 7])[:, None]

  @jax.jit
  def both(params):
    got, _ = scoring.response_hidden(graphdef, params, ids, pmask, resp, rmask)
    valid = jnp.concatenate([pmask, rmask], 1)
    tokens = jnp.concatenate([ids, resp], 1)
    hidden, _, _ = model.forward(graphdef, params, tokens, model.positions_from_mask(valid), valid)
    return got, hidden[:, P - 1 : -1]

  got, want = both(params)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_no_environment_call_is_single_turn(tiny):
  """Greedy, with a turn-stop the model never emits: the callback is never asked, and the rows are
  the single-turn sampler's (T = N)."""
  graphdef, params = tiny
  ids, mask = _left_pad(PROMPTS, P)
  n = 12
  single = sampler.generate(
    graphdef,
    params,
    ids,
    mask,
    np.array([1, 1, 1]),
    jax.random.key(0),
    1.0,
    1.0,
    num_rollouts=3,
    max_new_tokens=n,
    eos_id=EOS,
    pad_id=PAD,
    model_cfg=CFG,
    greedy=True,
  )
  single = _host(single)
  unused = sorted(set(range(2, CFG.vocab_size)) - set(single.tokens_RxN.ravel().tolist()))
  assert unused, "every token was sampled: no stop id that is never asked"

  def never(asked_R, turn_tokens):
    raise AssertionError("the environment was asked")

  turns = multiturn.TurnConfig(
    stop_ids=(unused[0],), max_turn_tokens=n, max_observation_tokens=3, max_turns=2
  )
  multi = _host(_gen(tiny, [1, 1, 1], never, tau=1.0, n=n, turns=turns, greedy=True))
  for name in ("tokens_RxN", "mask_RxN", "lengths_R", "finished_R", "group_ids_R"):
    np.testing.assert_array_equal(getattr(multi, name), getattr(single, name), err_msg=name)
  np.testing.assert_array_equal(multi.loss_mask_RxN, single.mask_RxN)
  np.testing.assert_array_equal(multi.turns_R, [1, 1, 1])
  np.testing.assert_array_equal(multi.tool_calls_R, [0, 0, 0])
  # Two programs of the same arithmetic over the same P + n slots (the single-turn sampler's one
  # segment): bit for bit on the CPU this was written on, but XLA may fuse the two loop bodies
  # differently elsewhere, so float32 rounding apart; the greedy choices must then be decided
  # (the top logit ahead by more than both programs' rounding).
  logits = np.asarray(
    _full_logits(
      graphdef,
      params,
      np.concatenate([ids, single.tokens_RxN], 1),
      np.concatenate([mask, single.mask_RxN], 1),
    ),
    np.float64,
  )[:, P - 1 : -1]
  z_scale = float(np.max(np.abs(logits)))
  top2 = np.sort(logits, axis=-1)[..., -2:][single.mask_RxN]
  assert np.min(top2[:, 1] - top2[:, 0]) > 4 * chain_terms(CFG, P + n) * U * z_scale
  np.testing.assert_allclose(
    multi.behaviour_logp_RxN, single.behaviour_logp_RxN, rtol=0, atol=logp_atol(CFG, P + n, z_scale)
  )
  np.testing.assert_allclose(
    multi.entropy_RxN, single.entropy_RxN, rtol=0, atol=entropy_atol(CFG, P + n, z_scale)
  )


def test_turn_limit_ends_rows_unfinished(tiny):
  """max_turns = 2: no observation after the second turn; a row asked there ends unfinished."""
  turns = dataclasses.replace(TURNS, max_turns=2)
  seen = 0
  for key in range(3):
    echo = Echo()
    out = _host(_gen(tiny, [2, 2, 2], echo, key=30 + key, turns=turns))
    _check_layout(out, echo, turns)
    assert out.turns_R.max() <= 2 and out.tool_calls_R.max() <= 1
    tokens, loss, _ = _compact(out)
    for r in range(len(tokens)):
      k = int(out.lengths_R[r])
      if out.turns_R[r] == 2 and tokens[r, k - 1] == CALL_END and loss[r, k - 1]:
        assert not out.finished_R[r]  # asked after the last turn: not answered, unfinished
        seen += 1
  assert seen, "no row was asked after its last turn"


def test_turn_budget_and_length_limit_end_rows_unfinished(tiny):
  """T = 3: a turn of 3 tokens without a stop ends the row, unfinished. N = 2T + O: one
  observation fits, so a second turn's stop is never answered."""
  turns = dataclasses.replace(TURNS, max_turn_tokens=3, max_turns=4)
  n = 2 * 3 + turns.max_observation_tokens
  budget = late = 0
  for key in range(4):
    echo = Echo()
    out = _host(_gen(tiny, [2, 2, 2], echo, key=50 + key, n=n, turns=turns))
    _check_layout(out, echo, turns)
    assert out.tool_calls_R.max() <= 1 and out.turns_R.max() <= 2
    tokens, loss, _ = _compact(out)
    for r in range(len(tokens)):
      k = int(out.lengths_R[r])
      last = tokens[r, :k][loss[r, :k]][-3:]
      if not out.finished_R[r] and len(last) == 3 and not np.isin(last, [EOS, CALL_END]).any():
        budget += 1
      late += int(out.tool_calls_R[r] == 1 and tokens[r, k - 1] == CALL_END and loss[r, k - 1])
  assert budget and late, (budget, late)


def test_an_observation_that_fits_is_answered_and_the_reply_gets_what_is_left(tiny):
  """N = T + O + 2: after a first turn of any width the observation block fits with two positions
  for the reply, so every row whose first turn asked is answered, and its reply holds at most 2
  tokens (a reply cut there is unfinished)."""
  n, answered = TURNS.max_turn_tokens + TURNS.max_observation_tokens + 2, 0
  for key in range(3):
    echo = Echo()
    out = _host(_gen(tiny, [2, 2, 2], echo, key=70 + key, n=n))
    _check_layout(out, echo)
    tokens, loss, _ = _compact(out)
    for r in range(len(tokens)):
      k = int(out.lengths_R[r])
      model = tokens[r, :k][loss[r, :k]]
      ends = np.flatnonzero(np.isin(model, [EOS, CALL_END]))
      if ends.size and model[ends[0]] == CALL_END:  # turn 1 asked
        assert out.tool_calls_R[r] == 1, r  # and was answered
        assert len(model) - (ends[0] + 1) <= 2  # the reply got the 2 positions left
        answered += 1
  assert answered >= 3, answered


CALL = 3  # plays a chat model's ``</tool_call>``; CALL_END plays its end-of-turn id


def test_a_chat_turn_asks_only_with_a_call_and_finishes_without_one(tiny):
  """The end-of-turn id ends every turn: with ``call_ids`` a turn asks only if it holds the call
  id; one that ends without it finishes the row (as EOS), and is never shown to the environment."""
  turns = dataclasses.replace(TURNS, call_ids=(CALL,))
  asked = finished = 0
  for key in range(4):
    echo = Echo()
    out = _host(_gen(tiny, [2, 2, 2], echo, key=90 + key, turns=turns))
    for r, calls in echo.asked.items():
      assert all(CALL in turn for turn, _, _ in calls), r
      asked += len(calls)
    tokens, loss, _ = _compact(out)
    for r in range(len(tokens)):
      k = int(out.lengths_R[r])
      model = tokens[r, :k][loss[r, :k]]
      last_turn = model[sum(len(t) for t, _, _ in echo.asked.get(r, [])) :]
      if model[-1] == CALL_END and CALL not in last_turn:
        assert out.finished_R[r], r
        finished += 1
  assert asked and finished, (asked, finished)


def test_programs_compile_once(tiny):
  """Two calls with other prompts, counts, keys, τ and observations: no program traces again."""
  n = N + 1  # a length no other test samples: the first call must trace every program
  names = ("prefill_program", "turn_program", "observe_program", "assemble_program")
  counter = CompileCounter(**{name: name for name in names}).start()
  try:
    echo = Echo()
    _gen(tiny, [2, 2, 2], echo, key=1, n=n)
    assert echo.calls and counter.counts() == dict.fromkeys(names, 1), counter.counts()
    other = [[3, 4], [9, 10, 11, 12, 13, 6, 5], [8]]
    echo = Echo(done_at={0: 0, 2: 0})
    _gen(tiny, np.array([1, 0, 5]), echo, key=2, tau=0.8, n=n, prompts=other)
    assert echo.calls and counter.counts() == dict.fromkeys(names, 1), counter.counts()
  finally:
    counter.stop()


def test_jax_engine_multiturn_mode(tiny):
  """A JaxEngine built with turns samples through multiturn.generate: the same rollouts, its
  environment from the factory (given each row's question index) or from the call."""
  graphdef, params = tiny
  made = []

  def factory(group_ids_R):
    made.append(group_ids_R)
    return Echo()

  engine = JaxEngine(
    graphdef, CFG, max_new_tokens=N, eos_id=EOS, pad_id=PAD, turns=TURNS, respond_factory=factory
  )
  ids, mask = _left_pad(PROMPTS, P)
  request = SampleRequest(ids, mask, [2, 2, 2], jax.random.key(10), 1.3)
  got = _host(engine.generate(params, 0, request))
  np.testing.assert_array_equal(made[0], [0, 0, 1, 1, 2, 2])
  want = _host(_gen(tiny, [2, 2, 2], Echo(), key=10))
  assert got.turns_R is not None and got.tool_calls_R is not None
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(x, y)
  again = engine.generate(params, 0, dataclasses.replace(request, respond=Echo()))
  np.testing.assert_array_equal(again.tokens_RxN, got.tokens_RxN)
  assert len(made) == 1
  # Evaluation reads the turn counts from the rollouts the call returned.
  sample_fn = engine_sampler(engine, params, eval_version(0), lambda out: [], 1.3)
  sampled = sample_fn(ids, mask, np.array([2, 2, 2]), jax.random.key(10), False)
  np.testing.assert_array_equal(sampled.turns_R, got.turns_R)
  np.testing.assert_array_equal(sampled.tool_calls_R, got.tool_calls_R)


def test_pending_batch_saved_without_loss_mask_restores_as_single_turn():
  """A checkpoint's batch in flight from before ``loss_mask_RxN`` existed: its loss mask is its
  response mask (single-turn rollouts)."""
  r, n = 2, 3
  mask = np.array([[True, True, False], [True, False, False]])
  fields = dict(
    prompt_ids_RxP=np.ones((r, 2), np.int32),
    prompt_mask_RxP=np.ones((r, 2), bool),
    tokens_RxN=np.full((r, n), 5, np.int32),
    mask_RxN=mask,
    behaviour_logp_RxN=np.where(mask, -1.0, 0.0).astype(np.float32),
    entropy_RxN=np.zeros((r, n), np.float32),
    lengths_R=mask.sum(1).astype(np.int32),
    group_ids_R=np.zeros(r, np.int32),
    finished_R=np.zeros(r, bool),
  )
  np.testing.assert_array_equal(_restored_rollouts(fields).loss_mask_RxN, mask)
  saved = dict(fields, loss_mask_RxN=np.array([[True, False, False], [True, False, False]]))
  np.testing.assert_array_equal(_restored_rollouts(saved).loss_mask_RxN, saved["loss_mask_RxN"])
