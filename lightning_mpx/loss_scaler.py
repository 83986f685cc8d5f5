"""Dynamic and static loss scaling with the state kept on the device.

The scale, the growth and hysteresis trackers and the overflow counter are small tensors created lazily on the
device of the first loss. :meth:`LossScaler.update` changes them with tensor ops only: a normal step never waits for
the device. With ``hysteresis=1`` and no bound reached, the scale follows ``torch.amp.GradScaler`` exactly.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Literal, Sequence

import torch

from lightning_mpx.opt_levels import LossScale, _check_loss_scale

_FP32_MAX = float(torch.finfo(torch.float32).max)
OnFloor = Literal["raise", "warn", "continue", "promote"]
ON_FLOOR_CHOICES: tuple[str, ...] = ("raise", "warn", "continue", "promote")


class LossScaleFloorError(FloatingPointError):
    """Gradients overflowed while the loss scale was already at its floor: training cannot make progress."""


class LossScaler:
    """Scales losses and tracks the scale of one loss.

    Args:
        loss_scale: ``"dynamic"``, or a positive number for a static scale.
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
        max_loss_scale: The ceiling of a dynamic scale.
        on_floor: What an overflow does when the scale cannot go lower (a dynamic scale at ``min_loss_scale``, or
            any static scale): ``"raise"`` :class:`LossScaleFloorError` naming the parameters with non-finite
            gradients, ``"warn"``, ``"continue"`` silently, or ``"promote"``: the modules the overflows keep coming
            from run in FP32 from then on (done by :class:`~lightning_mpx.amp.Amp`, see
            :mod:`lightning_mpx.promotion`; it raises as ``"raise"`` where no module can be blamed, and a scaler used
            on its own raises too). The step is skipped in every case.

    .. warning::
        :meth:`get_scale`, :meth:`state_dict` and :meth:`handle_overflow` read device values and so wait for the
        device; :meth:`scale`, :meth:`update` and :meth:`inv_scale` do not.
    """

    def __init__(
        self,
        loss_scale: LossScale = "dynamic",
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = False,
        min_loss_scale: float = 1.0,
        max_loss_scale: float = 2.0**24,
        on_floor: OnFloor = "raise",
    ) -> None:
        _check_loss_scale(loss_scale)
        _positive("init_scale", init_scale)
        _positive("min_loss_scale", min_loss_scale)
        # `not x > 0` rather than `x <= 0` so that NaN is refused too.
        if not _is_number(max_loss_scale) or not max_loss_scale > 0:  # type: ignore[operator]
            raise ValueError(f"max_loss_scale={max_loss_scale!r} must be a positive number (math.inf for no ceiling).")
        if not _is_number(growth_factor) or not growth_factor >= 1.0 or not math.isfinite(growth_factor):
            raise ValueError(
                f"growth_factor={growth_factor!r} must be a finite number of at least 1.0, e.g. 2.0 (1.0: the scale "
                "never grows back after a backoff)."
            )
        if not _is_number(backoff_factor) or not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor={backoff_factor!r} must be between 0 and 1 (exclusive), e.g. 0.5.")
        for name, value in (("growth_interval", growth_interval), ("hysteresis", hysteresis)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer.")
        if not isinstance(consecutive_hysteresis, bool):
            raise TypeError(f"consecutive_hysteresis={consecutive_hysteresis!r} must be True or False.")
        if min_loss_scale > max_loss_scale:
            raise ValueError(
                f"min_loss_scale={min_loss_scale!r} is above max_loss_scale={max_loss_scale!r}; the floor must not "
                "exceed the ceiling."
            )
        if loss_scale == "dynamic" and not min_loss_scale <= init_scale <= max_loss_scale:
            raise ValueError(
                f"init_scale={init_scale!r} lies outside [min_loss_scale={min_loss_scale!r}, "
                f"max_loss_scale={max_loss_scale!r}]."
            )
        if on_floor not in ON_FLOOR_CHOICES:
            raise ValueError(f"on_floor={on_floor!r} is not valid; valid choices: {', '.join(ON_FLOOR_CHOICES)}.")
        self.dynamic = loss_scale == "dynamic"
        self.init_scale = float(init_scale if self.dynamic else loss_scale)  # type: ignore[arg-type]
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_loss_scale = float(min_loss_scale)
        self.max_loss_scale = float(max_loss_scale)
        self.on_floor: OnFloor = on_floor
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._hysteresis_tracker: torch.Tensor | None = None
        self._overflows: torch.Tensor | None = None
        self._pending_state: dict[str, Any] | None = None
        # Whether scale() may hand back the loss itself: a static scale of exactly 1.0, known on the host (it changes
        # only when a checkpoint is loaded, whose value the host reads anyway), so that scale() and inv_scale() always
        # agree.
        self._unit = not self.dynamic and self.init_scale == 1.0

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

    # -- the per-step work --------------------------------------------------------------------------------------
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current scale (a no-op for a static scale of 1.0)."""
        if self._scale is None or self._scale.device != loss.device:
            self.to(loss.device)
        if self._unit:
            return loss
        return loss * self._scale  # type: ignore[operator]

    def inv_scale(self) -> torch.Tensor:
        """``1 / scale`` as a 0-d FP32 tensor, with the reciprocal taken in FP64 as GradScaler does."""
        return self.scale_tensor.double().reciprocal().float()

    def update(self, found_inf: torch.Tensor) -> None:
        """Advance the state after one iteration; ``found_inf > 0`` marks an overflow. No host sync."""
        scale = self.scale_tensor
        found = found_inf.to(device=scale.device, dtype=torch.float32).reshape(())
        self._overflows.add_((found > 0).to(torch.int64))  # type: ignore[union-attr]
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

    def handle_overflow(self, bad_parameters: Sequence[str], hint: str | None = None) -> None:
        """Apply ``on_floor`` if the scale is at its floor; call it on overflow steps only (it waits for the device).

        Args:
            bad_parameters: Names of the parameters with non-finite gradients.
            hint: The likely cause, when the caller knows better than "check the loss and inputs" (it replaces that
                advice in the message).

        Raises:
            LossScaleFloorError: when ``on_floor="raise"`` and the scale cannot go lower.
        """
        if self.on_floor == "continue" or not self.at_floor():
            return
        shown = ", ".join(bad_parameters[:10]) + (f" and {len(bad_parameters) - 10} more" if len(bad_parameters) > 10 else "")
        kind = "dynamic loss scale is at its floor" if self.dynamic else "static loss scale cannot be lowered"
        message = (
            f"Gradients overflowed and the {kind} (scale={self.get_scale():g}, min_loss_scale={self.min_loss_scale:g}):"
            f" non-finite gradients in {shown or 'unknown parameters'}. The step was skipped and parameters are "
            "unchanged. "
            + (hint or "Check the loss and inputs for inf/NaN, lower the learning rate, or use bfloat16")
            + "; pass on_floor='warn' or 'continue' to keep training."
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
        return {
            "scale": float(self._scale.item()),
            "growth_tracker": int(self._growth_tracker.item()),  # type: ignore[union-attr]
            "hysteresis_tracker": int(self._hysteresis_tracker.item()),  # type: ignore[union-attr]
            "overflows": int(self._overflows.item()),  # type: ignore[union-attr]
            "dynamic": self.dynamic,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"scale", "growth_tracker", "hysteresis_tracker", "overflows"} - set(state)
        if missing:
            raise KeyError(f"loss-scaler state is missing {sorted(missing)}; was it saved by LossScaler.state_dict()?")
        if "dynamic" in state and bool(state["dynamic"]) != self.dynamic:
            saved = "a dynamic" if state["dynamic"] else "a static"
            raise ValueError(
                f"the checkpoint holds {saved} loss scale but this scaler is "
                f"{'dynamic' if self.dynamic else 'static'}; resume with the same loss_scale setting."
            )
        if self._scale is None:
            self._pending_state = dict(state)
        else:
            self._apply_state(state)

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


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive(name: str, value: object) -> None:
    if not _is_number(value) or not math.isfinite(value) or value <= 0 or value > _FP32_MAX:  # type: ignore[arg-type, operator]
        raise ValueError(f"{name}={value!r} must be a positive finite number that FP32 can hold.")
