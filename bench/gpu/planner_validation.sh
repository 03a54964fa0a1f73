#!/usr/bin/env bash
# GPU check of the planner (issue 8): predicted vs measured CUDA peak memory (within 10 %) and step time (within
# 25 %) for the `small` flavor under 6 configurations (none / selective / full x micro-batch 2 / 4), and the matmul
# efficiency to calibrate `planner.estimate.Assumptions` with. Writes ${OUT:-.}/planner_validation_gpu.json.
# The planner's GPU is the catalog entry of the device's name (bench/gpu/detect.py; GPU=... overrides).
# Budget: ~1 minute on an H100 (run_all.sh gives it 70 s; environment install excluded).
set -euo pipefail
out="${OUT:-.}"
gpu=${GPU:-$(python bench/gpu/detect.py | python -c "import json, sys; print(json.load(sys.stdin)['catalog_gpu'])")}
python bench/planner_validation.py --device cuda --flavor small --gpu "$gpu" --seq 1024 --steps 3 \
    > "$out/planner_validation_gpu.json"
cat "$out/planner_validation_gpu.json"
