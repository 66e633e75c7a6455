# shellcheck shell=bash
# Shared by the benchmark scripts: start a `specd up` stack and run `specd bench` against it.
# The caller sets MAX_TOKENS, N and EXTRA (extra `specd bench` flags) before calling bench.
BIN=${BIN:-.venv/bin}
OUT=${OUT:-bench-results}
K=${K:-4}
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

