#!/usr/bin/env bash
# A probe after the sweep (not part of it): carryover and its equally long control continued from the sweep's
# baseline with another length or learning rate, evaluated at T=0 on the two ends of the sweep (rho 0 and 1).
#   STEPS=300 LR=1e-3 bash experiments/reconvergence-control/probe.sh     # after sweep.sh, with the same OUT
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/reconvergence-control}
THREADS=${THREADS:-2}
STEPS=${STEPS:-300}
LR=${LR:-1e-3}
NAME=steps$STEPS-lr$LR
T=$OUT/synthetic
for variant in carryover control; do
  out=$OUT/probe-$NAME/$variant
  [ -f "$out/model.safetensors" ] && continue
  flags=()
  [ "$variant" = carryover ] && flags=(--carryover true)
  python trainer/run.py experiments/reconvergence-control/drafter.yaml --target "$T/target" --dataset "$OUT/data" \
    --features "$OUT/features" --drafter_checkpoint "$OUT/baseline" --max_steps "$STEPS" --warmup_steps 0 \
    --learning_rate "$LR" --output_dir "$out" --threads "$THREADS" "${flags[@]}"
done
python evaluation/run.py --target "$T/target" --benchmark "$T/benchmark" --subsets rho_0.00 rho_1.00 \
  --drafters carryover="$OUT/probe-$NAME/carryover" control="$OUT/probe-$NAME/control" --gains carryover=control \
  --temperatures 0 --max_new_tokens 128 --num_assistant_tokens 7 --resume true --output_dir "$OUT/probe-$NAME/eval" \
  --threads "$THREADS"
