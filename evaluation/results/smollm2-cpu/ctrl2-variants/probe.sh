#!/usr/bin/env bash
# One training setting changed against the matched probe's 2-layer control (deep4-matched/probe.sh's ctrl2:
# dflash-gpu-cont3 continued 256 steps, batch 8, seed 0, lr 3e-4, on data-cpu's first shard), on the same batches:
#   bash evaluation/results/smollm2-cpu/ctrl2-variants/probe.sh NAME FLAG...   e.g. gamma2 --loss_gamma 2
# trains runs/b16/NAME with the trainer/run.py flags given, then measures slot accuracy on HumanEval responses and an
# unseen data-cpu shard and decodes the first 40 HumanEval prompts beside plain greedy, each beside the control.
# Every stage resumes; the control is trained first if runs/b15/ctrl2 is missing (it is shared with deep4-matched).
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 NAME FLAG..." >&2; exit 2; }
name=$1; shift
cd "$(dirname "$0")/../../../.."
common=(SETS=data-cpu SHARDS=1 STEPS=256 SEED=0 THREADS=2)
env "${common[@]}" OUT_DIR=runs/b15/ctrl2 bash trainer/configs/smollm2_continue.sh
env "${common[@]}" OUT_DIR="runs/b16/$name" bash trainer/configs/smollm2_continue.sh "$@"
S=hub/embedded/smollm2-135m-instruct R=evaluation/results/smollm2-cpu/slot-accuracy
python evaluation/slot_accuracy.py --drafters ctrl2=runs/b15/ctrl2 "$name=runs/b16/$name" \
  --sets humaneval=$R/humaneval-responses unseen-cpu6=$S/data-cpu/shard-00005.parquet --rows 160 --threads 2 \
  --output_dir "runs/b16/$name-slot-accuracy"
python evaluation/run.py --drafters "$name=runs/b16/$name" ctrl2=runs/b15/ctrl2 --gains "$name=ctrl2" \
  --benchmark embedded --subsets humaneval --limit 40 --temperatures 0 --max_new_tokens 128 --num_assistant_tokens 7 \
  --linear_backend onednn --dtype float32 --threads 2 --resume true --output_dir "runs/b16/$name-humaneval40-k7"
