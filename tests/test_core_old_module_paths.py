"""Stop 68's house splits: the modules split for size keep what was importable at their old paths.

``torch.save(model)`` of a prepared model pickles the engine's hooks on it by their module's path; a model saved whole
by an earlier release names the load hooks at ``lightning_mpx.engine.preparation`` (before they moved to
``engine/load_hooks.py``) and must still load.
"""

from __future__ import annotations

import io

import torch
from torch import nn

from lightning_mpx import Amp


def test_a_prepared_model_pickled_whole_with_the_hooks_old_path_loads():
    torch.manual_seed(0)
    model = Amp(opt_level="O2", half_dtype=torch.bfloat16).prepare_model(
        nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    )
    buffer = io.BytesIO()
    torch.save(model, buffer, _use_new_zipfile_serialization=False)  # one raw pickle: its globals are plain text
    new, old = b"clightning_mpx.engine.load_hooks\n", b"clightning_mpx.engine.preparation\n"
    saved = buffer.getvalue()
    assert saved.count(new) >= 3  # _LoadIntoMasters, _FollowModes, _MissingKept (pickle memoizes each global once)
    loaded = torch.load(io.BytesIO(saved.replace(new, old)), weights_only=False)  # as an earlier release wrote it
    assert torch.equal(loaded[0].weight, model[0].weight) and loaded[0].weight.dtype == torch.bfloat16
    loaded.load_state_dict({k: v.float() for k, v in model.state_dict().items()})  # its hooks hold no engine: inert
    assert torch.equal(loaded[1].bias, model[1].bias)
