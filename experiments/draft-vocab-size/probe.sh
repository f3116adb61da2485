#!/usr/bin/env bash
# Does the 8,192-token draft vocabulary cost dflash-gpu-cont3 acceptance, and does a larger one pay for its head?
#
# What it does: writes cont3's variants with 16,384 draft tokens and with the full 49,152-token vocabulary
# (experiments/draft-vocab-size/make_variants.py; no retraining: the drafter scores its tokens with rows of the
# target's frozen LM head), measures teacher-forced slot accuracy (160 rows) on the target's HumanEval responses and an
# unseen data-cpu shard, and decodes the first 40 HumanEval prompts beside plain greedy (T=0, 7 drafts a round, 128
# new tokens, float32 with oneDNN linear layers). Outputs go to runs/vocab; the evaluation resumes.
#
# Run, from the repository root of a checkout installed with `pip install -e .`:
#   bash experiments/draft-vocab-size/probe.sh
#
# Machine and time: the project's 2-core CPU machine, 2 threads: about 13 minutes to the slot accuracies and 20 to
# decode (plain decoding ran at 11.4 tokens/s on the day of the committed run, 2026-12-07).
#
# Result (committed in experiments/draft-vocab-size/draft-vocab-size): HumanEval first 40, T=0: tau 2.34 (8,192),
# 2.37 (16,384: +1.3% [+0.4, +2.5]), 2.39 (full: +1.9% [+0.4, +3.7]); drafting 13.6 / 15.5 / 22.3 ms a round, so the
# speedup falls: 1.46x / 1.44x / 1.40x. 0 mismatches in 120 outputs. The 8,192-token map stays.
set -euo pipefail
cd "$(dirname "$0")/../.."
python experiments/draft-vocab-size/make_variants.py runs/vocab
S=hub/embedded/smollm2-135m-instruct R=experiments/data-cpu-continuations/slot-accuracy
drafters=(v8k=$S/dflash-gpu-cont3 v16k=runs/vocab/cont3-v16384 vfull=runs/vocab/cont3-vfull)
python evaluation/slot_accuracy.py --drafters "${drafters[@]}" --sets humaneval=$R/humaneval-responses \
  unseen-cpu6=$S/data-cpu/shard-00005.parquet --rows 160 --threads 2 --output_dir runs/vocab/slot-accuracy
python evaluation/run.py --drafters "${drafters[@]}" --gains v16k=v8k vfull=v8k --benchmark embedded --subsets humaneval \
  --limit 40 --temperatures 0 --max_new_tokens 128 --num_assistant_tokens 7 --linear_backend onednn --dtype float32 \
  --threads 2 --resume true --output_dir runs/vocab/humaneval40-k7
