#!/usr/bin/env bash
# The README's GPU table on this machine: native FSDP2 engine (bf16; torch.compile off/on; activation
# checkpointing off/on; HSDP, two replica groups as if this node were two; the model's own loss instead of the
# lean loss) and the HF engine (DDP, FSDP2, DeepSpeed ZeRO-3), each a short run on every GPU, summarised as one
# Markdown table of tokens/s, tokens/s/GPU, MFU and peak memory; then benchmarks/lean_loss.py on one GPU (the lean
# loss against the model's own at vocabularies 32k/128k/256k: peak memory and tokens/s ratios).
#
#   bash benchmarks/gpu_matrix.sh                 # all GPUs torch sees; tables in $OUT/gpu_matrix.md, $OUT/lean_loss.md
#   NGPU=2 PRESET=default STEPS=40 bash benchmarks/gpu_matrix.sh
#   DRY_RUN=1 bash benchmarks/gpu_matrix.sh       # print the commands only
#
# Without a GPU it prints what it would run and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python )}
BIN=$(dirname "$PYTHON")
PRESET=${PRESET:-llama-1b}
BLOCK=${BLOCK:-2048}
PER_DEVICE=${PER_DEVICE:-4}
STEPS=${STEPS:-30}
CORPUS_MB=${CORPUS_MB:-40}
LOG_EVERY=${LOG_EVERY:-5}
OUT=${OUT:-outputs/gpu_matrix}
NGPU=${NGPU:-$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)}
DRY_RUN=${DRY_RUN:-0}

GBS=$(( PER_DEVICE * (NGPU > 0 ? NGPU : 1) ))
COMMON="--config_name $PRESET --max_corpus_mb $CORPUS_MB --bf16 true --block_size $BLOCK --global_batch_size $GBS --per_device_train_batch_size $PER_DEVICE \
--max_steps $STEPS --logging_steps $LOG_EVERY --eval_steps 0 --eval_on_start false --export_final false --save_steps 0 \
--report_to none --disable_tqdm true"
TORCHRUN="$BIN/torchrun --standalone --nproc-per-node ${NGPU/#0/1}"
ACCEL="$BIN/accelerate launch --num_processes ${NGPU/#0/1}"
# HSDP on one node: 2 replica groups of NGPU/2 (an odd count: NGPU replicas of 1), what two nodes would get by
# default; its peak memory shows the state over the shard group. One GPU has nothing to replicate: skipped.
if [ "$NGPU" -ge 2 ]; then
  HSDP_R=$(( NGPU % 2 == 0 ? 2 : NGPU ))
  HSDP="native bf16 + HSDP $HSDP_R x $(( NGPU / HSDP_R ))|$TORCHRUN run_fsdp_standalone.py $COMMON --dp_replicate $HSDP_R"
else
  HSDP="native bf16 + HSDP|SKIP HSDP needs at least 2 GPUs (world size ${NGPU/#0/1}): nothing to replicate"
fi

# name | command (each writes $OUT/<name>/metrics.jsonl)
RUNS=(
  "native bf16|$TORCHRUN run_fsdp_standalone.py $COMMON"
  "native bf16, the model's own loss (--lean_loss false)|$TORCHRUN run_fsdp_standalone.py $COMMON --lean_loss false"
  "native bf16 + activation checkpointing|$TORCHRUN run_fsdp_standalone.py $COMMON --gradient_checkpointing true"
  "native bf16 + torch.compile|$TORCHRUN run_fsdp_standalone.py $COMMON --torch_compile true"
  "native bf16 + torch.compile + activation checkpointing|$TORCHRUN run_fsdp_standalone.py $COMMON --torch_compile true --gradient_checkpointing true"
  "$HSDP"
  "HF engine, DDP|$ACCEL --config_file accelerate_configs/ddp.yaml run_hf_standalone.py $COMMON"
  "HF engine, FSDP2|$ACCEL --config_file accelerate_configs/fsdp.yaml run_hf_standalone.py $COMMON"
  "HF engine, DeepSpeed ZeRO-3|$ACCEL --config_file accelerate_configs/deepspeed_zero3.yaml run_hf_standalone.py $COMMON"
)

