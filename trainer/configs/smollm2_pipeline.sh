#!/usr/bin/env bash
# The main job on the embedded default target (SmolLM2-135M-Instruct): regenerate data, train a baseline drafter,
# continue it with carryover and (the fair control) without, evaluate, analyse. Every step resumes or is skipped when
# its output exists, so the script can be re-run after an interruption.
#   SCALE=small (default): 48 prompts, an end-to-end run of every stage (about 30 minutes on 2 cores).
#   SCALE=full: 640 prompts, the README's Results (about 3 hours on 2 cores).
#   THREADS=N: torch threads of every step (default 1; see the README on choosing it).
set -euo pipefail
cd "$(dirname "$0")/../.."

case "${SCALE:-small}" in
  small) PROMPTS=48; EPOCHS=1; CONTINUE_EPOCHS=1; LIMIT=2; NEW_TOKENS=32; OUT=runs/smollm2-small ;;
  full) PROMPTS=640; EPOCHS=1; CONTINUE_EPOCHS=0.3; LIMIT=4; NEW_TOKENS=64; OUT=runs/smollm2 ;;
  *) echo "SCALE must be small or full, got '$SCALE'" >&2; exit 2 ;;
esac
THREADS=${THREADS:-1}
DATA=data/smollm2-magpie-$PROMPTS
COMMON=(--dataset "$DATA" --target_dtype bfloat16 --max_seq_length 512 --num_draft_layers 2 --block_size 8 --num_anchors 32
        --per_device_train_batch_size 4 --learning_rate 6e-4 --warmup_steps 0.04 --lr_scheduler_type cosine
        --logging_steps 10 --save_steps 100 --save_total_limit 1 --report_to none --seed 0 --threads "$THREADS")

python -m trainer.regenerate --data_dir "$DATA" --prompts magpie --num_prompts "$PROMPTS" --magpie_max_new_tokens 64 \
  --max_new_tokens 256 --generation_batch_size 32 --shard_size 128 --target_dtype bfloat16 --threads "$THREADS"

train() {  # output_dir, extra args...; resumes from the last checkpoint of an interrupted run
  local out=$1; shift
  [ -f "$out/model.safetensors" ] && return 0
  local resume=()
  ls -d "$out"/checkpoint-* >/dev/null 2>&1 && resume=(--resume_from_checkpoint latest)
  python trainer/run.py "${COMMON[@]}" --output_dir "$out" "${resume[@]}" "$@"
}
train "$OUT/baseline" --num_train_epochs "$EPOCHS"
train "$OUT/carryover" --num_train_epochs "$CONTINUE_EPOCHS" --drafter_checkpoint "$OUT/baseline" --carryover
train "$OUT/control" --num_train_epochs "$CONTINUE_EPOCHS" --drafter_checkpoint "$OUT/baseline"

python evaluation/run.py --drafters baseline="$OUT/baseline" carryover="$OUT/carryover" \
  carryover-off="$OUT/carryover:off" control="$OUT/control" --benchmark embedded --limit "$LIMIT" \
  --temperatures 0 1 --max_new_tokens "$NEW_TOKENS" --output_dir "$OUT/eval" --threads "$THREADS"
for analysis in recall reconvergence attention; do
  python evaluation/analyze.py "$analysis" --drafter "$OUT/carryover" --baseline "$OUT/baseline" --limit "$LIMIT" \
    --max_new_tokens "$NEW_TOKENS" --output_dir "$OUT/analysis" --threads "$THREADS"
done
cat "$OUT/eval/table.md"
echo "results: $OUT/eval/table.md, $OUT/eval/report.json, $OUT/analysis"
