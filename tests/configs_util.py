"""Load configs/<task>.py the way `jalign.run` does, with overrides, as a validated RunConfig."""
import importlib.util
import os

import jax

from jalign.config import validate
from tests.cli import ROOT


def config_dict(config_name: str, arg: str | None = "tiny", **overrides):
  path = os.path.join(ROOT, "configs", f"{config_name}.py")
  spec = importlib.util.spec_from_file_location(f"configs_{config_name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config(arg).to_dict()  # a plain dict, so tests may set wrong types and unknown keys
  for dotted, value in overrides.items():
    node = c
    *parents, leaf = dotted.split("__")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return c


def run_config(config_name: str, arg: str | None = "tiny", **overrides):
  return validate(config_dict(config_name, arg, **overrides), jax.device_count())

