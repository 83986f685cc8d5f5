"""The opt level's settings in Accelerate's kwargs-handler style: ``kwargs_handlers=[MixedPrecisionKwargs(...)]``.

:class:`MixedPrecisionKwargs` is a dataclass whose setting fields are made from :mod:`lightning_mpx.settings`
(:func:`~lightning_mpx.settings.setting_fields`: each setting's name, type and default, and the opt-level overrides
with the default ``None``), followed by the adapter's own three fields; a setting added there is a field here.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from typing_extensions import Unpack

from lightning_mpx.casting.table import CastTable
from lightning_mpx.common.dtypes import parse_half_dtype
from lightning_mpx.common.imports import require
from lightning_mpx.common.keywords import checks_keywords
from lightning_mpx.health.promotion import check_patterns
from lightning_mpx.opt_levels import _check_loss_scale
from lightning_mpx.scaling.unscale import BACKENDS
from lightning_mpx.settings import (
    MODEL_WRITES,
    SCALER_FIELDS,
    SKIP_ON_DEVICE_AUTO,
    MixedPrecisionSettings,
    ScalerSettings,
    SettingsKeywords,
    check_choice,
    check_flag,
    check_optional_flag,
    check_positive_int,
    setting_fields,
)

require("accelerate", feature="lightning_mpx.accelerate")
from accelerate.utils import KwargsHandler  # type: ignore[import-untyped]  # noqa: E402

__all__ = ["FSDP_GATHER_CHOICES", "MixedPrecisionKwargs", "MixedPrecisionKwargsKeywords"]

#: ``MixedPrecisionKwargs(fsdp_gather=...)``: the dtype FSDP all-gathers O1's FP32 parameters in (see
#: lightning_mpx.integrations.fsdp).
FSDP_GATHER_CHOICES: tuple[str, ...] = ("half", "fp32")


class MixedPrecisionKwargsKeywords(SettingsKeywords, total=False):
    """The keywords of :class:`MixedPrecisionKwargs`, for type checkers and IDEs: every setting, and the adapter's."""

    log_metrics: bool
    telemetry_every_n_steps: int | None
    fsdp_gather: str


def _with_setting_fields(cls: type) -> type:
    """Applied before ``@dataclass``: one field per setting, typed and defaulted as in :mod:`lightning_mpx.settings`
    (the opt-level overrides ``None``: the preset's value), ahead of the class's own fields."""
    generated = {}
    for name, kind, default in setting_fields(overrides=True):
        if name == "half_dtype":  # None: the device's (see MixedPrecisionKwargs.settings), once in the annotation
            kind, default = (kind if "None" in kind.split(" | ") else f"{kind} | None"), None
        generated[name] = kind
        setattr(cls, name, default)
    cls.__annotations__ = {**generated, **cls.__dict__.get("__annotations__", {})}
    return cls


def _naming_unknown_keywords(cls: type) -> type:
    """Applied after ``@dataclass``: a keyword that is not a field (a typo, ``init_scaler=``) is refused with the
    valid keywords and the closest of them, where the dataclass's own ``__init__`` named none. The generated
    ``__init__`` does the rest; the signature shown is its own, and ``dataclasses.replace``, ``copy`` and pickling go
    through it (or around it) as before."""
    valid = tuple(f.name for f in dataclasses.fields(cls) if f.init)
    cls.__init__ = checks_keywords(f"{cls.__name__}()", valid)(cls.__init__)  # type: ignore[misc]
    return cls


