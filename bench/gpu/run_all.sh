#!/usr/bin/env bash
# The whole GPU campaign in one call, in priority order, each check under its own time limit, each writing its JSON
# into $OUT as soon as it finishes (a limit keeps what finished; a check that fails or times out leaves a JSON saying
# so, and the next one runs). At most 9.5 minutes on an H200 in all (the limits add up to 555 s).
#
#   bench/gpu/run_all.sh             on the device: from the repository root, with the wheels of prepare.sh
#   bench/gpu/run_all.sh --dry-run   here, on the CPU: every check with tiny shapes and the same JSON keys
#
# It installs nothing from the network. Missing packages come as wheels in .whl/ (bench/gpu/prepare.sh) and go into
# /tmp/site; the project runs from src/ with the machine's torch (>= 2.11). $OUT gets at most 8 files: one JSON per
# check, summary.json and run_all.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
dry=0
[ "${1:-}" = "--dry-run" ] && dry=1
out="${OUT:-bench-out}"
mkdir -p "$out"
log="$out/run_all.log"
: > "$log"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}"
if [ "$dry" = 0 ] && compgen -G ".whl/*.whl" > /dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >> "$log" 2>&1 || { echo "installing .whl/ failed (see $log)"; exit 1; }
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
start=$(date +%s)
statuses=()
# the quantization layouts the inference check also measures (bench/gpu/quantization.sh alone runs the same)
QUANT_LAYOUTS="vision=int8,projector=fp16,llm=int4 llm=int4 llm=int8 vision=int8,llm=int8_dynamic"

# check NAME SECONDS COMMAND...: run COMMAND (which prints one JSON on stdout) under a limit into $out/NAME.json
check() {
    local name=$1 limit=$2 t0 rc
    shift 2
    t0=$(date +%s)
    echo "== $name (limit ${limit}s): $*" >> "$log"
    timeout --kill-after=10 "$limit" "$@" > "$out/$name.json.tmp" 2>> "$log"
    rc=$?
    if [ "$rc" = 0 ] && "$py" -c "import json,sys; json.load(open(sys.argv[1]))" "$out/$name.json.tmp" 2>> "$log"; then
        mv "$out/$name.json.tmp" "$out/$name.json"
        rm -f "$out/$name.partial.json"
        statuses+=("\"$name\": {\"status\": \"ok\", \"seconds\": $(( $(date +%s) - t0 ))}")
    else
        local why=failed
        [ "$rc" = 124 ] || [ "$rc" = 137 ] && why=timeout
        # mfu.py rewrites its own file after every point: keep what it finished
        [ -s "$out/$name.partial.json" ] && mv "$out/$name.partial.json" "$out/$name.json" ||
            echo "{\"check\": \"$name\", \"status\": \"$why\", \"rc\": $rc}" > "$out/$name.json"
        rm -f "$out/$name.json.tmp"
        statuses+=("\"$name\": {\"status\": \"$why\", \"rc\": $rc, \"seconds\": $(( $(date +%s) - t0 ))}")
    fi
    echo "$name: ${statuses[-1]}"
}

if [ "$dry" = 1 ]; then
    check mfu 300 "$py" bench/mfu.py --dry-run --out "$out/mfu.partial.json"
    check planner_validation 120 "$py" bench/planner_validation.py --device cpu --flavor tiny --steps 1
    check activation_memory 240 "$py" bench/activation_memory.py --device cpu --seq 256 --repeats 1 --rounds 1
    check ring_kernel 60 "$py" bench/ring_kernel.py --device cpu --tokens 256 --repeats 1
    check precision 180 "$py" bench/precision.py --device cpu --flavors tiny --steps 2 --batch 2
    check inference 180 "$py" bench/inference.py --models tiny --histories 1 --steps 2 --warm 1 --batches 1 2 \
        --quantize vision=int8,projector=fp16,llm=int4 llm=int8_dynamic --out "$out/inference.partial.json"
else
    check mfu 220 "$py" bench/mfu.py --gpu "${GPU:-h200-141}" --out "$out/mfu.partial.json"
    check planner_validation 100 "$py" bench/planner_validation.py --device cuda --flavor small \
        --gpu "${GPU:-h200-141}" --seq 1024 --steps 3
    check activation_memory 75 "$py" bench/activation_memory.py --device cuda --seq 1024 2048 --repeats 3
    check ring_kernel 40 "$py" bench/ring_kernel.py --device cuda --heads 16 --head-dim 128 --repeats 5
    check precision 50 "$py" bench/precision.py --device cuda --flavors small --steps 20 --batch 8
    check inference 70 bash bench/gpu/inference.sh --quantize-models small --quantize $QUANT_LAYOUTS \
        --out "$out/inference.partial.json"
fi

{
    echo "{\"dry_run\": $([ "$dry" = 1 ] && echo true || echo false), \"seconds\": $(( $(date +%s) - start )),"
    echo " \"checks\": {$(IFS=,; echo "${statuses[*]}")}}"
} > "$out/summary.json"
cat "$out/summary.json"
