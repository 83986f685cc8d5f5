"""Switching precision between runs: a checkpoint written under one precision (Lightning's, Fabric's, Accelerate's own
modes, a plain FP32 loop, or an opt level) resumed under another, through every front door, from the user's side.

What carries over is checked exactly where it is the same value (FP32 weights, AdamW moments) and against a reference
run (the same checkpoint resumed under the saving precision) where kernels differ.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp, FabricMixedPrecisionPlugin, MixedPrecisionPlugin
from tests.lightning_helpers import make_trainer

_G = torch.Generator().manual_seed(0)
X, Y = torch.randn(64, 8, generator=_G), torch.randint(0, 3, (64,), generator=_G)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class AtStart(pl.Callback):
    """What the resumed fit starts from: the FP32 weights the optimizer steps, its state, the loss scale."""

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        amp = getattr(trainer.precision_plugin, "amp", None)
        params = module.named_parameters()
        self.fp32 = {n: (amp.master_of(p) if amp is not None else p).detach().clone() for n, p in params}
        self.optimizer = copy.deepcopy(trainer.optimizers[0].state_dict())
        self.scale = amp.scalers[0].get_scale() if amp is not None else None


def _precision(spec: str, **scaling: Any) -> dict[str, Any]:
    if spec.startswith("O"):
        level, half = spec.split(":")
        return {"plugins": [MixedPrecisionPlugin(level, half_dtype=half, **scaling)]}
    return {"precision": spec}


def _fit(spec: str, steps: int, ckpt: Any = None, save: Any = None, **scaling: Any) -> tuple[AtStart, Net]:
    model, at_start = Net(), AtStart()
    trainer = make_trainer(max_steps=steps, max_epochs=10, callbacks=[at_start], **_precision(spec, **scaling))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=16)
    trainer.fit(model, data, ckpt_path=ckpt)
    if save is not None:
        trainer.save_checkpoint(save)
    return at_start, model


def _assert_resumed_exactly(at_start: AtStart, checkpoint: dict[str, Any]) -> None:
    """The FP32 weights are the checkpoint's exactly (not a half rounding) and AdamW's moments are its, FP32, keyed
    by the same parameters."""
    for name, value in at_start.fp32.items():
        assert value.dtype == torch.float32 and torch.equal(value, checkpoint["state_dict"][name]), name
    saved, got = checkpoint["optimizer_states"][0]["state"], at_start.optimizer["state"]
    assert sorted(got) == sorted(saved)
    for index, state in saved.items():
        for key, value in state.items():
            assert got[index][key].dtype == value.dtype == torch.float32, (index, key)
            assert torch.equal(got[index][key], value), (index, key)


def _weights(model: nn.Module, amp: Any = None) -> dict[str, torch.Tensor]:
    return {n: (amp.master_of(p) if amp is not None else p).detach().float() for n, p in model.named_parameters()}


@pytest.mark.parametrize(("saved", "resumed"), [("bf16-mixed", "O2:bfloat16"), ("32-true", "O1:bfloat16")])
def test_a_lightning_precision_checkpoint_resumes_under_the_plugin_with_its_weights_and_adamw_state(
    saved: str, resumed: str, tmp_path: Any
) -> None:
    """Adopting the plugin mid-project: ``trainer.fit(model, ckpt_path=...)`` of a ``"bf16-mixed"``/``"32-true"``
    checkpoint starts from its FP32 weights and AdamW moments exactly, the scale at the level's default, and trains
    on as the saving precision does (the gap to it is far below the one a lost momentum makes)."""
    path = tmp_path / "run.ckpt"
    _fit(saved, 2, save=path)
    checkpoint = torch.load(path, weights_only=False)
    at_start, model = _fit(resumed, 4, ckpt=path)
    _assert_resumed_exactly(at_start, checkpoint)
    assert at_start.scale == 1.0  # bfloat16's static default; no error from a checkpoint without the plugin's entry
    _, reference = _fit(saved, 4, ckpt=path)
    got, want = _weights(model, model.trainer.precision_plugin.amp), _weights(reference)
    start = checkpoint["state_dict"]
    update = torch.cat([(got[n] - start[n]).flatten() for n in want])
    wanted = torch.cat([(want[n] - start[n]).flatten() for n in want])
    gap = ((update - wanted).norm() / wanted.norm()).item()
    # The resumed steps' relative distance to the saving precision's, measured: 0.17 (bf16-mixed -> O2), 0.03 (32-true
    # -> O1); the same resume with AdamW's moments dropped from the checkpoint: 0.67 and 0.57.
    assert gap < 0.35, gap


def test_a_16_mixed_checkpoint_gives_its_grad_scaler_scale_to_the_dynamic_scaler(tmp_path: Any) -> None:
    """A ``"16-mixed"`` checkpoint (Lightning's ``GradScaler`` state, grown from 16 to 128) resumed at O2 float16
    starts from that scale, not from ``init_scale`` (which would cost the overflows of backing off again)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=1)
    trainer = make_trainer(max_steps=3, max_epochs=10, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    trainer.fit(Net(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=16))
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    assert scaler.get_scale() == 128.0
    checkpoint = torch.load(tmp_path / "run.ckpt", weights_only=False)
    at_start, _ = _fit("O2:float16", 4, ckpt=tmp_path / "run.ckpt")
    _assert_resumed_exactly(at_start, checkpoint)
    assert at_start.scale == 128.0  # was 65536.0 (init_scale): the checkpoint's scale silently dropped


@pytest.mark.parametrize("resumed", ["bf16-mixed", "32-true"])
def test_an_o2_float16_checkpoint_resumes_under_lightning_precision_with_fp32_weights_and_state(
    resumed: str, tmp_path: Any
) -> None:
    """Leaving the plugin: an O2 float16 checkpoint (its dynamic scale grown away from its start) resumed under
    Lightning's own precision starts from the FP32 masters (not their half rounding) and the AdamW moments exactly.
    (``precision="16-mixed"`` on a CPU is Lightning's ``"bf16-mixed"``; its scaler ignores the plugin's entry, as
    docs/lightning.md says.)"""
    path = tmp_path / "run.ckpt"
    _, model = _fit("O2:float16", 2, save=path, init_scale=2.0**4, growth_interval=1)
    masters = _weights(model, model.trainer.precision_plugin.amp)
    checkpoint = torch.load(path, weights_only=False)
    assert checkpoint["MixedPrecisionPlugin"]["scalers"][0]["scale"] == 64.0
    at_start, _ = _fit(resumed, 3, ckpt=path)
    _assert_resumed_exactly(at_start, checkpoint)
    for name, value in masters.items():
        assert torch.equal(at_start.fp32[name], value), name


def _fabric(spec: str) -> tuple[Any, Any, Any, Any]:
    from lightning.fabric import Fabric

    if spec == "O2":
        mpx = FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx])
    else:
        mpx, fabric = None, Fabric(accelerator="cpu", devices=1, precision=spec)
    net = _net()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    if mpx is not None:
        mpx.setup_optimizers(optimizer)  # docs/fabric.md: after fabric.setup, before fabric.load
    return fabric, mpx, model, optimizer


