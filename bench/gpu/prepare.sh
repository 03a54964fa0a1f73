#!/usr/bin/env bash
# Run here, before a device call: downloads into .whl/ (git-ignored) exactly the wheels the GPU campaign needs that
# the device machine lacks (Python 3.12, manylinux x86_64; it has torch >= 2.11, transformers, safetensors, numpy,
# rich, typer, pyyaml, matplotlib and tensorboard, and no network), checks that they resolve offline for Python 3.12
# and that they fit the 64 MiB a call may carry, and prints the one device command to run.
#
# The versions are the ones this project's environment installs (.venv), so the device runs the same code.
set -euo pipefail
cd "$(dirname "$0")/../.."
py="${PYTHON:-.venv/bin/python}"
dest=.whl
version() { "$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
# torchao: fp8 linears (the MFU check's fp8 variant); pydantic and its needs + tomli-w: vlaforge.config
# (typing-extensions too: pydantic needs a newer one than the device may have; /tmp/site comes first on the path)
pkgs=(torchao pydantic pydantic-core annotated-types typing-inspection typing-extensions tomli-w)
pins=()
for p in "${pkgs[@]}"; do pins+=("$p==$(version "$p")"); done
# peft: the LoRA rows of planner_validation (pure Python; its requirements - transformers, accelerate, safetensors,
# psutil, tqdm, pyyaml - are on the device), carried without its dependencies
extra=("peft==$(version peft)")
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
target=(--python-version 3.12 --implementation cp --only-binary=:all: "${platforms[@]}")
rm -rf "$dest"
mkdir -p "$dest"
"$py" -m pip download -q --no-deps "${target[@]}" -d "$dest" "${pins[@]}" "${extra[@]}"
# offline resolution for Python 3.12: every requirement of these wheels is among them (torchao declares no torch)
"$py" -m pip install -q --dry-run --ignore-installed --no-index --find-links "$dest" "${target[@]}" \
    --target /tmp/vlaforge-whl-check "${pins[@]}"
echo "resolved offline for Python 3.12: ${pins[*]} (and ${extra[*]} without its dependencies)"
size=$(du -sm "$dest" | cut -f1)
ls -1 "$dest"
echo "$dest: ${size} MiB of 64 MiB a call may carry"
[ "$size" -lt 60 ] || { echo "too large to carry with the working tree"; exit 1; }
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || grep -qx '/.whl/' .gitignore || echo '/.whl/' >> .git/info/exclude
cat <<EOF
device command (run tool, carry [".whl"], timeout_s 600; the checks' limits add up to 515 s, run_all.sh caps the
whole at 530 s, BUDGET_S=...):
  OUT=\$OUT bench/gpu/run_all.sh
EOF
