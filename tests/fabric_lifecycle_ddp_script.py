"""Run by tests/test_fabric_lifecycle.py: ``Fabric(strategy="ddp", devices=2)`` with the plugin at O2 (bfloat16), two
CPU processes (gloo), no ``mpx.setup_optimizers`` in the runs checked.

1. litgpt's full fine-tuning path: the model is set up (each rank its own initial weights), then pretrained FP32
   weights are loaded with ``fabric.load_raw``; a body and a head optimizer (learning rate 0: the masters they step
   are the ones training starts from) step one after the other. Each rank counts the masters equal to the FP32
   weights, and the entries of ``fp32_state_dict`` equal to them.
2. A step-0 checkpoint (nothing kept from before the cast under a process group), resumed the documented way
   (``setup``, ``setup_optimizers``, ``load``) into a model of other weights: the resumed run must end with the
   straight run's weights and masters.

Every rank writes its findings to ``$MPX_OUT/rank{r}.json``.
"""

import json
import os

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin
from tests.launch import end_ranks


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def train(fabric: Fabric, model, optimizers, steps: range) -> None:
    for step in steps:
        x, y = batch(step, fabric.global_rank)
        fabric.backward(F.cross_entropy(model(x), y))
        for optimizer in optimizers:
            optimizer.step()
        for optimizer in optimizers:
            optimizer.zero_grad()


def main() -> None:
    out = os.environ["MPX_OUT"]
    mpx = FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[mpx])
    fabric.launch()
    rank = fabric.global_rank
    record: dict = {"world_size": fabric.world_size}

    # 1. load_raw after setup
    pretrained = {k: v.detach().clone() for k, v in net(seed=1).state_dict().items()}  # the same on every rank
    path = os.path.join(out, "pretrained.pt")
    if rank == 0:
        torch.save(pretrained, path)
    fabric.barrier()
    model = net(seed=10 + rank)
    opt_body = torch.optim.SGD(model[0].parameters(), lr=0.0)
    opt_head = torch.optim.SGD(model[2].parameters(), lr=0.0)
    model, opt_body, opt_head = fabric.setup(model, opt_body, opt_head)
    fabric.load_raw(path, model)
    train(fabric, model, [opt_body, opt_head], range(2))
    module = model.module
    masters = [(name, mpx.amp.master_of(p)) for name, p in module.named_parameters()]
    record["masters"] = sum(m.dtype == torch.float32 for _, m in masters)
    record["exact_masters"] = sum(torch.equal(m, pretrained[name]) for name, m in masters)
    exported = mpx.amp.fp32_state_dict(module)
    record["exact_export"] = sum(torch.equal(exported[k], v) for k, v in pretrained.items())

    # 2. a step-0 checkpoint, resumed the documented way
    mpx2 = FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")
    fabric2 = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[mpx2])
    fabric2.launch()  # finds the process group running
    model = net(seed=20 + rank)
    opt_body = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
    opt_head = torch.optim.AdamW(model[2].parameters(), lr=1e-2)
    model, opt_body, opt_head = fabric2.setup(model, opt_body, opt_head)
    checkpoint = os.path.join(out, "step0.ckpt")
    fabric2.save(checkpoint, {"model": model, "opt_body": opt_body, "opt_head": opt_head, "mpx": mpx2})
    train(fabric2, model, [opt_body, opt_head], range(3))
    straight = model.module

    mpx3 = FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")
    fabric3 = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[mpx3])
    fabric3.launch()
    model = net(seed=30 + rank)
    opt_body = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
    opt_head = torch.optim.AdamW(model[2].parameters(), lr=1e-2)
    model, opt_body, opt_head = fabric3.setup(model, opt_body, opt_head)
    mpx3.setup_optimizers(opt_body, opt_head)
    fabric3.load(checkpoint, {"model": model, "opt_body": opt_body, "opt_head": opt_head, "mpx": mpx3})
    train(fabric3, model, [opt_body, opt_head], range(3))
    record["resumed_equal"] = all(
        torch.equal(a, b) and torch.equal(mpx2.amp.master_of(a), mpx3.amp.master_of(b))
        for a, b in zip(straight.parameters(), model.module.parameters())
    )
    record["params"] = [p.detach().float().flatten().tolist() for p in model.module.parameters()]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    end_ranks()  # three DDP models in one gloo group: a rank once hung in its teardown after writing this


if __name__ == "__main__":
    main()
