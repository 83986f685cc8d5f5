"""Leaving lightning_mpx at float16 for the framework's own float16 mixed precision: the run resumed under Lightning's
``"16-mixed"``, Accelerate's ``"fp16"`` or Fabric's ``"16-mixed"`` starts its ``torch.amp.GradScaler`` at the scale and
growth tracker the plugin's dynamic scaler had reached, not at its own ``init_scale`` (the overflows of backing off
again, or the steps of growing back, saved).

On a CPU, Lightning's ``precision="16-mixed"`` is built as
``MixedPrecision("16-mixed", "cpu", scaler=GradScaler("cpu"))`` and Accelerate's ``"fp16"`` has no scaler (it reads
no scaler.pt there): a CPU ``GradScaler`` stands in for the CUDA one it has on a GPU, and Accelerate's own
``load_state`` fills it.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin, MixedPrecisionPlugin
from tests.lightning_helpers import make_trainer

_G = torch.Generator().manual_seed(0)
X, Y = torch.randn(48, 8, generator=_G), torch.randint(0, 3, (48,), generator=_G)
#: The plugin's scaler grows every 2 steps from 16: after 3 steps its scale is 32 and its growth tracker 1, both away
#: from a default GradScaler's (65536, 0, growth_interval 2000).
SCALING = {"init_scale": 16.0, "growth_interval": 2}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


class ScaleAtStart(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        plugin = trainer.precision_plugin
        amp = getattr(plugin, "amp", None)
        self.state = amp.scalers[0].state_dict() if amp is not None else plugin.scaler.state_dict()


def _fit(plugin: Any, steps: int, ckpt: Any = None, save: Any = None) -> ScaleAtStart:
    at_start = ScaleAtStart()
    trainer = make_trainer(plugin, max_steps=steps, max_epochs=10, callbacks=[at_start])
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=16)
    trainer.fit(Net(), data, ckpt_path=ckpt)
    if save is not None:
        trainer.save_checkpoint(save)
    return at_start


def _native_16_mixed() -> Any:
    from lightning.pytorch.plugins.precision import MixedPrecision

    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


def _assert_grad_scaler_resumed(grad_scaler_state: dict[str, Any], saved: dict[str, Any]) -> None:
    assert (saved["scale"], saved["growth_tracker"]) == (32.0, 1)  # grown away from every default
    assert grad_scaler_state["scale"] == saved["scale"]  # was 65536.0: GradScaler's init_scale
    assert grad_scaler_state["_growth_tracker"] == saved["growth_tracker"]
    assert grad_scaler_state["growth_interval"] == SCALING["growth_interval"]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_float16_plugin_checkpoint_resumed_under_16_mixed_starts_at_the_plugins_scale(level, tmp_path) -> None:
    """``trainer.fit(model, ckpt_path=...)`` under Lightning's ``"16-mixed"`` of a checkpoint of the plugin at float16:
    its ``GradScaler`` starts at the plugin's scale and growth tracker (Lightning's ``"MixedPrecision"`` entry), and a
    resume with the plugin still takes its own entry (here made to differ)."""
    path = tmp_path / "run.ckpt"
    _fit(MixedPrecisionPlugin(level, half_dtype="float16", **SCALING), 3, save=path)
    checkpoint = torch.load(path, weights_only=False)
    saved = checkpoint["MixedPrecisionPlugin"]["scalers"][0]
    _assert_grad_scaler_resumed(_fit(_native_16_mixed(), 4, ckpt=path).state, saved)
    if level == "O2":
        checkpoint["MixedPrecision"]["scale"] = 2.0
        torch.save(checkpoint, tmp_path / "edited.ckpt")
        plugin = MixedPrecisionPlugin(level, half_dtype="float16", **SCALING)
        assert _fit(plugin, 4, ckpt=tmp_path / "edited.ckpt").state["scale"] == saved["scale"]


def test_a_bfloat16_plugin_checkpoint_has_no_16_mixed_entry(tmp_path) -> None:
    """bfloat16's static scale is a setting a ``GradScaler`` cannot hold: no ``"MixedPrecision"`` entry is written."""
    _fit(MixedPrecisionPlugin("O2", half_dtype="bfloat16"), 1, save=tmp_path / "run.ckpt")
    checkpoint = torch.load(tmp_path / "run.ckpt", weights_only=False)
    assert "MixedPrecisionPlugin" in checkpoint and "MixedPrecision" not in checkpoint


