"""Ranks of tests/test_lightning_ddp_no_sync_refusals.py: raw-step refusals kept under DDP's ``no_sync`` until the step
(engine/unsynced.py) through the Trainer and the Accelerate adapter, habits that are no raw step under ``no_sync``
against the frameworks' own bfloat16, and the DDP watch's forward pre-hooks under ``torch.compile``,
``find_unused_parameters``, ``static_graph`` and an evaluation first. Two CPU processes (gloo), ONE launch. Each rank
writes ``$MPX_OUT/rank{r}.json``; a case that raises leaves its traceback in the case's ``"error"``.

Refusal cases (``*_raw_rank1``, ``*_unheld_rank1``): the raw step runs on rank 1 ONLY, between two accumulated
backwards (the first under ``no_sync``): rank 1 alone sees it, so raising at rank 1's next backward would leave rank 0
in that backward's all-reduce (a hang, until the group's short timeout). Both ranks must raise, at the step.

``trainer_fit_twice``: the raw step in a second ``trainer.fit`` of the same Trainer (a new DDP wrapper).

Watch cases (``watch/*``, Fabric, O2): the first forward is an evaluation under ``torch.no_grad()`` (``eval_first``),
or the model is compiled (``compile``), or DDP runs with ``find_unused_parameters`` / ``static_graph``; the ranks
agree whether the wrapper was found (``watched``) before the rank-1-only raw step is tried (a wrapper not found would
hang the launch), then both must raise.
"""

from __future__ import annotations

import datetime
import os
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.launch import case_error, finish_cases

BF16 = {"half_dtype": "bfloat16", "loss_scale": "dynamic", "init_scale": 2.0**8}
LR = 0.05


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 4, generator=g), torch.randn(4, generator=g)


def flat(tensors: Any) -> list[float]:
    return torch.cat([t.detach().float().flatten() for t in tensors]).tolist()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x)).squeeze(-1).float()


# -- the Trainer
class Accum(pl.LightningModule):
    """Automatic optimization (``accumulate_grad_batches=2``). ``raw``: ``"all"`` (a raw SGD over every parameter, the
    prepared optimizer's), ``"head"`` (the optimizer holds the trunk only: a raw SGD over the head, which no prepared
    optimizer holds), stepped on rank 1 only before the second accumulated backward. ``habits``: a frozen backbone,
    an EMA teacher written at every batch (between the accumulated backwards) and read by the loss."""

    def __init__(self, raw: str | None = None, habits: bool = False) -> None:
        super().__init__()
        self.net = Net()
        self.raw_over, self.habits = raw, habits
        if habits:
            torch.manual_seed(1)
            self.backbone = nn.Linear(4, 4).requires_grad_(False)
            self.teacher = Net().requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.backbone(x) if self.habits else x)

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        if self.raw_over is not None and index % 2 == 1 and self.global_rank == 1:
            params = self.net.parameters() if self.raw_over == "all" else self.net.head.parameters()
            raw = torch.optim.SGD(params, lr=LR)
            raw.step()
            raw.zero_grad()
        out = self(x)
        loss = F.mse_loss(out, y)
        if self.habits:
            with torch.no_grad():
                for t, s in zip(self.teacher.parameters(), self.net.parameters()):
                    t.lerp_(s.detach().to(t.dtype), 0.5)
                target = self.teacher(self.backbone(x))
            loss = loss + 0.1 * F.mse_loss(out, target.float())
        return loss

    def configure_optimizers(self) -> Any:
        params = self.net.trunk.parameters() if self.raw_over == "head" else self.net.parameters()
        return torch.optim.SGD(params, lr=LR)


def _trainer(module: Accum, level: str, r: dict, batches: int = 4) -> None:
    from lightning_mpx import MixedPrecisionPlugin

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(7 + rank)
    data = torch.utils.data.TensorDataset(
        torch.randn(4 * batches, 4, generator=g), torch.randn(4 * batches, generator=g)
    )
    kwargs: dict[str, Any] = (
        {"plugins": [MixedPrecisionPlugin(level, **BF16)]} if level.startswith("O") else {"precision": level}
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, max_epochs=1, accumulate_grad_batches=2,
        use_distributed_sampler=False, **kwargs,
    )  # fmt: skip
    r["w_start"] = flat(module.net.parameters())
    try:
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    finally:
        r["w"] = flat(module.net.parameters())
        r["steps"] = trainer.global_step
        if module.habits:
            r["teacher"] = flat(module.teacher.parameters())


