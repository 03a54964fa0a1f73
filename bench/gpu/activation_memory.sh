#!/usr/bin/env bash
# GPU activation-memory check: the `small` flavor at 1k/2k/4k tokens on real tensors, CUDA peak memory and step
# time for every checkpointing strategy (and CPU offload). Writes ${OUT:-.}/activation_memory_gpu.json.
# Budget: ~3 minutes on an H200 (environment install excluded).
set -euo pipefail
out="${OUT:-.}"
python bench/activation_memory.py --device cuda --repeats 5 > "$out/activation_memory_gpu.json"
cat "$out/activation_memory_gpu.json"
