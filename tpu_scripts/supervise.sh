#!/usr/bin/env bash
# Keep a run going on spot / preemptible capacity: launch it, watch the slice, and when the slice is preempted
# recreate it, set it up and launch the same command again (which resumes from the newest complete checkpoint).
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<USAGE
Usage: tpu_scripts/supervise.sh --name=NAME --zone=ZONE --config=configs/TASK.py[:ARG] --run-dir=DIR
                                [create.sh flags] [setup.sh flags] [--max-restarts=N] [--interval=S]
                                [--max-recreations=N] [--project=PROJECT] [--queued] [--dry-run]
                                [-- --config.KEY=VALUE ...]

Runs on your machine until the run has finished on every worker (exit 0) or has failed (exit 1). Every S seconds it
reads the slice's state: READY -> reads each worker's logs/exit_status (written by worker_loop.sh when jalign ends);
PREEMPTED, TERMINATED, STOPPED or gone -> deletes what is left, then create.sh, setup.sh and launch.sh with the
flags given here. A missing slice at the start is created the same way. --run-dir must outlive the slice: a Cloud
Storage mount such as ~/gcs/runs/x (setup.sh --mount=BUCKET), never the VM's own disk.

  create.sh flags   --accelerator-type=TYPE --version=RUNTIME --spot --valid-for=DURATION
  setup.sh flags    --source=DIR|SPEC --data=gs://... --checkpoint=gs://... --mount=BUCKET
  launch.sh flags   --config=FILE[:ARG] --run-dir=DIR --max-restarts=N, and after -- the jalign.run flags
  --interval=S         seconds between checks (default 60)
  --max-recreations=N  give up after recreating the slice N times (default 10)
$COMMON_HELP
USAGE
}

CREATE=()
SETUP=()
LAUNCH=()   # launch.sh's own flags
JALIGN=()   # after --: jalign.run's flags
INTERVAL=60
MAX_RECREATIONS=10
RUN_DIR=""
parse_common "$@"
after_dashes=0
for arg in "${ARGS[@]+"${ARGS[@]}"}"; do
  if [[ "$after_dashes" == 1 ]]; then
    JALIGN+=("$arg")
    continue
  fi
  case "$arg" in
    --accelerator-type=* | --version=* | --spot | --valid-for=*) CREATE+=("$arg") ;;
    --source=* | --data=* | --checkpoint=* | --mount=*) SETUP+=("$arg") ;;
    --config=* | --max-restarts=*) LAUNCH+=("$arg") ;;
    --run-dir=*)
      RUN_DIR="${arg#*=}"
      LAUNCH+=("$arg")
      ;;
    --interval=*) INTERVAL="${arg#*=}" ;;
    --max-recreations=*) MAX_RECREATIONS="${arg#*=}" ;;
    --) after_dashes=1 ;;
    *) unknown "$arg" "create.sh's, setup.sh's and launch.sh's flags, --interval, --max-recreations" ;;
  esac
done
[[ -n "$RUN_DIR" ]] || die "--run-dir is required: a directory that outlives the slice (e.g. ~/gcs/runs/NAME)"
[[ "$INTERVAL" =~ ^[0-9]+$ && "$INTERVAL" -gt 0 ]] || die "--interval=$INTERVAL: a positive number of seconds"
[[ "$MAX_RECREATIONS" =~ ^[0-9]+$ ]] || die "--max-recreations=$MAX_RECREATIONS: a number"

HERE="$(dirname "${BASH_SOURCE[0]}")"
BASE=(--name="$NAME" --zone="$ZONE")
[[ -n "$PROJECT" ]] && BASE+=(--project="$PROJECT")
[[ "$QUEUED" == 1 ]] && BASE+=(--queued)
[[ "$DRY_RUN" == 1 ]] && BASE+=(--dry-run)

LAUNCH_ARGS=("${LAUNCH[@]+"${LAUNCH[@]}"}" -- "${JALIGN[@]+"${JALIGN[@]}"}")

script() {
  bash "$HERE/$1.sh" "${BASE[@]}" "${@:2}"
}

slice_state() {
  run gcloud compute tpus tpu-vm describe "$NAME" "${SCOPE[@]}" --format="value(state)" 2>/dev/null || echo MISSING
}

# One line per worker: its run's final status, or "running".
run_states() {
  on_workers "cat jalign/logs/exit_status 2>/dev/null || echo running" 2>/dev/null || echo unreachable
}

bring_up() {
  script create "${CREATE[@]+"${CREATE[@]}"}"
  script setup "${SETUP[@]+"${SETUP[@]}"}"
  script launch "${LAUNCH_ARGS[@]}"
}

say() {
  echo "[supervise $(date -u +%Y-%m-%dT%H:%M:%SZ)] $*"
}

if [[ "$DRY_RUN" == 1 ]]; then
  echo "# every --interval: the slice's state, then each worker's run"
  slice_state
  run_states
  echo "# when the slice is PREEMPTED, TERMINATED, STOPPED or gone"
  script teardown
  bring_up
  exit 0
fi

state=$(slice_state)
if [[ "$state" == MISSING ]]; then
  say "slice $NAME does not exist: creating it"
  bring_up
else
  script launch "${LAUNCH_ARGS[@]}" || say "launch.sh failed (see above); watching the run that is there"
fi
recreations=0
while true; do
  sleep "$INTERVAL"
  state=$(slice_state)
  case "$state" in
    READY)
      states=$(run_states)
      if grep -qvx 0 <<<"$states"; then
        failed=$(grep -x '[0-9]*' <<<"$states" | grep -vx 0 | head -n 1 || true)
        if [[ -n "$failed" ]]; then
          say "the run ended with status $failed on a worker; its log: tpu_scripts/logs.sh --name=$NAME --zone=$ZONE"
          exit 1
        fi
      else
        say "the run finished on every worker"
        exit 0
      fi
      ;;
    PREEMPTED | TERMINATED | STOPPED | MISSING)
      recreations=$((recreations + 1))
      if ((recreations > MAX_RECREATIONS)); then
        say "slice $NAME is $state again; --max-recreations=$MAX_RECREATIONS reached, giving up"
        exit 1
      fi
      say "slice $NAME is $state: recreating it ($recreations of $MAX_RECREATIONS); the run resumes from $RUN_DIR"
      [[ "$state" == MISSING ]] || script teardown
      bring_up
      ;;
    *) say "slice $NAME is $state; waiting" ;;
  esac
done
