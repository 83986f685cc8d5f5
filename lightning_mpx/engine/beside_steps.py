"""A raw optimizer stepped in the same iteration as a prepared one: a head's optimizer never given to lightning_mpx
(``fabric.setup``, ``configure_optimizers``, ``accelerator.prepare``, ``amp.prepare_optimizer``), stepped by the user's
code before or after the prepared optimizer's step, over parameters that no registered optimizer holds.

The engine's backward scaled their gradients too, and nothing unscales them: the raw step applies them multiplied by
the loss scale (at O1 float16, 65536: NaN within a few steps), at O2 to the half weights with no FP32 master. The check
of :class:`~lightning_mpx.engine.raw_steps.UnheldParams` at the next backward cannot see it: an engine step between the
backward's note and the next backward voids the note, so that an EMA swap after the step passes. So the engine's step
looks itself, where the unheld parameters exist (``machine.unheld``; ``None`` for an ordinary run, which pays one
attribute read per step for all of this):

* before the step (:func:`written_before_step`): those that held a gradient at the end of the last backward and were
  written since, with no engine step between, unless their gradient was replaced by another tensor (the user's own
  unscaled one, ``p.grad = g`` from ``amp.true_grads``) or parameters of the registered optimizers were written since
  too (:func:`held_written`: a weight decay written by hand over every parameter before the step): the raw step came
  first;
* after the step (:class:`StepsBeside`): the versions of those parameters and of the registered optimizers' then, and a
  mark (an empty set in each gradient's ``__dict__``, weakly referenced with a callback) on each gradient present:
  a gradient freed (``zero_grad``) after its parameter was written since the step was stepped on, which is what a raw
  optimizer does (a torch optimizer reads ``p.grad``, so it writes before the ``zero_grad``). A value set by hand (a
  temperature annealed before each forward) comes after its ``zero_grad``; a parameter left out of every optimizer
  whose gradient is never cleared (a backbone left requiring grad, cleared by the prepared optimizer's ``zero_grad``
  only) keeps its mark, set once: no call per step. The next engine backward refuses what the callbacks found, unless
  parameters of the registered optimizers were written since the step too (a whole-model write: an EMA swap by
  ``copy_`` for validation, a weight decay written by hand over every parameter, before a ``model.zero_grad()``).

Both are refused with a ``RuntimeError`` naming the parameters and each door's fix, after the raw step's first write
(nothing here can see a torch optimizer it never met before it steps: torch's only such hook is process-wide, which
this library does not patch). Under DDP the refusal goes where the ranks meet (``machine.refused``: the step's flags,
engine.unsynced), so both ranks refuse alike. Not seen: a raw step after the prepared one whose gradients are zeroed in
place (``zero_grad(set_to_none=False)``), or never cleared; one followed by a write to the registered optimizers'
parameters before the next backward; one before the step beside such a write before it.
"""

from __future__ import annotations

import functools
import itertools
import operator
import weakref
from typing import Any, Sequence

import torch

__all__ = ["StepsBeside", "held_versions", "held_written", "written_before_step"]

_VERSION = operator.attrgetter("_version")
_GRAD = operator.attrgetter("grad")
_PARAMS = operator.itemgetter("params")
_GROUPS = operator.attrgetter("param_groups")
_REF = operator.attrgetter("optimizer_ref")
_CALL = operator.methodcaller("__call__")
_MARK = "_mpx_freed"  # the attribute of an unheld parameter's gradient that holds its mark (StepsBeside.after_step)


def held_versions(machine: Any) -> tuple[int, ...]:
    """The versions of the registered optimizers' parameters (C-level maps)."""
    optimizers = filter(None, map(_CALL, map(_REF, machine.optimizers.values())))  # those alive
    groups = itertools.chain.from_iterable(map(_GROUPS, optimizers))
    with torch._C.DisableTorchFunction():
        return tuple(map(_VERSION, itertools.chain.from_iterable(map(_PARAMS, groups))))


def held_written(machine: Any) -> bool:
    """Whether parameters of the registered optimizers were written since the backward that noted their versions,
    with no engine step between (``_OptimizerState.backward_versions``): a whole-model write before the step (a
    weight decay or a clamp written by hand over every parameter), no raw step over the unheld ones alone. The weights
    an ``nn.Embedding(max_norm=...)`` renormalises at each forward (``machine.renormed``) and a load's one write of each
    parameter it loaded are left out. Asked only where :func:`written_before_step` found a write."""
    renormed = machine.renormed
    for state in machine.optimizers.values():
        noted, optimizer = state.backward_versions, state.optimizer_ref()
        if noted is None or optimizer is None or state.noted_at != machine.steps_taken:
            continue
        params = list(itertools.chain.from_iterable(map(_PARAMS, optimizer.param_groups)))
        if len(params) == len(noted) and any(
            p._version != v and not machine.loaded_since_step(p, written=True)  # a load's write: no hand write
            for p, v in zip(params, noted)
            if id(p) not in renormed
        ):
            return True
    return False


