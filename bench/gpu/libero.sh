#!/usr/bin/env bash
# LIBERO-Object at the full protocol on a GPU (issue 44): the scripted expert from all 500 fixed initial states with
# both cameras rendered at 256 px at every step (what a policy's evaluation renders), with EGL on the GPU; success,
# env steps per second and seconds in one JSON on stdout (bench/libero.py expert --render 256).
#
# Its own device call, not part of run_all.sh (~650 MB of LIBERO assets do not fit the 64 MiB a call may carry, so
# the device needs the LIBERO stack installed: requirements/libero.txt). Without it, the JSON says what is missing.
#   OUT=$OUT bench/gpu/libero.sh            (run tool, timeout_s 300)
#   bench/gpu/libero.sh --dry-run           here: 1 state per task, 64 px
set -uo pipefail
cd "$(dirname "$0")/../.."
py="${PYTHON:-python3}"
# NOTE: not bench/ on the path, as run_all.sh has it: bench/libero.py would shadow LIBERO's `libero` package
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" MUJOCO_GL=egl PYTHONUNBUFFERED=1
out="${OUT:-bench-out}"
mkdir -p "$out"
if ! missing=$("$py" -c "from vlaforge.data import libero; libero.libero()" 2>&1 >/dev/null); then
    "$py" -c "import json, sys; print(json.dumps({'check': 'libero', 'status': 'skipped', 'why': sys.argv[1]}))" \
        "$(echo "$missing" | tail -1)" | tee "$out/libero.json"
    exit 0
fi
if [ "${1:-}" = "--dry-run" ]; then
    args=(--states 1 --placements 0 --render 64)
else
    args=(--states 50 --placements 0 --render 256 --workers "${WORKERS:-8}")
fi
exec "$py" bench/libero.py expert --out "$out" "${args[@]}"
