"""Cases of tests/test_fabric_fsdp1.py, run in ``tests/fabric_fsdp1_script.py``'s launch
(``hostile/<kind>:<precision>``; :data:`RUNS`): ``FabricMixedPrecisionPlugin`` under Fabric's ``FSDPStrategy``
(FSDP1, the ``CPUFSDPStrategy`` of tests/fabric_fsdp1_script.py), attacked the way people set Fabric up, two CPU
processes (gloo, one launch), bfloat16 with a dynamic scale.

Each case (``<kind>:<precision>``; the precision is an opt level for the plugin or Fabric's own ``bf16-mixed``)
trains :data:`STEPS` steps with the clip by norm and records the gathered weights, the clip's norms and the losses
(``error`` when it raised). Kinds: ``plain``
(``fabric.setup``); ``gan`` (a generator and a discriminator, each set up on its own, the generator run once before
the discriminator is set up); ``checkpointed`` (``activation_checkpointing_policy={Block}``); ``flat``
(``use_orig_params=False``: the optimizer built over the wrapper's flat parameters after ``setup_module``);
``user_wrapped`` (wrapped with FSDP1 by the user before ``fabric.setup``); ``two_optimizers`` (one model, two
optimizers, both clipped); ``unregistered`` (the same, the optimizers not handed to ``plugin.setup_optimizers``);
``clip_value`` (``clip_val``); ``reused`` (the plugin object of a finished run given to a second Fabric).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from lightning_mpx import FabricMixedPrecisionPlugin
from tests.fabric_fsdp1_script import BATCH, Block, CPUFSDPStrategy, build, full_weights

STEPS = 4
CLIP = 0.05
SETTINGS: dict[str, Any] = {"half_dtype": "bfloat16", "loss_scale": "dynamic", "init_scale": 2.0**12,
                            "growth_interval": 1000}  # fmt: skip


def make(precision: str, **strategy: Any) -> tuple[Fabric, FabricMixedPrecisionPlugin | None]:
    plugin = FabricMixedPrecisionPlugin(precision, **SETTINGS) if precision.startswith("O") else None
    kwargs: dict[str, Any] = {"plugins": [plugin]} if plugin is not None else {"precision": precision}
    strategy.setdefault("auto_wrap_policy", {Block})
    fabric = Fabric(accelerator="cpu", devices=2, strategy=CPUFSDPStrategy(**strategy), **kwargs)
    fabric.launch()
    return fabric, plugin


def data(step: int, rank: int, width: int = 16, out: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(BATCH, width, generator=g), torch.randn(BATCH, out, generator=g)
    per = BATCH // 2
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def loop(fabric: Fabric, model: Any, optimizers: list[Any], out: dict[str, Any], clip: str = "norm") -> None:
    for step in range(STEPS):
        x, y = data(step, fabric.global_rank)
        loss = F.mse_loss(model(x).float(), y)
        fabric.backward(loss)
        for optimizer in optimizers:
            if clip == "norm":
                out["norms"].append(float(fabric.clip_gradients(model, optimizer, max_norm=CLIP)))
            else:
                fabric.clip_gradients(model, optimizer, clip_val=CLIP)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        reduced = loss.detach().float().clone()
        dist.all_reduce(reduced)
        out["losses"].append(float(reduced) / 2)
    out["weights"] = full_weights(model)


def run_plain(precision: str, out: dict[str, Any], **strategy: Any) -> FabricMixedPrecisionPlugin | None:
    fabric, plugin = make(precision, **strategy)
    model = fabric.setup_module(build())
    out["checkpoint_wrappers"] = sum("CheckpointWrapper" in type(m).__name__ for m in model.modules())
    loop(fabric, model, [fabric.setup_optimizers(sgd(model.parameters()))], out)
    return plugin


def run_gan(precision: str, out: dict[str, Any]) -> None:
    fabric, _ = make(precision, auto_wrap_policy={nn.Linear})
    torch.manual_seed(0)
    gen = fabric.setup_module(nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16)))
    opt_g = fabric.setup_optimizers(sgd(gen.parameters()))
    with torch.no_grad():
        gen(torch.randn(2, 4))  # a sample before the discriminator exists
    disc = fabric.setup_module(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)))
    opt_d = fabric.setup_optimizers(sgd(disc.parameters()))
    for step in range(STEPS):
        real, _ = data(step, fabric.global_rank)
        z = torch.randn(real.shape[0], 4, generator=torch.Generator().manual_seed(100 + step))
        fake = gen(z)
        logits = disc(torch.cat([real, fake.detach()]))
        labels = torch.cat([torch.ones(len(real), 1), torch.zeros(len(real), 1)])
        d_loss = F.binary_cross_entropy_with_logits(logits.float(), labels)
        fabric.backward(d_loss)
        out["norms"].append(float(fabric.clip_gradients(disc, opt_d, max_norm=CLIP)))
        opt_d.step()
        opt_d.zero_grad()
        g_loss = F.binary_cross_entropy_with_logits(disc(fake).float(), torch.ones(len(real), 1))
        fabric.backward(g_loss)
        out["norms"].append(float(fabric.clip_gradients(gen, opt_g, max_norm=CLIP)))
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()
        out["losses"].append(float(d_loss.detach()) + float(g_loss.detach()))
    out["weights"] = full_weights(gen) + full_weights(disc)


def run_flat(precision: str, out: dict[str, Any]) -> None:
    fabric, _ = make(precision, use_orig_params=False)
    model = fabric.setup_module(build())
    loop(fabric, model, [fabric.setup_optimizers(sgd(model.parameters()))], out)


def run_user_wrapped(precision: str, out: dict[str, Any]) -> None:
    fabric, plugin = make(precision)
    config = plugin.mixed_precision_config if plugin is not None else fabric.strategy.mixed_precision_config
    wrapped = FullyShardedDataParallel(build(), mixed_precision=config, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                       device_id=torch.device("cpu"), use_orig_params=True)  # fmt: skip
    model = fabric.setup_module(wrapped)
    loop(fabric, model, [fabric.setup_optimizers(sgd(model.parameters()))], out)


def run_two_optimizers(precision: str, out: dict[str, Any], register: bool = True) -> None:
    fabric, plugin = make(precision)
    model = fabric.setup_module(build())
    params = list(model.parameters())
    first = fabric.setup_optimizers(sgd(params[:2]))  # the first layer
    rest = fabric.setup_optimizers(sgd(params[2:]))
    if plugin is not None and register:
        plugin.setup_optimizers(first, rest)
    try:
        loop(fabric, model, [first, rest], out)
    except RuntimeError as error:
        out["refusal"] = str(error)


def run_clip_value(precision: str, out: dict[str, Any]) -> None:
    fabric, _ = make(precision)
    model = fabric.setup_module(build())
    try:
        loop(fabric, model, [fabric.setup_optimizers(sgd(model.parameters()))], out, clip="value")
    except Exception as error:  # noqa: BLE001 - the answer is the result
        out["refusal"] = f"{type(error).__name__}: {error}"


def run_reused(precision: str, out: dict[str, Any]) -> None:
    plugin = FabricMixedPrecisionPlugin(precision, **SETTINGS)
    for _ in range(2):
        out["losses"], out["norms"] = [], []
        fabric = Fabric(accelerator="cpu", devices=2, strategy=CPUFSDPStrategy(auto_wrap_policy={Block}),
                        plugins=[plugin])  # fmt: skip
        fabric.launch()
        model = fabric.setup_module(build())
        loop(fabric, model, [fabric.setup_optimizers(sgd(model.parameters()))], out)


RUNS = {
    "plain": run_plain,
    "gan": run_gan,
    "checkpointed": lambda p, o: run_plain(p, o, activation_checkpointing_policy={Block}),
    "flat": run_flat,
    "user_wrapped": run_user_wrapped,
    "two_optimizers": run_two_optimizers,
    "unregistered": lambda p, o: run_two_optimizers(p, o, register=False),
    "clip_value": run_clip_value,
    "reused": run_reused,
}
