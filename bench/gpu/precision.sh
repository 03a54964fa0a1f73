#!/usr/bin/env bash
# GPU precision check: step time, peak memory and final loss of bf16, bf16 + fp8 LLM linears and fp16 on the `small`
# flavor, in one process, compiled (bench/precision.py's GPU defaults). fp8 does not pay on small (0.37-0.80x bf16
# on an H100, 2026-12-06): this checks fp8's accuracy and memory; bench/mfu.py's fp8 check measures its speed on
# vla-7b layer shapes. Run from the repository root; writes JSON to ${OUT:-.}/precision_gpu.json.
# Budget: ~75 s on an H100 (environment install excluded).
set -euo pipefail
out="${OUT:-.}"
python bench/precision.py --device cuda --flavors small --configs bf16 fp8 fp16 --steps 30 --batch 8 \
    > "$out/precision_gpu.json"
cat "$out/precision_gpu.json"
