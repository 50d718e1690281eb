"""``model:tiny-rm`` (jaxrl.tasks.rewards.train_rm): a reward model trained in code on the
arithmetic task ranks held-out answers well above chance, its saved checkpoint is an HF
``Qwen2ForSequenceClassification`` that ``jaxrl.nn.reward_model``, a ``model:`` term and
transformers score as it was trained, and a ``tiny:rm`` run logs both terms."""

from __future__ import annotations

import dataclasses
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from rounding import logits_atol  # noqa: E402
from run_helpers import read_metrics, tiny_config  # noqa: E402

from jaxrl.config import ConfigError  # noqa: E402
from jaxrl.nn import reward_model  # noqa: E402
from jaxrl.run.components import task_sections  # noqa: E402
from jaxrl.run.train import Trainer  # noqa: E402
from jaxrl.tasks import arithmetic_task  # noqa: E402
from jaxrl.tasks.data import arithmetic  # noqa: E402
from jaxrl.tasks.data import tokenizer as vocab  # noqa: E402
from jaxrl.tasks.rewards import train_rm  # noqa: E402
from jaxrl.tasks.rewards.terms import ModelTerm, build_terms  # noqa: E402

# Chance is 0.5. Over the 512 held-out pairs of tiny:rm's 8 levels a ranking at chance lies
# within 0.5 ± 0.066 (3 standard deviations, 0.5/√512 each), so 0.65 is a learned ranking, not
# luck. The trained model measures 0.754 (600 steps, 2 CPU cores): it checks the easy positions
# (the zero padding above a short sum, the low digits) and misses many carries in the long sums;
# the bar leaves room for another CPU's rounding to move the training trajectory.
THRESHOLD = 0.65
# A few steps on fewer pairs: a model whose scores differ between rows, which is all the checkpoint's
# parity needs (the ranking's quality is the slow test's, above).
BRIEF = dataclasses.replace(train_rm.SETTINGS, steps=60, warmup_steps=10, train_pairs=1024)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """tiny:rm's task (the default tiny levels, aligned layout), its reward model trained once."""
  cfg = tiny_config("rm")
  tcfg = arithmetic_task.task_config(cfg.task, cfg.seed)
  tok = vocab.build_tokenizer(tmp_path_factory.mktemp("tok"))
  return tcfg, tok, train_rm.train_reward_model(tcfg, tok)


@pytest.fixture(scope="module")
def briefly_trained(tmp_path_factory):
  """tiny:rm's task, its reward model trained for ``BRIEF``'s few steps."""
  cfg = tiny_config("rm")
  tcfg = arithmetic_task.task_config(cfg.task, cfg.seed)
  tok = vocab.build_tokenizer(tmp_path_factory.mktemp("tok"))
  return tcfg, tok, train_rm.train_reward_model(tcfg, tok, BRIEF)


def test_wrong_answers_differ_in_one_digit():
  rng = np.random.default_rng(0)
  for answer in ("0", "7", "125", "000521", "99999"):
    for _ in range(20):
      wrong = train_rm.wrong_answer(answer, rng)
      assert len(wrong) == len(answer) and wrong.isdigit()
      assert sum(a != b for a, b in zip(answer, wrong)) == 1


@pytest.mark.slow  # 600 training steps: about 30 s on 2 CPU cores
def test_trained_reward_model_ranks_heldout_answers_above_chance(trained):
  _, _, rm = trained
  print(f"held-out pairwise accuracy {rm.heldout_accuracy:.3f}, {rm.seconds:.1f} s")
  assert rm.heldout_pairs >= 400
  assert rm.heldout_accuracy >= THRESHOLD, rm.heldout_accuracy


def test_saved_checkpoint_scores_as_trained(briefly_trained, tmp_path):
  """Read back by jaxrl.nn.reward_model: the same weights through the same forward (float32,
  saved losslessly), so the same scores up to XLA's choice of summation order; transformers'
  Qwen2ForSequenceClassification within two float32 forwards' rounding (rounding.logits_atol);
  a ``model:`` term on the text as the run passes it, the same scores again."""
  import torch
  import transformers

  tcfg, tok, rm = briefly_trained
  path = train_rm.save(rm, tmp_path / "rm", tok)
  _, heldout = train_rm.task_pairs(tcfg, tok, BRIEF)
  # references and wrong answers: rows the model scores apart
  tokens = np.concatenate([heldout.chosen_NxT[:16], heldout.rejected_NxT[:16]])
  mask = np.concatenate([heldout.chosen_mask_NxT[:16], heldout.rejected_mask_NxT[:16]])
  ours = rm.scores(tokens, mask)
  assert np.std(ours) > 0.1  # the rows score differently: the comparison means something
  loaded = reward_model.load_reward_model(path)
  np.testing.assert_allclose(np.asarray(loaded.scores(tokens, mask)), ours, rtol=0, atol=1e-5)

  hf_model = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
  assert type(hf_model).__name__ == "Qwen2ForSequenceClassification"
  with torch.no_grad():
    out = hf_model(input_ids=torch.tensor(tokens).long(), attention_mask=torch.tensor(mask).long())
  ref = out.logits[:, 0].float().numpy()
  np.testing.assert_allclose(ours, ref, rtol=0, atol=logits_atol(rm.cfg, ref, tokens.shape[1]))

  problems = arithmetic.build_task(tcfg)[1][:6]
  term = ModelTerm(str(path), None, "float32", max_tokens=64, rows=4)
  got = term([q.prompt for q in problems], [q.answer for q in problems], [""] * 6)
  want = rm.scores(*train_rm._rows(tok, [q.prompt + q.answer for q in problems]))
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_tiny_rm_is_for_the_arithmetic_task_without_tools():
  with pytest.raises(ValueError, match="without tools"):
    tiny_config("rm,tools")
  with pytest.raises(ConfigError, match="model:tiny-rm is trained on the arithmetic task"):
    build_terms(
      task_sections(tiny_config("countdown,test", **{"reward.terms": "verifier, model:tiny-rm"}))
    )


@pytest.mark.slow
def test_tiny_rm_run_logs_both_terms(tmp_path, monkeypatch):
  """tiny:rm at tiny:test's size: the run trains model:tiny-rm into its run directory (fewer steps
  here), nothing into the cache, and each step logs the verifier's and the reward model's means."""
  monkeypatch.setenv("JAXRL_CACHE", str(tmp_path / "cache"))
  monkeypatch.setattr(train_rm, "SETTINGS", dataclasses.replace(train_rm.SETTINGS, steps=100))
  Trainer.open(tiny_config("rm,test", steps=2), str(tmp_path / "run")).run()
  assert not (tmp_path / "cache").exists()
  (cached,) = (tmp_path / "run").glob("tiny-rm-*")
  report = json.loads((cached / train_rm.REPORT).read_text())
  assert report["settings"]["steps"] == 100 and 0 <= report["heldout_pairwise_accuracy"] <= 1
  rows = [r for r in read_metrics(tmp_path / "run") if "reward_term_model" in r]
  assert len(rows) == 2
  for row in rows:
    assert row["reward_term_model_applies"] == 1.0 and np.isfinite(row["reward_term_model"])
    assert row["reward_term_verifier_applies"] == 1.0
