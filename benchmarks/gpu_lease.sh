#!/usr/bin/env bash
# The GPU lease: everything anygpu wants measured on a lent GPU, in three device calls of under 5 minutes each, ready
# before the GPU comes (docs/benchmarks.md#the-gpu-lease says when and how to run it, and what each row means).
#
#   bash benchmarks/gpu_lease.sh fetch     # here (package registries): the wheels the device lacks, into .whl/
#   bash benchmarks/gpu_lease.sh plan      # what it installs, runs and writes; no GPU, no install, no run
#   bash benchmarks/gpu_lease.sh 1         # there, call 1: machine facts, matmul ceilings, the eager rows, CP kernels
#   bash benchmarks/gpu_lease.sh 2         # there, call 2: the compiled, FP8 and SFT rows
#   bash benchmarks/gpu_lease.sh 3         # there, call 3: the GPU tests (pytest -m gpu), the ones no lease passed first
#   bash benchmarks/gpu_lease.sh           # the three calls' work; without a GPU: the rehearsal (below)
#   bash benchmarks/gpu_lease.sh venv      # here: the device-like venv the rehearsal runs in
#   bash benchmarks/gpu_lease.sh test-order   # the order part 3 runs the GPU tests in
#
# Without a GPU the same parts run as a rehearsal with shrunken shapes on the CPU, in a venv built like the device's
# Python (Python 3.12, torch 2.11 from PyPI, transformers 5.17 and the image's other packages from
# benchmarks/lease_device_packages.txt; no datasets, no deepspeed), then the wheels of .whl/ installed with --target
# on top exactly as on the device: a broken lease is found here, not in the 15 minutes. The rehearsal runs every row
# (no time budget) and collects the GPU tests (each skips without a GPU).
#
# Each part installs .whl/ into $SITE with --target, writes only small files to $OUT (lease-N.md: the table;
# lease-N.jsonl: the rows; lease-N.log: every command's output; part 3: lease-3.md and gpu-tests.log), never a
# checkpoint, and on a GPU skips what would not fit its time budget (BUDGET seconds, default 255: three calls of
# 280 s fit 15 minutes of device time with the machine's start). The GPU tests that a lease passed are listed in
# benchmarks/lease_gpu_tests_passed.txt; part 3 runs the others first.
# Knobs: JOBS (rows at once in the rehearsal, default 2; one on a GPU), OUT (default outputs/lease), PYTHON (default
# .venv/bin/python where there is one, else python3: the device image's), BUDGET, ROW_LIMIT (seconds per row,
# default 150), TEST_LIMIT (seconds per GPU test in part 3, its module's shared runs included; default 150), SITE
# (default /tmp/anygpu-lease-site), LEASE_WORK (default /tmp/anygpu-lease), LEASE_VENV (default
# ~/.cache/anygpu/lease-venv), PYTHON312 (the rehearsal venv's interpreter; default: python3.12 or pyenv's), ROWS
# (comma-separated row ids: only these rows of the part, main or late, and no kernels; e.g. ROWS=grpo-4l,grpo-2l
# bash benchmarks/gpu_lease.sh 1 measures the GRPO rows, which a whole part 1 leaves no time for).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-outputs/lease}
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
BUDGET=${BUDGET:-255}
ROW_LIMIT=${ROW_LIMIT:-150}
TEST_LIMIT=${TEST_LIMIT:-150}
SITE=${SITE:-/tmp/anygpu-lease-site}
LEASE_VENV=${LEASE_VENV:-$HOME/.cache/anygpu/lease-venv}
WHEELS=.whl
WHEEL_LIST=benchmarks/lease_wheels.txt
DEVICE_PACKAGES=benchmarks/lease_device_packages.txt
PASSED_TESTS=benchmarks/lease_gpu_tests_passed.txt
SLOW_GPU_TESTS=test_fp8_trains  # run after the other unproven GPU tests
MAX_WHEELS_MB=48   # the device takes a working tree of 64 MiB, the repository's ~2 MB included
export LEASE_WORK=${LEASE_WORK:-/tmp/anygpu-lease}

