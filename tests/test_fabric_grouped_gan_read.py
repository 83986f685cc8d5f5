"""Hostile review of stop 62's last library changes (review62c). Fabric under a process group: the found-inf reducer a
group of two or more ranks gets is installed by hand in a gloo group of one, the read's logic in-process; a run that
reads on "rank 0" is compared with the same run without the read (what the other ranks do)."""

from __future__ import annotations

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin
from lightning_mpx.integrations.collectives import all_reduce_max


def _gan(read: bool, late: int = 2, iters: int = 4) -> tuple[list[int], float, list[torch.Tensor]]:
    """A float16 O1 GAN (growth_interval=1: each update doubles the scale), both backwards before both steps; G
    accumulates its gradients over the first ``late`` iterations and steps from then on (the plugin meets its
    optimizer at that first step). ``read``: ``mpx.metrics()`` between D's step and G's first step."""
    torch.manual_seed(0)
    mpx = FabricMixedPrecisionPlugin("O1", half_dtype="float16", growth_interval=1)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=mpx)
    gen, disc = nn.Linear(4, 4), nn.Linear(4, 1)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.1)
    gen, disc = fabric.setup(gen, disc)
    opt_d, opt_g = fabric.setup_optimizers(opt_d, opt_g)
    g = torch.Generator().manual_seed(1)
    updates = []
    for it in range(iters):
        fake = gen(torch.randn(3, 4, generator=g))
        fabric.backward(disc(fake.detach()).float().pow(2).mean())
        fabric.backward(-disc(fake).float().mean())
        mpx.amp.found_inf_reducer = all_reduce_max  # what a group of two or more ranks gets
        opt_d.step()
        opt_d.zero_grad()
        if read and it == late:
            mpx.metrics()  # rank 0 alone logs
        if it >= late:
            opt_g.step()
            opt_g.zero_grad(set_to_none=False)
        updates.append(mpx.amp.iteration.index)
    return updates, mpx.amp.scalers[0].scale_tensor.item(), [p.detach().clone() for p in gen.parameters()]


def test_a_read_between_d_and_a_late_g_step_keeps_the_ranks_together(one_rank: None) -> None:
    """A read on one rank between D's step and the first step of G's optimizer (met late) must not end the
    iteration there: the reading rank's updates, scale and G's weights stay those of a rank that did not read.
    G's gradients, added to in place since an update met them, look at the read exactly as a head-only optimizer's
    unfrozen body's do; a rule that counted such gradients as stale (tried in stop 62) split the ranks here, so any
    gradient no optimizer holds counts as waiting: in the body's case reads lag one update (docs/fabric.md), and
    saves hold the scalers as the pending update leaves them (tests/test_fabric_grouped_save_pending.py)."""
    read_updates, read_scale, read_weights = _gan(read=True)
    updates, scale, weights = _gan(read=False)
    assert read_updates == updates
    assert read_scale == scale
    for a, b in zip(read_weights, weights):
        torch.testing.assert_close(a, b)
