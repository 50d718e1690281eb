"""The per-step metrics row, built in one place from what the step measured and decided."""

from __future__ import annotations

import numpy as np

from jaxrl.rl import paper_metrics
from jaxrl.tasks.data.prompts import decode_responses
from jaxrl.tasks.envs.trajectory import compact, trajectory_parts


def group_outcomes(rewards_R: np.ndarray, group_ids_R: np.ndarray, num_groups: int) -> dict:
  """Fractions of groups whose rollouts are all correct / all wrong (zero-advantage groups)."""
  counts = np.bincount(group_ids_R, minlength=num_groups)
  correct = np.bincount(group_ids_R, weights=rewards_R > 0, minlength=num_groups)
  present = counts > 0
  if not present.any():  # every answer set aside (the verifier scored none)
    return dict(frac_all_correct=float("nan"), frac_all_wrong=float("nan"))
  return dict(
    frac_all_correct=float(np.mean((correct == counts)[present])),
    frac_all_wrong=float(np.mean((correct == 0)[present])),
  )


def generated_tokens(rollouts) -> float:
  """The model tokens a batch's sampling generated, every row (rows a dynamic-sampling step drops
  and answers the verifier sets aside cost them too): the compute a comparison of methods at
  equal generated tokens counts (bench/methods_study.py)."""
  return float(np.asarray(rollouts.loss_mask_RxN).sum())


def useful_and_raw_tokens(rollouts) -> tuple[float, float]:
  """The update's tokens that are not padding (the prompts' and responses') and every position of
  its ``[R, P + N]`` rows."""
  prompt_RxP, mask_RxN = np.asarray(rollouts.prompt_mask_RxP), np.asarray(rollouts.mask_RxN)
  useful = float(prompt_RxP.sum() + mask_RxN.sum())
  return useful, float(prompt_RxP.size + mask_RxN.size)


def update_rates(rollouts, seconds: float, positions: int | None = None) -> dict:
  """The update's throughputs over every row it processed: of the tokens that are not padding
  (``train_tok_s``: prompts' and responses') and of every position it processed
  (``train_raw_tok_s``): its packed buffers' ``positions``, or (None) its ``[R, P + N]`` rows."""
  useful, raw = useful_and_raw_tokens(rollouts)
  raw = raw if positions is None else float(positions)
  seconds = max(seconds, 1e-9)
  return {"train_tok_s": useful / seconds, "train_raw_tok_s": raw / seconds}


def allocation_metrics(counts_B) -> dict:
  """How the step's rollout budget was spread over its questions."""
  counts = np.asarray(counts_B)
  return dict(
    alloc_min=float(counts.min()),
    alloc_max=float(counts.max()),
    alloc_std=float(counts.std()),
    alloc_hist=np.bincount(counts, minlength=counts.max() + 1).tolist(),
  )


def decision_metrics(methods, controllers, tau, hp) -> dict:
  """τ, ε and the controllers' targets: every decision of the step, after its updates."""
  temp = controllers.temperature
  return dict(
    tau=float(tau),
    tau_next=float(temp.tau),
    tau_clamped=float(temp.clamped),
    entropy_target=float(methods.temperature.target(temp)),
    eps_low=float(hp.eps_low),
    eps_high=float(hp.eps_high),
    clip_target=float(methods.clip.target(controllers.clip)),
  )


def paper_metrics_row(methods, controllers, entropy) -> dict:
  """The papers' own diagnostics of the step's rollout entropy H (docs/algorithms.md §12):
  H/H_init (E3), (H − S(t))/S(t) against the clip schedule and whether ε_high is saturated (ES)."""
  clip = controllers.clip
  return dict(
    entropy_rel_init=paper_metrics.entropy_rel_init(entropy, controllers.temperature.h_init),
    entropy_tracking_error=paper_metrics.entropy_tracking_error(entropy, methods.clip.target(clip)),
    clip_saturated=float(methods.clip.saturated(clip)),
  )


