#!/usr/bin/env bash
# Two more layers on dflash-gpu-cont3: the 600-step CPU capacity probe in cont5's data order.
#
# What it does: grows the shipped dflash-gpu-cont3 to 4 draft layers (--num_draft_layers 4: the new layers are copies
# of its last with zero residual outputs, so the grown drafter starts drafting exactly as cont3) and continues it for
# 600 steps in cont5's data order (seed 4; data-gpu's 10 shards, data-cpu's first 5, the mix and the stubs:
# SHARDS="10 5 0 0"), float32, lr 3e-4 with 50 warmup steps and a cosine schedule, through
# trainer/configs/smollm2_continue.sh (every stage resumes). Extra arguments are more trainer/run.py flags.
#
# Run, from the repository root of a checkout installed with `pip install -e .`:
#   bash experiments/deep4/deep4.sh                  # OUT_DIR defaults to runs/b14/deep4
#
# Machine and time: the project's 2-core CPU machine, 2 threads, float32: 5,453 s with a 24-minute pause (about 6.7 s
# a step), after the features of the 20,360 rows (about three hours here, about 34 GB of disk), which
# smollm2_continue.sh extracts first if data/ lacks them.
#
# Result: the training loss minus cont5's on the same batches went from +0.022 (steps 1-100) to -0.050 (steps
# 501-600), but only as the 4-layer run's learning rate decayed faster (cont5 ran a 1,200-step schedule), so it cannot
# tell capacity from annealing. Its 2-layer control was lost with its session's machine; the matched probe
# (experiments/deep4/probe.sh) answers the question. Log: experiments/deep4/deep4-probe/training; cont5's log:
# experiments/data-cpu-continuations/gpu-cont5/training.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR=${OUT_DIR:-runs/b14/deep4} STEPS=600 SEED=4 SHARDS="10 5 0 0" bash trainer/configs/smollm2_continue.sh \
  --num_draft_layers 4 "$@"