# -- the Accelerate adapter
def _accelerate(level: str, r: dict, raw_rank1: bool = False, gan: bool = False) -> None:
    from accelerate import Accelerator as NativeAccelerator

    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import accelerate_state_reset, prepared_gan

    with accelerate_state_reset():
        if level == "bf16":
            accelerator = NativeAccelerator(mixed_precision="bf16", cpu=True, gradient_accumulation_steps=2)
        else:
            accelerator = Accelerator(mixed_precision=level, cpu=True, gradient_accumulation_steps=2,
                                      kwargs_handlers=[MixedPrecisionKwargs(**BF16)])  # fmt: skip
        rank = accelerator.process_index
        if gan:
            gen, disc, opt_g, opt_d = prepared_gan(accelerator)
            r["wrapper"] = type(gen).__name__
            r["w_start"] = flat([p for m in (gen, disc) for p in accelerator.unwrap_model(m).parameters()])
            for step in range(4):
                g = torch.Generator().manual_seed(10 * step + rank)
                noise, real = torch.randn(4, 4, generator=g), torch.randn(4, 8, generator=g)
                with accelerator.accumulate(gen, disc):
                    fake = gen(noise)
                    d_loss = F.softplus(disc(fake.detach())).mean() + F.softplus(-disc(real)).mean()
                    accelerator.backward(d_loss.float())
                    opt_d.step()
                    opt_d.zero_grad()
                    g_loss = F.softplus(-disc(fake)).mean()
                    accelerator.backward(g_loss.float())
                    opt_g.step()
                    opt_g.zero_grad()
                    opt_d.zero_grad()  # the generator's loss left gradients in the discriminator
            unwrapped = [accelerator.unwrap_model(m) for m in (gen, disc)]
            r["w"] = flat([p for m in unwrapped for p in m.parameters()])
            if level != "bf16":
                amp = accelerator.amp
                r["w"] = flat([*amp.master_params(opt_g.optimizer), *amp.master_params(opt_d.optimizer)])
            return
        module = Net()
        model, optimizer = accelerator.prepare(module, torch.optim.SGD(module.parameters(), lr=LR))
        raw = torch.optim.SGD(module.parameters(), lr=LR)
        r["w_start"] = flat(module.parameters())
        try:
            for step in range(4):
                x, y = batch(step, rank)
                with accelerator.accumulate(model):
                    if raw_rank1 and step == 1 and rank == 1:
                        raw.step()
                        raw.zero_grad()
                    accelerator.backward(F.mse_loss(model(x), y))
                    optimizer.step()
                    optimizer.zero_grad()
        finally:
            r["w"] = flat(module.parameters())


# -- Fabric: the DDP watch
def _fabric_watch(variant: str, r: dict) -> None:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    from lightning_mpx import FabricMixedPrecisionPlugin

    ddp = {"find_unused_parameters": variant == "find_unused", "static_graph": variant == "static_graph"}
    plugin = FabricMixedPrecisionPlugin("O2", **BF16)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=DDPStrategy(**ddp), plugins=plugin)
    fabric.launch()
    rank = fabric.global_rank
    module = Net()
    if variant == "compile":
        module = torch.compile(module, backend="aot_eager")
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=LR))
    inner = module._orig_mod if variant == "compile" else module
    if variant == "eval_first":
        model.eval()
        with torch.no_grad():
            model(batch(9, rank)[0])
        model.train()
    x, y = batch(0, rank)
    fabric.backward(F.mse_loss(model(x), y))  # synchronised
    optimizer.step()
    optimizer.zero_grad()
    watched = torch.tensor([float(len(plugin.amp._machine.ddp) == 1)])
    dist.all_reduce(watched, op=dist.ReduceOp.MIN)
    r["watched"] = bool(watched.item())
    r["hooks_left"] = sum(
        type(hook).__name__ == "DdpWatch" for m in inner.modules() for hook in m._forward_pre_hooks.values()
    )
    if not r["watched"]:
        return  # a rank-1 refusal at the backward would hang: the test reads "watched"
    raw = torch.optim.SGD(inner.parameters(), lr=LR)
    with fabric.no_backward_sync(model):
        fabric.backward(F.mse_loss(model(x), y))
    if rank == 1:
        raw.step()
        raw.zero_grad()
    fabric.backward(F.mse_loss(model(x), y))  # synchronised: rank 1 keeps its refusal
    if variant == "clip":  # the unscale before the step: nothing raised there
        fabric.clip_gradients(model, optimizer, max_norm=0.01)
    r["step_reached"] = True
    optimizer.step()  # the ranks meet: both refuse


