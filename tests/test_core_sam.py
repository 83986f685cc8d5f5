"""Sharpness-aware minimization (SAM, davda54/sam: ``first_step`` climbs to ``w + rho * g / ||g||`` and clears the
gradients, a second backward at the perturbed weights, ``second_step`` restores ``w`` and steps its base optimizer)
through every front door: the core ``Amp``, the Trainer's manual optimization, Fabric and the Accelerate adapter, at
O2 bfloat16 (against Fabric's own ``"bf16-mixed"``) and O1 float16 (against FP32: ``"16-mixed"``'s GradScaler would
step the base optimizer with scaled gradients unless the user unscales). The documented recipe (docs/master_weights.md,
"SAM and two-pass optimizers"): ``second_step`` undoes the perturbation only and the door's optimizer step runs the
base step; davda54's own ``second_step`` (a base step the engine never sees) is refused, naming the recipe."""

from __future__ import annotations

import functools
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

STEPS = 4


class SAM(torch.optim.Optimizer):
    """davda54/sam, as users copy it."""

    def __init__(self, params: Any, base_optimizer_cls: type, rho: float = 0.05, **kw: Any) -> None:
        super().__init__(params, dict(rho=rho, **kw))
        self.base_optimizer = base_optimizer_cls(self.param_groups, **kw)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> None:
        grads = [p.grad.norm(2) for g in self.param_groups for p in g["params"] if p.grad is not None]
        grad_norm = torch.norm(torch.stack(grads), 2)
        for g in self.param_groups:
            scale = g["rho"] / (grad_norm + 1e-12)
            for p in g["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                p.add_(p.grad * scale.to(p))
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()


class DoorSAM(SAM):
    """The recipe: ``second_step`` only undoes the perturbation; ``step()`` is the base step, run by the door."""

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if "old_p" in self.state[p]:
                    p.data = self.state[p].pop("old_p")

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        return self.base_optimizer.step(closure)


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    x = torch.randn(8, 4, generator=g)
    return x, x.sum(1, keepdim=True).tanh()


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k.removeprefix("net."): v.detach().float().clone() for k, v in model.state_dict().items()}


def _iteration(backward: Callable[[], None], optimizer: Any, step: Callable[[], Any]) -> None:
    """One SAM iteration: the recipe's (``step`` after ``second_step``), or davda54's (``second_step`` steps)."""
    backward()
    optimizer.first_step(zero_grad=True)
    backward()
    if isinstance(optimizer, DoorSAM) or isinstance(getattr(optimizer, "optimizer", None), DoorSAM):
        optimizer.second_step()
        step()
        optimizer.zero_grad()
    else:
        optimizer.second_step(zero_grad=True)


def _core(opt_level: str, half_dtype: str, cls: type = DoorSAM) -> dict[str, torch.Tensor]:
    from lightning_mpx import Amp

    amp = Amp(opt_level, half_dtype=half_dtype)
    model = amp.prepare_model(_net())
    optimizer = amp.prepare_optimizer(cls(model.parameters(), torch.optim.SGD, lr=0.1))
    for i in range(STEPS):
        x, y = _batch(i)

        def backward() -> None:
            with amp.forward_context():
                loss = F.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)
            amp.backward(loss)

        _iteration(backward, optimizer, functools.partial(amp.step, optimizer))
    return _weights(model)


def _fabric(opt_level: str | None, half_dtype: str | None, precision: str = "32-true", setup: bool = True) -> Any:
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    plugin = FabricMixedPrecisionPlugin(opt_level, half_dtype=half_dtype) if opt_level else None
    fabric = Fabric(accelerator="cpu", devices=1, **({"plugins": [plugin]} if plugin else {"precision": precision}))
    model = _net()
    model, optimizer = fabric.setup(model, DoorSAM(model.parameters(), torch.optim.SGD, lr=0.1))
    if plugin is not None and setup:
        plugin.setup_optimizers(optimizer)  # the plugin meets it before first_step (see the recipe)
    for i in range(STEPS):
        x, y = _batch(i)
        _iteration(lambda: fabric.backward(F.mse_loss(model(x).float(), y)), optimizer, optimizer.step)
    return _weights(model.module)


def _accelerate(opt_level: str, half_dtype: str) -> dict[str, torch.Tensor]:
    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

    accelerator = Accelerator(mixed_precision=opt_level, cpu=True, kwargs_handlers=[
        MixedPrecisionKwargs(half_dtype=half_dtype)
    ])
    model = _net()
    model, optimizer = accelerator.prepare(model, DoorSAM(model.parameters(), torch.optim.SGD, lr=0.1))
    sam = optimizer.optimizer  # AcceleratedOptimizer delegates no attribute: first_step is the wrapped SAM's
    for i in range(STEPS):
        x, y = _batch(i)
        backward = lambda: accelerator.backward(F.mse_loss(model(x).float(), y))  # noqa: E731
        backward()
        sam.first_step(zero_grad=True)
        backward()
        sam.second_step()
        optimizer.step()
        optimizer.zero_grad()
    return _weights(accelerator.unwrap_model(model))


