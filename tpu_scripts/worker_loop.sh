#!/usr/bin/env bash
# Runs on each worker (started by launch.sh, from ~/jalign): `python3 -m jalign.run ARGS...`, started again after a
# preemption or a kill, so the run resumes from its newest complete checkpoint.
#
# Usage: tpu_scripts/worker_loop.sh MAX_RESTARTS ARGS...
#
# Exit status 143 (jalign saved its state on SIGTERM) or any death by a signal (>128: SIGKILL from the OOM killer,
# a lost peer's abort) starts the same command again, at most MAX_RESTARTS times. 0 (finished), 1 (stopped: a
# non-finite loss) and 2 (a user error, which a restart would only repeat) end the loop. logs/run.pid holds this
# loop's process group; logs/exit_status the final status, written when the loop ends (tpu_scripts/status.sh and
# supervise.sh read both).
set -uo pipefail
usage() {
  echo "Usage: tpu_scripts/worker_loop.sh MAX_RESTARTS ARGS...

Runs python3 -m jalign.run ARGS... from the checkout's root and starts it again after a preemption or a kill
(status 143 or above 128), at most MAX_RESTARTS times; 0 (finished), 1 (stopped) and 2 (a user error: config, data,
checkpoint) end it. launch.sh starts it on every worker; logs/exit_status holds the final status.

  -h, --help   this help"
}
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  usage
  exit 0
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
[[ "${1:-}" =~ ^[0-9]+$ ]] || {
  echo "worker_loop.sh: first argument: the most restarts (a number); see --help" >&2
  exit 2
}
max_restarts=$1
shift
mkdir -p logs
rm -f logs/exit_status
echo "$$" >logs/run.pid
restarts=0
while true; do
  python3 -m jalign.run "$@"
  status=$?
  echo "[worker_loop $(date -u +%Y-%m-%dT%H:%M:%SZ)] jalign.run exited with status $status"
  if ((status > 128 && restarts < max_restarts)); then
    restarts=$((restarts + 1))
    echo "[worker_loop] restart $restarts of $max_restarts: the run resumes from its newest complete checkpoint"
    continue
  fi
  echo "$status" >logs/exit_status
  exit "$status"
done
