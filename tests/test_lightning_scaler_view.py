"""Code ported from Lightning's ``"16-mixed"`` that reads the loss scale through the precision plugin's scaler
(``self.trainer.precision_plugin.scaler.get_scale()``, ``fabric._precision.scaler.get_scale()``,
``trainer.scaler.state_dict()``): the same user code, unchanged, logs the same scales under the plugin (a read-only
view of the engine's scaler) as under Lightning's/Fabric's own ``"16-mixed"`` (a ``torch.amp.GradScaler``), for the
same sequence of overflows; the calls that would change the scale are refused with what does that instead.
"""

from __future__ import annotations

import pickle
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin, MixedPrecisionPlugin
from lightning_mpx.scaling.view import GradScalerView
from tests.lightning_helpers import make_trainer

SCALING = {"init_scale": 256.0, "growth_interval": 2}
OVERFLOW_AT = (2, 3, 6)  # steps whose loss is made inf: back off twice, grow, back off again
STEPS = 8
_G = torch.Generator().manual_seed(0)
X = torch.randn(STEPS * 4, 4, generator=_G)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))


def _loss(out: torch.Tensor, step: int) -> torch.Tensor:
    loss = out.float().pow(2).mean()
    return loss * float("inf") if step in OVERFLOW_AT else loss


class Ported(pl.LightningModule):
    """A LightningModule written for ``precision="16-mixed"``: it logs the scaler's scale at each step."""

    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = not manual
        self.net = _net()
        self.seen: list[float] = []
        self.after: list[tuple[float, float | None]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        scale = self.trainer.precision_plugin.scaler.get_scale()
        self.seen.append(scale)
        self.log("scale", scale)
        loss = _loss(self.net(batch[0]), batch_idx)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        self.manual_backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return None

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        plugin = self.trainer.precision_plugin
        metric = plugin.metrics()["mpx/loss_scale"] if isinstance(plugin, MixedPrecisionPlugin) else None
        self.after.append((self.trainer.scaler.get_scale(), metric))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def _fit(plugin: Any, manual: bool = False, **kwargs: Any) -> tuple[Ported, pl.Trainer]:
    model = Ported(manual)
    trainer = make_trainer(plugin, max_steps=STEPS, **kwargs)
    trainer.fit(model, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X), batch_size=4))
    return model, trainer


def _grad_scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", **SCALING)  # type: ignore[arg-type]


def test_trainer_logs_the_scales_lightnings_16_mixed_logs_for_the_same_overflows(tmp_path) -> None:
    """``self.trainer.precision_plugin.scaler.get_scale()`` in each training step (before the backward) and
    ``trainer.scaler.get_scale()`` after it: the scales Lightning's own ``"16-mixed"`` (its ``GradScaler``) shows at
    the same points for the same overflows, and the plugin's ``mpx/loss_scale`` after the step; the checkpoint and its
    resume are the engine's, unchanged (the view adds no state)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    ours, trainer = _fit(MixedPrecisionPlugin("O2", half_dtype="float16", **SCALING))
    native, _ = _fit(MixedPrecision("16-mixed", "cpu", scaler=_grad_scaler()))
    assert native.seen == [256.0, 256.0, 512.0, 256.0, 128.0, 128.0, 256.0, 128.0]  # the reference moved
    assert ours.seen == native.seen
    assert [after for after, _ in ours.after] == [after for after, _ in native.after]
    assert [metric for _, metric in ours.after] == [after for after, _ in native.after]
    assert trainer.logged_metrics["scale"] == ours.seen[-1]

    view = trainer.precision_plugin.scaler
    resumed = torch.amp.GradScaler("cpu")
    resumed.load_state_dict(view.state_dict())  # GradScaler's format
    assert resumed.state_dict() == native.trainer.scaler.state_dict()
    assert view._scale is not None and view._scale.item() == native.trainer.scaler._scale.item()

    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    entry = torch.load(path, weights_only=False)["MixedPrecisionPlugin"]
    assert entry["scalers"][0]["scale"] == view.get_scale()
    assert "scaler" not in entry and set(vars(view)) == {"_owner", "_front"}  # no state of its own
    plugin = MixedPrecisionPlugin("O2", half_dtype="float16", **SCALING)
    resumed_model = Ported()
    make_trainer(plugin, max_steps=STEPS + 1, max_epochs=2).fit(
        resumed_model, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X), batch_size=4), ckpt_path=path
    )
    assert resumed_model.seen == [view.get_scale()]  # the checkpoint carried the scale the view showed


def test_manual_optimization_reads_the_updated_scale_after_its_step() -> None:
    """In manual optimization the iteration ends at the next training step: read after it (``on_train_batch_end``),
    the view still shows the scale updated after the step, as Lightning's ``"16-mixed"`` does."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    ours, _ = _fit(MixedPrecisionPlugin("O2", half_dtype="float16", **SCALING), manual=True)
    native, _ = _fit(MixedPrecision("16-mixed", "cpu", scaler=_grad_scaler()), manual=True)
    assert ours.seen == native.seen == [256.0, 256.0, 512.0, 256.0, 128.0, 128.0, 256.0, 128.0]
    assert [after for after, _ in ours.after] == [after for after, _ in native.after] == ours.seen[1:] + [128.0]


