#!/usr/bin/env bash
# GPU quantization (issue 19): the `small` VLA through PolicyRuntime in bf16 next to quantized copies - INT8 vision +
# FP16 projector + INT4 LLM (torchao Int4WeightOnlyConfig, tinygemm layout), INT4 LLM alone, INT8 weight-only LLM,
# INT8 vision + INT8 dynamic-activation LLM - with p50/p99 per prediction, weight bytes, peak GPU memory and the
# action cosine to the bf16 chunk. One JSON on stdout. run_all.sh measures the same layouts inside its inference
# check; this runs them alone. ~20 s on an H200.
set -euo pipefail
exec "${PYTHON:-python3}" bench/inference.py --device cuda --dtype bf16 --models small --steps 20 --warm 3 \
    --quantize-only --quantize "vision=int8,projector=fp16,llm=int4" "llm=int4" "llm=int8" \
    "vision=int8,llm=int8_dynamic" "$@"
