"""Optimizer wrappers that share ``param_groups`` with an inner optimizer (Lookahead, SAM's ``base_optimizer``) at O2,
checkpointed mid-run: the inner optimizer's state dict is keyed by the parameters the user sees, in FP32, and a resume
restores its momentum (docs/master_weights.md, "Optimizer wrappers"). Compared with Lightning's ``"bf16-mixed"`` of the
same code, and a resumed run with an unbroken one."""

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
from tests.test_core_sam import DoorSAM as _DoorSAM


class TimmLookahead(torch.optim.Optimizer):
    """timm's ``Lookahead`` (with ``Optimizer.__init__`` run): slow weights in the base optimizer's state, its
    ``state_dict()`` the base optimizer's."""

    def __init__(self, base_optimizer: torch.optim.Optimizer, alpha: float = 0.5, k: int = 2) -> None:
        super().__init__(base_optimizer.param_groups, base_optimizer.defaults)
        self._base_optimizer = base_optimizer
        self.param_groups = base_optimizer.param_groups
        for group in self.param_groups:
            group.setdefault("lookahead_alpha", alpha)
            group.setdefault("lookahead_k", k)
            group.setdefault("lookahead_step", 0)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = self._base_optimizer.step(closure)
        for group in self._base_optimizer.param_groups:
            group["lookahead_step"] += 1
            if group["lookahead_step"] % group["lookahead_k"] == 0:
                for fast_p in group["params"]:
                    param_state = self._base_optimizer.state[fast_p]
                    slow = param_state.setdefault("lookahead_slow_buff", fast_p.detach().clone())
                    slow.add_(fast_p - slow, alpha=group["lookahead_alpha"])
                    fast_p.copy_(slow)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._base_optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self._base_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._base_optimizer.load_state_dict(state_dict)
        self.param_groups = self._base_optimizer.param_groups