def _train(backward: Any, model: nn.Module, optimizer: Any, steps: int = 2) -> None:
    for step in range(steps):
        x, y = X[16 * step : 16 * step + 16], Y[16 * step : 16 * step + 16]
        backward(F.cross_entropy(model(x).float(), y))
        optimizer.step()
        optimizer.zero_grad()


def _fp32_and_state(amp: Any, model: nn.Module, optimizer: Any) -> tuple[list[torch.Tensor], dict[str, Any]]:
    inner = getattr(optimizer, "optimizer", optimizer)
    if amp is not None and amp.properties.master_weights:
        weights = [m.detach().clone() for m in amp.master_params(inner)]
    else:
        weights = [p.detach().clone() for p in model.parameters()]
    return weights, copy.deepcopy(optimizer.state_dict()["state"])


Snapshot = tuple[list[torch.Tensor], dict[str, Any]]


def _assert_same(got: Snapshot, want: Snapshot) -> None:
    for index, (value, reference) in enumerate(zip(*[w[0] for w in (got, want)])):
        assert value.dtype == torch.float32 and torch.equal(value, reference), f"parameter {index}"
    assert sorted(got[1]) == sorted(want[1])
    for index, state in want[1].items():
        for key, value in state.items():
            assert got[1][index][key].dtype == value.dtype and torch.equal(got[1][index][key], value), (index, key)


@pytest.mark.parametrize(("saved", "resumed"), [("bf16-mixed", "O2"), ("O2", "bf16-mixed")])
def test_fabric_switches_between_bf16_mixed_and_o2_with_weights_and_adamw_state(saved, resumed, tmp_path) -> None:
    """``fabric.save`` under one, ``fabric.load`` under the other (the plugin's entry in the state where the run has
    it; a ``"bf16-mixed"`` checkpoint has none, so the adopting run loads model and optimizer): FP32 weights and AdamW
    moments exactly; the O2 checkpoint's plugin entry comes back as the remainder under ``"bf16-mixed"``."""
    fabric, mpx, model, optimizer = _fabric(saved)
    _train(fabric.backward, model, optimizer)
    state = {"model": model, "optimizer": optimizer, **({"mpx": mpx} if mpx is not None else {})}
    fabric.save(tmp_path / "run.ckpt", state)
    want = _fp32_and_state(mpx and mpx.amp, model, optimizer)
    fabric, mpx, model, optimizer = _fabric(resumed)
    remainder = fabric.load(tmp_path / "run.ckpt", {"model": model, "optimizer": optimizer})
    assert list(remainder) == (["mpx"] if saved == "O2" else [])
    _assert_same(_fp32_and_state(mpx and mpx.amp, model, optimizer), want)
    _train(fabric.backward, model, optimizer, steps=1)


