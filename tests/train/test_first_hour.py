"""A new user's first hour, through the command line as a user runs it: data that yields nothing ends at once with
the counts, drops are reported at start, Ctrl-C saves and the rerun resumes bitwise, a run directory is locked, a
directory that cannot be written is an `error:`, a signal before the first step exits at once."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests import cli
from tests.configs_util import ROOT
from tests.train.crash_util import hf_weights, run_faulty

NOISE = ("E0000", "InitGoogle", "libtpu", "Source Location", "host bounds", "TPU_")


def _cli(run_dir, *flags, config="sft.py:tiny", timeout=300):
  return cli.run(config, run_dir, *flags, timeout=timeout)


def _jsonl(path, records):
  with open(path, "w", encoding="utf-8") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")
  return str(path)


def _lines(text: str) -> list[str]:
  return [line for line in text.splitlines() if line.strip() and not any(n in line for n in NOISE)]


def test_sft_data_all_longer_than_the_limit_ends_at_once_with_the_counts(tmp_path):
  """The recipes' settings (truncation='drop', skip_bad_records=True): before, the loader searched forever."""
  data = _jsonl(tmp_path / "long.jsonl", [{"prompt": "What is 1 + 1? " * 30, "completion": "2"}] * 20
                + [{"text": "no layout"}])
  started = time.time()
  proc = _cli(tmp_path / "run", f"--config.data.train={data}", "--config.data.eval=", "--config.data.truncation=drop",
              "--config.data.skip_bad_records=True")
  assert proc.returncode == 2 and time.time() - started < 120, proc.stderr[-2000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1, proc.stderr[-2000:]
  assert "long.jsonl: no usable records: read 21 of 21 records: kept 0, dropped 21" in errors[0]
  assert "20 too long: longest 2" in errors[0] and "data.max_length=64; the first: " in errors[0]
  assert "1 malformed, skipped by data.skip_bad_records; the first: " in errors[0]
  assert f"{data}:21: record has neither 'messages' nor 'prompt'+'completion'" in errors[0]


def test_dropped_pairs_are_counted_at_start_and_the_averages_say_which_set(tmp_path):
  pairs = [{"prompt": f"What is {i} + 1?", "chosen": f"#### {i + 1}", "rejected": f"#### {i + 2}"} for i in range(12)]
  pairs += [{"prompt": "What is 1 + 1? " * 30, "chosen": "#### 2", "rejected": "#### 3"}] * 3
  data = _jsonl(tmp_path / "pairs.jsonl", pairs)
  proc = _cli(tmp_path / "run", f"--config.data.train={data}", "--config.data.eval=", "--config.data.truncation=drop",
              "--config.train.steps=1", config="dpo.py:tiny")
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout
  assert (f"data {data}: read 15 of 15 preference pairs: kept 12, dropped 3 (3 too long: longest " in out), out[-3000:]
  assert f"the first: {data}:13: prompt has " in out
  assert "over the 12 kept pairs: chosen" in out
  # train.steps=1 under the recipe's warmup_steps=2: one override cuts the run short, the warmup clipped to it
  assert "warning: config.optim.warmup_steps=2 is more than train.steps=1: the warmup is clipped to 1 steps" in out


def test_a_warmup_longer_than_the_run_is_clipped_to_it():
  from jalign.config import OptimSection
  from jalign.train.optimizer import schedule
  lr = schedule(OptimSection(lr=1.0, warmup_steps=100, schedule="constant"), steps=4)
  assert [float(lr(i)) for i in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_a_prompt_longer_than_the_sampler_allows_ends_grpo_before_the_first_step(tmp_path):
  prompts = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(10)]
  prompts[6] = {"prompt": "What is 1 + 1?" + " 2" * 80, "answer": "2"}
  data = _jsonl(tmp_path / "prompts.jsonl", prompts)
  proc = _cli(tmp_path / "run", f"--config.grpo.prompts={data}", config="grpo.py:tiny")
  assert proc.returncode == 2, proc.stderr[-2000:]
  error = next(line for line in proc.stderr.splitlines() if line.startswith("error: "))
  assert "read 10 of 10 prompts: kept 9, dropped 1 (1 too long" in error and f"the first: {data}:7" in error
  assert "sampling.max_prompt_length" in error
  assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


def _losses(run_dir) -> dict[int, float]:
  rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  steps = [r["step"] for r in rows if "train/loss" in r]
  assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
  return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


RUN = ("--config.train.steps=10", "--config.checkpoint.every=4", "--config.train.log_every=1",
       "--config.train.eval_examples=0")


def test_ctrl_c_saves_exits_130_and_the_rerun_equals_an_uninterrupted_run(tmp_path):
  clean = str(tmp_path / "clean")
  run_faulty("sft", clean, *RUN)
  run_dir = str(tmp_path / "run")
  stopped = run_faulty("sft", run_dir, *RUN, env={"SIGNAL_AT_BATCH": "INT:7"}, check=False)
  assert stopped.returncode == 130, stopped.stdout[-2000:] + stopped.stderr[-2000:]
  saved = [line for line in stopped.stdout.splitlines() if line.startswith("Ctrl-C (SIGINT): saved step ")]
  assert saved == [f"Ctrl-C (SIGINT): saved step 7 to {run_dir}/checkpoints; exiting with status 130; rerun the "
                   "same command to resume"], stopped.stdout[-2000:]
  assert "Traceback" not in stopped.stderr and not os.path.exists(os.path.join(run_dir, "hf"))
  # Steps logged after step 7's checkpoint are gone from metrics.jsonl when the rerun resumes from it.
  resumed = run_faulty("sft", run_dir, *RUN)
  assert f"resumed from {run_dir}/checkpoints/7" in resumed.stdout + resumed.stderr
  assert hf_weights(run_dir) == hf_weights(clean)
  assert _losses(run_dir) == _losses(clean)


def test_a_second_ctrl_c_exits_at_once_without_waiting_for_the_save(tmp_path):
  run_dir = str(tmp_path / "run")
  started = time.time()
  proc = run_faulty("sft", run_dir, *RUN, "--config.checkpoint.async_save=False",
                    env={"SIGNAL_AT_BATCH": "INT:6", "SIGNAL_AGAIN_AFTER_S": "3", "SLOW_SAVE": "6:120"}, check=False)
  assert proc.returncode == 130 and time.time() - started < 100, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert (f"Ctrl-C (SIGINT) again: exiting now without saving (status 130); the newest complete checkpoint is "
          f"{run_dir}/checkpoints/4" in proc.stderr), proc.stderr[-2000:]
  assert not os.path.exists(os.path.join(run_dir, ".lock"))


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_signal_before_the_first_step_exits_at_once_saying_nothing_was_saved(tmp_path, name):
  run_dir = tmp_path / "run"
  proc = subprocess.Popen(cli.command("sft.py:tiny", run_dir), cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 120
  while not os.path.exists(run_dir / ".lock"):  # start-up under way: the data read, the model built next
    assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-2000:]
    time.sleep(0.05)
  sent = time.time()
  proc.send_signal(getattr(signal, name))
  _, err = proc.communicate(timeout=60)
  code = 128 + getattr(signal, name)
  assert proc.returncode == code and time.time() - sent < 10, err[-2000:]
  assert f"before this run finished a step: nothing new to save; exiting with status {code}" in err, err[-2000:]
  assert "Traceback" not in err and not os.path.exists(run_dir / "checkpoints" / "8")


def test_two_runs_in_one_run_dir_the_second_ends_naming_the_first(tmp_path):
  run_dir = tmp_path / "run"
  os.makedirs(run_dir)
  holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
  try:
    with open(run_dir / ".lock", "w") as f:  # a live run's lock
      json.dump({"pid": holder.pid, "host": socket.gethostname(), "since": "earlier", "command": "python -m jalign.run"}, f)
    proc = _cli(run_dir)
    assert proc.returncode == 2, proc.stderr[-2000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert error and f"is in use by another run: pid {holder.pid} on host {socket.gethostname()}" in error[0], \
        proc.stderr[-2000:]
    assert not os.path.exists(run_dir / "metrics.jsonl")
  finally:
    holder.kill()
    holder.wait()
  # The holder is gone: its lock is stale, taken over with a warning; the run finishes and releases it.
  proc = _cli(run_dir)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert f"was left by a run that is no longer running (pid {holder.pid}" in proc.stderr
  assert not os.path.exists(run_dir / ".lock")


def test_two_runs_started_together_one_runs_one_ends_with_an_error(tmp_path):
  run_dir = tmp_path / "run"
  cmd = cli.command("sft.py:tiny", run_dir, "--config.train.steps=30")
  procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for _ in range(2)]
  results = [(p.wait(timeout=300), p.communicate()[1]) for p in procs]
  assert sorted(code for code, _ in results) == [0, 2], [err[-1500:] for _, err in results]
  err = next(err for code, err in results if code == 2)
  assert "is in use by another run" in err
  steps = [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl") if "train/loss" in line]
  assert steps == sorted(set(steps))  # one run's rows, not two interleaved


@pytest.mark.parametrize("where", ["under_a_file", "unwritable"])
def test_a_run_dir_that_cannot_be_created_or_written_is_a_user_error(tmp_path, where):
  if where == "under_a_file":
    open(tmp_path / "afile", "w").close()
    run_dir, reason = tmp_path / "afile" / "run", "cannot create it"
  elif os.geteuid() == 0:  # root writes through permission bits: /proc takes no files
    run_dir, reason = "/proc", "cannot write in it"
  else:
    os.makedirs(tmp_path / "ro")
    os.chmod(tmp_path / "ro", 0o555)
    run_dir, reason = tmp_path / "ro", "cannot write in it"
  proc = _cli(run_dir)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
  assert errors == [errors[0]] and f"config.run_dir='{run_dir}': {reason}" in errors[0], proc.stderr[-2000:]


def test_help_exits_0_and_says_how_to_list_keys():
  proc = cli.run(None, None, "--help", timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.startswith("usage: python -m jalign.run --config=") and "--list_keys" in proc.stdout


def test_a_mistyped_or_moved_key_on_the_command_line_is_named_with_what_to_write():
  from jalign.run import _flag_message
  argv = ["jalign.run", f"--config={ROOT}/configs/grpo.py:tiny", "--config.grpo.promts=p.jsonl"]
  assert _flag_message(argv, KeyError("promts")).startswith(
      f"--config.grpo.promts: {ROOT}/configs/grpo.py:tiny has no key config.grpo.promts (did you mean "
      "config.grpo.prompts?); keys of config.grpo: async_staleness, buffer, ")
  argv[-1] = "--config.grpo.kl_coef=0"  # a key that moved to the section of the code that reads it
  assert _flag_message(argv, KeyError("kl_coef")) == "--config.grpo.kl_coef: grpo.kl_coef moved to --config.kl.coef"


def test_list_keys_prints_every_key_with_value_type_and_bounds(tmp_path):
  proc = cli.run("grpo.py:tiny", None, "--config.train.steps=7", "--list_keys", timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  lines = _lines(proc.stdout)
  assert "config.train.steps = 7  (int, > 0)" in lines  # the override applied
  assert "config.task = 'grpo'  (one of 'sft', 'rollout', 'grpo', 'ppo', 'rm', 'dpo', 'distill', 'eval')" in lines
  assert "config.policy_loss.clip_c = None  (float or None, > 1)" in lines
  assert "config.sampling.temperature = 1.0  (float, >= 0)" in lines, [l for l in lines if "temperature" in l]
  from jalign.config import RunConfig, defaults
  from jalign.core.sections import listing
  assert len(lines) == len(listing(RunConfig, defaults())) > 150  # every key, nothing else
  assert not os.path.exists(ROOT + "/runs/grpo_tiny/.lock")


def test_grpo_shows_sampled_completions_and_the_report_holds_its_held_out_accuracy(tmp_path):
  run_dir = tmp_path / "run"
  proc = _cli(run_dir, "--config.log.samples_every=2", config="grpo.py:tiny")
  assert proc.returncode == 0, proc.stderr[-3000:]
  shown = [line for line in proc.stdout.splitlines() if " sample (reward " in line]
  assert [line.split()[1] for line in shown] == ["1", "1", "2", "2"], proc.stdout[-3000:]  # step 1, then every 2
  rows = [json.loads(line) for line in open(run_dir / "samples.jsonl")]
  assert [r["step"] for r in rows] == [1, 1, 2, 2]
  from jalign.rewards.verifiable import REGISTRY, Batch
  for r in rows:  # the reward shown is the verifier's of the completion shown
    assert r["prompt"].endswith("<|im_start|>assistant\n") and r["completion"]
    assert r["reward"] == REGISTRY["gsm8k"](Batch([r["completion"]], [r["ground_truth"]], [1]))[0]
  # report.md's held-out row: the final accuracy metrics.jsonl holds
  metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
  final = [m for m in metrics if "eval/accuracy" in m][-1]
  table = [line for line in (run_dir / "report.md").read_text().splitlines() if line.startswith("| ")]
  header = [c.strip() for c in table[0].strip("|").split("|")]
  row = [c.strip() for c in table[2].strip("|").split("|")]
  assert row[header.index("accuracy")] == f"{final['eval/accuracy']:.4f}"
  assert row[header.index("eval/accuracy_initial")] == f"{final['eval/accuracy_initial']:.4f}"


def test_eval_needs_no_reference_and_names_one_it_cannot_use(tmp_path):
  import shutil

  import jalign
  policy = os.path.join(os.path.dirname(jalign.__file__), "assets", "tiny_policy")
  short = tmp_path / "short_context"
  shutil.copytree(policy, short)
  config = json.load(open(short / "config.json"))
  config["max_position_embeddings"] = 8
  json.dump(config, open(short / "config.json", "w"))
  flags = (f"--config.model.path={policy}", "--config.eval.sft_data=")
  proc = _cli(tmp_path / "eval", *flags, f"--config.eval.reference={short}", config="eval.py:tiny")
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert (f"error: config.eval.reference='{short}' cannot be compared with config.model.path='{policy}': its context "
          "is 8 positions") in proc.stderr, proc.stderr[-2000:]
  proc = _cli(tmp_path / "eval", *flags, config="eval.py:tiny")  # the defaults: no reference
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "eval: 16 prompts of synthetic:arith:test, greedy answers of" in proc.stdout
  shown = [json.loads(line) for line in open(tmp_path / "eval" / "samples.jsonl")]
  assert len(shown) == 2 and all("What is" in r["prompt"] and r["reward"] in (0.0, 1.0) for r in shown)
  out = json.load(open(tmp_path / "eval" / "eval.json"))
  assert "eval/win_rate" not in out and 0 <= out["eval/accuracy"] <= 1


def test_a_missing_model_path_is_not_found(tmp_path):
  proc = _cli(tmp_path / "run", f"--config.model.path={tmp_path / 'nope'}")
  assert proc.returncode == 2
  assert f"error: config.model.path='{tmp_path / 'nope'}': not found" in proc.stderr, proc.stderr[-2000:]


def test_a_wrong_layout_under_skip_bad_records_names_the_first_reason(tmp_path):
  """The HH recipes skip bad records; a file of another layout used to end with only 'no usable preference pairs'."""
  data = _jsonl(tmp_path / "sft_not_pairs.jsonl", [{"prompt": f"What is {i} + 1?", "completion": str(i + 1)}
                                                   for i in range(5)])
  proc = _cli(tmp_path / "run", f"--config.data.train={data}", "--config.data.eval=",
              "--config.data.skip_bad_records=True", config="dpo.py:tiny")
  assert proc.returncode == 2, proc.stderr[-2000:]
  error = next(line for line in proc.stderr.splitlines() if line.startswith("error: "))
  assert (f"no usable preference pairs: read 5 of 5 preference pairs: kept 0, dropped 5 (5 malformed, skipped by "
          f"data.skip_bad_records; the first: {data}:1: record has no 'chosen' field") in error, error
