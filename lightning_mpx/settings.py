"""The settings of a mixed-precision run, in one place: frozen dataclasses validated when they are built.

:class:`ScalerSettings` holds the dynamic loss scaler's settings, :class:`MixedPrecisionSettings` the opt level, its
overrides and everything else an :class:`~lightning_mpx.engine.amp.Amp` is built from (the scaler settings included).
Every front door takes these or forwards its keywords into them, so that each setting is documented, defaulted and
checked here once::

    settings = MixedPrecisionSettings.from_kwargs("O2", half_dtype="float16", growth_interval=500)
    amp = Amp.from_settings(settings)               # the same engine as Amp("O2", half_dtype=..., ...)
    plugin = MixedPrecisionPlugin.from_settings(settings)

The front doors do not repeat the keyword lists. Each takes ``**settings`` typed with :class:`SettingsKeywords`
(:class:`ScalerKeywords` for :class:`~lightning_mpx.scaling.scaler.LossScaler`), which type checkers and IDEs read, and
:func:`keyword_signature` gives it the signature that ``help()`` and ``inspect`` show: one typed keyword per field,
with the field's default. :class:`~lightning_mpx.integrations.accelerate.MixedPrecisionKwargs` is a dataclass whose
fields are made from :func:`setting_fields`.

Adding a setting: a field here (with its line in the class docstring and its check in ``__post_init__``) and its
line in :class:`SettingsKeywords` (or :class:`ScalerKeywords`); every front door takes it from then on
(``tests/test_settings.py`` fails until the typed keywords agree with the fields).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence, TypedDict, TypeVar

import torch

from lightning_mpx.casting.table import CastTable
from lightning_mpx.common.keywords import (
    check_keywords,  # noqa: F401  (its home before; scaling/scaler.py imports it here)
    checks_keywords,
)
from lightning_mpx.health.promotion import check_patterns
from lightning_mpx.ignored_settings import (  # noqa: F401  (their home before: callers import them from here)
    DYNAMIC_ONLY,
    _rank_zero,
    ignored_level_settings,
    ignored_scaler_settings,
    warn_ignored_scaler_settings,
    warn_ignored_settings,
    written_settings,
)
from lightning_mpx.opt_levels import Properties, _check_loss_scale, resolve_properties
from lightning_mpx.scaling.unscale import BACKENDS

__all__ = [
    "MODEL_WRITES",
    "ON_FLOOR_CHOICES",
    "MixedPrecisionSettings",
    "OnFloor",
    "OptLevelOverrides",
    "ScalerKeywords",
    "ScalerSettings",
    "SettingsKeywords",
    "ignored_level_settings",
    "ignored_scaler_settings",
    "implicit_half_dtype",
    "keyword_signature",
    "setting_fields",
]

_FP32_MAX = float(torch.finfo(torch.float32).max)
OnFloor = Literal["raise", "warn", "continue", "promote"]
ON_FLOOR_CHOICES: tuple[str, ...] = ("raise", "warn", "continue", "promote")
#: How O2 finds writes made to the half model outside the step: ``"versions"`` (version counters, storage
#: addresses and the parameters' handed-out ``.data``, free when nothing was written) or ``"values"`` (a comparison of
#: every half parameter with its master's rounding before each step: one extra read of the weights and one host sync
#: per step).
MODEL_WRITES = ("versions", "values")
#: What ``skip_on_device=None`` does (the messages that refuse another value say it).
SKIP_ON_DEVICE_AUTO = "None: on the device for the optimizers that can skip their step there, on the host for the rest"


# -- the checks, each message naming the argument, the value and what is valid --------------------------------------
def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive(name: str, value: object) -> None:
    if not _is_number(value) or not math.isfinite(value) or value <= 0 or value > _FP32_MAX:  # type: ignore[arg-type, operator]
        raise ValueError(f"{name}={value!r} must be a positive finite number that FP32 can hold.")


def check_positive_int(name: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is an ``int`` (not a bool) of at least 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer.")


def check_flag(name: str, value: object) -> None:
    """Raise ``TypeError`` unless ``value`` is ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False.")


def check_optional_flag(name: str, value: object, none_means: str) -> None:
    """Raise ``TypeError`` unless ``value`` is ``True``, ``False`` or ``None`` (``none_means``: what ``None`` does)."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True, False or None ({none_means}).")


def check_choice(name: str, value: object, choices: Sequence[str], *, quote: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices`` (listed in the message, quoted if asked)."""
    if value not in choices:
        listed = ", ".join(map(repr, choices)) if quote else ", ".join(choices)
        raise ValueError(f"{name}={value!r} is not valid; valid choices: {listed}.")


