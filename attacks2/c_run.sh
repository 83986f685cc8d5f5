#!/bin/bash
# Runs attack C across habits and skip modes; each under timeout 150.
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
for skip in 0 1; do for habit in none skipped metrics bool; do for over in 2 4; do
  echo "== SKIP=$skip HABIT=$habit OVER=$over (STEPS=5)"
  SKIP=$skip HABIT=$habit OVER=$over timeout 150 python attacks2/c_fabric_ddp_floor.py 2>&1 | grep -E "^\[rank|Error|Timeout" | grep -v Warn | head -6
  echo "rc=${PIPESTATUS[0]}"
done; done; done
