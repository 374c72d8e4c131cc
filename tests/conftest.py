"""Test set-up: 8 fake CPU devices, no hub access and one compilation cache per run, before anything imports jax."""
import os
import shutil
import tempfile

# Eight fake devices share the test machine's two cores with another test process: a collective's participants can
# reach it tens of seconds apart, past XLA's CPU default of 40 s before it aborts the process.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_cpu_collective_call_terminate_timeout_seconds=600").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # TPU compile targets in several test processes at once
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The tests build the same tiny models and steps again and again, in this process, in the pytest-xdist workers and
# in the runs they start as subprocesses (which inherit the environment): a persistent compilation cache shared by all
# of them turns most compiles into a file read. It lives for one run, made by whichever process gets here first (the
# xdist controller, whose environment the workers inherit), and removed by it at the end. The size cap turns on the
# cache's file lock, so that two workers never read an entry while it is being written.
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _OWN_CACHE = tempfile.mkdtemp(prefix="jalign-tests-jax-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
  os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))


def pytest_unconfigure(config):
  if _OWN_CACHE is not None and not hasattr(config, "workerinput"):
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)


# Test tiers. A test's markers follow from what it does, read (by the regular expressions below) from its code and
# that of the helpers and fixtures of its own module it uses, docstrings and comments left out, so a new test lands
# in its tier by itself: `realdata` needs ../shared/realdata, `aot` compiles for TPU topologies or Llama-sized shapes,
# `e2e` runs a whole job (the command line or another Python process, a task run to its end, a recipe, a notebook).
# `long` is set by hand on the full reproductions. The fast developer tier is
# `-m "not e2e and not realdata and not aot and not long"`.
_TIERS = {
    "realdata": ("realdata", "smollm2", "REALDATA"),
    "aot": ("topology", "tpu_target", r"fit\.report", r"jalign\.fit", "llama3-8b", "llama3_8b"),
    # A task's or the command line's `run(` (not a shell command's or a tool's), another Python process, a notebook.
    "e2e": (r"\b(?!subprocess\.|tools\.|app\.)\w+\.run\(", "cli\.command\(", "run_faulty\(", "sys\.executable",
            "run_recipe", "run_job", "client\.execute\("),
}


def _code(obj) -> str:
  """The source of a function (or a fixture's function) without its docstring and comments; "" if it has none."""
  import ast
  import inspect
  import textwrap
  obj = getattr(obj, "_get_wrapped_function", lambda: getattr(obj, "__wrapped__", obj))()
  try:
    tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
  except (OSError, TypeError, SyntaxError):
    return ""
  for node in ast.walk(tree):
    body = getattr(node, "body", None)
    if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
      node.body = body[1:] or [ast.Pass()]
  return ast.unparse(tree)


def _reach(fn, module, names) -> str:
  """`fn`'s code and that of the module-level functions and fixtures of `module` it names, followed transitively."""
  import re
  seen, todo, texts = set(), [fn, *(getattr(module, n, None) for n in names)], []
  while todo:
    obj = todo.pop()
    if obj is None or id(obj) in seen or not callable(obj):
      continue
    seen.add(id(obj))
    text = _code(obj)
    texts.append(text)
    todo += [getattr(module, n) for n in set(re.findall(r"\b(\w+)\b", text)) if n in vars(module)]
  return "\n".join(texts)


def pytest_collection_modifyitems(config, items):
  import re

  import pytest
  texts = {}
  for item in items:
    fn = getattr(item, "function", None)
    if fn is None:
      continue
    key = (fn, tuple(getattr(item, "fixturenames", ())))
    if key not in texts:
      texts[key] = _reach(fn, item.module, key[1])
    for marker, needles in _TIERS.items():
      if any(re.search(n, texts[key]) for n in needles):
        item.add_marker(getattr(pytest.mark, marker))