def check_cast_table(table: object) -> None:
    """Raise ``TypeError`` unless ``table`` is a :class:`~lightning_mpx.casting.table.CastTable` or ``None``."""
    if table is not None and not isinstance(table, CastTable):
        raise TypeError(
            f"cast_table={type(table).__name__} must be a lightning_mpx.CastTable or None (the device's default); "
            "build one with CastTable.default() or CastTable.for_device('cuda') and register into it."
        )


@dataclass(frozen=True)
class ScalerSettings:
    """The settings of a dynamic loss scaler (see :class:`~lightning_mpx.scaling.scaler.LossScaler`), validated.

    Args:
        init_scale: First scale of a dynamic scaler (``2**16``, as torch's GradScaler and Apex).
        growth_factor: Factor applied after ``growth_interval`` steps in a row without overflow (``1.0``: the scale
            only ever backs off, as Apex's kernel allows).
        backoff_factor: Factor applied on an overflow (see ``hysteresis``).
        growth_interval: Overflow-free steps before the scale grows.
        hysteresis: How many overflows it takes to back off, as in Megatron-LM's ``DynamicGradScaler`` and
            DeepSpeed's ``DynamicLossScaler``: a tracker starts at ``hysteresis``; an overflow lowers it by one, or
            backs off when it is already at 1, and it stays at 1 (every further overflow backs off) until a growth
            restores it. A backoff does not restore it, so under persistent overflow the scale falls by one backoff
            per step once ``hysteresis - 1`` overflows have been tolerated. ``1`` backs off on every overflow,
            exactly like GradScaler.
        consecutive_hysteresis: Also restore the tracker after every overflow-free step (DeepSpeed's
            ``consecutive_hysteresis``), so that only ``hysteresis`` overflows *in a row* back off.
        min_loss_scale: The floor of a dynamic scale.
        max_loss_scale: The ceiling of a dynamic scale (``math.inf`` for none).
        on_floor: What an overflow does when the scale cannot go lower (a dynamic scale at ``min_loss_scale``, or
            any static scale): ``"raise"`` :class:`~lightning_mpx.scaling.scaler.LossScaleFloorError` naming the
            parameters with non-finite gradients, ``"warn"``, ``"continue"`` silently, or ``"promote"``: the modules
            the overflows keep coming from run in FP32 from then on (done by :class:`~lightning_mpx.engine.amp.Amp`, see
            :mod:`lightning_mpx.health.promotion`; it raises as ``"raise"`` where no module can be blamed, and a scaler
            used on its own raises too). The step is skipped in every case.

    Raises:
        ValueError: for a value out of range, naming it; ``TypeError`` for a flag that is not a bool. Whether
            ``init_scale`` lies within ``[min_loss_scale, max_loss_scale]`` depends on the loss scale (a static one
            ignores it) and is checked by :meth:`check_init_scale` when the scaler is built.
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    max_loss_scale: float = 2.0**24
    on_floor: OnFloor = "raise"

    def __post_init__(self) -> None:
        _positive("init_scale", self.init_scale)
        _positive("min_loss_scale", self.min_loss_scale)
        # `not x > 0` rather than `x <= 0` so that NaN is refused too.
        if not _is_number(self.max_loss_scale) or not self.max_loss_scale > 0:
            raise ValueError(
                f"max_loss_scale={self.max_loss_scale!r} must be a positive number (math.inf for no ceiling)."
            )
        growth = self.growth_factor
        if not _is_number(growth) or not growth >= 1.0 or not math.isfinite(growth):
            raise ValueError(
                f"growth_factor={growth!r} must be a finite number of at least 1.0, e.g. 2.0 (1.0: the scale "
                "never grows back after a backoff)."
            )
        if not _is_number(self.backoff_factor) or not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"backoff_factor={self.backoff_factor!r} must be between 0 and 1 (exclusive), e.g. 0.5.")
        check_positive_int("growth_interval", self.growth_interval)
        check_positive_int("hysteresis", self.hysteresis)
        check_flag("consecutive_hysteresis", self.consecutive_hysteresis)
        if self.min_loss_scale > self.max_loss_scale:
            raise ValueError(
                f"min_loss_scale={self.min_loss_scale!r} is above max_loss_scale={self.max_loss_scale!r}; the floor "
                "must not exceed the ceiling."
            )
        check_choice("on_floor", self.on_floor, ON_FLOOR_CHOICES)

    def check_init_scale(self, loss_scale: object) -> None:
        """Raise ``ValueError`` if a dynamic ``loss_scale`` would start outside ``[min_loss_scale,
        max_loss_scale]`` (a static scale ignores ``init_scale``)."""
        if loss_scale == "dynamic" and not self.min_loss_scale <= self.init_scale <= self.max_loss_scale:
            raise ValueError(
                f"init_scale={self.init_scale!r} lies outside [min_loss_scale={self.min_loss_scale!r}, "
                f"max_loss_scale={self.max_loss_scale!r}]."
            )

    def to_kwargs(self) -> dict[str, Any]:
        """The settings as keyword arguments (every field)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