@_naming_unknown_keywords
@dataclasses.dataclass
@_with_setting_fields
class MixedPrecisionKwargs(KwargsHandler):  # type: ignore[misc]
    """Settings of the opt level, in Accelerate's kwargs-handler style.

    Pass it as ``Accelerator(mixed_precision="O2", kwargs_handlers=[MixedPrecisionKwargs(...)])``. The defaults are
    :class:`~lightning_mpx.engine.amp.Amp`'s; only the fields you change are passed on. Values are checked here as far
    as they can be without the opt level, and again, against the opt level, when the :class:`Accelerator` is built.

    Args:
        half_dtype: ``"float16"`` or ``"bfloat16"`` (also ``"fp16"``, ``"bf16"`` or a torch dtype); ``None`` (default):
            the device's, which the :class:`Accelerator` picks: bfloat16 on a CPU (where float16 matmuls are often
            emulated, tens of times slower), float16 elsewhere, as Apex and :class:`~lightning_mpx.engine.amp.Amp`.
        num_losses, cast_table, allow_banned, unscale_backend, overflow_log_interval, model_writes,
            diagnose_overflows, fp32_modules, skip_on_device: The engine's settings, documented and checked in
            :class:`~lightning_mpx.settings.MixedPrecisionSettings` (pass ``loss_id`` to
            :meth:`Accelerator.backward` with ``num_losses`` above 1; the overflow record of ``diagnose_overflows``
            is ``accelerator.amp.last_overflow``).
        init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, consecutive_hysteresis,
            min_loss_scale, max_loss_scale, on_floor: Loss-scaler settings (see
            :class:`~lightning_mpx.settings.ScalerSettings`).
        cast_model_type, patch_torch_functions, keep_batchnorm_fp32, master_weights, loss_scale: Opt-level property
            overrides (see :func:`~lightning_mpx.opt_levels.resolve_properties`); ``None`` keeps the preset's value.
        log_metrics: Add the ``mpx/...`` metrics to every :meth:`Accelerator.log` call.
        telemetry_every_n_steps: Measure underflow, zeros and headroom (``mpx/underflow/<module>``,
            ``mpx/zeros/<module>``, ``mpx/headroom_doublings/<module>``, see :mod:`lightning_mpx.health.telemetry`) in
            the unscale of every n-th iteration
            (the first, then every n-th: log when ``step % n == 0``); ``None`` (default) measures only after
            :meth:`Accelerator.request_mpx_telemetry`.
        fsdp_gather: Under Accelerate's FSDP at O1, the dtype FSDP all-gathers the FP32 parameters in: ``"half"``
            (default; the cast table on top) or ``"fp32"`` (Apex's exact O1, which keeps half copies of the weights
            alive until the backward: about 45% of the model's FP32 bytes on every rank, measured). Only ``"half"``
            at O2/O3; ignored without FSDP.

    The setting fields are made from :mod:`lightning_mpx.settings` (in the order of
    :func:`~lightning_mpx.settings.setting_fields`), their keywords typed in :class:`MixedPrecisionKwargsKeywords`.

    Raises:
        ValueError: for a value that is invalid whatever the opt level (a dtype, a scaler setting, ...).
        TypeError: for a flag that is not a bool (``skip_on_device``: not a bool or ``None``).
    """

    log_metrics: bool = True
    telemetry_every_n_steps: int | None = None
    fsdp_gather: str = "half"

    if TYPE_CHECKING:  # what type checkers see of the generated fields (the dataclass makes the real __init__)

        def __init__(self, **settings: Unpack[MixedPrecisionKwargsKeywords]) -> None: ...

        def __getattr__(self, name: str) -> Any: ...

    def __post_init__(self) -> None:
        # The checks that need no opt level, with the messages of lightning_mpx.settings; settings() checks the rest.
        if self.half_dtype is not None:
            parse_half_dtype(self.half_dtype)
        self.fp32_modules = check_patterns(self.fp32_modules)
        check_positive_int("num_losses", self.num_losses)
        for name in ("patch_torch_functions", "keep_batchnorm_fp32", "master_weights"):
            if getattr(self, name) not in (None, True, False):
                raise TypeError(f"{name}={getattr(self, name)!r} must be True, False or None (the preset's value).")
        for name in ("allow_banned", "log_metrics", "diagnose_overflows"):
            check_flag(name, getattr(self, name))
        check_optional_flag("skip_on_device", self.skip_on_device, SKIP_ON_DEVICE_AUTO)
        every = self.telemetry_every_n_steps
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"telemetry_every_n_steps={every!r} must be a positive integer or None.")
        check_choice("unscale_backend", self.unscale_backend, BACKENDS)
        check_choice("fsdp_gather", self.fsdp_gather, FSDP_GATHER_CHOICES, quote=True)
        check_choice("model_writes", self.model_writes, MODEL_WRITES, quote=True)
        if self.cast_table is not None and not isinstance(self.cast_table, CastTable):
            raise TypeError(f"cast_table={type(self.cast_table).__name__} must be a lightning_mpx.CastTable or None.")
        loss_scale = "dynamic" if self.loss_scale is None else self.loss_scale
        _check_loss_scale(loss_scale)
        ScalerSettings(**{name: getattr(self, name) for name in SCALER_FIELDS}).check_init_scale(loss_scale)

    def settings(self, opt_level: str, device_type: str | None = None) -> MixedPrecisionSettings:
        """The :class:`~lightning_mpx.settings.MixedPrecisionSettings` of ``opt_level`` with these fields, on
        ``device_type`` (``"cpu"``, ``"cuda"``...): with ``half_dtype=None``, bfloat16 on ``"cpu"``, else float16."""
        return MixedPrecisionSettings.from_kwargs(opt_level, **self.amp_kwargs(device_type))

    def amp_kwargs(self, device_type: str | None = None) -> dict[str, Any]:
        """The keyword arguments for :class:`~lightning_mpx.engine.amp.Amp`: the fields changed from their defaults,
        and ``half_dtype`` as :meth:`settings` resolves it on ``device_type``."""
        kwargs = {k: v for k, v in self.to_kwargs().items() if k not in _ADAPTER_FIELDS}
        if kwargs.get("half_dtype") is None:  # the adapter picks it for its device itself: float16 off a CPU
            kwargs["half_dtype"] = self.implicit_dtype(device_type) or "float16"
        return kwargs

    def implicit_dtype(self, device_type: str | None) -> str | None:
        """The half dtype picked for ``device_type`` when none was given (``"bfloat16"`` on ``"cpu"``), else
        ``None`` (the given one, or float16 off a CPU)."""
        return "bfloat16" if self.half_dtype is None and device_type == "cpu" else None



#: The adapter's own fields, which are not engine settings.
_ADAPTER_FIELDS = ("log_metrics", "telemetry_every_n_steps", "fsdp_gather")
