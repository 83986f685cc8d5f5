"""Optimizer wrappers at O2, resumed mid-run (docs/master_weights.md, "Optimizer wrappers"): a timm-style Lookahead
through Fabric's ``fabric.save``/``fabric.load``, torch-optimizer's own ``Lookahead`` (whose ``load_state_dict``
leaves its groups and its inner optimizer's apart), and a Lookahead over a model with a frozen layer. Compared with
the unbroken run and with Lightning's ``"bf16-mixed"`` resumed the same way."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp, MixedPrecisionPlugin
from tests.lightning_helpers import make_trainer
from tests.test_lightning_optimizer_wrappers_resume import TimmLookahead, _batch, _net, _weights, _worst


class PackageLookahead(torch.optim.Optimizer):
    """torch-optimizer's ``Lookahead`` (torch_optimizer/lookahead.py, 0.3.0) as the package has it, with the one line
    lightning_mpx's error for it asks for (``Optimizer.__init__`` first) and ``add_``'s keyword form of its
    ``alpha``: slow weights in its own ``state`` keyed by ``id`` in its state dict, and a ``load_state_dict`` that
    loads its own groups and then the inner optimizer's, never sharing them again."""

    def __init__(self, optimizer: torch.optim.Optimizer, k: int = 5, alpha: float = 0.5, init: bool = True) -> None:
        if init:
            torch.optim.Optimizer.__init__(self, optimizer.param_groups, optimizer.defaults)
        self.optimizer = optimizer
        self.k = k
        self.alpha = alpha
        self.param_groups = self.optimizer.param_groups
        self.state: Any = defaultdict(dict)
        self.fast_state = self.optimizer.state
        for group in self.param_groups:
            group["counter"] = 0

    def _update(self, group: dict[str, Any]) -> None:
        for fast in group["params"]:
            param_state = self.state[fast]
            if "slow_param" not in param_state:
                param_state["slow_param"] = torch.clone(fast.data).detach()
            slow = param_state["slow_param"]
            fast.data.mul_(self.alpha).add_(slow, alpha=1.0 - self.alpha)
            slow.data.copy_(fast)

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = self.optimizer.step(closure=closure)
        for group in self.param_groups:
            if group["counter"] == 0:
                self._update(group)
            group["counter"] = (group["counter"] + 1) % self.k
        return loss

    def state_dict(self) -> dict[str, Any]:
        fast_state_dict = self.optimizer.state_dict()
        slow_state = {(id(k) if isinstance(k, torch.Tensor) else k): v for k, v in self.state.items()}
        return {
            "fast_state": fast_state_dict["state"],
            "slow_state": slow_state,
            "param_groups": fast_state_dict["param_groups"],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        slow_state_dict = {"state": state_dict["slow_state"], "param_groups": state_dict["param_groups"]}
        fast_state_dict = {"state": state_dict["fast_state"], "param_groups": state_dict["param_groups"]}
        super().load_state_dict(slow_state_dict)
        self.optimizer.load_state_dict(fast_state_dict)
        self.fast_state = self.optimizer.state

    def zero_grad(self) -> None:  # type: ignore[override]
        self.optimizer.zero_grad()


def _package(params: Any) -> PackageLookahead:
    return PackageLookahead(torch.optim.SGD(params, lr=0.1, momentum=0.9), k=2)


# -- torch-optimizer's Lookahead, core Amp ------------------------------------------------------------------------
def _amp_run(level: str | None, resume_at: int | None = None, steps: int = 6) -> dict[str, torch.Tensor]:
    def build() -> tuple[Amp | None, nn.Module, Any]:
        amp = None if level is None else Amp(level, half_dtype="bfloat16")
        model = _net()
        if amp is None:
            return amp, model, _package(model.parameters())
        model = amp.prepare_model(model)
        return amp, model, amp.prepare_optimizer(_package(model.parameters()))

    def train(amp: Amp | None, model: nn.Module, opt: Any, steps: range) -> None:
        for i in steps:
            x, y = _batch(i)
            if amp is None:
                F.mse_loss(model(x), y).backward()
                opt.step()
            else:
                with amp.forward_context():
                    loss = F.mse_loss(amp.cast_outputs(model(amp.cast_inputs(x))).float(), y)
                amp.backward(loss)
                amp.step(opt)
                amp.update()
            opt.zero_grad()

    amp, model, opt = build()
    train(amp, model, opt, range(resume_at or steps))
    if resume_at is None:
        return _weights(model)
    saved = {"opt": opt.state_dict(), "amp": None if amp is None else amp.state_dict()}
    saved["model"] = _weights(model) if amp is None else amp.fp32_state_dict(model)
    amp, model, opt = build()
    if amp is not None:
        amp.load_state_dict(saved["amp"])
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    train(amp, model, opt, range(resume_at, steps))
    again = opt.state_dict()["fast_state"]  # saved again after the resume: keyed by the parameters, in FP32
    assert set(again) == {0, 1, 2, 3} and all(s["momentum_buffer"].dtype == torch.float32 for s in again.values())
    return _weights(model)


def test_package_lookahead_resumed_at_o2_trains_as_fp32_resumed() -> None:
    fp32, o2 = _amp_run(None, resume_at=3), _amp_run("O2", resume_at=3)
    stopped = _amp_run(None, steps=3)  # where a run that stopped training after the resume would be
    assert _worst(fp32, stopped) > 5e-2, _worst(fp32, stopped)
    assert _worst(o2, fp32) <= 1e-2, _worst(o2, fp32)


def test_package_lookahead_without_optimizer_init_refused_by_name() -> None:
    # the package as published never runs Optimizer.__init__: no hooks to put on it (and torch's own
    # load_state_dict fails on it even in FP32)
    amp = Amp("O2", half_dtype="bfloat16")
    model = amp.prepare_model(_net())
    with pytest.raises(TypeError, match=r"optimizer=PackageLookahead never ran torch.optim.Optimizer.__init__"):
        amp.prepare_optimizer(PackageLookahead(torch.optim.SGD(model.parameters(), lr=0.1), init=False))


# -- torch-optimizer's Lookahead, the Trainer -----------------------------------------------------------------------
class _Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return F.mse_loss(self.net(batch[0]).float(), batch[1])

    def configure_optimizers(self) -> Any:
        return _package(self.parameters())


def _fit_resumed(tmp_path: Any, plugin: bool, **precision: Any) -> tuple[dict[str, torch.Tensor], ...]:
    """An epoch of three steps, checkpointed, and a new Trainer resuming from it for a second epoch (a checkpoint
    saved where ``max_steps`` stopped a fit resumes into no step at all); the weights at the checkpoint and at the
    end."""
    xs, ys = zip(*map(_batch, range(3)))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=8)

    def trainer(epochs: int) -> pl.Trainer:
        o2 = MixedPrecisionPlugin("O2", half_dtype="bfloat16") if plugin else None
        return make_trainer(o2, max_epochs=epochs, **precision)

    first, module = trainer(1), _Module()
    first.fit(module, data)
    first.save_checkpoint(tmp_path / "mid.ckpt")
    at_checkpoint = _weights(module.net)
    module = _Module()
    trainer(2).fit(module, data, ckpt_path=tmp_path / "mid.ckpt")
    return at_checkpoint, _weights(module.net)


