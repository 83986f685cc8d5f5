"""Ranks of tests/test_fabric_clip_overflow_writes.py (gloo, ONE launch): Fabric at O2/O1 float16,
``fabric.clip_gradients`` then a write to the model's gradients, rank 1 alone overflowing at step :data:`INF_AT` (every
rank must skip it). Each rank writes, per case, its norms, skips and final weights (the masters at O2); the references
run in each rank (one process each).

* ``ddp_super/O2``: a ``DDPStrategy`` subclass whose ``clip_gradients_norm`` calls ``super()`` (its frame is not
  Lightning's: the plugin tells Lightning's clip by its code object);
* ``ddp_read/O2``: Fabric's ``"ddp"``, the user's own read of ``mpx.main_params(optimizer)`` after the clip (a log of
  the masters' norms) before the write;
* ``ddp_own/O2``: a ``DDPStrategy`` subclass that clips ``precision.main_params`` itself: the write is refused at the
  step, on every rank (no rank left waiting in a collective);
* ``ref_ddp``: the same steps in FP32 on both ranks' batches (the overflow step left out);
* ``fsdp2/O1`` and ``fsdp1/O1``: ``ModelParallelStrategy`` (``shard_model``) and ``FSDPStrategy``, an inf written into
  rank 1's shard of a gradient at :data:`INF_AT`, the clip with ``error_if_nonfinite=False``, the write, the step;
  ``ref_sharded``: those steps unsharded in FP32 on the global batch (tests/fabric_fsdp_clipping_script.py's model and
  data);
* ``trainer/O2`` and ``trainer/16-mixed``: the Trainer under DDP reading Lightning's ``grad_norm`` in
  ``on_before_optimizer_step`` (clipping, accumulating over 3 batches, rank 1 overflowing once).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy

from lightning_mpx import FabricMixedPrecisionPlugin
from tests.launch import quiet_case as _quiet
from tests.launch import run_cases
from tests.lightning_ddp_no_sync_script import _batch, _net

STEPS = 3
INF_AT = 1
MAX_NORM = 0.5


class SuperClip(DDPStrategy):
    """The user's strategy: its own ``clip_gradients_norm`` (a log line, say) that calls Lightning's."""

    def clip_gradients_norm(self, module: Any, optimizer: Any, max_norm: Any, norm_type: Any = 2.0,
                            error_if_nonfinite: bool = True) -> torch.Tensor:  # fmt: skip
        return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)


class OwnClip(DDPStrategy):
    """The user's strategy that clips ``precision.main_params`` itself (not through ``super()``)."""

    def clip_gradients_norm(self, module: Any, optimizer: Any, max_norm: Any, norm_type: Any = 2.0,
                            error_if_nonfinite: bool = True) -> torch.Tensor:  # fmt: skip
        self.precision.unscale_gradients(optimizer)
        params = self.precision.main_params(optimizer)
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type, error_if_nonfinite=False)


def _flat(values: Any) -> list[float]:
    return torch.cat([v.detach().float().flatten() for v in values]).tolist()


def _ddp(kind: str) -> dict[str, Any]:
    plugin = FabricMixedPrecisionPlugin("O2", half_dtype="float16", init_scale=2.0**8)
    strategy: Any = {"ddp_super": SuperClip, "ddp_own": OwnClip}.get(kind)
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp" if strategy is None else strategy(), plugins=[plugin])
    fabric.launch()
    rank = fabric.global_rank
    net = _net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    out: dict[str, Any] = {"norms": [], "skipped": [], "read": []}
    for step in range(STEPS):
        x, y = _batch(step, rank)
        loss = F.cross_entropy(model(x * 4).float(), y)
        fabric.backward(loss * 1e8 if (step == INF_AT and rank == 1) else loss)  # float16 overflows, rank 1 alone
        out["norms"].append(float(fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM, error_if_nonfinite=False)))
        if kind == "ddp_read":  # the masters' gradients read for a log: no clip
            out["read"].append(float(torch.nn.utils.get_total_norm([m.grad for m in plugin.main_params(optimizer)])))
        for p in net.parameters():
            p.grad.mul_(0.5)
        try:
            optimizer.step()
        except RuntimeError as error:
            out["refused"] = str(error)[:120]
            return out
        out["skipped"].append(plugin.step_was_skipped(optimizer))
        optimizer.zero_grad()
    out["final"] = _flat(plugin.fp32_state_dict(net).values())
    return out


