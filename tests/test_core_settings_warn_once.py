"""Helper xfa56: two former strict xfails, fixed. One settings object warns once about a setting its level ignores,
through ``from_settings``, the half dtype an engine picks and ``ddp_spawn``'s pickling; the bfloat16 headroom of small
live gradients reads as it is in TensorBoard (``mpx/headroom_doublings/<group>``); the doctor reads it right."""

from __future__ import annotations

import math
import pickle
import re
import warnings
from typing import Any

import pytest
import torch

from lightning_mpx import Amp, MixedPrecisionPlugin, MixedPrecisionSettings
from lightning_mpx.integrations.fabric import FabricMixedPrecisionPlugin


def _ignored(run) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return len([w for w in caught if "is ignored" in str(w.message)])


def test_one_settings_object_warns_once_through_the_picked_dtype_and_ddp_spawn_pickling() -> None:
    """half_dtype=None: each engine picks the CPU's bfloat16 on a copy of the settings; the warning is still the one
    object's, said once. A plugin pickled into ddp_spawn's processes keeps that it was said (and a plugin built from
    keywords still warns in its own right, once)."""
    settings = MixedPrecisionSettings.from_kwargs("O1", model_writes="values")
    doors = [Amp.from_settings(settings), MixedPrecisionPlugin.from_settings(settings),
             FabricMixedPrecisionPlugin.from_settings(settings)]
    engines = [doors[0], doors[1].amp, doors[2].amp]
    assert _ignored(lambda: [amp.pick_half_dtype("cpu") for amp in engines]) == 1
    assert all(amp.properties.half_dtype is not None and amp.settings.model_writes == "values" for amp in engines)
    spawned = [pickle.loads(pickle.dumps(plugin)) for plugin in doors[1:]]
    assert _ignored(lambda: [plugin.amp.pick_half_dtype("cpu") for plugin in spawned]) == 0
    assert spawned[0].settings == settings and spawned[1].amp.settings.model_writes == "values"
    own: list[MixedPrecisionPlugin] = []  # a plugin built from keywords: its own object, warned at construction
    assert _ignored(lambda: own.append(MixedPrecisionPlugin("O1", half_dtype="bfloat16", model_writes="values"))) == 1
    again = [lambda: MixedPrecisionPlugin.from_settings(own[0].settings), lambda: pickle.loads(pickle.dumps(own[0]))]
    assert [_ignored(run) for run in again] == [0, 0]


class _SmallLoss:
    """The Classifier's loss times 1e-7: gradients near 1e-8, normal in bfloat16 and FP32, tiny beside either half's
    maximum (bfloat16's 3.4e38 once made their logged headroom read 0)."""

    @staticmethod
    def model() -> Any:
        from tests.lightning_helpers import Classifier

        class SmallLoss(Classifier):
            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                return super().training_step(batch, batch_idx) * 1e-7

        return SmallLoss(features=4)


@pytest.mark.parametrize("half", ["bfloat16", "float16"])
def test_the_doctor_reads_the_logged_headroom_as_the_largest_scaled_gradient(tmp_path, half: str) -> None:
    """A Trainer run logged to TensorBoard, read back by ``lightning-mpx doctor``: the largest gradient it reports
    (a fraction of the half maximum) is the run's largest scaled gradient, for bfloat16's range as for float16's."""
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_mpx.health import doctor
    from tests.lightning_helpers import classification_data, loader, make_trainer

    plugin = MixedPrecisionPlugin("O1", half_dtype=half)
    trainer = make_trainer(plugin, max_steps=1, log_every_n_steps=1,
                           logger=TensorBoardLogger(str(tmp_path), name="run", version=0))
    trainer.fit(_SmallLoss.model(), loader(classification_data(n=16, features=4)))
    scale = plugin.amp.scalers[0].get_scale()  # no overflow, no growth in one step: the scale it ran at
    peak = max(float(p.grad.abs().max()) for p in trainer.lightning_module.parameters())  # unscaled, FP32 at O1
    expected = peak * scale / torch.finfo(getattr(torch, half)).max
    diagnosis = doctor.diagnose(tmp_path / "run" / "version_0")
    lines = [line for finding in diagnosis.findings for line in finding.evidence]
    found = [re.search(r"largest gradient (?:is above )?(\S+) \(2\^(-?[\d.]+)\) of the half maximum", line)
             for line in lines]
    (match, *_) = [m for m in found if m] or [None]
    assert match is not None, diagnosis.format()
    assert float(match.group(1)) == pytest.approx(expected, rel=1e-2)  # not "0"
    assert float(match.group(2)) == pytest.approx(math.log2(expected), abs=0.06)
