#!/usr/bin/env bash
# One host: drafter, verifier and gateway under one `specd up`, placed on the GPUs it has.
#
#   two or more GPUs: drafter on cuda:$SPECD_DRAFTER_GPU (0), verifier on cuda:$SPECD_VERIFIER_GPU (1)
#   one GPU:          both on cuda:0 (they share it: `specd up` runs them under CUDA MPS, starting
#                     nvidia-cuda-mps-control -d or using a daemon already running, and says so;
#                     where MPS cannot be had it says why and runs the sequential pipeline;
#                     SPECD_SHARED_GPU=mps|off: MPS or refuse to start / leave MPS alone)
#   no GPU:           both on the CPU (this is how CI runs it)
#
# Everything is set through the environment, with the services' own variable names, so the
# same values work for `specd drafter|verifier|gateway`, systemd, compose and Kubernetes:
#   SPECD_VERIFIER_MODEL, SPECD_DRAFTER_MODEL (default: the target), SPECD_DRAFTER_DRAFTER
#   (model|ngram|none), SPECD_{DRAFTER,VERIFIER}_{DEVICE,DTYPE,PORT}, SPECD_DRAFTER_QUANTIZE,
#   SPECD_GATEWAY_{HOST,HTTP_PORT,GRPC_PORT,NUM_SPECULATIVE_TOKENS,MAX_BATCH},
#   SPECD_TLS_{CERT,KEY,CA,CLIENT_CERT,CLIENT_KEY,SERVER_NAME}, SPECD_GATEWAY_API_KEY.
# The drafter and verifier stay on 127.0.0.1 and answer only the gateway: `specd up` gives
# all three a random backend token (or SPECD_BACKEND_TOKEN, when set).
# Variables `specd up` does not pass on as flags (SPECD_DRAFTER_THREADS, ...) reach the
# services unchanged. SPECD_GPU_COUNT overrides GPU detection; SPECD (default `specd`) is the
# command to run. Arguments after the options go to `specd up` as they are.
#
# Usage: deploy/launch.sh [--dry-run] [specd up options...]
set -euo pipefail

dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then
  dry_run=1
  shift
fi

gpu_count() {
  if [[ -n "${SPECD_GPU_COUNT:-}" ]]; then
    echo "$SPECD_GPU_COUNT"
  elif command -v nvidia-smi >/dev/null 2>&1; then
    # A host with the tool but no usable driver lists nothing: count what it lists.
    nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU ' || true
  else
    echo 0
  fi
}

gpus=$(gpu_count)
if ((gpus >= 2)); then
  drafter_device="cuda:${SPECD_DRAFTER_GPU:-0}"
  verifier_device="cuda:${SPECD_VERIFIER_GPU:-1}"
elif ((gpus == 1)); then
  drafter_device=cuda:0
  verifier_device=cuda:0
else
  drafter_device=cpu
  verifier_device=cpu
fi
drafter_device=${SPECD_DRAFTER_DEVICE:-$drafter_device}
verifier_device=${SPECD_VERIFIER_DEVICE:-$verifier_device}

target=${SPECD_VERIFIER_MODEL:-embedded}
read -r -a specd <<<"${SPECD:-specd}"
cmd=(
  "${specd[@]}" up
  --host "${SPECD_GATEWAY_HOST:-127.0.0.1}"
  --http-port "${SPECD_GATEWAY_HTTP_PORT:-8000}"
  --grpc-port "${SPECD_GATEWAY_GRPC_PORT:-50050}"
  --drafter-port "${SPECD_DRAFTER_PORT:-50051}"
  --verifier-port "${SPECD_VERIFIER_PORT:-50052}"
  --target-model "$target"
  --draft-model "${SPECD_DRAFTER_MODEL:-$target}"
  --drafter "${SPECD_DRAFTER_DRAFTER:-model}"
  --drafter-device "$drafter_device"
  --verifier-device "$verifier_device"
  # The target stays float32 (greedy output exactly the target's) unless told otherwise.
  --drafter-dtype "${SPECD_DRAFTER_DTYPE:-auto}"
  --verifier-dtype "${SPECD_VERIFIER_DTYPE:-float32}"
  --quantize "${SPECD_DRAFTER_QUANTIZE:-auto}"
  --num-speculative-tokens "${SPECD_GATEWAY_NUM_SPECULATIVE_TOKENS:-4}"
  --max-batch "${SPECD_GATEWAY_MAX_BATCH:-32}"
  --shared-gpu "${SPECD_SHARED_GPU:-auto}"
)
if [[ -n "${SPECD_TLS_CERT:-}" ]]; then
  cmd+=(--tls-cert "$SPECD_TLS_CERT" --tls-key "${SPECD_TLS_KEY:?SPECD_TLS_KEY must go with SPECD_TLS_CERT}")
  cmd+=(--tls-ca "${SPECD_TLS_CA:?SPECD_TLS_CA must go with SPECD_TLS_CERT}")
  [[ -n "${SPECD_TLS_SERVER_NAME:-}" ]] && cmd+=(--tls-server-name "$SPECD_TLS_SERVER_NAME")
  if [[ -n "${SPECD_TLS_CLIENT_CERT:-}" ]]; then
    cmd+=(--tls-client-cert "$SPECD_TLS_CLIENT_CERT" --tls-client-key "${SPECD_TLS_CLIENT_KEY:?}")
  fi
fi
cmd+=("$@")

echo "deploy/launch.sh: $gpus GPU(s): drafter on $drafter_device, verifier on $verifier_device" >&2
if ((dry_run)); then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
# exec: SIGTERM/SIGINT reach `specd up`, which stops the gateway first, lets it drain, then the others.
exec "${cmd[@]}"
