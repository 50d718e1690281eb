"""The docs a user has: every ``docs/algorithms.md §N`` cited in the code, tests, benchmarks and docs
is a section of it, nothing points outside the repository, the README's performance figures, the
tools evidence's figures (README, docs/environments.md) and docs/rewards.md's tiny:rm outcome are
their results files', and the API example runs."""

from __future__ import annotations

import glob
import os
import re

from run_helpers import ROOT

CITATION = re.compile(r"algorithms\.md[^§\n]{0,3}§\s?(\d+(?:\.\d+)*)")
HEADING = re.compile(r"#+\s*§?(\d+(?:\.\d+)*)")


def _files(*patterns: str) -> list[str]:
  return sorted(f for p in patterns for f in glob.glob(os.path.join(ROOT, p), recursive=True))


def _sections() -> set[str]:
  with open(os.path.join(ROOT, "docs", "algorithms.md")) as f:
    return {m.group(1) for line in f if (m := HEADING.match(line))}


def test_every_cited_section_of_the_algorithms_doc_exists():
  sections = _sections()
  assert {"0", "1", "9.1", "11"} <= sections  # the headings are read as numbered
  files = _files("jaxrl/**/*.py", "tests/*.py", "bench/*.py", "configs/*.py", "docs/*.md")
  files += _files("README.md", "WORKSPACE.md")
  cited = {
    (os.path.relpath(f, ROOT), m.group(1))
    for f in files
    for m in CITATION.finditer(open(f, encoding="utf-8").read())
  }
  assert len(cited) > 30
  assert not [(f, s) for f, s in cited if s not in sections]


def test_nothing_points_outside_the_repository():
  files = _files("jaxrl/**/*.py", "docs/*.md", "README.md", "WORKSPACE.md")
  assert not [f for f in files if "shared/" in open(f, encoding="utf-8").read()]


NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
RESULTS_LINK = re.compile(r"\]\((bench/results/[^)#]+)")


def _performance_rows() -> list[list[str]]:
  """README's performance table: one list of cells per figure row."""
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    section = f.read().split("\n## Performance\n", 1)[1].split("\n## ", 1)[0]
  rows = [line.strip().strip("|").split("|") for line in section.splitlines() if line[:2] == "| "]
  return [[c.strip() for c in row] for row in rows[1:]]  # the header row left out


def test_the_performance_table_quotes_its_results_files():
  """Each figure of the table (every number in its figure column) appears, as written, in the
  results file its row links: a figure changes with its file or the test fails."""
  rows = _performance_rows()
  assert len(rows) >= 8
  missing = []
  for what, figure, _, details in rows:
    links = RESULTS_LINK.findall(details)
    assert links, f"the row {what!r} links no results file"
    text = "".join(open(os.path.join(ROOT, p), encoding="utf-8").read() for p in links)
    for number in NUMBER.findall(figure):
      if not re.search(rf"(?<![\d.]){re.escape(number)}(?!\d)", text):
        missing.append((what, number, links))
  assert not missing


TOOLS_LINK = re.compile(r"\]\((?:\.\./)?(bench/results/tools[^)#]*)")
DECIMAL = re.compile(r"(?<![\w.])\d+\.\d+(?![\w.]*\w)")  # 46.1, 0.48; not 0.8M
PERCENT = re.compile(r"(?<![\w.])(\d+)(?:–(\d+))?%")  # 45%, 98–99%


def test_the_tools_evidence_quotes_its_results_files():
  """Each paragraph of README.md and docs/environments.md that links a tools results file quotes
  it: every decimal figure appears there as written, every whole percent is one of its figures
  rounded. A figure changes with its file or the test fails."""
  missing, checked = [], 0
  for doc in ("README.md", os.path.join("docs", "environments.md")):
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
      paragraphs = f.read().split("\n\n")
    for para in paragraphs:
      links = sorted(set(TOOLS_LINK.findall(para)))
      if not links:
        continue
      text = "".join(open(os.path.join(ROOT, p), encoding="utf-8").read() for p in links)
      for number in DECIMAL.findall(para):
        checked += 1
        if not re.search(rf"(?<![\d.]){re.escape(number)}(?!\d)", text):
          missing.append((doc, number, links))
      rounded = {round(float(x)) for x in NUMBER.findall(text.replace(",", ""))}
      for whole in (int(n) for m in PERCENT.finditer(para) for n in m.groups() if n):
        checked += 1
        if whole not in rounded:
          missing.append((doc, f"{whole}%", links))
  assert checked > 30, checked
  assert not missing


def test_the_rewards_doc_quotes_its_results_file():
  """docs/rewards.md's paragraph on what tiny:rm's policy learned: each number in it appears, as
  written, in the results file it links, so a figure changes with its file or the test fails."""
  with open(os.path.join(ROOT, "docs", "rewards.md"), encoding="utf-8") as f:
    (paragraph,) = [p for p in f.read().split("\n\n") if "bench/results/rm_outcome.md" in p]
  quoted = re.sub(r"\]\([^)]*\)", "]", paragraph)  # a link's target holds no figure
  with open(os.path.join(ROOT, "bench", "results", "rm_outcome.md"), encoding="utf-8") as f:
    results = f.read()
  numbers = NUMBER.findall(quoted)
  assert len(numbers) >= 3
  assert not [n for n in numbers if not re.search(rf"(?<![\d.]){re.escape(n)}(?!\d)", results)]


def test_the_python_api_example_runs(tmp_path, capsys):
  """docs/api.md's example, as a user would paste it (its run directory moved under tmp_path)."""
  with open(os.path.join(ROOT, "docs", "api.md")) as f:
    (code,) = re.findall(r"```python\n(.*?)```", f.read(), re.S)
  assert '"/tmp/api_run"' in code
  exec(
    compile(code.replace('"/tmp/api_run"', repr(str(tmp_path / "run"))), "docs/api.md", "exec"), {}
  )
  lines = capsys.readouterr().out.splitlines()
  assert [line.split()[0] for line in lines] == ["1", "2", "3"]  # a row per step
  assert all("'reward':" in line and "'tau':" in line for line in lines)


def test_the_make_run_table_and_time_are_its_results_file():
  """README's first table and the time it quotes for `make run` are bench/results/make_run.md's
  (bench/make_run.py writes it from a run): a new run's figures change both or the test fails."""
  with open(os.path.join(ROOT, "bench", "results", "make_run.md"), encoding="utf-8") as f:
    results = f.read()
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    readme = f.read()
  rows = [line for line in results.splitlines() if line.startswith("|") and "---" not in line]
  block = readme.split("```\n| level", 1)[1].split("```", 1)[0]
  assert ("| level" + block).strip().splitlines() == rows
  (minutes,) = re.findall(r"\*\*(\d+\.\d) minutes\*\*", results)
  assert f"It takes about {minutes} minutes on 2 cores" in readme
