"""A torch optimizer lightning_mpx never prepared (or a hand-written update), stepping the parameters after the
engine's backward where that is harmful (O2: no FP32 master update; a loss scale other than 1: gradients x scale):
refused at the next backward, naming the parameters and the fix of each front door (the core ``Amp``, Fabric,
Accelerate; the Trainer's case is tests/test_lightning_masters_state_dict.py). What a user legitimately does between
backwards and steps (accumulation with a clamp, a skipped batch, an EMA swap for validation, two prepared optimizers, a
frozen layer, a parameter in no optimizer, a checkpoint loaded between a backward and a step) still trains as FP32
does."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp

REFUSED = r"(?s)'0\.weight'.*were written and their gradients cleared after a backward of lightning_mpx"


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


def _loss(model: nn.Module, i: int) -> torch.Tensor:
    x, y = _batch(i)
    dtype = next(p.dtype for p in model.parameters())
    return F.mse_loss(model(x.to(dtype)).float(), y)


def _core(opt_level: str, half_dtype: str, **kw: Any) -> tuple[Amp, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    amp = Amp(opt_level=opt_level, half_dtype=half_dtype, **kw)
    model = amp.prepare_model(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)))
    return amp, model, amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))


def _raw_step(model: nn.Module, raw: torch.optim.Optimizer | None) -> None:
    if raw is not None:
        raw.step()
        raw.zero_grad()
        return
    with torch.no_grad():  # a hand-written update: the same harm
        for p in model.parameters():
            p -= 0.1 * p.grad
            p.grad = None


@pytest.mark.parametrize(
    ("opt_level", "half_dtype", "by_hand", "refused"),
    [
        ("O2", "bfloat16", False, True),  # no FP32 master update
        ("O2", "bfloat16", True, True),
        ("O1", "float16", False, True),  # the dynamic scale: gradients x65536
        ("O1", "bfloat16", False, False),  # a unit scale and no masters: a plain step, left alone
    ],
)
def test_core_a_raw_step_after_amp_backward_is_refused_where_harmful(
    opt_level: str, half_dtype: str, by_hand: bool, refused: bool
) -> None:
    amp, model, _ = _core(opt_level, half_dtype)
    raw = None if by_hand else torch.optim.SGD(model.parameters(), lr=0.1)  # never given to prepare_optimizer
    amp.backward(_loss(model, 0))
    _raw_step(model, raw)
    if not refused:
        amp.backward(_loss(model, 1))
        assert all(torch.isfinite(p).all() for p in model.parameters())
        return
    with pytest.raises(RuntimeError, match=REFUSED + r".*amp\.prepare_optimizer\(optimizer\)"):
        amp.backward(_loss(model, 1))


def test_fabric_and_accelerate_a_second_phase_optimizer_never_set_up_is_refused(fresh_accelerate_state: Any) -> None:
    """A user steps the prepared optimizer, then starts a second phase with a new optimizer not given to the door."""
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")])
    accelerator = Accelerator(
        mixed_precision="O2", cpu=True, kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16")]
    )
    for setup, backward, fix in (
        (fabric.setup, fabric.backward, r"fabric\.setup\(model, optimizer\)"),
        (accelerator.prepare, accelerator.backward, r"accelerator\.prepare\(model, optimizer\)"),
    ):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
        model, opt = setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        backward(_loss(model, 0))
        opt.step()
        opt.zero_grad()
        raw = torch.optim.SGD(model.parameters(), lr=0.01)  # phase two: never set up
        backward(_loss(model, 1))
        raw.step()
        raw.zero_grad()
        with pytest.raises(RuntimeError, match=REFUSED + r".*" + fix):
            backward(_loss(model, 2))


def _legit(model: nn.Module, opts: list[Any], backward: Any, step: Any, load: Any) -> None:
    """Two optimizers (GAN-style), a frozen first layer, a bias in no optimizer; accumulation with a clamp between
    the backwards, an EMA swap for validation after the step, a skipped batch, a checkpoint loaded between a backward
    and a step."""
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for it in range(3):
        backward(_loss(model, 2 * it))
        with torch.no_grad():
            model[2].weight.clamp_(-0.3, 0.3)  # between accumulated backwards
        backward(_loss(model, 2 * it + 1))
        step()
        for opt in opts:
            opt.zero_grad()
        kept = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict(ema)  # the EMA weights for validation, then the trained ones back
        with torch.no_grad():
            _loss(model, 99)
        model.load_state_dict(kept)
        backward(_loss(model, 10 + it))  # a skipped batch: no step, then cleared
        for opt in opts:
            opt.zero_grad()
        backward(_loss(model, 20 + it))
        load()  # a checkpoint loaded between a backward and a step (its gradients cleared)
        for opt in opts:
            opt.zero_grad()


def test_legitimate_writes_between_backwards_and_steps_train_as_fp32() -> None:
    def build() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
        model[0].requires_grad_(False)
        return model

    ref = build()
    ref_opts = [torch.optim.SGD(ref[2].parameters(), lr=0.1), torch.optim.SGD([ref[4].weight], lr=0.1)]
    ref_saved = {k: v.clone() for k, v in ref.state_dict().items()}

    def ref_step() -> None:
        for opt in ref_opts:
            opt.step()

    _legit(ref, ref_opts, lambda loss: loss.backward(), ref_step, lambda: ref.load_state_dict(ref_saved))

    amp = Amp(opt_level="O2", half_dtype="bfloat16")
    model = amp.prepare_model(build())
    opts = [amp.prepare_optimizer(torch.optim.SGD(model[2].parameters(), lr=0.1)),
            amp.prepare_optimizer(torch.optim.SGD([model[4].weight], lr=0.1))]  # fmt: skip
    saved = ({k: v.clone() for k, v in amp.fp32_state_dict(model).items()}, amp.state_dict())

    def step() -> None:
        for opt in opts:
            amp.step(opt)
        amp.update()

    def load() -> None:
        model.load_state_dict(saved[0])
        amp.load_state_dict(saved[1])

    _legit(model, opts, amp.backward, step, load)  # no error
    got, want = amp.fp32_state_dict(model), ref.state_dict()
    assert all(torch.allclose(got[k].float(), want[k], atol=2e-2) for k in want), {
        k: (got[k].float() - want[k]).abs().max().item() for k in want
    }


def test_core_a_raw_optimizer_over_parameters_no_prepared_optimizer_holds_is_refused() -> None:
    torch.manual_seed(0)
    amp = Amp(opt_level="O1", half_dtype="float16")
    model = amp.prepare_model(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)))
    amp.prepare_optimizer(torch.optim.SGD(model[0].parameters(), lr=0.1))  # the generator's, prepared
    raw = torch.optim.SGD(model[2].parameters(), lr=0.1)  # the discriminator's, never prepared
    amp.backward(_loss(model, 0))
    raw.step()
    raw.zero_grad()
    with pytest.raises(RuntimeError, match=r"'2\.weight'.*were written"):
        amp.backward(_loss(model, 1))