def _accelerator(spec: str) -> tuple[Any, Any, Any]:
    from accelerate import Accelerator as Upstream

    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    reset_accelerate_state()
    if spec == "O2":
        kwargs = MixedPrecisionKwargs(half_dtype="bfloat16")
        accelerator = Accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=[kwargs])
    else:
        accelerator = Upstream(mixed_precision=spec, cpu=True)
    net = _net()
    return (accelerator, *accelerator.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2)))


def test_accelerate_bf16_checkpoint_into_o2_names_how_to_keep_the_optimizer_state_and_that_way_works(
    tmp_path, fresh_accelerate_state
) -> None:
    """``load_state`` of a checkpoint of Accelerate's own ``"bf16"`` at O2 is refused (it has no engine file); the
    error names the way that keeps the AdamW moments (it said they start afresh), and that way gives the weights and
    moments exactly."""
    from safetensors.torch import load_file

    accelerator, model, optimizer = _accelerator("bf16")
    _train(accelerator.backward, model, optimizer)
    accelerator.save_state(str(tmp_path))
    want = _fp32_and_state(None, model, optimizer)
    accelerator, model, optimizer = _accelerator("O2")
    with pytest.raises(FileNotFoundError, match=r"load_state_dict\(torch.load\(os.path.join\(.*'optimizer.bin'"):
        accelerator.load_state(str(tmp_path))
    accelerator.unwrap_model(model).load_state_dict(load_file(os.path.join(tmp_path, "model.safetensors")))
    optimizer.load_state_dict(torch.load(os.path.join(tmp_path, "optimizer.bin")))
    _assert_same(_fp32_and_state(accelerator.amp, model, optimizer), want)
    _train(accelerator.backward, model, optimizer, steps=1)


def test_accelerate_o2_checkpoint_resumes_under_accelerate_bf16_with_weights_and_adamw_state(
    tmp_path, fresh_accelerate_state
) -> None:
    accelerator, model, optimizer = _accelerator("O2")
    _train(accelerator.backward, model, optimizer)
    accelerator.save_state(str(tmp_path))
    want = _fp32_and_state(accelerator.amp, model, optimizer)
    accelerator, model, optimizer = _accelerator("bf16")
    accelerator.load_state(str(tmp_path))
    _assert_same(_fp32_and_state(None, model, optimizer), want)


def test_a_plain_fp32_checkpoint_loads_into_the_core_o2_loop_and_its_fp32_state_dict_back() -> None:
    """``torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()})`` of an FP32 loop, loaded after
    ``prepare_model``/``prepare_optimizer``: the masters are its weights and AdamW's moments its own, FP32, keyed by
    the masters; and an O2 run's ``amp.fp32_state_dict(model)`` with its optimizer's state loads into plain FP32
    exactly."""
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(lambda loss: loss.backward(), model, optimizer)
    checkpoint = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    want = _fp32_and_state(None, model, optimizer)

    amp = Amp("O2", half_dtype="bfloat16")
    resumed = amp.prepare_model(_net())
    opt = amp.prepare_optimizer(torch.optim.AdamW(resumed.parameters(), lr=1e-2))
    resumed.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    _assert_same(_fp32_and_state(amp, resumed, opt), want)
    assert all(p.dtype == torch.float32 for p in opt.state)  # the state lives on the masters

    def backward(loss: torch.Tensor) -> None:
        amp.backward(loss)

    with amp.forward_context():
        loss = F.cross_entropy(amp.cast_outputs(resumed(amp.cast_inputs(X[:16]))), Y[:16])
    backward(loss)
    assert amp.step(opt)
    amp.update()
    back = {"model": amp.fp32_state_dict(resumed), "optimizer": opt.state_dict()}
    want = _fp32_and_state(amp, resumed, opt)
    plain = _net()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    plain.load_state_dict(back["model"])
    plain_opt.load_state_dict(back["optimizer"])
    _assert_same(_fp32_and_state(None, plain, plain_opt), want)
