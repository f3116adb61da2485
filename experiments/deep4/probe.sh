#!/usr/bin/env bash
# Matched capacity probe on CPU: does a 4-layer drafter fit better than a 2-layer one on the same batches?
#
# What it does: continues the shipped dflash-gpu-cont3 for 2 epochs (256 steps, batch 8, seed 0, lr 3e-4 with 50
# warmup steps and a cosine schedule) on data-cpu's first shard (1,024 responses cont3 never saw), once with its 2
# layers (ctrl2) and once grown to 4 (deep4; the new layers start as no-ops), with the same data order, schedule and
# seed; then teacher-forced slot accuracy (160 rows) on an unseen data-cpu shard and on the target's HumanEval
# responses, and the first 40 HumanEval prompts decoded beside plain greedy (T=0, 7 drafts a round, 128 new tokens,
# float32 with oneDNN linear layers). Every stage resumes; outputs go to runs/b15.
#
# Run, from the repository root of a checkout installed with `pip install -e .`:
#   bash experiments/deep4/probe.sh
#
# Machine and time: the project's 2-core CPU machine, 2 threads, float32: 67 minutes to the slot accuracies (the
# shard's features 10.4 minutes, ctrl2 986 s at 3.9 s a step, deep4 1,648 s at 6.4 s a step), 22 more to decode.
#
# Result (committed in experiments/deep4/deep4-matched): deep4's training loss stays above ctrl2's for all 256 steps
# (2.205 against 2.199 over steps 201-256); slot 1 on HumanEval responses 65.9% (deep4) / 66.2% (ctrl2) / 66.5%
# (cont3). HumanEval first 40, T=0: tau 2.29 for deep4 (-0.9% [-2.0, +0.1] against ctrl2), 2.31 for ctrl2 (-1.4%
# [-2.8, +0.1] against cont3), 2.34 for cont3; 1.29x / 1.38x / 1.40x plain speed; 0 mismatches in 120 outputs.
set -euo pipefail
cd "$(dirname "$0")/../.."
common=(SETS=data-cpu SHARDS=1 STEPS=256 SEED=0 THREADS=2)
env "${common[@]}" OUT_DIR=runs/b15/ctrl2 bash trainer/configs/smollm2_continue.sh
env "${common[@]}" OUT_DIR=runs/b15/deep4 bash trainer/configs/smollm2_continue.sh --num_draft_layers 4
S=hub/embedded/smollm2-135m-instruct R=experiments/data-cpu-continuations/slot-accuracy
python evaluation/slot_accuracy.py --drafters cont3=$S/dflash-gpu-cont3 ctrl2=runs/b15/ctrl2 deep4=runs/b15/deep4 \
  --sets unseen-cpu5=$S/data-cpu/shard-00005.parquet humaneval=$R/humaneval-responses --rows 160 --threads 2 \
  --output_dir runs/b15/slot-accuracy
python evaluation/run.py --drafters deep4=runs/b15/deep4 ctrl2=runs/b15/ctrl2 cont3=$S/dflash-gpu-cont3 \
  --gains deep4=ctrl2 ctrl2=cont3 --benchmark embedded --subsets humaneval --limit 40 --temperatures 0 \
  --max_new_tokens 128 --num_assistant_tokens 7 --linear_backend onednn --dtype float32 --threads 2 --resume true \
  --output_dir runs/b15/he40
