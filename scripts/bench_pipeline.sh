#!/usr/bin/env bash
# The pipeline benchmark: sequential vs cohort vs draft-ahead speculation on the embedded
# model, with the drafter and the verifier sharing the CPU or pinned to one core each.
#   1. placement "split" (verifier on CPU 0, drafter on CPU 1, one torch thread each):
#      chat prompts at 1 and 8 clients, modes target / sequential / cohort / ahead / auto
#   2. the same stack at 32 clients: target / auto
#   3. placement "shared" (no pinning, torch's default threads), 1 client:
#      target / sequential / ahead, to see what pinning buys
# Results: $OUT/bench-pipeline-*.json and plots; the tables on stdout.
# Usage: scripts/bench_pipeline.sh [extra `specd bench` flags, applied to every run]
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
OUT=${OUT:-bench-results}
K=${K:-4}
MAX_TOKENS=${MAX_TOKENS:-64}
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
start_stack split --verifier-cpus 0 --drafter-cpus 1
bench pipeline-split --workload chat --concurrency 1,8 --num-prompts "$N" --modes target,sequential,cohort,ahead,auto
bench pipeline-split-c32 --workload chat --concurrency 32 --num-prompts 64 --max-tokens 48 --modes target,auto
cleanup; up_pid=""

start_stack shared
bench pipeline-shared --workload chat --concurrency 1 --num-prompts "$N" --modes target,sequential,ahead
cleanup; up_pid=""
