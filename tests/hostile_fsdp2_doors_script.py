"""Run by tests/test_hostile_fsdp2_doors.py: the Accelerate adapter and the Trainer plugin under FSDP2, two CPU
processes (gloo), one launch, on a tiny GPT (tied ``wte``/``lm_head``; a block whose first ``Linear`` is frozen, so
one sharded unit holds frozen and trainable parameters).

Accelerate (as tests/accelerate_fsdp_script.py: Accelerate's state told ``MULTI_GPU`` on device ``cpu``):
``acc_O2`` (``mixed_precision="O2"``, bfloat16; the optimizer made from ``model.parameters()``, frozen ones
included; rank 1 alone writes an inf at step ``INF_AT``; ``clip_grad_norm_`` on the trainable parameters; then
``get_state_dict``, ``unwrap_model``, ``save_state`` and ``load_state`` into a fresh accelerator) and ``acc_bf16``
(Accelerate's own ``mixed_precision="bf16"``, the same model and steps without the inf: the reference).
Trainer (``ModelParallelStrategy``, ``shard_model`` in ``configure_model``, O2 float16 with a dynamic scale,
``gradient_clip_val``): ``straight`` saves a distributed checkpoint before the first step and after the skipped
one (``trainer.save_checkpoint``), ``from0``/``from2`` resume them. Every rank writes ``$MPX_OUT/rank{r}.json``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.launch import case_error, end_ranks, launch_ranks, write_rank_results

INF_AT = 1  # the step whose gradient gets an inf, on rank 1 only
STEPS = 4
CLIP = 0.5


class GPT(nn.Module):
    """Embedding, a block (its first Linear frozen), a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(32, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.block[0].requires_grad_(False)
        self.lm_head = nn.Linear(16, 32, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.block(self.wte(ids)))


def tokens(step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s half of step ``step``'s global batch (by step, so that a resumed fit sees the same data)."""
    g = torch.Generator().manual_seed(10 + step)
    return torch.randint(0, 32, (8, 6), generator=g)[rank * 4 : (rank + 1) * 4]


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), ids.flatten())


def local(t: torch.Tensor) -> torch.Tensor:
    from lightning_mpx.engine.sharding import local_tensor

    return local_tensor(t)


def poison(param: torch.Tensor) -> None:
    local(param.grad).view(-1)[0] = float("inf")


def gathered_norm(params: list[torch.Tensor], scale: float) -> float:
    """The unscaled FP64 norm of the full gradients (each parameter once), gathered from every rank."""
    norms = [p.grad.full_tensor().double().norm() for p in params if p.grad is not None]
    return float(torch.stack(norms).norm()) / scale