def _train(backward: Any, model: nn.Module, optimizer: Any, steps: int = 3) -> None:
    for step in range(steps):
        x, y = X[16 * step : 16 * step + 16], Y[16 * step : 16 * step + 16]
        backward(F.cross_entropy(model(x).float(), y))
        optimizer.step()
        optimizer.zero_grad()


def test_an_adapter_float16_checkpoint_loaded_by_accelerate_fp16_gives_its_grad_scaler_the_scale(
    tmp_path, fresh_accelerate_state
) -> None:
    """``save_state`` at O2 float16 writes scaler.pt in ``GradScaler``'s format, which ``load_state`` of Accelerate's
    own ``"fp16"`` reads into its scaler (on CUDA it failed on the missing file)."""
    from accelerate import Accelerator as Upstream

    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    kwargs = MixedPrecisionKwargs(half_dtype="float16", **SCALING)
    accelerator = Accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=[kwargs])
    net = _net()
    model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=1e-2))
    _train(accelerator.backward, model, optimizer)
    accelerator.save_state(str(tmp_path))
    saved = accelerator.amp.scalers[0].state_dict()

    reset_accelerate_state()
    upstream = Upstream(mixed_precision="fp16", cpu=True)
    assert upstream.scaler is None  # Accelerate's "fp16" on a CPU: no scaler, no scaler.pt read
    net = _net()
    upstream.prepare(net, torch.optim.SGD(net.parameters(), lr=1e-2))
    upstream.scaler = torch.amp.GradScaler("cpu")  # what Accelerate's "fp16" holds on a GPU
    upstream.load_state(str(tmp_path))
    _assert_grad_scaler_resumed(upstream.scaler.state_dict(), saved)
    assert upstream.scaler.get_scale() == saved["scale"]


def test_fabric_16_mixed_keeps_no_scaler_state_and_the_documented_recipe_carries_the_plugins(tmp_path) -> None:
    """Fabric's own ``"16-mixed"`` neither saves nor loads its ``GradScaler`` (``fabric.save``/``fabric.load`` never
    call the precision's ``state_dict``), so there is no key to write; docs/fabric.md's recipe gives it the plugin's
    scale and growth tracker from the checkpoint's ``"mpx"`` entry."""
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.precision import MixedPrecision

    mpx = FabricMixedPrecisionPlugin("O2", half_dtype="float16", **SCALING)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx])
    net = _net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=1e-2))
    _train(fabric.backward, model, optimizer)
    fabric.save(tmp_path / "run.ckpt", {"model": model, "optimizer": optimizer, "mpx": mpx})
    saved = mpx.amp.scalers[0].state_dict()

    scaler = torch.amp.GradScaler("cpu")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    net = _net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=1e-2))
    remainder = fabric.load(tmp_path / "run.ckpt", {"model": model, "optimizer": optimizer})
    assert scaler.get_scale() == 65536.0  # fabric.load left the scaler alone
    # docs/fabric.md: the recipe
    plugin_scale = remainder["mpx"]["scalers"][0]
    scaler.load_state_dict({
        **scaler.state_dict(), "scale": plugin_scale["scale"], "_growth_tracker": plugin_scale["growth_tracker"],
        "growth_interval": SCALING["growth_interval"],
    })
    _assert_grad_scaler_resumed(scaler.state_dict(), saved)
    _train(fabric.backward, model, optimizer, steps=1)
    assert scaler.get_scale() == 2 * saved["scale"]  # the tracker carried over: it grows on the next step
