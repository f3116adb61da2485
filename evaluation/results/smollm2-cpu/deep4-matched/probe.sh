#!/usr/bin/env bash
# Matched capacity probe on CPU: dflash-gpu-cont3 continued for 2 epochs (256 steps, batch 8) on data-cpu's first
# shard (1,024 responses cont3 never saw), once with its 2 layers and once grown to 4 (new layers start as no-ops):
# same data order, schedule and seed. Then teacher-forced slot accuracy on an unseen shard and HumanEval responses,
# and the first 40 HumanEval prompts decoded beside plain greedy. Every stage resumes; outputs go to runs/b15.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
common=(SETS=data-cpu SHARDS=1 STEPS=256 SEED=0 THREADS=2)
env "${common[@]}" OUT_DIR=runs/b15/ctrl2 bash trainer/configs/smollm2_continue.sh
env "${common[@]}" OUT_DIR=runs/b15/deep4 bash trainer/configs/smollm2_continue.sh --num_draft_layers 4
S=hub/embedded/smollm2-135m-instruct R=evaluation/results/smollm2-cpu/slot-accuracy
python evaluation/slot_accuracy.py --drafters cont3=$S/dflash-gpu-cont3 ctrl2=runs/b15/ctrl2 deep4=runs/b15/deep4 \
  --sets unseen-cpu5=$S/data-cpu/shard-00005.parquet humaneval=$R/humaneval-responses --rows 160 --threads 2 \
  --output_dir runs/b15/slot-accuracy
python evaluation/run.py --drafters deep4=runs/b15/deep4 ctrl2=runs/b15/ctrl2 cont3=$S/dflash-gpu-cont3 \
  --gains deep4=ctrl2 ctrl2=cont3 --benchmark embedded --subsets humaneval --limit 40 --temperatures 0 \
  --max_new_tokens 128 --num_assistant_tokens 7 --linear_backend onednn --dtype float32 --threads 2 --resume true \
  --output_dir runs/b15/he40
