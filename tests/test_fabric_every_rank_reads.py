"""Stop 64's merged changes attacked as a careless user (review64): Fabric's clip limits under a strategy of one's
own, reads on every rank under DDP (save after the last read, load after a read) against ``GradScaler``'s scale
history, and the workaround the refusal of ``fabric.backward`` before ``fabric.setup`` names for tensors of one's own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import SingleDeviceStrategy
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin
from tests.launch import case_results


# -- 1. fabric.clip_gradients through a strategy of one's own ----------------------------------------------------
class _KwargsStrategy(SingleDeviceStrategy):
    """A strategy whose clip by norm takes Fabric's keywords as ``**kwargs`` (it could log them) and clips as
    Fabric's does."""

    def clip_gradients_norm(self, module: Any, optimizer: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        self.precision.unscale_gradients(optimizer)
        return torch.nn.utils.clip_grad_norm_(self.precision.main_params(optimizer), **kwargs)


def _clipped(strategy: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, plugins=[FabricMixedPrecisionPlugin("O1")])
    net = nn.Linear(4, 2)
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    fabric.backward(model(torch.randn(3, 4)).sum())
    norm = fabric.clip_gradients(model, opt, max_norm=0.5)
    return norm, [p.grad.clone() for p in net.parameters()]


def test_a_strategy_of_ones_own_with_kwargs_clips_as_fabrics() -> None:
    """A strategy's ``clip_gradients_norm(self, module, optimizer, **kwargs)`` holds no ``max_norm`` local: the limit
    check read ``None`` there and refused a valid ``max_norm=0.5`` ("max_norm=None must be a positive number"). Now
    it clips as Fabric's own strategy does (same norm, same gradients)."""
    norm, grads = _clipped(_KwargsStrategy(device=torch.device("cpu")))
    ref_norm, ref_grads = _clipped("auto")
    assert norm == ref_norm
    for grad, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref, rtol=0, atol=0)


# -- 3. reads on every rank under DDP never end the iteration: one launch -----------------------------------------
# torch.amp.GradScaler's history for init_scale=2**10, growth_interval=1 and overflows at iterations 1 and 3.
_GRADSCALER = [2048.0, 1024.0, 2048.0, 1024.0, 2048.0]


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out: Path = tmp_path_factory.mktemp("review64")
    return case_results("fabric_every_rank_reads_script.py", out, timeout=150)


def _gradscaler_history() -> list[float]:
    """What ``torch.amp.GradScaler`` shows after each iteration for the script's overflows (on one rank of two)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    param = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.1)
    history = []
    for step in range(5):
        scaler.scale(param.sum() * (float("inf") if step in (1, 3) else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        history.append(scaler.get_scale())
    return history


@pytest.mark.parametrize("case", ["read_save", "read_load"])
def test_reads_on_every_rank_show_gradscalers_history(launched: list[dict[str, Any]], case: str) -> None:
    """``mpx.metrics()`` on every rank after each iteration's step: the scale GradScaler shows, one overflow counted
    per overflowing iteration (none twice), the same on both ranks."""
    assert _gradscaler_history() == _GRADSCALER
    for rank in launched:
        assert rank[case]["reads"] == _GRADSCALER
        assert rank[case]["overflows"] == [0.0, 1.0, 0.0, 1.0, 0.0]
        assert rank[case]["skipped"] == 2.0


def test_a_save_after_the_last_read_holds_the_last_update(launched: list[dict[str, Any]]) -> None:
    """No forward or backward after the last iteration's read, then ``fabric.save``: the checkpoint holds the scale
    that iteration's update leaves (the live engine's update still due), and a resumed run goes on from it as
    GradScaler would (x2 at its next clean iteration), reporting no overflow again and the same skip count."""
    for rank in launched:
        case = rank["read_save"]
        assert case["live_after_save"] == 1024.0  # the update still due on the live engine: ended by the next call
        assert case["saved"] == case["resumed"] == 2048.0
        assert case["resumed_next"] == 4096.0
        assert case["resumed_overflows"] == 0.0 and case["resumed_skipped"] == 2.0


def test_a_load_after_a_read_is_not_updated_again(launched: list[dict[str, Any]]) -> None:
    """A read (the update held), then ``fabric.load`` of the checkpoint saved after iteration 1: the held update is
    not applied on top of the loaded scale (1024, not 2048), and iteration 2 again doubles it as it did."""
    for rank in launched:
        case = rank["read_load"]
        assert case["after_load"] == 1024.0 and case["after_load_skipped"] == 1.0
        assert case["after_load_next"] == 2048.0


# -- 2. fabric.backward before fabric.setup: tensors of one's own ---------------------------------------------------
def test_tensors_of_ones_own_train_as_fp32_once_their_optimizer_is_registered() -> None:
    """A loss over tensors of one's own (no model: an input optimized as in style transfer), its optimizer set up by
    ``fabric.setup_optimizers``: the first ``fabric.backward`` is refused naming ``plugin.setup_optimizers``, and with
    that call the float16 O1 run trains as FP32 (the dynamic scale unscaled at the step)."""

    def run(register: bool) -> torch.Tensor:
        torch.manual_seed(0)
        mpx = FabricMixedPrecisionPlugin("O1", half_dtype="float16")
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx])
        weight = nn.Parameter(torch.randn(8))
        opt = fabric.setup_optimizers(torch.optim.SGD([weight], lr=0.1))
        if register:
            mpx.setup_optimizers(opt)
        for _ in range(3):
            fabric.backward((weight * weight).sum())
            opt.step()
            opt.zero_grad()
        return weight.detach()

    with pytest.raises(RuntimeError, match=r"plugin\.setup_optimizers\(optimizer\)"):
        run(register=False)
    torch.manual_seed(0)
    expected = torch.randn(8) * 0.8**3  # SGD on sum(w^2): w <- w - 0.1 * 2w, three times
    torch.testing.assert_close(run(register=True), expected)
