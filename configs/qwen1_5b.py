"""E3's 1.5B run: DeepSeek-R1-Distill-Qwen-1.5B on 4 GPUs, lr 5e-6 (see jaxrl/paper_configs.py).

  python -m jaxrl.main --config=configs/qwen1_5b.py --workdir=runs/qwen1_5b

Variants and paths as in ``configs/qwen7b.py``.
"""

from jaxrl.paper_configs import METHODS, OPTIONS, math_config

VARIANTS = METHODS + OPTIONS  # listed by --help; e3 is the default


def get_config(arg: str = ""):
  return math_config("1.5b", arg)
