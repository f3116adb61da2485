#!/usr/bin/env bash
# The paper's experiment on the embedded target: each shipped carryover drafter against its equally long control
# (DFlash and Markov variants), every round verifying all 7 drafts of the block (the setting where a rejected round
# carries rows), float32 (lossless on this CPU) with oneDNN linear layers (faster here), T=0 and T=1, 128 new tokens.
# Two runs side by side, one torch thread each: the embedded benchmarks (HumanEval 164, MT-Bench 80) and the held-out prompts (40 python-code, 40 Magpie).
# Resumable and extendable: every prompt's results are kept in <run>/records.jsonl.gz, so running it again (after an
# interruption, or with a larger LIMIT) decodes only the prompts not done yet.
#   LIMIT=N   prompts per subset (the first N); unset = all of them (about 9 hours for the embedded run and 3 for
#             the held-out one, side by side, 68 s a prompt and temperature, as measured with torch's default linear
#             layers; oneDNN's make plain decoding about 1.5x faster here, not timed at this size)
#   OUT=dir   output folder (default evaluation/results/smollm2-cpu/paper-long: the shipped pairs; paper-full holds
#             the records of the pairs shipped at cfd82ae, which a resumed run refuses to mix with these)
set -euo pipefail
cd "$(dirname "$0")/../.."

S=hub/embedded/smollm2-135m-instruct
OUT=${OUT:-evaluation/results/smollm2-cpu/paper-long}
args=(
  --drafters dflash-carryover=$S/dflash-carryover dflash-control=$S/dflash-control
             markov-carryover=$S/markov-carryover markov-control=$S/markov-control
  --gains dflash-carryover=dflash-control markov-carryover=markov-control
  --temperatures 0 1 --max_new_tokens 128 --dtype float32 --linear_backend onednn --threads 1 --resume true
)
[ -n "${LIMIT:-}" ] && args+=(--limit "$LIMIT")
mkdir -p logs
python evaluation/run.py "${args[@]}" --benchmark embedded --output_dir "$OUT/embedded" > logs/paper-embedded.log 2>&1 &
embedded=$!
python evaluation/run.py "${args[@]}" --benchmark evaluation/benchmarks/smollm2-heldout --output_dir "$OUT/heldout" \
  > logs/paper-heldout.log 2>&1 &
heldout=$!
status=0
wait $embedded || { status=$?; echo "the embedded run failed: logs/paper-embedded.log" >&2; }
wait $heldout || { status=$?; echo "the held-out run failed: logs/paper-heldout.log" >&2; }
[ $status -eq 0 ] && cat "$OUT/embedded/table.md" "$OUT/heldout/table.md"
exit $status
