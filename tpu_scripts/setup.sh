#!/usr/bin/env bash
# Set up every worker of a TPU VM / pod slice: copy jalign there, install it with the `tpu` extra, fetch data.
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<USAGE
Usage: tpu_scripts/setup.sh --name=NAME --zone=ZONE [--source=DIR|PIP_SPEC] [--data=gs://BUCKET/PATH]
                            [--checkpoint=gs://BUCKET/PATH] [--mount=BUCKET] [--project=PROJECT] [--dry-run]

On every worker: installs jalign (the committed tree of a local checkout, copied over as an archive, or a pip
requirement such as 'jalign[tpu] @ git+https://...'), with the jax[tpu] extra; copies data and an initial checkpoint
from Cloud Storage; optionally mounts a bucket with gcsfuse (a directory every worker sees, for run_dir and its
checkpoints on a multi-host slice).

  --source=DIR|SPEC      default: the checkout this script lives in
  --data=gs://...        copied to ~/data on every worker
  --checkpoint=gs://...  copied to ~/checkpoint on every worker (e.g. an HF model for model.path)
  --mount=BUCKET         mounted at ~/gcs on every worker (needs gcsfuse on the image)
$COMMON_HELP
USAGE
}

SOURCE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DATA=""
CHECKPOINT=""
MOUNT=""
parse_common "$@"
for arg in "${ARGS[@]+"${ARGS[@]}"}"; do
  case "$arg" in
    --source=*) SOURCE="${arg#*=}" ;;
    --data=*) DATA="${arg#*=}" ;;
    --checkpoint=*) CHECKPOINT="${arg#*=}" ;;
    --mount=*) MOUNT="${arg#*=}" ;;
    *) unknown "$arg" "--source, --data, --checkpoint, --mount" ;;
  esac
done
for uri in "$DATA" "$CHECKPOINT"; do
  [[ -z "$uri" || "$uri" == gs://* ]] || die "'$uri': --data and --checkpoint take gs:// URIs"
done

if [[ -d "$SOURCE" ]]; then
  archive="${TMPDIR:-/tmp}/jalign-$NAME.tar.gz"
  run git -C "$SOURCE" archive --format=tar.gz -o "$archive" HEAD
  run gcloud compute tpus tpu-vm scp "$archive" "$NAME":jalign.tar.gz "${SCOPE[@]}" --worker=all
  on_workers "mkdir -p jalign && tar -xzf jalign.tar.gz -C jalign && python3 -m pip install -q -U pip && python3 -m pip install -q -e './jalign[tpu]'"
else
  on_workers "python3 -m pip install -q -U pip && python3 -m pip install -q '$SOURCE'"
fi
if [[ -n "$DATA" ]]; then
  on_workers "mkdir -p data && gcloud storage rsync --recursive '$DATA' data"
fi
if [[ -n "$CHECKPOINT" ]]; then
  on_workers "mkdir -p checkpoint && gcloud storage rsync --recursive '$CHECKPOINT' checkpoint"
fi
if [[ -n "$MOUNT" ]]; then
  on_workers "mkdir -p gcs && (mountpoint -q gcs || gcsfuse --implicit-dirs '$MOUNT' gcs)"
fi
on_workers "python3 -c 'import jax, jalign; print(\"jalign ready, jax\", jax.__version__)'"
echo "next: tpu_scripts/launch.sh --name=$NAME --zone=$ZONE --config=configs/grpo.py"
