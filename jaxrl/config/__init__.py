"""The run's typed, frozen configuration, converted once from an ``ml_collections.ConfigDict``.

``schema``: ``Config``, which assembles the sections; each section is defined with its checks beside
the component it configures (``jaxrl.{nn,rl,methods,tasks,rollout,parallel,workdir,run}.sections``)
and re-exported here, the names users import. ``validate``: ConfigDict → validated ``Config``
(``from_configdict``), and the checks that span sections; ``derived``: what the whole config
implies (the annealing phase's config, the compiled programs' static configurations). How a field
is checked: ``jaxrl.fields`` (``ConfigError``, ``Range``). Importing this package loads no JAX: a
broken config exits before any compile.
"""

from jaxrl.config.derived import annealing, forget_config, loss_config  # noqa: F401
from jaxrl.config.schema import Config  # noqa: F401
from jaxrl.config.validate import default_configdict, from_configdict, to_dict  # noqa: F401
from jaxrl.fields import ConfigError  # noqa: F401
from jaxrl.methods.sections import (  # noqa: F401
  AllocationSection,
  AnnealPhaseSection,
  ClipSection,
  DynamoAllocationSection,
  E3AllocationSection,
  EEPOSection,
  OldLogpFrom,
  TemperatureSection,
)
from jaxrl.nn.sections import (  # noqa: F401
  Dtype,
  LoraSection,
  LoraTarget,
  ModelSection,
  Remat,
)
from jaxrl.parallel.sections import MeshSection  # noqa: F401
from jaxrl.rl.program_configs import ForgetConfig, LossConfig, resolved_correction  # noqa: F401
from jaxrl.rl.sections import (  # noqa: F401
  Aggregation,
  BehaviourCorrection,
  Correction,
  KLEstimator,
  LossSection,
  ModulationSection,
  OptimSection,
)
from jaxrl.rollout.sections import (  # noqa: F401
  Engine,
  LoraSync,
  RolloutSection,
  VllmDtype,
  VllmSection,
  WeightTransfer,
)
from jaxrl.run.sections import DiagnosticsSection, EvalSection, LogSection, resolve_ks  # noqa: F401
from jaxrl.tasks.mixture import parse_mixture  # noqa: F401
from jaxrl.tasks.sections import (  # noqa: F401
  MIN_REWARD_MEMORY_MB,
  MIN_TOOL_MEMORY_MB,
  DataSection,
  Overlength,
  RewardCombine,
  RewardSection,
  SFTSection,
  TaskName,
  TaskSection,
  ToolSection,
)
from jaxrl.tasks.term_specs import TERM_KINDS, TermSpec, parse_terms  # noqa: F401
from jaxrl.workdir.sections import CheckpointSection  # noqa: F401
