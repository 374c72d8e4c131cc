"""Load configs/<task>.py the way `jalign.run` does, with overrides, as a validated RunConfig."""
import importlib.util
import os

import jax

from jalign.config import validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def run_as_user(config_name: str, run_dir, timeout: int = 3600):
  """`python -m jalign.run --config=configs/<config_name>.py` in a subprocess as a user runs it: one CPU device (the
  test session's 8 fake devices would change the arithmetic's order), no progress bar or TensorBoard."""
  import subprocess
  import sys
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  return subprocess.run([sys.executable, "-m", "jalign.run", f"--config={ROOT}/configs/{config_name}.py",
                         f"--config.run_dir={run_dir}", "--config.log.progress=False",
                         "--config.log.tensorboard=False"], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=timeout)
