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
STUBS=data/smollm2-stub                      # HumanEval-form stubs of the same coding functions (from stage 3d)
MIXSTUB_FEATURES=data/smollm2-mixstub-features
OUT=runs/smollm2-$VARIANT
[ -f "$RECIPE" ] || { echo "VARIANT must be dflash or markov (no $RECIPE)" >&2; exit 2; }

# bf16 where this CPU computes it natively (AVX-512, AMX: there bf16 autocast is 1.6x the float32 step), float32
# where it is emulated (AVX2 only, e.g. AMD EPYC Milan: the target's bf16 forward 7x slower than float32). The
# regeneration stays bf16 whatever the CPU: its dtype is part of the data (and of the shipped shards' manifest).
if python -c "import sys; from carryover_common.targets import cpu_bf16_is_emulated; sys.exit(cpu_bf16_is_emulated())"; then
  DTYPE=bfloat16 BF16=true
else
  DTYPE=float32 BF16=false
fi

# 1. Data: the shipped responses if the checkout has them (nobody regenerates them twice), else regenerate.
shipped_data() {  # folder in the checkout, data folder
  if [ ! -f "$2/regeneration.json" ] && [ -f "$1/regeneration.json" ]; then
    mkdir -p "$2" && cp "$1"/*.parquet "$1"/*.json* "$2"/
  fi
}
shipped_data "$SHIPPED/data" "$DATA"
python -m trainer.regenerate --data_dir "$DATA" --prompts python-code magpie --num_prompts 2000 1000 \
  --magpie_max_new_tokens 64 --max_new_tokens 256 --generation_batch_size 128 --shard_size 256 \
  --target_dtype bfloat16 --threads "$THREADS"
# The 2,000 coding functions of the mix again, as stubs to complete.
shipped_data "$SHIPPED/data-stub" "$STUBS"
python -m trainer.regenerate --data_dir "$STUBS" --prompts python-stub --num_prompts 2000 --max_new_tokens 256 \
  --generation_batch_size 128 --shard_size 256 --target_dtype bfloat16 --threads "$THREADS"

# 2. The target's feature layers of every row (and its last layer, which the Markov objectives read), once.
features() {  # output_dir, dataset folders...
  local out=$1; shift
  python -m trainer.features --dataset "$@" --output_dir "$out" --target_layer_ids 1 8 15 22 27 \
    --final_hidden true --max_seq_length 512 --batch_size 8 --target_dtype "$DTYPE" --threads "$THREADS"
}
[ "$VARIANT" = dflash ] && features "$FEATURES" "$DATA"  # the DFlash stages before 3d read the mix alone
features "$MIXSTUB_FEATURES" "$DATA" "$STUBS"

train() {  # output_dir, extra flags...; resumes from the last checkpoint of an interrupted run
  local out=$1; shift
  [ -f "$out/model.safetensors" ] && return 0
  local resume=()
  ls -d "$out"/checkpoint-* >/dev/null 2>&1 && resume=(--resume_from_checkpoint latest)
  python trainer/run.py "$RECIPE" --output_dir "$out" --threads "$THREADS" --target_dtype "$DTYPE" --bf16 "$BF16" \
    "${resume[@]}" "$@"
}
mix=(--dataset "$DATA" --features "$FEATURES")
mixstub=(--dataset "$DATA" "$STUBS" --features "$MIXSTUB_FEATURES")
# 3. The baseline. DFlash, in four stages: 3 epochs on the first 1,024 responses (shards 0-3: the first drafter
# shipped), the recipe's 2 epochs on all of them from those weights with a fresh schedule, 2,400 more steps (6.4
# epochs) with the learning rate restarted, then 1,600 steps on the mix and the stubs together: the shipped
# baseline. Markov: the DFlash baseline with a new Markov head, trained on the mix and the stubs for the recipe
# file's steps (run VARIANT=dflash first).
if [ "$VARIANT" = dflash ]; then
  # Earlier recipes wrote the 2-epoch baseline, then the 2,400-step one, to $OUT/baseline: continuing from either
  # would skip a stage.
  earlier=""
  [ -f "$OUT/baseline/model.safetensors" ] && [ ! -e "$OUT/baseline-2ep" ] && earlier=baseline-2ep
  [ -f "$OUT/baseline/model.safetensors" ] && [ ! -e "$OUT/baseline-long" ] && [ -z "$earlier" ] && earlier=baseline-long
  if [ -n "$earlier" ]; then
    echo "$OUT/baseline is an earlier recipe's baseline: rename it to $OUT/$earlier (and move its carryover and" \
      "control aside), then run this again" >&2
    exit 2
  fi
  train "$OUT/pilot" "${mix[@]}" --dataset_shards 4 --num_train_epochs 3
  train "$OUT/baseline-2ep" "${mix[@]}" --drafter_checkpoint "$OUT/pilot"
  train "$OUT/baseline-long" "${mix[@]}" --drafter_checkpoint "$OUT/baseline-2ep" --max_steps 2400 --warmup_steps 50
  train "$OUT/baseline" "${mixstub[@]}" --drafter_checkpoint "$OUT/baseline-long" --max_steps 1600 --warmup_steps 50 \
    --learning_rate 3e-4
else
  [ -f runs/smollm2-dflash/baseline/model.safetensors ] || { echo "Run VARIANT=dflash first: the Markov baseline starts from its baseline" >&2; exit 2; }
  if [ -f "$OUT/baseline/model.safetensors" ]; then  # earlier recipes started it from the 2-epoch DFlash baseline
    python - "$OUT/baseline" <<'PY' || exit 2
import json, sys
inputs = json.load(open(f"{sys.argv[1]}/carryover_training.json")).get("inputs", {})
if inputs.get("drafter_checkpoint") != "runs/smollm2-dflash/baseline":
    sys.exit(f"{sys.argv[1]} is an earlier recipe's Markov baseline: move it (and its carryover and control) aside, then run this again")
PY
  fi
  train "$OUT/baseline" "${mixstub[@]}"
fi
# 4. Its two continuations of equal length: with carryover (the two-pass draft-verify-draft objective) and without
# (the control), from the same weights and the same data order.
continuation=("${mixstub[@]}" --drafter_checkpoint "$OUT/baseline" --max_steps "$CONTINUE_STEPS" --warmup_steps 0 \
  --learning_rate 3e-4)
train "$OUT/carryover" "${continuation[@]}" --carryover true
train "$OUT/control" "${continuation[@]}"

# 5. Evaluation: plain greedy against every drafter on the first 40 HumanEval prompts, T=0, 128 new tokens, float32
# with oneDNN linear layers, all 7 drafts verified per round (the main job's setting, README Results); the gain is
# against the control.
python evaluation/run.py --drafters baseline="$OUT/baseline" carryover="$OUT/carryover" control="$OUT/control" \
  --benchmark embedded --subsets humaneval --limit 40 --temperatures 0 --max_new_tokens 128 --num_assistant_tokens 7 \
  --linear_backend onednn --baseline_name control --output_dir "$OUT/eval" --threads "$THREADS"
cat "$OUT/eval/table.md"
