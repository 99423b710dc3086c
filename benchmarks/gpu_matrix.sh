#!/usr/bin/env bash
# The README's GPU table on this machine: native FSDP2 engine (bf16; torch.compile off/on; activation
# checkpointing off/on; HSDP, two replica groups as if this node were two; the model's own loss instead of the
# lean loss; torch.compile on GPT-2 124M with its shipped dropout 0.1, keyed) and the HF engine (DDP, FSDP2,
# DeepSpeed ZeRO-3), context parallelism 2 around sdpa and flash attention, each a short run on every GPU
# started by the vendor launcher (run_nvidia_all.sh or
# run_amd_all.sh: their environment presets, as a user's run gets them) under a time limit, summarised as one
# Markdown table of tokens/s, tokens/s/GPU, MFU, peak memory and, for the torch.compile rows, dynamo's
# recompiles after step 2 (TORCH_LOGS=recompiles; 0 expected); then benchmarks/lean_loss.py on one GPU (the
# lean loss against the model's own at vocabularies 32k/128k/256k: peak memory and tokens/s ratios).
#
#   bash benchmarks/gpu_matrix.sh                 # all GPUs torch sees; tables in $OUT/gpu_matrix.md, $OUT/lean_loss.md
#   NGPU=2 PRESET=default STEPS=40 TIME_LIMIT=600 bash benchmarks/gpu_matrix.sh
#   DRY_RUN=1 bash benchmarks/gpu_matrix.sh       # print the commands only
#
# Knobs: NGPU, PRESET, BLOCK, PER_DEVICE, STEPS, CORPUS_MB, LOG_EVERY, OUT, VENDOR (nvidia|amd: which launcher;
# default from torch's build), TIME_LIMIT (seconds per configuration, default 1200: past it the run gets
# SIGTERM, SIGKILL 60 s later, and its row says so). Without a GPU it prints what it would run and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python )}
PRESET=${PRESET:-llama-1b}
BLOCK=${BLOCK:-2048}
PER_DEVICE=${PER_DEVICE:-4}
STEPS=${STEPS:-30}
CORPUS_MB=${CORPUS_MB:-40}
LOG_EVERY=${LOG_EVERY:-5}
OUT=${OUT:-outputs/gpu_matrix}
NGPU=${NGPU:-$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)}
DRY_RUN=${DRY_RUN:-0}
TIME_LIMIT=${TIME_LIMIT:-1200}
VENDOR=${VENDOR:-$("$PYTHON" -c "import torch; print('amd' if torch.version.hip else 'nvidia')" 2>/dev/null || echo nvidia)}
case "$VENDOR" in nvidia|amd) ;; *) echo "VENDOR=$VENDOR: give nvidia or amd" >&2; exit 2;; esac

GBS=$(( PER_DEVICE * (NGPU > 0 ? NGPU : 1) ))
COMMON="--config_name $PRESET --max_corpus_mb $CORPUS_MB --bf16 true --block_size $BLOCK --global_batch_size $GBS --per_device_train_batch_size $PER_DEVICE \
--max_steps $STEPS --logging_steps $LOG_EVERY --eval_steps 0 --eval_on_start false --export_final false --save_steps 0 \
--report_to none --disable_tqdm true"
# Every run through the vendor launcher (its environment presets, its torchrun / accelerate line), under
# `timeout`; TORCH_LOGS=recompiles puts dynamo's recompiles in the log of a compiled run (counted in the table).
LAUNCH="timeout --kill-after 60 $TIME_LIMIT bash run_${VENDOR}_all.sh --nproc ${NGPU/#0/1}"
NATIVE="$LAUNCH --engine fsdp --"
COMPILED="env TORCH_LOGS=recompiles $NATIVE"
hf() { echo "$LAUNCH --engine hf --accelerate-config $1 --"; }
# GPT-2 124M as shipped (dropout 0.1 on embeddings, attention and residuals: keyed masks), at its 1024 positions
GPT2_DROPOUT="--config_name benchmarks/gpt2_dropout.json --block_size 1024 --logging_steps 1"
# HSDP on one node: 2 replica groups of NGPU/2 (an odd count: NGPU replicas of 1), what two nodes would get by
# default; its peak memory shows the state over the shard group. One GPU has nothing to replicate: skipped.
if [ "$NGPU" -ge 2 ]; then
  HSDP_R=$(( NGPU % 2 == 0 ? 2 : NGPU ))
  HSDP="native bf16 + HSDP $HSDP_R x $(( NGPU / HSDP_R ))|$NATIVE $COMMON --dp_replicate $HSDP_R"
else
  HSDP="native bf16 + HSDP|SKIP HSDP needs at least 2 GPUs (world size ${NGPU/#0/1}): nothing to replicate"
