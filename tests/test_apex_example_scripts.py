"""NVIDIA Apex's own example scripts (examples/imagenet/main_amp.py, examples/dcgan/main_amp.py, docs/source/
advanced.rst at the commit before amp's removal) run through ``lightning_mpx.apex``: their habits, in-process."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from lightning_mpx.apex import amp


@pytest.fixture(autouse=True)
def _reset_amp():
    yield
    amp._amp_state.reset()


class CustomData:
    """advanced.rst's "Custom data batch types": a batch class with a ``to(dtype)`` method."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def to(self, dtype: torch.dtype) -> CustomData:
        self.tensor = self.tensor.to(dtype)
        return self


class _BatchModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.seen: list[torch.dtype] = []

    def forward(self, batch: CustomData, extra: list) -> CustomData:
        self.seen += [batch.tensor.dtype, extra[0].tensor.dtype]
        return CustomData(self.lin(batch.tensor) + self.lin(extra[0].tensor))


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_custom_batch_class_with_to_is_cast_like_apex(opt_level):
    """Apex's patched forward called ``batch.to(torch.float16)`` on a custom batch class (also inside a list) and
    ``.to(torch.float32)`` on such an output; without it the FP32 batch met the half weights in the first matmul."""
    torch.manual_seed(0)
    model = _BatchModel()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0, loss_scale=128.0,
                                cast_model_type=torch.float16)  # Apex semantics: float16, whatever the default
    x = torch.randn(3, 4)
    out = model(CustomData(x.clone()), [CustomData(x.clone())])
    assert model.seen == [torch.float16, torch.float16]
    assert out.tensor.dtype == torch.float32  # the output's to(float32), as Apex's output caster
    expected = reference(CustomData(x), [CustomData(x)]).tensor
    torch.testing.assert_close(out.tensor, expected, atol=2e-2, rtol=2e-2)
    with amp.scale_loss(out.tensor.sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _imagenet_like() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(4, 3))


def test_imagenet_main_amp_string_arguments_and_resume():
    """main_amp.py passes argparse strings (``--keep-batchnorm-fp32 False``, ``--loss-scale 128.0``), prints
    ``_amp_state.loss_scalers[0].loss_scale()``, and resumes from ``model.state_dict()`` and
    ``optimizer.state_dict()`` (no ``amp`` entry): the resumed run continues the uninterrupted one exactly."""
    torch.manual_seed(0)
    data = [(torch.randn(4, 3, 6, 6), torch.randint(0, 3, (4,))) for _ in range(4)]
    criterion = nn.CrossEntropyLoss()

    def start(state=None):
        model = _imagenet_like()
        opt = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9, weight_decay=1e-4)
        model, opt = amp.initialize(model, opt, opt_level="O2", keep_batchnorm_fp32="False", loss_scale="128.0",
                                    cast_model_type=torch.float16,
                                    verbosity=0)
        if state is not None:
            model.load_state_dict(state["state_dict"])
            opt.load_state_dict(state["optimizer"])
        return model, opt

    def train(model, opt, batches):
        for x, y in batches:
            loss = criterion(model(x), y)
            opt.zero_grad()
            with amp.scale_loss(loss, opt) as scaled_loss:
                scaled_loss.backward()
            opt.step()
            assert amp._amp_state.loss_scalers[0].loss_scale() == 128.0

    torch.manual_seed(1)
    model, opt = start()
    assert model[1].weight.dtype == torch.float16  # "False" is False, not a truthy string
    train(model, opt, data[:2])
    buf = io.BytesIO()
    torch.save({"state_dict": model.state_dict(), "optimizer": opt.state_dict()}, buf)
    train(model, opt, data[2:])
    straight = {k: v.clone() for k, v in model.state_dict().items()}
    buf.seek(0)
    model2, opt2 = start(torch.load(buf))
    train(model2, opt2, data[2:])
    for key, value in model2.state_dict().items():
        assert torch.equal(value, straight[key]), key
