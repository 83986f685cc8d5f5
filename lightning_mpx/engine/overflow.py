"""Overflow steps, told to the user: :class:`Overflows` records each (with the forensics), counts it, logs it
(throttled) and hands it to the floor's policy; the gradients to examine and the floor hint are here too.

The counts are totals, owned here (the scalers' per loss, the forensics' per module) and saved with the engine; each
reader of the metrics (:class:`MetricsReader`: a user's ``Amp.metrics()``, a front door's logger) owns only its
position, the totals at its previous read, and reports their growth since, so no read takes counts from another.

The record of an overflow itself is built by :class:`~lightning_mpx.health.forensics.OverflowForensics`; what is here is
what the step (:class:`~lightning_mpx.engine.optimizer_step.OptimizerStep`) hands it and how the result is logged.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from lightning_mpx.common.containers import read_floats
from lightning_mpx.engine.optimizer_state import optimizer_params
from lightning_mpx.engine.sharding import local_tensor
from lightning_mpx.engine.unsynced import raise_refusals
from lightning_mpx.health.forensics import FIRST_TAG, OVERFLOW_TAG, ROOT_TAG, OverflowForensics, OverflowRecord
from lightning_mpx.scaling.scaler import LossScaler

if TYPE_CHECKING:
    from lightning_mpx.health.promotion import Promotion

log = logging.getLogger("lightning_mpx")

MasterOf = Callable[[torch.Tensor], torch.Tensor]

#: The reader of ``Amp.metrics()`` when the call names none (a core loop, a callback, ``mpx.metrics()`` in Fabric).
DEFAULT_READER = "default"


def overflows_name(loss_id: int, num_losses: int) -> str:
    """The metric name of ``loss_id``'s overflow count: ``mpx/overflows``, suffixed ``/loss{id}`` when there are
    several losses."""
    return "mpx/overflows" + (f"/loss{loss_id}" if num_losses > 1 else "")


def check_readers_state(state: Any, names: Callable[[str], str] = str) -> None:
    """Refuse an engine checkpoint ``state`` whose ``metric_readers`` :meth:`Overflows.readers_state` did not make
    (before anything is loaded): each reader a non-empty ``str`` (as :meth:`Amp.metrics
    <lightning_mpx.engine.amp.Amp.metrics>` takes), each count a ``str`` with a whole number in int64's range. None
    (a checkpoint of a release that saved none) is fine. ``names``: the tags' name of a module the checkpoint counted
    (:meth:`~lightning_mpx.health.forensics.OverflowForensics.loaded_names`, :func:`user_positions`)."""
    saved = user_positions(state, names)
    if saved is None:
        return
    bad = None if isinstance(saved, Mapping) else saved
    for reader, position in saved.items() if bad is None else ():
        if not isinstance(reader, str) or not reader or not isinstance(position, Mapping):
            bad = {reader: position}
            break
        wrong = [(c, v) for c, v in position.items() if not isinstance(c, str) or not _whole_count(v)]
        if wrong:
            bad = {reader: dict(wrong)}
            break
    if bad is not None:
        raise TypeError(
            f"the checkpoint's metric_readers entry {bad!r:.200} must map each reader's name (a non-empty str) to its "
            "counts' totals (str: a whole number in int64's range), as Amp.state_dict() saves them."
        )
    totals, complete = _saved_totals(state, names)
    for reader, position in saved.items():
        for count, value in position.items():
            total = totals.get(count, 0 if complete else None)
            if total is not None and value > total:
                raise ValueError(
                    f"the checkpoint's metric_readers entry for reader {reader!r:.100} holds {count}={value:g}, above "
                    f"the checkpoint's total {total} (positions from another checkpoint, or edited by hand): its reads "
                    "would report negative counts. Save the engine again, or drop the checkpoint's metric_readers "
                    "entry to count every reader from the loaded totals; nothing was loaded."
                )


def user_positions(state: Any, names: Callable[[str], str] = str) -> Any:
    """The ``metric_readers`` entry of an engine checkpoint ``state`` with its module counts under the tags that the
    engine gives them now (``names``: the tags' name of a module the checkpoint counted,
    :meth:`~lightning_mpx.health.forensics.OverflowForensics.loaded_names`): a checkpoint written before
    stop 70 named a data-parallel model's modules ``module.<name>`` in its tags, whose readers' positions would
    otherwise not be found (the first read reported the loaded totals once more). Anything malformed is returned as
    it is, for :func:`check_readers_state` to refuse."""
    saved = state.get("metric_readers") if isinstance(state, Mapping) else None
    kept = state.get("overflow_counts") if isinstance(state, Mapping) else None
    if names is str or not isinstance(saved, Mapping) or not isinstance(kept, Mapping):
        return saved
    renamed: dict[str, str] = {}
    for key, prefix in (("modules", OVERFLOW_TAG), ("first", FIRST_TAG)):
        counts = kept.get(key)
        for module in counts if isinstance(counts, Mapping) else ():
            old, new = prefix + (str(module) or ROOT_TAG), prefix + (names(str(module)) or ROOT_TAG)
            if old != new:
                renamed[old] = new
    if not renamed:
        return saved
    out: dict[Any, Any] = {}
    for reader, position in saved.items():
        if isinstance(position, Mapping):
            position = dict(position)
            for old, new in renamed.items():
                if old in position:
                    value = position.pop(old)
                    position.setdefault(new, value)  # (a checkpoint of this release holds the new tag itself)
        out[reader] = position
    return out


def _saved_totals(state: Mapping[str, Any], names: Callable[[str], str] = str) -> tuple[dict[str, int], bool]:
    """The totals an engine checkpoint ``state`` holds, by metric name (each loss's overflows, the forensics' module
    counts under the tags of ``names``: :func:`user_positions`), and whether it holds every one (a count absent is 0):
    not when it kept no module totals (an older release's)."""
    scalers = state.get("scalers")
    scalers = scalers if isinstance(scalers, list) else []
    out = {
        overflows_name(i, len(scalers)): int(s["overflows"])
        for i, s in enumerate(scalers)
        if isinstance(s, Mapping) and _whole_count(s.get("overflows"))
    }
    kept = state.get("overflow_counts")
    if not isinstance(kept, Mapping):
        return out, False
    complete = len(out) == len(scalers)
    for key, prefix in (("modules", OVERFLOW_TAG), ("first", FIRST_TAG)):
        counts = kept.get(key) or {}
        for module, count in counts.items() if isinstance(counts, Mapping) else ():
            if _whole_count(count):
                tag = prefix + (names(str(module)) or ROOT_TAG)
                out[tag] = out.get(tag, 0) + int(count)
    return out, complete


def _whole_count(value: Any) -> bool:
    """Whether ``value`` can be a count's total: a whole number in int64's range (a float of one too; below 0: a
    module's position upgraded from a release that kept no module totals, :func:`upgrade_unlogged
    <lightning_mpx.integrations.metric_counts.upgrade_unlogged>`)."""
    if isinstance(value, float):
        return value.is_integer() and -(2.0**63) <= value < 2.0**63
    return isinstance(value, int) and -(2**63) <= value < 2**63


class MetricsReader:
    """One reader's position in an engine's metrics: each count's total at its previous read (the growth since is
    what its next read reports), the gradient norms it reported (a norm is reported once per reader) and the
    telemetry measurements it has seen.

    Args:
        counts: The totals to count from (absent names: 0).
        measurements: The telemetry measurements made before (``GradTelemetry.measurements``).
    """

    def __init__(self, counts: Mapping[str, torch.Tensor | int] | None = None, measurements: int = 0) -> None:
        self.counts: dict[str, torch.Tensor | int] = dict(counts or {})
        self.norms: dict[int, torch.Tensor] = {}  # the norm tensor each loss had at the previous read (by identity)
        self.measurements = measurements


class OverflowLog:
    """The overflow messages of one engine, at most one per ``interval`` seconds (the ones in between are counted
    and reported with the next).

    Args:
        interval: Minimum seconds between two messages (``overflow_log_interval``).

    Attributes:
        enabled: Whether messages are logged (the adapters turn it off on ranks other than zero).
    """

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.enabled = True
        self._last = -float("inf")
        self._suppressed = 0

    def log(
        self,
        names: list[str],
        loss_ids: list[int],
        scalers: Sequence[LossScaler],
        record: OverflowRecord | None,
        scales: Mapping[int, float] | None = None,
        *,
        gathered: bool = False,
        shared: bool = False,
    ) -> None:
        """Log one overflow step: the scales of ``loss_ids`` (``scales``: as they were at the step, when the step is
        read after it was taken, skipped on the device), the parameters ``names`` and the ``record``; ``gathered``:
        the flag was reduced across processes; ``shared``: charged by ``Amp.share_overflow``."""
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < self.interval:
            self._suppressed += 1
            return
        suppressed = self._suppressed
        self._last, self._suppressed = now, 0
        shown_scales = ", ".join(
            f"loss {i}: {scales[i] if scales is not None else scalers[i].get_scale():g}" for i in sorted(loss_ids)
        )
        shown = ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")
        log.info(
            "Gradient overflow: step skipped (scale before update %s); non-finite gradients in %s%s%s",
            shown_scales,
            shown or _nameless(late=scales is not None, gathered=gathered, shared=shared),
            f"; {record.describe()}" if record is not None else "",
            f"; {suppressed} earlier overflow message(s) suppressed" if suppressed else "",
        )


def _nameless(*, late: bool, gathered: bool, shared: bool = False) -> str:
    """Why an overflow's log names no parameter: its flag came from another process or another optimizer
    (``shared``), or (a step skipped on the device, read later) the gradients were cleared or overwritten before the
    read."""
    if shared and not late:
        return "no parameter of this optimizer (skipped with the optimizers of an overflowing loss: share_overflow)"
    if shared:
        return (
            "no parameter of this optimizer (skipped with the optimizers of an overflowing loss: share_overflow; or "
            "its gradients were cleared before this step's outcome was read)"
        )
    if not late:
        return "no parameter (flag set by another process)"
    cleared = (
        "the gradients were cleared before this step's outcome was read (skip_on_device reads it later; use the "
        "StepOutcome before zero_grad(), or diagnose_overflows=True, to name them)"
    )
    return f"no parameter ({'flag set by another process, or ' if gathered else ''}{cleared})"


def named_grads(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], master_of: MasterOf
) -> list[tuple[str, torch.Tensor]]:
    """(name, gradient) of the optimizer's parameters that have one (the master's where the model's is gone)."""
    candidates = []
    for index, param in enumerate(optimizer_params(optimizer)):
        grad = param.grad if param.grad is not None else master_of(param).grad
        if grad is not None:  # under FSDP, this rank's shard (the records of all ranks are merged)
            candidates.append((names.get(id(param), f"param{index}"), local_tensor(grad)))
    return candidates


