#!/usr/bin/env bash
# Launch `python -m jalign.run` on every worker of a TPU VM / pod slice, in the background, logging per worker.
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<USAGE
Usage: tpu_scripts/launch.sh --name=NAME --zone=ZONE --config=configs/TASK.py[:ARG] [--run-dir=DIR]
                             [--max-restarts=N] [--project=PROJECT] [--dry-run] [-- --config.KEY=VALUE ...]

Starts the same command on every worker (one jalign process per host; they join through jax.distributed, which
finds the slice's workers by itself: distributed.coordinator_address=auto). Output goes to ~/jalign/logs/run.log on
each worker; follow it with tpu_scripts/status.sh and fetch it with tpu_scripts/logs.sh. Arguments after -- go to
jalign.run unchanged. On a multi-host slice, --run-dir must be a directory every worker sees (e.g. ~/gcs/runs/x
after setup.sh --mount=BUCKET): all workers write one checkpoint directory.

Each worker runs jalign under tpu_scripts/worker_loop.sh, which starts it again after a preemption notice (jalign
saves on SIGTERM and exits 143) or a kill, resuming from the newest complete checkpoint. When the slice itself is
preempted (spot), tpu_scripts/supervise.sh recreates it and launches again.

  --config=FILE[:ARG]  a config of the jalign checkout on the workers, e.g. configs/grpo.py
  --run-dir=DIR        default: runs/NAME under ~/jalign
  --max-restarts=N     restarts per worker after a preemption or kill (default 3)
$COMMON_HELP
USAGE
}

CONFIG=""
RUN_DIR=""
MAX_RESTARTS=3
EXTRA=()
parse_common "$@"
after_dashes=0
for arg in "${ARGS[@]+"${ARGS[@]}"}"; do
  if [[ "$after_dashes" == 1 ]]; then
    EXTRA+=("$arg")
    continue
  fi
  case "$arg" in
    --config=*) CONFIG="${arg#*=}" ;;
    --run-dir=*) RUN_DIR="${arg#*=}" ;;
    --max-restarts=*) MAX_RESTARTS="${arg#*=}" ;;
    --) after_dashes=1 ;;
    *) unknown "$arg" "--config, --run-dir, --max-restarts, -- (then jalign.run flags)" ;;
  esac
done
[[ -n "$CONFIG" ]] || die "--config is required, e.g. --config=configs/grpo.py"
RUN_DIR="${RUN_DIR:-runs/$NAME}"
[[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]] || die "--max-restarts=$MAX_RESTARTS: a number of restarts"

flags=(--config="$CONFIG" --config.run_dir="$RUN_DIR" --config.distributed.coordinator_address=auto
  --config.log.progress=False "${EXTRA[@]+"${EXTRA[@]}"}")
quoted=$(printf '%q ' "${flags[@]}")
# logs/run.pid: the worker loop of a run already going there (a pattern search would also match this very command).
on_workers "cd jalign && mkdir -p logs && if test -f logs/run.pid && kill -0 \$(cat logs/run.pid) 2>/dev/null; then echo \"jalign.run is already running on \$(hostname)\"; exit 1; fi; setsid nohup bash tpu_scripts/worker_loop.sh $MAX_RESTARTS ${quoted}> logs/run.log 2>&1 < /dev/null & echo \"started on \$(hostname)\""
echo "next: tpu_scripts/status.sh --name=$NAME --zone=$ZONE"
