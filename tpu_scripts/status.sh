#!/usr/bin/env bash
# Status of a TPU VM / pod slice and of the jalign run on each of its workers.
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<USAGE
Usage: tpu_scripts/status.sh --name=NAME --zone=ZONE [--lines=N] [--queued] [--project=PROJECT] [--dry-run]

Prints the slice's state and health (or the queued request's state), then on every worker whether jalign.run is
running and the last N lines of its log.

  --lines=N   log lines per worker (default 5)
$COMMON_HELP
USAGE
}

LINES=5
parse_common "$@"
for arg in "${ARGS[@]+"${ARGS[@]}"}"; do
  case "$arg" in
    --lines=*) LINES="${arg#*=}" ;;
    *) unknown "$arg" "--lines" ;;
  esac
done
[[ "$LINES" =~ ^[0-9]+$ ]] || die "--lines=$LINES: a number of lines"

if [[ "$QUEUED" == 1 ]]; then
  run gcloud compute tpus queued-resources describe "$NAME" "${SCOPE[@]}" --format="value(state.state)"
fi
run gcloud compute tpus tpu-vm describe "$NAME" "${SCOPE[@]}" --format="value(state,health,acceleratorType)"
on_workers "echo \"== \$(hostname): \$(test -f jalign/logs/run.pid && kill -0 \$(cat jalign/logs/run.pid) 2>/dev/null && echo running || echo not running)\$(test -f jalign/logs/exit_status && echo \", ended with status \$(cat jalign/logs/exit_status)\")\"; tail -n $LINES jalign/logs/run.log 2>/dev/null || echo '(no log yet)'"
