"""Second hostile review of stop 57's schedule-free and Lookahead support at O2, through the doors users take: the
Trainer (the schedulefree README's Lightning recipe with accumulation and mid-epoch validation; a ModelCheckpoint
saved mid-epoch resumed by a new Trainer; a Lookahead's own ``add_param_group`` mid-fit), the core and Accelerate
(``accelerator.accumulate``, ``save_state``/``load_state`` into fresh objects mid-run). Each held to ``"bf16-mixed"``
(Trainer), Accelerate's ``"bf16"`` or FP32 on the same code and data. Tiny MLPs, CPU, bfloat16."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

from lightning_mpx import Amp, MixedPrecisionPlugin
from tests.lightning_helpers import classification_data, loader
from tests.test_accelerate_schedule_free import ClosureScheduleFreeSGD, ScheduleFreeSGD
from tests.test_core_schedule_free_wrappers import _Lookahead, _xy

HALF = "bfloat16"
Weights = dict[str, torch.Tensor]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def _floats(state: dict[str, Any]) -> Weights:
    return {k: v.float().clone() for k, v in state.items() if v.is_floating_point()}


def _gap(got: Weights, want: Weights) -> float:
    assert got.keys() == want.keys()
    return max((got[k] - want[k]).abs().max().item() for k in got)


# --- Trainer ---------------------------------------------------------------------------------------------------------


class _LM(pl.LightningModule):
    """The schedulefree README's recipe: ``train()`` at each training epoch's (and, after a mid-epoch validation or a
    checkpoint, batch's) start, ``eval()`` at validation's start, the training epoch's end and in
    ``on_save_checkpoint``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.net, self.kind = _net(), kind
        self.losses: list[float] = []

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        return F.cross_entropy(self.net(batch[0]).float(), batch[1])

    def validation_step(self, batch: Any, index: int) -> None:
        self.losses.append(F.cross_entropy(self.net(batch[0]).float(), batch[1]).item())

    def _mode(self, train: bool) -> None:
        if self.kind == "sf":
            opt = self.optimizers()
            opt.train() if train else opt.eval()

    def on_train_epoch_start(self) -> None:
        self._mode(True)

    def on_train_batch_start(self, batch: Any, index: int) -> None:
        self._mode(True)

    def on_validation_epoch_start(self) -> None:
        if not self.trainer.sanity_checking:
            self._mode(False)

    def on_train_epoch_end(self) -> None:
        self._mode(False)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._mode(False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.kind == "sf":
            return ClosureScheduleFreeSGD(self.parameters(), lr=0.5)
        return _Lookahead(torch.optim.AdamW(self.parameters(), lr=0.02, fused=False))


def _trainer(precision: str, root: str, **kwargs: Any) -> tuple[pl.Trainer, MixedPrecisionPlugin | None]:
    plugin = MixedPrecisionPlugin(precision, half_dtype=HALF) if precision == "O2" else None
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root, num_sanity_val_steps=0,
                         **kwargs, **({"plugins": [plugin]} if plugin else {"precision": precision}))  # fmt: skip
    return trainer, plugin


def _weights(module: _LM, plugin: MixedPrecisionPlugin | None) -> Weights:
    return _floats(plugin.amp.fp32_state_dict(module.net) if plugin else module.net.state_dict())


def _recipe_fit(precision: str, root: str) -> tuple[list[float], Weights]:
    trainer, plugin = _trainer(precision, root, max_epochs=2, accumulate_grad_batches=2, val_check_interval=4,
                               limit_val_batches=2, enable_checkpointing=False)  # fmt: skip
    module = _LM("sf")
    data = loader(classification_data(n=128, features=8), batch_size=16)
    trainer.fit(module, data, data)
    return module.losses, _weights(module, plugin)


def test_trainer_o2_schedule_free_readme_recipe_with_accumulation_and_mid_epoch_validation_as_bf16_mixed(
    tmp_path: Any,
) -> None:
    (losses, weights), (ref_losses, ref) = _recipe_fit("O2", str(tmp_path)), _recipe_fit("bf16-mixed", str(tmp_path))
    assert len(losses) == len(ref_losses) == 8
    assert losses == pytest.approx(ref_losses, abs=1e-3)  # eval() not redone on the masters: 2.3e-2 off
    assert _gap(weights, ref) < 2e-3


class _ResumableLoader(torch.utils.data.DataLoader):
    """A loader Lightning saves the position of (``state_dict``/``load_state_dict``), so that a mid-epoch checkpoint
    resumes at the next batch, as the uninterrupted run goes on."""

    def __init__(self) -> None:
        super().__init__(classification_data(n=64, features=8), batch_size=16)
        self.seen, self.skip = 0, 0

    def __iter__(self) -> Any:
        skip, self.skip, self.seen = self.skip, 0, self.skip
        for index, batch in enumerate(super().__iter__()):
            if index >= skip:
                self.seen += 1
                yield batch

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skip = state["seen"]


def _resume_fit(precision: str, kind: str, root: str) -> tuple[Weights, Weights]:
    """Three epochs of 4 batches, a ModelCheckpoint every 5 steps (mid-epoch 2, a Lookahead between syncs); a new
    Trainer resumes from the first and ends the fit."""
    data = _ResumableLoader()
    every = ModelCheckpoint(dirpath=root, every_n_train_steps=5, save_top_k=-1, filename="{step}")
    trainer, plugin = _trainer(precision, root, max_epochs=3, limit_val_batches=0, callbacks=[every])
    module = _LM(kind)
    trainer.fit(module, data)
    straight = _weights(module, plugin)
    trainer, plugin = _trainer(precision, root, max_epochs=3, limit_val_batches=0, enable_checkpointing=False)
    module = _LM(kind)
    trainer.fit(module, _ResumableLoader(), ckpt_path=f"{root}/step=5.ckpt")
    return straight, _weights(module, plugin)


@pytest.mark.parametrize("kind", ["sf", "lookahead"])
def test_trainer_o2_mid_epoch_checkpoint_resumed_by_a_new_trainer_as_bf16_mixed(kind: str, tmp_path: Any) -> None:
    # Held: the new Trainer goes on as the uninterrupted one, which is bf16-mixed's (a schedule-free move not redone on
    # the masters: 2.7e-2 off). Not asserted: bf16-mixed's own resume, 4.1e-3 off its uninterrupted run with "sf":
    # on_save_checkpoint's eval() runs after Lightning built the checkpoint and moves the parameters its state_dict
    # aliases, so it holds the averaged point beside the optimizer's saved train_mode=True (docs/lightning.md).
    straight, resumed = _resume_fit("O2", kind, str(tmp_path / "o2"))
    ref_straight, _ = _resume_fit("bf16-mixed", kind, str(tmp_path / "ref"))
    assert _gap(straight, ref_straight) < 2e-3
    assert _gap(resumed, straight) < 1e-6


def _added_group_trained(got: Weights, ref: Weights, atol: float) -> None:
    """The head added mid-fit (lr 5e-4: AdamW's steps, 1.5e-3 in all here, are below its bfloat16 spacing) moved as
    the reference's; stepped in bfloat16 without FP32 masters it is 1.8e-3 off."""
    head, start = ["2.weight", "2.bias"], _floats(_net().state_dict())
    assert _gap({k: got[k] for k in head}, {k: start[k] for k in head}) > 1e-3  # it trained
    assert _gap({k: got[k] for k in head}, {k: ref[k] for k in head}) < atol
    assert _gap(got, ref) < 3e-3


class _Unfreeze(Callback):
    """BackboneFinetuning's habit: the head frozen at first, unfrozen at epoch 1 and added with the wrapper's own
    ``add_param_group``."""

    def on_fit_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        module.net[2].requires_grad_(False)

    def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.current_epoch == 1:
            module.net[2].requires_grad_(True)
            trainer.optimizers[0].add_param_group({"params": list(module.net[2].parameters()), "lr": 5e-4})


class _FrozenLM(_LM):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _Lookahead(torch.optim.AdamW(self.net[0].parameters(), lr=0.02, fused=False))


def _unfreeze_fit(precision: str, root: str) -> Weights:
    trainer, plugin = _trainer(precision, root, max_epochs=2, limit_val_batches=0, enable_checkpointing=False,
                               callbacks=[_Unfreeze()])  # fmt: skip
    module = _FrozenLM("lookahead")
    trainer.fit(module, loader(classification_data(n=64, features=8)))
    return _weights(module, plugin)


def test_trainer_o2_lookahead_add_param_group_mid_fit_trains_the_added_group_as_bf16_mixed(tmp_path: Any) -> None:
    got, ref = _unfreeze_fit("O2", str(tmp_path)), _unfreeze_fit("bf16-mixed", str(tmp_path))
    _added_group_trained(got, ref, 5e-4)


# --- core ------------------------------------------------------------------------------------------------------------


def _core_unfreeze(level: str | None) -> Weights:
    amp = Amp(level, half_dtype=HALF) if level else None
    model = _net()
    model[2].requires_grad_(False)
    if amp is not None:
        model = amp.prepare_model(model)
    opt = _Lookahead(torch.optim.AdamW(model[0].parameters(), lr=0.02, fused=False))
    if amp is not None:
        opt = amp.prepare_optimizer(opt)
    x, y = _xy()
    for epoch in range(2):
        if epoch == 1:
            model[2].requires_grad_(True)
            opt.add_param_group({"params": list(model[2].parameters()), "lr": 5e-4})
        for i in range(0, 64, 16):
            if amp is None:
                F.cross_entropy(model(x[i : i + 16]), y[i : i + 16]).backward()
                opt.step()
            else:
                with amp.forward_context():
                    out = amp.cast_outputs(model(amp.cast_inputs(x[i : i + 16])))
                amp.backward(F.cross_entropy(out.float(), y[i : i + 16]))
                amp.step(opt)
                amp.update()
            opt.zero_grad()
    return _floats(amp.fp32_state_dict(model) if amp is not None else model.state_dict())


def test_core_o2_lookahead_add_param_group_mid_fit_trains_the_added_group_as_fp32() -> None:
    _added_group_trained(_core_unfreeze("O2"), _core_unfreeze(None), 1e-3)


# --- Accelerate ------------------------------------------------------------------------------------------------------


def _accelerator(mp: str, **kwargs: Any) -> Any:
    from tests.accelerate_helpers import reset_accelerate_state

    reset_accelerate_state()
    if mp == "O2":
        from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

        return Accelerator(mixed_precision=mp, cpu=True, kwargs_handlers=[MixedPrecisionKwargs(half_dtype=HALF)],
                           **kwargs)  # fmt: skip
    import accelerate

    return accelerate.Accelerator(mixed_precision=mp, cpu=True, **kwargs)


def _accel_unfreeze(mp: str) -> Weights:
    acc = _accelerator(mp)
    model = _net()
    model[2].requires_grad_(False)
    model, opt = acc.prepare(model, _Lookahead(torch.optim.AdamW(model[0].parameters(), lr=0.02, fused=False)))
    x, y = _xy()
    for epoch in range(2):
        if epoch == 1:
            model[2].requires_grad_(True)
            opt.add_param_group({"params": list(model[2].parameters()), "lr": 5e-4})
        for i in range(0, 64, 16):
            acc.backward(F.cross_entropy(model(x[i : i + 16]).float(), y[i : i + 16]))
            opt.step()
            opt.zero_grad()
    return _floats(acc.get_state_dict(model))


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_accelerate_o2_lookahead_add_param_group_mid_fit_trains_the_added_group_as_bf16() -> None:
    pytest.importorskip("accelerate")
    _added_group_trained(_accel_unfreeze("O2"), _accel_unfreeze("bf16"), 1e-3)


def _accel_sf_epoch(acc: Any, model: nn.Module, opt: Any, losses: list[float]) -> None:
    x, y = _xy()
    model.train()
    opt.train()
    for i in range(0, 64, 8):
        with acc.accumulate(model):
            acc.backward(F.cross_entropy(model(x[i : i + 8]).float(), y[i : i + 8]))
            opt.step()
            opt.zero_grad()
    model.eval()
    opt.eval()
    with torch.no_grad():
        losses.append(F.cross_entropy(model(x).float(), y).item())


def _accel_sf(mp: str, root: str) -> tuple[list[float], Weights]:
    """An epoch (accumulating 2), ``eval()``, an evaluation, ``save_state``; fresh objects ``load_state`` it and train
    an epoch more."""
    losses: list[float] = []
    acc = _accelerator(mp, gradient_accumulation_steps=2)
    net = _net()
    model, opt = acc.prepare(net, ScheduleFreeSGD(net.parameters(), lr=0.5))
    _accel_sf_epoch(acc, model, opt, losses)
    acc.save_state(root)
    acc = _accelerator(mp, gradient_accumulation_steps=2)
    net = _net()
    model, opt = acc.prepare(net, ScheduleFreeSGD(net.parameters(), lr=0.5))
    acc.load_state(root)
    model.eval()
    opt.eval()
    with torch.no_grad():  # the resumed model evaluates where the saved one did
        x, y = _xy()
        losses.append(F.cross_entropy(model(x).float(), y).item())
    _accel_sf_epoch(acc, model, opt, losses)
    opt.train()
    return losses, _floats(acc.get_state_dict(model))


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_accelerate_o2_schedule_free_accumulate_save_load_state_into_fresh_objects_as_bf16(tmp_path: Any) -> None:
    pytest.importorskip("accelerate")
    losses, weights = _accel_sf("O2", str(tmp_path / "o2"))
    ref_losses, ref = _accel_sf("bf16", str(tmp_path / "ref"))
    assert losses == pytest.approx(ref_losses, abs=1e-3)
    assert _gap(weights, ref) < 3e-3
