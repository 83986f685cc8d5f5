"""Hostile review of stop 61's carried scales (engine.carried_scales ``CarriedScales``): a Fabric GAN whose
generator's optimizer the plugin meets only at its first step, with a read of the scale after D's step (the pending
update runs there, growing the float16 scale). What the user does to G's gradients before G's first step must be
unscaled as with G registered up front (``mpx.setup_optimizers``) and as FP32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin


def _gan(
    mpx: FabricMixedPrecisionPlugin | None, edit: str, *, register: bool = False, apart: bool = True
) -> list[torch.Tensor]:
    """Both backwards, D's step, a read of the scale, ``edit`` on G's gradients, G's step; three iterations.
    ``edit``: "mul" (``p.grad.mul_(2)``), "clone" (``p.grad = p.grad.clone()``) or "accumulate" (G steps every
    second iteration, its gradients accumulated across the read's update). ``mpx=None``: FP32. ``apart``: each
    model by ``fabric.setup_module`` and its optimizer by ``fabric.setup_optimizers``, which the plugin meets at its
    first step (``fabric.setup(model, optimizer)`` registers it at set-up, since stop 63)."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx] if mpx is not None else None,
                    precision=None if mpx is not None else "32-true")  # fmt: skip
    torch.manual_seed(0)
    g_net, d_net = nn.Linear(4, 4), nn.Linear(4, 1)
    if apart:
        g, g_opt = fabric.setup_module(g_net), fabric.setup_optimizers(torch.optim.SGD(g_net.parameters(), lr=0.1))
        d, d_opt = fabric.setup_module(d_net), fabric.setup_optimizers(torch.optim.SGD(d_net.parameters(), lr=0.1))
    else:
        g, g_opt = fabric.setup(g_net, torch.optim.SGD(g_net.parameters(), lr=0.1))
        d, d_opt = fabric.setup(d_net, torch.optim.SGD(d_net.parameters(), lr=0.1))
    if register and mpx is not None:
        mpx.setup_optimizers(g_opt, d_opt)
    for step in range(3 if edit != "accumulate" else 4):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        fabric.backward(d(x).float().pow(2).mean())
        fabric.backward(g(x).float().pow(2).mean())
        d_opt.step()
        if mpx is not None:
            fabric._precision.scaler.get_scale()  # the pending update runs: the scale grows (growth_interval=1)
        if edit == "accumulate" and step % 2 == 0:
            d_opt.zero_grad()
            continue
        for p in g_net.parameters():
            if edit == "mul":
                p.grad.mul_(2)  # type: ignore[union-attr]
            elif edit == "clone":
                p.grad = p.grad.clone()  # type: ignore[union-attr]
        g_opt.step()
        d_opt.zero_grad()
        g_opt.zero_grad()
    return [p.detach().float().clone() for p in (*g_net.parameters(), *d_net.parameters())]


def _fp16() -> FabricMixedPrecisionPlugin:
    return FabricMixedPrecisionPlugin("O2", half_dtype="float16", init_scale=256.0, growth_interval=1)


def _max_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(got, want))


@pytest.mark.parametrize("edit", ["mul", "clone"])
def test_gs_gradients_edited_before_its_first_step_keep_the_scale_they_carry(edit: str) -> None:
    """G's gradients scaled in place or replaced by a copy after the update: still at the scale they were computed
    with, as a registered G's pending gradients (unscaled by the new scale before: off by the growth factor)."""
    late = _gan(_fp16(), edit)
    assert _max_error(late, _gan(_fp16(), edit, register=True)) < 1e-6
    assert _max_error(late, _gan(None, edit)) < 1e-3


@pytest.mark.xfail(strict=True, reason=(
    "engine/carried_scales.py: gradients no registered optimizer holds are not rescaled at a backward that adds to "
    "them at a scale an update changed (a registered optimizer's are, rescale.rescale_pending); the later record "
    "unscales the whole sum by the new scale. Rescaling them at each backward would cost a step in the "
    "head-only-optimizer case; workaround: mpx.setup_optimizers(g_opt, d_opt). Optimizers given to "
    "fabric.setup(model, optimizer) are registered there since stop 63 (tests/test_core_peft_merges.py); this is the "
    "optimizer set up apart, by fabric.setup_optimizers"))
def test_gs_gradients_accumulated_across_an_update_before_its_first_step() -> None:
    """G accumulates over two iterations with a read (an update) between: its first step as the registered loop's."""
    late = _gan(_fp16(), "accumulate")
    assert _max_error(late, _gan(_fp16(), "accumulate", register=True)) < 1e-6


@pytest.mark.parametrize("reset", ["del", "pop"])
def test_a_reset_of_a_parameters_adam_state_by_the_model_parameter_resets_it_at_o2(reset: str) -> None:
    """``del optimizer.state[p]`` / ``optimizer.state.pop(p, None)`` by a model parameter (pruning or re-init code
    resetting its moments) after steps: at O2 it raised ``KeyError`` / silently removed nothing (the entry is the FP32
    master's). Now the entry is gone as in FP32: the next step starts ``p``'s Adam over (``step`` 1)."""
    from lightning_mpx import Amp

    amp = Amp("O2", half_dtype="bfloat16")
    model = nn.Linear(4, 4)
    amp.prepare_model(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    amp.prepare_optimizer(opt)

    def step() -> None:
        with amp.forward_context():
            loss = model(torch.ones(2, 4, dtype=torch.bfloat16)).float().pow(2).mean()
        amp.backward(loss)
        amp.step(opt)
        amp.update()
        opt.zero_grad()

    step(), step()
    weight = model.weight
    if reset == "del":
        del opt.state[weight]
    else:
        assert opt.state.pop(weight, None) is not None
    assert len(opt.state) == 1 and opt.state[weight] == {}
    step()
    assert float(opt.state[weight]["step"]) == 1.0 and float(opt.state[model.bias]["step"]) == 3.0


def test_setdefault_by_the_model_parameter_gives_the_masters_entry_at_o2() -> None:
    """``optimizer.state.setdefault(p, {})`` by a model parameter at O2 (code that adds its own key to a parameter's
    state) gives the FP32 master's entry, as ``optimizer.state[p]`` does: one entry, the key kept by the next
    ``state_dict()`` beside Adam's moments (dict's own setdefault put a second, empty entry under ``p``, which later
    reads by ``p`` found instead of the moments)."""
    from lightning_mpx import Amp

    amp = Amp("O2", half_dtype="bfloat16")
    model = nn.Linear(4, 4)
    amp.prepare_model(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    amp.prepare_optimizer(opt)
    with amp.forward_context():
        loss = model(torch.ones(2, 4, dtype=torch.bfloat16)).float().pow(2).mean()
    amp.backward(loss)
    amp.step(opt)
    amp.update()
    entry = opt.state.setdefault(model.weight, {})
    assert "exp_avg_sq" in entry and entry is opt.state[model.weight] and len(opt.state) == 2
    entry["mine"] = 7
    saved = opt.state_dict()["state"]
    assert [sorted(s) for s in saved.values()].count(sorted(["step", "exp_avg", "exp_avg_sq", "mine"])) == 1

