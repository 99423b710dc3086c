#!/usr/bin/env bash
# Set up anygpu in ./.venv: keep a torch that is already installed, otherwise install
# the build that matches the machine (CPU build where there is no GPU driver), then
# the rest of requirements.txt and anygpu itself (editable).
#
#   bash scripts/setup.sh            # runtime dependencies
#   bash scripts/setup.sh --test     # plus the test tools (pytest, hypothesis, shellcheck)
#
# The versions are the exact ones the test suite passed with (constraints.txt, written by
# scripts/freeze_constraints.py); requirements.txt keeps the package's own, wider ranges.
#
# Knobs: VENV (default .venv), PYTHON (default python3), TORCH_INDEX_URL (force a wheel
# index for torch, e.g. https://download.pytorch.org/whl/rocm6.4), CONSTRAINTS (default
# constraints.txt; CONSTRAINTS= installs the newest versions the ranges allow).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
CONSTRAINTS=${CONSTRAINTS-constraints.txt}
WITH_TEST=0
for arg in "$@"; do
  case "$arg" in
    --test) WITH_TEST=1 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown option '$arg' (valid: --test, --help)" >&2; exit 2 ;;
  esac
done

log() { echo "[setup] $*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV (it sees the system's packages, so an installed torch is kept)"
  "$PYTHON" -m venv --system-site-packages "$VENV"
fi
PY="$VENV/bin/python"
# --no-compile: pip byte-compiles one file at a time; compileall below uses every core.
PIP=("$PY" -m pip install --disable-pip-version-check -q --no-compile)

gpu_vendor() {
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then echo nvidia
  elif command -v rocm-smi >/dev/null 2>&1 && rocm-smi --showid 2>/dev/null | grep -q 'GPU\['; then echo amd
  else echo none; fi
}

if "$PY" -c 'import torch' 2>/dev/null; then
  log "keeping the installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
  vendor=$(gpu_vendor)
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    log "installing torch from $TORCH_INDEX_URL"
    "${PIP[@]}" torch --index-url "$TORCH_INDEX_URL"
  elif [ "$vendor" = nvidia ]; then
    log "NVIDIA driver found: installing the CUDA build of torch from PyPI"
    "${PIP[@]}" torch
  elif [ "$vendor" = amd ]; then
    log "AMD driver found: installing the ROCm build of torch"
    "${PIP[@]}" torch --index-url https://download.pytorch.org/whl/rocm6.4
  else
    log "no GPU driver: installing the CPU build of torch (never the multi-GB CUDA wheels)"
    # The PyTorch CPU index first; where it cannot be reached, a CPU wheel pip already
    # knows of locally (find-links); never PyPI's default torch, which pulls CUDA.
    if ! "${PIP[@]}" --timeout 20 --retries 1 torch --index-url https://download.pytorch.org/whl/cpu 2>/dev/null; then
      if "${PIP[@]}" --no-index --no-deps 'torch>=2.6' 2>/dev/null && "$PY" -c 'import torch, sys; sys.exit("+cpu" not in torch.__version__ and torch.version.cuda is not None)'; then
        "${PIP[@]}" "torch==$("$PY" -c 'import torch; print(torch.__version__)')"   # its pure-Python dependencies
      else
        log "error: could not install a CPU build of torch (download.pytorch.org unreachable, no local wheel)."
        log "install one yourself, e.g. pip install torch --index-url https://download.pytorch.org/whl/cpu, then rerun."
        exit 1
      fi
    fi
  fi
fi

# Pin the torch we have so no later requirement can swap it for another build.
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$("$PY" -c 'import torch; print(torch.__version__)')" >"$constraints"
if [ -n "$CONSTRAINTS" ]; then
  log "versions from $CONSTRAINTS (the ones the test suite passed with)"
  cat "$CONSTRAINTS" >>"$constraints"
fi

# setup.py of DeepSpeed imports torch: build it against the torch above, not a fresh
# (CUDA) torch in an isolated build environment.
"${PIP[@]}" -c "$constraints" setuptools wheel packaging ninja
requirements=(-r requirements.txt)
if [ "$WITH_TEST" = 1 ]; then requirements+=(-r requirements-test.txt); fi
"${PIP[@]}" -c "$constraints" "${requirements[@]}" --no-build-isolation   # one resolve for both lists
"${PIP[@]}" -c "$constraints" --no-deps --no-build-isolation -e .
# Byte-compile what was installed on all cores (about 15 s of the set-up on 2 cores, against 27 s
# serially in pip): the tests start ~200 interpreters, and an uncompiled torch would cost each one seconds.
"$PY" -m compileall -q -j 0 "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true
log "ready: $VENV ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
