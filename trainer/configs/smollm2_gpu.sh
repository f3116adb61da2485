#!/usr/bin/env bash
# The SmolLM2 DFlash drafter at GPU scale, time-boxed for a short GPU lease: regenerate the target's responses to
# HumanEval-form coding prompts (stubs and tasks from installed packages' documented functions) and Magpie prompts,
# then train a new drafter (trainer/configs/smollm2_dflash_gpu.yaml) on them and on the shipped responses. The first
# run (one H200, 7 minutes) regenerated the first 10 of 25 shards: they ship in hub/embedded/.../data-gpu and this
# script goes on from there (README, "A GPU run").
#   PROMPTS=file     coding prompts, one {"prompt": ...} per line (default: the shipped draw, data-gpu/code-prompts)
#   MAGPIE=N         Magpie prompts synthesised by the target and mixed in (default 4000; 0: none)
#   REGEN_S=N        stop regenerating after N seconds: the finished shards are kept and trained on (0: no limit)
#   MAX_STEPS=N      training steps (default 2000)
#   CONTINUE_STEPS=N then its carryover and control continuations, N steps each (default 0: none)
#   GEN_BATCH=N      regeneration batch (default 512)
#   TARGET=path      the target (default: the embedded SmolLM2; a random one of its shape is a dry run)
#   DATA, OUT_DIR    the regenerated responses and the drafter (default data/smollm2-gpu, runs/smollm2-dflash/gpu)
# Arguments are more trainer/run.py flags (e.g. `--use_cpu true` for a dry run without a GPU). Every stage resumes:
# regeneration keeps its finished shards, training its last checkpoint; a finished drafter is not trained again (give
# a new OUT_DIR to train on a grown regeneration).
set -euo pipefail
cd "$(dirname "$0")/../.."

SHIPPED=hub/embedded/smollm2-135m-instruct
PROMPTS=${PROMPTS:-$SHIPPED/data-gpu/code-prompts.jsonl.gz}
MAGPIE=${MAGPIE:-4000}
REGEN_S=${REGEN_S:-0}
MAX_STEPS=${MAX_STEPS:-2000}
CONTINUE_STEPS=${CONTINUE_STEPS:-0}
GEN_BATCH=${GEN_BATCH:-512}
TARGET=${TARGET:-smollm2}
DATA=${DATA:-data/smollm2-gpu}
OUT_DIR=${OUT_DIR:-runs/smollm2-dflash/gpu}
num_code=$(python -c "from trainer.data import load_prompts; import sys; print(len(load_prompts(sys.argv[1])))" "$PROMPTS")

# 1. Responses, in shards of 1,024 prompts (coding and Magpie shuffled together); a time limit stops between tokens,
# and the shard under way is lost, the finished ones kept. The shipped shards (and their Magpie prompts) go first.
if [ ! -f "$DATA/regeneration.json" ] && [ "$PROMPTS" = "$SHIPPED/data-gpu/code-prompts.jsonl.gz" ]; then
  mkdir -p "$DATA" && cp "$SHIPPED"/data-gpu/{*.parquet,regeneration.json,magpie-*.jsonl} "$DATA"/
fi
sources=(--prompts "$PROMPTS" --num_prompts "$num_code")
[ "$MAGPIE" -gt 0 ] && sources=(--prompts magpie "$PROMPTS" --num_prompts "$MAGPIE" "$num_code")
# Not while its drafter is under way: a resumed training run must read the rows it started on (run.py checks).
limit=()
[ "$REGEN_S" -gt 0 ] && limit=(timeout "$REGEN_S")
if ls -d "$OUT_DIR"/checkpoint-* >/dev/null 2>&1 && [ ! -f "$OUT_DIR/model.safetensors" ]; then
  echo "$OUT_DIR is under way: training resumes on the shards it started with"
else
  "${limit[@]}" python -m trainer.regenerate --target "$TARGET" --data_dir "$DATA" "${sources[@]}" \
    --magpie_max_new_tokens 64 --max_new_tokens 256 --generation_batch_size "$GEN_BATCH" --shard_size 1024 \
    --target_dtype bfloat16 || { status=$?; [ "$status" -eq 124 ] || exit "$status"; }
fi
shards=$(ls "$DATA"/shard-*.parquet | wc -l)
echo "regenerated: $shards shards in $DATA ($SECONDS s)"

# 2. The drafter on the finished shards (a regeneration cut short is not a complete folder) and the shipped responses
# (3,000 mix + 2,000 stubs).
train() {  # output_dir, extra flags...; skipped when done, resumed from the last checkpoint when interrupted
  local out=$1; shift
  [ -f "$out/model.safetensors" ] && return 0
  local resume=()
  ls -d "$out"/checkpoint-* >/dev/null 2>&1 && resume=(--resume_from_checkpoint latest)
  python trainer/run.py trainer/configs/smollm2_dflash_gpu.yaml --target "$TARGET" \
    --dataset "$DATA" "$SHIPPED/data" "$SHIPPED/data-stub" --dataset_shards "$shards" 0 0 --output_dir "$out" \
    "${resume[@]}" "$@"
  echo "trained: $out ($SECONDS s)"
}
train "$OUT_DIR" --max_steps "$MAX_STEPS" "$@"

# 3. Its two continuations of equal length from the same weights and data order: with carryover (the two-pass
# draft-verify-draft objective) and without (the control).
if [ "$CONTINUE_STEPS" -gt 0 ]; then
  continuation=(--drafter_checkpoint "$OUT_DIR" --max_steps "$CONTINUE_STEPS" --warmup_steps 0 --learning_rate 3e-4)
  train "$OUT_DIR-carryover" "${continuation[@]}" --carryover true "$@"
  train "$OUT_DIR-control" "${continuation[@]}" "$@"
fi