def written_before_step(note: Any, grad_ids: tuple[int, ...], steps_taken: int) -> list[torch.Tensor]:
    """Of the unheld parameters noted at the end of the last engine backward (``note``: UnheldParams.note, with
    ``grad_ids`` the ids of their gradients then), those that held a gradient and were written since, with no engine
    step between (``steps_taken``), unless their gradient was replaced by another tensor since (the user's unscaled
    one). The usual case (nothing written) is one C-level comparison."""
    if note is None or note[3] != steps_taken:
        return []
    params, versions, had = note[0], note[1], note[2]
    with torch._C.DisableTorchFunction():
        if tuple(map(_VERSION, params)) == versions:
            return []
        grads = tuple(map(_GRAD, params))
    return [
        p
        for p, v, h, g, was in zip(params, versions, had, grads, grad_ids)
        if h and p._version != v and (g is None or id(g) == was)
    ]


def _held_params(machine: Any) -> list[torch.Tensor]:
    """The registered optimizers' parameters, in :func:`held_versions`' order."""
    optimizers = filter(None, map(_CALL, map(_REF, machine.optimizers.values())))
    return list(itertools.chain.from_iterable(map(_PARAMS, itertools.chain.from_iterable(map(_GROUPS, optimizers)))))


def _written_by_hand(machine: Any, then: tuple[int, ...]) -> bool:
    """Whether parameters of the registered optimizers were written since their versions ``then`` (at the last
    step) other than by a ``load_state_dict`` (a group added since: taken as written)."""
    now = held_versions(machine)
    if now == then:
        return False
    if len(now) != len(then):
        return True
    params = _held_params(machine)
    return any(v != w and not machine.loaded_since_step(p, written=True) for p, v, w in zip(params, now, then))


class StepsBeside:
    """What the last engine step left of the unheld parameters: their versions, the registered optimizers'
    parameters' versions, marks on the gradients present, and the positions of those whose gradient was freed after a
    write since (see the module's docstring). Owned by :class:`~lightning_mpx.engine.raw_steps.UnheldParams`."""

    def __init__(self) -> None:
        self.params: tuple[torch.Tensor, ...] = ()  # the noted parameters the marks and versions are for
        # At the end of the last engine step: the versions of ``params`` and of the registered optimizers' parameters.
        self.after: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self.refs: dict[int, weakref.ref[Any]] = {}  # id(mark): its weak reference, whose callback is _freed
        self.written: list[int] = []  # positions in ``params`` freed after a write since the step

    def after_step(self, params: Sequence[torch.Tensor], machine: Any) -> None:
        """At the end of an engine step: note the versions and mark the gradients not marked yet (C-level maps)."""
        params = tuple(params)
        with torch._C.DisableTorchFunction():
            grads = list(map(_GRAD, params))
            self.after = tuple(map(_VERSION, params)), held_versions(machine)
        if len(params) != len(self.params) or not all(map(operator.is_, params, self.params)):
            self.params, self.refs, self.written = params, {}, []  # the old marks' callbacks go with their references
        refs = self.refs
        marks = map(getattr, grads, itertools.repeat(_MARK), itertools.repeat(None))
        unmarked = map(operator.not_, map(refs.__contains__, map(id, marks)))
        present = map(operator.is_not, grads, itertools.repeat(None))
        todo = list(itertools.compress(range(len(grads)), map(operator.and_, present, unmarked)))
        if not todo:
            return  # the usual case once marked: gradients kept (accumulating), or none
        # An empty set, as engine.rescale's marks: it lives as long as the gradient (in its __dict__), travels inert
        # with a copy or a torch.save (weights_only loads a set), and its weak reference's callback tells the free.
        new = list(map(set, itertools.repeat((), len(todo))))
        ids = list(map(id, new))
        callbacks = map(functools.partial, itertools.repeat(self._freed), todo, ids)
        refs.update(zip(ids, map(weakref.ref, new, callbacks)))
        try:
            list(map(setattr, map(grads.__getitem__, todo), itertools.repeat(_MARK), new))
        except AttributeError:  # a tensor subclass that takes no attribute: not watched
            self.refs = {}

    def _freed(self, index: int, mark_id: int, _ref: Any) -> None:
        """A marked gradient was freed: was its parameter written since the last step (while it held it)?"""
        self.refs.pop(mark_id, None)
        after = self.after
        if after is not None and index < len(self.params) and self.params[index]._version != after[0][index]:
            self.written.append(index)

    def take(self, machine: Any) -> list[torch.Tensor]:
        """At the next engine backward: the parameters whose gradient was freed after a write since the last step,
        unless the registered optimizers' parameters were written since it too (a whole-model write). A
        ``load_state_dict`` since the step (``machine.loaded_since_step``) is neither: the parameters it loaded are
        left out of both (a ``strict=False`` load of a few layers leaves a raw step over the others refused)."""
        written, self.written = self.written, []
        after = self.after
        if not written or after is None:
            return []
        params = self.params
        found = [params[i] for i in sorted(set(written)) if not machine.loaded_since_step(params[i], written=True)]
        if found and _written_by_hand(machine, after[1]):
            return []  # a whole-model write
        return found

    def forget(self) -> None:
        """Forget what was noted (a stage change of the engine wrote the parameters)."""
        self.after, self.written = None, []
