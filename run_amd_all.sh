#!/usr/bin/env bash
# Train on every AMD GPU this job may use, on one node or many.
#
#   bash run_amd_all.sh [options] [-- training-script arguments]
#   bash run_amd_all.sh --engine fsdp -- --config_name tiny --max_steps 10 --output_dir outputs/tiny
#   bash run_amd_all.sh --gpus 0,1 --dry-run        # print the environment and the command only
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash run_amd_all.sh   # on each node (NODE_RANK 0, 1)
#
# Options: --engine hf|fsdp (default hf), --accelerate-config NAME|PATH, --nproc N, --gpus LIST,
# --cpu, --master-port PORT, --max-restarts K, --rdzv-conf K=V[,K=V], --script PATH, --ifname IFACE,
# --count-from auto|smi|torch, --dry-run, --interactive (ask, the plan's recommendation as defaults),
# --help. Details: --help and docs/launchers.md.
# Knob: PYTHON (default: the active virtualenv, else ./.venv, else python3).
# The logic lives in anygpu/launch/launcher.py; this file and run_nvidia_all.sh differ only in VENDOR.
set -euo pipefail

VENDOR=amd
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then PY=$VIRTUAL_ENV/bin/python
elif [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python
else PY=python3; fi

if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
  echo
fi

# --interactive (before --): the dialogue of `anygpu launch` (detect, recommend, ask), which then
# runs this same launcher.
MODULE=anygpu.launch.launcher
for arg in "$@"; do
  if [ "$arg" = "--" ]; then break; fi
  if [ "$arg" = "--interactive" ]; then MODULE=anygpu.tools.interactive; fi
done

# exec: the training job's exit code and signals are this script's. The launcher is imported
# from ROOT without touching PYTHONPATH, so the training processes inherit the caller's.
exec "$PY" -c 'import importlib, sys; sys.path.insert(0, sys.argv[1]); sys.exit(importlib.import_module(sys.argv[2]).main(sys.argv[3:]))' \
  "$ROOT" "$MODULE" --vendor "$VENDOR" "$@"
