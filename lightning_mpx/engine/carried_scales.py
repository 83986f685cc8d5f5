"""The scale that gradients on parameters no registered optimizer holds carry across an update (engine.raw_steps).

An engine backward of a dynamic loss scale leaves gradients scaled by that loss's scale on the parameters no
registered optimizer holds (:class:`~lightning_mpx.engine.raw_steps.UnheldParams`). An update before their optimizer is
registered (a Fabric GAN's read of the scale after D's first step, before G's) must not change what they are unscaled
by: the optimizer registered over them later starts with the loss and the scale of the backward that last made or added
to each, for those still as that backward left them (:meth:`CarriedScales.settle`).

The cost sits where it is rare. A backward records, with C-level maps only (no Python call per parameter), the
gradients it made or added to (a weak reference and a version each: nothing here keeps a gradient alive); an update
gives the records since the last one a copy of their loss's scale (one per loss, none when nothing is recorded); only
:meth:`CarriedScales.settle`, where an optimizer is registered late, looks at each parameter. A record none of whose
gradients is still as it left it is dropped at the next backward. Static scales never move: nothing is recorded.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from typing import Any, Sequence

import torch

__all__ = ["CarriedScales"]

_VERSION = operator.attrgetter("_version")
_DEREF = weakref.ref.__call__  # a weak reference's referent, or None (C-level, for map)
_REFS, _VERSIONS = itertools.repeat("_version"), itertools.repeat(-1)  # getattr(None, "_version", -1): freed


class CarriedScales:
    """What the backwards of dynamic losses left on the unheld parameters, and the scale each record carries.

    ``marks``: at the last recording backward, each gradient by its parameter's id (weak references, versions);
    ``records``: ``[loss_id, ids, references, versions, scale]`` per backward, for the gradients it made or added to,
    ``scale`` being ``None`` until the next update (``pending``: those records).
    """

    def __init__(self) -> None:
        self.marks: tuple[dict[int, weakref.ref[torch.Tensor]], dict[int, int]] = ({}, {})
        self.records: list[list[Any]] = []
        self.pending: list[list[Any]] = []

    def note(self, params: Sequence[torch.Tensor], grads: Sequence[Any], had: Sequence[bool], loss_id: int) -> None:
        """At the end of a backward of dynamic loss ``loss_id``: record the gradients it made or added to (those not
        as the last recording backward left them). ``grads``/``had``: each parameter's gradient, whether it has one."""
        with torch._C.DisableTorchFunction():  # C-level maps
            ids = tuple(itertools.compress(map(id, params), had))
            present = tuple(itertools.compress(grads, had))
            refs = tuple(map(weakref.ref, present))  # the one basic reference each tensor has: `is` tells them apart
            versions = tuple(map(_VERSION, present))
            old_refs, old_versions = self.marks
            changed = tuple(map(operator.or_, map(operator.is_not, refs, map(old_refs.get, ids)),
                                map(operator.ne, versions, map(old_versions.get, ids))))  # fmt: skip
            self.marks = dict(zip(ids, refs)), dict(zip(ids, versions))
            if not any(changed):
                return
            live = []
            for record in self.records:  # those with a gradient still as it was recorded (no call per record)
                if any(map(operator.eq, map(getattr, map(_DEREF, record[2]), _REFS, _VERSIONS), record[3])):
                    live.append(record)
            compress = itertools.compress
            record = [loss_id, tuple(compress(ids, changed)), tuple(compress(refs, changed)),
                      tuple(compress(versions, changed)), None]  # fmt: skip
        live.append(record)
        self.records = live
        self.pending.append(record)

    def carry(self, scalers: Sequence[Any]) -> None:
        """At an update, before the scalers move: the records since the last update take a copy of their loss's scale
        (``scalers``: the engine's; one copy per loss)."""
        pending, self.pending = self.pending, []
        scales: dict[int, torch.Tensor] = {}
        for record in pending:
            scale = scales.get(record[0])
            if scale is None:
                scale = scales[record[0]] = scalers[record[0]].scale_tensor.clone()
            record[4] = scale

    def settle(self, state: Any, params: Sequence[torch.Tensor]) -> None:
        """Where an optimizer over ``params`` is registered: the loss and the scale that the gradients on them carry
        across an update become its state's (``loss_id``, ``grad_scale``), so its first step unscales them by the scale
        they were computed with. (Parameters carrying several losses' gradients: the last one's.) The last record of a
        parameter decides, whatever was done to its gradient since without an engine backward (scaled in place,
        replaced by a copy: still at the scale it was computed with, as a registered optimizer's pending gradients keep
        theirs); a gradient cleared and computed again by an engine backward has a later record."""
        records = self.records
        if not any(record[4] is not None for record in records):
            return
        for param in params:
            key = id(param)
            if param.grad is None:
                continue
            for loss_id, ids, _refs, _versions, scale in reversed(records):
                if key in ids:
                    if scale is not None:  # else computed since the last update: at the scale the state reads
                        state.loss_id, state.grad_scale = loss_id, scale
                    break

    def last_loss(self, param: torch.Tensor) -> tuple[int, torch.Tensor | None] | None:
        """The loss of the last recorded backward that made or added to ``param``'s gradient and the scale it carries
        across an update (``None``: computed since the last update, at that loss's scale now); ``None`` when no
        record holds it. As :meth:`settle` reads it, for one parameter."""
        key = id(param)
        for loss_id, ids, _refs, _versions, scale in reversed(self.records):
            if key in ids:
                return loss_id, scale
        return None
