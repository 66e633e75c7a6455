#!/usr/bin/env bash
# A quick benchmark (`make bench`): specd speculative vs target-only vs HF assisted
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
MAX_TOKENS=${MAX_TOKENS:-96}
N=${N:-12}
# shellcheck source=scripts/bench_lib.sh
source scripts/bench_lib.sh

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
