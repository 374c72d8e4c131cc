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


# Test tiers. A test's markers follow from what it does, read from its source, so a new test lands in its tier by
# itself: `realdata` needs ../shared/realdata, `aot` compiles for TPU topologies or Llama-sized shapes, `e2e` runs a
# whole job (the command line, a task run to the end, a recipe). `long` is set by hand on the full reproductions.
# The fast developer tier is `-m "not e2e and not realdata and not aot and not long"`.
_TIERS = {
    "realdata": ("realdata", "smollm2", "REALDATA"),
    "aot": ("topology", "tpu_target", "fit.report", "jalign.fit", "llama3-8b", "llama3_8b"),
    "e2e": ("run_as_user", "jalign.run", "tasks.run(", "_run(tmp_path", "faulty_run", "loop.run(", ".run(cfg",
            "run_recipe", "run_job", "subprocess.run("),
}


def pytest_collection_modifyitems(config, items):
  import inspect
  import pytest
  sources = {}
  for item in items:
    fn = getattr(item, "function", None)
    if fn is None:
      continue
    if fn not in sources:
      try:
        sources[fn] = inspect.getsource(fn)
      except (OSError, TypeError):
        sources[fn] = ""
    text = sources[fn] + " ".join(getattr(item, "fixturenames", ()))
    for marker, needles in _TIERS.items():
      if any(n in text for n in needles):
        item.add_marker(getattr(pytest.mark, marker))
