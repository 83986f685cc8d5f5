"""What users read in TensorBoard, attacked: real TensorBoard loggers (Trainer, Fabric, Accelerate's
``log_with="tensorboard"``) read back with TensorBoard's own ``EventAccumulator`` (every event, duplicates kept),
against ``torch.amp.GradScaler`` on the same overflow schedule (``tests.test_hostile_telemetry.reference``).

Covered elsewhere and not repeated: the Trainer's float16 curve per step, accumulation with overflows on whole steps,
its resume (``tests/test_hostile_telemetry.py``, ``tests/test_hostile_readers.py``), two losses' curves in a GAN
(``test_two_losses_each_get_their_own_curve_at_the_batch_that_overflowed``), a Trainer DDP run logged by rank 0."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("tensorboard")
pl = pytest.importorskip("lightning.pytorch")
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.loggers import TensorBoardLogger as FabricTensorBoardLogger  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from lightning_mpx import FabricMixedPrecisionPlugin, MixedPrecisionPlugin  # noqa: E402
from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer  # noqa: E402
from tests.test_hostile_telemetry import GROWTH, INIT, reference  # noqa: E402


def events(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar event under ``run`` as TensorBoard reads it, in file order, duplicates kept (no orphan purge:
    a resumed run that logged an x again must show here)."""
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0}, purge_orphaned_data=False)
    acc.Reload()
    # In the order written: the files are read in name order, and a name's last field is a per-process count (9 and
    # 10 sort "10" first when two writers open in one second): by wall time, ties kept in file order.
    return {
        tag: [(e.step, e.value) for e in sorted(acc.Scalars(tag), key=lambda e: e.wall_time)]
        for tag in acc.Tags()["scalars"]
    }


def since(skipped: list[int], at: list[int]) -> list[float]:
    """The overflows each logged point at ``at`` covers (those since the previous point)."""
    bounds = [-1, *at]
    return [float(len([s for s in skipped if lo < s <= hi])) for lo, hi in zip(bounds, bounds[1:])]


# -- Fabric: a real TensorBoardLogger, then a resume from fabric.save --------------------------------------------------
def _fabric_segment(root: Path, ckpt: Path, steps: range, inject: set[int], resume: bool) -> None:
    mpx = FabricMixedPrecisionPlugin("O1", half_dtype="float16", init_scale=INIT, growth_interval=GROWTH)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx],
                    loggers=[FabricTensorBoardLogger(str(root), name="run", version=0)])
    torch.manual_seed(0)
    model = fabric.setup_module(nn.Linear(8, 2))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.01))
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "mpx": mpx}
    if resume:
        fabric.load(str(ckpt), state)
    for step in steps:
        loss = model(torch.randn(4, 8)).square().mean()
        fabric.backward(loss * (float("inf") if step in inject else 1.0))  # the loss itself overflows
        optimizer.step()
        optimizer.zero_grad()
        fabric.log_dict({"loss": loss.item(), **mpx.metrics()}, step=step)  # docs/fabric.md's loop
    fabric.save(str(ckpt), state)
    fabric.logger.finalize("success")


def test_fabric_curve_and_resume_match_grad_scaler_without_duplicate_steps(tmp_path):
    inject = {1, 2, 8}
    _fabric_segment(tmp_path, tmp_path / "a.ckpt", range(0, 5), inject, resume=False)
    _fabric_segment(tmp_path, tmp_path / "a.ckpt", range(5, 11), inject, resume=True)
    scales, skipped = reference(inject, 11)
    logged = events(tmp_path / "run" / "version_0")
    # One point per step, x = the step, none twice: the resumed run continues at 5 with the saved scale.
    for tag in ("mpx/loss_scale", "mpx/overflows", "mpx/skipped_steps"):
        assert [x for x, _ in logged[tag]] == list(range(11)), tag
    assert [v for _, v in logged["mpx/loss_scale"]] == scales
    # Growth after growth_interval=3 good steps (3, 4 saved, 5 resumed) shows at 5: the growth tracker came back too.
    assert scales[4] < scales[5] < INIT
    assert [v for _, v in logged["mpx/overflows"]] == [float(s in skipped) for s in range(11)]
    assert [v for _, v in logged["mpx/skipped_steps"]] == [float(len([k for k in skipped if k <= s]))
                                                            for s in range(11)]


# -- the Trainer: accumulation, an overflow in the middle micro-batch --------------------------------------------------
class MiddleMicroBatchOverflow(Classifier):
    """Accumulating 4 micro-batches per step: the second micro-batch of each of ``steps``' loss is multiplied by inf."""

    def __init__(self, steps: set[int]) -> None:
        super().__init__()
        self.overflow_steps = steps

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("opt_step", float(self.trainer.global_step))
        if self.trainer.global_step in self.overflow_steps and batch_idx % 4 == 1:
            return loss * float("inf")
        return loss


