#!/usr/bin/env bash
# The README's benchmark (`make bench`): specd speculative vs target-only vs HF assisted
# generation on the embedded model, every ratio from one run on this machine.
#   1. float32 target, int8 drafter (the default pair), chat prompts, 1 and 8 clients,
#      modes target / fixed k / auto / HF generate(assistant_model=...)
#   2. the same stack at 32 clients: target / fixed / auto
#   3. bfloat16 target, same drafter, chat, 1 client: target / fixed / auto / HF
#   4. n-gram drafter, rewrite and code-edit prompts, 1 client: target / fixed / HF prompt lookup
# Results: $OUT/bench-*.json, $OUT/plots-*/*.png, and the tables on stdout.
# Usage: scripts/bench.sh [extra `specd bench` flags, applied to every run]
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
OUT=${OUT:-bench-results}
K=${K:-4}
MAX_TOKENS=${MAX_TOKENS:-96}
N=${N:-12}
mkdir -p "$OUT"
up_pid=""
cleanup() { if [ -n "$up_pid" ]; then kill -INT "$up_pid" 2>/dev/null || true; wait "$up_pid" 2>/dev/null || true; fi; }
trap cleanup EXIT

start_stack() {  # start_stack NAME [specd up flags...]
  local name=$1; shift
  "$BIN/specd" up -k "$K" --http-port 8100 --grpc-port 50150 --drafter-port 50151 --verifier-port 50152 \
    --drafter-metrics-port 9101 --verifier-metrics-port 9102 "$@" >"$OUT/up-$name.log" 2>&1 &
  up_pid=$!
  until grep -q "specd is up" "$OUT/up-$name.log"; do
    kill -0 "$up_pid" 2>/dev/null || { cat "$OUT/up-$name.log"; exit 1; }
    sleep 1
  done
}

bench() {  # bench NAME [specd bench flags...]
  local name=$1; shift
  echo "== $name"
  "$BIN/specd" bench --base-url http://127.0.0.1:8100 -k "$K" --max-tokens "$MAX_TOKENS" --output-dir "$OUT" \
    --name "$name" --service-metrics drafter=http://127.0.0.1:9101/metrics,verifier=http://127.0.0.1:9102/metrics \
    "$@" "${EXTRA[@]}" 2>"$OUT/bench-$name.log"
}

EXTRA=("$@")
start_stack f32
bench chat-f32 --workload chat --concurrency 1,8 --num-prompts "$N" --modes target,fixed,auto,hf
bench chat-f32-c32 --workload chat --concurrency 32 --num-prompts 64 --max-tokens 48 --modes target,fixed,auto
cleanup; up_pid=""

start_stack bf16 --verifier-dtype bfloat16
bench chat-bf16 --workload chat --concurrency 1 --num-prompts "$N" --modes target,fixed,auto,hf --hf-target-dtype bfloat16
cleanup; up_pid=""

start_stack ngram --drafter ngram
bench rewrite-ngram --workload rewrite --concurrency 1 --num-prompts "$N" --modes target,fixed,hf --hf-draft ngram
cleanup; up_pid=""