class ScalerKeywords(TypedDict, total=False):
    """The fields of :class:`ScalerSettings` as keywords, for ``**settings: Unpack[ScalerKeywords]`` (type checkers
    and IDEs read the names and types here; the defaults and docs are the fields')."""

    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    consecutive_hysteresis: bool
    min_loss_scale: float
    max_loss_scale: float
    on_floor: OnFloor


class OptLevelOverrides(TypedDict, total=False):
    """The opt-level property overrides (see :func:`~lightning_mpx.opt_levels.resolve_properties`); an override
    not given, or given as ``None``, keeps the preset's value (the front doors' signatures show each with the default
    ``None``)."""

    cast_model_type: str | torch.dtype | None
    patch_torch_functions: bool
    keep_batchnorm_fp32: bool | None
    master_weights: bool
    loss_scale: float | str


SCALER_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ScalerSettings))
#: The opt-level property overrides (see :func:`~lightning_mpx.opt_levels.resolve_properties`).
OPT_LEVEL_OVERRIDES: tuple[str, ...] = tuple(OptLevelOverrides.__annotations__)


@dataclass(frozen=True)
class MixedPrecisionSettings:
    """Everything an :class:`~lightning_mpx.engine.amp.Amp` is built from, validated (the opt level against its
    overrides too). Build it with :meth:`from_kwargs` (the keywords of ``Amp``) or directly.

    Args:
        opt_level: ``"O0"`` to ``"O3"`` (see :mod:`lightning_mpx.opt_levels`).
        half_dtype: ``"float16"`` or ``"bfloat16"`` (also ``"fp16"``, ``"bf16"`` or a torch dtype). With bfloat16 the
            default loss scale is a static 1.0. ``None`` (default): the device's (:func:`implicit_half_dtype`):
            bfloat16 on a CPU (float16 matmuls are often emulated there, tens of times slower), float16 elsewhere,
            picked by :meth:`on_device` for the device the model trains on (the engine does it when it prepares its
            first model, the Trainer and Fabric plugins at set-up); until then :attr:`properties` hold the
            provisional one, float16 when CUDA is available, else bfloat16.
        num_losses: Number of losses with a loss scaler each (``loss_id`` 0 to ``num_losses - 1``), as Apex's
            ``num_losses``: a GAN gives its generator and discriminator losses their own scale.
        cast_table: The table of the O1 policy. ``None``: the table of the device the model is on at the first
            forward (:meth:`CastTable.for_device`: on CUDA, the default settled ``torch.autocast``'s way, which runs
            with no Python per call; elsewhere :meth:`CastTable.default`). Only valid when the policy is on.
        allow_banned: Run banned ops (``binary_cross_entropy``) in FP32 instead of raising. Only O1's cast table
            bans ops: given at another level it is named as ignored (:func:`ignored_level_settings`).
        unscale_backend: ``"auto"``, ``"foreach"``, ``"reference"`` or ``"triton"`` (see
            :mod:`lightning_mpx.scaling.unscale`); also used for the master-to-model copy at O2.
        overflow_log_interval: Minimum seconds between two overflow log messages.
        model_writes: How O2 takes writes made to the half model outside the step into the FP32 masters:
            ``"versions"`` (default: version counters and storage addresses, and the ``.data`` each half parameter
            hands out, such as WGAN's ``p.data.clamp_()``: no cost when nothing was written; see
            :class:`~lightning_mpx.masters.weights.WatchedParameter`) or ``"values"`` (every half parameter is
            compared with its master's rounding before each step: one read of the weights and one host sync per
            step, and every write is seen). Only read with FP32 masters (O2): given at another level it is named as
            ignored.
        diagnose_overflows: Watch every forward with hooks that flag non-finite module outputs on the device, so
            that each overflow's record says whether the forward or the backward produced the non-finite values and
            which module did first. Without it the forward is watched only after an overflow with the scale at its
            floor, until the next step that does not overflow (see :mod:`lightning_mpx.health.forensics`).
        fp32_modules: Module-name patterns (:mod:`fnmatch`, on the names of ``model.named_modules()``, e.g.
            ``["lm_head", "*.norm"]``) of modules that run in FP32 at every opt level (see
            :mod:`lightning_mpx.health.promotion`). A pattern that matches no module raises ``ValueError`` when an
            optimizer is prepared. At O0 (the whole model FP32) it is named as ignored.
        skip_on_device: Where an overflowed step is skipped. ``None`` (default, "auto"): on the device for each
            optimizer that can skip its own step there (``torch.optim.Adam`` and ``AdamW`` with ``fused=True`` in
            every parameter group, on a model that is not sharded by FSDP1, with ``on_floor`` other than
            ``"promote"``): the overflow flag goes to the optimizer's step, as ``torch.amp.GradScaler`` does for
            fused optimizers, and :meth:`Amp.step <lightning_mpx.engine.amp.Amp.step>` does not wait for the
            device; every other optimizer reads the flag on the host (one device-to-host sync per step), silently.
            ``True``: the device for every optimizer, and a ``ValueError`` for one that cannot. ``False``: the host
            for every optimizer (the opt-out). Decided per optimizer at its first step (again when its parameter
            groups change). On the device the step's outcome (the count, the log, the record, ``on_floor``) is read
            later: when its result is used as a bool, at the next backward or step, or at a checkpoint. See
            ``docs/loss_scaling.md``.
        overrides: The opt-level property overrides given (any of ``cast_model_type``, ``patch_torch_functions``,
            ``keep_batchnorm_fp32``, ``master_weights``, ``loss_scale``; see
            :func:`~lightning_mpx.opt_levels.resolve_properties`, whose ``None`` values they keep:
            ``cast_model_type=None`` leaves the model as it is); an override not given keeps the preset's value.
            (:meth:`from_kwargs`, the front doors' keywords, leaves out those given as ``None``.)
        scaler: The loss-scaler settings (:class:`ScalerSettings`, or a mapping of its fields), one scaler per
            loss.

    Attributes:
        properties: The resolved :class:`~lightning_mpx.opt_levels.Properties` of the opt level with its overrides
            (their ``half_dtype`` is the one the run trains in).
        device_type: With ``half_dtype=None``: the device type the half dtype was picked for (:meth:`on_device`),
            ``None`` while it is provisional.
    """

    opt_level: str = "O1"
    half_dtype: str | torch.dtype | None = None
    num_losses: int = 1
    cast_table: CastTable | None = None
    allow_banned: bool = False
    unscale_backend: str = "auto"
    overflow_log_interval: float = 10.0
    model_writes: str = "versions"
    diagnose_overflows: bool = False
    fp32_modules: Sequence[str] = ()
    skip_on_device: bool | None = None
    overrides: Mapping[str, Any] = field(default_factory=dict)
    scaler: ScalerSettings = field(default_factory=ScalerSettings)
    properties: Properties = field(init=False, repr=False, compare=False)
    device_type: str | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        # In the order Amp has always checked them, so that a run with two bad settings reports the same one.
        check_choice("model_writes", self.model_writes, MODEL_WRITES, quote=True)
        if not isinstance(self.overrides, Mapping):
            raise TypeError(
                f"overrides={type(self.overrides).__name__} must be a mapping of opt-level overrides; valid keys: "
                f"{', '.join(OPT_LEVEL_OVERRIDES)}."
            )
        overrides = dict(self.overrides)  # a copy: the caller's dict does not change these settings
        object.__setattr__(self, "overrides", overrides)
        half = implicit_half_dtype(self.device_type) if self.half_dtype is None else self.half_dtype
        props = resolve_properties(self.opt_level, half_dtype=half, **overrides)
        object.__setattr__(self, "properties", props)
        if isinstance(self.num_losses, bool) or not isinstance(self.num_losses, int) or self.num_losses < 1:
            raise ValueError(f"num_losses={self.num_losses!r} must be a positive integer.")
        check_choice("unscale_backend", self.unscale_backend, BACKENDS)
        check_cast_table(self.cast_table)
        if self.cast_table is not None and not props.patch_torch_functions:
            raise ValueError(
                f"cast_table is only used by the cast-table policy, which is off at opt_level="
                f"{props.opt_level!r} (patch_torch_functions=False); use opt_level='O1'"
                + (
                    ", or register a loss function of your own in the level's loss table after building "
                    "(amp.policy.table.register(fn, 'float' at O2, 'promote' at O3), fn decorated with "
                    "@lightning_mpx.dispatchable)."
                    if props.casts_model else "."
                )
            )
        if isinstance(self.scaler, Mapping):  # from_kwargs: checked here, in Amp's order of checks
            object.__setattr__(self, "scaler", ScalerSettings(**self.scaler))
        if not isinstance(self.scaler, ScalerSettings):
            raise TypeError(f"scaler={type(self.scaler).__name__} must be a lightning_mpx.ScalerSettings.")
        _check_loss_scale(props.loss_scale)
        self.scaler.check_init_scale(props.loss_scale)
        check_flag("diagnose_overflows", self.diagnose_overflows)
        check_optional_flag("skip_on_device", self.skip_on_device, SKIP_ON_DEVICE_AUTO)
        if self.skip_on_device is True and self.scaler.on_floor == "promote":
            raise ValueError(
                "skip_on_device=True cannot be combined with on_floor='promote': a promotion changes the model before "
                "the next forward, and a step skipped on the device is read later (at the next backward); use "
                "on_floor='raise', 'warn' or 'continue', or skip_on_device=None (the default, which reads such steps "
                "on the host) or False."
            )
        object.__setattr__(self, "fp32_modules", check_patterns(self.fp32_modules))
        check_flag("allow_banned", self.allow_banned)
        interval = self.overflow_log_interval
        if not _is_number(interval) or not interval >= 0:  # type: ignore[operator]
            raise ValueError(
                f"overflow_log_interval={interval!r} must be a number of seconds of at least 0 (0: log every overflow; "
                "math.inf: only the first)."
            )

    @classmethod
    def from_kwargs(cls, opt_level: str = "O1", **kwargs: Any) -> MixedPrecisionSettings:
        """The settings from :class:`~lightning_mpx.engine.amp.Amp`'s keywords: its own fields, the scaler's fields, and
        the opt-level overrides (any other keyword goes to the overrides, where
        :func:`~lightning_mpx.opt_levels.resolve_properties` names it as unknown). An opt-level override given as
        ``None`` is not given: the level's value, as in Apex's ``amp.initialize`` (the front doors' signatures show
        each with the default ``None``, and a ``LightningCLI`` config passes every keyword of a signature).
        ``overrides=`` (a mapping, as :meth:`to_kwargs` gives it) is taken as given, ``None`` values included: the
        settings' own ``overrides``, whose ``None`` is :func:`~lightning_mpx.opt_levels.resolve_properties`' (so that
        :meth:`to_kwargs`, ``from_settings`` and ``ddp_spawn``'s pickling keep ``cast_model_type=None``)."""
        own = {f.name for f in dataclasses.fields(cls) if f.init} - {"opt_level", "overrides", "scaler"}
        scaler = {k: kwargs.pop(k) for k in SCALER_FIELDS if k in kwargs}
        mine = {k: kwargs.pop(k) for k in list(kwargs) if k in own}
        kept = kwargs.pop("overrides", {})
        if not isinstance(kept, Mapping):
            raise TypeError(
                f"overrides={kept!r} must be a mapping of opt-level overrides; valid keys: "
                f"{', '.join(OPT_LEVEL_OVERRIDES)}."
            )
        _check_unknown(kwargs, ENGINE_FIELDS + SCALER_FIELDS)
        overrides = {k: v for k, v in kwargs.items() if not (v is None and k in OPT_LEVEL_OVERRIDES)}
        overrides.update(kept)
        return cls(opt_level, **mine, overrides=overrides, scaler=scaler)  # type: ignore[arg-type]

    def on_device(self, device_type: str) -> MixedPrecisionSettings:
        """These settings with the half dtype picked for ``device_type`` (``"cpu"``, ``"cuda"``...) when none was
        given (``half_dtype=None``; see :func:`implicit_half_dtype`); ``self`` when one was given or already picked."""
        if self.half_dtype is not None or self.device_type is not None:
            return self
        picked = dataclasses.replace(self)
        object.__setattr__(picked, "device_type", str(device_type))
        object.__setattr__(picked, "_picked_from", written_settings(self))  # its warning is the written object's
        picked.__post_init__()  # the properties of the picked dtype, checked as any settings' are
        return picked

    def to_kwargs(self) -> dict[str, Any]:
        """The keywords of :class:`~lightning_mpx.engine.amp.Amp` (all but ``opt_level``) that rebuild these settings:
        ``Amp(s.opt_level, **s.to_kwargs())`` is ``Amp.from_settings(s)``. The overrides given come flat, but those
        given as ``None`` (a keyword ``None`` would mean the level's value) under ``overrides=``, which
        :meth:`from_kwargs` keeps as given."""
        out = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.init and f.name not in ("opt_level", "overrides", "scaler")
        }
        out["fp32_modules"] = tuple(self.fp32_modules)
        given = {k: v for k, v in self.overrides.items() if v is not None}
        kept = {k: v for k, v in self.overrides.items() if v is None}
        return {**out, **self.scaler.to_kwargs(), **given, **({"overrides": kept} if kept else {})}


