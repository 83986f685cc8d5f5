"""Pickling a prepared optimizer and the ``Accelerator`` with an opt level: ports of Accelerate's
``tests/test_optimizer.py::test_accelerated_optimizer_pickling`` and ``tests/test_accelerator.py::
test_can_pickle_dataloader``, at O0-O3 in float16 and bfloat16.

Accelerate asserts that the round trip works (and, for the Accelerator, that its dataloaders come back whole). What
the opt level adds: the engine's run (loss scales, O2's FP32 masters tied to the model's half parameters) is not
pickled, so an unpickled optimizer's state loads into an optimizer prepared again, and it refuses to step by itself
with a message naming those calls; an unpickled Accelerator keeps its settings and trains what it prepares next.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("accelerate")

from accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard, skip_first_batches  # noqa: E402
from accelerate.utils import DataLoaderConfiguration  # noqa: E402

from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # Accelerate's singleton state: none at each start

LEVELS = ["O0", "O1", "O2", "O3"]
HALVES = ["float16", "bfloat16"]


def _accelerator(level: str, half: str, **kwargs) -> Accelerator:
    return Accelerator(mixed_precision=level, kwargs_handlers=[MixedPrecisionKwargs(half_dtype=half)], **kwargs)


def _trained(level: str, half: str, steps: int = 2):
    """A prepared model and SGD with momentum (state to carry) after ``steps`` steps (not AdamW: at O3 in float16
    its eps is 0)."""
    accelerator = _accelerator(level, half)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    for _ in range(steps):
        accelerator.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return accelerator, model, optimizer, (x, y)


def _same_state(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for key in a["state"]:
        for name, value in a["state"][key].items():
            assert torch.equal(value, b["state"][key][name]), (key, name)  # the same tensors, copied: bit for bit


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("level", LEVELS)
def test_accelerated_optimizer_pickling(level, half):
    """Accelerate's test: ``pickle.loads(pickle.dumps(optimizer))`` works. The unpickled optimizer holds the same
    state (the momentum buffers, at O2 those of the FP32 masters) and the last step's outcome; loaded into an optimizer
    prepared again, the run goes on as the original does."""
    accelerator, model, optimizer, (x, y) = _trained(level, half)
    unpickled = pickle.loads(pickle.dumps(optimizer))
    _same_state(unpickled.state_dict(), optimizer.state_dict())
    assert unpickled.step_was_skipped is optimizer.step_was_skipped is False

    # Stepping it alone would train copies with no loss scale: refused, naming the calls that carry its state.
    with pytest.raises(RuntimeError, match=r"was unpickled.*accelerator\.prepare\(.*load_state_dict\(unpickled"):
        unpickled.step()

    # Its state loads into a new optimizer over the same model (O2: over the same masters), which then steps as
    # the original would have.
    again = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    again.load_state_dict(unpickled.state_dict())
    _same_state(again.state_dict(), optimizer.state_dict())


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("level", LEVELS)
def test_pickled_optimizer_state_resumes_the_run(level, half):
    """The state of an unpickled optimizer, loaded into an optimizer prepared anew on a second, identical run, gives
    the same weights after the next step as the original run (the same computation repeated: bit for bit); without
    it (no momentum yet) they differ."""
    _, model, optimizer, batch = _trained(level, half)
    state = pickle.loads(pickle.dumps(optimizer)).state_dict()
    reference = _next_step_weights(_trained(level, half)[:3], batch)  # the original run, going on

    def anew(load: bool) -> list[torch.Tensor]:
        accelerator, twin, _, _ = _trained(level, half)
        fresh = accelerator.prepare(torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9))
        if load:
            fresh.load_state_dict(state)
        return _next_step_weights((accelerator, twin, fresh), batch)

    assert all(torch.equal(a, b) for a, b in zip(anew(load=True), reference))
    assert not all(torch.equal(a, b) for a, b in zip(anew(load=False), reference))


def _next_step_weights(run, batch) -> list[torch.Tensor]:
    accelerator, model, optimizer = run
    x, y = batch
    accelerator.backward(F.cross_entropy(model(x), y))
    optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("dispatch_batches", [True, False])
@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("level", LEVELS)
def test_can_pickle_dataloader(level, half, dispatch_batches):
    """Accelerate's test: a pickled Accelerator gives back its prepared dataloaders (one skipping its first two
    batches), which iterate as the originals; with a model and optimizer prepared too. The unpickled Accelerator keeps
    the opt level and its settings, and trains a model it prepares next."""
    data = torch.arange(10)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data))
    skip = skip_first_batches(loader, 2)
    config = DataLoaderConfiguration(dispatch_batches=dispatch_batches, use_stateful_dataloader=False)
    accelerator = _accelerator(level, half, dataloader_config=config)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    original, _, _, _ = accelerator.prepare(loader, skip, model, torch.optim.SGD(model.parameters(), lr=0.1))
    kind = DataLoaderDispatcher if dispatch_batches else DataLoaderShard
    assert isinstance(original, kind)

    loaded = pickle.loads(pickle.dumps(accelerator))
    assert len(loaded._dataloaders) == 2
    first, skipped = loaded._dataloaders
    assert isinstance(first, kind) and isinstance(skipped, kind)
    assert len(first) == len(original) and [b for b in first] == [b for b in original]
    assert len(skipped) == len(original) - 2 and [b for b in skipped] == [b for b in original][2:]

    assert loaded.mixed_precision == level and loaded.mpx_kwargs == accelerator.mpx_kwargs
    assert loaded.amp is not accelerator.amp and loaded.amp.settings == accelerator.amp.settings
    torch.manual_seed(1)
    fresh = nn.Linear(4, 2)
    before = fresh.weight.detach().float().clone()
    fresh, opt = loaded.prepare(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
    loaded.backward(fresh(torch.randn(3, 4)).float().pow(2).mean())
    opt.step()
    assert not opt.step_was_skipped
    assert not torch.equal(fresh.weight.detach().float(), before)