def _bucket_view(precision: str | None, r: dict) -> None:
    """``gradient_as_bucket_view=True`` with ``zero_grad(set_to_none=False)`` (the same bucket views, marked by each
    step, kept from step to step), two micro-batches a step under ``no_backward_sync``, SGD with momentum."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    from lightning_mpx import FabricMixedPrecisionPlugin

    plugin = FabricMixedPrecisionPlugin("O2", **BF16) if precision is None else None
    fabric = Fabric(accelerator="cpu", devices=2, strategy=DDPStrategy(gradient_as_bucket_view=True), plugins=plugin,
                    precision=precision)  # fmt: skip
    fabric.launch()
    rank = fabric.global_rank
    module = Net()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=LR, momentum=0.9))
    r["w_start"] = flat(module.parameters())
    for step in range(6):
        x, y = batch(step, rank)
        with fabric.no_backward_sync(model, enabled=step % 2 == 0):
            fabric.backward(F.mse_loss(model(x), y) / 2)
        if step % 2 == 1:
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
    r["w"] = flat(plugin.master_params(optimizer) if plugin is not None else module.parameters())


class LaterRaw(Accum):
    """:class:`Accum` whose rank-1-only raw step comes in the second epoch only (the second ``fit``)."""

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        self.raw_over = "all" if self.current_epoch > 0 else None
        return super().training_step(batch, index)


def _fit_twice(r: dict) -> None:
    """``trainer.fit`` for one epoch, then ``max_epochs`` raised and ``trainer.fit`` again (the same Trainer and
    plugin, a new DDP wrapper around the same model): the rank-1-only raw step comes in the second fit."""
    from lightning_mpx import MixedPrecisionPlugin

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(7 + rank)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, generator=g))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, max_epochs=1, accumulate_grad_batches=2,
        use_distributed_sampler=False, plugins=[MixedPrecisionPlugin("O2", **BF16)],
    )  # fmt: skip
    module = LaterRaw()
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    trainer.fit(module, loader)
    r["first_steps"] = trainer.global_step
    trainer.fit_loop.max_epochs = 2
    trainer.fit(module, loader)


def main() -> None:
    # A short timeout: a collective left waiting by a one-rank error fails here instead of after 30 minutes.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    torch.set_num_threads(1)
    results: dict = {"world": dist.get_world_size()}
    with case_error(results.setdefault("trainer_raw_rank1", {})) as r:
        _trainer(Accum(raw="all"), "O2", r)
    with case_error(results.setdefault("trainer_unheld_rank1", {})) as r:
        _trainer(Accum(raw="head"), "O2", r)
    for level in ("O2", "bf16-mixed"):
        with case_error(results.setdefault(f"trainer_habits/{level}", {})) as r:
            _trainer(Accum(habits=True), level, r, batches=6)
    with case_error(results.setdefault("accelerate_raw_rank1", {})) as r:
        _accelerate("O2", r, raw_rank1=True)
    for level in ("O2", "bf16"):
        with case_error(results.setdefault(f"accelerate_gan/{level}", {})) as r:
            _accelerate(level, r, gan=True)
    for precision in (None, "bf16-mixed"):
        with case_error(results.setdefault(f"bucket_view/{precision or 'O2'}", {})) as r:
            _bucket_view(precision, r)
    for variant in ("eval_first", "find_unused", "static_graph", "compile", "clip"):
        with case_error(results.setdefault(f"watch/{variant}", {})) as r:
            _fabric_watch(variant, r)
    # Last: before stop 65's review the second fit's wrapper was not found, rank 1 raised alone (a hang, which
    # leaves the group unusable for the cases after it)
    with case_error(results.setdefault("trainer_fit_twice", {})) as r:
        _fit_twice(r)
    finish_cases(results)


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    warnings.simplefilter("ignore")
    main()
