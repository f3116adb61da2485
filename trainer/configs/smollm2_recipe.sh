#!/usr/bin/env bash
# The full reproduction of the shipped SmolLM2 drafters (hub/embedded/smollm2-135m-instruct): regenerate the data,
# extract the target's features once, train the baseline, continue it with carryover and (the fair control) without
# for the same number of steps, then evaluate. Every stage resumes after an interruption (run the script again) and
# is skipped when its output exists.
#   VARIANT=dflash (default) | markov    the recipe file trainer/configs/smollm2_$VARIANT.yaml
#   THREADS=N                            torch threads of every step (default 2: the machine's 2 cores, idle)
#   CONTINUE_STEPS=N                     steps of the carryover and control continuations (default 120)
set -euo pipefail
cd "$(dirname "$0")/../.."

VARIANT=${VARIANT:-dflash}
THREADS=${THREADS:-2}
CONTINUE_STEPS=${CONTINUE_STEPS:-120}
RECIPE=trainer/configs/smollm2_$VARIANT.yaml
SHIPPED=hub/embedded/smollm2-135m-instruct
DATA=data/smollm2-mix
FEATURES=data/smollm2-mix-features
OUT=runs/smollm2-$VARIANT
[ -f "$RECIPE" ] || { echo "VARIANT must be dflash or markov (no $RECIPE)" >&2; exit 2; }

# 1. Data: the shipped responses if the checkout has them (nobody regenerates them twice), else regenerate.
if [ ! -f "$DATA/regeneration.json" ] && [ -f "$SHIPPED/data/regeneration.json" ]; then
  mkdir -p "$DATA" && cp "$SHIPPED"/data/*.parquet "$SHIPPED"/data/*.json* "$DATA"/
fi
python -m trainer.regenerate --data_dir "$DATA" --prompts python-code magpie --num_prompts 2000 1000 \
  --magpie_max_new_tokens 64 --max_new_tokens 256 --generation_batch_size 128 --shard_size 256 \
  --target_dtype bfloat16 --threads "$THREADS"

# 2. The target's feature layers of every row (and its last layer, which the Markov objectives read), once.
python -m trainer.features --dataset "$DATA" --output_dir "$FEATURES" --target_layer_ids 1 8 15 22 27 \
  --final_hidden true --max_seq_length 512 --batch_size 8 --target_dtype bfloat16 --threads "$THREADS"

train() {  # output_dir, extra flags...; resumes from the last checkpoint of an interrupted run
  local out=$1; shift
  [ -f "$out/model.safetensors" ] && return 0
  local resume=()
  ls -d "$out"/checkpoint-* >/dev/null 2>&1 && resume=(--resume_from_checkpoint latest)
  python trainer/run.py "$RECIPE" --dataset "$DATA" --features "$FEATURES" \
    --output_dir "$out" --threads "$THREADS" "${resume[@]}" "$@"
}
# 3. The baseline. DFlash, in three stages: 3 epochs on the first 1,024 responses (shards 0-3: the first drafter
# shipped), the recipe's 2 epochs on all of them from those weights with a fresh schedule, then 2,400 more steps
# (6.4 epochs) with the learning rate restarted: the shipped baseline. Markov: the 2-epoch DFlash baseline with a
# new Markov head, trained for the recipe file's steps (run VARIANT=dflash first).
if [ "$VARIANT" = dflash ]; then
  # An earlier recipe wrote the 2-epoch baseline to $OUT/baseline: continuing from it would skip stage 3c.
  if [ -f "$OUT/baseline/model.safetensors" ] && [ ! -e "$OUT/baseline-2ep" ]; then
    echo "$OUT/baseline is an earlier recipe's 2-epoch baseline: rename it to $OUT/baseline-2ep (and move its" \
      "carryover and control aside), then run this again" >&2
    exit 2
  fi
  train "$OUT/pilot" --dataset_shards 4 --num_train_epochs 3
  train "$OUT/baseline-2ep" --drafter_checkpoint "$OUT/pilot"
  train "$OUT/baseline" --drafter_checkpoint "$OUT/baseline-2ep" --max_steps 2400 --warmup_steps 50
else
  [ -f runs/smollm2-dflash/baseline-2ep/model.safetensors ] || { echo "Run VARIANT=dflash first: the Markov baseline starts from its 2-epoch baseline" >&2; exit 2; }
  train "$OUT/baseline"
fi
# 4. Its two continuations of equal length: with carryover (the two-pass draft-verify-draft objective) and without
# (the control), from the same weights and the same data order.
continuation=(--drafter_checkpoint "$OUT/baseline" --max_steps "$CONTINUE_STEPS" --warmup_steps 0 --learning_rate 3e-4)
train "$OUT/carryover" "${continuation[@]}" --carryover true
train "$OUT/control" "${continuation[@]}"

# 5. Evaluation: plain greedy against every drafter on the first 40 HumanEval prompts, T=0, 128 new tokens, float32
# with oneDNN linear layers, all 7 drafts verified per round (the main job's setting, README Results); the gain is
# against the control.
python evaluation/run.py --drafters baseline="$OUT/baseline" carryover="$OUT/carryover" control="$OUT/control" \
  --benchmark embedded --subsets humaneval --limit 40 --temperatures 0 --max_new_tokens 128 --num_assistant_tokens 7 \
  --linear_backend onednn --baseline_name control --output_dir "$OUT/eval" --threads "$THREADS"
cat "$OUT/eval/table.md"
