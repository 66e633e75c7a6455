#!/usr/bin/env bash
# The head-of-line benchmark: inter-token latency of running streams while long prompts arrive,
# with whole-prompt prefill (--prefill-chunk-tokens 0) and chunked prefill (the default).
# Workload longmix: chat prompts, every fourth replaced by a ~1,400-token prompt; auto mode
# (what `specd up` serves), 8 and 32 clients. Both stacks use `specd up`'s default placement.
# Results: $OUT/bench-prefill-*.json and plots; the tables on stdout.
# Usage: scripts/bench_prefill.sh [extra `specd bench` flags, applied to every run]
set -euo pipefail
cd "$(dirname "$0")/.."
MAX_TOKENS=${MAX_TOKENS:-64}
CHUNK=${CHUNK:-512}
# shellcheck source=scripts/bench_lib.sh
source scripts/bench_lib.sh

EXTRA=("$@")
for chunk in 0 "$CHUNK"; do
  start_stack "prefill-$chunk" --prefill-chunk-tokens "$chunk"
  bench "prefill-$chunk" --workload longmix --concurrency 8,32 --modes auto
  cleanup; up_pid=""
done
