#!/usr/bin/env bash
# The whole GPU campaign in one call, in priority order, each check under its own time limit, each writing its JSON
# into $OUT as soon as it finishes (a limit keeps what finished; a check that fails or times out leaves a JSON saying
# so, and the next one runs). The whole stays under 9 minutes: the device call's 600 s include the machine's start.
#
#   bench/gpu/run_all.sh             on the device: from the repository root, with the wheels of prepare.sh
#   bench/gpu/run_all.sh --dry-run   here, on the CPU: every check with tiny shapes and the same JSON keys
#
# It installs nothing from the network. Missing packages come as wheels in .whl/ (bench/gpu/prepare.sh) and go into
# /tmp/site; the project runs from src/ with the machine's torch (>= 2.11). $OUT gets at most 8 files: one JSON per
# check and summary.json (with the device, its catalog entry, the torch / transformers versions and the last 6,000
# characters of the log, which is written under /tmp or to $LOG).
#
# Limits (seconds, on an H100; the first run, 2026-12-06, took 410 s: mfu finished inside its 220 with fp8 beside
# each of six points, precision ran past 50 and inference past 70, three checks crashed early):
#   mfu 145                fp8 check first (bf16, tensorwise, rowwise on vla-7b-4l: one process each, ~40 s apiece
#                          for imports, build and compile), then bf16 MFU of the largest fitting flavor and of small
#                          at micro-batch 16 (~30 s each: the six bf16 + six fp8 points of the first run took ~200 s);
#                          no new point after 95 s
#   planner_validation 70  eight uncompiled small steps, now built on the device (~4 s each) plus imports
#   policies 50            LeRobot's pi0.5 at its published size (built on the device, random weights): a fine-tune
#                          step's time, peak, TFLOP/s and MFU (bf16 over fp32 masters, joint layers checkpointed),
#                          SmolVLA's and pi0.5's chunk latency, then the step under a 24 GB memory fraction with bf16
#                          masters; no new row after 35 s (bench/policies_gpu.py; issue 60)
#   activation_memory 60   one sequence length (2048), every strategy, eager
#   ring_kernel 30         three sequence lengths of one attention call, no model
#   precision 75           bf16, fp8, fp16 of small in ONE process, compiled (~20 s each) plus imports; no new
#                          configuration after 45 s (fp16, last, is the one dropped when time is short)
#   inference 85           latency of small and vla-7b-4l at history 1 with a compiled variant (~30 s each), then
#                          the quantized layouts (each layout's timed predictions capped at 2 s), then history 4
#                          and batches while time is left; no new measurement after 55 s
# They add up to 515 s (mfu 180 and inference 100 of the first run gave 35 s to policies); with the wheels' install
# and the device probe ~530 s. BUDGET_S (530) caps the whole: a check never gets more than what is left of it (and a killed check's 10 s grace keeps the whole within 540 s).
set -uo pipefail
cd "$(dirname "$0")/../.."
dry=0
[ "${1:-}" = "--dry-run" ] && dry=1
out="${OUT:-bench-out}"
mkdir -p "$out"
log="${LOG:-$(mktemp /tmp/run_all.XXXXXX.log)}"  # its tail goes into summary.json (at most 8 files come back)
: > "$log"
py="${PYTHON:-python3}"
start=$(date +%s)
budget=${BUDGET_S:-530}
[ "$dry" = 1 ] && budget=${BUDGET_S:-100000}  # the CPU dry run is as slow as the machine is busy
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}"
if [ "$dry" = 0 ] && compgen -G ".whl/*.whl" > /dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >> "$log" 2>&1 || { echo "installing .whl/ failed (see $log)"; exit 1; }
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
# the device and its catalog entry (an H100 or an H200 may be lent: the name decides, GPU=... overrides)
device=$("$py" bench/gpu/detect.py --default h200-141 2>> "$log") || device='{"device": "unknown"}'
gpu=${GPU:-$("$py" -c "import json, sys; print(json.loads(sys.argv[1]).get('catalog_gpu', 'h200-141'))" "$device")}
echo "device: $device; catalog entry: $gpu" | tee -a "$log"
statuses=()
# the quantization layouts the inference check also measures (bench/gpu/quantization.sh alone runs the same)
QUANT_LAYOUTS="vision=int8,projector=fp16,llm=int4 llm=int4 llm=int8 vision=int8,llm=int8_dynamic"