def _trainer(opt_level: str, half_dtype: str) -> dict[str, torch.Tensor]:
    import lightning.pytorch as pl

    from lightning_mpx import MixedPrecisionPlugin

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            optimizer = self.optimizers()  # LightningOptimizer: first_step/second_step are SAM's
            _iteration(lambda: self.manual_backward(F.mse_loss(self.net(x).float(), y)), optimizer, optimizer.step)

        def configure_optimizers(self) -> Any:
            return DoorSAM(self.net.parameters(), torch.optim.SGD, lr=0.1)

    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, plugins=[MixedPrecisionPlugin(opt_level, half_dtype=half_dtype)],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    module = Module()
    trainer.fit(module, torch.utils.data.DataLoader([_batch(i) for i in range(STEPS)], batch_size=None))
    return _weights(module)


@functools.lru_cache(maxsize=None)
def _reference(precision: str) -> dict[str, torch.Tensor]:
    return _fabric(None, None, precision=precision)


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float) -> None:
    assert all(torch.allclose(got[k], want[k], atol=atol) for k in want), {
        k: (got[k] - want[k]).abs().max().item() for k in want
    }


DOORS = {"core": _core, "trainer": _trainer, "fabric": _fabric, "accelerate": _accelerate}


@pytest.mark.parametrize("door", list(DOORS))
@pytest.mark.parametrize(("opt_level", "half_dtype", "reference"), [
    ("O2", "bfloat16", "bf16-mixed"), ("O1", "float16", "32-true"),
])
def test_sam_recipe_trains_as_the_frameworks_precision(door: str, opt_level: str, half_dtype: str, reference: str):
    """first_step's perturbation (with its gradients cleared to None) passes the raw-step check; the base step is the
    door's, so at O2 it steps the FP32 masters and at float16 the unscaled gradients, skipping an overflow."""
    want = _reference(reference)
    plain = _fit_plain_sgd()
    assert max((want[k] - plain[k]).abs().max().item() for k in want) > 1e-2  # SAM moved the weights elsewhere
    _assert_close(DOORS[door](opt_level, half_dtype), want, 3e-3)


@functools.lru_cache(maxsize=None)
def _fit_plain_sgd() -> dict[str, torch.Tensor]:
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(STEPS):
        x, y = _batch(i)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return _weights(model)


@pytest.mark.parametrize(("opt_level", "half_dtype"), [("O2", "bfloat16"), ("O1", "float16")])
def test_davda54_second_step_is_refused_naming_sam_and_the_recipe(opt_level: str, half_dtype: str):
    """Its base_optimizer.step() bypasses the engine (at O2 the half weights stepped, the masters never; at float16 the
    gradients still scaled): refused at the next backward (the first iteration's perturbation passed)."""
    with pytest.raises(RuntimeError, match=r"SAM-style two-pass optimizer(.|\n)*base_optimizer.step\(\)") as caught:
        _core(opt_level, half_dtype, cls=SAM)
    assert "docs/master_weights.md" in str(caught.value) and "amp.step(optimizer)" in str(caught.value)


@pytest.mark.parametrize(("opt_level", "half_dtype", "reference"), [
    ("O2", "bfloat16", "bf16-mixed"), ("O1", "float16", "32-true"),
])
def test_fabric_sam_recipe_met_at_its_first_step_trains_as_the_frameworks_precision(opt_level, half_dtype, reference):
    """Without plugin.setup_optimizers the plugin meets the optimizer at its first step, after first_step wrote the
    weights: that write, over parameters no prepared optimizer held then, was refused as a raw step; it is judged at
    the step now (tests/test_fabric_sam_plain_loop.py), and the recipe trains as with the plugin told."""
    _assert_close(_fabric(opt_level, half_dtype, setup=False), _reference(reference), 3e-3)


def test_fabric_o2_davda54_second_step_with_the_plugin_never_told_is_refused_naming_the_recipe():
    """davda54's loop never steps through Fabric, so the plugin never meets the optimizer: first_step's write is
    noted at the second backward, and the next backward, after second_step's base step (a raw step: the half weights
    stepped, no master), refuses both, naming the SAM recipe."""
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")])
    net = _net()  # the optimizer set up apart: the plugin meets it at its first step (fabric.setup meets it there)
    model = fabric.setup_module(net)
    optimizer = fabric.setup_optimizers(SAM(net.parameters(), torch.optim.SGD, lr=0.1))
    x, y = _batch(0)
    fabric.backward(F.mse_loss(model(x).float(), y))
    optimizer.first_step(zero_grad=True)
    fabric.backward(F.mse_loss(model(x).float(), y))
    optimizer.second_step(zero_grad=True)
    with pytest.raises(RuntimeError, match=r"no optimizer prepared(.|\n)*SAM-style two-pass optimizer") as caught:
        fabric.backward(F.mse_loss(model(x).float(), y))
    assert "docs/master_weights.md" in str(caught.value)


