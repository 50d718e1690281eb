"""The training loop: the only place that owns jit boundaries, the loop and side effects.

One RL step: data cursor → question ids → allocation (uniform here) → rollout engine at τ →
rewards on the host → question statistics → jitted GRPO update → metrics → checkpoint.
Before RL: the built-in task, its tokenizer, the SFT warm start and a held-out evaluation; after
RL: the same evaluation and a before/after table. Every file a run writes lives in ``workdir``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl import arch, distributed, hf, losses, model, optim, sharding, sft, step
from jaxrl.checkpoint import CheckpointError, Checkpointer
from jaxrl.config import Config, to_dict
from jaxrl.data.cursor import Mixture, MixtureCursor, next_mixture_batch
from jaxrl.eval import EvalResult, comparison_table, engine_sampler, evaluate
from jaxrl.methods import Methods, eepo_stage1_counts
from jaxrl.metrics import MetricsWriter, plot_run
from jaxrl.phases import Phase, phase_at, run_phases
from jaxrl.progress import Progress
from jaxrl.rollout import sampler
from jaxrl.rollout.build import build_engine
from jaxrl.stats import init_stats, update_stats
from jaxrl.task import TaskData, load_task

log = logging.getLogger(__name__)

# Independent random streams, all derived from config.seed.
_STREAM_INIT, _STREAM_RL, _STREAM_EVAL = 1, 2, 3


def rl_step_config(cfg: Config) -> step.RLStepConfig:
  loss = losses.LossConfig(
    aggregation=cfg.loss.aggregation,
    dual_clip=cfg.loss.dual_clip or None,
    kl_estimator=cfg.loss.kl_estimator,
    use_kl=cfg.loss.kl_coef > 0,
    informative_only=cfg.loss.informative_only,
    max_response_len=cfg.rollout.max_new_tokens,
  )
  mod = cfg.modulation
  return step.RLStepConfig(
    loss=loss,
    num_groups=cfg.batch_questions,
    mini_batches=cfg.loss.mini_batches,
    micro_batches=cfg.loss.micro_batches,
    scale_by_std=cfg.loss.scale_by_std,
    logprob_chunk=cfg.loss.logprob_chunk,
    modulation=mod.enabled,
    modulation_alpha=mod.alpha,
    modulation_gamma=mod.gamma,
    modulation_tau=mod.tau,
  )


def step_hparams(cfg: Config, tau, eps_high) -> step.StepHparams:
  f32 = jnp.float32
  return step.StepHparams(
    loss=losses.LossHparams(
      eps_low=f32(cfg.loss.eps_low),
      eps_high=f32(eps_high),
      kl_coef=f32(cfg.loss.kl_coef),
      entropy_coef=f32(cfg.loss.entropy_coef),
    ),
    tau=f32(tau),
  )


def token_mean_entropy(out) -> float:
  """Token-weighted mean entropy at τ over every generated token of a ``SampleOutput``."""
  mask = np.asarray(out.mask_RxN)
  return float((np.asarray(out.entropy_RxN) * mask).sum() / max(mask.sum(), 1))


def group_outcomes(rewards_R: np.ndarray, group_ids_R: np.ndarray, num_groups: int) -> dict:
  """Fractions of groups whose rollouts are all correct / all wrong (zero-advantage groups)."""
  counts = np.bincount(group_ids_R, minlength=num_groups)
  correct = np.bincount(group_ids_R, weights=rewards_R > 0, minlength=num_groups)
  present = counts > 0
  return dict(
    frac_all_correct=float(np.mean((correct == counts)[present])),
    frac_all_wrong=float(np.mean((correct == 0)[present])),
  )


@dataclasses.dataclass
class _PhaseRuntime:
  """What a phase compiles and samples with: its policies, its train step, its data mixture."""

  phase: Phase
  methods: Methods
  update: object  # jitted step.rl_update for the phase's shapes
  mixture: Mixture


@dataclasses.dataclass
class Trainer:
  """Holds what setup built; ``run`` drives SFT → eval → RL → eval."""

  cfg: Config
  workdir: str

  def __post_init__(self):
    os.makedirs(self.workdir, exist_ok=True)
    if distributed.is_main():
      with open(os.path.join(self.workdir, "config.json"), "w") as f:
        json.dump(to_dict(self.cfg), f, indent=1)
    # Process 0 builds the tokenizer cache in the shared workdir; the others then read it.
    self.task: TaskData = distributed.main_first(
      lambda: load_task(self.cfg, os.path.join(self.workdir, "tokenizer"))
    )
    self.model_cfg = arch.model_config(self.cfg, self.task.vocab_size)
    self.mesh = sharding.make_mesh(self.cfg.mesh.data, self.cfg.mesh.fsdp, self.cfg.mesh.tensor)
    self.graphdef, abstract_params = model.abstract(self.model_cfg)
    self.param_shardings = sharding.tree_shardings(abstract_params, self.mesh)
    t = self.task
    self.engine = build_engine(
      self.cfg,
      self.graphdef,
      self.model_cfg,
      tokenizer=t.tokenizer,
      eos_id=t.eos_id,
      pad_id=t.pad_id,
      prompt_len=t.train_prompt_ids.shape[1],
      workdir=self.workdir,
    )
    self.progress = Progress(enabled=self.cfg.log.progress)
    self._updates = {}  # phase index → its jitted train step
    for phase in run_phases(self.cfg):  # a bad mixture fails here, before anything compiles
      self.task.mixture(phase.mixture, "anneal_phase.mixture")

  # -- phases -------------------------------------------------------------------------------------

  def init_params(self):
    """The checkpoint's weights streamed onto their shardings, or a seeded random init."""
    m = self.cfg.model
    if m.checkpoint:
      log.info("loading %s (params %s, compute %s)", m.checkpoint, m.param_dtype, m.dtype)
      _, _, params = hf.load_hf_checkpoint(
        m.checkpoint,
        dtype=jnp.dtype(m.param_dtype),
        shardings=self.param_shardings,
        scan_layers=m.scan_layers,
        remat=m.remat,
        compute_dtype=m.dtype,
      )
      return params

    def init():
      return model.create(self.model_cfg, self.cfg.seed * 1000 + _STREAM_INIT)[1]

    return jax.jit(init, out_shardings=self.param_shardings)()

  def warm_start(self, params):
    c, t = self.cfg, self.task
    if c.sft.steps == 0:
      return params
    with self.progress.task("SFT warm start", c.sft.steps) as advance:
      params, _ = sft.warm_start(
        self.graphdef,
        params,
        self.mesh,
        prompt_ids_NxP=t.sft_prompt_ids,
        prompt_mask_NxP=t.sft_prompt_mask,
        target_ids_NxT=t.sft_target_ids,
        target_mask_NxT=t.sft_target_mask,
        steps=c.sft.steps,
        batch_size=c.sft.batch_size,
        learning_rate=c.sft.learning_rate,
        warmup_steps=c.sft.warmup_steps,
        weight_decay=c.sft.weight_decay,
        chunk=c.loss.logprob_chunk,
        workdir=self.workdir,
        target_loss=c.sft.target_loss,
        progress=advance,
      )
    return params

  def evaluate(self, params, name: str) -> EvalResult:
    """Held-out evaluation, cached as ``eval_{name}.json`` (a resumed run does not redo it)."""
    path = os.path.join(self.workdir, f"eval_{name}.json")
    if os.path.exists(path):
      with open(path) as f:
        return EvalResult.from_json(json.load(f))
    c, t = self.cfg, self.task
    self.engine.set_weights(params, -1)
    per_call = max(1, c.num_rollouts // c.eval.num_samples)
    calls = -(-len(t.heldout_levels) // per_call)

    with self.progress.task(f"eval ({name})", calls) as advance:
      done = [0]

      def on_call():
        done[0] += 1
        advance(done[0], calls)

      sample_fn = engine_sampler(self.engine, t.decode, c.eval.temperature, on_call)
      result = evaluate(
        sample_fn,
        t.heldout_prompt_ids,
        t.heldout_prompt_mask,
        t.heldout_levels,
        lambda responses, q: t.score(responses, t.heldout_answers[q]),
        num_samples=c.eval.num_samples,
        ks=c.eval_ks,
        questions_per_call=per_call,
        key=jax.random.fold_in(jax.random.PRNGKey(c.seed), _STREAM_EVAL),
      )
    if distributed.is_main():
      with open(path + ".tmp", "w") as f:
        json.dump(result.to_json(), f)
      os.replace(path + ".tmp", path)
    return result

  def rl(self, sft_params) -> None:
    """GRPO steps from the warm start; resumes from the latest checkpoint in ``workdir``."""
    c, t = self.cfg, self.task
    tx = optim.from_config(c.optim)
    state_shardings = step.TrainState(
      step=sharding.replicated(self.mesh),
      params=self.param_shardings,
      opt_state=sharding.tree_shardings(jax.eval_shape(tx.init, sft_params), self.mesh),
    )
    use_kl = c.loss.kl_coef > 0
    ref_params = jax.tree.map(jnp.copy, sft_params) if use_kl else None
    state = jax.jit(functools.partial(step.init_state, tx=tx), out_shardings=state_shardings)(
      sft_params
    )
    phases = run_phases(c)
    num_q = len(t.train_answers)
    rt = self._enter_phase(phases[0], tx, state_shardings)
    log.info("methods: %s", rt.methods.describe())
    tree = {"state": state, "stats": init_stats(num_q), "policies": rt.methods.init(num_q)}
    cursor = MixtureCursor.start(rt.mixture)

    ckpt = Checkpointer(
      os.path.join(self.workdir, "checkpoints"),
      keep=c.checkpoint.keep,
      async_save=c.checkpoint.async_save,
      settle_timeout=c.checkpoint.settle_timeout,
    )
    start = 0
    if ckpt.latest_step() is not None:
      start = ckpt.latest_step()
      rep = sharding.replicated(self.mesh)
      target_shardings = {
        "state": state_shardings,
        "stats": jax.tree.map(lambda _: rep, tree["stats"]),
        "policies": jax.tree.map(lambda _: rep, tree["policies"]),
      }
      abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, target_shardings
      )
      tree, meta = ckpt.restore(start, abstract)
      if meta["phase"] != rt.phase.index:
        rt = self._enter_phase(phases[meta["phase"]], tx, state_shardings)
      cursor = MixtureCursor.from_json(meta["cursor"])
      log.info("resumed from step %d, %s phase (%s)", start, rt.phase.name, ckpt.directory)
    state, stats, policies = tree["state"], tree["stats"], tree["policies"]

    writer = (
      MetricsWriter(
        self.workdir,
        tensorboard=c.log.tensorboard,
        wandb_project=c.log.wandb_project if c.log.wandb else None,
        config=to_dict(c),
        resume_step=start,
      )
      if distributed.is_main()
      else _NoWriter()
    )
    base_key = jax.random.fold_in(jax.random.PRNGKey(c.seed), _STREAM_RL)
    stop = _StopFlag()
    nonfinite_run = 0  # consecutive steps whose update was skipped as non-finite
    try:
      with self.progress.task("GRPO", c.steps, start) as advance:
        for i in range(start, c.steps):
          t0 = time.time()
          if (
            phase_at(phases, i) is not rt.phase
          ):  # the annealing phase begins: new shapes, new data
            epoch = cursor.epoch(rt.mixture)
            rt = self._enter_phase(phase_at(phases, i), tx, state_shardings)
            cursor = MixtureCursor.start(rt.mixture, epoch0=epoch)
            policies = dataclasses.replace(
              policies, alloc=rt.methods.start_phase(policies.alloc, stats, epoch, num_q)
            )
          methods = rt.methods
          epoch_before = cursor.epoch(rt.mixture)
          qids_B, cursor = next_mixture_batch(cursor, c.seed, rt.mixture, c.batch_questions)
          counts_B = methods.allocate(policies.alloc, stats, jnp.asarray(qids_B))
          tau = policies.temperature.tau
          out, eepo_row = self._rollouts(
            state.params,
            methods,
            policies,
            qids_B,
            counts_B,
            tau,
            jax.random.fold_in(base_key, i),
            i,
          )
          if "gate_state" in eepo_row:  # EEPO ran (without it, the row may hold the vLLM gap)
            policies = dataclasses.replace(policies, gate=eepo_row.pop("gate_state"))
          responses = t.decode(out)
          group_ids_R = np.asarray(out.group_ids_R)
          t1 = time.time()
          verified = t.verify(responses, t.train_answers[qids_B[group_ids_R]])
          rewards_R = verified.rewards_R
          stats = update_stats(stats, qids_B, group_ids_R, rewards_R, i)
          # Entropy of the step's rollouts at τ under the params that sampled them (E3's H_t and
          # the clip controller's measured entropy: known before this step's update).
          mask = np.asarray(out.mask_RxN)
          tokens = float(mask.sum())
          h_t = token_mean_entropy(out)
          clip_state = methods.update_clip(policies.clip, h_t)
          eps_high = methods.clip.current(clip_state)
          hp = step_hparams(c, tau, eps_high)
          batch = step.PolicyBatch(
            prompt_ids_RxP=out.prompt_ids_RxP,
            prompt_mask_RxP=out.prompt_mask_RxP,
            response_ids_RxN=out.tokens_RxN,
            response_mask_RxN=out.mask_RxN,
            old_logp_RxN=out.logp_RxN,
            rewards_R=jnp.asarray(rewards_R, jnp.float32),
            group_ids_R=out.group_ids_R,
          )
          t2 = time.time()
          state, m = rt.update(state, sharding.shard_batch(batch, self.mesh), hp, ref_params)
          m = distributed.to_host(m)
          nonfinite_run = self._check_finite(m, nonfinite_run, i + 1)
          t3 = time.time()
          temp_state = methods.update_temperature(policies.temperature, h_t)
          policies = dataclasses.replace(policies, temperature=temp_state, clip=clip_state)
          if (
            cursor.epoch(rt.mixture) != epoch_before
          ):  # a pass over the data ended: E3 re-ranks, bounds widen
            policies = dataclasses.replace(
              policies, alloc=methods.on_epoch_end(policies.alloc, stats, epoch_before)
            )
          counts = np.asarray(counts_B)
          row = dict(
            m,
            reward=float(rewards_R.mean()),
            pass_rate=float((rewards_R > 0).mean()),
            entropy_rollout=h_t,
            response_len=tokens / len(rewards_R),
            tau=float(tau),
            tau_next=float(temp_state.tau),
            tau_clamped=float(temp_state.clamped),
            entropy_target=float(methods.temperature.target(temp_state)),
            eps_low=float(hp.loss.eps_low),
            eps_high=float(eps_high),
            clip_target=float(methods.clip.target(clip_state)),
            alloc_min=float(counts.min()),
            alloc_max=float(counts.max()),
            alloc_std=float(counts.std()),
            alloc_hist=np.bincount(counts, minlength=counts.max() + 1).tolist(),
            rollout_tok_s=tokens / max(t1 - t0, 1e-9),
            train_tok_s=(tokens + mask.shape[0] * out.prompt_ids_RxP.shape[1]) / max(t3 - t2, 1e-9),
            step_time=t3 - t0,
            epoch=cursor.epoch(rt.mixture),
            phase=rt.phase.index,
            group_size=rt.phase.cfg.rollout.group_size,
            max_new_tokens=rt.phase.cfg.rollout.max_new_tokens,
            # Compiled versions of the hot functions: constant after the first step, or
            # something (a shape, a Python scalar) is recompiling every step.
            compiles_update=sum(f._cache_size() for f in self._updates.values()),
            compiles_sampler=sampler.generate._cache_size(),
            **verified.metrics(),
            **eepo_row,
            **group_outcomes(rewards_R, group_ids_R, c.batch_questions),
          )
          if c.eval.every and (i + 1) % c.eval.every == 0 and i + 1 < c.steps:
            row.update(self._validate(state.params, i + 1))
          writer.write(i + 1, row)
          advance(i + 1, c.steps, f"reward {row['reward']:.3f} H {h_t:.3f} τ {float(tau):.2f}")
          if (i + 1) % c.checkpoint.every == 0 or i + 1 == c.steps or stop.requested:
            ckpt.save(
              i + 1,
              {"state": state, "stats": self._global(stats), "policies": self._global(policies)},
              {"cursor": cursor.to_json(), "phase": rt.phase.index, "step": i + 1},
            )
          if stop.requested:
            ckpt.wait()  # the stop is only reported once the checkpoint is on disk
            _check_saved(ckpt, i + 1)
            log.warning(
              "%s: checkpoint saved at step %d; run again to resume", stop.signal_name, i + 1
            )
            raise Stopped(i + 1)
    finally:
      stop.restore()
      ckpt.close()
      writer.close()
    _check_saved(ckpt, c.steps)
    self.final_params, self.final_stats = state.params, stats

  def _check_finite(self, metrics: dict, run: int, step_number: int) -> int:
    """Counts consecutive steps with a skipped (non-finite) update; too many stop the run."""
    if not metrics["nonfinite_updates"]:
      return 0
    run += 1
    log.warning(
      "step %d: non-finite loss or gradients (loss %s, grad norm %s): update skipped (%d in a row)",
      step_number,
      metrics["loss"],
      metrics["grad_norm"],
      run,
    )
    limit = self.cfg.optim.max_nonfinite_steps
    if run >= limit:
      raise NonFiniteError(
        f"{run} consecutive steps had non-finite loss or gradients (limit "
        f"optim.max_nonfinite_steps={limit}); the last checkpoint holds the "
        f"last finite state"
      )
    return run

  def _global(self, tree):
    """Host-side state (question statistics, controllers) as arrays replicated over the global
    mesh: what a multi-process orbax save needs (a no-op with one process)."""
    if jax.process_count() == 1:
      return tree
    rep = sharding.replicated(self.mesh)
    return jax.tree.map(
      lambda x: jax.make_array_from_callback(
        np.shape(x), rep, lambda index, x=np.asarray(x): x[index]
      ),
      tree,
    )

  def export_hf(self, params) -> str:
    """The trained policy as an HF checkpoint in ``WORKDIR/hf`` (model.dtype, tokenizer,
    generation config): what transformers, vLLM and ``python -m jaxrl.eval`` load."""
    out = os.path.join(self.workdir, "hf")
    dtype = jnp.dtype(self.cfg.model.dtype)
    params = jax.tree.map(lambda x: x.astype(dtype), params)
    if jax.process_count() > 1:
      params = distributed.to_host(params)  # a collective: every process gathers, process 0 writes
      if not distributed.is_main():
        return out
    hf.save_hf_checkpoint(self.model_cfg, params, out, tokenizer=self.task.tokenizer)
    generation = os.path.join(self.cfg.model.checkpoint, "generation_config.json")
    if os.path.exists(generation):
      shutil.copy(generation, out)
    log.info("trained policy exported to %s (%s)", out, dtype.name)
    return out

  def _validate(self, params, step_number: int) -> dict:
    """The periodic held-out evaluation (``eval.every``), as ``val/…`` metrics of the step."""
    result = self.evaluate(params, f"step{step_number}")
    row = {f"val/pass@{k}": v["all"] for k, v in result.pass_at.items()}
    row["val/greedy"] = result.greedy["all"]
    log.info(
      "step %d held-out: %s", step_number, ", ".join(f"{k} {100 * v:.1f}" for k, v in row.items())
    )
    return row

  def _enter_phase(self, phase: Phase, tx, state_shardings) -> _PhaseRuntime:
    """The phase's policies, jitted train step and mixture; the engine samples its response length."""
    pc = phase.cfg
    if phase.index not in self._updates:
      self._updates[phase.index] = jax.jit(
        functools.partial(step.rl_update, self.graphdef, tx, rl_step_config(pc)),
        donate_argnums=(0,),
        out_shardings=(state_shardings, None),
      )
    self.engine.max_new_tokens = pc.rollout.max_new_tokens
    mixture = self.task.mixture(phase.mixture, "anneal_phase.mixture", stream=phase.index)
    if phase.index:
      log.info(
        "%s phase from step %d: %d questions (%s), G=%d, max_new_tokens=%d",
        phase.name,
        phase.start + 1,
        mixture.size,
        phase.mixture or "all",
        pc.rollout.group_size,
        pc.rollout.max_new_tokens,
      )
    return _PhaseRuntime(
      phase, Methods(pc, self.model_cfg.vocab_size), self._updates[phase.index], mixture
    )

  def _rollouts(self, params, methods: Methods, policies, qids_B, counts_B, tau, key, step_index):
    """The step's rollouts: one stage, or EEPO's sample → gate → forget → sample.

    EEPO's θ' is a temporary rollout version; the next step's ``set_weights`` replaces it.
    """
    c, t = self.cfg, self.task
    ids, mask = t.train_prompt_ids[qids_B], t.train_prompt_mask[qids_B]
    self.engine.set_weights(params, step_index)
    if not c.eepo.enabled:
      return self._sample(params, ids, mask, counts_B, tau, key)
    counts1_B = eepo_stage1_counts(counts_B)
    out1, info1 = self._sample(params, ids, mask, counts1_B, tau, jax.random.fold_in(key, 1))
    h1 = token_mean_entropy(out1)
    fire, gate_state = methods.gate(policies.gate, h1)
    unlearn, params2 = float("nan"), params
    if bool(fire):
      params2, unlearn = self._forget(
        params,
        out1.prompt_ids_RxP,
        out1.prompt_mask_RxP,
        out1.tokens_RxN,
        out1.mask_RxN,
        jnp.float32(tau),
      )
      self.engine.set_weights(params2, f"{step_index}-forget")
    out2, info2 = self._sample(
      params2, ids, mask, counts_B - counts1_B, tau, jax.random.fold_in(key, 2)
    )
    out = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), out1, out2)
    if bool(fire) and c.eepo.old_logp_from == "policy":
      old_logp, _ = self._score(
        params, out.prompt_ids_RxP, out.prompt_mask_RxP, out.tokens_RxN, out.mask_RxN, tau
      )
      out = dataclasses.replace(out, logp_RxN=old_logp)
    gaps = [d["rollout_logp_gap"] for d in (info1, info2) if d]
    return out, {
      "eepo_gate": float(bool(fire)),
      "eepo_unlearn_loss": float(unlearn),
      "entropy_stage1": h1,
      "entropy_stage2": token_mean_entropy(out2),
      "gate_state": gate_state,
      **({"rollout_logp_gap": max(gaps)} if gaps else {}),
    }

  def _sample(self, params, ids_BxP, mask_BxP, counts_B, tau, key):
    """Rollouts from the engine, with π_old log-probs and entropies at τ under ``params``.

    The JAX sampler returns both. A vLLM sidecar returns its own log-probs but no entropies: the
    rollouts are scored here under the params that sampled them (one forward, as the update does),
    those log-probs serve as π_old, and the largest gap to the server's is logged.
    """
    out = self.engine.generate(ids_BxP, mask_BxP, counts_B, tau, key)
    if self.engine.provides_entropy:
      return out, {}
    logp, ent = self._score(
      params, out.prompt_ids_RxP, out.prompt_mask_RxP, out.tokens_RxN, out.mask_RxN, tau
    )
    logp, ent = distributed.to_host((logp, ent))
    gap = float(np.max(np.abs(logp - out.logp_RxN), initial=0.0))
    out = jax.tree.map(jnp.asarray, dataclasses.replace(out, logp_RxN=logp, entropy_RxN=ent))
    return out, {"rollout_logp_gap": gap}

  def _forget(self, params, prompt_ids_RxP, prompt_mask_RxP, tokens_RxN, mask_RxN, tau):
    """EEPO's θ' from the stage-1 rows: rows sharded over the data axes, accumulated in
    ``step.sequential_chunks`` chunks as ``_score`` (what --plan compiles)."""
    batch, micro = self._row_chunks(prompt_ids_RxP, prompt_mask_RxP, tokens_RxN, mask_RxN)
    return self._forget_jit(params, *batch, tau, micro=micro)

  def _row_chunks(self, *rows_R):
    """Host rows → (arrays sharded over the data axes, the number of sequential chunks)."""
    batch = sharding.shard_batch(tuple(np.asarray(x) for x in rows_R), self.mesh)
    return batch, step.sequential_chunks(len(rows_R[0]), self.cfg.loss.micro_batches)

  @functools.cached_property
  def _forget_jit(self):
    e = self.cfg.eepo
    # θ' gets θ's shardings, so stage 2 reuses the sampler compiled for stage 1.
    return jax.jit(
      functools.partial(
        step.eepo_forget,
        self.graphdef,
        self.cfg.loss.logprob_chunk,
        lr=e.lr,
        eps_l=e.eps_l,
        eps_r=e.eps_r,
      ),
      out_shardings=(self.param_shardings, None),
      static_argnames=("micro",),
    )

  def _score(self, params, prompt_ids_RxP, prompt_mask_RxP, tokens_RxN, mask_RxN, tau):
    """π_old log-probs and entropies at τ of R rollouts under ``params``: rows sharded over the
    data axes and scored in ``step.sequential_chunks`` chunks."""
    batch, micro = self._row_chunks(prompt_ids_RxP, prompt_mask_RxP, tokens_RxN, mask_RxN)
    return self._score_jit(params, *batch, jnp.float32(tau), micro=micro)

  @functools.cached_property
  def _score_jit(self):
    return jax.jit(
      functools.partial(
        step.score_responses_chunked, self.graphdef, chunk_size=self.cfg.loss.logprob_chunk
      ),
      static_argnames=("micro",),
    )

  # -- whole run ----------------------------------------------------------------------------------

  def run(self) -> dict:
    """SFT → eval → RL → eval; the rollout engine (a sidecar server) stops however this ends."""
    try:
      params = self.warm_start(self.init_params())
      before = self.evaluate(params, "sft")
      self.rl(params)
      after = self.evaluate(self.final_params, f"step{self.cfg.steps}")
      if self.cfg.model.checkpoint:
        self.export_hf(self.final_params)
    finally:
      self.engine.close()
      self.task.close()
    table = comparison_table(before, after, self.cfg.eval_ks, self.task.level_names)
    summary = {"before": before.to_json(), "after": after.to_json(), "table": table}
    if not distributed.is_main():
      return summary
    with open(os.path.join(self.workdir, "results.md"), "w") as f:
      f.write(
        f"# Held-out evaluation (seed {self.cfg.seed}, {self.cfg.steps} RL steps)\n\n{table}\n"
      )
    if self.cfg.log.plot and os.path.exists(os.path.join(self.workdir, "metrics.jsonl")):
      plot_run(os.path.join(self.workdir, "metrics.jsonl"), os.path.join(self.workdir, "run.png"))
    return summary


