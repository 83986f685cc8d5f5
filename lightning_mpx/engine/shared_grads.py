"""Gradients of parameters held by more than one prepared optimizer, unscaled once per backward.

Without FP32 masters (O1, O3, and the parameters with no master at O2) an optimizer's unscale divides its gradients
in place. A parameter held by two optimizers (a head in the whole model's optimizer and in its own) has one gradient:
the second optimizer's unscale would divide it again, and its step would apply the gradient divided by the scale
twice where FP32 steps it with its gradient (``torch.amp.GradScaler`` does the same, see docs/loss_scaling.md).

:class:`SharedGrads` is the one owner of that knowledge. It finds the overlap where the optimizers' parameter sets are
known (a registration or a release, and an unscale that finds an optimizer's parameter count changed: an
``add_param_group``), and only when there is one does an unscale pay for it: the gradients an unscale divided in place
are noted (the tensor and its version after the divide); a later unscale of another optimizer
finds them so (the same tensor, no backward since: a clip's or the user's write keeps true values; so does a tensor the
user put in place of one since, ``p.grad = p.grad.clone()``, told by its parameter: :meth:`SharedGrads.replaced`) and
checks them for inf/NaN, clips them with its own and measures them, without dividing them again. Every optimizer holding
an overflowed shared gradient finds the overflow in its own check, so each one's stage skips its step. A backward since
voids the notes (:meth:`SharedGrads.backward`); :meth:`SharedGrads.clear` drops the
references at the end of the iteration. The other way, the true values that steps leave (a loop that does not zero
them) or that a batch unscaled without stepping leaves are brought back up to the next backward's scale once too
(:meth:`SharedGrads.once`), not once per optimizer holding them.

At O2 a shared parameter's master is shared too, and its FP32 gradient is made again by each optimizer's unscale from
the half gradient, which an unscale before the step (``unscale_``, a clip) shows the true values in: the next
optimizer's unscale divided them again, and the first optimizer's step freed the FP32 gradient that an optimizer
unscaled before it was to step with. The FP32 gradient an unscale made for a shared master is noted with the half
gradient it came from (:meth:`SharedGrads.note_masters`): a later unscale takes its values while the half gradient is
as it was (:meth:`SharedGrads.true_of`), and a step gives it back to the master that a step freed
(:meth:`SharedGrads.restore`). An FP32 gradient the user put in place of the noted one (``m.grad = m.grad * 0.5`` over
``amp.master_params``) is noted in its place before the next unscale or step (:meth:`SharedGrads.follow`).
"""

from __future__ import annotations

import itertools
import operator
from typing import Iterable, Mapping, Sequence

import torch

from lightning_mpx.engine.newly_shared import made_before
from lightning_mpx.engine.optimizer_state import _OptimizerState, _Stage
from lightning_mpx.engine.scaled_write import clipped_nothing
from lightning_mpx.engine.shared_clips import keep_clipped
from lightning_mpx.scaling.scaler import LossScaler

_PARAMS = operator.itemgetter("params")
_GRAD = operator.attrgetter("grad")


