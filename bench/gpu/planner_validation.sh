#!/usr/bin/env bash
# GPU check of the planner (issue 8): predicted vs measured CUDA peak memory (within 10 %) and step time (within
# 25 %) for the `small` flavor under 6 configurations (none / selective / full x micro-batch 2 / 4), and the matmul
# efficiency to calibrate `planner.estimate.Assumptions` with. Writes ${OUT:-.}/planner_validation_gpu.json.
# Budget: ~3 minutes on an H200 (environment install excluded).
set -euo pipefail
out="${OUT:-.}"
python bench/planner_validation.py --device cuda --flavor small --gpu "${GPU:-h200-141}" --seq 1024 --steps 3 \
    > "$out/planner_validation_gpu.json"
cat "$out/planner_validation_gpu.json"
