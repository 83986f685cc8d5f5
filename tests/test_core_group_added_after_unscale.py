"""A group added to the optimizer (``add_param_group``: a head or a backbone unfrozen into it) after the gradients were
unscaled (``unscale_``, a clip) and before the step: its parameters hold this backward's gradients, scaled, which the
unscale never read. FP32 steps them on their true values, once; at O2 they did not move (their new masters had no
gradient) and at O1 float16 they were stepped scaled, 65536 times too far (as ``torch.amp.GradScaler`` steps them).
Each door, against FP32 or the framework's own mixed precision. And a ``load_state_dict(strict=False)`` of part of the
model after a step: neither a raw step nor a whole-model write (engine/beside_steps.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp

LR = 0.5
MAX_NORM = 0.05  # below the trunk's gradient norm: the clip changes what the trunk steps on


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def _trunk(model: nn.Sequential) -> list[nn.Parameter]:
    return list(model[0].parameters()) + list(model[1].parameters())


def _close_moves(after: torch.Tensor, before: torch.Tensor, ref_after: torch.Tensor, ref_before: torch.Tensor) -> None:
    """The move of a parameter within 15% (of the move's norm) of FP32's (bfloat16 forwards: 8% seen): a move of
    zero, a clip it should not have, a gradient left scaled (x65536) or unscaled twice (/65536) is far outside."""
    move, ref = (after.float() - before.float()), (ref_after - ref_before)
    assert ref.norm() > 1e-3
    assert (move - ref).norm() <= 0.15 * ref.norm(), f"moved {move.norm():.4g}, FP32 {ref.norm():.4g}"


def _fp32(sequence: str) -> tuple[torch.Tensor, ...]:
    """FP32: the head and the first layer after the sequence, and the head before."""
    model = _model()
    opt = torch.optim.SGD(_trunk(model), lr=LR)
    x, y = _batch(0)
    F.mse_loss(model(x), y).backward()
    if sequence in ("clip", "clip-backward"):
        torch.nn.utils.clip_grad_norm_(_trunk(model), MAX_NORM)
    head_before = model[2].weight.detach().clone()
    opt.add_param_group({"params": list(model[2].parameters())})
    if sequence == "unscale-clip":  # a clip after the add: over every parameter the optimizer holds now
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], MAX_NORM)
    if sequence == "clip-backward":
        x, y = _batch(1)
        F.mse_loss(model(x), y).backward()
    opt.step()
    return model[2].weight.detach().clone(), head_before, model[0].weight.detach().clone()


def _core(level: str, half: str, sequence: str) -> tuple[Amp, nn.Sequential, torch.optim.Optimizer, Any]:
    model = _model()
    amp = Amp(level, half_dtype=half)
    amp.prepare_model(model)
    opt = amp.prepare_optimizer(torch.optim.SGD(_trunk(model), lr=LR))

    def backward(seed: int) -> None:
        x, y = _batch(seed)
        with amp.forward_context():
            loss = F.mse_loss(model(amp.cast_inputs(x)).float(), y)
        amp.backward(loss)

    backward(0)
    if sequence in ("clip", "clip-backward"):
        amp.clip_grad_norm_(opt, MAX_NORM)
    else:
        amp.unscale_(opt)
    return amp, model, opt, backward


def _value(amp: Amp, param: torch.Tensor) -> torch.Tensor:
    return amp.master_of(param).detach().float().clone() if amp.opt_level == "O2" else param.detach().float().clone()


@pytest.mark.parametrize("sequence", ["clip", "unscale", "unscale-clip", "clip-backward"])
@pytest.mark.parametrize(("level", "half"), [("O2", "bfloat16"), ("O2", "float16"), ("O1", "float16")])
@pytest.mark.filterwarnings("ignore:lightning_mpx")
def test_core_a_group_added_after_the_unscale_steps_as_fp32(level: str, half: str, sequence: str) -> None:
    """The core ``Amp``: an unscale (``clip_grad_norm_`` or ``unscale_``), the head added, then (``unscale-clip``) a
    clip over every parameter, or (``clip-backward``) another backward, and the step: the head (and the trunk) move
    as FP32's, the head's gradient unscaled exactly once."""
    ref_head, ref_before, ref_trunk = _fp32(sequence)
    amp, model, opt, backward = _core(level, half, sequence)
    head = model[2].weight
    before = _value(amp, head)
    opt.add_param_group({"params": list(model[2].parameters())})
    if sequence == "unscale-clip":
        amp.clip_grad_norm_(opt, MAX_NORM)
    if sequence == "clip-backward":
        backward(1)
    trunk_before = _value(amp, model[0].weight)
    assert amp.step(opt) is True
    amp.update()
    _close_moves(_value(amp, head), before, ref_head, ref_before)
    _close_moves(_value(amp, model[0].weight), trunk_before, ref_trunk, _model()[0].weight.detach())


@pytest.mark.filterwarnings("ignore:lightning_mpx")
def test_core_o2_a_group_added_after_unscale_shows_its_true_gradient() -> None:
    """At O2 ``unscale_`` shows the true values on the half gradients; the head added since gets its true values
    there too before the step (its half gradient then matches FP32's, not 65536 times it)."""
    model = _model()
    F.mse_loss(model(_batch(0)[0]), _batch(0)[1]).backward()
    ref = model[2].weight.grad.clone()
    amp, model, opt, _ = _core("O2", "float16", "unscale")
    opt.add_param_group({"params": list(model[2].parameters())})
    amp.clip_grad_norm_(opt, 1e9)  # a second look after the add
    torch.testing.assert_close(model[2].weight.grad.float(), ref, rtol=2e-2, atol=2e-3)


@pytest.mark.filterwarnings("ignore:lightning_mpx")
def test_core_o2_show_unscaled_on_model_after_a_group_added_shows_its_true_gradient() -> None:
    """At O2 ``unscale_``, the head added, then ``show_unscaled_on_model`` (the Trainer's and Fabric's look before a
    user's clip): the head's half gradient holds its true value (FP32's), not the scaled one."""
    model = _model()
    F.mse_loss(model(_batch(0)[0]), _batch(0)[1]).backward()
    ref = model[2].weight.grad.clone()
    amp, model, opt, _ = _core("O2", "float16", "unscale")
    opt.add_param_group({"params": list(model[2].parameters())})
    amp.show_unscaled_on_model(opt)
    torch.testing.assert_close(model[2].weight.grad.float(), ref, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.filterwarnings("ignore:lightning_mpx")
def test_core_an_overflow_in_the_added_group_skips_the_step(fused: bool) -> None:
    """O1 float16: the added group's gradients are checked too: an inf there skips the step, on the host (SGD) or on
    the device (a fused AdamW): the trunk does not move, the head stays finite."""
    model = _model()
    amp = Amp("O1", half_dtype="float16")
    amp.prepare_model(model)
    make = torch.optim.AdamW if fused else torch.optim.SGD
    opt = amp.prepare_optimizer(make(_trunk(model), lr=LR, **({"fused": True} if fused else {})))
    x, y = _batch(0)
    with amp.forward_context():
        amp.backward(F.mse_loss(model(amp.cast_inputs(x)).float(), y))
    amp.clip_grad_norm_(opt, MAX_NORM)
    model[2].weight.grad[0, 0] = float("inf")
    opt.add_param_group({"params": list(model[2].parameters())})
    trunk = model[0].weight.detach().clone()
    amp.step(opt)
    amp.update()
    assert amp.iteration.skipped(opt)
    assert torch.equal(model[0].weight, trunk)
    assert torch.isfinite(model[2].bias).all()


@pytest.mark.filterwarnings("ignore:lightning_mpx")
def test_fabric_clip_gradients_then_add_param_group() -> None:
    """Fabric: ``fabric.clip_gradients``, ``optimizer.add_param_group``, ``optimizer.step()`` at O2 float16 move the
    head as FP32's."""
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    ref_head, ref_before, _ = _fp32("clip")
    plugin = FabricMixedPrecisionPlugin("O2", half_dtype="float16")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=plugin)
    net = _model()
    model, opt = fabric.setup(net, torch.optim.SGD(_trunk(net), lr=LR))
    x, y = _batch(0)
    fabric.backward(F.mse_loss(model(x).float(), y))
    fabric.clip_gradients(model, opt, max_norm=MAX_NORM)
    before = plugin.amp.master_of(net[2].weight).detach().clone()
    opt.add_param_group({"params": list(net[2].parameters())})
    opt.step()
    _close_moves(plugin.amp.master_of(net[2].weight).detach(), before, ref_head, ref_before)


def test_accelerate_clip_grad_norm_then_add_param_group(fresh_accelerate_state: Any) -> None:
    """Accelerate: ``accelerator.clip_grad_norm_``, ``optimizer.add_param_group``, ``optimizer.step()`` at O1 float16
    move the head as FP32's (it was stepped on its scaled gradient)."""
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

    ref_head, ref_before, _ = _fp32("clip")
    accelerator = Accelerator(
        mixed_precision="O1", cpu=True, kwargs_handlers=[MixedPrecisionKwargs(half_dtype="float16")]
    )
    net = _model()
    model, opt = accelerator.prepare(net, torch.optim.SGD(_trunk(net), lr=LR))
    x, y = _batch(0)
    accelerator.backward(F.mse_loss(model(x).float(), y))
    accelerator.clip_grad_norm_(_trunk(net), MAX_NORM)
    before = net[2].weight.detach().clone()
    opt.add_param_group({"params": list(net[2].parameters())})
    opt.step()
    _close_moves(net[2].weight.detach(), before, ref_head, ref_before)


@pytest.mark.parametrize("hook", ["on_before_optimizer_step", "configure_gradient_clipping"])
@pytest.mark.filterwarnings("ignore:lightning_mpx", "ignore::UserWarning")
def test_trainer_a_hook_adds_the_head_before_the_step(hook: str, tmp_path: Path) -> None:
    """The Trainer at O2 float16 with ``gradient_clip_val``: a hook that runs after the unscale adds the head to the
    optimizer (``on_before_optimizer_step``; ``configure_gradient_clipping`` before its clip) at the first step, and the
    clip after it takes the head too: the head moves as FP32's."""
    import lightning.pytorch as pl

    from lightning_mpx import MixedPrecisionPlugin

    ref_head, ref_before, _ = _fp32("unscale-clip")  # Lightning clips after on_before_optimizer_step

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()
            self.before: torch.Tensor | None = None

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            return F.mse_loss(self.net(batch[0]).float(), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(_trunk(self.net), lr=LR)

        def add_head(self, optimizer: Any) -> None:
            if self.before is None:
                self.before = self.trainer.precision_plugin.amp.master_of(self.net[2].weight).detach().clone()
                optimizer.add_param_group({"params": list(self.net[2].parameters())})

    if hook == "on_before_optimizer_step":
        Module.on_before_optimizer_step = lambda self, optimizer: self.add_head(optimizer)  # type: ignore[assignment]
    else:

        def clipping(self: Any, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None):
            self.add_head(optimizer)
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

        Module.configure_gradient_clipping = clipping  # type: ignore[assignment]
    module = Module()
    data = torch.utils.data.DataLoader([_batch(0)], batch_size=None)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=1, plugins=[MixedPrecisionPlugin("O2", half_dtype=torch.float16)],
        gradient_clip_val=MAX_NORM, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, data)
    assert module.before is not None
    after = trainer.precision_plugin.amp.master_of(module.net[2].weight).detach()
    _close_moves(after, module.before, ref_head, ref_before)


# -- a load of part of the model after a step, then a raw head step or not ------------------------------------------
class _LooseHead:
    """O2 bfloat16, the head left requiring grad out of the prepared optimizer (as
    tests/test_core_raw_head_sequences.py)."""

    def __init__(self) -> None:
        self.model = _model()
        self.amp = Amp("O2", half_dtype="bfloat16")
        self.amp.prepare_model(self.model)
        self.opt = self.amp.prepare_optimizer(torch.optim.SGD(_trunk(self.model), lr=0.05))

    def iteration(self, seed: int) -> None:
        x, y = _batch(seed)
        with self.amp.forward_context():
            loss = F.mse_loss(self.model(self.amp.cast_inputs(x)).float(), y)
        self.amp.backward(loss)
        self.amp.step(self.opt)
        self.amp.update()


@pytest.mark.parametrize("write", ["full-load", "partial-load-and-hand-write"])
@pytest.mark.filterwarnings("ignore:lightning_mpx")
def test_a_load_after_the_step_with_no_raw_step_is_not_refused(write: str) -> None:
    """A load of the whole model after a step (the head too), or a load of the first layer with a hand write over
    every parameter (an EMA swap), then ``model.zero_grad()``: no raw step, the next iterations run."""
    run = _LooseHead()
    run.iteration(0)
    if write == "full-load":
        run.model.load_state_dict({k: v.float() for k, v in run.model.state_dict().items()})
    else:
        run.model.load_state_dict({"0.weight": torch.zeros(16, 8)}, strict=False)
        with torch.no_grad():
            for param in run.model.parameters():
                param.mul_(1.0)
    run.model.zero_grad()
    run.iteration(1)
    run.iteration(2)


@pytest.mark.filterwarnings("ignore:lightning_mpx")
def test_a_raw_head_step_after_a_load_that_lacked_the_head_is_refused() -> None:
    """``load_state_dict(strict=False)`` of every entry but the head's, then a raw SGD step over the head: the
    parameters the load lacked are no load's writes; refused at the next backward."""
    run = _LooseHead()
    run.iteration(0)
    run.model.load_state_dict({k: v for k, v in run.model.state_dict().items() if not k.startswith("2.")}, strict=False)
    raw = torch.optim.SGD(run.model[2].parameters(), lr=0.05)
    raw.step()
    raw.zero_grad()
    with pytest.raises(RuntimeError, match="did not prepare"):
        run.iteration(1)


@pytest.mark.filterwarnings("ignore:lightning_mpx")
def test_core_o1_a_head_added_that_its_own_optimizer_unscaled_is_divided_once() -> None:
    """O1 float16: the head in an optimizer of its own, unscaled there (``unscale_``), then added to the trunk's
    optimizer after its clip: the trunk's step checks the head's gradient without dividing it again
    (engine/shared_grads.py), and both steps move the head as FP32's two steps do."""
    ref = _model()
    ref_head = torch.optim.SGD(ref[2].parameters(), lr=LR)
    ref_trunk = torch.optim.SGD(_trunk(ref), lr=LR)
    x, y = _batch(0)
    F.mse_loss(ref(x), y).backward()
    torch.nn.utils.clip_grad_norm_(_trunk(ref), MAX_NORM)
    ref_trunk.add_param_group({"params": list(ref[2].parameters())})
    ref_trunk.step()
    ref_head.step()
    model = _model()
    amp = Amp("O1", half_dtype="float16")
    amp.prepare_model(model)
    head_opt = amp.prepare_optimizer(torch.optim.SGD(model[2].parameters(), lr=LR))
    trunk_opt = amp.prepare_optimizer(torch.optim.SGD(_trunk(model), lr=LR))
    with amp.forward_context():
        amp.backward(F.mse_loss(model(amp.cast_inputs(x)).float(), y))
    amp.unscale_(head_opt)
    amp.clip_grad_norm_(trunk_opt, MAX_NORM)
    trunk_opt.add_param_group({"params": list(model[2].parameters())})
    amp.step(trunk_opt)
    amp.step(head_opt)
    amp.update()
    before = _model()[2].weight.detach()
    _close_moves(model[2].weight.detach(), before, ref[2].weight.detach(), before)
