"""Evaluation-only runs at O1 see weights loaded through ``.data`` between two forward passes.

A validate or predict loop never reaches an iteration boundary (``Amp.update``), and a write through ``p.data``
(``p.data.copy_(...)``, ``p.data = ...``) leaves no trace on ``p`` itself (``p.data`` has its own version counter),
so a cached half copy of ``p`` would keep serving the old weights.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_mpx import Amp

WRITES = ["copy_", "assign"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _load_through_data(model: nn.Module, new: dict[str, torch.Tensor], write: str) -> None:
    for name, param in model.named_parameters():
        if write == "copy_":
            param.data.copy_(new[name])
        else:
            param.data = new[name].clone()


def _new_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {name: torch.randn(p.shape, generator=g) for name, p in model.named_parameters()}


def _reference(new: dict[str, torch.Tensor], x: torch.Tensor, half: str) -> torch.Tensor:
    """The output of a fresh O1 model holding ``new``."""
    model, amp = _model(), Amp("O1", half_dtype=half)
    model.load_state_dict(new)
    with torch.no_grad(), amp.forward_context():
        return model(x)


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
@pytest.mark.parametrize("write", WRITES)
def test_core_evaluation_loop_sees_weights_loaded_through_data(write, half):
    amp = Amp("O1", half_dtype=half)
    model = amp.prepare_model(_model(), train=False)
    x = torch.randn(5, 8)
    with torch.no_grad():
        with amp.forward_context():
            before = model(x)
        new = _new_weights(model)
        _load_through_data(model, new, write)
        with amp.forward_context():
            after = model(x)
    want = _reference(new, x, half)
    assert not torch.equal(before, want)
    torch.testing.assert_close(after, want, rtol=0, atol=0)


pl = pytest.importorskip("lightning.pytorch")


class _Recorder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _model()
        self.outputs: list[torch.Tensor] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.outputs.append(self.net(batch[0]))


@pytest.mark.parametrize("write", WRITES)
def test_lightning_validate_twice_sees_weights_loaded_through_data(write):
    from lightning_mpx import MixedPrecisionPlugin

    from .lightning_helpers import make_trainer

    x = torch.randn(5, 8)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=5)
    module = _Recorder()
    trainer = make_trainer(MixedPrecisionPlugin("O1", half_dtype="bfloat16"))
    trainer.validate(module, data, verbose=False)
    new = _new_weights(module.net)
    _load_through_data(module.net, new, write)
    trainer.validate(module, data, verbose=False)
    torch.testing.assert_close(module.outputs[1], _reference(new, x, "bfloat16"), rtol=0, atol=0)
