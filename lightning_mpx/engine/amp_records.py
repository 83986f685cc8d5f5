"""The records of :class:`~lightning_mpx.engine.amp.Amp`: the outcomes of steps skipped on the device, the metrics
it reports, and the checkpoint of its state (what a run saves, loads, or takes over from the engine it replaces).

:class:`AmpRecords` is the base of :class:`~lightning_mpx.engine.amp.Amp` that reads and writes what the parts have
recorded; the engine's training calls (prepare, backward, step, update) stay on :class:`Amp` (the forward on
:class:`~lightning_mpx.engine.amp_forward.AmpForward`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Collection

import torch

from lightning_mpx.engine.amp_parts import AmpParts
from lightning_mpx.engine.checkpoint import _engine_entry
from lightning_mpx.engine.overflow import DEFAULT_READER, check_readers_state, user_positions

if TYPE_CHECKING:
    from lightning_mpx.engine.amp import Amp


class AmpRecords(AmpParts):
    """The base of :class:`~lightning_mpx.engine.amp.Amp` over its records: reading the steps skipped on the device
    (:meth:`read_step_outcomes`, :meth:`settle_step_outcomes`), the metrics (:meth:`metrics`,
    :meth:`request_telemetry`) and the checkpoint (:meth:`state_dict`, :meth:`load_state_dict`,
    :meth:`continue_from`)."""

    # -- steps skipped on the device ----------------------------------------------------------------------------
    def read_step_outcomes(self) -> None:
        """Read the steps skipped on the device (``skip_on_device``) that were not read yet, oldest first, on this
        process only (never a collective: rank 0 alone may call it, to log): their outcomes become known and each
        overflow is counted (``skipped_steps``, the module counts of this process's record). Waits for the device
        only up to the last of those steps. Nothing to do otherwise.

        In one process each overflow is also recorded, logged and ``on_floor`` applied here (which may raise
        :class:`LossScaleFloorError`). Under a process group (``found_inf_reducer`` set) that part merges the ranks'
        records, a collective: it is done at the next :meth:`scale_loss` (backward) or :meth:`step` after an
        :meth:`update`, where every rank is, or at :meth:`settle_step_outcomes`."""
        self._pending.read()

    def settle_step_outcomes(self) -> None:
        """Read and settle every step skipped on the device (``skip_on_device``) that is still pending: count,
        record (merged across ranks under a process group) and log each overflow, and apply ``on_floor`` (which may
        raise :class:`LossScaleFloorError`). Under a process group it is a collective: call it on every rank
        together (the plugins do at teardown; the next backward or step does it anyway). Nothing to do otherwise."""
        self._pending.settle()

    # -- metrics and checkpoints --------------------------------------------------------------------------------
    def request_telemetry(self) -> None:
        """Measure underflow and headroom of the scaled gradients in the unscale (on the device, no host sync) until
        the next :meth:`update`: the next :meth:`metrics` holds ``mpx/underflow/<group>``, ``mpx/zeros/<group>`` and
        ``mpx/headroom_doublings/<group>`` (see :mod:`lightning_mpx.health.telemetry`)."""
        self.telemetry.requested = True

    def metrics(self, reader: str = DEFAULT_READER, *, after_update: bool = False) -> dict[str, torch.Tensor | float]:
        """``mpx/loss_scale``, ``mpx/overflows`` (since ``reader``'s previous call), ``mpx/skipped_steps`` (total) and
        ``mpx/grad_norm`` (unscaled, when computed since), with a ``/loss{id}`` suffix when there are several losses;
        ``mpx/overflow/<module>`` (overflow steps since with non-finite gradients in the module; ``_root``: the root
        module's own parameters); the telemetry measured since a :meth:`request_telemetry`. Device tensors or Python
        numbers: building them does not wait for the device. With ``skip_on_device``, ``mpx/skipped_steps`` and the
        module counts cover the steps read so far (:meth:`read_step_outcomes` first to include the last ones);
        ``mpx/overflows`` is counted on the device and is always current.

        The engine keeps the totals; each ``reader`` (a name: the front doors' loggers read as ``"log"``) keeps only
        its position, so reads never take counts from each other. The positions are in :meth:`state_dict`: after
        :meth:`load_state_dict` a reader's first call reports what its saving run had not read yet (a reader the
        checkpoint does not hold never read: it counts from the start), never what it read there again.

        ``after_update=True``: the scale and the overflow count as the scale update the finished iteration owes will
        leave them, computed on copies (the engine unchanged: :meth:`update` stays due), for a read that may not end
        the iteration yet shows what ending it would (Fabric's under a process group, while another optimizer's step
        may still come). The overflow it counts is not counted again after the update."""
        if not isinstance(reader, str) or not reader:
            raise TypeError(f"reader={reader!r} must be a non-empty str (default {DEFAULT_READER!r}).")
        if not isinstance(after_update, bool):
            raise TypeError(f"after_update={after_update!r} must be a bool (default False).")
        position = self._overflows.reader(reader)
        scalers = self._machine.updated_scalers() if after_update and self.iteration.update_pending else None
        out = self._overflows.metrics(position, self._machine.grad_norms, scalers)  # and mpx/overflow/<module>
        out.update(self.promotion.metrics())
        out.update(self.telemetry.metrics(since=position.measurements))
        position.measurements = self.telemetry.measurements
        return out

    def state_dict(self) -> dict[str, Any]:
        """Scalers, FP32 masters and counters (the overflow totals, and each metrics reader's position): everything
        needed, with the optimizer's own state, to resume (steps skipped on the device are read first)."""
        return self._state_dict()

    def _state_dict(self, shared: Collection[int] = ()) -> dict[str, Any]:
        """:meth:`state_dict`, the masters of the half parameters whose ``id`` is in ``shared`` the live masters, not
        copies: for a front door whose lean entry drops them at once, its model's entry holding them
        (:func:`~lightning_mpx.integrations.fabric_checkpoint.lean_state_dict`); a copy of each would be a model's
        worth of FP32 memory at every save."""
        self.read_step_outcomes()
        state = self._checkpoint.state_dict(shared)
        state["overflow_counts"] = self.forensics.state_dict()
        state["metric_readers"] = self._overflows.readers_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (after :meth:`prepare_model`); masters come back bit-exact. A refused
        checkpoint changes nothing. When every model was prepared with ``train=False`` the checkpoint's masters are
        left out (the half weights come from the model's state dict).

        A checkpoint of another opt level resumes (load the model's state dict first, as the frameworks do): into FP32
        masters (O0/O1/O3 to O2) the masters are the model's weights as loaded (an FP32 checkpoint's exactly); out of
        them (O2 to O0/O1/O3) the checkpoint's masters become the model's parameters (exact where the model is FP32,
        their rounding at O3). A loss scale carries over when both levels scale dynamically; otherwise this level's own
        scaling starts from its settings."""
        self.read_step_outcomes()  # steps made before the load are this run's: counted before it replaces them
        # a bad one is refused before anything is loaded; the modules under the names the tags give them now
        names = self.forensics.loaded_names()
        check_readers_state(_engine_entry(state), names)
        self.pick_half_dtype(None)  # loaded before any model: the provisional dtype is the run's from now on
        self._checkpoint.load_state_dict(state, with_masters=self._with_masters)
        self._machine.forget_writes()  # the load wrote the parameters: no raw step (engine.raw_steps)
        state = _engine_entry(state)
        self._checkpoint.held.loaded(self, state)  # masters left to the model's entry: loaded by the next step?
        self.forensics.load_state_dict(state.get("overflow_counts"), names)  # None (older release): from zero
        self._overflows.load_readers(user_positions(state, names), self.telemetry.measurements)

    def continue_from(self, other: Amp) -> None:
        """Go on from ``other``, an engine with the same settings that this one replaces before it prepares a model
        (``Accelerator.free_memory()``): its loss scales, overflow totals, skipped steps and metrics readers'
        positions, so that the scale curve and the logged counts go on as ``torch.amp.GradScaler`` does across
        Accelerate's own ``free_memory()``. Masters and optimizers are not taken (see ``accelerate_forward``)."""
        _check_engine(other)
        other.read_step_outcomes()
        self._machine.forget_writes()
        other._machine.forget_writes()  # this stage's writes are no raw step of the other's (engine.raw_steps)
        for mine, theirs in zip(self.scalers, other.scalers, strict=True):
            mine.load_state_dict(theirs.state_dict())
        self._overflows.skipped_steps[:] = other._overflows.skipped_steps
        self.forensics.load_state_dict(other.forensics.state_dict())
        self._overflows.load_readers(other._overflows.readers_state(), self.telemetry.measurements)


def _check_engine(other: object) -> None:
    """Raise ``TypeError`` unless ``other`` is an engine (the :class:`~lightning_mpx.engine.amp.Amp`
    :meth:`AmpRecords.continue_from` goes on from)."""
    if not isinstance(other, AmpRecords):
        raise TypeError(
            f"other={other!r} must be a lightning_mpx.Amp: the engine this one replaces (its loss scales and counts "
            "go on here)."
        )