def floor_hint(optimizer: torch.optim.Optimizer, master_of: MasterOf, opt_level: str) -> str | None:
    """The likely cause of a floor error that is not the loss: an Adam ``eps`` that the half optimizer state
    cannot hold (O3, or any half model without FP32 masters: AdamW's default 1e-8 is 0 in float16)."""
    if "adam" not in type(optimizer).__name__.lower():
        return None
    for group in optimizer.param_groups:
        eps = group.get("eps")
        stepped = [master_of(p) for p in group["params"]]  # at O2 the FP32 masters, not the half model
        half = [p.dtype for p in stepped if p.dtype in (torch.float16, torch.bfloat16)]
        if not half or not isinstance(eps, (int, float)) or isinstance(eps, bool):
            continue
        tiny = torch.finfo(half[0]).tiny  # the smallest normal number
        if eps < tiny:
            shown = "0" if torch.tensor(eps, dtype=half[0]).item() == 0 else "a subnormal"
            return (
                f"The likely cause is {type(optimizer).__name__}'s eps={eps:g}, which is {shown} in {half[0]} "
                f"(smallest normal {tiny:g}): with half parameters and no FP32 master weights (opt_level="
                f"{opt_level!r}) the optimizer state is half too, and the update divides by "
                f"sqrt(v) + eps, where both underflow to 0 for small gradients: the weights become inf/NaN. Use "
                f"opt_level='O2' (FP32 masters and optimizer state), half_dtype='bfloat16', or a larger eps such "
                f"as 1e-4"
            )
    return None


