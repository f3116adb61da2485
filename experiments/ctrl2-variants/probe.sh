#!/usr/bin/env bash
# One training setting changed against the matched probe's 2-layer control, on the same batches.
#
# What it does: the control is experiments/deep4/probe.sh's ctrl2 (dflash-gpu-cont3 continued 256 steps, batch 8,
# seed 0, lr 3e-4, position weights exp(-(k-1)/4), on data-cpu's first shard); it is trained first if runs/b15/ctrl2
# is missing. Then trains runs/b16/NAME from the shipped cont3 with the trainer/run.py flags given, measures
# teacher-forced slot accuracy (160 rows) on the target's HumanEval responses and an unseen data-cpu shard, and
# decodes the first 40 HumanEval prompts beside plain greedy (T=0, 7 drafts a round, 128 new tokens, float32 with
# oneDNN linear layers), each beside the control. Every stage resumes.
#
# Run, from the repository root of a checkout installed with `pip install -e .`:
#   bash experiments/ctrl2-variants/probe.sh NAME FLAG...
#   bash experiments/ctrl2-variants/probe.sh gamma2 --loss_gamma 2
#   bash experiments/ctrl2-variants/probe.sh lr6 --learning_rate 6e-4
#
# Machine and time: the project's 2-core CPU machine, 2 threads, float32: about 22 minutes of training (gamma2 1,306
# s, lr6 1,335 s), 9 for the slot accuracies, 17 to decode (plain decoding ran at 10.0 and 10.7 tokens/s in the two
# committed runs, 2026-12-07).
#
# Result (committed in experiments/ctrl2-variants/ctrl2-variants): HumanEval first 40, T=0, tau against ctrl2's 2.31:
# gamma2 2.31 (+0.1% [-0.5, +0.7]), 1.44x (ctrl2 1.45x); lr6 2.26 (-2.2% [-3.3, -1.2]), 1.42x (ctrl2 1.44x).
# 0 mismatches in 160 outputs. Neither setting helps.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 NAME FLAG..." >&2; exit 2; }
name=$1; shift
cd "$(dirname "$0")/../.."
common=(SETS=data-cpu SHARDS=1 STEPS=256 SEED=0 THREADS=2)
env "${common[@]}" OUT_DIR=runs/b15/ctrl2 bash trainer/configs/smollm2_continue.sh
env "${common[@]}" OUT_DIR="runs/b16/$name" bash trainer/configs/smollm2_continue.sh "$@"
S=hub/embedded/smollm2-135m-instruct R=experiments/data-cpu-continuations/slot-accuracy
python evaluation/slot_accuracy.py --drafters ctrl2=runs/b15/ctrl2 "$name=runs/b16/$name" \
  --sets humaneval=$R/humaneval-responses unseen-cpu6=$S/data-cpu/shard-00005.parquet --rows 160 --threads 2 \
  --output_dir "runs/b16/$name-slot-accuracy"
python evaluation/run.py --drafters "$name=runs/b16/$name" ctrl2=runs/b15/ctrl2 --gains "$name=ctrl2" \
  --benchmark embedded --subsets humaneval --limit 40 --temperatures 0 --max_new_tokens 128 --num_assistant_tokens 7 \
  --linear_backend onednn --dtype float32 --threads 2 --resume true --output_dir "runs/b16/$name-humaneval40-k7"