class TorchOptimizerLookahead(torch.optim.Optimizer):
    """torch-optimizer's ``Lookahead`` (with ``Optimizer.__init__`` run): slow weights in its own state; its state
    dict the inner one's ``state`` and groups beside its own."""

    def __init__(self, optimizer: torch.optim.Optimizer, k: int = 2, alpha: float = 0.5) -> None:
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.optimizer, self.k, self.alpha = optimizer, k, alpha
        self.param_groups = self.optimizer.param_groups
        self.state: Any = defaultdict(dict)
        for group in self.param_groups:
            group["counter"] = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = self.optimizer.step(closure)
        for group in self.param_groups:
            if group["counter"] == 0:
                for fast in group["params"]:
                    slow = self.state[fast].setdefault("slow_param", fast.detach().clone())
                    slow += (fast - slow) * self.alpha
                    fast.copy_(slow)
            group["counter"] = (group["counter"] + 1) % self.k
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        fast = self.optimizer.state_dict()
        return {"fast_state": fast["state"], "slow": super().state_dict(), "param_groups": fast["param_groups"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict["slow"])
        self.optimizer.load_state_dict({"state": state_dict["fast_state"], "param_groups": state_dict["param_groups"]})
        self.param_groups = self.optimizer.param_groups


class DoorSAM(_DoorSAM):
    """davda54's SAM in the form docs/master_weights.md gives (tests/test_core_sam.py's ``DoorSAM``: restore in
    ``second_step``, base step in ``step``), with a state dict that holds the base optimizer's."""

    def state_dict(self) -> dict[str, Any]:
        return {"sam": super().state_dict(), "base": self.base_optimizer.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict["sam"])
        self.base_optimizer.load_state_dict(state_dict["base"])
        self.param_groups = self.base_optimizer.param_groups


def _wrapped(shape: str, params: Any) -> torch.optim.Optimizer:
    if shape == "timm":
        return TimmLookahead(torch.optim.SGD(params, lr=0.1, momentum=0.9))
    if shape == "torch_optimizer":
        return TorchOptimizerLookahead(torch.optim.SGD(params, lr=0.1, momentum=0.9))
    return DoorSAM(params, torch.optim.SGD, lr=0.1, momentum=0.9)


def _inner(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return getattr(opt, "_base_optimizer", None) or getattr(opt, "optimizer", None) or opt.base_optimizer


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    x = torch.randn(8, 4, generator=g)
    return x, x.sum(1, keepdim=True).tanh()


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


# -- the core Amp -------------------------------------------------------------------------------------------------
def _amp_steps(amp: Amp | None, model: nn.Module, opt: Any, steps: range) -> None:
    for i in steps:
        x, y = _batch(i)
        if amp is None:
            loss = F.mse_loss(model(x), y)
            loss.backward()
        else:
            with amp.forward_context():
                loss = F.mse_loss(amp.cast_outputs(model(amp.cast_inputs(x))).float(), y)
            amp.backward(loss)
        if isinstance(opt, DoorSAM):
            opt.first_step(zero_grad=True)
            if amp is None:
                F.mse_loss(model(x), y).backward()
            else:
                with amp.forward_context():
                    loss = F.mse_loss(amp.cast_outputs(model(amp.cast_inputs(x))).float(), y)
                amp.backward(loss)
            opt.second_step()
        if amp is None:
            opt.step()
        else:
            amp.step(opt)
            amp.update()
        opt.zero_grad()


def _amp_run(shape: str, level: str | None, resume_at: int | None = None, steps: int = 6) -> dict[str, torch.Tensor]:
    """``steps`` steps of ``shape`` under ``Amp(level)`` (FP32 without one); ``resume_at``: the model, the optimizer
    and the engine saved after that many steps and loaded into new ones that continue."""

    def build() -> tuple[Amp | None, nn.Module, Any]:
        amp = None if level is None else Amp(level, half_dtype="bfloat16")
        model = _net()
        if amp is None:
            return amp, model, _wrapped(shape, model.parameters())
        model = amp.prepare_model(model)
        return amp, model, amp.prepare_optimizer(_wrapped(shape, model.parameters()))

    amp, model, opt = build()
    if resume_at is None:
        _amp_steps(amp, model, opt, range(steps))
        return _weights(model)
    _amp_steps(amp, model, opt, range(resume_at))
    saved = {"opt": opt.state_dict(), "amp": None if amp is None else amp.state_dict()}
    saved["model"] = _weights(model) if amp is None else amp.fp32_state_dict(model)
    inner = saved["opt"]["base"]["state"] if shape == "sam" else saved["opt"].get("fast_state") or saved["opt"]["state"]
    assert set(inner) == {0, 1, 2, 3}, inner.keys()  # keyed by the parameters' indices, one entry each
    assert all(s["momentum_buffer"].dtype == torch.float32 for s in inner.values())
    amp, model, opt = build()
    if amp is not None:
        amp.load_state_dict(saved["amp"])
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    _amp_steps(amp, model, opt, range(resume_at, steps))
    return _weights(model)


@pytest.mark.parametrize("shape", ["timm", "torch_optimizer", "sam"])
def test_wrapper_checkpoint_mid_run_resumes_as_unbroken_at_o2(shape: str) -> None:
    fp32 = _amp_run(shape, None)
    unbroken, resumed = _amp_run(shape, "O2"), _amp_run(shape, "O2", resume_at=3)
    assert _worst(fp32, {k: v for k, v in _weights(_net()).items()}) > 1e-2  # it trained
    # the momentum restored: a resume that dropped it is off the unbroken run by far more (measured: ~1e-2)
    assert _worst(resumed, unbroken) <= 1e-5, _worst(resumed, unbroken)
    assert _worst(resumed, fp32) <= 2e-2, _worst(resumed, fp32)


def test_sam_base_optimizer_state_dict_after_a_step_at_o2() -> None:
    amp = Amp("O2", half_dtype="bfloat16")
    model = amp.prepare_model(_net())
    sam = amp.prepare_optimizer(_wrapped("sam", model.parameters()))
    _amp_steps(amp, model, sam, range(1))
    state = sam.base_optimizer.state_dict()["state"]
    assert set(state) == {0, 1, 2, 3} and all(s["momentum_buffer"].dtype == torch.float32 for s in state.values())
    assert isinstance(sam.param_groups[0]["params"][0], nn.Parameter)  # the model's own, after the state dict


# -- the Trainer (automatic optimization) -----------------------------------------------------------------------------
class _Module(pl.LightningModule):
    def __init__(self, shape: str) -> None:
        super().__init__()
        self.net, self.shape = _net(), shape

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return F.mse_loss(self.net(batch[0]).float(), batch[1])

    def configure_optimizers(self) -> Any:
        return _wrapped(self.shape, self.parameters())


def _fit(shape: str, tmp_path: Any = None, **precision: Any) -> dict[str, torch.Tensor]:
    """Six steps of one epoch; with ``tmp_path``: a checkpoint after three, and a new Trainer resuming from it for a
    second epoch."""
    xs, ys = zip(*map(_batch, range(6)))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=8)
    plugin = precision.pop("plugin", None)
    module = _Module(shape)
    if tmp_path is None:
        make_trainer(plugin() if plugin else None, **precision).fit(module, data)
        return _weights(module.net)
    trainer = make_trainer(plugin() if plugin else None, max_steps=3, **precision)
    trainer.fit(module, data)
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    state = torch.load(tmp_path / "mid.ckpt", weights_only=False)["optimizer_states"][0]
    assert set(state.get("fast_state") or state["state"]) == {0, 1, 2, 3}
    module = _Module(shape)
    trainer = make_trainer(plugin() if plugin else None, max_epochs=2, **precision)
    trainer.fit(module, data, ckpt_path=tmp_path / "mid.ckpt")
    assert trainer.global_step > 3  # the resumed run stepped (a checkpoint where max_steps stopped ends its epoch)
    return _weights(module.net)


def _o2() -> MixedPrecisionPlugin:
    return MixedPrecisionPlugin("O2", half_dtype="bfloat16")


@pytest.mark.parametrize("shape", ["timm", "torch_optimizer"])
def test_lookahead_trainer_checkpoint_mid_run_at_o2_as_bf16_mixed(shape: str, tmp_path: Any) -> None:
    want, fp32 = _fit(shape, tmp_path, precision="bf16-mixed"), _fit(shape, tmp_path)
    got = _fit(shape, tmp_path, plugin=_o2)
    assert _worst(want, _weights(_net())) > 1e-2  # it trained
    assert _worst(got, want) <= 2e-3 + _worst(want, fp32), (_worst(got, want), _worst(want, fp32))


class _LateInner(torch.optim.Optimizer):
    """A wrapper whose inner optimizer is made on its groups after it was prepared."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, dict(lr=0.1))
        self.inner: torch.optim.Optimizer | None = None

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        return self.inner.step(closure)  # type: ignore[union-attr]

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "case",
    [
        "inner_made_after_prepare",
        "two_wrappers_one_inner",
    ],
)
def test_inner_state_dict_keyed_by_parameters_at_o2(case: str) -> None:
    amp = Amp("O2", half_dtype="bfloat16")
    model = amp.prepare_model(_net())
    if case == "inner_made_after_prepare":
        opt = amp.prepare_optimizer(_LateInner(model.parameters()))
        opt.inner = torch.optim.SGD(opt.param_groups, lr=0.1, momentum=0.9)
        others = [opt]
    else:
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt, other = amp.prepare_optimizer(TimmLookahead(inner)), amp.prepare_optimizer(TimmLookahead(inner))
        others = [other, opt]
    _amp_steps(amp, model, opt, range(2))
    for each in others:
        state = each.state_dict()["state"]
        assert set(state) == {0, 1, 2, 3} and all(s["momentum_buffer"].dtype == torch.float32 for s in state.values())
    assert all(isinstance(p, nn.Parameter) for g in opt.param_groups for p in g["params"])
