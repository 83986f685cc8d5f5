"""The parts of :class:`~lightning_mpx.engine.amp.Amp`, built from its settings, and their state under the names the
adapters and tests use.

Each part of the engine owns its state (the optimizers' step machine, the models, the masters, the overflows, the
properties); :class:`AmpParts` shows it on the engine as properties that read (and, where settable, write) the part's
attribute, so that the engine and its part can never disagree.
"""

from __future__ import annotations

import functools
import logging
import operator
from typing import Any, Callable

import torch
from torch import nn

from lightning_mpx.casting.loss_promotion import o3_policy
from lightning_mpx.casting.loss_regions import LossRegions
from lightning_mpx.casting.policy import CastPolicy
from lightning_mpx.casting.table import CastTable
from lightning_mpx.engine.checkpoint import EngineState
from lightning_mpx.engine.iteration import Iteration
from lightning_mpx.engine.optimizer_state import _OptimizerState
from lightning_mpx.engine.optimizer_step import OptimizerStep
from lightning_mpx.engine.optimizers import StepMachine
from lightning_mpx.engine.overflow import Overflows
from lightning_mpx.engine.preparation import PreparedModels
from lightning_mpx.health.forensics import OverflowForensics, OverflowRecord
from lightning_mpx.health.promotion import Promotion
from lightning_mpx.health.telemetry import GradTelemetry
from lightning_mpx.masters.store import Masters
from lightning_mpx.masters.weights import MasterWeights
from lightning_mpx.opt_levels import Properties
from lightning_mpx.scaling.scaler import LossScaler
from lightning_mpx.settings import MixedPrecisionSettings, implicit_dtype_note, warn_ignored_scaler_settings

_log = logging.getLogger("lightning_mpx")
#: What the front doors may set on an engine before it picks its half dtype, kept when it does (:meth:`AmpParts.
#: pick_half_dtype` builds the parts again).
_KEPT = (
    "register_call",
    "registers_at_step",
    "found_inf_reducer",
    "log_overflows",
    "overflow_log_interval",
    "sharded",
    "unscale_backend",
)


