#!/usr/bin/env bash
# Does the 8,192-token draft vocabulary cost dflash-gpu-cont3 acceptance? Its variants with 16,384 tokens and the full
# vocabulary (make_variants.py; no retraining), then teacher-forced slot accuracy on HumanEval responses and an unseen
# data-cpu shard (about 13 minutes at 2 threads), and the first 40 HumanEval prompts decoded beside plain greedy (20
# minutes). Outputs go to runs/vocab; the evaluation resumes.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
python evaluation/results/smollm2-cpu/draft-vocab-size/make_variants.py runs/vocab
S=hub/embedded/smollm2-135m-instruct R=evaluation/results/smollm2-cpu/slot-accuracy
drafters=(v8k=$S/dflash-gpu-cont3 v16k=runs/vocab/cont3-v16384 vfull=runs/vocab/cont3-vfull)
python evaluation/slot_accuracy.py --drafters "${drafters[@]}" --sets humaneval=$R/humaneval-responses \
  unseen-cpu6=$S/data-cpu/shard-00005.parquet --rows 160 --threads 2 --output_dir runs/vocab/slot-accuracy
python evaluation/run.py --drafters "${drafters[@]}" --gains v16k=v8k vfull=v8k --benchmark embedded --subsets humaneval \
  --limit 40 --temperatures 0 --max_new_tokens 128 --num_assistant_tokens 7 --linear_backend onednn --dtype float32 \
  --threads 2 --resume true --output_dir runs/vocab/humaneval40-k7
