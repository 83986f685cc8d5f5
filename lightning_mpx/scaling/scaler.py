"""Dynamic and static loss scaling with the state kept on the device.

The scale, the growth and hysteresis trackers and the overflow counter are small tensors created lazily on the
device of the first loss. :meth:`LossScaler.update` changes them with tensor ops only: a normal step never waits for
the device. With ``hysteresis=1`` and no bound reached, the scale follows ``torch.amp.GradScaler`` exactly.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Mapping, Sequence

import torch
from typing_extensions import Unpack

from lightning_mpx.common.containers import read_floats
from lightning_mpx.opt_levels import LossScale, _check_loss_scale

# ON_FLOOR_CHOICES and OnFloor are defined with the other settings; their old import path here keeps working.
from lightning_mpx.settings import (  # noqa: F401
    ON_FLOOR_CHOICES,
    SCALER_DEFAULTS,
    SCALER_FIELDS,
    OnFloor,
    ScalerKeywords,
    ScalerSettings,
    check_keywords,
    keyword_signature,
)

_FP32_MAX = float(torch.finfo(torch.float32).max)
#: The floor error's advice by the half dtype of the gradients (``None``: a scaler that was not told it). bfloat16
#: is advised to float16 runs only: a bfloat16 gradient overflows where an FP32 one would.
_FLOOR_ADVICE: dict[torch.dtype | None, str] = {
    torch.float16: "Check the loss and inputs for inf/NaN, lower the learning rate, or use bfloat16 (FP32's range)",
    torch.bfloat16: (
        "Check the loss and inputs for inf/NaN, or lower the learning rate (bfloat16 has FP32's range: these values "
        "are not finite in FP32 either)"
    ),
    None: "Check the loss and inputs for inf/NaN, or lower the learning rate",
}


class LossScaleFloorError(FloatingPointError):
    """Gradients overflowed while the loss scale was already at its floor: training cannot make progress."""


class LossScaler:
    """Scales losses and tracks the scale of one loss.

    Args:
        loss_scale: ``"dynamic"``, or a positive number for a static scale.
        **settings: The scaler's settings (``init_scale``, ``growth_factor``, ``backoff_factor``,
            ``growth_interval``, ``hysteresis``, ``consecutive_hysteresis``, ``min_loss_scale``, ``max_loss_scale``,
            ``on_floor``; typed in :class:`~lightning_mpx.settings.ScalerKeywords`), each documented, defaulted and
            checked in :class:`~lightning_mpx.settings.ScalerSettings` (:meth:`from_settings` takes one whole).
        half_dtype: The dtype whose gradients it scales, which the floor error's advice names (``None``: not
            known).

    Attributes:
        settings: The :class:`~lightning_mpx.settings.ScalerSettings` the scaler was built with.
        half_dtype: The ``half_dtype`` it was given.

    .. warning::
        :meth:`get_scale`, :meth:`state_dict` and :meth:`handle_overflow` read device values and so wait for the
        device; :meth:`scale`, :meth:`update` and :meth:`inv_scale` do not.
    """

    @keyword_signature(engine=False, overrides=False)
    def __init__(
        self,
        loss_scale: LossScale = "dynamic",
        *,
        half_dtype: torch.dtype | None = None,
        **settings: Unpack[ScalerKeywords],
    ) -> None:
        _check_loss_scale(loss_scale)
        check_keywords("LossScaler()", settings, SCALER_FIELDS + ("half_dtype",))
        self._configure(loss_scale, ScalerSettings(**settings), half_dtype)

    @classmethod
    def from_settings(
        cls, loss_scale: LossScale, settings: ScalerSettings, *, half_dtype: torch.dtype | None = None
    ) -> LossScaler:
        """A scaler of ``loss_scale`` (``"dynamic"`` or a static number) with ``settings``; ``half_dtype``: the
        dtype whose gradients it scales, which the floor error's advice names (``None``: not known)."""
        if not isinstance(settings, ScalerSettings):
            raise TypeError(f"settings={type(settings).__name__} must be a lightning_mpx.ScalerSettings.")
        _check_loss_scale(loss_scale)
        scaler = cls.__new__(cls)
        scaler._configure(loss_scale, settings, half_dtype)
        return scaler

    def _configure(self, loss_scale: LossScale, settings: ScalerSettings, half_dtype: torch.dtype | None) -> None:
        settings.check_init_scale(loss_scale)
        if half_dtype not in (None, torch.float16, torch.bfloat16):
            raise ValueError(
                f"half_dtype={half_dtype!r} is not a half-precision dtype; valid choices: None, torch.float16, "
                "torch.bfloat16."
            )
        self.settings = settings
        self.half_dtype = half_dtype
        self.dynamic = loss_scale == "dynamic"
        self.init_scale = float(settings.init_scale if self.dynamic else loss_scale)  # type: ignore[arg-type]
        self.growth_factor = float(settings.growth_factor)
        self.backoff_factor = float(settings.backoff_factor)
        self.growth_interval = settings.growth_interval
        self.hysteresis = settings.hysteresis
        self.consecutive_hysteresis = settings.consecutive_hysteresis
        self.min_loss_scale = float(settings.min_loss_scale)
        self.max_loss_scale = float(settings.max_loss_scale)
        self.on_floor: OnFloor = settings.on_floor
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._hysteresis_tracker: torch.Tensor | None = None
        self._overflows: torch.Tensor | None = None
        self._pending_state: dict[str, Any] | None = None
        # Whether scale() may hand back the loss itself: a static scale of exactly 1.0, known on the host (it changes
        # only when a checkpoint is loaded, whose value the host reads anyway), so that scale() and inv_scale() always
        # agree.
        self._unit = not self.dynamic and self.init_scale == 1.0
        self._one: torch.Tensor | None = None  # unscale_factor() of a unit scale, on the scale's device

    # -- device state -------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device | None:
        return None if self._scale is None else self._scale.device

    def to(self, device: torch.device | str) -> LossScaler:
        """Create (or move) the state on ``device``; called implicitly by the first :meth:`scale`."""
        device = torch.device(device)
        if self._scale is None:
            self._scale = torch.full((), self.init_scale, dtype=torch.float32, device=device)
            self._growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
            self._hysteresis_tracker = torch.full((), self.hysteresis, dtype=torch.int32, device=device)
            self._overflows = torch.zeros((), dtype=torch.int64, device=device)
            if self._pending_state is not None:
                self._apply_state(self._pending_state)
                self._pending_state = None
        elif self._scale.device != device:
            self._scale = self._scale.to(device)
            self._growth_tracker = self._growth_tracker.to(device)  # type: ignore[union-attr]
            self._hysteresis_tracker = self._hysteresis_tracker.to(device)  # type: ignore[union-attr]
            self._overflows = self._overflows.to(device)  # type: ignore[union-attr]
        return self

    @property
    def scale_tensor(self) -> torch.Tensor:
        """The scale as a 0-d FP32 device tensor (read it without a host sync)."""
        if self._scale is None:
            self.to("cpu")
        return self._scale  # type: ignore[return-value]

    @property
    def overflow_count(self) -> torch.Tensor:
        """Overflow events seen by :meth:`update` so far, as a 0-d int64 device tensor."""
        self.scale_tensor
        return self._overflows  # type: ignore[return-value]

    def get_scale(self) -> float:
        """The current scale as a Python float (waits for the device)."""
        return float(self.scale_tensor.item())

    def clone(self) -> LossScaler:
        """A copy with device state of its own (the scale, trackers and overflow count cloned; a state loaded before
        the first :meth:`scale` copied): updating it leaves this scaler as it is. The settings (frozen) and the unit
        scale's read-only one are shared."""
        other = copy.copy(self)
        if self._scale is not None:
            other._scale = self._scale.clone()
            other._growth_tracker = self._growth_tracker.clone()  # type: ignore[union-attr]
            other._hysteresis_tracker = self._hysteresis_tracker.clone()  # type: ignore[union-attr]
            other._overflows = self._overflows.clone()  # type: ignore[union-attr]
        if self._pending_state is not None:
            other._pending_state = dict(self._pending_state)
        return other

    # -- the per-step work --------------------------------------------------------------------------------------
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current scale (a no-op for a static scale of 1.0)."""
        if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
            kind = loss.dtype if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise TypeError(
                f"loss={kind} must be a floating-point torch.Tensor (the loss the backward starts from, such as "
                "loss_fn(output, target)), not a Python number or an integer tensor."
            )
        if self._scale is None or self._scale.device != loss.device:
            self.to(loss.device)
        if self._unit:
            return loss
        return loss * self._scale  # type: ignore[operator]

    def inv_scale(self) -> torch.Tensor:
        """``1 / scale`` as a 0-d FP32 tensor, with the reciprocal taken in FP64 as GradScaler does."""
        return self.scale_tensor.double().reciprocal().float()

    def unscale_factor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """What the gradients of this scale are multiplied by to unscale them: :meth:`inv_scale`, except that a static
        scale of 1.0 (bfloat16's default) gives the same 0-d FP32 one at every call, made once per device, instead
        of three kernels a step. Read it, do not write to it. ``device``: where the state is made if it has none yet
        (default: the CPU); a state made before stays where it is."""
        if self._scale is None:
            self.to("cpu" if device is None else device)
        if not self._unit:
            return self.inv_scale()
        scale = self._scale  # made above: scale_tensor without its call
        assert scale is not None
        one = self._one
        if one is None or one.device != scale.device:
            one = self._one = torch.ones((), dtype=torch.float32, device=scale.device)
        return one

    def update(self, found_inf: torch.Tensor, *, overflowed: bool | None = None) -> None:
        """Advance the state after one iteration; ``found_inf > 0`` marks an overflow. No host sync.

        Args:
            found_inf: The iteration's overflow flag (any device, any floating dtype, one element).
            overflowed: What a host read of ``found_inf`` said, when the caller has read it (``Amp.step`` does, to
                decide the skip): the overflow is then counted without operators on the device, and a static
                scale's update makes none. ``None``: counted from ``found_inf`` on its device.
        """
        if not isinstance(found_inf, torch.Tensor):
            raise TypeError(
                f"found_inf={found_inf!r} must be a torch.Tensor (the overflow flag: nonzero on overflow), such as "
                "Amp.found_inf(optimizer)."
            )
        scale = self._scale if self._scale is not None else self.scale_tensor  # made once: no call per step
        if overflowed is not None:
            if overflowed:
                self._overflows.add_(1)  # type: ignore[union-attr]
            if not self.dynamic:
                return
            found = found_inf
            if found.device != scale.device or found.dtype != torch.float32 or found.dim():
                found = found.to(device=scale.device, dtype=torch.float32).reshape(())
        else:
            found = found_inf
            if found.device != scale.device or found.dtype != torch.float32 or found.dim():
                found = found.to(device=scale.device, dtype=torch.float32).reshape(())
            self._overflows.add_(found > 0)  # type: ignore[union-attr]  (a bool added to the int64 count: 0 or 1)
            if not self.dynamic:
                return
        if self.hysteresis == 1:
            # torch's own kernel: exactly GradScaler's trajectory; the bounds are applied after it.
            assert self._growth_tracker is not None
            torch._amp_update_scale_(
                scale, self._growth_tracker, found, self.growth_factor, self.backoff_factor, self.growth_interval
            )
            scale.clamp_(self.min_loss_scale, self.max_loss_scale)
            return
        # DeepSpeed's DynamicLossScaler (Megatron-LM's DynamicGradScaler is the same): an overflow with the
        # hysteresis tracker at 1 backs off, any other lowers the tracker; it stays at 1 (every overflow backs off)
        # until a growth (with consecutive_hysteresis: any overflow-free step) restores it.
        overflow = found > 0
        back_off = overflow & (self._hysteresis_tracker <= 1)  # type: ignore[operator]
        tracker = (self._hysteresis_tracker - overflow.to(torch.int32)).clamp(min=1)  # type: ignore[operator]
        successes = torch.where(overflow, torch.zeros_like(self._growth_tracker), self._growth_tracker + 1)  # type: ignore[arg-type, operator]
        grow = ~overflow & (successes >= self.growth_interval)
        new_scale = torch.where(back_off, (scale * self.backoff_factor).clamp(min=self.min_loss_scale), scale)
        # Like torch's kernel, never grow past the FP32 range to inf (possible with max_loss_scale=math.inf).
        grown = scale * self.growth_factor
        grown = torch.where(torch.isfinite(grown), grown.clamp(max=self.max_loss_scale), scale)
        new_scale = torch.where(grow, grown, new_scale)
        scale.copy_(new_scale)
        self._growth_tracker.copy_(torch.where(grow, torch.zeros_like(successes), successes))  # type: ignore[union-attr]
        restore = ~overflow if self.consecutive_hysteresis else grow
        self._hysteresis_tracker.copy_(  # type: ignore[union-attr]
            torch.where(restore, torch.full_like(tracker, self.hysteresis), tracker)
        )

    def at_floor(self) -> bool:
        """Whether an overflow now could not lower the scale (waits for the device)."""
        return not self.dynamic or self.get_scale() <= self.min_loss_scale

    def handle_overflow(
        self, bad_parameters: Sequence[str], hint: str | None = None, *, scale: float | None = None
    ) -> None:
        """Apply ``on_floor`` if the scale is at its floor; call it on overflow steps only (it waits for the device).

        Args:
            bad_parameters: Names of the parameters with non-finite gradients.
            hint: The likely cause, when the caller knows better than "check the loss and inputs" (it replaces that
                advice in the message).
            scale: The scale the overflowed gradients were computed with, when an update may have changed it
                since (a step skipped on the device and read later); ``None``: the current scale.

        Raises:
            LossScaleFloorError: when ``on_floor="raise"`` and the scale cannot go lower.
        """
        if scale is None:
            at_floor = self.at_floor()
        else:
            at_floor = not self.dynamic or scale <= self.min_loss_scale
        if self.on_floor == "continue" or not at_floor:
            return
        shown = ", ".join(bad_parameters[:10]) + (
            f" and {len(bad_parameters) - 10} more" if len(bad_parameters) > 10 else ""
        )
        kind = "dynamic loss scale is at its floor" if self.dynamic else "static loss scale cannot be lowered"
        message = (
            f"Gradients overflowed and the {kind} (scale={self.get_scale() if scale is None else scale:g}, "
            f"min_loss_scale={self.min_loss_scale:g}):"
            f" non-finite gradients in {shown or 'unknown parameters'}. The step was skipped and parameters are "
            "unchanged. "
            + (hint or _FLOOR_ADVICE[self.half_dtype])
            + ("; pass on_floor='warn' or 'continue' to keep training." if self.on_floor != "warn" else
               "; training goes on (on_floor='warn'; 'continue' silences this warning, 'raise' stops).")
        )
        if self.on_floor in ("raise", "promote"):  # "promote" gets here only when no module could be blamed
            raise LossScaleFloorError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    # -- checkpoints --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (waits for the device)."""
        if self._scale is None:
            return dict(self._pending_state) if self._pending_state else {
                "scale": self.init_scale, "growth_tracker": 0, "hysteresis_tracker": self.hysteresis,
                "overflows": 0, "dynamic": self.dynamic,
            }
        read = read_floats({"scale": self._scale, "growth_tracker": self._growth_tracker,  # one host read, not four
                            "hysteresis_tracker": self._hysteresis_tracker, "overflows": self._overflows})
        return {
            "scale": read["scale"],
            "growth_tracker": int(read["growth_tracker"]),
            "hysteresis_tracker": int(read["hysteresis_tracker"]),
            "overflows": int(read["overflows"]),
            "dynamic": self.dynamic,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (a refused one changes nothing)."""
        if not isinstance(state, Mapping):
            raise TypeError(f"state={type(state).__name__} must be a dict saved by LossScaler.state_dict().")
        missing = {"scale", "growth_tracker", "hysteresis_tracker", "overflows"} - set(state)
        if missing:
            grad_scaler = " It is a torch.amp.GradScaler state dict: pass init_scale=state['scale'] to a LossScaler."
            raise KeyError(f"loss-scaler state is missing {sorted(missing)}; was it saved by LossScaler.state_dict()?"
                           + (grad_scaler if "_growth_tracker" in state else ""))
        if "dynamic" in state and bool(state["dynamic"]) != self.dynamic:
            saved = "a dynamic" if state["dynamic"] else "a static"
            raise ValueError(
                f"the checkpoint holds {saved} loss scale but this scaler is "
                f"{'dynamic' if self.dynamic else 'static'}; resume with the same loss_scale setting."
            )
        scale = state["scale"]
        try:
            value = None if isinstance(scale, bool) else float(scale)
        except (TypeError, ValueError, RuntimeError):
            value = None
        if value is None or not 0 < value <= _FP32_MAX:
            # a NaN, zero or negative scale would turn every loss and step after the load into NaN or nothing
            raise ValueError(
                f"the checkpoint's loss scale {scale!r} is not a positive finite number; valid: a scale saved by "
                "LossScaler.state_dict()."
            )
        if self._scale is None:
            self._pending_state = dict(state)
        else:
            self._apply_state(state)

    def grad_scaler_state(self, state: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
        """This scaler's state (or ``state``, a :meth:`state_dict` of it) in ``torch.amp.GradScaler.state_dict()``'s
        format, for a run of the framework's own float16 mixed precision to resume from (its scale, growth tracker and
        growth settings; a GradScaler has no hysteresis nor scale bounds); ``None`` for a static scale, which a
        GradScaler (always dynamic) cannot hold."""
        if not self.dynamic:
            return None
        state = self.state_dict() if state is None else state
        return {
            "scale": float(state["scale"]), "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
            "growth_interval": int(self.growth_interval), "_growth_tracker": int(state["growth_tracker"]),
        }

    def _apply_state(self, state: dict[str, Any]) -> None:
        # A state saved with a longer growth_interval (or a larger hysteresis) can hold a tracker past this scaler's
        # limit; torch's kernel grows only when the tracker *equals* the interval, so it would never grow again.
        # With the same settings the trackers are always below the limits and this changes nothing.
        self._scale.fill_(state["scale"])  # type: ignore[union-attr]
        self._unit = not self.dynamic and float(state["scale"]) == 1.0
        growth_tracker = min(int(state["growth_tracker"]), self.growth_interval - 1)
        self._growth_tracker.fill_(growth_tracker)  # type: ignore[union-attr]
        hysteresis_tracker = max(1, min(int(state["hysteresis_tracker"]), self.hysteresis))
        self._hysteresis_tracker.fill_(hysteresis_tracker)  # type: ignore[union-attr]
        self._overflows.fill_(state["overflows"])  # type: ignore[union-attr]

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else f"static {self.init_scale:g}"
        consecutive = ", consecutive_hysteresis=True" if self.consecutive_hysteresis else ""
        return f"LossScaler({kind}, growth_interval={self.growth_interval}, hysteresis={self.hysteresis}{consecutive})"
