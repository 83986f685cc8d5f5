"""Contract breaks found by running more of Lightning's, Fabric's and Accelerate's own tests with the plugins (stop 60:
Lightning checkpointing, models, trainer, profilers, utilities, accelerators, strategies, serve; Fabric strategies,
connector, CLI; Accelerate optimizer, scheduler, grad sync, kwargs handlers, data loader, hooks, modeling utils),
ported here. The table of every upstream failure and its class is in docs/testing.md."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils.data import DataLoader

pytest.importorskip("accelerate")

from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs  # noqa: E402


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_dropped_accelerator_is_freed_at_once(opt_level, tmp_path):
    """Accelerate ``tests/test_data_loader.py::test_ensure_dataloader_gets_cleaned_up``: an Accelerator that
    prepared a dataloader, dropped by the user, is freed at once with its engine and the dataloader (Accelerate's own
    is). The adapter registered its own bound methods as its save/load-state hooks, a reference cycle that kept it
    alive until the next cyclic collection. The hooks still run: ``save_state`` writes the engine's state, and
    ``load_state`` restores its loss scale."""
    accelerator = Accelerator(
        mixed_precision=opt_level, kwargs_handlers=[MixedPrecisionKwargs(half_dtype="float16", init_scale=64.0)],
        cpu=True,
    )
    data = accelerator.prepare_data_loader(DataLoader(list(range(16)), batch_size=4))
    assert next(iter(data)).tolist() == [0, 1, 2, 3]
    accelerator.save_state(str(tmp_path))
    scaler = accelerator.amp.scalers[0]
    scaler.update(torch.ones(()))  # an overflow: the scale backs off
    assert scaler.get_scale() == 32.0
    accelerator.load_state(str(tmp_path))
    assert scaler.get_scale() == 64.0
    del scaler
    refs = [weakref.ref(obj) for obj in (accelerator, accelerator.amp, data, data.gradient_state)]
    gc.collect()
    gc.disable()  # only reference counting may free them
    try:
        del accelerator, data
        assert [ref() is None for ref in refs] == [True] * len(refs)
    finally:
        gc.enable()