def test_trainer_accumulation_logs_per_optimizer_step_and_a_middle_overflow_is_one_skip(tmp_path):
    steps, every, inject = 9, 2, {2, 5}
    plugin = MixedPrecisionPlugin("O1", half_dtype="float16", init_scale=INIT, growth_interval=GROWTH)
    trainer = make_trainer(plugin, max_steps=steps, accumulate_grad_batches=4, log_every_n_steps=every,
                           logger=TensorBoardLogger(str(tmp_path), name="run", version=0))
    trainer.fit(MiddleMicroBatchOverflow(inject), loader(classification_data(n=16 * 4 * steps)))
    scales, skipped = reference(inject, steps)
    logged = events(tmp_path / "run" / "version_0")
    at = [s for s in range(steps) if (s + 1) % every == 0]  # optimizer steps, not batches
    assert [x for x, _ in logged["mpx/loss_scale"]] == at == [x for x, _ in logged["opt_step"]]
    assert [v for _, v in logged["mpx/loss_scale"]] == [scales[x] for x in at]
    assert [v for _, v in logged["mpx/overflows"]] == since(skipped, at)
    assert logged["mpx/skipped_steps"][-1][1] == len(skipped) == 2  # one skip per overflowing step, not per batch


# -- Accelerate: log_with="tensorboard", gradient accumulation ---------------------------------------------------------
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_accelerate_tensorboard_accumulation_logs_one_point_per_optimizer_step(tmp_path):
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

    steps, inject = 7, {1, 4}
    accelerator = Accelerator(
        mixed_precision="O1", log_with="tensorboard", project_dir=str(tmp_path), gradient_accumulation_steps=4,
        kwargs_handlers=[MixedPrecisionKwargs(half_dtype="float16", init_scale=INIT, growth_interval=GROWTH)],
    )
    accelerator.init_trackers("run")
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    step = 0
    for batch in range(4 * steps):
        with accelerator.accumulate(model):
            loss = model(torch.randn(4, 8)).square().mean()
            if step in inject and batch % 4 == 2:  # the third of the four micro-batches
                loss = loss * float("inf")
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            accelerator.log({"opt_step": float(step)}, step=step)
            step += 1
    accelerator.end_training()
    scales, skipped = reference(inject, steps)
    logged = events(tmp_path / "run")
    assert [x for x, _ in logged["mpx/loss_scale"]] == list(range(steps))
    assert [v for _, v in logged["mpx/loss_scale"]] == scales
    assert [v for _, v in logged["mpx/overflows"]] == [float(s in skipped) for s in range(steps)]
    assert logged["mpx/skipped_steps"][-1][1] == len(skipped) == 2


# -- two optimizers, one loss scale (manual optimization, GAN-style) ---------------------------------------------------
class OneScaleGAN(pl.LightningModule):
    """A GAN step with one loss scale for both optimizers (``num_losses=1``); inf gradients in D's at ``d_inf``."""

    def __init__(self, d_inf: set[int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.g, self.d = nn.Linear(16, 16), nn.Linear(16, 1)
        self.d_inf = d_inf
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        opt_g, opt_d = self.optimizers()
        opt_d.zero_grad()
        self.manual_backward(self.d(x).mean() - self.d(self.g(x).detach()).mean())
        if batch_idx in self.d_inf:
            self.d.weight.grad[0, 0] = float("inf")
        opt_d.step()
        opt_g.zero_grad()
        self.manual_backward(-self.d(self.g(x)).mean())
        opt_g.step()

    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.g.parameters(), lr=0.01), torch.optim.SGD(self.d.parameters(), lr=0.01)]


def _gan_reference(d_inf: set[int], batches: int) -> tuple[list[float], list[int]]:
    """torch's GradScaler shared by two optimizers (its documented multi-optimizer recipe): the scale after each
    iteration's one update, and the batches whose D step it skipped."""
    d, g = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    opt_d, opt_g = torch.optim.SGD([d], lr=1.0), torch.optim.SGD([g], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT, growth_interval=GROWTH)
    scales, skipped = [], []
    for b in range(batches):
        scaler.scale(d.sum()).backward()
        if b in d_inf:
            d.grad[0] = float("inf")
        before = d.detach().clone()
        scaler.step(opt_d)
        skipped += [b] if torch.equal(d.detach(), before) else []
        scaler.scale(g.sum()).backward()
        scaler.step(opt_g)
        opt_d.zero_grad()
        opt_g.zero_grad()
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, skipped


