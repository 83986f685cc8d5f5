#!/usr/bin/env bash
# Issue 41's GPU runs, for a session lent a GPU (15 minutes of device time, at most 10 minutes a command): two calls
# of the device tool, each under 10 minutes, run from the repository root with OUT set (the device tool sets it):
#
#   bash benchmarks/gpu_issue41.sh fsdp     # about 9 minutes: gpu_suite.py fsdp, plain, then with --fsdp-fused
#   bash benchmarks/gpu_issue41.sh resnet   # about 3 minutes: the host-bound ResNet-18 goal rows (goal 2), then
#                                           # at most 3 minutes of the tests with CUDA cases (device_tests below)
#
# Each part writes its folder under $OUT and tars it there as soon as it is done, so that a call cut short keeps what
# finished. Back here: python benchmarks/gpu_report.py <fsdp folder> <resnet folder> --no-doc, and the fused folder
# on its own (fused runs are judged apart); copy the folders to benchmarks/results/gpu/ and commit them.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD"
out="${OUT:?set OUT to the folder that comes back}"
stamp="$(date +%Y-%m-%d)"

part() {  # part NAME ARGUMENTS...: gpu_suite.py ARGUMENTS --out $OUT/NAME, then $OUT/NAME.tgz
    local name="$1"
    shift
    python benchmarks/gpu_suite.py "$@" --out "$out/$name"
    tar -C "$out" -czf "$out/$name.tgz" "$name"
}

device_tests() {  # the test files with CUDA cases, on the device's torch (2.11): $OUT/$stamp-device-tests.{log,xml}
    local name="$stamp-device-tests"
    timeout 180 python -m pytest -q -p no:cacheprovider --junitxml="$out/$name.xml" \
        tests/test_o1_device_table.py tests/test_autocast_engine.py tests/test_hostile_autocast_switch.py \
        tests/test_compile_doors.py tests/test_skip_on_device.py tests/test_unscale_triton.py \
        tests/test_loss_scaler.py tests/test_amp_stages.py tests/test_frozen_params_o2.py >"$out/$name.log" 2>&1
    echo "device tests: exit $? (log: $name.log)"
}

case "${1:-}" in
    fsdp)
        part "$stamp-fsdp" fsdp --budget 270
        part "$stamp-fsdp-fused" fsdp --fsdp-fused --budget 270
        ;;
    resnet)
        part "$stamp-resnet" step --model resnet --budget 200 --variants lightning-16-mixed mpx-O2-fp16 mpx-O1-fp16 lightning-bf16-mixed mpx-O1-bf16
        device_tests
        ;;
    *)
        echo "usage: bash benchmarks/gpu_issue41.sh fsdp|resnet" >&2
        exit 2
        ;;
esac
