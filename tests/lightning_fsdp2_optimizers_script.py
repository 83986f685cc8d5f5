"""Run by tests/test_lightning_fsdp2_optimizers.py: stop 57's optimizers under FSDP2 through the Trainer
(``ModelParallelStrategy( data_parallel_size=2, tensor_parallel_size=1)``, ``shard_model`` in ``configure_model``), two
CPU processes (gloo), one launch; O2 bfloat16 against Lightning's own ``"bf16-mixed"`` (``fully_shard`` + autocast) on
the same model and data. Kinds: ``sf`` (tests/test_accelerate_schedule_free.py's schedule-free SGD, with
tests/test_lightning_schedule_free.py's closure call: ``eval()`` before each validation and before the checkpoint saved
at the end of the first epoch's validation, ``train()`` at each training epoch's start), ``la``
(tests/test_lightning_optimizer_wrappers_resume.py's timm Lookahead over AdamW) and ``sam`` (tests/test_core_sam.py's
``DoorSAM``, the documented recipe: two passes per step, manual optimization). Each kind and precision runs ``straight``
(4 steps, a distributed checkpoint saved after step 2, through ``torch.distributed.checkpoint``) and ``resumed`` from
that checkpoint; SAM also at O2 float16 (``O2-float16``: a dynamic loss scale over the two backwards of each step).
Every rank writes ``$MPX_OUT/rank{r}.json``."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.launch import case_error, end_ranks, launch_ranks, write_rank_results

STEPS = 4
SAVE_AT = 2  # the checkpoint: after this many steps
KINDS = ("sf", "la", "sam")
PRECISIONS = ("O2", "bf16-mixed")


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s half of step ``step``'s global batch (by step: a resumed fit sees the same data)."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(16, 8, generator=g)[rank * 8 : (rank + 1) * 8]
    return x, x[:, :4].sin()


def full(module: nn.Module) -> dict[str, list[float]]:
    return {n: p.full_tensor().double().flatten().tolist() for n, p in module.named_parameters()}


def optimizer_for(kind: str, params: Any) -> torch.optim.Optimizer:
    from tests.test_accelerate_schedule_free import ClosureScheduleFreeSGD as _ClosureSGD
    from tests.test_core_sam import DoorSAM
    from tests.test_lightning_optimizer_wrappers_resume import TimmLookahead

    # tests/test_accelerate_schedule_free.py's ScheduleFreeSGD, calling the closure as schedulefree's do
    if kind == "sf":
        return _ClosureSGD(params, lr=0.1)
    if kind == "la":
        return TimmLookahead(torch.optim.AdamW(params, lr=0.02), k=2)
    return DoorSAM(params, torch.optim.SGD, lr=0.1, momentum=0.9, rho=0.05)


def fit(kind: str, precision: str, out: str, resume: bool) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from lightning_mpx import MixedPrecisionPlugin
    from lightning_mpx.integrations.fsdp import shard_model
    from tests.lightning_helpers import make_trainer

    path = os.path.join(out, f"{kind}_{precision}")
    sf, sam = kind == "sf", kind == "sam"

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net()
            self.losses: list[float] = []
            self.val_losses: list[float] = []
            self.train_weights: list[dict[str, list[float]]] = []
            self.eval_weights: list[dict[str, list[float]]] = []
            self.automatic_optimization = not sam

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            if precision.startswith("O2"):
                shard_model(self.net, self.trainer.precision_plugin, mesh=mesh, blocks=[self.net[0], self.net[2]])
            else:  # Lightning's FSDP2 "bf16-mixed": fully_shard without a policy, autocast around the step
                for layer in (self.net[0], self.net[2], self.net):
                    fully_shard(layer, mesh=mesh)

        def loss(self) -> torch.Tensor:
            x, y = batch(self.global_step, self.global_rank)
            return F.mse_loss(self.net(x).float(), y)

        def training_step(self, _: Any, __: int) -> Any:
            loss = self.loss()
            self.losses.append(loss.item())
            if not sam:
                return loss
            opt = self.optimizers()
            self.manual_backward(loss)
            opt.first_step(zero_grad=True)
            self.manual_backward(self.loss())
            opt.second_step()
            opt.step()
            opt.zero_grad()
            return None

        def validation_step(self, _: Any, __: int) -> None:
            x, y = batch(1000, self.global_rank)
            self.val_losses.append(F.mse_loss(self.net(x).float(), y).item())

        def on_train_epoch_start(self) -> None:
            if sf:
                self.optimizers().train()

        def on_validation_epoch_start(self) -> None:
            if sf and not self.trainer.sanity_checking:
                self.train_weights.append(full(self.net))
                self.optimizers().eval()
                self.eval_weights.append(full(self.net))

        def on_validation_epoch_end(self) -> None:
            if sf and self.trainer.global_step == SAVE_AT and not resume:  # in eval mode, as ModelCheckpoint saves
                self.trainer.save_checkpoint(path)

        def on_train_batch_start(self, _: Any, __: int) -> None:
            if not sf and self.global_step == SAVE_AT and not resume:
                self.trainer.save_checkpoint(path)

        def on_train_end(self) -> None:
            if sf:
                self.optimizers().eval()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return optimizer_for(kind, self.parameters())

    half = {"O2": "bfloat16", "O2-float16": "float16"}.get(precision)
    plugin = MixedPrecisionPlugin("O2", half_dtype=half) if half else None
    extra = {} if plugin else {"precision": precision}
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    epochs = dict(max_epochs=STEPS // SAVE_AT, limit_val_batches=1, num_sanity_val_steps=0) if sf else {}
    trainer = make_trainer(plugin, strategy=strategy, devices=2, max_steps=STEPS, use_distributed_sampler=False,
                           **epochs, **extra)  # fmt: skip
    model = Lit()
    data = torch.utils.data.DataLoader(range(SAVE_AT if sf else STEPS), batch_size=None)
    trainer.fit(model, data, data if sf else None, ckpt_path=path if resume else None)
    return {"losses": model.losses, "val_losses": model.val_losses, "eval_weights": model.eval_weights,
            "train_weights": model.train_weights, "params": full(model.net), "global_step": trainer.global_step,
            "sharded": bool(plugin and plugin.amp.sharded), "initial": full_initial(model.net),
            "scale": plugin.amp.scalers[0].get_scale() if plugin else None,
            "skipped": plugin.amp.skipped_steps if plugin else None}  # fmt: skip


def full_initial(sharded: nn.Module) -> dict[str, list[float]]:
    """The weights the fit started from, as :func:`full` lists them."""
    return {n: p.double().flatten().tolist() for n, p in net().named_parameters()}


def main() -> int:
    if "RANK" not in os.environ:
        return launch_ranks(__file__, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    out, rank = os.environ["MPX_OUT"], int(os.environ["RANK"])
    results: dict[str, Any] = {}
    for kind in KINDS:
        for precision in PRECISIONS:
            for resume in (False, True):
                name = f"{kind}_{precision}_{'resumed' if resume else 'straight'}"
                with case_error(results.setdefault(name, {})) as record:
                    record.update(fit(kind, precision, out, resume))
                dist.barrier()
    for resume in (False, True):  # SAM's two backwards per step under a dynamic float16 scale
        with case_error(results.setdefault(f"sam_O2-float16_{'resumed' if resume else 'straight'}", {})) as record:
            record.update(fit("sam", "O2-float16", out, resume))
        dist.barrier()
    write_rank_results(results, rank=rank)
    end_ranks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
