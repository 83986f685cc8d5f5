"""Schedule-free optimizers (facebookresearch/schedule_free) at O2 through Fabric and the Trainer, held to
``"bf16-mixed"`` on the same code: the user calls ``optimizer.train()`` before training and ``optimizer.eval()``
before evaluating (Fabric's ``_FabricOptimizer`` and Lightning's ``self.optimizers()`` forward them to the optimizer,
whose groups hold the half parameters between steps while its state is keyed by the FP32 masters). The model must be
evaluated, checkpointed and resumed at the averaged point, as in ``"bf16-mixed"``. Tiny MLP, CPU, bfloat16."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin, MixedPrecisionPlugin
from tests.lightning_helpers import classification_data, loader
from tests.test_accelerate_schedule_free import ClosureScheduleFreeSGD, ScheduleFreeSGD

HALF = "bfloat16"
Weights = dict[str, torch.Tensor]


class ScheduleFreeAdamW(torch.optim.Optimizer):
    """``schedulefree.AdamWScheduleFree`` without warm-up or weight decay: ``eval()``/``train()`` lerp the parameters
    between the training point ``y`` and the averaged point ``x`` by ``1 - 1/beta1`` / ``1 - beta1``."""

    def __init__(self, params: Any, lr: float = 0.01, betas: tuple[float, float] = (0.9, 0.999)) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=1e-8, train_mode=True, k=0))

    @torch.no_grad()
    def _move(self, to_train: bool) -> None:
        for group in self.param_groups:
            if group["train_mode"] != to_train:
                beta1 = group["betas"][0]
                for p in group["params"]:
                    state = self.state[p]
                    if "z" in state:
                        p.lerp_(end=state["z"], weight=1 - beta1 if to_train else 1 - 1 / beta1)
                group["train_mode"] = to_train

    def eval(self) -> None:
        self._move(False)

    def train(self) -> None:
        self._move(True)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            assert group["train_mode"], "step() in eval mode"
            group["k"] += 1
            k, (beta1, beta2) = group["k"], group["betas"]
            ckp1 = 1 / k
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "z" not in state:
                    state["z"], state["v"] = p.clone(), torch.zeros_like(p)
                z, v = state["z"], state["v"]
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                grad = p.grad / ((v / (1 - beta2**k)).sqrt() + group["eps"])
                p.lerp_(end=z, weight=ckp1)
                p.add_(grad, alpha=group["lr"] * (beta1 * (1 - ckp1) - 1))
                z.sub_(grad, alpha=group["lr"])


_OPTIMIZERS = {"sgd": ScheduleFreeSGD, "adamw": ScheduleFreeAdamW}


def _net() -> nn.Module:
    torch.manual_seed(0)  # a batch norm (FP32 at O2, its own master) next to half layers
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.GELU(), nn.Linear(32, 4))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g)


def _floats(state: dict[str, Any]) -> Weights:
    return {k: v.float().clone() for k, v in state.items() if v.is_floating_point()}


def _close(got: Weights, want: Weights, atol: float) -> None:
    assert got.keys() == want.keys()
    gap = max((got[k] - want[k]).abs().max().item() for k in got)
    assert gap <= atol, gap


# --- Fabric --------------------------------------------------------------------------------------------------------


def _fabric(precision: str) -> tuple[Any, FabricMixedPrecisionPlugin | None]:
    from lightning.fabric import Fabric

    plugin = FabricMixedPrecisionPlugin(precision, half_dtype=HALF) if precision == "O2" else None
    if plugin is not None:
        return Fabric(accelerator="cpu", devices=1, plugins=[plugin]), plugin
    return Fabric(accelerator="cpu", devices=1, precision=precision), None  # type: ignore[arg-type]


def _fabric_epochs(fabric: Any, model: nn.Module, opt: Any, epochs: int, last: bool = True) -> list[float]:
    """``epochs`` of ``train()``, steps, ``eval()`` and an evaluation (not after the last one unless ``last``)."""
    x, y = _data()
    losses = []
    for epoch in range(epochs):
        model.train()
        opt.train()
        for i in range(0, 64, 16):
            fabric.backward(F.cross_entropy(model(x[i : i + 16]), y[i : i + 16]))
            opt.step()
            opt.zero_grad()
        model.eval()
        opt.eval()
        if last or epoch < epochs - 1:
            with torch.no_grad():
                losses.append(F.cross_entropy(model(x), y).item())
    return losses


def _fabric_run(precision: str, kind: str, path: str) -> tuple[list[float], Weights, Weights]:
    """Two epochs, the first evaluated after ``optimizer.eval()``; saved right after the second's ``eval()`` (no
    forward between); resumed in a new Fabric, which calls ``train()``, trains one epoch and evaluates. Returns the
    losses, the weights after the first run's last ``train()`` and the resumed run's weights after its ``train()``."""
    fabric, plugin = _fabric(precision)
    net = _net()
    model, opt = fabric.setup(net, _OPTIMIZERS[kind](net.parameters()))
    losses = _fabric_epochs(fabric, model, opt, 2, last=False)
    fabric.save(path, {"model": model, "optimizer": opt})
    opt.train()
    with torch.no_grad():  # a forward (the engine's first look since train()), then the weights
        model(_data()[0])
    first = _floats(plugin.amp.fp32_state_dict(model.module) if plugin else model.module.state_dict())
    fabric, plugin = _fabric(precision)
    net = _net()
    model, opt = fabric.setup(net, _OPTIMIZERS[kind](net.parameters()))
    if plugin is not None:  # before fabric.load (docs/fabric.md): the O2 state loads into the FP32 masters
        plugin.setup_optimizers(opt)
    fabric.load(path, {"model": model, "optimizer": opt})
    losses += _fabric_epochs(fabric, model, opt, 1)
    opt.train()
    with torch.no_grad():
        model(_data()[0])
    resumed = _floats(plugin.amp.fp32_state_dict(model.module) if plugin else model.module.state_dict())
    return losses, first, resumed


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_fabric_o2_schedule_free_eval_train_and_eval_mode_checkpoint_resume_as_bf16_mixed(kind: str, tmp_path) -> None:
    # Before: optimizer.eval() through _FabricOptimizer moved nothing at O2 (groups hold the half parameters, state is
    # keyed by the masters): evaluated and saved at the training point, 2e-3..5e-3 off in loss, silently.
    ref_losses, ref_first, ref_resumed = _fabric_run("bf16-mixed", kind, str(tmp_path / "ref.ckpt"))
    losses, first, resumed = _fabric_run("O2", kind, str(tmp_path / "o2.ckpt"))
    assert losses == pytest.approx(ref_losses, abs=3e-4)
    _close(first, ref_first, 2e-3)
    _close(resumed, ref_resumed, 2e-3)


def test_fabric_o1_schedule_free_is_unchanged() -> None:
    from lightning.fabric import Fabric

    losses = {}
    for name, fabric in (("O1", Fabric(accelerator="cpu", devices=1,
                                       plugins=[FabricMixedPrecisionPlugin("O1", half_dtype=HALF)])),
                         ("ref", _fabric("bf16-mixed")[0])):  # fmt: skip
        net = _net()
        model, opt = fabric.setup(net, ScheduleFreeSGD(net.parameters()))
        losses[name] = _fabric_epochs(fabric, model, opt, 2)
    assert losses["O1"] == pytest.approx(losses["ref"], abs=3e-4)


# --- Trainer -------------------------------------------------------------------------------------------------------


class _ScheduleFreeLM(pl.LightningModule):
    """The schedulefree README's Lightning habit: ``train()`` at each training epoch's start, ``eval()`` at each
    validation epoch's start and at the end of training."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()
        self.val_losses: list[float] = []

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x).float(), y)

    def validation_step(self, batch: Any, index: int) -> None:
        x, y = batch
        self.val_losses.append(F.cross_entropy(self.net(x).float(), y).item())

    def on_train_epoch_start(self) -> None:
        self.optimizers().train()

    def on_validation_epoch_start(self) -> None:
        if not self.trainer.sanity_checking:
            self.optimizers().eval()

    def on_train_end(self) -> None:
        self.optimizers().eval()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return ClosureScheduleFreeSGD(self.parameters())