def _check_unknown(given: Iterable[str], settings: Sequence[str]) -> None:
    """Raise ``TypeError`` for a keyword of ``given`` that is neither an opt-level override nor one of ``settings``,
    naming it, the overrides and the other settings, and the nearest valid keyword (a misspelt setting, such as
    ``init_scaler=``, is not taken for an override)."""
    unknown = [name for name in given if name not in OPT_LEVEL_OVERRIDES]
    if not unknown:
        return
    near = difflib.get_close_matches(unknown[0], [*OPT_LEVEL_OVERRIDES, *settings, "overrides"], n=1)
    raise TypeError(
        f"unknown opt-level override(s) {', '.join(map(repr, unknown))}; valid choices: "
        f"{', '.join(OPT_LEVEL_OVERRIDES)}, or a setting: {', '.join(settings)}."
        + (f" Did you mean {near[0]}=?" if near else "")
    )


def implicit_half_dtype(device_type: str | None) -> str:
    """The half dtype of a run given none: ``"bfloat16"`` on ``"cpu"`` (float16 matmuls are often emulated on CPUs,
    tens of times slower; ``torch.autocast``'s CPU default too), ``"float16"`` on any other device; ``device_type=None``
    (not known yet): float16 when CUDA is available, else bfloat16."""
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return "bfloat16" if device_type == "cpu" else "float16"


