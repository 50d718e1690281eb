"""E3's 7B run: DeepSeek-R1-Distill-Qwen-7B on 8 GPUs (see jaxrl/paper_configs.py for every setting).

  python -m jaxrl.main --config=configs/qwen7b.py --workdir=runs/qwen7b
  python -m jaxrl.main --config=configs/qwen7b.py --plan      # memory per device, no weights needed

Variants: ``configs/qwen7b.py:grpo`` (baseline), ``:dynamo``, ``:eepo``, ``:es``. Weights in
``$JAXRL_MODELS/DeepSeek-R1-Distill-Qwen-7B`` (default ``models/``), data in ``$JAXRL_DATA``
(default ``data/math``: ``train.jsonl``, ``val.jsonl``), or ``--config.model.checkpoint=DIR``,
``--config.data.train=FILE[:WEIGHT],...``.
"""

from jaxrl.paper_configs import METHODS, OPTIONS, math_config

VARIANTS = METHODS + OPTIONS  # listed by --help; e3 is the default


def get_config(arg: str = ""):
  return math_config("7b", arg)