def test_package_lookahead_trainer_resumed_at_o2_as_bf16_mixed(tmp_path: Any) -> None:
    (mid, want), (_, fp32) = _fit_resumed(tmp_path, False, precision="bf16-mixed"), _fit_resumed(tmp_path, False)
    got = _fit_resumed(tmp_path, True)[1]
    assert _worst(want, mid) > 1e-2, _worst(want, mid)  # it trained after the resume
    assert _worst(got, want) <= 2e-3 + _worst(want, fp32), (_worst(got, want), _worst(want, fp32))


# -- a timm-style Lookahead through Fabric --------------------------------------------------------------------------
def test_lookahead_fabric_load_before_the_plugin_knew_it_refused_setup_optimizers_resumes(tmp_path: Any) -> None:
    """``fabric.load`` into a Lookahead the plugin had not met (Fabric hands it the optimizer at its first step)
    rounds its inner optimizer's FP32 state to half and keys it by the half parameters, which the step on the masters
    never finds (momentum dropped: ~7e-2 off the unbroken run): refused at the next step, as for any optimizer;
    ``plugin.setup_optimizers(opt)`` before the load resumes as the unbroken run."""
    import lightning.fabric as L

    from lightning_mpx import FabricMixedPrecisionPlugin

    def run(resume: bool, setup_optimizers: bool = True) -> dict[str, torch.Tensor]:
        def build() -> Any:
            plugin = FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")
            fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
            net = _net()  # the optimizer set up apart: met at its first step (fabric.setup(model, opt) meets it)
            model = fabric.setup_module(net)
            opt = fabric.setup_optimizers(TimmLookahead(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)))
            if setup_optimizers:
                plugin.setup_optimizers(opt)
            return fabric, model, opt

        fabric, model, opt = build()
        for i in range(6):
            if resume and i == 3:
                fabric.save(tmp_path / "c.ckpt", {"model": model, "opt": opt})
                fabric, model, opt = build()
                fabric.load(tmp_path / "c.ckpt", {"model": model, "opt": opt})
            x, y = _batch(i)
            fabric.backward(F.mse_loss(model(x).float(), y))
            opt.step()
            opt.zero_grad()
        return _weights(model)

    assert _worst(run(True), run(False)) <= 1e-5
    refused = r"optimizer=TimmLookahead has state .* plugin.setup_optimizers\(optimizer\)"
    with pytest.raises(RuntimeError, match=refused):
        run(True, setup_optimizers=False)