say() { echo "[lease] $*" >&2; }

# name==version for each wheel of $WHEEL_LIST, the version the test suite runs with (constraints.txt)
wheel_specs() {
  grep -v '^\s*#' "$WHEEL_LIST" | awk 'NF {print $1}' | while read -r name; do
    version=$(grep -i "^${name}==" constraints.txt | cut -d= -f3)
    [ -n "$version" ] || { echo "gpu_lease.sh: $name is not in constraints.txt" >&2; exit 2; }
    echo "$name==$version"
  done
}

fetch() {
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  for spec in $(wheel_specs); do
    say "downloading $spec"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$WHEELS" "$spec"
  done
  size=$(du -sm "$WHEELS" | cut -f1)
  count=$(find "$WHEELS" -name '*.whl' | wc -l)
  say "$count wheels, $size MB in $WHEELS/ (git-ignored; carry it: carry=[\".whl\"])"
  [ "$size" -le "$MAX_WHEELS_MB" ] || { echo "gpu_lease.sh: $WHEELS/ is $size MB, over $MAX_WHEELS_MB MB" >&2; exit 1; }
}

install() {
  compgen -G "$WHEELS/*.whl" >/dev/null || {
    echo "gpu_lease.sh: no wheels in $WHEELS/: run 'bash benchmarks/gpu_lease.sh fetch' where the package registries are, and carry .whl" >&2
    exit 2
  }
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$SITE:$PWD"
}

bench() { "$PYTHON" benchmarks/lease_bench.py "$@"; }

# id|name|layers|seconds of each row of part $1
rows_of() {
  bench plan --part "$1" --lines
}

run_row() {  # id, name, layers, result file: one row in a process of its own, its record (or why not) in the file
  local id=$1 name=$2 layers=$3 result=$4 status=0 why
  timeout --kill-after 10 "$ROW_LIMIT" "$PYTHON" benchmarks/lease_bench.py row "$id" >"$result.out" 2>&1 || status=$?
  if grep -q '^LEASE_ROW ' "$result.out"; then
    grep '^LEASE_ROW ' "$result.out" | cut -d' ' -f2- >"$result"
  else
    why=$([ "$status" = 124 ] || [ "$status" = 137 ] && echo "timed out after $ROW_LIMIT s" || echo "failed (exit $status)")
    say "$id: $why (see the log)"
    echo "{\"kind\": \"row\", \"name\": \"$name\", \"layers\": $layers, \"status\": \"$why\"}" >"$result"
  fi
}

