#!/usr/bin/env bash
# The positive control for carryover (issue 54): a synthetic target whose rejected draft branches re-converge at a
# rate set by rho, and the whole pipeline on it through the project's CLIs, as a user with their own target runs it:
# build the target (evaluation/synthetic_target.py), regenerate its answers, store its features, train a DFlash
# baseline, continue it with carryover and, for the same steps, without (the control), evaluate at T=0 and T=1 with
# a paired bootstrap interval on the gain per rho subset, measure re-convergence, and summarise.
#   bash experiments/reconvergence-control/sweep.sh   # OUT, THREADS, TARGET_STEPS, BASELINE_STEPS, CONTINUE_STEPS, PROMPTS, RHOS
# Every stage resumes or is skipped when its output exists: run it again after an interruption.
# Machine and time: see experiments/reconvergence-control/README.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/reconvergence-control}
THREADS=${THREADS:-2}
TARGET_STEPS=${TARGET_STEPS:-600}        # the synthetic target's training steps
BASELINE_STEPS=${BASELINE_STEPS:-1500}   # the DFlash baseline
CONTINUE_STEPS=${CONTINUE_STEPS:-300}    # carryover and its control, each
PROMPTS=${PROMPTS:-40}                   # held-out prompts per rho
ANALYZE_PROMPTS=${ANALYZE_PROMPTS:-15}   # of them, re-convergence statistics on the first (replays cost 4 s a prompt)
RHOS=${RHOS:-"0 0.25 0.5 0.75 1"}
LAYERS=${LAYERS:-"1 3"}                  # the target layers the drafter reads (the 4-layer target's second and last)
DRAFT_LAYERS=${DRAFT_LAYERS:-2}
TARGET_FLAGS=${TARGET_FLAGS:-}          # more flags of evaluation/synthetic_target.py (the tiny test's smaller target)
RESULTS=${RESULTS:-experiments/reconvergence-control/results}
T=$OUT/synthetic

# 1. The target, its training prompts and the held-out benchmark (one subset per rho).
[ -f "$T/synthetic.json" ] || python -m evaluation.synthetic_target --output_dir "$T" --rhos $RHOS \
  --train_steps "$TARGET_STEPS" --num_eval_prompts "$PROMPTS" --threads "$THREADS" $TARGET_FLAGS
# 2. Its greedy answers to the training prompts (every rho alike) and its feature layers.
python -m trainer.regenerate --target "$T/target" --data_dir "$OUT/data" --prompts "$T/train_prompts.jsonl" \
  --max_new_tokens 160 --generation_batch_size 128 --shard_size 500 --threads "$THREADS"
python -m trainer.features --target "$T/target" --dataset "$OUT/data" \
  --output_dir "$OUT/features" --target_layer_ids $LAYERS --dtype float32 --max_seq_length 256 --batch_size 32 --threads "$THREADS"
train() {  # output_dir, extra flags...; resumes from the last checkpoint of an interrupted run
  local out=$1; shift
  [ -f "$out/model.safetensors" ] && return 0
  local resume=()
  ls -d "$out"/checkpoint-* >/dev/null 2>&1 && resume=(--resume_from_checkpoint latest)
  python trainer/run.py experiments/reconvergence-control/drafter.yaml --target "$T/target" --dataset "$OUT/data" \
    --features "$OUT/features" --num_draft_layers "$DRAFT_LAYERS" --target_layer_ids $LAYERS --output_dir "$out" \
    --threads "$THREADS" "${resume[@]}" "$@"
}
# 3. The baseline, then its two continuations of equal length from the same weights and data order.
train "$OUT/baseline" --max_steps "$BASELINE_STEPS" --learning_rate 1e-3 --warmup_steps 50 --lr_scheduler_type cosine
continuation=(--drafter_checkpoint "$OUT/baseline" --max_steps "$CONTINUE_STEPS" --warmup_steps 0 --learning_rate 3e-4)
train "$OUT/carryover" "${continuation[@]}" --carryover true
train "$OUT/control" "${continuation[@]}"
# 4. tau per rho at T=0 and T=1 with the gain of carryover against its control (95% paired bootstrap over prompts).
python evaluation/run.py --target "$T/target" --benchmark "$T/benchmark" --drafters baseline="$OUT/baseline" \
  carryover="$OUT/carryover" control="$OUT/control" --gains carryover=control --temperatures 0 1 \
  --max_new_tokens 128 --num_assistant_tokens 7 --warmup 1 --resume true --output_dir "$OUT/eval" --threads "$THREADS"
# 5. Re-convergence R per rejected round (T=0), normalised by the control's tau.
[ -f "$OUT/reconvergence/reconvergence.json" ] || python evaluation/analyze.py reconvergence --target "$T/target" \
  --benchmark "$T/benchmark" --limit "$ANALYZE_PROMPTS" --drafter "$OUT/carryover" --baseline "$OUT/control" --max_new_tokens 128 \
  --output_dir "$OUT/reconvergence" --threads "$THREADS"
# 6. The table and the plot of gain against normalised R, into the experiment's folder.
python experiments/reconvergence-control/summarize.py --run "$OUT" --output_dir "$RESULTS"
