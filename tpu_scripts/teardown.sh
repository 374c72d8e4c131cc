#!/usr/bin/env bash
# Delete a TPU VM / pod slice (or its queued-resource request). Data on its disks is lost: copy results off first.
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<USAGE
Usage: tpu_scripts/teardown.sh --name=NAME --zone=ZONE [--queued] [--project=PROJECT] [--dry-run]

Deletes the slice without asking (--quiet). With --queued, deletes the queued resource and the slice it made.
$COMMON_HELP
USAGE
}

parse_common "$@"
for arg in "${ARGS[@]+"${ARGS[@]}"}"; do
  unknown "$arg" "no other flags"
done
if [[ "$QUEUED" == 1 ]]; then
  run gcloud compute tpus queued-resources delete "$NAME" "${SCOPE[@]}" --force --quiet
else
  run gcloud compute tpus tpu-vm delete "$NAME" "${SCOPE[@]}" --quiet
fi
