"""Hostile-user attacks on stop 57's Fabric SAM loop (engine/raw_steps.py ``UnheldParams.judge``): a GAN whose two
optimizers the plugin meets one after the other at their first steps, and a checkpoint loaded before the first step.
Each against Fabric's own "bf16-mixed" on the same code."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin
from tests.test_fabric_raw_step_optimizer_habits import _SAM, _assert_close, _batch


def _fit_gan(sam: str, **precision: Any) -> dict[str, torch.Tensor]:
    """A GAN-shaped loop, no ``plugin.setup_optimizers``: each iteration steps the discriminator first, then the
    generator; ``sam`` names the one that is SAM-style (first_step, a second backward, its step)."""
    fabric = Fabric(accelerator="cpu", devices=1, **precision)
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    disc = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    g_opt = _SAM(gen.parameters()) if sam == "gen" else torch.optim.SGD(gen.parameters(), lr=0.1)
    d_opt = _SAM(disc.parameters()) if sam == "disc" else torch.optim.SGD(disc.parameters(), lr=0.1)
    gen, g_opt = fabric.setup(gen, g_opt)
    disc, d_opt = fabric.setup(disc, d_opt)
    for i in range(3):
        x, y = _batch(i)
        for net, opt, loss in (
            ("disc", d_opt, lambda: F.mse_loss(disc(gen(x).detach()).float(), y)),
            ("gen", g_opt, lambda: F.mse_loss(disc(gen(x)).float(), y)),
        ):
            fabric.backward(loss())
            if sam == net:
                opt.first_step(True)
                fabric.backward(loss())
            opt.step()
            g_opt.zero_grad()
            d_opt.zero_grad()
    return {f"{n}.{k}": v.detach().float() for n, m in (("g", gen), ("d", disc)) for k, v in m.state_dict().items()}


@pytest.mark.parametrize("sam", ["gen", "disc"])
def test_o2_gan_with_a_sam_optimizer_met_second_trains_as_bf16_mixed(sam: str) -> None:
    """The plugin meets the discriminator's optimizer at its first step: a SAM discriminator met first trains as
    "bf16-mixed"; so does a SAM generator met after it (its first_step over a model no registered optimizer holds any
    parameter of is deferred to its step, as before the first registration: engine/raw_steps.py UnheldParams._unmet;
    was refused)."""
    want = _fit_gan(sam, precision="bf16-mixed")
    got = _fit_gan(sam, plugins=[FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")])
    _assert_close(got, want, 3e-3)


def _fit_loaded(tmp_path: Any, **precision: Any) -> dict[str, torch.Tensor]:
    """A SAM without davda54's ``load_state_dict`` override (``base_optimizer.param_groups = self.param_groups``):
    ``fabric.load`` before the first step leaves its base optimizer with the old group list."""
    fabric = Fabric(accelerator="cpu", devices=1, **precision)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model, optimizer = fabric.setup(model, _SAM(model.parameters()))
    path = os.path.join(tmp_path, "c.ckpt")
    fabric.save(path, {"model": model, "optimizer": optimizer})
    fabric.load(path, {"model": model, "optimizer": optimizer})
    for i in range(3):
        x, y = _batch(i)
        fabric.backward(F.mse_loss(model(x).float(), y))
        optimizer.first_step(True)
        fabric.backward(F.mse_loss(model(x).float(), y))
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().float() for k, v in model.state_dict().items()}


def test_o2_sam_without_the_load_override_loaded_before_the_first_step_trains_as_bf16_mixed(tmp_path: Any) -> None:
    """torch's ``load_state_dict`` gives the SAM new group dicts and leaves its base optimizer on the old ones: the
    base step inside the door's step stepped the half weights, the masters never moved and the copy back undid it
    (the run stalled, 0.2 off "bf16-mixed", silently). A SAM-style optimizer's ``base_optimizer`` is its inner one
    whether or not their groups came apart (engine/optimizers.py shared_inners): its groups get the masters too."""
    want = _fit_loaded(tmp_path, precision="bf16-mixed")
    got = _fit_loaded(tmp_path, plugins=[FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")])
    _assert_close(got, want, 3e-3)
