#!/usr/bin/env bash
# Single-stream run on the embedded model: target-only (k=0) vs speculative (k=4),
# one after the other on this machine, through the whole stack (specd up + specd bench).
# Usage: scripts/bench_single_stream.sh [extra `specd bench` flags]
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
OUT=${OUT:-bench-results}
mkdir -p "$OUT"
for k in ${KS:-0 2 4}; do
  "$BIN/specd" up -k "$k" --http-port 8100 --grpc-port 50150 --drafter-port 50151 --verifier-port 50152 \
    >"$OUT/up-k$k.log" 2>&1 &
  up=$!
  trap 'kill $up 2>/dev/null || true' EXIT
  until grep -q "specd is up" "$OUT/up-k$k.log"; do
    kill -0 $up 2>/dev/null || { cat "$OUT/up-k$k.log"; exit 1; }
    sleep 1
  done
  echo "== k=$k"
  "$BIN/specd" bench --base-url http://127.0.0.1:8100 --concurrency 1 --num-prompts 16 --max-tokens 128 \
    --output "$OUT/single-stream-k$k.json" "$@"
  kill -INT $up
  wait $up || true
done