def implicit_dtype_note(logger: Any, opt_level: str, dtype: str, hint: str = 'half_dtype="float16"') -> None:
    """Log, once per run and on rank zero only (the caller's to check), that ``opt_level`` runs in ``dtype`` on
    this CPU because no half dtype was given, and how to ask for float16 (``hint``)."""
    logger.warning(
        "lightning_mpx: opt level %r runs in %s on this CPU (no half_dtype given; float16 matmuls are often emulated "
        "on CPUs, tens of times slower): pass %s for float16.", opt_level, dtype, hint)


#: The keyword under which ``from_settings`` and unpickling hand a front door's ``__init__`` the settings object itself
#: (see :func:`settings_of`): not a setting, so not in any signature.
SETTINGS_OBJECT = "_settings_object"


def settings_of(opt_level: str, keywords: dict[str, Any]) -> MixedPrecisionSettings:
    """The settings a front door's ``__init__(opt_level, **keywords)`` stands for: the object ``from_settings`` (or
    unpickling) hands over under :data:`SETTINGS_OBJECT`, kept as it is (so its once-per-object warning about
    ignored settings stays said), else new settings from ``keywords``.

    Raises:
        TypeError: for a handed-over object that is not a :class:`MixedPrecisionSettings`, given with other keywords,
            or with another ``opt_level``.
    """
    given = keywords.pop(SETTINGS_OBJECT, None)
    if given is None:
        return MixedPrecisionSettings.from_kwargs(opt_level, **keywords)
    if not isinstance(given, MixedPrecisionSettings) or keywords or given.opt_level != opt_level:
        raise TypeError(
            f"{SETTINGS_OBJECT}={type(given).__name__} with opt_level={opt_level!r} and keywords {sorted(keywords)}: "
            "from_settings(settings) hands over a MixedPrecisionSettings alone, at its own opt_level; pass either "
            "the settings object (from_settings) or the keywords."
        )
    return given


