"""Typed, frozen run configuration, converted once from an ``ml_collections.ConfigDict``.

``schema``: ``Config``, which assembles the sections; each section with its checks in the module
of what it configures (``model_sections``, ``task_sections``, ``rollout_sections``,
``update_sections``, ``methods_sections``, ``run_sections``); ``fields``: ``ConfigError``,
``Range``, the field checks; ``validate``: ConfigDict → validated ``Config`` (``from_configdict``); ``loss``: the update's static part (``LossConfig``);
``mixture``: ``NAME[:WEIGHT],...`` specs; ``reward_terms``: ``KIND[:SOURCE][*WEIGHT],...`` specs;
``anneal_phase``: the config inside the annealing phase (the phases themselves:
``jaxrl.methods.phases``).
"""

from jaxrl.config.anneal_phase import annealing  # noqa: F401
from jaxrl.config.fields import ConfigError  # noqa: F401
from jaxrl.config.loss import LossConfig, resolved_correction  # noqa: F401
from jaxrl.config.methods_sections import (  # noqa: F401
  AllocationSection,
  AnnealPhaseSection,
  ClipSection,
  DynamoAllocationSection,
  E3AllocationSection,
  EEPOSection,
  ModulationSection,
  OldLogpFrom,
  TemperatureSection,
)
from jaxrl.config.mixture import parse_mixture  # noqa: F401
from jaxrl.config.model_sections import (  # noqa: F401
  Dtype,
  LoraSection,
  LoraTarget,
  ModelSection,
  Remat,
)
from jaxrl.config.reward_terms import TERM_KINDS, TermSpec, parse_terms  # noqa: F401
from jaxrl.config.rollout_sections import (  # noqa: F401
  Engine,
  LoraSync,
  RolloutSection,
  VllmDtype,
  VllmSection,
  WeightTransfer,
)
from jaxrl.config.run_sections import (  # noqa: F401
  CheckpointSection,
  DiagnosticsSection,
  EvalSection,
  LogSection,
  MeshSection,
  SFTSection,
  resolve_ks,
)
from jaxrl.config.schema import Config  # noqa: F401
from jaxrl.config.task_sections import (  # noqa: F401
  MIN_REWARD_MEMORY_MB,
  MIN_TOOL_MEMORY_MB,
  DataSection,
  Overlength,
  RewardCombine,
  RewardSection,
  TaskName,
  TaskSection,
  ToolSection,
)
from jaxrl.config.update_sections import (  # noqa: F401
  Aggregation,
  BehaviourCorrection,
  Correction,
  KLEstimator,
  LossSection,
  OptimSection,
)
from jaxrl.config.validate import default_configdict, from_configdict, to_dict  # noqa: F401
