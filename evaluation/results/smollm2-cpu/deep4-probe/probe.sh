#!/usr/bin/env bash
# deep4 (grown to 4 layers) then its 2-layer control, 600 steps each, identical data order and schedule.
set -euo pipefail
cd /work/main
runs/b14/deep4.sh --num_draft_layers 4 > runs/b14/deep4.log 2>&1
OUT_DIR=runs/b14/ctrl2 runs/b14/deep4.sh > runs/b14/ctrl2.log 2>&1
echo probe-done
