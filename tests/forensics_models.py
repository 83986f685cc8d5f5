"""Models that overflow in float16 for a known reason, shared by tests/test_forensics.py and its DDP script.

* ``"activation"``: layer ``blow`` pushes its output past the float16 maximum (the forward is non-finite from there);
* ``"gradient"``: the forward is finite, but layer ``explode`` (tiny weights on large inputs) gets a weight gradient
  past the float16 maximum once the loss is scaled;
* ``"data"``: a NaN in the batch, which layer ``inp`` sees first;
* ``"clean"``: nothing overflows.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

CASES = ("activation", "gradient", "data")
#: The module each case blames (its first non-finite output, or its non-finite gradients).
CULPRIT = {"activation": "blow", "gradient": "explode", "data": "inp"}
ORIGIN = {"activation": "forward", "gradient": "backward", "data": "forward"}


def make_net(case: str) -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(
        OrderedDict(inp=nn.Linear(8, 16), act=nn.ReLU(), blow=nn.Linear(16, 16), explode=nn.Linear(16, 8),
                    out=nn.Linear(8, 4))
    )
    with torch.no_grad():
        if case == "activation":
            net.inp.weight.fill_(0.5)
            net.inp.bias.zero_()
            net.blow.weight.fill_(3e4)  # finite in float16; its outputs (~3e6) are not
        elif case == "gradient":
            # Large activations into explode (~1e3, finite), tiny weights out of it: a finite forward, and a weight
            # gradient of ~1e3 x 1e3 x the loss scale, past 65504.
            net.blow.weight.fill_(8.0)
            net.blow.bias.zero_()
            net.inp.weight.abs_()
            net.inp.bias.zero_()  # zero inputs make zero activations, so a zero batch does not overflow
            net.explode.weight.fill_(1e-4)
    return net


def make_batch(case: str, n: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 8, generator=g) + 1.0
    y = torch.randint(0, 4, (n,), generator=g)
    if case == "data":
        x[1, 3] = float("nan")
    return x, y


def kind_of(tensor: torch.Tensor) -> str | None:
    """The reference: what a gradient holds, computed here independently of lightning_mpx."""
    inf, nan = bool(tensor.isinf().any()), bool(tensor.isnan().any())
    return "inf+nan" if inf and nan else "inf" if inf else "nan" if nan else None


def reference_kinds(named_grads: Any) -> dict[str, str]:
    return {name: kind for name, grad in named_grads if grad is not None and (kind := kind_of(grad)) is not None}


class ForensicsModule(pl.LightningModule):
    """``self.net`` = :func:`make_net`; records the kinds of its (scaled) gradients after each backward.

    Args:
        case: One of :data:`CASES` or ``"clean"``.
        nan_at: (global step, rank): put a NaN into the batch there only.
        only_at: (global step, rank): the batch is zeros everywhere else (with ``"gradient"``: no overflow there).
    """

    def __init__(
        self, case: str, nan_at: tuple[int, int] | None = None, only_at: tuple[int, int] | None = None
    ) -> None:
        super().__init__()
        self.case = case
        self.net = make_net(case)
        self.nan_at = nan_at
        self.only_at = only_at
        self.grad_kinds: list[dict[str, str]] = []
        self.records: list[Any] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        where = (self.trainer.global_step, self.global_rank)
        if self.only_at is not None and where != self.only_at:
            x = torch.zeros_like(x)
        if where == self.nan_at:
            x = x.clone()
            x[0, 0] = float("nan")
        return F.cross_entropy(self.net(x), y)

    def on_after_backward(self) -> None:
        self.grad_kinds.append(reference_kinds((n, p.grad) for n, p in self.named_parameters()))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.records.append(self.trainer.precision_plugin.amp.last_overflow)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class ForensicsData(torch.utils.data.Dataset):
    def __init__(self, case: str, n: int = 16) -> None:
        self.x, self.y = make_batch(case, n=n)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]
