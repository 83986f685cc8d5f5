"""Two-process cases of tests/test_hostile_stepped_doors.py (gloo, one launch): a core ``Amp`` loop around
``DistributedDataParallel`` that keeps its gradients across steps (no ``zero_grad``), against the same loop in FP32;
then Lightning's ``strategy="ddp"`` with a no-op ``optimizer_zero_grad`` and accumulation, against "32-true".

Each rank writes ``$MPX_OUT/rank{r}.json``: per case the largest difference of its weights from the FP32 twin's.
"""

from __future__ import annotations

import json
import os
import sys

if "RANK" not in os.environ:  # the launcher
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.launch import launch_ranks

    raise SystemExit(launch_ranks(__file__))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from tests.launch import end_ranks  # noqa: E402

#: case -> (DDP keywords, actions): "bw" a backward, "ns" a backward under no_sync, "step", "zero0"
CASES = {
    "bucket_view": ({"gradient_as_bucket_view": True}, ["bw", "step"] * 3 + ["bw", "step", "step"]),
    "bucket_view_zero0": ({"gradient_as_bucket_view": True}, ["bw", "step", "zero0", "bw", "step", "bw", "step"]),
    "no_sync": ({}, ["ns", "bw", "step", "ns", "bw", "step"]),
    "no_sync_bucket_view": ({"gradient_as_bucket_view": True}, ["ns", "bw", "step", "ns", "bw", "step"]),
    "static_graph": ({"static_graph": True}, ["bw", "step"] * 4),
}


def _batch(i: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + 10 * i + rank)
    return torch.randn(8, 8, generator=g), torch.randn(8, 3, generator=g)


def _run(level: str | None, ddp_kwargs: dict, actions: list[str], rank: int) -> list[torch.Tensor]:
    from lightning_mpx import Amp

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    amp = None
    if level is not None:
        amp = Amp(level, half_dtype="bfloat16", loss_scale="dynamic", growth_interval=1)
        net = amp.prepare_model(net)
    model = nn.parallel.DistributedDataParallel(net, **ddp_kwargs)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    if amp is not None:
        opt = amp.prepare_optimizer(opt)
    it = 0
    for action in actions:
        if action in ("bw", "ns"):
            x, y = _batch(it, rank)
            it += 1
            ctx = model.no_sync() if action == "ns" else torch.enable_grad()
            with ctx:
                if amp is None:
                    F.mse_loss(model(x), y).backward()
                else:
                    with amp.forward_context():
                        out = amp.cast_outputs(model(amp.cast_inputs(x))).float()
                    amp.backward(F.mse_loss(out, y))
        elif action == "step":
            if amp is None:
                opt.step()
            else:
                amp.step(opt)
                amp.update()
        elif action == "zero0":
            opt.zero_grad(set_to_none=False)
    if amp is not None and amp.properties.master_weights:
        return [p.detach().clone() for p in amp.master_params(opt)]
    return [p.detach().float().clone() for p in net.parameters()]


class _KeepGrads(pl.LightningModule):
    """Automatic optimization whose ``optimizer_zero_grad`` does nothing: the gradients pile up across steps."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))

    def training_step(self, data, index):
        return F.mse_loss(self.net(data[0]).float(), data[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        pass


def _fit(level: str | None) -> list[torch.Tensor]:
    """Lightning's ``strategy="ddp"`` with ``accumulate_grad_batches=2`` (no_sync between), the plugin at ``level``
    or Lightning's "32-true"; 6 batches per rank, split by the Trainer's sampler."""
    from lightning_mpx import MixedPrecisionPlugin

    xs, ys = zip(*(_batch(i, 0) for i in range(12)))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=8)
    plugin = None
    if level is not None:
        plugin = MixedPrecisionPlugin(level, half_dtype="bfloat16", loss_scale="dynamic", growth_interval=1)
    module = _KeepGrads()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, accumulate_grad_batches=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        plugins=[plugin] if plugin is not None else None, precision=None if plugin is not None else "32-true",
    )  # fmt: skip
    trainer.fit(module, data)
    if plugin is not None and plugin.amp.properties.master_weights:
        return [p.detach().clone() for o in trainer.optimizers for p in plugin.amp.master_params(o)]
    return [p.detach().float().clone() for p in module.parameters()]


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    results = {}
    for name, (kwargs, actions) in CASES.items():
        want = _run(None, kwargs, actions, rank)
        for level in ("O1", "O2"):
            got = _run(level, kwargs, actions, rank)
            results[f"{name}-{level}"] = max((g - w).abs().max().item() for g, w in zip(got, want))
    want = _fit(None)  # the process group is up: Lightning's DDP strategy joins it
    for level in ("O1", "O2"):
        got = _fit(level)
        results[f"lightning_ddp_accumulate-{level}"] = max((g - w).abs().max().item() for g, w in zip(got, want))
    with open(os.path.join(os.environ["MPX_OUT"], f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    end_ranks()


if __name__ == "__main__":
    main()
