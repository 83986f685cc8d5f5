"""The state of :class:`~lightning_mpx.engine.amp.Amp`'s parts under the names the adapters and tests use.

Each part of the engine owns its state (the optimizers' step machine, the models, the masters, the overflows, the
properties); :class:`AmpParts` shows it on the engine as properties that read (and, where settable, write) the part's
attribute, so that the engine and its part can never disagree.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from lightning_mpx.casting.loss_regions import LossRegions
from lightning_mpx.engine.optimizer_state import _OptimizerState
from lightning_mpx.health.forensics import OverflowRecord
from lightning_mpx.masters.weights import MasterWeights


def _part(path: str, *, doc: str, settable: bool = False, also: tuple[str, ...] = ()) -> Any:
    """A property of :class:`Amp` that is the attribute at ``path`` of one of its parts (``"_overflows.last"``): the
    parts own their state, and the engine shows it under the names the adapters and tests use (``settable``: a
    write goes to the part, and to the parts' attributes at the paths in ``also``, which hold the same value). Read
    with a C-level getter: no Python frame."""
    targets = [(operator.attrgetter(owner), name) for owner, name in (p.rsplit(".", 1) for p in (path, *also))]

    def fset(amp: Any, value: Any) -> None:
        for owner_of, name in targets:
            setattr(owner_of(amp), name, value)

    return property(operator.attrgetter(path), fset if settable else None, doc=doc)


class AmpParts:
    """The base of :class:`~lightning_mpx.engine.amp.Amp`: its parts' state as properties (each the part's own
    attribute, read with a C-level getter)."""

    register_call: str = _part("_machine.register_call", settable=True, doc="""What the error for an optimizer this
        engine does not know tells the user to do (default: ``"call prepare_optimizer() on it first"``). A front door
        whose users never call :meth:`prepare_optimizer` names its own call here (the Fabric plugin:
        ``plugin.setup_optimizers(optimizer)``).""")
    sharded: bool = _part("_models.sharded", settable=True, doc="""Whether the prepared model is sharded by PyTorch
        FSDP (see :meth:`prepare_model`).""")
    master_weights: list[MasterWeights] = _part("_masters.weights", doc="""One
        :class:`~lightning_mpx.masters.weights.MasterWeights` per model prepared for training (O2).""")
    skipped_steps: list[int] = _part("_overflows.skipped_steps", settable=True, doc="""Steps skipped on overflow so
        far, by loss.""")
    last_overflow: OverflowRecord | None = _part("_overflows.last", doc="""The
        :class:`~lightning_mpx.health.forensics.OverflowRecord` of the latest overflow step (``None`` before the
        first), merged across ranks when ``found_inf_reducer`` is set.""")
    last_overflow_parameters: list[str] = _part("_overflows.last_parameters", doc="""The names of the parameters with
        non-finite gradients at that step (this process's).""")
    diagnose_overflows: bool = _part("forensics.diagnose", settable=True, doc="""Whether every forward is watched for
        non-finite outputs; setting it registers or removes the hooks.""")
    log_overflows: bool = _part("_overflows.log.enabled", settable=True, doc="""Whether overflow messages are logged
        (adapters turn it off on ranks other than zero).""")
    overflow_log_interval: float = _part("_overflows.log.interval", settable=True, doc="""Minimum seconds between two
        overflow log messages.""")
    fp32_modules: list[str] = _part("promotion.fp32_modules", doc="""Names of the modules that run in FP32: pinned by
        ``fp32_modules``, then promoted at the floor.""")
    opt_level: str = _part("properties.opt_level", doc="The opt level (``\"O0\"`` to ``\"O3\"``).")
    half_dtype: torch.dtype = _part("properties.half_dtype", doc="``torch.float16`` or ``torch.bfloat16``.")
    _optimizers: dict[int, _OptimizerState] = _part("_machine.optimizers", doc="The optimizers' states, by id.")
    _loss_regions: LossRegions | None = _part("_models.loss_regions", doc="O2: the regions that compute no loss.")

    unscale_backend: str = _part("_machine.backend", settable=True, also=("_masters.backend",), doc="""The unscale
        backend of the later unscales and masters.""")

    num_losses = property(lambda amp: len(amp.scalers), doc="The number of losses, one loss scaler each.")
