"""Ranks of tests/test_fabric_setup_optimizers.py (gloo, ONE launch): Fabric DDP at O2, the optimizers given to
``fabric.setup``.

Rank 0 seeds its models, rank 1 does not (``torch.seed()``: other weights). Per case, each rank writes its weights
before set-up (``init``, and their bfloat16 rounding), whether the optimizer was registered at set-up, the masters
right after ``fabric.setup`` (``mpx.master_params``), then trains three steps on its own batches with
``mpx.metrics()`` read on rank 0 alone between steps, and writes its final weights, masters and scale:

* ``plain``: ``fabric.setup(model, optimizer)``, bfloat16;
* ``gan``: ``fabric.setup(D, opt_d)``, ``fabric.setup(G, opt_g)``, float16, rank 1's D loss inf at step 1, reads
  between D's step and G's;
* ``wrapper``, ``fabric_subclass``, ``plugin_subclass``: set up through a user's function, a ``Fabric`` subclass's
  ``setup`` and a plugin subclass's ``convert_module`` (both calling ``super()``);
* ``resumed``: ``plain`` saves after 3 steps and trains 2 more; this run (other weights) loads that checkpoint
  before its first step and trains the same 2;
* ``lost``: the plugin cannot read Fabric's call (``_fabric_call`` finds nothing): the optimizer is met at its
  first step and the masters start from the broadcast half weights.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin
from tests.launch import run_cases

CASES = ("plain", "resumed", "gan", "wrapper", "fabric_subclass", "plugin_subclass", "lost")


def _registered(mpx: FabricMixedPrecisionPlugin, optimizer: Any) -> bool:
    """Whether the engine knows ``optimizer`` (docs/fabric.md: ``mpx.amp.master_params`` refuses one it has not met)."""
    try:
        mpx.amp.master_params(getattr(optimizer, "optimizer", optimizer))
    except RuntimeError:
        return False
    return True


class _PluginSubclass(FabricMixedPrecisionPlugin):
    """A user's plugin that logs each conversion (``convert_module`` overridden, ``super()`` called)."""

    def convert_module(self, module: nn.Module) -> nn.Module:
        self.converted = getattr(self, "converted", 0) + 1
        return super().convert_module(module)


class _FabricSubclass(Fabric):
    def setup(self, module: nn.Module, *optimizers: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        self.setups = getattr(self, "setups", 0) + 1
        return super().setup(module, *optimizers, **kwargs)


def _my_setup(fabric: Fabric, model: nn.Module, *optimizers: Any) -> Any:
    """A user's helper around ``fabric.setup``."""
    return fabric.setup(model, *optimizers)


def _values(params: Any) -> list[float]:
    return torch.cat([p.detach().float().flatten() for p in params]).tolist()


def _net(width_in: int, width_out: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width_in, 16), nn.Tanh(), nn.Linear(16, width_out))


def _setup(fabric: Any, net: nn.Module, wrapper: bool) -> Any:
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    return _my_setup(fabric, net, optimizer) if wrapper else fabric.setup(net, optimizer)


def _train(case: str, fabric: Any, mpx: Any, setups: list[Any], steps: range, out: dict[str, Any]) -> None:
    """``steps`` iterations of ``case``'s loop on this rank's own batches, ``mpx.metrics()`` read on rank 0 alone."""
    rank = dist.get_rank()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in steps:
            gen = torch.Generator().manual_seed(10 * rank + step)  # each rank's own batch
            if case == "gan":
                (disc, opt_d), (gen_model, opt_g) = setups
                real, noise = torch.randn(8, 4, generator=gen), torch.randn(8, 4, generator=gen)
                fake = gen_model(noise)
                loss = F.softplus(-disc(real)).mean() + F.softplus(disc(fake.detach())).mean()
                fabric.backward(loss * float("inf") if step == 1 and rank == 1 else loss)
                opt_d.step()
                opt_d.zero_grad()
                if rank == 0:
                    out["reads"].append(mpx.metrics()["mpx/loss_scale"])  # between D's step and G's
                fabric.backward(F.softplus(-disc(fake)).mean())
                opt_g.step()
                opt_g.zero_grad()
                opt_d.zero_grad()
            else:
                model, optimizer = setups[0]
                x, y = torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)
                fabric.backward(F.cross_entropy(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
            if rank == 0:
                out["reads"].append(mpx.metrics()["mpx/loss_scale"])


def _state_values(optimizer: Any) -> list[Any]:
    """AdamW's state, each tensor's dtype and values (the masters' at O2)."""
    state = optimizer.state_dict()["state"]
    return [[key, str(value.dtype), value.flatten().tolist()] for index in sorted(state) for key, value in
            sorted(state[index].items())]  # fmt: skip


def run_case(case: str) -> dict[str, Any]:
    import lightning_mpx.integrations.fabric as fabric_module

    rank = dist.get_rank()
    if rank == 0:
        torch.manual_seed(5 if case == "resumed" else 0)
    else:
        torch.seed()  # no seed: weights of its own
    half = "float16" if case == "gan" else "bfloat16"
    plugin_class = _PluginSubclass if case == "plugin_subclass" else FabricMixedPrecisionPlugin
    mpx = plugin_class("O2", half_dtype=half, init_scale=2.0**10, growth_interval=2)
    fabric_class = _FabricSubclass if case == "fabric_subclass" else Fabric
    fabric = fabric_class(accelerator="cpu", devices=2, strategy="ddp", plugins=[mpx])
    fabric.launch()
    nets = [_net(4, 1), _net(4, 4)] if case == "gan" else [_net(8, 4)]
    params = [p for net in nets for p in net.parameters()]
    out: dict[str, Any] = {"init": _values(params), "reads": []}
    out["rounded_init"] = _values(p.to(torch.bfloat16) for p in params)
    found = fabric_module._fabric_call
    if case == "lost":
        fabric_module._fabric_call = lambda frame: None
    try:
        setups = [_setup(fabric, net, wrapper=case == "wrapper") for net in nets]
    finally:
        fabric_module._fabric_call = found
    optimizers = [optimizer for _, optimizer in setups]
    out["registered_at_setup"] = all(_registered(mpx, optimizer) for optimizer in optimizers)
    out["masters_at_setup"] = _values(m for optimizer in optimizers for m in mpx.master_params(optimizer))
    steps = range(3)
    if case == "resumed":  # plain's checkpoint, loaded before the first step (FP32 AdamW state: into the masters)
        state = {"model": setups[0][0], "optimizer": optimizers[0], "mpx": mpx}
        fabric.load(os.path.join(os.environ["MPX_OUT"], "plain.ckpt"), state)
        out["loaded_state"] = _state_values(optimizers[0])
        steps = range(3, 5)
    _train(case, fabric, mpx, setups, steps, out)
    if case == "plain":  # saved after 3 steps, then 2 more: what "resumed" must give
        ckpt = os.path.join(os.environ["MPX_OUT"], "plain.ckpt")
        fabric.save(ckpt, {"model": setups[0][0], "optimizer": optimizers[0], "mpx": mpx})
        out["saved_state"] = _state_values(optimizers[0])
        _train(case, fabric, mpx, setups, range(3, 5), out)
    out["opt_state"] = [_state_values(optimizer) for optimizer in optimizers]
    mpx.amp.end_iteration()  # on every rank, as the next forward would
    out["final"] = _values(params)
    out["final_masters"] = _values(m for optimizer in optimizers for m in mpx.master_params(optimizer))
    out["scale"] = mpx.metrics()["mpx/loss_scale"]
    return out


def main() -> None:
    run_cases({case: functools.partial(run_case, case) for case in CASES})


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    main()
