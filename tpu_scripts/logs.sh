#!/usr/bin/env bash
# Fetch the jalign logs of every worker of a TPU VM / pod slice to logs/NAME/worker-I.log here.
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<USAGE
Usage: tpu_scripts/logs.sh --name=NAME --zone=ZONE [--workers=N] [--out=DIR] [--project=PROJECT] [--dry-run]

  --workers=N  hosts in the slice (default 1; e.g. v5p-64 has 8: four chips per host)
  --out=DIR    default logs/NAME
$COMMON_HELP
USAGE
}

WORKERS=1
OUT=""
parse_common "$@"
for arg in "${ARGS[@]+"${ARGS[@]}"}"; do
  case "$arg" in
    --workers=*) WORKERS="${arg#*=}" ;;
    --out=*) OUT="${arg#*=}" ;;
    *) unknown "$arg" "--workers, --out" ;;
  esac
done
[[ "$WORKERS" =~ ^[1-9][0-9]*$ ]] || die "--workers=$WORKERS: a positive number of hosts"
OUT="${OUT:-logs/$NAME}"
run mkdir -p "$OUT"
for ((i = 0; i < WORKERS; i++)); do
  run gcloud compute tpus tpu-vm scp "$NAME":jalign/logs/run.log "$OUT/worker-$i.log" "${SCOPE[@]}" --worker="$i"
done