def _ref_ddp() -> dict[str, Any]:
    net = _net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    norms = []
    for step in range(STEPS):
        if step == INF_AT:
            continue  # skipped on every rank
        loss = sum(F.cross_entropy(net(x * 4), y) for x, y in (_batch(step, 0), _batch(step, 1))) / 2
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)))
        for p in net.parameters():
            p.grad.mul_(0.5)
        optimizer.step()
        optimizer.zero_grad()
    return {"norms": norms, "final": _flat(net.state_dict().values())}


def _sharded(strategy: str) -> dict[str, Any]:
    from tests.fabric_fsdp_clipping_script import CLIP, build, data, fabric_for, local_shard, sgd, weights

    fabric, plugin = fabric_for(strategy, "O1", "float16")
    model = fabric.setup_module(build())
    optimizer = fabric.setup_optimizers(sgd(model.parameters()))
    out: dict[str, Any] = {"norms": [], "skipped": []}
    for step in range(STEPS):
        x, y = data(step, fabric.global_rank)
        fabric.backward(F.mse_loss(model(x).float(), y))
        if step == INF_AT and fabric.global_rank == 1:
            local_shard(model).view(-1)[0] = float("inf")
        out["norms"].append(float(fabric.clip_gradients(model, optimizer, max_norm=CLIP, error_if_nonfinite=False)))
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(0.5)
        optimizer.step()
        out["skipped"].append(plugin.step_was_skipped(optimizer))
        optimizer.zero_grad()
    out["final"] = weights(model)
    return out


def _ref_sharded() -> dict[str, Any]:
    from tests.fabric_fsdp_clipping_script import CLIP, build, data, sgd, weights

    model = build()
    optimizer = sgd(model.parameters())
    norms = []
    for step in range(STEPS):
        if step == INF_AT:
            continue
        x, y = data(step, None)
        F.mse_loss(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        for p in model.parameters():
            p.grad.mul_(0.5)
        optimizer.step()
        optimizer.zero_grad()
    return {"norms": norms, "final": weights(model)}


def _trainer(precision: str) -> dict[str, Any]:
    """The Trainer under DDP, float16, ``gradient_clip_val`` and ``accumulate_grad_batches=3``, Lightning's
    ``grad_norm(self, 2)`` read in ``on_before_optimizer_step``; rank 1's batch 4 overflows (the second step skipped
    on both ranks). ``precision``: O2, or Lightning's ``MixedPrecision("16-mixed")`` with a CPU ``GradScaler``."""
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision
    from lightning.pytorch.utilities import grad_norm

    from lightning_mpx import MixedPrecisionPlugin

    class Logged(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()
            self.norms: list[float] = []

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            if index == 4 and self.global_rank == 1:
                x = x * 1e6
            return F.cross_entropy(self.net(x * 4).float(), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.norms.append(float(grad_norm(self, 2)["grad_2.0_norm_total"]))

    if precision == "16-mixed":
        plugin: Any = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))
    else:
        plugin = MixedPrecisionPlugin(precision, half_dtype="float16", init_scale=2.0**8)
    module = Logged()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         plugins=[plugin], gradient_clip_val=0.5, accumulate_grad_batches=3)  # fmt: skip
    xs = torch.cat([_batch(i, 0)[0] for i in range(9)] + [_batch(i, 1)[0] for i in range(9)])
    ys = torch.cat([_batch(i, 0)[1] for i in range(9)] + [_batch(i, 1)[1] for i in range(9)])
    trainer.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=4))
    values = plugin.amp.fp32_state_dict(module) if precision == "O2" else module.state_dict()
    return {"norms": module.norms, "final": _flat(values.values())}


CASES = {
    **{f"{kind}/O2": _quiet(lambda kind=kind: _ddp(kind)) for kind in ("ddp_super", "ddp_read", "ddp_own")},
    "ref_ddp": _quiet(_ref_ddp),
    **{f"{strategy}/O1": _quiet(lambda strategy=strategy: _sharded(strategy)) for strategy in ("fsdp2", "fsdp1")},
    "ref_sharded": _quiet(_ref_sharded),
    **{
        f"trainer/{precision}": _quiet(lambda precision=precision: _trainer(precision))
        for precision in ("O2", "16-mixed")
    },
}


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    run_cases(CASES, timeout_s=60)
