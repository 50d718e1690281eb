"""Typed, frozen run configuration, converted once from an ``ml_collections.ConfigDict``.

``schema``: the sections, ``Config`` and ``ConfigError``; ``validate``: ConfigDict → validated
``Config`` (``from_configdict``); ``loss``: the update's static part (``LossConfig``);
``mixture``: ``NAME[:WEIGHT],...`` specs; ``reward_terms``: ``KIND[:SOURCE][*WEIGHT],...`` specs;
``anneal_phase``: the config inside the annealing phase (the phases themselves:
``jaxrl.methods.phases``).
"""

from jaxrl.config.anneal_phase import annealing  # noqa: F401
from jaxrl.config.loss import LossConfig, resolved_correction  # noqa: F401
from jaxrl.config.mixture import parse_mixture  # noqa: F401
from jaxrl.config.reward_terms import TERM_KINDS, TermSpec, parse_terms  # noqa: F401
from jaxrl.config.schema import (  # noqa: F401
  MIN_REWARD_MEMORY_MB,
  MIN_TOOL_MEMORY_MB,
  Aggregation,
  AllocationSection,
  AnnealPhaseSection,
  BehaviourCorrection,
  CheckpointSection,
  ClipSection,
  Config,
  ConfigError,
  Correction,
  DataSection,
  DiagnosticsSection,
  Dtype,
  DynamoAllocationSection,
  E3AllocationSection,
  EEPOSection,
  Engine,
  EvalSection,
  KLEstimator,
  LogSection,
  LoraSection,
  LoraSync,
  LoraTarget,
  LossSection,
  MeshSection,
  ModelSection,
  ModulationSection,
  OldLogpFrom,
  OptimSection,
  Overlength,
  Remat,
  RewardCombine,
  RewardSection,
  RolloutSection,
  SFTSection,
  TaskName,
  TaskSection,
  TemperatureSection,
  ToolSection,
  VllmDtype,
  VllmSection,
  WeightTransfer,
  resolve_ks,
)
from jaxrl.config.validate import default_configdict, from_configdict, to_dict  # noqa: F401
