"""An Apex-era training script that runs on lightning_mpx with the imports changed, and nothing else.

    python examples/apex_legacy.py --opt-level O2          # amp.initialize / scale_loss / checkpoint / resume
    python examples/apex_legacy.py --fp16-optimizer        # FP16_Optimizer with dynamic loss scaling

The only changed lines are the two imports marked ``# was: ...``. Runs on CPU (float16 matmuls are slow there but
supported) or on a GPU.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx.apex import amp  # was: from apex import amp
from lightning_mpx.apex.fp16_utils import FP16_Optimizer, network_to_half  # was: from apex.fp16_utils import ...


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))


def batches(n: int, device: torch.device, seed: int = 0):
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))  # the same task before and after resuming
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(32, 16, generator=g)
        yield x.to(device), (x @ w).argmax(1).to(device)


def amp_loop(opt_level: str, device: torch.device, steps: int) -> None:
    torch.manual_seed(0)
    model = make_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level)
    checkpoint_path = os.path.join(tempfile.mkdtemp(), "checkpoint.pt")

    def train(data):
        for step, (x, y) in enumerate(data):
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 5.0)
            optimizer.step()
            if step % 20 == 0:
                print(f"{opt_level} step {step:3d} loss {loss.item():.4f} "
                      f"scale {amp._amp_state.loss_scalers[0].loss_scale():g}")

    train(batches(steps, device))
    # Apex's recommended checkpoint: model, optimizer and amp state.
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()},
               checkpoint_path)

    # Resume as Apex documents: initialize first, then load the three state dicts.
    model = make_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level)
    checkpoint = torch.load(checkpoint_path)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    print(f"{opt_level} resumed at loss scale {amp._amp_state.loss_scalers[0].loss_scale():g}")
    train(batches(steps, device, seed=1))


def fp16_optimizer_loop(device: torch.device, steps: int) -> None:
    torch.manual_seed(0)
    model = network_to_half(make_model().to(device))
    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               dynamic_loss_scale=True)
    for step, (x, y) in enumerate(batches(steps, device)):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x).float(), y)
        optimizer.backward(loss)
        optimizer.clip_master_grads(5.0)
        optimizer.step()
        if step % 20 == 0:
            print(f"FP16_Optimizer step {step:3d} loss {loss.item():.4f} scale {optimizer.loss_scale:g} "
                  f"overflow {optimizer.overflow}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O1", choices=["O0", "O1", "O2", "O3"])
    parser.add_argument("--fp16-optimizer", action="store_true")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # shows "Gradient overflow.  Skipping step, ..."
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.fp16_optimizer:
        fp16_optimizer_loop(device, args.steps)
    else:
        amp_loop(args.opt_level, device, args.steps)


if __name__ == "__main__":
    main()
