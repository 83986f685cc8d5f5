"""Ranks of tests/test_lightning_masters_state_dict.py (two CPU processes, gloo; its one multi-rank launch): the O2
LightningModule's ``state_dict()`` giving the FP32 masters, under Lightning's ``strategy="ddp"`` (bfloat16). Every rank
writes ``$MPX_OUT/rank{r}.json``; a case that raises leaves its traceback in the case's ``"error"``.

* ``weights_only``: ``ModelCheckpoint(save_weights_only=True)`` (Lightning writes it on rank 0 only, without the
  precision plugin's hooks) holds FP32 weights, rank 0's masters exactly, and ``"bf16-mixed"``'s to a tolerance.
* ``resume``: a full checkpoint after one epoch (2 steps) resumed to two ends where the uninterrupted run ends.
* ``rank0_read``: ``self.state_dict()`` on rank 0 only inside ``training_step`` (a rank-zero callback's habit) does
  not hang (no collective) and changes nothing.
"""

from __future__ import annotations

import os
import tempfile
import warnings

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_mpx import MixedPrecisionPlugin
from tests.launch import case_error, end_ranks, write_rank_results


class Net(pl.LightningModule):
    def __init__(self, read_on_rank0: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
        self.read_on_rank0 = read_on_rank0

    def training_step(self, batch, index):
        if self.read_on_rank0 and self.global_rank == 0:
            self.state_dict()
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.5)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
        return torch.utils.data.DataLoader(list(zip(x, y)), batch_size=4)


def fit(module, precision: str = "O2", max_epochs: int = 2, ckpt_path=None, callbacks=(), root=None) -> pl.Trainer:
    prec = {"plugins": [MixedPrecisionPlugin("O2", half_dtype="bfloat16")]} if precision == "O2" else {
        "precision": precision}  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=bool(callbacks),
        enable_progress_bar=False, enable_model_summary=False, max_epochs=max_epochs, callbacks=list(callbacks),
        default_root_dir=root, **prec,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def flat(state: dict) -> list[float]:
    return torch.cat([v.detach().float().flatten() for v in state.values()]).tolist()


def shared_dir() -> str:
    path = [tempfile.mkdtemp(dir=os.environ["MPX_OUT"]) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    return path[0]


def main() -> None:
    dist.init_process_group("gloo")
    rank, out = dist.get_rank(), {}
    root = shared_dir()
    with case_error(out.setdefault("weights_only", {})) as case:
        held = {}
        for precision in ("O2", "bf16-mixed"):
            checkpoint = ModelCheckpoint(dirpath=os.path.join(root, precision), save_weights_only=True, save_top_k=-1)
            module = Net()
            fit(module, precision, callbacks=[checkpoint], root=root)
            dist.barrier()
            saved = checkpoint.best_model_path or checkpoint.last_model_path
            state = torch.load(saved, weights_only=True)["state_dict"]
            held[precision] = state
            if precision == "O2":
                mine = module.state_dict()
                case["dtypes"] = sorted({str(v.dtype) for v in state.values()})
                case["masters_exact"] = all(torch.equal(state[k], mine[k]) for k in mine)
        case["max_diff_to_bf16_mixed"] = max(
            (held["O2"][k] - held["bf16-mixed"][k]).abs().max().item() for k in held["O2"]
        )
    with case_error(out.setdefault("resume", {})) as case:
        straight = Net()
        fit(straight)
        first = Net()
        trainer = fit(first, max_epochs=1)
        path = os.path.join(root, "full.ckpt")
        trainer.save_checkpoint(path)
        dist.barrier()
        resumed = Net()
        fit(resumed, ckpt_path=path)
        case["straight"], case["resumed"] = flat(straight.state_dict()), flat(resumed.state_dict())
    with case_error(out.setdefault("rank0_read", {})) as case:
        reader = Net(read_on_rank0=True)
        fit(reader)
        case["weights"] = flat(reader.state_dict())
        case["straight"] = out["resume"].get("straight")
    write_rank_results(out, rank=rank)
    end_ranks()


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    warnings.simplefilter("ignore")
    main()
