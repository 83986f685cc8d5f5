"""review69c: a hostile user and reviewer of stop 69's report fixes (the doctor's loss, the underflow tags without a
wrapper's ``module``) and of the Apex layer's ``num_losses=2`` charges, checked against the run's own facts and
``torch.amp.GradScaler``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("tensorboard")
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402

from lightning_mpx import MixedPrecisionPlugin, doctor  # noqa: E402
from lightning_mpx.cli import main  # noqa: E402
from lightning_mpx.health.events import read_run  # noqa: E402


# -- the doctor's loss: an epoch's mean ------------------------------------------------------------------------------
class _EpochLogged(pl.LightningModule):
    """Two linear layers; the batch at each global step in ``bad`` holds an inf (one bad sample, met once an epoch).
    The loss is logged as users do: ``loss`` an epoch's mean only, ``train_loss`` at each step and an epoch's mean."""

    def __init__(self, bad: set[int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.bad = nn.Linear(8, 8), nn.Linear(8, 1), bad

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x = batch[0] * float("inf") if self.trainer.global_step in self.bad else batch[0]
        loss = self.b(torch.relu(self.a(x))).float().square().mean()
        self.log("loss", loss, on_step=False, on_epoch=True)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def _doctor(root: Path, capsys: pytest.CaptureFixture) -> tuple[int, dict, int, str]:
    """The doctor's exit status and report, as JSON and as text."""
    capsys.readouterr()
    status = main(["doctor", str(root), "--json"])
    report = json.loads(capsys.readouterr().out)
    text_status = main(["doctor", str(root)])
    return status, report, text_status, capsys.readouterr().out


def test_a_bad_sample_met_once_an_epoch_is_no_broken_run_when_the_loss_is_logged_as_an_epochs_mean(tmp_path, capsys):
    # 3 epochs of 10 float16 steps; the bad sample at steps 4, 14, 24 is skipped each time (27 updates applied). The
    # epoch means "loss" and "train_loss_epoch" are NaN at every epoch's end. The doctor read "loss" (before
    # "train_loss_step") and said "PROBLEM: non-finite loss ... at every logged step 9-29 ... the steps were not
    # skipped" (exit 1); read alone, the epoch means gave the same verdict.
    plugin = MixedPrecisionPlugin("O1", half_dtype="float16", init_scale=2.0**10, growth_interval=1000)
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=3, logger=TensorBoardLogger(str(tmp_path), name="", version=0),
        log_every_n_steps=1, plugins=[plugin], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    torch.manual_seed(1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(20, 8)), batch_size=2)
    trainer.fit(_EpochLogged({4, 14, 24}), loader)
    series = read_run(tmp_path).series
    assert [s for s, v in series["loss"] if v != v] == [9, 19, 29] == [s for s, v in series["train_loss_epoch"]]
    assert [s for s, v in series["train_loss_step"] if v != v] == [4, 14, 24]
    assert series["mpx/skipped_steps"][-1] == (29, 3.0)
    status, report, text_status, text = _doctor(tmp_path, capsys)
    assert status == text_status == 0 and report["healthy"], text
    assert "3 overflow steps in 30 (10.0%), 3 skipped in all" in report["findings"][0]["evidence"][0]
    assert "diagnosis: healthy" in text
    # the scale grown too high overflows the last two steps, their loss finite (no bad batch): a scale backing off,
    # healthy. Read from the epoch's NaN mean (the last bad sample's), it was a broken forward: persistent overflow.
    grown = dict(series, **{tag: [*series[tag][:-2], (28, 1.0), (29, 1.0)] for tag in ("mpx/overflows",)})
    grown["mpx/loss_scale"] = [*series["mpx/loss_scale"][:-2], (28, 2.0**16), (29, 2.0**15)]
    assert all(v == v for _, v in grown["train_loss_step"][-2:])
    assert doctor.diagnose_scalars(grown).exit_status == 0
    # the epoch means alone (no train_loss_step): each NaN epoch holds its skipped step, healthy too
    alone = {tag: points for tag, points in series.items() if not tag.startswith("train_loss")}
    assert doctor.diagnose_scalars(alone).exit_status == 0
    # ... but an epoch's NaN mean without an overflow in that epoch is still a broken run
    alone["mpx/overflows"] = [(s, v if s < 10 else 0.0) for s, v in alone["mpx/overflows"]]
    (finding,) = [f for f in doctor.diagnose_scalars(alone).findings if f.problem]
    assert finding.kind == "non_finite_loss" and finding.since_step == 9, finding
