"""Helper xfa56: two former strict xfails, fixed. One settings object warns once about a setting its level ignores,
through ``from_settings``, the half dtype an engine picks and ``ddp_spawn``'s pickling; the bfloat16 headroom of small
live gradients reads as what it is in TensorBoard (``mpx/headroom_log2/<group>``), and the doctor reads it right."""

from __future__ import annotations

import pickle
import warnings

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