def _part(path: str, *, doc: str, settable: bool = False, also: tuple[str, ...] = ()) -> Any:
    """A property of :class:`Amp` that is the attribute at ``path`` of one of its parts (``"_overflows.last"``): the
    parts own their state, and the engine shows it under the names the adapters and tests use (``settable``: a
    write goes to the part, and to the parts' attributes at the paths in ``also``, which hold the same value). Read
    with a C-level getter: no Python frame; dynamo cannot call one (a graph break), so code that runs inside a
    compiled forward reads the part itself (``amp._models.sharded``, ``amp.properties.half_dtype``)."""
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
    registers_at_step: bool = _part("_machine.registers_at_step", settable=True, doc="""Whether the front door
        registers optimizers at their first step (the Fabric plugin): before any is registered, a write with the
        gradients cleared over parameters no optimizer holds is judged by :meth:`judge_first_writes` there, not
        refused at the next backward (a SAM-style ``first_step`` in the first iteration).""")
    sharded: bool = _part("_models.sharded", settable=True, doc="""Whether the prepared model is sharded by PyTorch
        FSDP (see :meth:`prepare_model`).""")
    master_weights: list[MasterWeights] = _part("_masters.weights", doc="""One
        :class:`~lightning_mpx.masters.weights.MasterWeights` per model prepared for training (O2).""")
    skipped_steps: list[int] = _part("_overflows.skipped_steps", settable=True, doc="""Steps skipped on overflow so
        far, by loss.""")
    made_half: Callable[[torch.Tensor], bool] = _part("_models.made_half", doc="""Whether :meth:`prepare_model`
        converted a parameter to the half dtype (from FP32 or another floating dtype), not one the user gave in
        half: an O2 export warns about the frozen ones of those only (their values are a rounding).""")
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
    _loss_regions: LossRegions | None = _part("_models.loss_regions", settable=True, doc="""O2: the regions that
        compute no loss; set to ``None`` before preparing models by a front door that never enters
        :meth:`forward_context` at O2 (the Apex layer): its models then get no region hooks.""")

    unscale_backend: str = _part("_machine.backend", settable=True, also=("_masters.backend",), doc="""The unscale
        backend of the later unscales and masters.""")

    num_losses = property(lambda amp: len(amp.scalers), doc="The number of losses, one loss scaler each.")

    @property
    def _with_masters(self) -> bool:
        """Whether optimizers step FP32 masters of this engine (O2 on an unsharded model; under FSDP, FSDP's own
        sharded FP32 parameters are the masters)."""
        return self.properties.master_weights and not self.sharded

    def pick_half_dtype(self, where: torch.device | str | nn.Module | None) -> None:
        """Pick the half dtype the run trains in, when none was given (``half_dtype=None``), for the device of
        ``where`` (a device, a device type, or a model: its first floating tensor's; a model with none, or
        ``None``, keeps the provisional dtype): bfloat16 on a CPU, float16 elsewhere (see
        :meth:`~lightning_mpx.settings.MixedPrecisionSettings.on_device`). Done once, before any model is prepared:
        :meth:`prepare_model` does it for the model it is given, the Trainer and Fabric plugins at set-up for the
        device the strategy trains on; later calls, and any call with a given half dtype, do nothing. Picking
        bfloat16 on a CPU logs one line (rank zero only)."""
        settings = self.settings
        if settings.half_dtype is not None or settings.device_type is not None:
            return
        if isinstance(where, nn.Module):
            tensor = next((t for t in (*where.parameters(), *where.buffers()) if t.is_floating_point()), None)
            where = None if tensor is None else tensor.device
        device_type = "meta" if where is None else torch.device(where).type
        if device_type == "meta":  # nothing tells the device: the provisional dtype stays (CUDA's if available)
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
        picked = settings.on_device(device_type)
        if picked.properties.half_dtype == self.properties.half_dtype:
            self.settings = self._models.settings = picked  # the same parts: nothing was built for another dtype
            self._checkpoint.picked_for = device_type
        else:
            kept = {name: getattr(self, name) for name in _KEPT}
            self._configure(picked)
            for name, value in kept.items():
                setattr(self, name, value)
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if device_type == "cpu" and (not distributed or torch.distributed.get_rank() == 0):
            implicit_dtype_note(_log, self.properties.opt_level, "bfloat16")
        warn_ignored_scaler_settings(self.settings)  # the half dtype is known now (its loss scale with it)

    def _configure(self, settings: MixedPrecisionSettings) -> None:
        """Build the parts of the engine of ``settings`` (each owns its state; the properties above show it)."""
        self.settings = settings
        if settings.half_dtype is not None:  # given (none given: pick_half_dtype warns once it is picked)
            warn_ignored_scaler_settings(settings)
        self.model_writes = settings.model_writes
        self.properties: Properties = settings.properties
        self.policy: CastPolicy | None = _policy(settings)
        self.scalers: list[LossScaler] = [
            LossScaler.from_settings(self.properties.loss_scale, settings.scaler, half_dtype=self.properties.half_dtype)
            for _ in range(settings.num_losses)
        ]
        self.found_inf_reducer: Callable[[torch.Tensor], None] | None = None
        self.forensics = OverflowForensics(settings.diagnose_overflows)
        self.promotion = Promotion(self, settings.fp32_modules)  # the modules that run in FP32
        # underflow/headroom, on request only; its groups named as the forensics' tags
        self.telemetry = GradTelemetry(self.properties.half_dtype, self.forensics.user_names)
        self._masters = Masters(settings.unscale_backend)
        self._names: dict[int, str] = {}
        self._machine = StepMachine(
            self.scalers, self._masters, backend=settings.unscale_backend, telemetry=self.telemetry, names=self._names
        )
        self._machine.compare_writes = settings.model_writes == "values"  # a SAM pass's writes taken before its step
        master_of = functools.partial(self._masters.master_of, states=self._machine.optimizers.values(), refresh=False)
        self._overflows = Overflows(
            self.scalers, self.forensics, self.promotion, settings.overflow_log_interval,
            master_of=master_of, opt_level=self.properties.opt_level,
        )
        self._models = PreparedModels(
            settings, self.policy, self.promotion, self.forensics, self._masters, self._machine
        )
        self._stepper = OptimizerStep(
            self._machine, self._overflows, self.forensics, master_of=master_of,
            skip_on_device=settings.skip_on_device,
        )
        # skip_on_device: the steps not settled yet (read on one process at a use of their outcome, settled where
        # every rank is: the next backward or step)
        self._pending = self._stepper.pending
        self._checkpoint = EngineState(
            self.properties, self.scalers, self._masters, self.promotion, self._overflows, self._machine
        )
        self._checkpoint.picked_for = settings.device_type if settings.half_dtype is None else None
        self.iteration = Iteration()  # the steps since the last update(), and their outcomes: the doors read them


def _policy(settings: MixedPrecisionSettings) -> CastPolicy | None:
    """The cast policy of the opt level: the cast table at O1; at O2, one that runs a loss computed inside the half
    model's own forward in FP32 (:meth:`CastTable.default_o2`); at O3, one that runs a loss on arguments of two
    floating dtypes in the widest (:func:`~lightning_mpx.casting.loss_promotion.o3_policy`); none at O0."""
    props = settings.properties
    if not props.has_cast_policy:
        return None
    if props.patch_torch_functions:
        return CastPolicy(settings.cast_table, props.half_dtype, allow_banned=settings.allow_banned)
    if not props.master_weights:
        return o3_policy(props)
    return CastPolicy(CastTable.default_o2(), props.half_dtype, allow_banned=True)