def test_two_optimizers_sharing_one_scale_log_one_curve_per_batch_like_grad_scaler(tmp_path):
    batches, d_inf = 8, {1, 2, 6}
    plugin = MixedPrecisionPlugin("O1", half_dtype="float16", init_scale=INIT, growth_interval=GROWTH)
    trainer = make_trainer(plugin, max_steps=2 * batches, log_every_n_steps=1,
                           logger=TensorBoardLogger(str(tmp_path), name="run", version=0))
    trainer.fit(OneScaleGAN(d_inf), loader(classification_data(n=16 * batches)))
    scales, skipped = _gan_reference(d_inf, batches)
    logged = events(tmp_path / "run" / "version_0")
    # One scale, so one curve (num_losses=2 and loss_id give each its own, tests/test_hostile_telemetry.py), x per
    # batch as Lightning's own self.log (global_step counts both optimizers' steps: 2 per batch).
    assert not [t for t in logged if t.startswith("mpx/loss_scale/")]
    assert logged["mpx/loss_scale"] == list(zip(range(batches), scales))
    assert logged["mpx/overflows"] == [(b, float(b in skipped)) for b in range(batches)]
    assert logged["mpx/skipped_steps"][-1] == (batches - 1, float(len(skipped)))


# -- bfloat16: a static scale of 1.0 -----------------------------------------------------------------------------------
class LossTimesInfAt(Classifier):
    def __init__(self, steps: set[int]) -> None:
        super().__init__()
        self.overflow_steps = steps

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if self.trainer.global_step in self.overflow_steps else loss


def test_bfloat16_logs_a_flat_scale_and_only_real_non_finite_steps(tmp_path):
    steps = 6
    # on_floor="continue": bfloat16's static 1.0 is its floor, where an overflow raises by default.
    plugin = MixedPrecisionPlugin("O1", half_dtype="bfloat16", on_floor="continue")
    trainer = make_trainer(plugin, max_steps=steps, log_every_n_steps=1,
                           logger=TensorBoardLogger(str(tmp_path), name="run", version=0))
    trainer.fit(LossTimesInfAt({3}), loader(classification_data(n=16 * steps)))
    logged = events(tmp_path / "run" / "version_0")
    assert logged["mpx/loss_scale"] == [(s, 1.0) for s in range(steps)]  # flat: no growth, no back-off
    # A loss the data made infinite is a skipped step (its gradients would make the weights NaN); nothing else is.
    assert logged["mpx/overflows"] == [(s, float(s == 3)) for s in range(steps)]
    assert logged["mpx/skipped_steps"][-1] == (steps - 1, 1.0)
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())


class SmallLoss(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * 1e-7  # gradients near 1e-8: normal in bfloat16 and FP32


def test_bfloat16_headroom_of_small_live_gradients_is_not_logged_as_zero(tmp_path):
    plugin = MixedPrecisionPlugin("O1", half_dtype="bfloat16")
    trainer = make_trainer(plugin, max_steps=2, log_every_n_steps=1,
                           logger=TensorBoardLogger(str(tmp_path), name="run", version=0))
    trainer.fit(SmallLoss(), loader(classification_data(n=32)))
    assert all(p.grad is None or p.grad.abs().max() > 0 for p in trainer.lightning_module.parameters())
    logged = events(tmp_path / "run" / "version_0")
    # In doublings below bfloat16's maximum (float32 holds them): gradients are not zero, so their headroom is finite,
    # and far from overflow, so it is large (about 128 + 26 doublings for gradients near 1e-8).
    assert 0 < logged["mpx/headroom_doublings/net.0"][-1][1] < float("inf")
    assert 140 < logged["mpx/headroom_doublings/net.0"][-1][1] < 170


# -- Fabric DDP: one 2-rank gloo launch, an overflow on rank 1 only ----------------------------------------------------
def test_fabric_ddp_rank_one_overflow_is_skipped_on_both_and_logged_once_by_rank_zero(tmp_path):
    from tests.fabric_tensorboard_ddp_script import INJECT, STEPS, fabric_run
    from tests.launch import run_script

    run_script("fabric_tensorboard_ddp_script.py", tmp_path, timeout=120, OMP_NUM_THREADS="1")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["skipped"] == ranks[1]["skipped"] == sorted(INJECT)  # both ranks skip the same steps
    assert ranks[0]["weights"] == ranks[1]["weights"]  # and stay in sync
    assert len(list((tmp_path / "run" / "version_0").glob("events.out.tfevents.*"))) == 1  # rank 0 writes, alone
    ddp = events(tmp_path / "run" / "version_0")
    fabric_run(tmp_path / "single", rank_with_overflow=0)  # one process, the same schedule
    single = events(tmp_path / "single" / "run" / "version_0")
    scales, skipped = reference(INJECT, STEPS)
    for logged in (ddp, single):
        assert [x for x, _ in logged["mpx/loss_scale"]] == list(range(STEPS))
        assert [v for _, v in logged["mpx/loss_scale"]] == scales
        assert [v for _, v in logged["mpx/overflows"]] == [float(s in skipped) for s in range(STEPS)]
    assert {t: len(v) for t, v in ddp.items() if t.startswith("mpx/")} == {
        t: len(v) for t, v in single.items() if t.startswith("mpx/")}