def full(params: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    return {n: p.full_tensor().double().flatten().tolist() for n, p in params.items()}


# -- Accelerate ------------------------------------------------------------------------------------------------------
def accelerator(mixed_precision: str) -> Any:
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    reset_accelerate_state()
    PartialState(cpu=True)
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    PartialState._shared_state["device"] = torch.device("cpu")
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    handlers = [MixedPrecisionKwargs(half_dtype="bfloat16", on_floor="continue")] if mixed_precision == "O2" else []
    return Accelerator(mixed_precision=mixed_precision, fsdp_plugin=plugin, cpu=True, kwargs_handlers=handlers)


def accelerate_case(mixed_precision: str, rank: int, out: str) -> dict[str, Any]:
    acc = accelerator(mixed_precision)
    model = GPT()
    # model.parameters(), frozen ones included (torch's optimizers skip a parameter without a gradient)
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    ours = mixed_precision == "O2"
    trainable = [p for p in model.parameters() if p.requires_grad]
    record: dict[str, Any] = {"losses": [], "norms": [], "ref_norms": [], "skipped": []}
    for step in range(STEPS):
        ids = tokens(step, rank)
        loss = lm_loss(model(ids), ids)
        acc.backward(loss)
        if ours and step == INF_AT and rank == 1:
            poison(model.block[2].weight)
        scale = acc.amp.scalers[0].get_scale() if ours else 1.0
        record["ref_norms"].append(gathered_norm(trainable, scale))
        with case_error(record):
            record["norms"].append(float(acc.clip_grad_norm_(trainable, CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        record["skipped"].append(bool(optimizer.step_was_skipped))
        record["losses"].append(float(loss.detach()))
    record["frozen_unchanged"] = torch.equal(model.block[0].weight.full_tensor(), GPT().block[0].weight)
    shards = full(dict(model.named_parameters()))
    state = acc.get_state_dict(model)  # the full state dict on rank 0 (Accelerate gathers it there), empty elsewhere
    if rank == 0:
        record["state_dtypes"] = sorted({str(v.dtype) for v in state.values()})
        # the FP32 values trained (FSDP's FP32 shards, the masters at O2), not a half copy; the tied weight once
        record["state_is_shards"] = all(state[n].double().flatten().tolist() == shards[n] for n in shards)
        record["tied_in_state"] = torch.equal(state["wte.weight"], state["lm_head.weight"])
    record["unwrapped_dtypes"] = sorted({str(p.dtype) for p in acc.unwrap_model(model).parameters()})
    if ours:
        path = os.path.join(out, "acc_state")
        acc.save_state(path)
        saved = repr(acc.amp.state_dict())
        fresh = accelerator(mixed_precision)
        model2 = GPT()
        model2, optimizer2 = fresh.prepare(model2, torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9))
        fresh.load_state(path)
        record["state_restored"] = repr(fresh.amp.state_dict()) == saved
        record["weights_restored"] = full(dict(model2.named_parameters())) == shards
        record["skipped_steps"] = fresh.amp.skipped_steps
    return record


# -- Trainer ---------------------------------------------------------------------------------------------------------
def trainer_case(name: str, out: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_mpx import MixedPrecisionPlugin
    from lightning_mpx.integrations.fsdp import shard_model
    from tests.lightning_helpers import make_trainer

    saves = {0: os.path.join(out, "ckpt0"), 2: os.path.join(out, "ckpt2")} if name == "straight" else {}

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = GPT()
            self.losses: list[float] = []
            self.norms: list[float] = []
            self.engine_norms: list[float] = []
            self.saved: dict[int, str] = {}

        def configure_model(self) -> None:
            shard_model(self.gpt, self.trainer.precision_plugin, mesh=self.device_mesh["data_parallel"],
                        blocks=[self.gpt.block])  # fmt: skip

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            ids = tokens(self.global_step, self.global_rank)
            loss = lm_loss(self.gpt(ids), ids)
            self.losses.append(loss.item())
            return loss

        def on_after_backward(self) -> None:
            if self.global_step == INF_AT and self.global_rank == 1:
                poison(self.gpt.block[2].weight)

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            self.norms.append(gathered_norm([p for p in self.parameters() if p.requires_grad], 1.0))

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if self.global_step in saves:
                self.trainer.save_checkpoint(saves[self.global_step])
                self.saved[self.global_step] = repr(self.trainer.precision_plugin.amp.state_dict()["scalers"])

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.engine_norms.append(self.trainer.precision_plugin.metrics().get("mpx/grad_norm", float("nan")))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    plugin = MixedPrecisionPlugin("O2", half_dtype="float16", init_scale=1024.0, growth_interval=2, on_floor="continue")
    model = Lit()
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = make_trainer(plugin, strategy=strategy, devices=2, max_steps=STEPS, gradient_clip_val=CLIP,
                           use_distributed_sampler=False)  # fmt: skip
    ckpt = {"from0": os.path.join(out, "ckpt0"), "from2": os.path.join(out, "ckpt2")}.get(name)
    trainer.fit(model, torch.utils.data.DataLoader(range(STEPS), batch_size=None), ckpt_path=ckpt)
    return {
        "losses": model.losses, "norms": model.norms, "engine_norms": model.engine_norms, "saved": model.saved,
        "global_step": trainer.global_step, "skipped": plugin.amp.skipped_steps,
        "scalers": repr(plugin.amp.state_dict()["scalers"]), "params": full(dict(model.gpt.named_parameters())),
        "frozen_unchanged": torch.equal(model.gpt.block[0].weight.full_tensor(), GPT().block[0].weight),
    }  # fmt: skip


def main() -> int:
    if "RANK" not in os.environ:
        return launch_ranks(__file__, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    out, rank = os.environ["MPX_OUT"], int(os.environ["RANK"])
    results: dict[str, Any] = {}
    for name in ("acc_O2", "acc_bf16"):
        with case_error(results.setdefault(name, {})) as record:
            record.update(accelerate_case(name[4:], rank, out))
        dist.barrier()
    for name in ("straight", "from0", "from2"):
        with case_error(results.setdefault(name, {})) as record:
            record.update(trainer_case(name, out))
        dist.barrier()
    write_rank_results(results, rank=rank)
    end_ranks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