# -- a Lookahead over a model with a frozen layer -------------------------------------------------------------------
def _frozen_run(resume: bool, k: int, amp_first: bool = True) -> dict[str, torch.Tensor]:
    """Layer 0 trains two steps and is frozen for two; resumed there (``resume``: into a new model with the layer
    frozen before preparing, so it has no master), one more step frozen, then unfrozen for two."""

    def build(frozen: bool) -> tuple[Amp, nn.Module, Any]:
        amp, model = Amp("O2", half_dtype="bfloat16"), _net()
        model[0].requires_grad_(not frozen)
        model = amp.prepare_model(model)
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return amp, model, amp.prepare_optimizer(TimmLookahead(inner, k=k))

    def train(amp: Amp, model: nn.Module, opt: Any, steps: range) -> None:
        for i in steps:
            x, y = _batch(i)
            with amp.forward_context():
                loss = F.mse_loss(amp.cast_outputs(model(amp.cast_inputs(x))).float(), y)
            amp.backward(loss)
            amp.step(opt)
            amp.update()
            opt.zero_grad()

    amp, model, opt = build(False)
    train(amp, model, opt, range(2))
    model[0].requires_grad_(False)
    train(amp, model, opt, range(2, 4))
    if resume:
        saved = {"opt": opt.state_dict(), "amp": amp.state_dict(), "model": amp.fp32_state_dict(model)}
        assert {0, 1} <= set(saved["opt"]["state"])  # the frozen layer's momentum saved
        amp, model, opt = build(True)
        if amp_first:
            amp.load_state_dict(saved["amp"])
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        if not amp_first:
            amp.load_state_dict(saved["amp"])
    train(amp, model, opt, range(4, 5))
    model[0].requires_grad_(True)
    train(amp, model, opt, range(5, 7))
    return _weights(model)


@pytest.mark.parametrize("amp_first", [True, False])
@pytest.mark.parametrize("k", [2, 100])
def test_lookahead_frozen_layer_resumed_at_o2_as_unbroken(k: int, amp_first: bool) -> None:
    resumed, unbroken = _frozen_run(True, k, amp_first), _frozen_run(False, k)
    assert _worst(resumed, unbroken) <= 1e-5, _worst(resumed, unbroken)
