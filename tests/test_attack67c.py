"""attack67c: what a run reports (TensorBoard scalars, ``lightning-mpx doctor``/``plot``) attacked from the user's
side, against the run's own facts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("tensorboard")
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.loggers import TensorBoardLogger as FabricTensorBoardLogger  # noqa: E402

from lightning_mpx import FabricMixedPrecisionPlugin  # noqa: E402
from lightning_mpx.cli import main  # noqa: E402
from lightning_mpx.health.plot import read_scalars  # noqa: E402


# -- the doctor on a folder whose run started again from step 0 -------------------------------------------------------
def _fabric_run(root: Path, version: int, steps: int, overflow: bool) -> list[float]:
    """A Fabric loop logging ``mpx.metrics()`` at its own step count from 0 (docs/fabric.md's loop) into
    ``root/run/version_<version>``; with ``overflow`` every loss is inf (the scale falls to its floor, every step is
    skipped). Returns the skipped-step counts it logged (the run's facts)."""
    mpx = FabricMixedPrecisionPlugin("O1", half_dtype="float16", init_scale=4.0, on_floor="continue")
    logger = FabricTensorBoardLogger(str(root), name="run", version=version)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx], loggers=[logger])
    torch.manual_seed(0)
    model = fabric.setup_module(nn.Linear(4, 2))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.01))
    skipped = []
    for step in range(steps):
        loss = model(torch.randn(2, 4)).square().mean()
        fabric.backward(loss * (float("inf") if overflow else 1.0))
        optimizer.step()
        optimizer.zero_grad()
        metrics = mpx.metrics()
        skipped.append(metrics["mpx/skipped_steps"])
        fabric.log_dict({"loss": loss.item(), **metrics}, step=step)
    logger.finalize("success")
    return skipped


@pytest.mark.parametrize("again", ["same_folder", "next_version"])
def test_a_run_started_again_from_step_zero_is_judged_on_its_own_points(tmp_path, capsys, again):
    # The first run collapses (14 steps, all skipped); the user fixes it and runs again from step 0 for 6 healthy
    # steps, into the same folder (a fixed version) or TensorBoardLogger's next version. Read by step alone, the
    # second run's steps 0-5 were spliced onto the first run's 6-13: "persistent overflow", exit 1, about a run that
    # is no more.
    _fabric_run(tmp_path, 0, 14, overflow=True)
    facts = _fabric_run(tmp_path, 0 if again == "same_folder" else 1, 6, overflow=False)
    run_dir = tmp_path / "run" / ("version_0" if again == "same_folder" else "")
    assert main(["doctor", str(run_dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["healthy"] and report["steps"] == [0, 5]
    assert any("went back from 13 to 0" in note for note in report["notes"])
    scalars = read_scalars(run_dir)  # what the plot draws: the latest run's curve
    assert [v for _, v in scalars["mpx/skipped_steps"]] == facts == [0.0] * 6
    assert [s for s, _ in scalars["mpx/loss_scale"]] == list(range(6))


# -- DDP: rank 1 overflows alone, a logger on rank 0 only --------------------------------------------------------------
@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    from tests.launch import rank_results, run_script

    out = tmp_path_factory.mktemp("attack67c_ddp")
    run_script("attack67c_script.py", out, timeout=150)
    return rank_results(out)


def _grad_scaler_scales(overflow_steps: set[int], steps: int) -> list[float]:
    """``torch.amp.GradScaler``'s scale after each step's update (its defaults), gradients inf at ``overflow_steps``."""
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scaler = torch.amp.GradScaler("cpu")
    scales = []
    for step in range(steps):
        scaler.scale(param.sum()).backward()
        if step in overflow_steps:
            param.grad[0] = float("inf")
        scaler.step(optimizer)
        optimizer.zero_grad()
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def test_ddp_rank_one_overflow_logged_by_a_rank_zero_only_logger_is_the_truth(ddp):
    # Facts: both ranks skipped step 1 (rank 1's NaN batch) and step 3 (rank 1's gradient explosion), the same on both
    # ranks; the fused AdamW took 5 - 2 steps on each (its own step count).
    rank0, rank1 = ddp[0]["device"], ddp[1]["device"]
    assert rank0["skipped_steps"] == rank1["skipped_steps"] == [2]
    assert rank0["optimizer_steps"] == rank1["optimizer_steps"] == [3]
    assert rank0["weights_equal_finite"] and rank1["weights_equal_finite"]
    assert rank1["logged"] == []  # rank 1 has no logger: nothing asked of it, and no rank hung
    logged = dict((step, metrics) for step, metrics in rank0["logged"])
    assert sorted(logged) == list(range(5))  # one point per step, none twice
    assert [logged[s]["mpx/loss_scale"] for s in range(5)] == _grad_scaler_scales({1, 3}, 5)
    assert [logged[s]["mpx/overflows"] for s in range(5)] == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert [logged[s]["mpx/skipped_steps"] for s in range(5)] == [0.0, 1.0, 1.0, 2.0, 2.0]
    # The layer is rank 1's, told on rank 0: its forward's first non-finite module at step 1, the module whose
    # gradients alone overflowed at step 3.
    assert logged[1]["mpx/overflow_first/net.inp"] == 1.0
    assert logged[3]["mpx/overflow/net.explode"] == 1.0
    assert [logged[3][f"mpx/overflow/net.{m}"] for m in ("inp", "blow", "out")] == [0.0, 0.0, 0.0]