# A keyword that is not a field (``halfdtype=``) names the valid ones and the closest (the dataclass's own named none).
for _settings in (ScalerSettings, MixedPrecisionSettings):
    _settings.__init__ = checks_keywords(  # type: ignore[method-assign]
        f"{_settings.__name__}()", tuple(f.name for f in dataclasses.fields(_settings) if f.init)
    )(_settings.__init__)
del _settings


class SettingsKeywords(ScalerKeywords, OptLevelOverrides, total=False):
    """Every setting as a keyword (:class:`MixedPrecisionSettings`'s own fields, the scaler's, the opt-level
    overrides), for the front doors' ``**settings: Unpack[SettingsKeywords]``: type checkers and IDEs read the names
    and types here; the defaults and docs are the fields' (``tests/test_settings.py`` holds the two equal)."""

    half_dtype: str | torch.dtype | None
    num_losses: int
    cast_table: CastTable | None
    allow_banned: bool
    unscale_backend: str
    overflow_log_interval: float
    model_writes: str
    diagnose_overflows: bool
    fp32_modules: Sequence[str]
    skip_on_device: bool | None


#: The defaults of every setting.
DEFAULTS = MixedPrecisionSettings()
SCALER_DEFAULTS = DEFAULTS.scaler
#: The keywords of :class:`MixedPrecisionSettings`'s own fields (not ``opt_level``, ``overrides``, ``scaler``).
ENGINE_FIELDS: tuple[str, ...] = tuple(
    f.name
    for f in dataclasses.fields(MixedPrecisionSettings)
    if f.init and f.name not in ("opt_level", "overrides", "scaler")
)


