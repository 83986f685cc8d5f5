#!/bin/bash
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
for mode in ${MODES:-manual auto}; do for skip in 0 1; do
  echo "== MODE=$mode SKIP=$skip"
  MODE=$mode SKIP=$skip timeout 150 python attacks2/d_trainer_ddp_log.py 2>&1 | grep -E "^\[rank|Error|Traceback" | head -6
  echo "rc=${PIPESTATUS[0]}"
done; done
