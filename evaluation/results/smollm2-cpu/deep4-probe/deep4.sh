#!/usr/bin/env bash
# The 600-step CPU capacity probe: dflash-gpu-cont3 grown to 4 layers (new layers start as no-ops) and continued in
# cont5's data order (seed 4; data-gpu's 10 shards, data-cpu's first 5, the mix and the stubs). Its 2-layer control,
# slot accuracies and decode were lost with their session's machine; deep4-matched holds the matched probe.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
OUT_DIR=${OUT_DIR:-runs/b14/deep4} STEPS=600 SEED=4 SHARDS="10 5 0 0" bash trainer/configs/smollm2_continue.sh \
  --num_draft_layers 4 "$@"
