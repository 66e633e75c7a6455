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
MAX_TOKENS=${MAX_TOKENS:-64}
N=${N:-12}
# shellcheck source=scripts/bench_lib.sh
source scripts/bench_lib.sh

EXTRA=("$@")
start_stack split --verifier-cpus 0 --drafter-cpus 1
bench pipeline-split --workload chat --concurrency 1,8 --num-prompts "$N" --modes target,sequential,cohort,ahead,auto
bench pipeline-split-c32 --workload chat --concurrency 32 --num-prompts 64 --max-tokens 48 --modes target,auto
cleanup; up_pid=""

start_stack shared
bench pipeline-shared --workload chat --concurrency 1 --num-prompts "$N" --modes target,sequential,ahead
cleanup; up_pid=""
