#!/usr/bin/env bash
# After the probe: teacher-forced slot accuracy (unseen data-cpu shard 6, the target's HumanEval responses), then
# HumanEval decoding (164 prompts, T=0, 7 drafts a round) of deep4 beside plain decoding.
set -euo pipefail
cd /work/main && . .venv/bin/activate
until grep -q probe-done runs/b14/probe.log; do sleep 30; done
S=hub/embedded/smollm2-135m-instruct R=evaluation/results/smollm2-cpu/slot-accuracy
python evaluation/slot_accuracy.py --drafters cont3=$S/dflash-gpu-cont3 cont5=runs/b11/cont5 cont6=runs/b12/cont6 \
  ctrl2=runs/b14/ctrl2 deep4=runs/b14/deep4 \
  --sets unseen-cpu5=$S/data-cpu/shard-00005.parquet humaneval=$R/humaneval-responses --rows 160 --threads 2 \
  --output_dir runs/b14/slot-accuracy
echo slot-done
python evaluation/run.py --drafters deep4=runs/b14/deep4 --temperatures 0 --max_new_tokens 128 \
  --num_assistant_tokens 7 --dtype float32 --linear_backend onednn --threads 2 --resume true \
  --benchmark embedded --subsets humaneval --limit 164 --output_dir runs/b14/he164
echo after-done
