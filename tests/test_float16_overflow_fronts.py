"""A float16 overflow forced on one step (the loss times 1e6), on every front door at O1 and O2, against the
reference each front's user compares with: skipped step, scale back-off, schedule held, weights.

The reference is torch's own recipe: ``torch.autocast("cpu", float16)`` with a ``torch.amp.GradScaler`` (unscale,
clip, step, update), the scheduler stepped only when ``GradScaler`` did not back off; Fabric is also held to its own
``MixedPrecision("16-mixed")`` with a CPU ``GradScaler``, the Trainer to Lightning's ``"16-mixed"`` scale sequence
(which steps the schedule anyway: docs/lightning.md), Apex to the same loop with the schedule stepped on the skip too
(Apex's patched ``optimizer.step`` skips, the user's scheduler steps). A tiny linear model: float16 matmuls are slow
on some CPUs. The model's only casts are the matmuls, so O1's cast table and autocast agree, and so does O2's half
model (its weights are what autocast casts): the weights match the reference exactly.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # Accelerate's process-wide state: none left

STEPS, OVERFLOW_AT, MAX_NORM = 5, 2, 1.0
SCALES = [2.0**16, 2.0**16, 2.0**15, 2.0**15, 2.0**15]  # GradScaler's: the back-off at the overflow
Record = list[tuple[float, float, bool]]  # per step: scale after it, the learning rate after it, weights unchanged


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(STEPS)]


def _loss(out: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
    loss = F.mse_loss(out.float(), y)
    return loss * 1e6 if step == OVERFLOW_AT else loss  # 1e6 x 65536 overflows float16's backward


def _optimizer(params: Any, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.AdamW(params, lr=0.01, fused=True)  # GradScaler hands it the flag: skips on the device


def _schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))


def _weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in module.state_dict().items()}


def _same(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(before[k], after[k]) for k in before)


def _torch_reference(kind: str, *, schedule_on_skip: bool = False) -> tuple[Record, dict[str, torch.Tensor]]:
    model = _model()
    optimizer = _optimizer(model.parameters(), kind)
    schedule, scaler = _schedule(optimizer), torch.amp.GradScaler("cpu")
    record: Record = []
    for step, (x, y) in enumerate(_batches()):
        before = _weights(model)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(model(x), y, step)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        if schedule_on_skip or scaler.get_scale() >= scale:
            schedule.step()
        optimizer.zero_grad()
        record.append((scaler.get_scale(), optimizer.param_groups[0]["lr"], _same(before, _weights(model))))
    return record, _weights(model)


def _core(level: str, kind: str) -> tuple[Record, dict[str, torch.Tensor]]:
    from lightning_mpx import Amp

    amp = Amp(level, half_dtype="float16")
    model = amp.prepare_model(_model())
    optimizer = amp.prepare_optimizer(_optimizer(model.parameters(), kind))
    schedule = _schedule(optimizer)
    record: Record = []
    for step, (x, y) in enumerate(_batches()):
        before = _weights(model)
        with amp.forward_context():
            loss = _loss(amp.cast_outputs(model(amp.cast_inputs(x))), y, step)
        amp.backward(loss)
        amp.clip_grad_norm_(optimizer, MAX_NORM)
        if amp.step(optimizer):
            schedule.step()
        amp.update()
        optimizer.zero_grad()
        scale = float(amp.metrics()["mpx/loss_scale"])
        record.append((scale, optimizer.param_groups[0]["lr"], _same(before, _weights(model))))
    return record, amp.fp32_state_dict(model)


def _fabric(level: str, kind: str) -> tuple[Record, dict[str, torch.Tensor]]:
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.precision import MixedPrecision

    from lightning_mpx import FabricMixedPrecisionPlugin

    mpx = FabricMixedPrecisionPlugin(level, half_dtype="float16") if level != "16-mixed" else None
    plugin = mpx or MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    module = _model()
    optimizer = _optimizer(module.parameters(), kind)
    schedule = _schedule(optimizer)
    model, optimizer = fabric.setup(module, optimizer)
    record: Record = []
    for step, (x, y) in enumerate(_batches()):
        before = _weights(model)
        fabric.backward(_loss(model(x), y, step))
        fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM, error_if_nonfinite=False)
        scale = plugin.scaler.get_scale() if mpx is None else None
        optimizer.step()
        skipped = mpx.step_was_skipped(optimizer) if mpx is not None else plugin.scaler.get_scale() < scale
        if not skipped:
            schedule.step()
        optimizer.zero_grad()
        scale = float(mpx.metrics()["mpx/loss_scale"]) if mpx is not None else plugin.scaler.get_scale()
        record.append((scale, optimizer.param_groups[0]["lr"], _same(before, _weights(model))))
    return record, (mpx.fp32_state_dict(model) if mpx is not None else _weights(model))


def _accelerate(level: str, kind: str) -> tuple[Record, dict[str, torch.Tensor]]:
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

    accelerator = Accelerator(mixed_precision=level, cpu=True,
                              kwargs_handlers=[MixedPrecisionKwargs(half_dtype="float16")])  # fmt: skip
    module = _model()
    optimizer = _optimizer(module.parameters(), kind)
    model, optimizer, schedule = accelerator.prepare(module, optimizer, _schedule(optimizer))
    record: Record = []
    for step, (x, y) in enumerate(_batches()):
        before = _weights(model)
        accelerator.backward(_loss(model(x), y, step))
        accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        schedule.step()  # Accelerate's scheduler holds when the step was skipped
        optimizer.zero_grad()
        assert accelerator.optimizer_step_was_skipped == (step == OVERFLOW_AT)
        scale = float(accelerator.amp.metrics()["mpx/loss_scale"])
        record.append((scale, optimizer.param_groups[0]["lr"], _same(before, _weights(model))))
    return record, accelerator.amp.fp32_state_dict(model)


def _apex(level: str, kind: str) -> tuple[Record, dict[str, torch.Tensor]]:
    from lightning_mpx.apex import amp

    module = _model()
    names = [name for name, _ in module.named_parameters()]
    model, optimizer = amp.initialize(module, _optimizer(module.parameters(), kind), opt_level=level, verbosity=0)
    schedule = _schedule(optimizer)
    record: Record = []
    for step, (x, y) in enumerate(_batches()):
        before = _weights(model)
        with amp.scale_loss(_loss(model(x), y, step), optimizer) as scaled:
            scaled.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), MAX_NORM)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        scale = amp._amp_state.loss_scalers[0].loss_scale()
        record.append((scale, optimizer.param_groups[0]["lr"], _same(before, _weights(model))))
    masters = dict(zip(names, amp.master_params(optimizer)))
    return record, {k: v.detach().float() for k, v in masters.items()}


def _trainer(level: str, kind: str) -> tuple[Record, dict[str, torch.Tensor]]:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_mpx import MixedPrecisionPlugin

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()
            self.record: Record = []

        def training_step(self, batch: Any, step: int) -> torch.Tensor:
            self.before = _weights(self.net)
            return _loss(self.net(batch[0]), batch[1], step)

        def on_train_batch_end(self, *args: Any) -> None:
            precision = self.trainer.strategy.precision_plugin
            scale = precision.scaler.get_scale()  # the plugin's: a read-only view of its loss scaler
            lr = self.trainer.optimizers[0].param_groups[0]["lr"]
            self.record.append((scale, lr, _same(self.before, _weights(self.net))))

        def configure_optimizers(self) -> Any:
            optimizer = _optimizer(self.parameters(), kind)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": _schedule(optimizer), "interval": "step"}}

    plugin: Any = (MixedPrecisionPlugin(level, half_dtype="float16") if level != "16-mixed"
                   else MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")))  # fmt: skip
    module = Module()
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, plugins=[plugin], gradient_clip_val=MAX_NORM, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, torch.utils.data.DataLoader(_batches(), batch_size=None))
    weights = plugin.amp.fp32_state_dict(module.net) if level != "16-mixed" else _weights(module.net)
    return module.record, weights


def _check(record: Record, weights: dict[str, torch.Tensor], reference: tuple[Record, dict[str, torch.Tensor]]) -> None:
    assert [r[0] for r in record] == SCALES  # backed off once, at the overflow, as GradScaler
    assert [r[2] for r in record] == [s == OVERFLOW_AT for s in range(STEPS)]  # only that step left them in place
    assert [r[1] for r in record] == pytest.approx([r[1] for r in reference[0]], rel=1e-12)
    for name, value in reference[1].items():
        # the same kernels here (0.0 apart); room for another CPU, a float16 rounding (~1e-3) still fails
        torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-5, msg=name)


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, bool], tuple[Record, dict[str, torch.Tensor]]]:
    return {(kind, held): _torch_reference(kind, schedule_on_skip=not held) for kind in ("sgd", "fused")
            for held in (True, False)}  # fmt: skip


FRONTS: dict[str, Callable[[str, str], tuple[Record, dict[str, torch.Tensor]]]] = {
    "core": _core, "fabric": _fabric, "accelerate": _accelerate, "apex": _apex,
}  # fmt: skip


@pytest.mark.parametrize("kind", ["sgd", "fused"])
@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("front", list(FRONTS))
def test_forced_overflow_skips_backs_off_and_holds_the_schedule(references, front, level, kind):
    """The overflow step leaves the weights as they were, the scale halves there and only there, the schedule holds
    (Apex: steps, as Apex's patched step does), and the weights are GradScaler's loop's; a fused AdamW too (the flag
    handed to its step, as GradScaler does)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        record, weights = FRONTS[front](level, kind)
    _check(record, weights, references[(kind, front != "apex")])


def test_fabric_16_mixed_is_the_same_reference(references):
    """Fabric's own ``"16-mixed"`` (a CPU GradScaler) is the torch loop: the row above holds the plugin to it too."""
    record, weights = _fabric("16-mixed", "sgd")
    _check(record, weights, references[("sgd", True)])


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_trainer_forced_overflow_scale_of_16_mixed_schedule_held(references, level):
    """The Trainer plugin backs off as Lightning's ``"16-mixed"`` does, leaves the weights of the overflow step in
    place, and holds the per-step schedule there (``"16-mixed"`` steps it anyway): GradScaler's loop's weights."""
    record, weights = _trainer(level, "sgd")
    _check(record, weights, references[("sgd", True)])
    theirs, _ = _trainer("16-mixed", "sgd")
    assert [r[0] for r in theirs] == [r[0] for r in record] and [r[2] for r in theirs] == [r[2] for r in record]