run_rows() {  # part, phase (main: before the GPU tests; late: after them), jsonl, log
  # On the GPU one row at a time (they are timed); the rehearsal runs JOBS at once (default 2: this machine's cores),
  # but the first alone while there is no data cache (it fills the cache the others read).
  local part=$1 phase=$2 rows=$3 log=$4 i=0 jobs=${JOBS:-2} done_dir="$LEASE_WORK/rows-$1-$2" alone=1
  [ "$GPU" = 1 ] && jobs=1
  [ -n "$(ls -A "$LEASE_WORK/cache" 2>/dev/null)" ] && alone=0
  rm -rf "$done_dir" && mkdir -p "$done_dir"
  while IFS='|' read -r id name layers seconds when; do
    [ "$when" = "$phase" ] || continue
    [ -z "${ROWS:-}" ] || [[ ",$ROWS," == *",$id,"* ]] || continue
    i=$((i + 1))
    if [ "$GPU" = 1 ] && [ $((SECONDS - START + seconds)) -gt "$BUDGET" ]; then
      say "skipped $id: past the part's budget of $BUDGET s"
      echo "{\"kind\": \"row\", \"name\": \"$name\", \"layers\": $layers, \"status\": \"skipped (time budget)\"}" >"$done_dir/$i"
      continue
    fi
    say "row $id"
    run_row "$id" "$name" "$layers" "$done_dir/$i" &
    if [ "$i$alone" = 11 ] || [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; then wait -n || true; fi
    [ "$i$alone" = 11 ] && wait
  done < <(rows_of "$part")
  wait
  for k in $(seq 1 "$i"); do  # in the plan's order
    cat "$done_dir/$k" >>"$rows"
    if [ -f "$done_dir/$k.out" ]; then cat "$done_dir/$k.out" >>"$log"; fi
  done
}

test_order() {  # the GPU tests' ids, those $PASSED_TESTS does not list first (the slow ones last of them)
  local ids proven unproven
  local files  # the files that mark GPU tests: collecting every test file takes ~15 s of imports
  mapfile -t files < <(grep -lE '^(@pytest\.mark\.gpu|pytestmark = \[?pytest\.mark\.gpu)' tests/test_*.py)
  ids=$("$PYTHON" -m pytest -m gpu -n 0 -q -p no:cacheprovider --collect-only "${files[@]}" 2>/dev/null | grep '::' || true)
  proven=$(grep -v '^#' "$PASSED_TESTS" || true)
  unproven=$(grep -vxF -e "${proven:-#}" <<<"$ids" || true)
  # the FP8 tests last of these: each takes most of a part's minutes (2026-11-27: tensorwise ran past 150 s alone)
  grep -v "$SLOW_GPU_TESTS" <<<"$unproven" || true
  grep "$SLOW_GPU_TESTS" <<<"$unproven" || true
  [ -z "$proven" ] || grep -xF -e "$proven" <<<"$ids" || true
}

gpu_tests() {  # the GPU tests in the part's time, the unproven first (-v: a cut-short run still says what passed)
  local ids=(tests) left status=0
  if [ "$GPU" = 1 ]; then  # the rehearsal collects once (each test skips there): the order is for a GPU's minutes
    mapfile -t ids < <(test_order)  # one id per line: a parametrized id may hold spaces
    [ "${#ids[@]}" -gt 0 ] && [ -n "${ids[0]}" ] || ids=(tests)
  fi
  left=$((BUDGET - (SECONDS - START)))
  if [ "$GPU" = 1 ] && [ "$left" -lt 30 ]; then echo "- GPU tests: skipped (time budget)"; return; fi
  say "GPU tests (pytest -m gpu; on a GPU the unproven first), $left s"
  # --timeout: one slow test fails alone instead of taking the others' minutes (the FP8 test took a whole call once);
  # ANYGPU_INSTANT_FAILURES: each failure's reason in the log when it happens, kept when the part's time cuts it off
  ANYGPU_INSTANT_FAILURES=1 timeout --kill-after 10 "$([ "$GPU" = 1 ] && echo "$left" || echo 600)" \
    "$PYTHON" -m pytest -m gpu -n 0 -v \
    -p no:cacheprovider -rs --durations 10 --timeout "$TEST_LIMIT" "${ids[@]}" >"$OUT/gpu-tests.log" 2>&1 || status=$?
  echo "- GPU tests (\`pytest -m gpu\`, gpu-tests.log): $(tail -n 1 "$OUT/gpu-tests.log") (exit $status); passed: $(grep -c ' PASSED' "$OUT/gpu-tests.log" || true)"
}

part() {
  local n=$1 log rows tests=""
  START=$SECONDS
  install
  GPU=$("$PYTHON" -c 'import torch; print(int(torch.cuda.is_available()))')  # the rehearsal runs every row
  mkdir -p "$OUT" "$LEASE_WORK"
  log=$OUT/lease-$n.log rows=$OUT/lease-$n.jsonl
  : >"$log"; : >"$rows"
  bench facts | tee -a "$log" >"$OUT/facts-$n.md"
  if [ "$n" = 3 ]; then
    tests=$(gpu_tests)
  else
    bench prepare >>"$log" 2>&1
    if [ "$n" = 1 ] && [ -z "${ROWS:-}" ]; then
      say "matmul ceilings"
      bench gemm 2>>"$log" | grep '^LEASE_GEMM ' | cut -d' ' -f2- >>"$rows" || say "gemm failed (see $log)"
    fi
    run_rows "$n" main "$rows" "$log"
    if [ "$n" = 1 ] && [ -z "${ROWS:-}" ]; then
      say "context-parallel attention kernels"
      bench cp 2>>"$log" | grep '^LEASE_CP ' | cut -d' ' -f2- >>"$rows" || say "cp kernels failed (see $log)"
    fi
    run_rows "$n" late "$rows" "$log"
  fi
  {
    echo "## GPU lease, part $n ($(date -u +%Y-%m-%d))"; echo; cat "$OUT/facts-$n.md"; echo
    [ "$n" = 3 ] || bench table "$n" "$rows"
    echo "$tests"
  } >"$OUT/lease-$n.md"
  rm -f "$OUT/facts-$n.md"
  [ "$n" != 3 ] || rm -f "$log" "$rows"
  cat "$OUT/lease-$n.md"
  say "part $n done in $((SECONDS - START)) s: $OUT/lease-$n.md"
}

venv() {
  if [ -x "$LEASE_VENV/bin/python3" ] && "$LEASE_VENV/bin/python3" -c 'import torch, transformers' 2>/dev/null; then
    return
  fi
  py=${PYTHON312:-}
  for candidate in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
    [ -n "$py" ] && break
    "$candidate" -c 'import venv' 2>/dev/null && py=$candidate  # a pyenv shim without the version fails here
  done
  [ -n "$py" ] || { echo "gpu_lease.sh: no Python 3.12 (set PYTHON312)" >&2; exit 2; }
  say "building $LEASE_VENV with $py: torch 2.11 from PyPI (a CUDA build: it runs on the CPU too; ~4.5 GB, outside the repository and its set-up)"
  "$py" -m venv "$LEASE_VENV"
  "$LEASE_VENV/bin/python3" -m pip install -q --disable-pip-version-check -r "$DEVICE_PACKAGES"
}

plan() {
  echo "wheels (fetch: pip download --no-deps for Python 3.12 into $WHEELS/; install: pip install --no-deps --target $SITE):"
  for spec in $(wheel_specs); do
    have=$(find "$WHEELS" -name "$(echo "${spec%%==*}" | tr - _)-${spec##*==}-*.whl" 2>/dev/null | head -n 1 || true)
    echo "  $spec${have:+ ($(du -k "$have" | cut -f1) kB in $WHEELS/)}"
  done
  echo "device calls (docs/benchmarks.md):"
  for n in 1 2 3; do echo "  run(command='bash benchmarks/gpu_lease.sh $n', carry=['.whl'], timeout_s=280)"; done
  echo "each part: facts, then (part 1) matmul ceilings, its rows, CP kernels; (part 2) its rows; (part 3) pytest -m gpu"
  for n in 1 2; do
    echo "part $n rows (python benchmarks/lease_bench.py row ID):"
    bench plan --part "$n" --commands
  done
  echo "writes under \$OUT: lease-1.md lease-1.jsonl lease-1.log lease-2.md lease-2.jsonl lease-2.log lease-3.md gpu-tests.log"
}

case "${1:-all}" in
  fetch) fetch ;;
  plan) plan ;;
  venv) venv ;;
  1|2|3) part "$1" ;;
  test-order) test_order ;;
  all)
    if "$PYTHON" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
      part 1 && part 2 && part 3
    else
      say "no GPU: the rehearsal (shrunken shapes, CPU) in the device-like venv $LEASE_VENV"
      venv
      compgen -G "$WHEELS/*.whl" >/dev/null || fetch
      t0=$SECONDS
      PYTHON="$LEASE_VENV/bin/python3" OUT=${OUT%/}-rehearsal bash "$0" 1
      PYTHON="$LEASE_VENV/bin/python3" OUT=${OUT%/}-rehearsal bash "$0" 2
      PYTHON="$LEASE_VENV/bin/python3" OUT=${OUT%/}-rehearsal bash "$0" 3
      say "rehearsal done in $((SECONDS - t0)) s (the three parts; the venv's build not counted)"
    fi
    ;;
  -h|--help) sed -n "2,31p" "$0" ;;
  *) echo "gpu_lease.sh: unknown command '$1' (valid: fetch, plan, 1, 2, 3, venv, test-order, or none)" >&2; exit 2 ;;
esac
