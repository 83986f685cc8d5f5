"""Model surgery after set-up at O2, the remaining holes: ``torch.nn.utils.prune`` (``prune.l1_unstructured`` then
``prune.remove``, and Lightning's ``ModelPruning`` with and without ``use_global_unstructured``, made permanent in
its checkpoints and at the end of fit) exports and checkpoints the FP32 masters, never their half rounding, and trains
as ``"bf16-mixed"``/FP32 do; a head given to a registered optimizer by ``add_param_group`` alone (a callback mid-fit
on the Trainer's own optimizer, Fabric's optimizer after its first step) is prepared at the next forward and trains
as ``"bf16-mixed"`` does (was a RuntimeError at that forward). ``BackboneFinetuning`` at O2 is tested in
``tests/test_lightning_surgery_doors.py`` and ``tests/test_o2_mirror_lightning.py``. bfloat16; tolerances, not bit
equality."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import prune

from lightning_mpx import Amp, FabricMixedPrecisionPlugin, MixedPrecisionPlugin
from tests.lightning_helpers import classification_data, loader
from tests.test_core_surgery_added_head import _LM, _add_head, _batches, _close, _floats, _loss, _Net, _sgd

HALF = "bfloat16"
Weights = dict[str, torch.Tensor]


def _bf16_exact(value: torch.Tensor) -> bool:
    return torch.equal(value, value.to(torch.bfloat16).float())


# --- prune.l1_unstructured, then prune.remove (core Amp) ----------------------------------------------------------


def _pruned_run(level: str | None) -> tuple[Weights, Weights, Weights]:
    """Two steps, ``l1_unstructured`` on the first layer (ranked by its FP32 values: the masters at O2), two steps,
    ``prune.remove``, two steps; (the export while pruned, the export right after the remove, the final export)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
    amp = Amp(level, half_dtype=HALF) if level else None
    model = amp.prepare_model(model) if amp else model
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    opt = amp.prepare_optimizer(opt) if amp else opt

    def export() -> Weights:
        return _floats(amp.fp32_state_dict(model) if amp else model.state_dict())

    g = torch.Generator().manual_seed(3)
    exports = []
    for i in range(6):
        if i == 2:
            scores = amp.master_of(model[0].weight).detach() if amp else model[0].weight.detach()
            prune.l1_unstructured(model[0], "weight", amount=0.5, importance_scores=scores)
        if i == 4:
            exports.append(export())
            prune.remove(model[0], "weight")  # the usual export step
            exports.append(export())
        x = torch.randn(4, 32, generator=g)
        with amp.forward_context() if amp else torch.enable_grad():
            loss = F.mse_loss(model(amp.cast_inputs(x) if amp else x).float(), torch.ones(4, 4))
        if amp:
            amp.backward(loss)
            amp.step(opt)
            amp.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad()
    return exports[0], exports[1], export()


def test_prune_then_remove_at_o2_exports_the_fp32_masters_and_trains_as_fp32() -> None:
    pruned, removed, final = _pruned_run("O2")
    ref_pruned, ref_removed, ref_final = _pruned_run(None)
    assert "0.weight_orig" in pruned and "0.weight" in removed and "0.weight_orig" not in removed
    mask = pruned["0.weight_mask"].bool()
    assert torch.equal(mask, ref_pruned["0.weight_mask"].bool()), "not the FP32 run's mask"
    # remove(): the same Parameter, its .data set to weight_orig * mask: the kept elements keep their exact FP32
    # masters, the pruned ones are 0; not the half rounding
    assert torch.equal(removed["0.weight"][mask], pruned["0.weight_orig"][mask])
    assert not _bf16_exact(removed["0.weight"]) and (removed["0.weight"][~mask] == 0).all()
    for got, ref in ((removed, ref_removed), (final, ref_final)):  # trained in FP32 after the remove, as FP32 is
        assert got.keys() == ref.keys()
        for name, value in ref.items():
            assert torch.allclose(got[name], value, atol=0.01), f"{name}: {(got[name] - value).abs().max()}"


# --- Lightning's ModelPruning ----------------------------------------------------------------------------------------


class _Pruned(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 32)
        self.out = nn.Linear(32, 4)

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.out(torch.tanh(self.inp(x))).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class _SaveAtEpochOne(pl.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.current_epoch == 1:  # pruned at epoch 0's end: ModelPruning makes it permanent in the checkpoint
            trainer.save_checkpoint(self.path)


def _pruning_fit(precision: str, use_global: bool, path: str) -> tuple[Weights, Weights]:
    from lightning.pytorch.callbacks import ModelPruning

    pruning = ModelPruning("l1_unstructured", amount=0.5, use_global_unstructured=use_global,
                           make_pruning_permanent=True, use_lottery_ticket_hypothesis=False, verbose=0,
                           apply_pruning=lambda epoch: epoch == 0)  # fmt: skip
    plugin = MixedPrecisionPlugin(precision, half_dtype=HALF) if precision == "O2" else None
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, max_epochs=2,
                         callbacks=[pruning, _SaveAtEpochOne(path)],
                         **({"plugins": [plugin]} if plugin else {"precision": precision}))  # fmt: skip
    module = _Pruned()
    trainer.fit(module, loader(classification_data(n=32)))
    final = _floats(plugin.amp.fp32_state_dict(module) if plugin else module.state_dict())
    return final, _floats(torch.load(path, weights_only=True)["state_dict"])