def _trainer_fit(precision: str, epochs: int, root: str, ckpt: str | None = None) -> tuple[list[float], Weights, Any]:
    """Fits (validating each epoch when not resumed; resumed from ``ckpt``: no validation, so on_train_end's
    ``eval()`` is followed by no forward); returns the validation losses, the final weights and the checkpoint."""
    plugin = MixedPrecisionPlugin(precision, half_dtype=HALF) if precision == "O2" else None
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, max_epochs=epochs, default_root_dir=root,
                         num_sanity_val_steps=0, limit_val_batches=0 if ckpt else None,
                         **({"plugins": [plugin]} if plugin else {"precision": precision}))  # fmt: skip
    module = _ScheduleFreeLM()
    data = loader(classification_data(n=64, features=8))
    trainer.fit(module, data, data, ckpt_path=ckpt)
    model = {k: v.detach().clone() for k, v in module.net.named_parameters()}  # as the fit left the model
    weights = _floats(plugin.amp.fp32_state_dict(module.net) if plugin else module.net.state_dict())
    for name, value in model.items():  # the model holds (the half rounding of) the point the weights are at
        assert torch.equal(value, weights[name].to(value.dtype)), name
    return module.val_losses, weights, trainer.checkpoint_callback.best_model_path


def _trainer_run(precision: str, tmp_path: Any) -> tuple[list[float], Weights, Weights]:
    losses, weights, ckpt = _trainer_fit(precision, 2, str(tmp_path / precision / "a"))
    _, resumed, _ = _trainer_fit(precision, 3, str(tmp_path / precision / "b"), ckpt)
    return losses, weights, resumed


def test_trainer_o2_schedule_free_validates_ends_and_resumes_at_the_averaged_point_as_bf16_mixed(tmp_path) -> None:
    # Before: self.optimizers().eval() moved nothing at O2: validated, ended and checkpointed at the training point.
    losses, weights, resumed = _trainer_run("O2", tmp_path)
    ref_losses, ref_weights, ref_resumed = _trainer_run("bf16-mixed", tmp_path)
    assert losses == pytest.approx(ref_losses, abs=3e-4)
    _close(weights, ref_weights, 2e-3)
    # resumed from the checkpoint saved after validation (eval mode), trained, then on_train_end's eval() with no
    # forward after it: the model and its export at the averaged point, as bf16-mixed
    _close(resumed, ref_resumed, 2e-3)
