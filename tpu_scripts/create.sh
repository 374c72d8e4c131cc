#!/usr/bin/env bash
# Create a Cloud TPU VM or pod slice for jalign: on demand, spot, or through queued resources.
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<USAGE
Usage: tpu_scripts/create.sh --name=NAME --zone=ZONE [--accelerator-type=TYPE] [--version=RUNTIME] [--spot]
                             [--queued [--valid-for=DURATION]] [--project=PROJECT] [--dry-run]

Creates the TPU VM (one host, e.g. v5litepod-8) or pod slice (several hosts, e.g. v5p-64). With --queued the
request waits in line for capacity (queued resources) and this script waits until the slice is ACTIVE.

  --accelerator-type=TYPE  default v5litepod-8 (v5e-8); e.g. v5p-64, v6e-8, v4-32
  --version=RUNTIME        TPU software version; default per generation (v2-alpha-tpuv5-lite, v2-alpha-tpuv5,
                           v2-alpha-tpuv6e, tpu-ubuntu2204-base)
  --spot                   spot capacity: cheaper, may be preempted (jalign saves and exits on SIGTERM)
  --valid-for=DURATION     with --queued: give up if not provisioned within DURATION (e.g. 6h)
$COMMON_HELP
USAGE
}

TYPE=v5litepod-8
VERSION=""
SPOT=0
VALID_FOR=""
parse_common "$@"
for arg in "${ARGS[@]+"${ARGS[@]}"}"; do
  case "$arg" in
    --accelerator-type=*) TYPE="${arg#*=}" ;;
    --version=*) VERSION="${arg#*=}" ;;
    --spot) SPOT=1 ;;
    --valid-for=*) VALID_FOR="${arg#*=}" ;;
    *) unknown "$arg" "--accelerator-type, --version, --spot, --valid-for" ;;
  esac
done
if [[ -z "$VERSION" ]]; then
  case "$TYPE" in
    v5litepod-* | v5e-*) VERSION=v2-alpha-tpuv5-lite ;;
    v5p-*) VERSION=v2-alpha-tpuv5 ;;
    v6e-*) VERSION=v2-alpha-tpuv6e ;;
    v4-*) VERSION=tpu-ubuntu2204-base ;;
    *) die "no default --version for accelerator type '$TYPE'; give --version=RUNTIME" ;;
  esac
fi

if [[ "$QUEUED" == 1 ]]; then
  cmd=(gcloud compute tpus queued-resources create "$NAME" --node-id="$NAME" "${SCOPE[@]}"
    --accelerator-type="$TYPE" --runtime-version="$VERSION")
  [[ "$SPOT" == 1 ]] && cmd+=(--spot)
  [[ -n "$VALID_FOR" ]] && cmd+=(--valid-until-duration="$VALID_FOR")
  run "${cmd[@]}"
  if [[ "$DRY_RUN" == 1 ]]; then
    run gcloud compute tpus queued-resources describe "$NAME" "${SCOPE[@]}" --format="value(state.state)"
  else
    echo "waiting for queued resource $NAME to become ACTIVE ..."
    while true; do
      state=$(gcloud compute tpus queued-resources describe "$NAME" "${SCOPE[@]}" --format="value(state.state)")
      case "$state" in
        ACTIVE) break ;;
        FAILED | SUSPENDED) die "queued resource $NAME is $state" ;;
      esac
      sleep 30
    done
  fi
else
  [[ -z "$VALID_FOR" ]] || die "--valid-for applies to --queued requests only"
  cmd=(gcloud compute tpus tpu-vm create "$NAME" "${SCOPE[@]}" --accelerator-type="$TYPE" --version="$VERSION")
  [[ "$SPOT" == 1 ]] && cmd+=(--spot)
  run "${cmd[@]}"
fi
echo "next: tpu_scripts/setup.sh --name=$NAME --zone=$ZONE"
