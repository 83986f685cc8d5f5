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
