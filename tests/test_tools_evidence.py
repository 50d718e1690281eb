"""The tools evidence's report (bench/tools_evidence.py): its figures say what the runs show, at
the precision they are written with."""

from bench import tools_evidence


def test_a_cell_writes_the_mean_and_the_range_alike():
  # A mean to 0.1 beside a range rounded to integers read "99.8 (100–100)".
  assert tools_evidence._cell([0.995, 1.0, 1.0]) == "99.8 (99.5–100.0)"
  assert tools_evidence._cell([0.5]) == "50.0"
  assert tools_evidence._cell([0.40, 0.53], scale=1, digits=2) == "0.47 (0.40–0.53)"


def test_per_seed_values_are_shown():
  assert tools_evidence._seeds([0.17, 0.98, 0.2]) == "17.0 / 98.0 / 20.0"


def test_each_setting_has_its_own_run_directory():
  dirs = {tools_evidence.workdir("r", s, 0) for s in tools_evidence.SETTINGS}
  assert dirs == {"r/tool_s0", "r/tool_chat_s0", "r/no_tool_s0"}