def test_o1_float16_sam_overflow_in_either_pass_leaves_the_weights():
    """An overflow of the first pass perturbs the weights to inf/NaN; the recipe's restore puts them back before the
    door's step, which skips the overflowed second pass: the weights stay finite and unchanged, the scale backs off."""
    from lightning_mpx import Amp

    amp = Amp("O1", half_dtype="float16", init_scale=2.0**24)
    model = amp.prepare_model(_net())
    before = _weights(model)
    optimizer = amp.prepare_optimizer(DoorSAM(model.parameters(), torch.optim.SGD, lr=0.1))
    x, y = _batch(0)
    for _ in range(2):
        with amp.forward_context():
            loss = F.mse_loss(model(x).float(), y)
        amp.backward(loss)
        if _ == 0:
            optimizer.first_step(zero_grad=True)
            assert not all(torch.isfinite(p).all() for p in model.parameters())  # perturbed by the overflow
    optimizer.second_step()
    assert not amp.step(optimizer)
    _assert_close(_weights(model), before, 0.0)
    amp.end_iteration()
    assert amp.metrics()["mpx/loss_scale"] < 2.0**24


class _WarmupSGD(torch.optim.SGD):
    """Not SAM: an SGD with a warm-up helper that happens to be called ``first_step`` (no second_step, no base
    optimizer)."""

    def first_step(self) -> None:
        for group in self.param_groups:
            group["lr"] = group["lr"] * 0.1


def test_a_first_step_method_alone_is_not_sam_style_so_a_raw_update_is_refused_at_once():
    """The SAM allowance (one write with the gradients cleared per engine step) needs first_step beside second_step
    or a base_optimizer: an optimizer with a first_step method alone gets no unchecked hand-written update."""
    from lightning_mpx import Amp

    amp = Amp("O2", half_dtype="bfloat16")
    model = amp.prepare_model(_net())
    optimizer = amp.prepare_optimizer(_WarmupSGD(model.parameters(), lr=0.1))
    optimizer.first_step()
    x, y = _batch(0)
    amp.backward(F.mse_loss(amp.cast_outputs(model(amp.cast_inputs(x))).float(), y))
    with torch.no_grad():  # a hand-written update with still-scaled gradients (at O2: no master update)
        for p in model.parameters():
            p -= 0.1 * p.grad
    optimizer.zero_grad()
    with pytest.raises(RuntimeError, match="did not prepare"):
        amp.backward(F.mse_loss(amp.cast_outputs(model(amp.cast_inputs(x))).float(), y))


def _fabric_checkpointed(tmp_path: Any, **precision: Any) -> dict[str, torch.Tensor]:
    """The recipe with momentum, two accumulated micro-batches per pass, and fabric.save/fabric.load before the first
    step and mid-run (a SAM run that checkpoints, as users' do)."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, **precision)
    model, optimizer = fabric.setup(model := _net(), DoorSAM(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9))
    for plugin in precision.get("plugins", ()):
        plugin.setup_optimizers(optimizer)
    path = tmp_path / "ck.pt"
    for i in range(STEPS):
        if i in (0, 2):
            fabric.save(path, {"model": model, "optimizer": optimizer})
            fabric.load(path, {"model": model, "optimizer": optimizer})
        x, y = _batch(i)
        for _ in range(2):  # first pass, then the pass at the perturbed weights
            for half in (slice(0, 4), slice(4, 8)):
                fabric.backward(F.mse_loss(model(x[half]).float(), y[half]) / 2)
            if _ == 0:
                optimizer.first_step(zero_grad=True)
        optimizer.second_step()
        optimizer.step()
        optimizer.zero_grad()
    return _weights(model)


def test_fabric_o2_sam_checkpointed_mid_run_trains_as_bf16_mixed(tmp_path):
    """At O2 first_step's per-parameter state, written where the groups hold the half parameters, was left keyed by
    them: optimizer.state_dict() (fabric.save) raised KeyError once a step had run. It goes to the masters now."""
    from lightning_mpx import FabricMixedPrecisionPlugin

    want = _fabric_checkpointed(tmp_path, precision="bf16-mixed")
    got = _fabric_checkpointed(tmp_path, plugins=[FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")])
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-2