class Overflows:
    """The overflow steps of one engine: recorded, counted by loss, logged, and handed to the floor's policy.

    Args:
        scalers: The engine's loss scalers (read; their floor policy is applied here).
        forensics: The engine's overflow forensics, which builds the records.
        promotion: The engine's promotion (``on_floor="promote"``).
        interval: Minimum seconds between two log messages (``overflow_log_interval``).
        master_of: The FP32 master of a model parameter (the parameter itself when it has none), for the floor's
            hint.
        opt_level: The engine's opt level, for the floor's hint.

    Attributes:
        log: The throttled :class:`OverflowLog`.
        skipped_steps: Steps skipped so far, by loss.
        last: The record of the latest overflow step (``None`` before the first).
        last_parameters: This process's parameters with non-finite gradients at that step.
        readers: The metrics' readers by name (:data:`DEFAULT_READER` always), each with its position.
    """

    def __init__(
        self,
        scalers: Sequence[LossScaler],
        forensics: OverflowForensics,
        promotion: Promotion,
        interval: float,
        *,
        master_of: MasterOf,
        opt_level: str,
    ) -> None:
        self.scalers, self.forensics, self.promotion = scalers, forensics, promotion
        self.master_of, self.opt_level = master_of, opt_level
        self.log = OverflowLog(interval)
        self.skipped_steps: list[int] = [0] * len(scalers)
        self.last: OverflowRecord | None = None
        self.last_parameters: list[str] = []
        self.readers: dict[str, MetricsReader] = {DEFAULT_READER: MetricsReader()}
        self._start = MetricsReader()  # where a reader made later starts: zero, or the totals of the last load
        self._last_iteration: int | None = None  # the engine's iteration of ``last``

    def record(
        self,
        optimizer: torch.optim.Optimizer,
        overflowed: list[int],
        *,
        names: Mapping[int, str],
        master_of: MasterOf,
        step: int,
        gather: bool,
        iteration: int,
        shared: bool = False,
        scales: Mapping[int, float] | None = None,
        refused: str | None = None,
    ) -> list[str]:
        """:meth:`examine` then :meth:`settle` an overflow step of ``optimizer`` at once (the step read on the
        host). Returns this process's non-finite parameter names."""
        local = self.examine(optimizer, overflowed, names=names, master_of=master_of, step=step, scales=scales)
        return self.settle(
            local, overflowed, gather=gather, iteration=iteration, shared=shared, scales=scales, refused=refused
        )

    def examine(
        self,
        optimizer: torch.optim.Optimizer | None,
        overflowed: list[int],
        *,
        names: Mapping[int, str],
        master_of: MasterOf,
        step: int,
        scales: Mapping[int, float] | None = None,
    ) -> OverflowRecord:
        """What this process alone does for an overflow step, whenever it learns of it (never a collective: rank 0
        may do it alone, to log): build its record from the gradients there now, count the skipped step and the
        record's modules. ``scales``: each overflowed loss's scale at the step, when the step is read after an update
        may have changed it (a step skipped on the device); ``optimizer=None``: dropped since, a record without
        parameters. Returns the record, for :meth:`settle`."""
        dist = torch.distributed
        distributed = dist.is_available() and dist.is_initialized()
        local = self.forensics.build(
            named_grads(optimizer, names, master_of) if optimizer is not None else [],
            step=step,
            loss_ids=overflowed,
            scales=[
                self.scalers[i].scale_tensor if scales is None else torch.tensor(scales[i], dtype=torch.float32)
                for i in overflowed
            ],
            rank=dist.get_rank() if distributed else 0,
        )
        for loss_id in overflowed:
            self.skipped_steps[loss_id] += 1
        self.forensics.count(local.modules)
        return local

    def settle(
        self,
        local: OverflowRecord,
        overflowed: list[int],
        *,
        gather: bool,
        iteration: int,
        shared: bool = False,
        scales: Mapping[int, float] | None = None,
        refused: str | None = None,
    ) -> list[str]:
        """The rest of an overflow step, from this process's ``local`` record (:meth:`examine`): merged across
        ranks when ``gather`` (a collective: every rank calls this together, on the same step, which holds when
        the flags were reduced across them), counted where other ranks add modules, logged; at the floor, watch
        the next forwards. Returns this process's non-finite parameter names. ``refused``: a raw-step refusal this
        rank kept for this step (engine.unsynced), gathered with the records and raised on every rank.

        A record that names no parameter on any rank does not replace one of the same ``iteration`` (the engine's
        ``update()`` count) and losses that names some: an optimizer skipped with the others of an overflowing loss
        (:meth:`Amp.share_overflow <lightning_mpx.engine.amp.Amp.share_overflow>`, Apex's ``scale_loss`` over several
        optimizers) holds finite gradients, and the overflow is where the other one's record says. ``shared``: the
        optimizer's overflow was charged to it so (the log of a record naming nothing then says so)."""
        if gather:
            merged, refusals = self.forensics.gather_noted(local, refused)
            raise_refusals(refusals, local.rank)
        else:
            merged = local
        last = self.last
        named_before = self._last_iteration == iteration and last is not None and bool(last.parameters)
        # ... and the same losses' overflow: a nameless record of another loss is an overflow of its own
        kept = named_before and not merged.parameters and set(overflowed) <= set(last.loss_ids)  # type: ignore[union-attr]
        if not kept:  # a shared skip was recorded and logged with the parameters of the optimizer that overflowed
            self.last, self._last_iteration = merged, iteration
            self.last_parameters = list(local.parameters)
        floor = any(self._at_floor(i, scales) for i in overflowed)
        self.forensics.overflowed(merged, at_floor=floor, counted=local.modules)
        if not kept:
            log = self.log.log
            log(self.last_parameters, overflowed, self.scalers, self.last, scales, gathered=gather, shared=shared)
        return list(local.parameters)

    def at_floor(
        self,
        optimizer: torch.optim.Optimizer,
        overflowed: list[int],
        scales: Mapping[int, float] | None = None,
    ) -> None:
        """Apply the floor policy of the losses that overflowed (promote, raise with :func:`floor_hint`'s hint, or
        warn); ``scales`` as in :meth:`record`."""
        hint = floor_hint(optimizer, self.master_of, self.opt_level)
        if self.scalers[overflowed[0]].on_floor == "promote" and any(self._at_floor(i, scales) for i in overflowed):
            why_not = self.promotion.floor_overflow(self.last)
            if why_not is None:
                return  # promoted (or waiting for the next overflow's evidence): training goes on
            hint = why_not + (f". {hint}" if hint else "")
        for loss_id in overflowed:
            self.scalers[loss_id].handle_overflow(
                self.last_parameters, hint=hint, scale=None if scales is None else scales[loss_id]
            )

    def _at_floor(self, loss_id: int, scales: Mapping[int, float] | None) -> bool:
        """Whether ``loss_id``'s scale was at its floor at the step (``scales``) or is now (read on the device)."""
        scaler = self.scalers[loss_id]
        if scales is None:
            return scaler.at_floor()
        return not scaler.dynamic or scales[loss_id] <= scaler.min_loss_scale

    def reader(self, name: str) -> MetricsReader:
        """The reader ``name`` (made at its first use: its first read counts from the start of the run, or from the
        totals of the checkpoint loaded last)."""
        reader = self.readers.get(name)
        if reader is None:
            reader = self.readers[name] = MetricsReader(self._start.counts, self._start.measurements)
        return reader

    def metrics(
        self,
        reader: MetricsReader,
        grad_norms: Mapping[int, torch.Tensor],
        scalers: Sequence[LossScaler] | None = None,
    ) -> dict[str, torch.Tensor | float]:
        """Each loss's ``mpx/loss_scale``, ``mpx/overflows`` (since ``reader``'s previous read), ``mpx/skipped_steps``
        and ``mpx/grad_norm`` (from ``grad_norms``, when ``reader`` has not reported it yet), suffixed ``/loss{id}``
        when there are several losses, then the forensics' module counts (since ``reader``'s previous read); moves
        ``reader`` to now. ``scalers``: the scale and overflow count read from these (the engine's scalers as the
        pending update will leave them) instead of the engine's. Device tensors or Python numbers: no device read."""
        out: dict[str, torch.Tensor | float] = {}
        counts = reader.counts
        scalers = self.scalers if scalers is None else scalers
        for loss_id, scaler in enumerate(scalers):
            suffix = f"/loss{loss_id}" if len(scalers) > 1 else ""
            name, total = overflows_name(loss_id, len(scalers)), scaler.overflow_count
            out["mpx/loss_scale" + suffix] = scaler.scale_tensor.clone()
            # A read of the updated copies moved the position past the engine's count until its update: nothing is
            # counted twice, nor below zero. (A new tensor: the scaler counts in place.)
            position = counts.get(name, 0)
            counts[name] = total = total.clamp(min=position)
            out[name] = total - position
            out["mpx/skipped_steps" + suffix] = float(self.skipped_steps[loss_id])
            norm = grad_norms.get(loss_id)
            if norm is not None and reader.norms.get(loss_id) is not norm:
                out["mpx/grad_norm" + suffix] = reader.norms[loss_id] = norm
        totals = self.forensics.totals()
        for name in [*totals, *(n for n in counts if n not in totals and n not in out)]:
            # (a name only the position holds: a module counted by a checkpoint of a release that kept no totals)
            count = totals.get(name, 0)
            out[name] = float(count - counts.get(name, 0))
            counts[name] = count
        return out

    def readers_state(self) -> dict[str, dict[str, int]]:
        """Each reader's position (its counts' totals at its previous read) as Python numbers, for the engine's
        checkpoint: one host read for all of them."""
        flat = {f"{name}\0{count}": value for name, r in self.readers.items() for count, value in r.counts.items()}
        read = read_floats(flat)
        out: dict[str, dict[str, int]] = {name: {} for name in self.readers}
        for key, value in read.items():
            name, count = key.rsplit("\0", 1)  # (no metric name holds a NUL; a reader's name might)
            out[name][count] = int(value)
        return out

    def load_readers(self, saved: Mapping[str, Any] | None, measurements: int) -> None:
        """After a checkpoint's totals are loaded: each reader it saved (:meth:`readers_state`) counts on from its
        position there, so its first read reports what its saving run had not read yet; the others, and readers made
        later, count from the start of the run (a checkpoint of this release: they never read) or from the loaded
        totals (an older release's, whose readers read them). ``measurements``: the telemetry's count now."""
        check_readers_state({"metric_readers": saved})
        totals: dict[str, torch.Tensor | int] = {
            overflows_name(i, len(self.scalers)): s.overflow_count.clone() for i, s in enumerate(self.scalers)
        }
        totals.update(self.forensics.totals())
        # A checkpoint of this release holds every reader its run had (the default one always): one it does not hold
        # never read, and counts from the start as it would have in one uninterrupted run (a run without a logger
        # resumed into one with a logger: its first log holds the overflows that ``mpx/skipped_steps`` counts). One
        # of an older release (or upgraded from it, with the door's reader only) counted for readers it did not save.
        self._start = MetricsReader({} if saved is not None and DEFAULT_READER in saved else totals, measurements)
        saved = saved or {}
        # A count this load did not carry over (a scale of another half dtype or opt level, not taken: it counts
        # afresh) is below the saved positions: they count from the loaded total instead, not from above it.
        loaded = read_floats(totals) if saved else {}  # one host read, at a load
        self.readers = {
            name: MetricsReader(
                {c: min(int(v), int(loaded.get(c, 0))) for c, v in saved[name].items()}
                if name in saved
                else self._start.counts,
                measurements,
            )
            for name in dict.fromkeys([*self.readers, *saved])
        }
