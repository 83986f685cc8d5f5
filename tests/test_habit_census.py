"""The habit census's deterministic counts that users rely on (``benchmarks/habit_census.py``, tiny models on CPU).

Counts, not timings: host syncs and non-view aten ops per optimizer step, against the framework's own bfloat16
mixed precision with the same fused AdamW and the same habit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import habit_census  # noqa: E402

pytest.importorskip("lightning")


def _rows(front: str, habit: str, model: str, variants: tuple[str, ...]) -> dict[str, dict]:
    # One warm-up step: every row here counted the same after one as after two (stop 64, the lazy set-up is the
    # first step's), in three quarters of the steps.
    rows = [habit_census.row(front, v, habit, model, depths=(1, 2), warmup=1, steps=2, calls=False)
            for v in variants]  # fmt: skip
    habit_census.compare(rows)
    return {r["variant"]: r for r in rows}


def test_core_o2_loop_adds_no_host_sync_and_no_per_parameter_kernel():
    rows = _rows("loop", "plain", "gpt", ("autocast", "core-O2"))
    o2 = rows["core-O2"]
    assert rows["autocast"]["syncs"] == 0 and o2["extra_syncs"] == 0  # the step skipped on the device, unread
    assert o2["extra_reads"] == 1  # its flag read at the next backward, from a copy queued behind the step
    # O2's master gradients are views of one buffer: nothing per parameter beyond what autocast's step does.
    assert o2["extra_ops_per_param"] <= 0, o2


def test_trainer_o2_with_a_frozen_base_in_the_optimizer_stays_on_the_buffer_path():
    rows = _rows("trainer", "frozen", "resnet", ("bf16-mixed", "O2"))
    assert rows["O2"]["extra_syncs"] == 0
    assert rows["O2"]["extra_ops_per_param"] <= 0, rows["O2"]


@pytest.mark.parametrize("habit", ["clip-norm", "clip-value"])
def test_trainer_o2_clipping_does_no_per_parameter_work(habit):
    """``gradient_clip_val`` at O2: the unscaled FP32 gradients the plugin puts back on the half model for
    Lightning's hooks and clip go in one multi-tensor copy (they were copied one parameter at a time: one kernel per
    parameter tensor, a step of every fine-tuning recipe that clips)."""
    rows = _rows("trainer", habit, "gpt", ("bf16-mixed", "O2"))
    assert rows["O2"]["extra_syncs"] == 0
    assert rows["O2"]["extra_ops_per_param"] <= 0, rows["O2"]


def test_trainer_logging_step_reads_the_plugin_metrics_in_one_transfer():
    """With a logger writing every step, the plugin's ``mpx/*`` metrics cost one host read per logging step (they
    were read one ``float()`` at a time: eleven syncs a step on this ResNet, seventeen on the GPT)."""
    rows = _rows("trainer", "log", "resnet", ("bf16-mixed", "O2"))
    assert rows["bf16-mixed"]["syncs"] > 0  # the logged loss is read by Lightning in both
    # No .item() beyond Lightning's own; two reads: the metrics' one, and the step's flag at the next backward.
    assert rows["O2"]["extra_syncs"] == 0 and rows["O2"]["extra_reads"] == 2, rows["O2"]


def test_checkpoint_reads_the_loss_scaler_in_one_transfer():
    from lightning_mpx import LossScaler

    scaler = LossScaler(init_scale=2.0**10)
    scaler.scale(torch.ones(()))  # the scaler's state now lives on the device
    ops = habit_census._Ops()
    ops.active = True
    with ops, habit_census._Reads(ops):
        state = scaler.state_dict()
    assert ops.syncs == 0 and ops.reads == 1  # one transfer, not four .item() calls
    assert state["scale"] == 2.0**10 and state["growth_tracker"] == 0 and isinstance(state["overflows"], int)


def test_row_refuses_an_unknown_setup():
    with pytest.raises(ValueError, match="habit='clip-norm'"):
        habit_census.row("fabric", "O2", "clip-norm", "gpt")
    with pytest.raises(ValueError, match="tied"):
        habit_census.row("trainer", "O2", "tied", "resnet")



def test_gpu_default_o1_rows_run_on_autocast_alone():
    """The ``-gpu`` rows run O1 as a GPU does with no table given (``CastTable.for_device("cuda")``): on
    ``torch.autocast`` alone, no torch-function mode. The CPU default table's row runs the mode, whose casts of the
    GPT's parameters cost kernels per parameter tensor that autocast's cached casts do not."""
    from lightning_mpx import CastPolicy

    for variant in ("O1-gpu", "core-O1-gpu"):  # every front's -gpu variant hands its engine the same table
        level, settings = habit_census.settings_of(variant)
        assert level == "O1" and settings["half_dtype"] is torch.bfloat16
        policy = CastPolicy(settings["cast_table"], torch.bfloat16, device_type="cpu")
        assert policy.engine_in_use == "autocast:cpu" and policy.python_functions == ()
    rows = _rows("loop", "plain", "gpt", ("autocast", "core-O1", "core-O1-gpu"))
    gpu = rows["core-O1-gpu"]
    assert gpu["extra_syncs"] == 0 and gpu["extra_reads"] == 1  # the step's flag, read at the next backward
    assert gpu["extra_ops_per_param"] <= 0 < rows["core-O1"]["extra_ops_per_param"], (gpu, rows["core-O1"])