# check NAME SECONDS MARGIN COMMAND...: run COMMAND (which prints one JSON on stdout) under a limit into
# $out/NAME.json. The limit is SECONDS or what is left of the budget, whichever is less; an argument @BUDGET@
# becomes the limit less MARGIN (the script starts no new measurement after it, so it ends inside the limit).
check() {
    local name=$1 limit=$2 margin=$3 t0 rc left arg args=()
    shift 3
    t0=$(date +%s)
    left=$(( budget - (t0 - start) ))
    if [ "$left" -lt 15 ]; then
        echo "{\"check\": \"$name\", \"status\": \"skipped\", \"why\": \"campaign budget spent\"}" > "$out/$name.json"
        statuses+=("\"$name\": {\"status\": \"skipped\", \"seconds\": 0}")
        echo "$name: ${statuses[-1]}"
        return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
    for arg in "$@"; do args+=("${arg//@BUDGET@/$(( limit > margin ? limit - margin : 0 ))}"); done
    echo "== $name (limit ${limit}s): ${args[*]}" >> "$log"
    timeout --kill-after=10 "$limit" "${args[@]}" > "$out/$name.json.tmp" 2>> "$log"
    rc=$?
    if [ "$rc" = 0 ] && "$py" -c "import json,sys; json.load(open(sys.argv[1]))" "$out/$name.json.tmp" 2>> "$log"; then
        mv "$out/$name.json.tmp" "$out/$name.json"
        rm -f "$out/$name.partial.json"
        statuses+=("\"$name\": {\"status\": \"ok\", \"limit\": $limit, \"seconds\": $(( $(date +%s) - t0 ))}")
    else
        local why=failed
        [ "$rc" = 124 ] || [ "$rc" = 137 ] && why=timeout
        # mfu.py, policies_gpu.py and inference.py rewrite their own file after every point: keep what they finished
        [ -s "$out/$name.partial.json" ] && mv "$out/$name.partial.json" "$out/$name.json" ||
            echo "{\"check\": \"$name\", \"status\": \"$why\", \"rc\": $rc}" > "$out/$name.json"
        rm -f "$out/$name.json.tmp"
        statuses+=("\"$name\": {\"status\": \"$why\", \"rc\": $rc, \"limit\": $limit, \"seconds\": $(( $(date +%s) - t0 ))}")
    fi
    echo "$name: ${statuses[-1]}"
}

if [ "$dry" = 1 ]; then
    check mfu 300 60 "$py" bench/mfu.py --dry-run --budget-s @BUDGET@ --out "$out/mfu.partial.json"
    check planner_validation 120 0 "$py" bench/planner_validation.py --device cpu --flavor tiny --steps 1
    check policies 240 60 "$py" bench/policies_gpu.py --dry-run --steps 1 --runs 2 --budget-s @BUDGET@ \
        --out "$out/policies.partial.json"
    # tiny's bytes (small's 36 blocks under fake tensors took ~20 s of the check) and the timed strategies that
    # targets() reads; the CPU-only branches (the device counts and times one real run of small)
    check activation_memory 240 0 "$py" bench/activation_memory.py --device cpu --seq 256 --repeats 1 --rounds 1 \
        --bytes-flavor tiny --time-strategies full selective
    check ring_kernel 60 0 "$py" bench/ring_kernel.py --device cpu --tokens 256 --repeats 1
    # one process, as on the GPU (uncompiled here: the MFU point checks compilation, at ~100 s per compile)
    # one step: CPU fp8 matmuls are an emulation (~3 s a step on tiny); the final losses still compare
    check precision 180 60 "$py" bench/precision.py --device cpu --flavors tiny --steps 1 --batch 2 \
        --configs bf16 fp8 fp16 --processes one --budget-s @BUDGET@
    # one thread: the dry run shares the CPU (the test suite's other worker); two threads there ran 10x slower
    check inference 180 60 "$py" bench/inference.py --models tiny --histories 1 --steps 2 --warm 1 --batches 1 2 \
        --threads 1 --quantize vision=int8,projector=fp16,llm=int4 llm=int8_dynamic --quantize-max-s 2 \
        --budget-s @BUDGET@ --out "$out/inference.partial.json"
else
    check mfu 145 50 "$py" bench/mfu.py --gpu "$gpu" --budget-s @BUDGET@ --out "$out/mfu.partial.json"
    check planner_validation 70 0 "$py" bench/planner_validation.py --device cuda --flavor small --gpu "$gpu" \
        --seq 1024 --steps 3
    check policies 50 15 "$py" bench/policies_gpu.py --gpu "$gpu" --micro 4 --steps 3 --runs 10 \
        --budget-s @BUDGET@ --out "$out/policies.partial.json"
    check activation_memory 60 0 "$py" bench/activation_memory.py --device cuda --seq 2048 --repeats 3
    check ring_kernel 30 0 "$py" bench/ring_kernel.py --device cuda --heads 16 --head-dim 128 --repeats 5
    check precision 75 30 "$py" bench/precision.py --device cuda --flavors small --steps 12 --batch 8 \
        --configs bf16 fp8 fp16 --processes one --compile --budget-s @BUDGET@
    check inference 85 30 bash bench/gpu/inference.sh --quantize-models small \
        --quantize $QUANT_LAYOUTS --quantize-max-s 2 --budget-s @BUDGET@ --out "$out/inference.partial.json"
fi

{
    echo "{\"dry_run\": $([ "$dry" = 1 ] && echo true || echo false), \"seconds\": $(( $(date +%s) - start )),"
    echo " \"budget_s\": $budget, \"catalog_gpu\": \"$gpu\", \"device\": $device,"
    echo " \"checks\": {$(IFS=,; echo "${statuses[*]}")},"
    echo " \"log_tail\": $("$py" -c "import json, sys; print(json.dumps(open(sys.argv[1]).read()[-6000:]))" "$log")}"
} > "$out/summary.json"
cat "$out/summary.json"