def setting_fields(*, engine: bool = True, overrides: bool = False) -> list[tuple[str, Any, Any]]:
    """``(name, type, default)`` of each setting keyword, read from the fields: :class:`MixedPrecisionSettings`'s
    own (``engine``), :class:`ScalerSettings`'s, then (``overrides``) each opt-level override, typed ``... | None``
    with the default ``None`` (the preset's value). The types are the fields' annotations, as text."""
    own = {f.name: f for f in dataclasses.fields(MixedPrecisionSettings)}
    out = [(name, own[name].type, getattr(DEFAULTS, name)) for name in ENGINE_FIELDS] if engine else []
    out += [(f.name, f.type, getattr(SCALER_DEFAULTS, f.name)) for f in dataclasses.fields(ScalerSettings)]
    if overrides:
        for name, kind in OptLevelOverrides.__annotations__.items():
            text = getattr(kind, "__forward_arg__", kind)
            out.append((name, text if "None" in str(text) else f"{text} | None", None))
    return out


_F = TypeVar("_F", bound=Callable[..., Any])


def keyword_signature(*, engine: bool = True, overrides: bool = True) -> Callable[[_F], _F]:
    """Decorator for a front door written ``def __init__(self, opt_level="O1", **settings: Unpack[SettingsKeywords])``:
    the signature ``help()``, ``inspect`` and the docs show is its own parameters, then one typed keyword per setting
    with its default (from :func:`setting_fields`; ``engine=False``: the scaler's only), then (unless
    ``overrides=False``) one keyword per opt-level override, typed ``... | None`` with the default ``None`` (the
    level's value), and ``**overrides``. The function itself is unchanged. The keywords' types are the fields'
    evaluated (``str | torch.dtype | None``, not that text): tools that build arguments from a signature (jsonargparse,
    so ``LightningCLI`` config files) cannot resolve text in the front door's module, nor fill ``**overrides``."""

    def decorate(function: _F) -> _F:
        own = inspect.signature(function)
        kept = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        types = {**typing.get_type_hints(ScalerSettings), **typing.get_type_hints(MixedPrecisionSettings)}
        added = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=types[name])
            for name, _, default in setting_fields(engine=engine)
        ]
        if overrides:
            added += [
                inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=kind | None)
                for name, kind in typing.get_type_hints(OptLevelOverrides).items()
            ]
            added.append(inspect.Parameter("overrides", inspect.Parameter.VAR_KEYWORD, annotation="Any"))
        function.__signature__ = own.replace(parameters=kept + added)  # type: ignore[attr-defined]
        return function

    return decorate