@pytest.mark.parametrize("use_global", [False, True], ids=["local", "global"])
def test_model_pruning_made_permanent_at_o2_checkpoints_and_trains_as_bf16_mixed(use_global: bool, tmp_path) -> None:
    got, got_saved = _pruning_fit("O2", use_global, str(tmp_path / "o2.ckpt"))
    ref, ref_saved = _pruning_fit("bf16-mixed", use_global, str(tmp_path / "ref.ckpt"))
    for state, want, atol in ((got_saved, ref_saved, 3e-3), (got, ref, 0.02)):  # then trained on that mask
        assert state.keys() == want.keys() == {"inp.weight", "inp.bias", "out.weight", "out.bias"}
        for name, value in want.items():
            pruned, ref_pruned = state[name] == 0, value == 0
            assert ref_pruned.float().mean() >= 0.4, f"{name} not pruned"
            # ModelPruning ranks the half values at O2: a near-tie at the threshold may fall the other way
            assert (pruned != ref_pruned).float().mean() <= 0.01, name
            agree = pruned == ref_pruned
            gap = (state[name][agree] - value[agree]).abs().max()
            assert gap <= atol, f"{name}: {gap}"
    # the checkpoint ModelPruning rewrote holds the FP32 masters times the mask, not their bfloat16 rounding
    assert not all(_bf16_exact(value) for value in got_saved.values())


# --- a head added by add_param_group alone, mid-fit --------------------------------------------------------------


class _HeadByAddParamGroup(pl.Callback):
    def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.current_epoch == 1:
            _add_head(module.net)  # FP32 Linear + BatchNorm1d, after set-up
            trainer.optimizers[0].add_param_group({"params": list(module.net.classifier.parameters())})


def _trainer_head_run(precision: str) -> tuple[Weights, Any]:
    plugin = MixedPrecisionPlugin(precision, half_dtype=HALF) if precision == "O2" else None
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, max_epochs=2,
                         callbacks=[_HeadByAddParamGroup()],
                         **({"plugins": [plugin]} if plugin else {"precision": precision}))  # fmt: skip
    module = _LM()
    trainer.fit(module)
    return _floats(plugin.amp.fp32_state_dict(module.net) if plugin else module.net.state_dict()), module


def test_trainer_head_added_by_add_param_group_from_a_callback_trains_as_bf16_mixed() -> None:
    got, module = _trainer_head_run("O2")
    linear, norm = module.net.classifier
    assert linear.weight.dtype == torch.bfloat16 and norm.weight.dtype == torch.float32  # half, batch norm FP32
    _close(got, _trainer_head_run("bf16-mixed")[0])


def _fabric_head_run(precision: str) -> Weights:
    from lightning.fabric import Fabric

    plugin = FabricMixedPrecisionPlugin(precision, half_dtype=HALF) if precision == "O2" else None
    if plugin is not None:
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    else:
        fabric = Fabric(accelerator="cpu", devices=1, precision=precision)  # type: ignore[arg-type]
    model = fabric.setup(_Net())
    optimizer = fabric.setup_optimizers(_sgd(model.parameters()))
    for i, x in enumerate(_batches()):
        if i == 2:  # the optimizer registered at its first step already
            _add_head(model.module)
            optimizer.add_param_group({"params": list(model.module.classifier.parameters())})
        fabric.backward(_loss(model(x), x))
        optimizer.step()
        optimizer.zero_grad()
    return _floats(plugin.amp.fp32_state_dict(model.module) if plugin else model.module.state_dict())


def test_fabric_head_added_by_add_param_group_after_steps_trains_as_bf16_mixed() -> None:
    _close(_fabric_head_run("O2"), _fabric_head_run("bf16-mixed"))


def test_a_backbone_unfrozen_into_a_new_group_gets_its_own_value_as_master_not_a_lookalikes() -> None:
    """A backbone unfrozen into a new group (``BaseFinetuning.unfreeze_and_add_param_group``'s move) is seen at the
    next forward: the unfrozen half parameters (frozen when the model was prepared) take their own values as masters,
    never the FP32 value of another master whose rounding they happen to equal (an untie's clone alone is adopted so).
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.LayerNorm(8))
    model[:2].requires_grad_(False)  # the backbone, frozen before set-up
    amp = Amp("O2", half_dtype=HALF)
    model = amp.prepare_model(model)
    opt = amp.prepare_optimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-4))
    x = torch.randn(4, 8)
    for i in range(2):
        if i == 1:
            model[:2].requires_grad_(True)  # (BaseFinetuning would skip the norm: its `in` compares values)
            opt.add_param_group({"params": list(model[:2].parameters())})
        with amp.forward_context():
            loss = amp.cast_outputs(model(amp.cast_inputs(x))).square().mean()
        if i == 1:  # the new group seen at that forward: the backbone's norm has its master, from its own 1.0
            backbone = amp.master_of(model[1].weight)
            assert backbone is not model[1].weight and backbone.dtype == torch.float32
            assert torch.equal(backbone.detach(), torch.ones(8)), "took the head's FP32 value"
        amp.backward(loss)
        amp.step(opt)
        amp.update()
        opt.zero_grad()
        if i == 0:  # the head's norm moved less than a bfloat16 rounding: its master rounds to the backbone's 1.0
            head = amp.master_of(model[3].weight).detach().clone()
            assert not torch.equal(head, torch.ones(8)) and torch.equal(head.bfloat16(), model[1].weight)
