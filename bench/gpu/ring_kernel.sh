#!/usr/bin/env bash
# GPU check of sequence parallelism (issue 7): ring attention on one GPU (1-rank group) vs plain SDPA, forward +
# backward in bf16 at 4k / 8k / 16k tokens: the overhead of the blockwise path, whose CUDA block is still explicit
# math. Writes ${OUT:-.}/ring_kernel_gpu.json. Budget: ~1 minute on an H200.
set -euo pipefail
out="${OUT:-.}"
python bench/ring_kernel.py --device cuda --heads 16 --head-dim 128 --repeats 5 > "$out/ring_kernel_gpu.json"
cat "$out/ring_kernel_gpu.json"
