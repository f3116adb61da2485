#!/usr/bin/env bash
# Continue a SmolLM2 drafter on this CPU on every response set that ships in hub/embedded/smollm2-135m-instruct, from
# the target's features extracted once per set: how dflash-gpu-cont .. -cont4 were trained (README, Results), as one
# command. Every stage resumes (run it again): the regeneration keeps its finished shards, the features their
# finished shards (a grown set grows its features), training its last checkpoint.
#   FROM=path      the drafter to continue (default: the shipped dflash-gpu-cont3)
#   STEPS=N        training steps (default 1800; batch 8, so about one epoch of 15,000 rows)
#   SEED=N         the data order (default 0; each epoch so far took a new one)
#   CPU_SHARDS=N   first grow data-cpu to N shards of 1,024 responses (default 0: train on what ships; about 25 min
#                  a shard here, float32, 2 threads)
#   SETS, SHARDS   the response sets (folders of the shipped one) and the shards used of each (0: all); default
#                  "data-gpu data-cpu data data-stub" and "10 0 0 0" (data-gpu ships the 10 finished shards of the
#                  25 its manifest plans; a partial set is refused unless its count is named)
#   THREADS=N      torch threads of every step (default 2)
#   OUT_DIR        the drafter (default runs/smollm2-dflash/continue)
# Arguments are more trainer/run.py flags.
set -euo pipefail
cd "$(dirname "$0")/../.."

SHIPPED=hub/embedded/smollm2-135m-instruct
FROM=${FROM:-$SHIPPED/dflash-gpu-cont3}
STEPS=${STEPS:-1800}
SEED=${SEED:-0}
CPU_SHARDS=${CPU_SHARDS:-0}
read -ra sets <<< "${SETS:-data-gpu data-cpu data data-stub}"
read -ra shards <<< "${SHARDS:-10 0 0 0}"
THREADS=${THREADS:-2}
OUT_DIR=${OUT_DIR:-runs/smollm2-dflash/continue}
[ "${#sets[@]}" -eq "${#shards[@]}" ] || { echo "SETS names ${#sets[@]} sets, SHARDS ${#shards[@]} counts" >&2; exit 2; }

# bf16 where this CPU computes it natively, float32 where it is emulated (as in smollm2_recipe.sh). The features of
# one training run must all come from one target dtype: a folder made with the other is refused, not mixed.
if python -c "import sys; from carryover_common.targets import cpu_bf16_is_emulated; sys.exit(cpu_bf16_is_emulated())"; then
  DTYPE=bfloat16 BF16=true
else
  DTYPE=float32 BF16=false
fi

# 1. The response sets, copied out of the checkout (so the regeneration below never writes into it): the shipped
# files the copy lacks, and the shipped manifest where it records more prompts (a set grown in a later commit).
num_prompts() { python -c "import json, sys; print(json.load(open(sys.argv[1]))['num_prompts'])" "$1/regeneration.json"; }
for set in "${sets[@]}"; do
  shipped=$SHIPPED/$set copy=data/smollm2-$set
  [ -f "$shipped/regeneration.json" ] || { echo "$shipped holds no regenerated responses" >&2; exit 2; }
  mkdir -p "$copy" && find "$shipped" -maxdepth 1 -type f ! -name regeneration.json -exec cp -n {} "$copy"/ \;
  if [ ! -f "$copy/regeneration.json" ] || [ "$(num_prompts "$shipped")" -gt "$(num_prompts "$copy")" ]; then
    cp "$shipped/regeneration.json" "$copy"/
  fi
done
# data-cpu: the GPU prompt set's prompts after data-gpu's 10 shards (data-cpu/prompts.jsonl.gz), regenerated greedily
# here in float32 (this CPU's fast dtype), 1,024 a shard; CPU_SHARDS grows it (and the copy only, not the checkout).
if [ "$CPU_SHARDS" -gt 0 ]; then
  python -m trainer.regenerate --target smollm2 --data_dir data/smollm2-data-cpu \
    --prompts "$SHIPPED/data-cpu/prompts.jsonl.gz" --num_prompts $((CPU_SHARDS * 1024)) --max_new_tokens 256 \
    --generation_batch_size 128 --shard_size 1024 --target_dtype float32 --threads "$THREADS"
fi

# 2. The target's feature layers of every row, one folder per set (dflash-gpu's layers).
features=()
for i in "${!sets[@]}"; do
  out=data/smollm2-${sets[$i]}-features-$DTYPE
  python -m trainer.features --dataset "data/smollm2-${sets[$i]}" --dataset_shards "${shards[$i]}" --output_dir "$out" \
    --target_layer_ids 1 8 15 22 27 --max_seq_length 512 --batch_size 8 --target_dtype "$DTYPE" --threads "$THREADS"
  features+=("$out")
done

# 3. The drafter, continued with the CPU recipe's settings (batch 8, 64 anchors a row) and the continuations'
# schedule: lr 3e-4 restarted, 50 warmup steps, cosine.
[ -f "$OUT_DIR/model.safetensors" ] && { echo "$OUT_DIR is trained"; exit 0; }
resume=()
ls -d "$OUT_DIR"/checkpoint-* >/dev/null 2>&1 && resume=(--resume_from_checkpoint latest)
python trainer/run.py trainer/configs/smollm2_dflash.yaml --dataset "${sets[@]/#/data/smollm2-}" \
  --dataset_shards "${shards[@]}" --features "${features[@]}" --drafter_checkpoint "$FROM" --max_steps "$STEPS" \
  --warmup_steps 50 --learning_rate 3e-4 --seed "$SEED" --output_dir "$OUT_DIR" --threads "$THREADS" \
  --target_dtype "$DTYPE" --bf16 "$BF16" "${resume[@]}" "$@"
echo "trained: $OUT_DIR ($SECONDS s)"
