# shellcheck shell=bash
# shellcheck disable=SC2034  # QUEUED, COMMON_HELP: read by the scripts that source this file
# Shared by the tpu_scripts: the flags every script takes, the dry-run switch and the gcloud scope.
# Defaults may come from the environment: JALIGN_TPU_NAME, JALIGN_TPU_ZONE, JALIGN_TPU_PROJECT.
set -euo pipefail

NAME="${JALIGN_TPU_NAME:-}"
ZONE="${JALIGN_TPU_ZONE:-}"
PROJECT="${JALIGN_TPU_PROJECT:-}"
QUEUED=0
DRY_RUN=0
ARGS=()
SCOPE=()

COMMON_HELP="  --name=NAME        the TPU VM / pod slice (or \$JALIGN_TPU_NAME)
  --zone=ZONE        e.g. us-west4-a (or \$JALIGN_TPU_ZONE)
  --project=PROJECT  Google Cloud project (default: gcloud's; or \$JALIGN_TPU_PROJECT)
  --queued           the slice was / is to be made through queued resources
  --dry-run          print the gcloud commands instead of running them
  -h, --help         this help"

die() {
  echo "$(basename "$0"): $*" >&2
  exit 2
}

# quote ARG: ARG as a shell word, in single quotes when it needs any (a --flag= keeps its name outside them).
quote() {
  local arg=$1 prefix=""
  if [[ "$arg" =~ ^(--[A-Za-z0-9_.-]+=)(.*)$ ]]; then
    prefix=${BASH_REMATCH[1]}
    arg=${BASH_REMATCH[2]}
  fi
  if [[ "$arg" =~ ^[A-Za-z0-9_./:=@%+,-]*$ ]]; then
    printf '%s%s' "$prefix" "$arg"
  else
    printf "%s'%s'" "$prefix" "${arg//\'/\'\\\'\'}"
  fi
}

# run CMD...: print it, shell-quoted (dry run), or execute it.
run() {
  if [[ "$DRY_RUN" == 1 ]]; then
    local word sep=""
    for word in "$@"; do
      printf '%s' "$sep"
      quote "$word"
      sep=" "
    done
    printf '\n'
  else
    "$@"
  fi
}

# parse_common "$@": the common flags; anything else is left in ARGS for the script.
parse_common() {
  while (($#)); do
    case "$1" in
      --name=*) NAME="${1#*=}" ;;
      --zone=*) ZONE="${1#*=}" ;;
      --project=*) PROJECT="${1#*=}" ;;
      --queued) QUEUED=1 ;;
      --dry-run) DRY_RUN=1 ;;
      -h | --help)
        usage
        exit 0
        ;;
      *) ARGS+=("$1") ;;
    esac
    shift
  done
  [[ -n "$NAME" ]] || die "--name is required (or set JALIGN_TPU_NAME); see --help"
  [[ -n "$ZONE" ]] || die "--zone is required (or set JALIGN_TPU_ZONE); see --help"
  SCOPE=(--zone="$ZONE")
  if [[ -n "$PROJECT" ]]; then
    SCOPE+=(--project="$PROJECT")
  fi
}

# on_workers COMMAND: run a shell command on every worker of the slice (in each worker's home directory).
on_workers() {
  run gcloud compute tpus tpu-vm ssh "$NAME" "${SCOPE[@]}" --worker=all --command="$1"
}

unknown() {
  die "unknown flag '$1'; accepted: $2 and the common flags (see --help)"
}
