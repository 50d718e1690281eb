"""One home for the run's compiled programs: the trainer runs them, ``--plan`` lowers them.

``Programs`` holds what every jitted step of a run shares (the model's graphdef, the mesh, the
optimizer, the train state's shardings) and builds each jitted function once per static
configuration: the GRPO update per ``LossConfig`` (one per phase), π_old rescoring per log-prob
chunk, EEPO's forgetting step per ``ForgetConfig``. ``Trainer`` and ``plan.build`` both construct
their programs here, so the plan compiles exactly the functions, static arguments, donations and
output shardings that run. (The JAX sampler's jitted body lives with the sampler,
``rollout.sampler.generate``; the plan lowers that same function.)
"""

from __future__ import annotations

import functools

import jax
import optax

from jaxrl.nn import lora
from jaxrl.nn.sections import ModelSection
from jaxrl.parallel import sharding
from jaxrl.rl import forget, optim, scoring, step
from jaxrl.rl.program_configs import ForgetConfig, LossConfig
from jaxrl.rl.sections import LossSection, OptimSection
from jaxrl.types import TrainState


def reference_copy(loss: LossSection, model: ModelSection) -> bool:
  """Whether the update gets a frozen copy of the warm-start params as its KL reference: with KL,
  unless the model has LoRA adapters (then the reference is the policy with them switched off)."""
  return loss.kl_coef > 0 and not model.lora.rank


def train_state_shardings(
  tx: optax.GradientTransformation, abstract_params, mesh, trainable: lora.Trainable = "all"
):
  """Shardings of a ``TrainState``: params by logical axes, optimizer moments like their params
  (moments exist for the ``trainable`` part only)."""
  trained = lora.partition(abstract_params, trainable)[0]
  return TrainState(
    step=sharding.replicated(mesh),
    params=sharding.tree_shardings(abstract_params, mesh),
    opt_state=sharding.tree_shardings(jax.eval_shape(tx.init, trained), mesh),
  )


def differentiating_options(mesh) -> dict[str, str]:
  """XLA compiler options of the programs that differentiate the model on ``mesh``.

  On CPU, XLA removes optimization barriers right after its first CSE pass
  (``cse_barrier_expander``); later passes then merged ``jax.checkpoint``'s recomputation back
  into the forward, so with the layers unrolled ``model.remat`` saved nothing (Qwen2.5-0.5B shape,
  8 × (32 + 512) tokens, remat full: 13.5 GiB of XLA temp, as without remat; 5.25 GiB with the
  barriers kept). Keeping them makes remat on CPU recompute as it does on GPU, where the barriers
  live until scheduling. Programs without barriers compile the same either way."""
  if mesh.devices.flat[0].platform != "cpu":
    return {}
  # A pass's name, not an option: XLA skips the passes it names and ignores a name it lacks (a
  # later XLA that renames the pass costs CPU memory, never an error); same name in jax 0.10-0.11.
  return {"xla_disable_hlo_passes": "cse_barrier_expander"}


class Programs:
  """The jitted programs of one run (or one SFT warm start) on one mesh.

  ``trainable`` (``lora.Trainable``) is what every update and EEPO's forgetting step move: the
  RL run's is ``lora.policy_trainable`` (the adapters of a LoRA model, else everything); a LoRA
  run's SFT warm start trains the base ("base")."""

  def __init__(
    self,
    graphdef,
    abstract_params,
    mesh,
    tx: optax.GradientTransformation,
    trainable: lora.Trainable = "all",
  ):
    self.graphdef = graphdef
    self.mesh = mesh
    self.tx = tx
    self.trainable = trainable
    self.state_shardings = train_state_shardings(tx, abstract_params, mesh, trainable)
    self.param_shardings = self.state_shardings.params
    self._built: dict[tuple, object] = {}

  @classmethod
  def for_run(cls, o: OptimSection, graphdef, abstract_params, mesh) -> Programs:
    """The RL run's programs: its optimizer is the config's ``optim`` section's."""
    trainable = lora.policy_trainable(abstract_params)
    return cls(graphdef, abstract_params, mesh, optim.from_config(o), trainable)

  def _once(self, key: tuple, build):
    if key not in self._built:
      self._built[key] = build()
    return self._built[key]

  @property
  def init_state(self):
    """params → TrainState on the state's shardings (step 0, fresh optimizer moments)."""
    return self._once(
      ("init_state",),
      lambda: jax.jit(
        functools.partial(step.init_state, tx=self.tx, trainable=self.trainable),
        out_shardings=self.state_shardings,
      ),
    )

  def update(self, loss_cfg: LossConfig):
    """The GRPO update ``(state, batch, LossHparams, ref_params, packing) → (state, metrics)``;
    the state is donated (updated in place) and keeps its shardings. A ``rl.packing.Packing``
    runs it packed: one program per bucket of buffer rows (its static ``rows``)."""
    return self._once(
      ("update", loss_cfg),
      lambda: jax.jit(
        functools.partial(
          step.rl_update, self.graphdef, self.tx, loss_cfg, trainable=self.trainable
        ),
        donate_argnums=(0,),
        out_shardings=(self.state_shardings, None),
        compiler_options=differentiating_options(self.mesh),
      ),
    )

  def policy_grad(self, loss_cfg: LossConfig):
    """``(params, batch, LossHparams, ref_params) → grads`` of the GRPO loss (the trainable part,
    sharded as the params), nothing updated or donated: the gradient-variance diagnostic's."""
    return self._once(
      ("policy_grad", loss_cfg),
      lambda: jax.jit(
        functools.partial(step.policy_grad, self.graphdef, loss_cfg, trainable=self.trainable),
        compiler_options=differentiating_options(self.mesh),
      ),
    )

  def sft_update(self, chunk: int):
    """One supervised step ``(state, prompt ids, mask, target ids, mask[, loss mask]) → (state,
    metrics)``."""
    return self._once(
      ("sft_update", chunk),
      lambda: jax.jit(
        functools.partial(step.sft_update, self.graphdef, self.tx, chunk, trainable=self.trainable),
        donate_argnums=(0,),
        out_shardings=(self.state_shardings, None),
        compiler_options=differentiating_options(self.mesh),
      ),
    )

  def logp(self, chunk: int):
    """π_old log-probs and entropies at τ of rows sharded over the data axes, in ``micro``
    sequential strided chunks (``micro`` static)."""
    return self._once(
      ("logp", chunk),
      lambda: jax.jit(
        functools.partial(scoring.logp_responses_chunked, self.graphdef, chunk_size=chunk),
        static_argnames=("micro",),
      ),
    )

  def forget(self, fc: ForgetConfig):
    """EEPO's θ' = θ + η∇L ``(params, *rows, tau, packing, micro=)``; θ' gets θ's shardings, so
    stage 2 reuses stage 1's sampler."""
    return self._once(
      ("forget", fc),
      lambda: jax.jit(
        functools.partial(
          forget.eepo_forget,
          self.graphdef,
          fc.logprob_chunk,
          lr=fc.lr,
          eps_l=fc.eps_l,
          eps_r=fc.eps_r,
          paper_clip=fc.paper_clip,
          trainable=self.trainable,
        ),
        out_shardings=(self.param_shardings, None),
        static_argnames=("micro",),
        compiler_options=differentiating_options(self.mesh),
      ),
    )

  def built(self) -> dict[tuple, object]:
    """Every program built so far, by (kind, static configuration)."""
    return dict(self._built)
