"""Parameters that leave or join the FP32 masters of a model after they were made (:class:`MasterCover`, a base of
:class:`~lightning_mpx.masters.weights.MasterWeights`): handed over to another engine that prepares the model (a
second stage's new plugin, :mod:`~lightning_mpx.masters.handover`) or made another dtype
(:meth:`~MasterCover.hand_over`; the refusals name them), made FP32 in place (a module promoted to FP32 by
:class:`~lightning_mpx.health.promotion.Promotion`: :meth:`~MasterCover.release`), or set on the model as the clone
of a parameter with a master (an untie: :meth:`~MasterCover.adopt`).
"""

from __future__ import annotations

import weakref
from typing import Callable, Iterable, Iterator

import torch

from lightning_mpx.common.dtypes import HALF_DTYPES
from lightning_mpx.masters.mirror import _CONVERTED, _HANDED_OVER, _Entry
from lightning_mpx.masters.watch import _unwatch_data

__all__ = ["MasterCover"]


class MasterCover:
    """The parameters leaving or joining a :class:`~lightning_mpx.masters.weights.MasterWeights` (the attributes
    below are its own, see it)."""

    _entries: dict[int, _Entry]
    handed: dict[int, tuple[str, weakref.ref[torch.Tensor]]]
    converted: set[int]
    _live: Callable[[], Iterator[tuple[_Entry, torch.Tensor]]]  # the entries whose parameter is alive
    _entry: Callable[[torch.Tensor], _Entry | None]
    _make_master: Callable[[_Entry, torch.Tensor], None]
    fp32_value: Callable[[torch.Tensor], torch.Tensor | None]
    refresh: Callable[..., list[str]]

    def release(self, param: torch.Tensor) -> torch.Tensor | None:
        """Forget the master of ``param``, which has become FP32 in place (a module promoted to FP32): from now on it
        is its own master, as an FP32 parameter is. Returns the master it had (``None`` if none)."""
        entry = self._entry(param)
        if entry is None:
            return None
        master, entry.master = entry.master, None
        _unwatch_data(param)
        return master

    def adopt(self, name: str, param: torch.Tensor, fp32: torch.Tensor) -> None:
        """Cover ``param``, a half parameter set on the model after these masters were made whose values are the
        rounding of ``fp32`` (an untie's clone of a parameter with a master): its master starts from a copy of
        ``fp32``, as the same change made before preparing would have trained it."""
        entry = _Entry(name, param)
        entry.initial = fp32.detach().clone()
        self._entries[id(param)] = entry
        self._make_master(entry, param)

    def hand_over(self, param: torch.Tensor, *, converted: bool = False) -> torch.Tensor | None:
        """Let ``param`` go to another engine that prepares its model (a second stage's new plugin): returns its
        FP32 value (its master itself, no copy; or the value it is kept to be made from), writes made to ``param``
        since the last step taken first. These masters cover it no more, and a step of an optimizer of this engine
        that still holds it raises (:class:`~lightning_mpx.masters.mirror.Mirror` sees the version moved here), so
        that one engine steps it.
        ``converted``: ``param`` was made another dtype (which takes the value), not prepared by another engine;
        the refusals say so (:data:`~lightning_mpx.masters.mirror.CONVERTED_HINT`)."""
        entry = self._entry(param)
        if entry is None:
            return None
        if entry.master is not None:
            self.refresh([param])
        value = self.fp32_value(param)  # its master itself, or the value it is kept to be made from
        del self._entries[id(param)]
        self.handed[id(param)] = entry.name, entry.param
        if converted:
            self.converted.add(id(param))
        entry.master = entry.initial = None
        entry.version = _CONVERTED if converted else _HANDED_OVER
        torch.autograd.graph.increment_version(param)  # this engine's cached step views look at it again
        return value

    def handed_names(self, params: Iterable[torch.Tensor] | None = None) -> list[str]:
        """The names of the parameters (among ``params``; all by default) handed over since (:meth:`hand_over`) that
        still exist."""
        handed = self.handed
        for key in [key for key, (_, ref) in handed.items() if ref() is None]:
            del handed[key]
            self.converted.discard(key)
        if params is None:
            return [name for name, _ in handed.values()]
        return [handed[id(p)][0] for p in params if id(p) in handed and handed[id(p)][1]() is p]

    def converted_names(self, params: Iterable[torch.Tensor]) -> list[str]:
        """Those of :meth:`handed_names` (among ``params``) that were made another dtype rather than taken over."""
        handed = self.handed
        return [handed[id(p)][0] for p in params if id(p) in self.converted and id(p) in handed
                and handed[id(p)][1]() is p]  # fmt: skip

    def holds_half(self) -> bool:
        """Whether a half parameter of the model is still covered (none: every one was handed over, or is gone)."""
        return any(param.dtype in HALF_DTYPES for _, param in self._live())