class SharedGrads:
    """The parameters more than one registered optimizer holds, and which of their gradients hold true values now.

    Args:
        optimizers: The machine's registered optimizers' states, by the optimizer's ``id`` (read, never written).
        scalers: The machine's loss scalers (read), for the true values of a master that becomes shared after
            another optimizer's step (:func:`~lightning_mpx.engine.newly_shared.made_before`).

    Attributes:
        ids: The ``id`` of each parameter two or more registered optimizers hold (empty: no overlap, no cost).
        done: By gradient ``id``, while parameters are shared: each gradient an unscale divided in place, and its
            version as that unscale left it.
        raised: Before a backward, by ``id``: the gradients holding true values that an optimizer's stage brought up
            to the backward's scale already (gradients kept across a step, or unscaled by a batch that did not step),
            emptied at the next unscale (the stages brought up before a backward only after one).
        rescaled: By gradient ``id``, while parameters are shared: each scaled gradient brought to another loss's
            scale before its backward (:meth:`pending`), and its version then.
    """

    def __init__(self, optimizers: Mapping[int, _OptimizerState], scalers: Sequence[LossScaler] = ()) -> None:
        self.optimizers = optimizers
        self.scalers = scalers
        self.ids: frozenset[int] = frozenset()
        self.done: dict[int, tuple[torch.Tensor, int]] = {}
        self.raised: dict[int, torch.Tensor] = {}
        # at O2, by the half gradient's id: (half gradient, its version, the FP32 gradient an unscale made of it)
        self.masters: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        # at O2, by the FP32 gradient's id: (it, its version) when an unscale showed it on the half one (showing)
        self.truths: dict[int, tuple[torch.Tensor, int]] = {}
        self.rescaled: dict[int, tuple[torch.Tensor, int]] = {}
        # by the parameter's id: the shared parameters whose gradient an unscale left holding true values (divided in
        # place, or at O2 shown), for a tensor the user put in its place since (:meth:`replaced`)
        self.params: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # (parameter, its gradient then)

    def refresh(self) -> None:
        """Find the overlap again (a registration, a release, a parameter count changed). A parameter newly shared
        whose gradient another optimizer already unscaled in place in this iteration (unscaled and not stepped yet,
        or stepped and not written since) is noted as holding true values; at O2 a newly shared master's FP32
        gradient made by such an unscale, as that optimizer has it now (:mod:`~lightning_mpx.engine.newly_shared`)."""
        seen: set[int] = set()
        shared: set[int] = set()
        held: list[tuple[_OptimizerState, list[torch.Tensor]]] = []
        for state in list(self.optimizers.values()):
            optimizer = state.optimizer_ref()
            if optimizer is None:
                continue
            groups = itertools.chain.from_iterable(map(_PARAMS, optimizer.param_groups))
            params = list({id(p): p for p in groups}.values())
            held.append((state, params))
            for param in params:
                (shared if id(param) in seen else seen).add(id(param))
        new = shared - self.ids
        self.ids = frozenset(shared)
        if not shared:
            self.done, self.masters, self.truths, self.rescaled, self.params = {}, {}, {}, {}, {}
        elif new:  # at O2, before this unscale makes their gradients again: the notes an unscale made while shared kept
            self.masters = {**made_before(held, new, self.scalers), **self.masters}
        for state, params in held if new else ():
            for param in params:
                grad = param.grad
                if id(param) in new and grad is not None and id(grad) not in self.done and _true_now(state, grad):
                    self.done[id(grad)] = (grad, grad._version)

    def holds(self, grad: torch.Tensor) -> bool:
        """Whether ``grad`` holds true values: an unscale divided it in place and no backward came since
        (:meth:`backward`). A write since is the user's on true values (torch's ``clip_grad_norm_`` after
        ``unscale_``, as ``fabric.clip_gradients`` does; ``zero_grad`` leaves zeros): not divided again."""
        noted = self.done.get(id(grad))
        return noted is not None and noted[0] is grad

    def backward(self) -> None:
        """A backward is coming: it adds scaled values to the gradients (brought up first), so no note holds."""
        if self.done:
            self.done = {}
        if self.masters:
            self.masters, self.truths = {}, {}
        if self.params:
            self.params = {}

    def note(self, grads: list[torch.Tensor]) -> None:
        """Note ``grads`` as holding true values (an unscale in place just ran over them). The gradients brought up
        before the last backward (:meth:`once`) are forgotten: an unscale has run since, so that backward's stages are
        settled (the next ones start from an unscale)."""
        self.done.update((id(grad), (grad, grad._version)) for grad in grads)
        self.raised, self.rescaled = {}, {}

    def note_masters(self, sources: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
        """At O2, while parameters are shared: note the FP32 gradients ``targets`` an unscale just made of the half
        ones ``sources`` (the same tensor, unscaled in place, is :meth:`note`'s). All of them, not only those shared
        now: a group added after the unscale (``add_param_group`` of a parameter this optimizer holds, before the
        other's step) makes one shared whose FP32 gradient, clipped, the step then frees. Held until the next
        backward or the end of the iteration (:meth:`clear`), no longer than the gradients live anyway."""
        self.masters.update(
            (id(half), (half, half._version, true)) for half, true in zip(sources, targets) if true is not half
        )
        self.raised, self.rescaled = {}, {}

    def note_params(self, params: Iterable[torch.Tensor]) -> None:
        """Note the shared ``params`` as holding true values in their gradients (an unscale just divided them in place,
        or at O2 showed the true values in the half ones): whatever tensor the user puts in their place before the next
        backward holds true values too (:meth:`replaced`)."""
        self.params.update((id(param), (param, param.grad)) for param in params)

    def replaced(self, param: torch.Tensor | None) -> bool:
        """Whether ``param``'s gradient holds true values by an unscale since the last backward though no note holds
        the tensor: the user put another in its place since (``p.grad = p.grad.clone()``, torch's own clip returning
        new tensors), after the unscale showed them the true values. Not divided again (as a write in place is not)."""
        noted = None if param is None else self.params.get(id(param))
        return noted is not None and noted[0] is param

    def took(self, param: torch.Tensor, state: _OptimizerState) -> None:
        """At O2, ``state``'s unscale took the tensor the user put in place of ``param``'s half gradient
        (:meth:`replaced`) into the shared master's FP32 gradient: another optimizer unscaled before, whose marks hold
        the half gradient its unscale read, is told that the new tensor is taken already (its step then steps the
        master's gradient, with this optimizer's clip, rather than taking the tensor again over it)."""
        noted, grad = self.params.get(id(param)), param.grad
        if noted is None or noted[1] is None or grad is None or noted[1] is grad:
            return
        old, new = id(noted[1]), (id(grad), grad._version)
        for other in list(self.optimizers.values()):
            marks = other.unscaled_marks
            if other is not state and other.stage is _Stage.UNSCALED and marks:
                other.unscaled_marks = tuple(new if m is not None and m[0] == old else m for m in marks)

    def written_after_clip(self, sources: list[torch.Tensor], state: _OptimizerState) -> _OptimizerState | None:
        """At O2, before ``state``'s unscale reads the half gradients ``sources``: another optimizer whose engine clip
        read one of them (into the FP32 masters' gradients only), written by the user since (not cleared): the write
        was made on the unclipped values (scaled, or true ones ``unscale_`` showed), so neither optimizer's step can
        take it as FP32 would. That one refuses it at its step (``refuse_scaled_write``); this unscale took it
        silently (the other's clip lost: 2x FP32's norm). Not after a clip that clipped nothing (one host read,
        on this path only)."""
        reading = set(map(id, sources))
        for other in list(self.optimizers.values()):
            if other is state or other.stage is not _Stage.UNSCALED or not other.clips:
                continue
            params = [other.pair_params[i] for i in other.mastered] if other.pair_params else []
            for param, mark in zip(params, other.unscaled_marks):
                # in place (a version moved) or replaced (p.grad = p.grad * 0.5: another tensor, this unscale's)
                half = param.grad
                if mark is None or half is None or id(half) not in reading or (id(half), half._version) == mark:
                    continue
                if bool(half.any()) and not clipped_nothing(other):
                    return other
        return None

    def taken_written(self, halves: list[torch.Tensor], state: _OptimizerState) -> None:
        """At O2, ``state``'s unscale took ``halves`` (shared, holding true values an earlier unscale showed, written
        by the user since) into the shared masters' FP32 gradients: another optimizer unscaled before, whose marks hold
        them as its unscale left them, is told the write is taken (its step then steps the masters' gradients, with
        this optimizer's clip, rather than taking the write again over that clip)."""
        now = {id(half): (id(half), half._version) for half in halves}
        for other in list(self.optimizers.values()):
            marks = other.unscaled_marks
            # not one clipped since its unscale_: a write there is refused at its step (refuse_scaled_write)
            if other is not state and other.stage is _Stage.UNSCALED and other.shown and not other.clips and marks:
                other.unscaled_marks = tuple(now.get(mark[0], mark) if mark is not None else None for mark in marks)

    def true_of(self, half: torch.Tensor) -> torch.Tensor | None:
        """At O2, for a shared master's half gradient ``half`` about to be unscaled: the true values to take instead
        of dividing it, or ``None``. The FP32 gradient another optimizer's unscale made of it while it is as that
        unscale left it; else ``half`` itself where an unscale showed the true values in it (a write since is the
        user's, on true values: :meth:`holds`)."""
        noted = self.masters.get(id(half))
        if noted is not None and noted[0] is half and noted[1] == half._version:
            return noted[2]
        return half if self.holds(half) else None

    def shown(
        self,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        before: list[tuple[int, int]],
        state: _OptimizerState,
    ) -> None:
        """At O2: ``state``'s unscale showed the true values in the half gradients (``(half, FP32 gradient)`` pairs,
        written from the FP32 ones; ``before``: the identity and version of those it wrote, before the write): they
        hold true values now, and the FP32 gradients are still theirs. Another optimizer unscaled before, which
        noted them as it left them, is told that the write is the engine's, not the user's (which its step would
        take into its masters, over a clip made since)."""
        self.done.update((id(half), (half, half._version)) for half, _ in pairs)
        self.masters.update((id(half), (half, half._version, true)) for half, true in pairs)
        self.truths.update((id(true), (true, true._version)) for _, true in pairs)
        now = {id(half): (id(half), half._version) for half, _ in pairs}
        moved = {mark: now[mark[0]] for mark in before if mark[0] in now and now[mark[0]] != mark}
        for other in list(self.optimizers.values()) if moved else ():
            marks = other.unscaled_marks
            if other is not state and other.stage is _Stage.UNSCALED and marks and any(m in moved for m in marks):
                other.unscaled_marks = tuple(moved.get(mark, mark) if mark is not None else None for mark in marks)

    def showing(self, half: torch.Tensor, true: torch.Tensor) -> bool:
        """Whether ``half`` shows the values of ``true`` already (an unscale showed them, neither written since: a
        clip of ``true`` since, torch's on the masters as ``fabric.clip_gradients`` makes it, is a write)."""
        noted = self.masters.get(id(half))
        shown = self.truths.get(id(true))
        return (
            noted is not None
            and noted[0] is half
            and noted[1] == half._version
            and noted[2] is true
            and shown is not None
            and shown[0] is true
            and shown[1] == true._version
            and self.holds(half)
        )

    def restore(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Before the step of an optimizer unscaled earlier (``(parameter, master)`` pairs): give a shared master
        whose FP32 gradient another optimizer's step freed since the gradient noted for its half one; one the user
        replaced since (``m.grad = m.grad * 0.5`` over ``amp.master_params``) is noted instead (:meth:`follow`), for
        the other optimizer's unscale or step after this step freed it."""
        for param, master in pairs:
            half = param.grad
            if master is not param and half is not None:
                noted = self.masters.get(id(half))
                if noted is not None and noted[0] is half:
                    if master.grad is None:
                        master.grad = noted[2]
                    elif master.grad is not noted[2]:
                        self.masters[id(half)] = (half, noted[1], master.grad)

    def follow(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Before an unscale makes new FP32 gradients for ``pairs`` (``(parameter, master)``, as last paired): a
        shared master whose FP32 gradient the user replaced since another optimizer's unscale noted it
        (``m.grad = m.grad * 0.5``) has the user's tensor noted in its place, which this unscale then takes (an
        in-place write is kept already: the noted tensor is the master's). Engine-made replacements hold the noted
        values. Asked only where such notes exist (:attr:`masters`)."""
        for param, master in pairs:
            half, grad = param.grad, master.grad
            if master is not param and half is not None and grad is not None:
                noted = self.masters.get(id(half))
                if noted is not None and noted[0] is half and noted[2] is not grad:
                    self.masters[id(half)] = (half, noted[1], grad)

    def settled(self, stepped: _OptimizerState) -> None:
        """After a step (of ``stepped``'s optimizer): the FP32 gradients noted (:attr:`masters`) are let go once no
        registered optimizer is left to take them (every one stepped since the backward). The steps freed them; the
        notes would keep them through the next forward where the iteration ends at the next backward (Fabric, a loop
        that calls ``update()`` late). Before that, the half gradients the step left that another optimizer's unscale
        showed the true values in (a head's step after the whole model's ``unscale_``) are noted as such
        (``stepped_shown``): the step's own unscale showed nothing, so its other half gradients keep the scale, and
        the next backward brought these up by the ratio of scales, 1, as if scaled (the whole model's clip and step
        after it 0.35 off FP32, silently). Those whose FP32 gradient carries another optimizer's clip (that one
        unscaled, not stepped) get the values stepped with (:func:`~lightning_mpx.engine.shared_clips.keep_clipped`)."""
        if stepped.stage is _Stage.STEPPED and not stepped.stepped_true and self.done:
            grads = map(_GRAD, map(stepped.pair_params.__getitem__, stepped.mastered))
            stepped.stepped_shown = frozenset((id(g), g._version) for g in grads if g is not None and self.holds(g))
        if stepped.stage is _Stage.STEPPED and not stepped.stepped_true:  # another's clip in what it stepped with
            keep_clipped(self, stepped)
        if all(state.stage is _Stage.STEPPED for state in self.optimizers.values()):
            self.masters, self.truths = {}, {}

    def once(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Before a backward: those of ``grads`` (true values, about to be brought up to its scale) that no other
        optimizer's stage brought up already; all of them are noted as brought up."""
        raised = self.raised
        todo = [grad for grad in grads if raised.get(id(grad)) is not grad]
        raised.update((id(grad), grad) for grad in todo)
        return todo

    def pending(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Before a backward of another loss (or at a scale updated since): those of ``grads`` (scaled, pending) that
        another optimizer's stage has not brought to the backward's scale since their last write
        (:func:`~lightning_mpx.engine.rescale.rescale_pending`, which notes them after with :meth:`rescaled_now`): a
        gradient two optimizers hold holds two losses' contributions once, so it is brought over once."""
        noted = self.rescaled
        return [g for g in grads if (n := noted.get(id(g))) is None or n[0] is not g or n[1] != g._version]

    def rescaled_now(self, grads: list[torch.Tensor]) -> None:
        """Note ``grads`` as brought to the coming backward's scale (:meth:`pending`): until written again (the
        backward adds to them)."""
        self.rescaled.update((id(grad), (grad, grad._version)) for grad in grads)

    def clear(self) -> None:
        """Drop the notes (the end of an iteration: the gradients are not held alive past it)."""
        self.done, self.masters, self.truths, self.rescaled, self.params = {}, {}, {}, {}, {}


def _true_now(state: _OptimizerState, grad: torch.Tensor) -> bool:
    """Whether ``grad``, a gradient of a parameter ``state``'s optimizer holds, holds true values by that optimizer's
    stage: unscaled (and not stepped yet), or left by its step and not written since."""
    if state.stage is _Stage.UNSCALED or state.stage is _Stage.SKIPPED:
        return True
    if state.stage is _Stage.STEPPED and state.stepped_true and state.stepped_marks is not None:
        return (id(grad), grad._version) in state.stepped_marks
    return False