fi
# Context parallelism (docs/long-context.md): each sequence split over 2 GPUs, Ulysses attention around sdpa and
# around flash attention (flash-attn installed), with activation checkpointing; one GPU has nothing to split.
if [ "$NGPU" -ge 2 ] && [ $(( NGPU % 2 )) = 0 ]; then
  CP_SDPA="native bf16 + context parallelism 2 (sdpa)|$NATIVE $COMMON --cp 2 --gradient_checkpointing true"
  CP_FLASH="native bf16 + context parallelism 2 (flash attention)|$NATIVE $COMMON --cp 2 --gradient_checkpointing true --attn_implementation flash_attention_2"
else
  CP_SDPA="native bf16 + context parallelism 2 (sdpa)|SKIP context parallelism needs an even number of GPUs (world size ${NGPU/#0/1})"
  CP_FLASH="native bf16 + context parallelism 2 (flash attention)|SKIP context parallelism needs an even number of GPUs (world size ${NGPU/#0/1})"
fi

# name | command (each writes $OUT/<name>/metrics.jsonl)
RUNS=(
  "native bf16|$NATIVE $COMMON"
  "native bf16, the model's own loss (--lean_loss false)|$NATIVE $COMMON --lean_loss false"
  "native bf16 + activation checkpointing|$NATIVE $COMMON --gradient_checkpointing true"
  "native bf16 + torch.compile|$COMPILED $COMMON --torch_compile true"
  "native bf16 + torch.compile + activation checkpointing|$COMPILED $COMMON --torch_compile true --gradient_checkpointing true"
  "native bf16 + torch.compile, GPT-2 124M with keyed dropout 0.1|$COMPILED $COMMON $GPT2_DROPOUT --torch_compile true"
  "$HSDP"
  "$CP_SDPA"
  "$CP_FLASH"
  "HF engine, DDP|$(hf ddp) $COMMON"
  "HF engine, FSDP2|$(hf fsdp) $COMMON"
  "HF engine, DeepSpeed ZeRO-3|$(hf deepspeed_zero3) $COMMON"
)

LEAN_LOSS="timeout --kill-after 60 $TIME_LIMIT $PYTHON benchmarks/lean_loss.py --bf16 --hidden 2048 --layers 2 --tokens 8192 --rounds 5"
# Gradient accumulation on the native engine: reduce-scatter every micro-batch (the engine) against deferring it to
# the last one (the engine before; +1x the model's fp32 size per GPU), tokens/s as a ratio (docs/memory.md)
ACCUMULATION="timeout --kill-after 60 $TIME_LIMIT $PYTHON -m torch.distributed.run --standalone --nproc-per-node ${NGPU/#0/1} \
benchmarks/accumulation_speed.py --bf16 --config_name $PRESET --block_size $BLOCK --accumulation 4"

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
  echo "  # gradient accumulation: reduce-scatter every micro-batch against deferred, every GPU, bf16"
  echo "  $ACCUMULATION"
  echo "and writes $OUT/gpu_matrix.md, $OUT/lean_loss.md and $OUT/accumulation.md"
  exit 0
fi

mkdir -p "$OUT"
for run in "${RUNS[@]}"; do
  name=${run%%|*}; dir=$OUT/$(slug "$name")
  rm -rf "$dir" "$dir.skipped" "$dir.timeout"
  echo "== $name" >&2
  if [[ ${run#*|} == SKIP* ]]; then echo "   skipped: ${run#*|SKIP }" >&2; echo "${run#*|SKIP }" >"$dir.skipped"; continue; fi
  # a failed or timed-out configuration is a row that says so, not the end of the matrix
  status=0
  ${run#*|} --output_dir "$dir" >"$dir.log" 2>&1 || status=$?
  if [ "$status" = 124 ] || [ "$status" = 137 ]; then
    echo "   timed out after $TIME_LIMIT s: see $dir.log" >&2; echo "$TIME_LIMIT" >"$dir.timeout"
  elif [ "$status" != 0 ]; then
    echo "   failed (exit $status): see $dir.log" >&2
  fi
done

"$PYTHON" benchmarks/gpu_matrix_summary.py "$OUT" "$NGPU" "$PRESET" "$BLOCK" "$GBS" "$TIME_LIMIT" "${RUNS[@]}"
echo "== lean loss vs the model's own" >&2
$LEAN_LOSS >"$OUT/lean_loss.md" 2>"$OUT/lean_loss.log" || echo "   failed: see $OUT/lean_loss.log" >&2
cat "$OUT/lean_loss.md"
echo "== gradient accumulation: reduce-scatter every micro-batch against deferred" >&2
$ACCUMULATION >"$OUT/accumulation.md" 2>"$OUT/accumulation.log" || echo "   failed: see $OUT/accumulation.log" >&2
cat "$OUT/accumulation.md"