LEAN_LOSS="$PYTHON benchmarks/lean_loss.py --bf16 --hidden 2048 --layers 2 --tokens 8192 --rounds 5"

slug() { echo "$1" | tr 'A-Z' 'a-z' | tr -c 'a-z0-9\n' '-' | sed 's/--*/-/g; s/-$//'; }

if [ "$NGPU" = "0" ] || [ "$DRY_RUN" = "1" ]; then
  [ "$NGPU" = "0" ] && echo "no GPU visible to torch: nothing run. On a GPU machine this runs:"
  for run in "${RUNS[@]}"; do
    echo "  # ${run%%|*}"
    if [[ ${run#*|} == SKIP* ]]; then echo "  # skipped: ${run#*|SKIP }"; continue; fi
    echo "  ${run#*|} --output_dir $OUT/$(slug "${run%%|*}")"
  done
  echo "  # the lean loss against the model's own, one GPU, bf16"
  echo "  $LEAN_LOSS"
  echo "and writes $OUT/gpu_matrix.md and $OUT/lean_loss.md"
  exit 0
fi

mkdir -p "$OUT"
for run in "${RUNS[@]}"; do
  name=${run%%|*}; dir=$OUT/$(slug "$name")
  rm -rf "$dir" "$dir.skipped"
  echo "== $name" >&2
  if [[ ${run#*|} == SKIP* ]]; then echo "   skipped: ${run#*|SKIP }" >&2; echo "${run#*|SKIP }" >"$dir.skipped"; continue; fi
  # a failed configuration is a row that says so, not the end of the matrix
  ${run#*|} --output_dir "$dir" >"$dir.log" 2>&1 || echo "   failed: see $dir.log" >&2
done

"$PYTHON" - "$OUT" "$NGPU" "$PRESET" "$BLOCK" "$GBS" "${RUNS[@]}" <<'PY'
import json, statistics, sys, re
from pathlib import Path
out, ngpu, preset, block, gbs, runs = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6:]
try:
    import torch
    gpu = torch.cuda.get_device_name(0)
except Exception:
    gpu = "?"
def slug(s): return re.sub(r"-+", "-", re.sub(r"[^a-z0-9]", "-", s.lower())).strip("-")
lines = [f"{ngpu} x {gpu}, preset {preset}, block {block}, global batch {gbs}, bf16 "
         "(median over logged windows after the first)", "",
         "| configuration | tokens/s | tokens/s/GPU | MFU | peak memory (GB) |", "|---|---:|---:|---:|---:|"]
for run in runs:
    name = run.split("|", 1)[0]
    path = out / slug(name) / "metrics.jsonl"
    skipped = out / (slug(name) + ".skipped")
    if skipped.exists():
        lines.append(f"| {name} | skipped: {skipped.read_text().strip()} | | | |")
        continue
    recs = [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []
    recs = [r for r in recs if "tokens_per_second" in r][1:]  # the first window holds compilation and warm-up
    if not recs:
        lines.append(f"| {name} | failed (see {out / slug(name)}.log) | | | |")
        continue
    med = lambda k: statistics.median(r[k] for r in recs if r.get(k) is not None) if any(r.get(k) is not None for r in recs) else None
    tps, per, mfu, mem = med("tokens_per_second"), med("tokens_per_second_per_device"), med("mfu"), max((r.get("max_memory_allocated_gb") or 0) for r in recs)
    lines.append(f"| {name} | {tps:,.0f} | {per:,.0f} | {'%.1f%%' % (100 * mfu) if mfu else 'n/a'} | {mem:.1f} |")
table = "\n".join(lines) + "\n"
(out / "gpu_matrix.md").write_text(table)
print(table)
PY
echo "== lean loss vs the model's own" >&2
$LEAN_LOSS >"$OUT/lean_loss.md" 2>"$OUT/lean_loss.log" || echo "   failed: see $OUT/lean_loss.log" >&2
cat "$OUT/lean_loss.md"
