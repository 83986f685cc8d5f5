"""The loss scale carried between precisions and doors, stop 58's gaps: Lightning's FSDP ``"16-mixed"``
(``FSDPPrecision``, whose ``ShardedGradScaler`` reads the checkpoint's ``"FSDPPrecision"`` entry) both ways, and
Accelerate's own ``"fp16"`` loading an adapter checkpoint saved with a static scale (its ``load_state`` requires a
scaler.pt).

Without a launch: ``trainer.fit(ckpt_path=...)`` restores a precision plugin with Lightning's
``_CheckpointConnector.restore_precision_plugin_state`` (``on_load_checkpoint``, then ``load_state_dict`` of the entry
named by the plugin's class), called here on the plugin Lightning's ``FSDPStrategy`` holds. On a CPU,
``FSDPPrecision("16-mixed")`` builds a disabled CUDA ``ShardedGradScaler`` (which ignores ``load_state_dict``) and
refuses one passed in (``self.precision`` is read before it is set): a CPU ``ShardedGradScaler`` is put in its place,
as Accelerate's ``"fp16"`` gets a CPU ``GradScaler`` for the CUDA one it holds on a GPU.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_mpx import MixedPrecisionPlugin
from tests.lightning_helpers import make_trainer
from tests.test_lightning_precision_switch_float16 import (
    SCALING,
    Net,
    X,
    Y,
    _assert_grad_scaler_resumed,
    _fit,
    _net,
    _train,
)


def _fsdp_precision(precision: str) -> Any:
    from lightning.pytorch.plugins.precision import FSDPPrecision
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.cuda.amp.GradScaler is enabled, but CUDA is not available")
        plugin = FSDPPrecision(precision)
    if plugin.scaler is not None:
        plugin.scaler = ShardedGradScaler(device="cpu")  # the CUDA one of a GPU
    return plugin


def _restore(plugin: Any, checkpoint: dict[str, Any]) -> None:
    """What ``trainer.fit(ckpt_path=...)`` does with the precision plugin's state: Lightning's own code."""
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    connector = _CheckpointConnector(SimpleNamespace(precision_plugin=plugin))
    connector._loaded_checkpoint = checkpoint
    connector.restore_precision_plugin_state()


def test_a_float16_plugin_checkpoint_resumed_under_fsdp_16_mixed_starts_at_the_plugins_scale(tmp_path) -> None:
    """Our plugin at O2 float16, then Lightning's ``strategy="fsdp", precision="16-mixed"``: its
    ``ShardedGradScaler`` starts at the plugin's scale, growth tracker and growth interval (it started at 65536, as
    no ``"FSDPPrecision"`` entry was written), as an FSDP ``"16-mixed"`` run resumed under itself does; FSDP's
    ``"bf16-mixed"`` and ``"32-true"`` (no scaler) load the same checkpoint, and the plugin's own resume still takes
    its own entry (the written ones edited to differ)."""
    path = tmp_path / "run.ckpt"
    _fit(MixedPrecisionPlugin("O2", half_dtype="float16", **SCALING), 3, save=path)
    checkpoint = torch.load(path, weights_only=False)
    saved = checkpoint["MixedPrecisionPlugin"]["scalers"][0]

    fsdp = _fsdp_precision("16-mixed")
    _restore(fsdp, checkpoint)
    _assert_grad_scaler_resumed(fsdp.scaler.state_dict(), saved)
    assert fsdp.state_dict() == checkpoint["MixedPrecision"]  # what Lightning's "16-mixed" without FSDP gets
    for precision in ("bf16-mixed", "32-true"):
        other = _fsdp_precision(precision)
        _restore(other, checkpoint)
        assert other.scaler is None and other.state_dict() == {}

    for key in ("MixedPrecision", "FSDPPrecision"):
        checkpoint[key]["scale"] = 2.0
    torch.save(checkpoint, tmp_path / "edited.ckpt")
    plugin = MixedPrecisionPlugin("O2", half_dtype="float16", **SCALING)
    assert _fit(plugin, 4, ckpt=tmp_path / "edited.ckpt").state["scale"] == saved["scale"]


def test_an_fsdp_16_mixed_checkpoint_gives_its_sharded_grad_scaler_scale_to_the_plugin(tmp_path) -> None:
    """A checkpoint of Lightning's FSDP ``"16-mixed"`` (a full, consolidated one: the weights of a single-device
    checkpoint and its ``ShardedGradScaler`` in ``"FSDPPrecision"``) resumed with the plugin at O2 float16: the
    dynamic scale starts at that scale and growth tracker (it started at ``init_scale``), as a ``"16-mixed"``
    checkpoint's ``"MixedPrecision"`` entry gives them."""
    trainer = make_trainer(max_steps=1)  # "32-true": its weights and loops, no precision entry
    trainer.fit(Net(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=16))
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    checkpoint = torch.load(tmp_path / "run.ckpt", weights_only=False)
    fsdp = _fsdp_precision("16-mixed")
    fsdp.scaler.load_state_dict({**fsdp.scaler.state_dict(), "scale": 256.0, "_growth_tracker": 3})
    checkpoint["FSDPPrecision"] = fsdp.state_dict()  # what Lightning's dump_checkpoint writes
    torch.save(checkpoint, tmp_path / "fsdp.ckpt")

    plugin = MixedPrecisionPlugin("O2", half_dtype="float16", init_scale=16.0, growth_interval=5)
    state = _fit(plugin, 2, ckpt=tmp_path / "fsdp.ckpt").state
    assert (state["scale"], state["growth_tracker"]) == (256.0, 3)  # was (16.0, 0)


@pytest.mark.parametrize("scaling", [{"half_dtype": "bfloat16"}, {"half_dtype": "float16", "loss_scale": 128.0}])
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_static_scale_adapter_checkpoint_loads_under_accelerate_fp16(scaling, tmp_path) -> None:
    """``save_state`` of the adapter with a static scale (bfloat16's, ``loss_scale=<number>``), then
    ``load_state`` of Accelerate's own ``"fp16"``: it loads, its ``GradScaler`` where it starts without a checkpoint
    (a static scale is a setting a GradScaler cannot hold; Lightning's ``"16-mixed"`` starts at ``init_scale`` too).
    It failed: no scaler.pt was written and Accelerate's ``load_state`` requires one. Accelerate's ``"bf16"`` (no
    scaler) loads it too."""
    from accelerate import Accelerator as Upstream

    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    accelerator = Accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=[MixedPrecisionKwargs(**scaling)])
    net = _net()
    model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=1e-2))
    _train(accelerator.backward, model, optimizer, steps=1)
    assert not accelerator.amp.scalers[0].dynamic
    accelerator.save_state(str(tmp_path))

    for mode in ("fp16", "bf16"):
        reset_accelerate_state()
        upstream = Upstream(mixed_precision=mode, cpu=True)
        assert upstream.scaler is None  # a CPU: Accelerate's "fp16" makes no GradScaler
        net = _net()
        upstream.prepare(net, torch.optim.SGD(net.parameters(), lr=1e-2))
        if mode == "fp16":
            upstream.scaler = torch.amp.GradScaler("cpu")  # what Accelerate's "fp16" holds on a GPU
            fresh = upstream.scaler.state_dict()
        upstream.load_state(str(tmp_path))
        if mode == "fp16":
            assert upstream.scaler.state_dict() == fresh
            upstream.backward(F.cross_entropy(net(X[:16]), Y[:16]))  # and trains on