def step_record(
  *,
  update,
  rollouts,
  rewards_R,
  entropy,
  num_groups,
  decisions,
  counts_B,
  times,
  context,
  verified: dict,
  extra: dict,
) -> dict:
  """The step's metrics row, keys in a fixed order.

  ``update``: the train step's metrics on the host; ``decisions``: ``decision_metrics``;
  ``times``: wall-clock (start, batch taken, update start, update done); ``context``: epoch,
  phase, shapes and compile counts; ``verified``: the verifier's counters; ``extra``: the batch's
  generation (its seconds, EEPO's metrics, staleness, dynamic sampling's). ``rollouts``: the rows
  of the step's questions (NaN rewards when the verifier scored none of them)."""
  rows = max(len(rewards_R), 1)
  # Lengths and throughputs count every response token, the model's and an environment's (what a
  # response holds, what the programs process); the model's alone are ``model_tokens_mean`` (and
  # the update's ``token_count``, docs/algorithms.md §11).
  mask = np.asarray(rollouts.mask_RxN)
  tokens = float(mask.sum())
  model_tokens = float(np.asarray(rollouts.loss_mask_RxN).sum())
  t0, t1, t2, t3 = times
  rollout_s = max(extra.get("rollout_seconds", t1 - t0), 1e-9)
  return dict(
    update,
    reward=float(rewards_R.mean()) if len(rewards_R) else float("nan"),
    pass_rate=float((rewards_R > 0).mean()) if len(rewards_R) else float("nan"),
    entropy_rollout=entropy,
    response_len=tokens / rows,
    model_tokens_mean=model_tokens / rows,
    **decisions,
    **allocation_metrics(counts_B),
    # the engine's rate while generating (response tokens, not padding); the trainer's wait for
    # the batch (0 when it was ready)
    rollout_tok_s=tokens / rollout_s,
    rollout_wait_s=t1 - t0,
    update_seconds=t3 - t2,
    step_time=t3 - t0 - extra.get("diagnostics_seconds", 0.0),  # the step's own work
    wall_time=t3,  # when the update finished (steps per second across rows)
    **context,
    **verified,
    **extra,
    **group_outcomes(rewards_R, np.asarray(rollouts.group_ids_R), num_groups),
  )


def sample_rows(task, rollouts, qids_B, counts_B, tau, n: int) -> list[dict]:
  """The first response of each of the step's first ``n`` groups, as text (``samples.jsonl``):
  its question, prompt, response, reward, group, the group's allocated G and the step's τ; with an
  environment also its ``parts``, each with who wrote it (``trajectory_parts``)."""
  if n <= 0:
    return []
  group_ids_R = np.asarray(rollouts.group_ids_R)
  groups, first_R = np.unique(group_ids_R, return_index=True)
  groups, rows = groups[:n], first_R[:n]
  tokenizer = task.tokenizer
  tokens_RxN, mask_RxN = np.asarray(rollouts.tokens_RxN)[rows], np.asarray(rollouts.mask_RxN)[rows]
  model_RxN = np.asarray(rollouts.loss_mask_RxN)[rows]
  lengths_R = np.asarray(rollouts.lengths_R)[rows]
  if task.environment is not None:  # the gaps between turns out (model_RxN: who wrote what)
    tokens_RxN, model_RxN = compact(tokens_RxN, mask_RxN), compact(model_RxN, mask_RxN)
  responses = decode_responses(tokenizer, tokens_RxN, lengths_R, model_RxN, task.eos_id)
  prompt_ids, prompt_mask = (
    np.asarray(rollouts.prompt_ids_RxP),
    np.asarray(rollouts.prompt_mask_RxP),
  )
  rewards = np.asarray(rollouts.rewards_R)
  out = [
    dict(
      question=int(qids_B[g]),
      prompt=tokenizer.decode(prompt_ids[r][prompt_mask[r]].tolist(), skip_special_tokens=True),
      response=response,
      reward=float(rewards[r]),
      group=int(g),
      group_size=int(counts_B[g]),
      tau=float(tau),
    )
    for g, r, response in zip(groups.tolist(), rows.tolist(), responses)
  ]
  if task.environment is not None:
    for k, row in enumerate(out):
      row["parts"] = trajectory_parts(
        tokenizer, tokens_RxN[k], model_RxN[k], lengths_R[k], eos_id=task.eos_id
      )
  return out
