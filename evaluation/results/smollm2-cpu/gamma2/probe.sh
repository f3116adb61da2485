#!/usr/bin/env bash
# Early slots weighted harder: dflash-gpu-cont3 continued as the matched probe's 2-layer control (deep4-matched/probe.sh:
# 256 steps, batch 8, seed 0, on data-cpu's first shard) but with position weights exp(-(k-1)/2) in place of the
# default exp(-(k-1)/4), on the same batches. Then slot accuracy on HumanEval responses and an unseen data-cpu shard,
# and the first 40 HumanEval prompts decoded beside plain greedy, against the control. Every stage resumes; outputs go
# to runs/b15 (the control, shared with deep4-matched/probe.sh) and runs/b16.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
common=(SETS=data-cpu SHARDS=1 STEPS=256 SEED=0 THREADS=2)
env "${common[@]}" OUT_DIR=runs/b15/ctrl2 bash trainer/configs/smollm2_continue.sh
env "${common[@]}" OUT_DIR=runs/b16/gamma2 bash trainer/configs/smollm2_continue.sh --loss_gamma 2
S=hub/embedded/smollm2-135m-instruct R=evaluation/results/smollm2-cpu/slot-accuracy
python evaluation/slot_accuracy.py --drafters ctrl2=runs/b15/ctrl2 gamma2=runs/b16/gamma2 \
  --sets humaneval=$R/humaneval-responses unseen-cpu6=$S/data-cpu/shard-00005.parquet --rows 160 --threads 2 \
  --output_dir runs/b16/slot-accuracy
python evaluation/run.py --drafters gamma2=runs/b16/gamma2 ctrl2=runs/b15/ctrl2 --gains gamma2=ctrl2 \
  --benchmark embedded --subsets humaneval --limit 40 --temperatures 0 --max_new_tokens 128 --num_assistant_tokens 7 \
  --linear_backend onednn --dtype float32 --threads 2 --resume true --output_dir runs/b16/humaneval40-k7
