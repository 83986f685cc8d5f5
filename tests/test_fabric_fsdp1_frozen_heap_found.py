"""What the suite's time cuts of stop 65 met on the way (tests/conftest.py's ``_frozen_heap`` freezes the heap at
each module's start with ``gc.freeze()``, which production code runs as well, e.g. after loading a model)."""

from __future__ import annotations

import gc

import torch
from torch import nn


def test_the_fsdp1_wrapper_of_a_model_is_found_after_the_heap_is_frozen(one_rank):
    """Fabric's ``FSDPStrategy`` wraps the model after the plugin converted it; the plugin finds the wrapper at its
    first call after ``fabric.setup``, the heap frozen in between (it looked with ``gc.get_referrers``, which does not
    see frozen objects, and took the model for an unsharded one: fsdp1find66)."""
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin
    from tests.fabric_fsdp1_script import CPUFSDPStrategy

    plugin = FabricMixedPrecisionPlugin("O1", half_dtype="bfloat16")
    fabric = Fabric(accelerator="cpu", devices=1, strategy=CPUFSDPStrategy(), plugins=[plugin])
    fabric.launch()
    model = fabric.setup_module(nn.Sequential(nn.Linear(4, 4)))
    gc.collect()
    gc.freeze()  # as _frozen_heap does: left frozen, what is alive now stays alive anyway
    fabric.backward(model(torch.ones(2, 4)).float().sum())  # the plugin's first call after fabric.setup
    assert plugin.amp.sharded
    assert plugin._wrappers[model._original_module]() is model._forward_module
    assert not plugin._setups  # the fabric.setup_module call's frame, let go
