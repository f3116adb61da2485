#!/usr/bin/env bash
# CPU capacity probe: cont5-like continuation (cont3 + STEPS steps, seed 4, data-gpu 10 + data-cpu 5 shards + data
# + data-stub) with the drafter grown from 2 to 4 layers (new layers start as no-ops).
set -euo pipefail
cd /work/main && . .venv/bin/activate
OUT_DIR=${OUT_DIR:-runs/b14/deep4} STEPS=${STEPS:-600} SEED=4 SHARDS="10 5 0 0" bash trainer/configs/smollm2_continue.sh "$@"