def test_fabric_scaler_reads_what_fabrics_16_mixed_grad_scaler_reads() -> None:
    """``fabric._precision.scaler.get_scale()`` (and ``fabric.strategy.precision.scaler``) after each
    ``optimizer.step()``: Fabric's own ``"16-mixed"`` ``GradScaler``'s scales for the same overflows, and the
    plugin's ``mpx/loss_scale``; before the first backward, the configured scale (a GradScaler's ``init_scale``)."""
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.precision import MixedPrecision

    def run(plugin: Any) -> list[float]:
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        net = _net()
        model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=1e-2))
        scales = [fabric._precision.scaler.get_scale()]
        for step in range(STEPS):
            fabric.backward(_loss(model(X[step * 4:(step + 1) * 4]), step))
            optimizer.step()
            optimizer.zero_grad()
            scales.append(fabric.strategy.precision.scaler.get_scale())
        return scales

    mpx = FabricMixedPrecisionPlugin("O2", half_dtype="float16", **SCALING)
    ours = run(mpx)
    assert ours == run(MixedPrecision("16-mixed", "cpu", scaler=_grad_scaler()))
    assert ours == [256.0, 256.0, 512.0, 256.0, 128.0, 128.0, 256.0, 128.0, 128.0]
    assert mpx.metrics()["mpx/loss_scale"] == ours[-1]
    assert mpx.scaler.state_dict()["_growth_tracker"] == mpx.amp.scalers[0].state_dict()["growth_tracker"]


@pytest.mark.parametrize("plugin_class", [MixedPrecisionPlugin, FabricMixedPrecisionPlugin])
def test_calls_that_change_the_scale_are_refused_naming_what_does_it(plugin_class: Any) -> None:
    """``scale``, ``unscale_``, ``step``, ``update`` and ``load_state_dict`` of the view would fight the engine (a
    second scaling, a second unscale): each is refused, naming the call that does its work; nothing changes."""
    plugin = plugin_class("O2", half_dtype="float16", **SCALING)
    view = plugin.scaler
    fabric = plugin_class is FabricMixedPrecisionPlugin
    expected = {
        "scale": "fabric.backward(loss)" if fabric else "self.manual_backward(loss)",
        "unscale_": "fabric.clip_gradients" if fabric else "on_before_optimizer_step",
        "step": "plugin.step_was_skipped(optimizer)",
        "update": "once per iteration",
        "load_state_dict": "fabric.load(" if fabric else "ckpt_path=",
    }
    args = {"scale": (torch.ones(()),), "unscale_": (None,), "step": (None,), "update": (), "load_state_dict": ({},)}
    for name, words in expected.items():
        with pytest.raises(RuntimeError, match="read-only view") as raised:
            getattr(view, name)(*args[name])
        assert words in str(raised.value) and f"plugin.scaler.{name}()" in str(raised.value)
    assert view.get_scale() == view.state_dict()["scale"] == 256.0
    assert plugin.amp.scalers[0].device is None  # reading made no state (the first backward makes it on its device)
    with pytest.raises(AttributeError):
        view._scale = torch.ones(())  # type: ignore[misc]


@pytest.mark.parametrize("plugin_class", [MixedPrecisionPlugin, FabricMixedPrecisionPlugin])
def test_the_view_reads_the_engines_scaler_and_pickles_as_its_plugin(plugin_class: Any) -> None:
    """One owner: a view taken earlier shows what the engine's scaler holds now (loss 0's; others through
    ``amp.scalers``); a static scale gives no view (None, as "bf16-mixed"'s scaler); the view and the plugin pickle
    (``ddp_spawn``) as the settings: a fresh engine's configured scale."""
    plugin = plugin_class("O2", half_dtype="float16", num_losses=2, **SCALING)
    view = plugin.scaler
    assert isinstance(view, GradScalerView) and view._scale is None  # a GradScaler's before its first scale()
    for scaler, scale in zip(plugin.amp.scalers, (32.0, 8.0)):
        scaler.load_state_dict({**scaler.state_dict(), "scale": scale, "growth_tracker": 1})
        scaler.to("cpu")
    assert view.get_scale() == 32.0 and view.state_dict()["_growth_tracker"] == 1
    assert plugin.amp.scalers[1].get_scale() == 8.0
    assert (view.is_enabled(), view.get_growth_factor(), view.get_backoff_factor(), view.get_growth_interval()) == (
        True, 2.0, 0.5, 2
    )
    for copy in (pickle.loads(pickle.dumps(view)), pickle.loads(pickle.dumps(plugin)).scaler):
        assert copy.get_scale() == 256.0
    # A static scale has no GradScaler: None, as "bf16-mixed"'s (code written for both takes the same branch).
    assert plugin_class("O2", half_dtype="bfloat16").scaler is None
    assert plugin_class("O2", half_dtype="float16", loss_scale=128.0).scaler is None
    assert plugin_class("O2", half_dtype="bfloat16", loss_scale="dynamic").scaler is not None
