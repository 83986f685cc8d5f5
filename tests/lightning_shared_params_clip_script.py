"""Ranks of tests/test_lightning_shared_params_clip.py (gloo, ONE launch): stop 67's surfaces under Fabric's DDP, each
O2 case beside its reference (``"32-true"`` where two optimizers share a parameter, ``"bf16-mixed"`` otherwise). Each
rank writes, per case, its final weights (FP32: the masters at O2) or the error it raised.

* ``shared_overflow``: the whole model's optimizer and the head's own (one master), the whole one clipped, at float16;
  rank 1's loss overflows at step 1 (the gradients all-reduced: both ranks hold it), so both optimizers skip that
  step on both ranks (the reference skips it by hand);
* ``late_group`` (float16): the whole model's optimizer and the trunk's; the head (held by the whole one) added to
  the trunk's between its clip and its step, on both ranks;
* ``kept_raw_rank0``: accumulation of 2 under ``no_backward_sync``; rank 0 alone steps its half weights by hand
  along the gradients between the backwards and leaves it (a raw step the engine would lose): refused on both ranks;
* ``kept_undone_rank0``: the same write undone by rank 0 from a copy before the second backward (a descent probe):
  trains on. (Undone by subtraction, the half rounding it leaves parts the ranks: tests/test_core_descent_probes.py's
  gap.)
"""

from __future__ import annotations

import datetime
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric

from lightning_mpx import FabricMixedPrecisionPlugin
from tests.launch import case_error, finish_cases
from tests.lightning_ddp_no_sync_script import _batch, _net, _values


def _fabric(precision: str, half: str) -> Fabric:
    if precision == "O2":
        plugin = FabricMixedPrecisionPlugin("O2", half_dtype=half)
        return Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[plugin])
    return Fabric(accelerator="cpu", devices=2, strategy="ddp", precision=precision)


def case(kind: str, precision: str) -> dict[str, Any]:
    fabric = _fabric(precision, "float16" if kind in ("shared_overflow", "late_group") else "bfloat16")

    def train(fabric: Fabric) -> dict[str, Any]:
        rank = fabric.global_rank
        net = _net()
        if kind.startswith("kept"):
            model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
            for step in range(6):
                x, y = _batch(step, rank)
                window = step % 2 == 0
                with fabric.no_backward_sync(model, enabled=window):
                    fabric.backward(F.cross_entropy(model(x).float(), y) / 2)
                if window and rank == 0:
                    with torch.no_grad():
                        saved = [p.clone() for p in net.parameters()]
                        for p in net.parameters():
                            p.sub_(0.05 * p.grad.sign().to(p.dtype))  # a step along the gradients, rank 0 only
                        if kind == "kept_undone_rank0":
                            for p, before in zip(net.parameters(), saved):
                                p.copy_(before)  # undone (from a copy) before the next backward
                if window:
                    continue
                opt.step()
                opt.zero_grad()
            return {"final": _values(net)}
        part = net[0] if kind == "late_group" else net[2]
        model, whole, other = fabric.setup(
            net, torch.optim.SGD(net.parameters(), lr=0.05), torch.optim.SGD(part.parameters(), lr=0.3)
        )
        for step in range(3):
            x, y = _batch(step, rank)
            loss = F.cross_entropy(model(x).float(), y)
            overflow = kind == "shared_overflow" and step == 1
            if overflow and rank == 1 and precision == "O2":
                loss = loss * 1e8  # float16's gradients overflow at any scale
            fabric.backward(loss)
            if overflow and precision != "O2":  # the reference skips the step on both ranks
                whole.zero_grad()
                other.zero_grad()
                continue
            fabric.clip_gradients(model, whole, max_norm=0.1)
            whole.step()
            if kind == "late_group":
                fabric.clip_gradients(model, other, max_norm=0.05)
                if step == 0:
                    other.add_param_group({"params": list(net[2].parameters()), "lr": 0.2})
            other.step()
            whole.zero_grad()
            other.zero_grad()
        amp = getattr(fabric._precision, "amp", None)
        values = amp.fp32_state_dict(net) if amp is not None else net.state_dict()
        return {"final": torch.cat([v.detach().float().flatten() for v in values.values()]).tolist()}

    return fabric.launch(train)


CASES = (
    "shared_overflow/O2", "shared_overflow/32-true", "late_group/O2", "late_group/32-true", "kept_raw_rank0/O2",
    "kept_undone_rank0/O2", "kept_undone_rank0/bf16-mixed",
)  # fmt: skip


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a stray collective: an error, no hang
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in CASES:
            kind, precision = name.split("/")
            with case_error(results.setdefault(name, {})) as result:
                result.update(case(kind, precision))
    finish_cases(results)


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    main()