def _check_saved(ckpt: Checkpointer, step_number: int) -> None:
  """The run's last checkpoint must be on disk before the run reports success (or a stop)."""
  if step_number in ckpt.failed:
    latest = ckpt.latest_step()
    raise CheckpointError(
      f"the checkpoint of step {step_number} could not be written "
      f"({ckpt.last_error}); "
      + (
        f"the latest usable one is step {latest} in {ckpt.directory}"
        if latest is not None
        else f"no usable checkpoint in {ckpt.directory}"
      )
    )


class NonFiniteError(RuntimeError):
  """Training diverged: too many consecutive non-finite steps."""


class _NoWriter:
  """Processes other than 0 write no metrics."""

  def write(self, step, row):
    return row

  def close(self):
    pass


class Stopped(Exception):
  """The run stopped on request (SIGINT / SIGTERM) after saving the step's checkpoint."""

  def __init__(self, step: int):
    super().__init__(f"stopped after step {step}; its checkpoint is saved")
    self.step = step


class _StopFlag:
  """First SIGINT (Ctrl-C) or SIGTERM (a scheduler's preemption): finish the step, checkpoint,
  stop. A second one: stop at once."""

  SIGNALS = (signal.SIGINT, signal.SIGTERM)

  def __init__(self):
    self.requested = False
    self.signal_name = ""
    self._previous = {}
    try:
      for sig in self.SIGNALS:
        self._previous[sig] = signal.signal(sig, self._handle)
    except ValueError:  # not the main thread (e.g. inside some test runners)
      self.restore()

  def _handle(self, signum, frame):
    if self.requested:
      raise KeyboardInterrupt
    self.requested = True
    self.signal_name = signal.Signals(signum).name
    log.warning(
      "%s: finishing this step and saving a checkpoint (again to abort)", self.signal_name
    )

  def restore(self):
    for sig, previous in self._previous.items():
      signal.signal(sig, previous)
    self._previous = {}


def train(cfg: Config, workdir: str) -> dict:
  return Trainer(cfg, workdir).run()
