"""The documentation stays true: the config reference is generated from the section dataclasses."""
import os
import re

from jalign import config
from tests.configs_util import ROOT


def test_config_reference_is_current():
  """docs/config.md is what `python -m jalign.config` writes now (rerun it after changing a section)."""
  with open(os.path.join(ROOT, "docs", "config.md"), encoding="utf-8") as f:
    assert f.read() == config.reference_page(), "docs/config.md is stale: python -m jalign.config > docs/config.md"


METRIC = re.compile(r"\"((?:actor|critic|eval|train|rollout|perf|timing_s|data|mismatch|monitor|agent|response_length|"
                    r"rewards|logps|rm)/[A-Za-z0-9_/@]+)\"")


def test_every_logged_metric_is_in_the_glossary():
  """Each metric key written in jalign/ is explained in docs/metrics.md."""
  keys = set()
  for root, _, names in os.walk(os.path.join(ROOT, "jalign")):
    for name in names:
      if name.endswith(".py"):
        keys |= set(METRIC.findall(open(os.path.join(root, name), encoding="utf-8").read()))
  with open(os.path.join(ROOT, "docs", "metrics.md"), encoding="utf-8") as f:
    glossary = f.read()
  missing = sorted(k for k in keys if f"`{k}" not in glossary)  # a prefix the code filters by counts
  assert len(keys) > 60 and not missing, f"metrics missing from docs/metrics.md: {missing}"
