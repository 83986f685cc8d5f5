"""Raw-step refusals (engine.raw_steps) decided from gradients that a DDP backward did not synchronise, kept until the
step, where the ranks meet.

Under DDP the raw-step checks decide from the gradients each rank holds. After a synchronised backward every rank
holds the same ones, and the ranks decide alike at the next backward. Under ``no_sync`` (``fabric.no_backward_sync``,
Accelerate's ``accumulate``, the Trainer's ``accumulate_grad_batches``) each rank holds its own: a parameter only one
rank's forward used has a gradient on that rank alone, and a raw step that one rank refuses another may let pass (a
gradient kept beside the written ones), or never see (its raw optimizer wrote nothing there): the refusing rank raised
and the others went on into the next all-reduce, a hang. No rule from one rank's view decides alike in every case.

So after a backward that DDP did not synchronise, with no engine step since, a refusal is not raised at the backward:
the machine keeps it (``machine.refused``) until the next step, where every rank meets in the all-reduce of the
overflow flags (``found_inf_reducer``): the rank that keeps one sets its flags (every rank skips the step, nothing is
written), and the overflow records gathered across ranks carry it (:func:`raise_refusals`), so every rank raises it
there. Without a reducer (the core ``Amp`` under DDP with none set) the rank raises it at its step.

The DDP wrappers around the prepared models are found at their first forward: a forward pre-hook on each submodule that
holds parameters reads ``DistributedDataParallel``'s active module there (set while a wrapper's forward runs), and the
hooks are taken off at the engine's next backward (:meth:`DdpWatch.settle`; a copy of the model made before it drops
its own at its first forward): nothing per step after it. A model whose forward has not run by then on this rank (a
model used in some iterations only: uneven batches) keeps its hooks until the backward after its first forward, so that
every rank finds its wrapper. A later set-up of the same models (a second
``trainer.fit``, which wraps them in a new DDP) watches them again. Whether a
backward runs unsynchronised is read from the wrappers at each engine backward (:func:`synced`): ``no_sync`` active, or
the reducer not prepared: DDP's flag off now (the Trainer's ``manual_backward`` sets it again after a
``training_step`` forward) and the wrapper's last forward with grad enabled ran under ``no_sync`` (noted by a forward
hook put on each wrapper met, :class:`SyncNote`: a ``torch.no_grad()`` forward on one rank alone, which clears DDP's
own flag, changes nothing).
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Sequence

import torch
from torch import nn

__all__ = ["DdpWatch", "SyncNote", "raise_refusals", "synced", "watch_ddp"]


class DdpWatch:
    """One-shot forward pre-hooks (this object itself) on the prepared models' submodules that hold parameters, noting
    the DDP wrappers whose forward runs them (``machine.ddp``: weak references). A model's are taken off at its
    forward through a DDP wrapper, or else at the engine's first backward after its forward ran (:meth:`settle`),
    whether or not a wrapper was found (a model under DDP goes through its wrapper's forward). A copy of a model made
    meanwhile (``copy.deepcopy``, ``AveragedModel``) shares it and an unpickled one gets an inert one: there (a module
    it never watched), and wherever it runs once settled, it takes itself off the module at its first call."""

    def __init__(self, machine: Any) -> None:
        self._machine = weakref.ref(machine) if machine is not None else None
        self._handles: dict[int, list[Any]] = {}  # by the id of the watched model
        self._models: dict[int, tuple[int, ...]] = {}  # a watched submodule's id: the ids of the models holding it
        self._ran: set[int] = set()  # the watched models whose forward ran since they were watched

    def __reduce__(self) -> tuple[Any, ...]:
        return (DdpWatch, (None,))  # inert: takes itself off at its first call

    def __deepcopy__(self, memo: dict[int, Any]) -> DdpWatch:
        return self

    def add(self, modules: Iterable[nn.Module]) -> None:
        """Watch the forwards of ``modules``' submodules that hold parameters."""
        for module in modules:
            subs = [sub for sub in module.modules() if any(True for _ in sub.parameters(recurse=False))]
            self._handles[id(module)] = [sub.register_forward_pre_hook(self) for sub in subs]
            for sub in subs:
                self._models[id(sub)] = (*self._models.get(id(sub), ()), id(module))

    def __call__(self, module: nn.Module, args: Any) -> None:
        machine = self._machine() if self._machine is not None else None
        models = self._models.get(id(module))  # None: a copy's (deepcopy, AveragedModel), made before it settled
        if machine is None or machine.ddp_watch is not self or models is None:  # settled, a copy, an unpickled model
            for key in [key for key, hook in module._forward_pre_hooks.items() if hook is self]:
                del module._forward_pre_hooks[key]
            return
        self._ran.update(models)
        wrapper = _active_ddp()
        if wrapper is None:
            return
        if all(ref() is not wrapper for ref in machine.ddp):  # those of an earlier set-up gone
            machine.ddp = (*(ref for ref in machine.ddp if ref() is not None), weakref.ref(wrapper))
            # whether its forwards with grad enabled prepare a synchronised backward (SyncNote); this one's as its
            # _post_forward will set it, the hook taking the next ones
            if torch.is_grad_enabled():
                machine.ddp_synced[id(wrapper)] = bool(wrapper.require_backward_grad_sync)
            wrapper.register_forward_hook(SyncNote(machine))
        if len(models) == 1:  # its wrapper met: its hooks are done (a model evaluated after the last backward)
            for handle in self._handles.pop(models[0], ()):
                handle.remove()

    def settle(self) -> frozenset[int]:
        """Take the hooks off the models whose forward ran (at the engine's backward: their wrappers, if any, were met
        by then). A model whose forward has not run yet (on this rank: uneven batches, a model used in some iterations
        only) keeps its hooks until a backward after its first forward: taken off at the first backward, its wrapper
        would be known to the ranks that ran it only, which would then keep a refusal that the others raise at once
        (the ranks part). Returns the ids of the models still watched."""
        for model in [model for model in self._handles if model in self._ran]:
            for handle in self._handles.pop(model):
                handle.remove()
        self._ran.clear()
        return frozenset(self._handles)


class SyncNote:
    """A forward hook on a DDP wrapper met by :class:`DdpWatch`: after each of its forwards with grad enabled, whether
    that forward prepared DDP's reducer for a synchronised backward (the wrapper's ``require_forward_param_sync``, which
    its ``_post_forward`` has just set), kept in ``machine.ddp_synced`` by the wrapper's id. The flag itself is cleared
    by a ``torch.no_grad()`` forward too (a look at a sample on one rank alone), which prepares nothing and leaves the
    coming backward synchronised: read at the backward, it would part the ranks (one keeping a refusal for the step
    that the others raise at once). A call per forward of a DDP wrapper, only under DDP."""

    def __init__(self, machine: Any) -> None:
        self._machine = weakref.ref(machine) if machine is not None else None

    def __reduce__(self) -> tuple[Any, ...]:
        return (SyncNote, (None,))  # a pickled wrapper's copy notes nothing

    def __deepcopy__(self, memo: dict[int, Any]) -> SyncNote:
        return self

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled() and self._machine is not None:
            machine = self._machine()
            if machine is not None:
                machine.ddp_synced[id(module)] = bool(module.require_forward_param_sync)


def synced(wrapper: nn.Module, noted: dict[int, bool]) -> bool:
    """Whether the coming backward through ``wrapper`` (a DDP wrapper) all-reduces: DDP's ``no_sync`` not active, and
    the reducer prepared: the wrapper's flag set now (by its last forward, or by the Trainer's ``manual_backward``,
    whose ``prepare_for_backward`` sets it after a ``training_step`` forward that left it off), or else set by its last
    forward with grad enabled (``noted``: :class:`SyncNote`'s, by id). Alike on every rank that ran the same forwards
    with grad, whatever forwards under ``torch.no_grad()`` one rank ran alone (which clear the flag)."""
    if not wrapper.require_backward_grad_sync:
        return False
    return bool(wrapper.require_forward_param_sync) or noted.get(id(wrapper), False)


def watch_ddp(modules: Sequence[nn.Module], machine: Any) -> None:
    """Under a process group of several ranks, watch the forwards of those of ``modules`` (the prepared models, not
    sharded) not watched yet until the engine's next backward, for DDP wrappers around them (:class:`DdpWatch`);
    nothing otherwise (called when the models or the registrations change: never per step)."""
    new = [module for module in modules if id(module) not in machine.ddp_watched]
    dist = torch.distributed
    if not new or not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    machine.ddp_watched = machine.ddp_watched | frozenset(map(id, new))
    if machine.ddp_watch is None:
        machine.ddp_watch = DdpWatch(machine)
    machine.ddp_watch.add(new)


def raise_refusals(refusals: Sequence[str | None], rank: int) -> None:
    """Raise on every rank the refusals the ranks kept (``refusals``, by rank, gathered with their overflow records
    at a step they all skipped for it): this rank's own, or the first other rank's."""
    if not any(refusals):
        return
    own = refusals[rank] if rank < len(refusals) else None
    if own:
        raise RuntimeError(own)
    other, message = next((r, m) for r, m in enumerate(refusals) if m)
    raise RuntimeError(
        f"on rank {other} (refused on every rank at this step, where the ranks meet: the backward before it was not "
        f"synchronised by DDP, so each rank held its own gradients): {message}"
    )


def _active_ddp() -> Any:
    """The ``DistributedDataParallel`` whose forward runs now, if any."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel._active_ddp_module
