#!/usr/bin/env bash
# GPU inference latency (issue 17): PolicyRuntime in bf16 with SDPA (flash where no mask is needed) and compiled
# regions, on `small` and on vla-7b layer shapes (4 + 4 blocks), p50/p99 per prediction at frame history 1 and 4
# next to the eager path, and predict_batch throughput at 1/8/32 sessions. One JSON on stdout.
# Run from the repository root (run_all.sh runs it with the campaign, with --quantize and --budget-s: history 1 of
# both models first, ~30 s each with the compile warm-up; history 4 and the batches while its budget lasts).
set -euo pipefail
exec "${PYTHON:-python3}" bench/inference.py --device cuda --dtype bf16 --models small vla-7b-4l --histories 1 4 \
    --steps 20 --warm 3 --batches 1 8 32 --big-batches --compile "${COMPILE:-default}" "$@"
