"""The Accelerate adapter's metrics (:class:`MpxLogging`, a base of
:class:`~lightning_mpx.integrations.accelerate.Accelerator`): telemetry requested for an iteration, the engine's
metrics read as Python numbers, and ``log`` adding them to what the user logs, on the main process only."""

from __future__ import annotations

from typing import Any

from lightning_mpx.common.containers import read_floats
from lightning_mpx.common.imports import require
from lightning_mpx.engine.overflow import DEFAULT_READER
from lightning_mpx.opt_levels import OPT_LEVELS

require("accelerate", feature="lightning_mpx.accelerate")
from lightning_mpx.integrations.metric_counts import LOG_READER  # noqa: E402

__all__ = ["MpxLogging"]


class MpxLogging:
    """The engine's metrics for an accelerator whose ``amp`` is a :class:`~lightning_mpx.Amp` (or ``None``:
    Accelerate's own mixed precision, with no metrics); ``log`` calls on to ``accelerate.Accelerator.log``."""

    # What the Accelerator this is a base of provides (declared here for readers and type checkers).
    amp: Any
    mpx_kwargs: Any  # its MixedPrecisionKwargs, or None
    mixed_precision: str
    is_main_process: bool

    def request_mpx_telemetry(self) -> None:
        """Measure underflow and headroom in this iteration's unscale (call it before the optimizer step); the next
        :meth:`log` or :meth:`mpx_metrics` holds ``mpx/underflow/<module>``, ``mpx/zeros/<module>`` and
        ``mpx/headroom_doublings/<module>``."""
        if self.amp is None:
            raise ValueError(
                f"request_mpx_telemetry() needs an opt level, but mixed_precision={self.mixed_precision!r}; use "
                f"one of {', '.join(map(repr, OPT_LEVELS))}."
            )
        self.amp.request_telemetry()

    def mpx_metrics(self) -> dict[str, float]:
        """``mpx/loss_scale``, ``mpx/overflows`` (since the previous call), ``mpx/skipped_steps`` and
        ``mpx/grad_norm`` (when ``clip_grad_norm_`` computed it since the previous call) as Python floats, with a
        ``/loss{id}`` suffix when there are several losses, and ``mpx/underflow/<module>``, ``mpx/zeros/<module>``
        and ``mpx/headroom_doublings/<module>`` after telemetry was measured. Reads the device (one sync); empty with
        a native value. :meth:`log` reads on its own (since the previous log): a call takes nothing from the next
        log, and after ``load_state`` each counts on from where the saving run's left off."""
        return self._read_mpx_metrics(DEFAULT_READER)

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict[str, Any] | None = None) -> None:
        """As ``accelerate.Accelerator.log``; with an opt level the metrics of :meth:`mpx_metrics`, counted since the
        previous log (whatever :meth:`mpx_metrics` calls were made between), are added to ``values`` (your own values
        win on a name clash) unless ``MixedPrecisionKwargs(log_metrics=False)``. The device is read
        only here, and only on the main process, which is the only one that logs."""
        if (
            self.amp is not None
            and self.mpx_kwargs is not None
            and self.mpx_kwargs.log_metrics
            and self.is_main_process
        ):
            values = {**self._read_mpx_metrics(LOG_READER), **values}
        super().log(values, step=step, log_kwargs=log_kwargs)

    # -- internals ----------------------------------------------------------------------------------------------------
    def _read_mpx_metrics(self, reader: str) -> dict[str, float]:
        """The engine's metrics since ``reader``'s previous read, as Python numbers (one host read)."""
        return {} if self.amp is None else read_floats(self.amp.metrics(reader))
