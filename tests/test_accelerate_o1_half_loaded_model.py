"""A hostile user of stop 52's newest surfaces: the Accelerate adapter's CPU default of bfloat16 given a model loaded in
float16, at O1.

O1 leaves a half model of the user's own as it is (no masters), and its CPU cast table (a torch-function mode) cast
only FP32 tensors to the run's half dtype: a float16 model under a bfloat16 run (``Accelerator(mixed_precision="O1")``
on a CPU, ``MixedPrecisionPlugin("O1", half_dtype=torch.bfloat16)`` of a ``model.half()``) met bfloat16 inputs with
its float16 weights and failed with "mat1 and mat2 must have the same dtype, but got BFloat16 and Half", where
Accelerate's own ``"bf16"`` and Lightning's ``"bf16-mixed"`` (``torch.autocast``, which casts every floating dtype but
float64) train it. O1 now casts the other half dtype as well for such a model.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("lightning.pytorch")

from lightning_mpx import MixedPrecisionPlugin  # noqa: E402
from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer  # noqa: E402


def _float16_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)).half()  # as the user loaded it


def _accelerate_run(own: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Three steps of a float16 model under bfloat16 mixed precision: Accelerate's own ``"bf16"`` or O1."""
    from tests.accelerate_helpers import accelerate_state_reset

    with accelerate_state_reset():
        if own:
            from accelerate import Accelerator

            accelerator = Accelerator(mixed_precision="bf16", cpu=True)
        else:
            from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

            accelerator = Accelerator(mixed_precision="O1", cpu=True,
                                      kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16")])
        net = _float16_net()
        model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        g, losses = torch.Generator().manual_seed(0), []
        for _ in range(3):
            loss = model(torch.randn(8, 8, generator=g)).float().pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses, {k: v.clone() for k, v in net.state_dict().items()}


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_accelerate_o1_trains_a_float16_model_under_bfloat16_as_accelerates_bf16() -> None:
    want_losses, want = _accelerate_run(own=True)
    losses, got = _accelerate_run(own=False)  # failed: "mat1 and mat2 must have the same dtype"
    assert losses == pytest.approx(want_losses, rel=1e-3)
    for name, value in want.items():
        assert got[name].dtype == torch.float16, name  # O1 leaves the user's float16 weights as they are
        torch.testing.assert_close(got[name], value, rtol=0, atol=2e-3, msg=name)


class _HalfClassifier(Classifier):
    def __init__(self) -> None:
        super().__init__(features=16)
        self.half()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x).float(), y)


def test_trainer_o1_trains_a_float16_model_under_bfloat16_as_bf16_mixed() -> None:
    data = loader(classification_data(n=32), batch_size=8)
    want = _HalfClassifier()
    make_trainer(precision="bf16-mixed", max_steps=3).fit(want, data)
    got = _HalfClassifier()
    make_trainer(MixedPrecisionPlugin("O1", half_dtype=torch.bfloat16), max_steps=3).fit(got, data)
    for (name, value), reference in zip(got.named_parameters(), want.parameters()):
        assert value.dtype == torch.float16, name
        torch.testing.assert_close(value, reference, rtol=0, atol=2e-3, msg=name)
