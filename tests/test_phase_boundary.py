"""A phase boundary with batches in flight (``rollout.max_staleness`` = k ≥ 1): the pipeline
drains there. No batch of the annealing phase is issued before its first step, so every step of
the main phase trains, re-ranks (E3) and draws dynamic sampling's extra rounds with the main
phase's cursor, mixture and allocation state; the annealing phase's first batch is issued at its
own first step, by the params that step starts from."""

from __future__ import annotations

from run_helpers import step_context, tiny_config

from jaxrl.run.loop import initial_loop, rl_step

BOUNDARY = 3  # the annealing phase's first step (0-based)


def test_e3_annealing_dynamic_sampling_k1_drains_at_the_boundary(tmp_path):
  cfg = tiny_config(
    "e3,test,anneal",
    steps=6,
    **{
      "anneal_phase.start": BOUNDARY,
      "rollout.max_staleness": 1,
      "rollout.dynamic_sampling": True,
      "sft.steps": 0,
    },
  )
  ctx, params = step_context(cfg, tmp_path / "tokenizer")
  loop = initial_loop(ctx, ctx.programs.init_state(params))
  main_mixture = ctx.runtime(0).mixture
  rows = []
  for i in range(cfg.steps):
    loop, row = rl_step(ctx, loop, i)
    rows.append(row)
    issued = [(p.issue.step, p.issue.phase) for p in loop.pending]
    if i < BOUNDARY:
      # The issue side never ran ahead into the annealing phase: while the main phase trains,
      # the loop's phase and cursor (which dynamic sampling's extra rounds draw from and E3's
      # epoch ends are counted on) are the main phase's.
      assert loop.phase == 0 and all(phase == 0 for _, phase in issued), (i, issued)
      assert loop.cursor.epoch(main_mixture) == row["epoch"]
    if i == BOUNDARY - 1:
      assert issued == [], issued  # drained: nothing in flight across the boundary
  assert [r["phase"] for r in rows] == [0, 0, 0, 1, 1, 1]
  # One step stale everywhere except the first batch of each phase, issued at its own step.
  assert [r["rollout_staleness"] for r in rows] == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
  assert [r["group_size"] for r in rows] == [4, 4, 4, 8, 8, 8]
