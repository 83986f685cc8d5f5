"""lightning_mpx: Apex-style mixed precision (opt levels, cast table, master weights, dynamic loss scaling).

The core is framework-agnostic; the Lightning Trainer and Fabric plugins and the Accelerate adapter are thin layers over
:class:`~lightning_mpx.engine.amp.Amp`.
"""

from lightning_mpx.casting.lists import CATEGORIES, DEFAULT_TABLE
from lightning_mpx.casting.policy import BannedOpError, CastPolicy, checkpoint_contexts, disable_casts
from lightning_mpx.casting.table import CastEntry, CastTable, dispatchable
from lightning_mpx.common.compat import warn_if_old_torch
from lightning_mpx.engine.amp import Amp
from lightning_mpx.engine.outcome import StepOutcome
from lightning_mpx.masters.watch import release_masters
from lightning_mpx.masters.weights import MasterWeights, convert_module
from lightning_mpx.opt_levels import DESCRIPTIONS, OPT_LEVELS, Properties, resolve_properties
from lightning_mpx.scaling.scaler import LossScaleFloorError, LossScaler
from lightning_mpx.scaling.unscale import unscale_grads_
from lightning_mpx.settings import MixedPrecisionSettings, ScalerSettings

__version__ = "0.1.0"

warn_if_old_torch()  # once, at import: torch older than the tested releases


def __getattr__(name: str) -> object:
    # The Lightning plugins are imported on first use, so that ``import lightning_mpx`` needs torch alone.
    if name == "MixedPrecisionPlugin":
        from lightning_mpx.integrations.lightning import MixedPrecisionPlugin

        return MixedPrecisionPlugin
    if name == "FabricMixedPrecisionPlugin":
        from lightning_mpx.integrations.fabric import FabricMixedPrecisionPlugin

        return FabricMixedPrecisionPlugin
    raise AttributeError(f"module 'lightning_mpx' has no attribute {name!r}")


__all__ = [
    "Amp",
    "BannedOpError",
    "CATEGORIES",
    "CastEntry",
    "CastPolicy",
    "CastTable",
    "DEFAULT_TABLE",
    "DESCRIPTIONS",
    "FabricMixedPrecisionPlugin",
    "LossScaleFloorError",
    "LossScaler",
    "MasterWeights",
    "MixedPrecisionPlugin",
    "MixedPrecisionSettings",
    "OPT_LEVELS",
    "Properties",
    "ScalerSettings",
    "StepOutcome",
    "__version__",
    "checkpoint_contexts",
    "convert_module",
    "disable_casts",
    "dispatchable",
    "release_masters",
    "resolve_properties",
    "unscale_grads_",
]
