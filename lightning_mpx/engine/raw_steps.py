"""A torch optimizer that lightning_mpx never prepared, stepping parameters by hand between the engine's backwards.

Under manual optimization a user may build an optimizer of their own (``torch.optim.SGD(self.parameters())`` in a
LightningModule's ``training_step``, one never returned from ``configure_optimizers`` nor passed to ``fabric.setup``,
``amp.prepare_optimizer`` or Accelerate's ``prepare``) and step it after the engine's backward. At O2 it steps the
half parameters with the half gradients, still scaled, and no FP32 master update (the next ``refresh_masters`` takes
its writes as a user's edits); under a loss scale other than 1 it applies the gradients multiplied by the scale.

Nothing of the engine runs in that step, so the next backward tells it: every backward notes the versions of each
registered optimizer's parameters and the count of the engine's steps (``StepMachine.before_backward``: C-level maps,
no Python call); a later backward with no engine step between (the gradients of the first still pending) that finds
versions changed looks for parameters written since whose gradients were cleared (:func:`refuse_raw_step`).
Gradient accumulation keeps its gradients, a skipped batch (``zero_grad`` without a step) writes no parameter (but
for an ``nn.Embedding(max_norm=...)``'s weight, renormalised in place by each forward: left out), a write
after the step (a clamp, an EMA swap for validation) comes before the first backward, and the engine's own stage
changes that write parameters (a checkpoint loaded, a model prepared again, masters refreshed with ``force``, another
stage's engine taking over, a schedule-free optimizer's ``eval()``/``train()`` redone on the masters) forget what was
noted (:meth:`StepMachine.forget_writes`): none of them is refused. Only
where the harm is real: with FP32 masters (O2), or a loss scale other than 1. A SAM-style two-pass optimizer
(``first_step``, :func:`is_two_pass`) has one such write let through per engine step: its
``first_step``'s perturbation, undone before the step; a second (davda54's ``second_step``, whose
``base_optimizer.step()`` the engine's step never runs) is refused with the recipe of docs/master_weights.md: at that
call where the optimizer has a ``base_optimizer`` (:class:`~lightning_mpx.engine.step_guard.BaseStepGuard`), here
otherwise.

Nor is a write while some of the optimizer's parameters keep their gradients (an EMA swap for validation, or an EMA
teacher in ``self.parameters()`` updated, between accumulated backwards): no ``zero_grad`` ran, so those without one
(frozen, unused by the forward, a teacher whose output is detached) never took the backward's. At O2, though, such a
write that moved elements from their masters' rounding against their gradients nearly everywhere is a torch optimizer's
step between accumulated backwards (:func:`stepped_along`, engine.half_steps), refused at the step where it still
stands (the next step would keep its half rounding only; a probe undone before it is let through: engine.kept_writes).

A raw optimizer over parameters that no registered optimizer holds (a GAN's discriminator stepped by hand beside a
prepared generator optimizer; a Fabric model before the plugin met its optimizer at the first step) is seen through
:class:`UnheldParams`: the parameters of the prepared models that require grad and that no registered optimizer holds,
found when the models or the registrations change (never per step; ``None`` for an ordinary run, so no cost there). The
end of each harmful engine backward notes their versions and which of them hold a gradient (a callback queued by a hook
on the scaled loss, run after DDP's: the ranks see the same gradients, and so refuse alike); the next engine backward
refuses those that held one and were written since with their gradients cleared, with no engine step between (a write
after a step, an EMA swap, is no raw step). Written with the gradients kept (a discriminator stepped by hand before its
``zero_grad``, as the DCGAN loop does) they are suspects for one more backward: engine steps never write them, so one
whose gradient is cleared by then is refused too, unless written again since (a value set by hand before each forward: a
temperature annealed under accumulation) or unless every gradient the registered optimizers hold was cleared with it
(``model.zero_grad()`` ending an iteration after an EMA swap kept through accumulation). A parameter never written (its
gradient accumulates), a frozen one, one that never holds a gradient (an EMA teacher under ``torch.no_grad()``) and one
set on a model after it was prepared are left alone.

A door that meets its optimizers at their first step (Fabric's: ``registers_at_step``) has, in the first iteration,
a SAM-style ``first_step`` write over parameters no optimizer holds yet: before any optimizer is registered, one such
write is noted at the backward after it (``UnheldParams.deferred``), not refused, and judged where the door registers
the optimizer (:meth:`UnheldParams.judge`): the ``first_step`` of a SAM-style optimizer holding those parameters, or a
raw step, refused there (a second write before it is refused at the backward after it). After a registration, only a
write over set-up models no registered optimizer holds any parameter of is so noted (a GAN's SAM generator met after
its discriminator's optimizer); one over part of a held model (a head beside a set-up trunk) is refused at once. At O2
the masters are made at the first such backward, from the weights before ``first_step``.

The gradients an engine backward leaves on those parameters carry the scale of its loss; nothing rescales them (no
optimizer's state holds them). An update before their optimizer is registered (a Fabric GAN's read of the scale after
D's first step, before G's, where the plugin meets G) must not change what they are unscaled by: it keeps, for those
still as the backward left them, the loss and the scale (``CarriedScales.carry``, engine.carried_scales, from the
notes of dynamic losses), and the optimizer registered over them later starts with them (:meth:`UnheldParams.settle`),
as a registered optimizer's pending gradients keep theirs (``_OptimizerState.grad_scale``). Gradients cleared or
recomputed since carry nothing. A static scale never moves: nothing is kept.
"""

from __future__ import annotations

import functools
import itertools
import operator
import weakref
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from lightning_mpx.engine.beside_steps import StepsBeside, held_written, written_before_step
from lightning_mpx.engine.carried_scales import CarriedScales
from lightning_mpx.engine.frozen_writes import warn_half_ema, watch_frozen
from lightning_mpx.engine.half_steps import at_rounding, rounding, stepped_along
from lightning_mpx.engine.kept_writes import forget_undone, keep_write
from lightning_mpx.engine.optimizer_state import _OptimizerState
from lightning_mpx.engine.raw_step_messages import _BESIDE_FIX, _FIX, _KEPT_FIX, _SAM_FIX, _shown
from lightning_mpx.engine.unsynced import watch_ddp
from lightning_mpx.masters.pairs import master_for
from lightning_mpx.masters.weights import MasterWeights

# stepped_along (engine.half_steps) and _SAM_FIX (engine.raw_step_messages) were defined here: importable here still.
__all__ = ["UnheldParams", "find_unheld", "is_two_pass", "refuse_base_with_sam", "refuse_raw_step", "stepped_along"]

_PARAMS = operator.itemgetter("params")
_VERSION = operator.attrgetter("_version")
_GRAD = operator.attrgetter("grad")
_HALF = (torch.float16, torch.bfloat16)


def refuse_raw_step(
    state: _OptimizerState,
    master_weights: Sequence[MasterWeights],
    names: dict[int, str],
    *,
    harmful: bool,
    steps_taken: int = 0,
    renormed: frozenset[int] = frozenset(),
    defer: bool = False,
) -> str | None:
    """Raise when, since the backward that noted them, parameters of the state's optimizer were written and their
    gradients cleared with no step of the engine between: another optimizer stepped them by hand. ``harmful``: with
    FP32 masters or a loss scale other than 1 (otherwise such a step is a plain step, and left alone). A SAM-style
    two-pass optimizer (:func:`is_two_pass`) has one such write let through per engine step (``steps_taken``: the
    engine's count): its ``first_step``'s perturbation, undone before the step; a second is its base step, raw.
    ``renormed``: the ids of weights an ``nn.Embedding(max_norm=...)`` renormalises in place at each forward, left out
    (its forward after a batch skipped once its backward ran writes them so). ``defer``: a backward since the last
    engine step was not synchronised by DDP (engine.unsynced): the error's message is returned instead of raised, for
    the next step to raise on every rank; ``None`` when there is none."""
    noted = state.backward_versions
    optimizer = state.optimizer_ref()
    if noted is None or optimizer is None or not harmful:
        return None
    with torch._C.DisableTorchFunction():
        params = list(itertools.chain.from_iterable(map(_PARAMS, optimizer.param_groups)))
        if len(noted) != len(params) or tuple(map(_VERSION, params)) == noted:
            return None  # the usual case: nothing written since (gradient accumulation, a skipped batch)
        if any(map(operator.is_not, map(_GRAD, params), itertools.repeat(None))):
            # gradients kept (accumulation; a clamp or an EMA swap between accumulated backwards): no zero_grad since,
            # so those written without one never took the backward's (frozen, unused by the forward, an EMA teacher
            # whose output is detached). A raw optimizer between accumulated backwards, at O2, is told by what it
            # wrote: a step along the gradients the backward left (:func:`stepped_along`)
            # (engine.kept_writes: judged at the step, where a probe undone before it, extragradient's, is let through)
            if state.kept_writes:
                forget_undone(state)  # probes undone since (engine.kept_writes): no copy kept past them
            stepped = stepped_along(params, noted, master_weights, renormed)
            if stepped:
                shown = _shown(stepped, master_weights, names)
                message = (
                    f"parameters {shown} were stepped along their gradients between two backwards of lightning_mpx, "
                    f"with the gradients kept, no step of its prepared {type(optimizer).__name__} between, and the "
                    f"write still there at its step: {_KEPT_FIX}"
                )
                keep_write(state, message, [(p, rounding(p, master_weights)) for p in stepped])
            return None
        stepped = [p for p, v in zip(params, noted) if p._version != v and id(p) not in renormed]
    if stepped and master_weights and not state.two_pass:  # (a SAM-style write is counted below)
        # At O2 a half weight written back to its FP32 master's rounding (a rollback by copy_ to the last step's
        # snapshot) holds nothing the next step would lose: not a raw step (read on this path only, before refusing).
        stepped = [p for p in stepped if not at_rounding(p, master_weights)]
    if not stepped:
        return None
    two_pass = state.two_pass  # is_two_pass(optimizer), asked once at registration
    if two_pass and state.perturbed_at != steps_taken:
        state.perturbed_at = steps_taken  # its first_step: scale-free (g / ||g||), undone before the step
        return None
    state.backward_versions = None  # raised once: a caller that catches it is not told again for the same writes
    shown = _shown(stepped, master_weights, names)
    if two_pass:
        message = (
            f"parameters {shown} were written and their gradients cleared twice since the last step of the "
            f"{type(optimizer).__name__} prepared by lightning_mpx, with backwards between: the second write of this "
            f"SAM-style two-pass optimizer (first_step, second_step) is its second_step's base_optimizer.step(), "
            f"which the engine never sees: {_SAM_FIX}"
        )
    else:
        message = (
            f"parameters {shown} were written and their gradients cleared after a backward of lightning_mpx with no "
            f"step of its prepared {type(optimizer).__name__} between: {_FIX}"
        )
    if defer:
        return message
    raise RuntimeError(message)


def is_two_pass(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a SAM-style two-pass optimizer (davda54/sam, ASAM, GSAM): a callable ``first_step``
    (the perturbation) beside a callable ``second_step`` or a ``base_optimizer`` (a ``step()`` that restores and steps
    the base optimizer is the same recipe), also through a wrapper that delegates them (Lightning's or Fabric's
    optimizer). A ``first_step`` alone (a user's warm-up method of that name) is not SAM-style."""
    if not callable(getattr(optimizer, "first_step", None)):
        return False
    return callable(getattr(optimizer, "second_step", None)) or getattr(optimizer, "base_optimizer", None) is not None


def refuse_base_with_sam(optimizer: torch.optim.Optimizer, states: Iterable[_OptimizerState]) -> None:
    """Refuse registering ``optimizer`` beside a registered SAM-style optimizer whose ``base_optimizer`` it is, or
    a SAM-style ``optimizer`` whose ``base_optimizer`` is registered: the two hold the same parameters, and the base
    one's state took ``first_step``'s perturbation for a raw step of its own at the next backward (an error naming a
    cause the user did not have). Called where that check is harmful (with masters, or a loss scale other than 1),
    once per registration."""
    base = getattr(optimizer, "base_optimizer", None) if is_two_pass(optimizer) else None
    for state in states:
        other = state.optimizer_ref()
        if other is None or other is optimizer:
            continue
        if other is base:
            sam, inner = optimizer, other
        elif state.two_pass and getattr(other, "base_optimizer", None) is optimizer:
            sam, inner = other, optimizer
        else:
            continue
        raise ValueError(
            f"optimizer={type(optimizer).__name__}: the SAM-style optimizer {type(sam).__name__} and its "
            f"base_optimizer ({type(inner).__name__}) cannot both be registered; register the SAM-style optimizer only "
            "(its step() steps the base optimizer, on the FP32 masters at O2): prepare_optimizer(), "
            "accelerator.prepare(), fabric.setup() or configure_optimizers() with it alone. See 'SAM and two-pass "
            "optimizers' in docs/master_weights.md."
        )


class UnheldParams:
    """The parameters of the prepared models that require grad and that no registered optimizer holds, and what the
    last harmful engine backward left in them (see the module's docstring). Made by :func:`find_unheld` when the models
    or the registrations change; the engine holds ``None`` instead when there are none.

    Args:
        modules: The prepared models that have some (held weakly: nothing here keeps a model or a parameter alive
            past a backward, nor blocks ``torch.utils.swap_tensors``, which refuses a tensor with a weak reference).
        ids: Those parameters' ids: read from the live models at each backward, so a parameter replaced since (a
            model sharded by FSDP after it was prepared) drops out.
    """

    def __init__(self, modules: Sequence[nn.Module], ids: frozenset[int]) -> None:
        self.modules = tuple(weakref.ref(m) for m in modules)
        self.ids = ids
        # At the end of the last harmful engine backward: the parameters, their versions, whether each held a gradient,
        # the engine's count of steps, and whether only half parameters are harmed (O2 with a unit scale).
        self.note: tuple[tuple[torch.Tensor, ...], tuple[int, ...], tuple[bool, ...], int, bool] | None = None
        # Positions written with their gradients kept since the note before the last one, with no engine step between:
        # refused at the next backward if their gradients were cleared since.
        self.suspects: frozenset[int] = frozenset()
        # A door that registers optimizers at their first step (Fabric's, ``machine.registers_at_step``), before any is
        # registered: the parameters of one write with their gradients cleared (a SAM-style first_step, or a raw
        # step), judged where the door registers its optimizer (:meth:`judge`).
        self.deferred: tuple[torch.Tensor, ...] = ()
        # Whether the half children no optimizer holds were looked for (:meth:`warn_half_children`, once).
        self.looked = False
        # The gradients the engine's backwards of dynamic losses left here, and the scale each carries across an update,
        # which an optimizer registered over them later starts with (engine.carried_scales; a Fabric GAN's generator).
        self.scales = CarriedScales()
        # A raw optimizer stepped in the same iteration as a prepared one (engine.beside_steps): the ids of the
        # gradients at the note, and what the last engine step left of these parameters.
        self.grad_ids: tuple[int, ...] = ()
        self.beside = StepsBeside()

    def params(self) -> tuple[torch.Tensor, ...]:
        """The parameters, from the live models (once each)."""
        ids, seen, found = self.ids, set(), []
        for ref in self.modules:
            module = ref()
            for param in module.parameters() if module is not None else ():
                key = id(param)
                if key in ids and key not in seen:
                    seen.add(key)
                    found.append(param)
        return tuple(found)

    def before_backward(self, machine: Any, loss_id: int, scaled: torch.Tensor | None) -> None:
        """At an engine backward (``scaled``: its scaled loss, ``None`` when not known): refuse a raw step since the
        last one (:meth:`check`), then, where a raw step would harm (O2, or a scale other than 1), have the end of
        this backward note the parameters."""
        self.check(machine)
        if self.beside.written:  # gradients freed after a write since the last engine step (engine.beside_steps)
            self._refuse_beside(
                self.beside.take(machine),
                machine,
                "after the step of a prepared optimizer, while they held the gradients of the backward before it",
            )
        scaler = machine.scalers[loss_id]
        masters = bool(machine.masters.weights)
        if not self.looked and masters and machine.optimizers:
            self.warn_half_children(machine)
        if masters and self.note is None and machine.registers_at_step and not machine.optimizers:
            # A door that meets its optimizers at their first step (Fabric's), at the first backward: the masters
            # made now (as the step would, writes since set-up taken), from the weights before a SAM-style first_step
            # perturbs them; its step (judge) then takes no write into them. Masters exist from the first step on.
            for param in self.params():
                master_for(machine.masters.weights, param)
        if scaled is not None and scaled.requires_grad and (masters or not scaler._unit):
            dynamic = loss_id if scaler.dynamic else None  # the gradients' scale recorded (CarriedScales) or not
            scaled.register_hook(functools.partial(self._queue, machine.steps_taken, scaler._unit, dynamic))

    def warn_half_children(self, machine: Any) -> None:
        """Once, at the first backward where optimizers are registered and FP32 masters exist (O2): warn about the
        half parameters, of a model an optimizer trains part of, that require grad and that no optimizer holds, such
        as an EMA or momentum teacher kept as a child. Updated by hand (``e.lerp_(s, 1 - d)``) with a decay of 0.99
        or more, most of their elements never move in half, where ``"bf16-mixed"`` averages its FP32 weights."""
        self.looked = True
        held = _held(machine)
        for ref in self.modules:
            module = ref()
            if module is None or not any(id(p) in held for p in module.parameters()):
                continue  # a model no optimizer trains any of (a GAN's other model, met at its own first step)
            found = [(n, p.dtype) for n, p in module.named_parameters() if id(p) in self.ids and p.dtype in _HALF]
            if not found:
                continue
            what = "{dtype} parameters of {owner} ({shown}) require grad but no optimizer holds them, so they have "
            what += "no FP32 master."
            warn_half_ema(module, found, what, frozen=False)

    def forget(self, *, loaded: bool = False) -> None:
        """Forget what was noted (a stage change of the engine wrote the parameters); ``loaded``: a model's
        ``load_state_dict``, whose writes the notes of the last step's :class:`StepsBeside` tell apart (by the
        parameters it loaded), so those are kept, and so is the last backward's note: the parameters the load wrote are
        left out of its looks (:meth:`check`, :meth:`before_step`), a raw step over the others still refused."""
        if not loaded:
            self.note, self.suspects, self.deferred = None, frozenset(), ()
            self.beside.forget()

    def judge(self, machine: Any, optimizer: torch.optim.Optimizer) -> frozenset[int]:
        """Where a door that registers optimizers at their first step (``machine.registers_at_step``: Fabric's)
        registers ``optimizer``, before it does: refuse a write since the last backward (a raw step before this step),
        and a write deferred at a backward (:meth:`check`) unless ``optimizer`` is SAM-style (:func:`is_two_pass`) and
        holds its parameters (then it was its ``first_step``). Returns the ids of the parameters written since the
        first backward that ``optimizer``, SAM-style, holds: its ``first_step``'s (their gradients cleared or zeroed),
        whose per-parameter state (``old_p``) is its own, not state loaded before the door knew it."""
        note, suspects = self.note, self.suspects  # written with the gradients kept (zeroed) before the last note
        self.check(machine, defer=False)
        deferred = self.deferred
        written = list(deferred)
        if note is not None:
            written += [note[0][i] for i in sorted(suspects)]
        if not written:
            return frozenset()
        held = frozenset(map(id, itertools.chain.from_iterable(map(_PARAMS, optimizer.param_groups))))
        two_pass = is_two_pass(optimizer)
        if deferred and not (two_pass and all(id(p) in held for p in deferred)):
            self.forget()
            shown = _shown(deferred, machine.masters.weights, machine.names)
            raise RuntimeError(
                f"parameters {shown}, which no optimizer prepared by lightning_mpx held then, were written and their "
                f"gradients cleared between two backwards of lightning_mpx before the first step of "
                f"{type(optimizer).__name__} (where the Fabric plugin meets it), which is no SAM-style optimizer "
                f"holding them: {_FIX}"
            )
        self.deferred = ()
        return frozenset(id(p) for p in written if id(p) in held) if two_pass else frozenset()

    def check(self, machine: Any, *, defer: bool = True) -> None:
        """Raise when parameters that held a gradient at the note were written since with their gradients cleared,
        with no engine step between, or were suspects (written with the gradients kept) whose gradients were cleared
        since; note new suspects. The usual case (nothing written, no suspect) is one C-level comparison. In a door
        that registers optimizers at their first step (``machine.registers_at_step``), before any is registered, one
        such write is deferred (``defer``): noted for :meth:`judge`, which tells a SAM-style ``first_step`` from a raw
        step there; a second one before that is refused."""
        note = self.note
        if note is None:
            return
        noted, versions, had, noted_at, half_only = note
        params = self.params()
        if not _same(params, noted):
            self.forget()  # the models' parameters changed since (replaced, sharded): nothing to compare
            return
        with torch._C.DisableTorchFunction():
            if not self.suspects and tuple(map(_VERSION, params)) == versions:
                return
            suspects, self.suspects = self.suspects, frozenset()
            fresh = noted_at == machine.steps_taken  # a write after an engine step is no raw step (an EMA swap)
            stepped, kept, cleared_suspects = [], [], []
            for i, (param, version, held) in enumerate(zip(params, versions, had)):
                cleared = param.grad is None
                # A suspect written again since the note (a value set by hand before each forward: a temperature
                # annealed under accumulation) took that value, not a raw step's: left to the rule below.
                if i in suspects and cleared and param._version == version:
                    cleared_suspects.append(param)
                elif fresh and held and param._version != version:
                    if cleared:
                        stepped.append(param)
                    else:
                        kept.append(i)
            self.suspects = frozenset(kept)
        if cleared_suspects and not _all_cleared(machine):
            # cleared alone (a raw optimizer's zero_grad); with every gradient the prepared optimizers hold, it is the
            # end of an iteration (model.zero_grad() after the step) and the write an EMA swap kept through accumulation
            stepped += cleared_suspects
        held_now = _held(machine)  # one added to a registered optimizer since (add_param_group): the engine's steps
        stepped = [p for p in stepped if id(p) not in held_now and (not half_only or p.dtype in _HALF)]
        stepped = [p for p in stepped if not machine.loaded_since_step(p, written=True)]  # a load's write: no step
        if not stepped:
            return
        if defer and not self.deferred and machine.registers_at_step and self._unmet(machine, stepped):
            self.deferred = tuple(stepped)  # judged where the door registers its optimizer (judge)
            return
        stepped = [*self.deferred, *(p for p in stepped if all(p is not d for d in self.deferred))]
        self.forget()  # raised once: a caller that catches it is not told again for the same writes
        shown = _shown(stepped, machine.masters.weights, machine.names)
        message = (
            f"parameters {shown}, which no optimizer prepared by lightning_mpx holds, were written and their "
            f"gradients cleared after a backward of lightning_mpx: {_FIX}"
        )
        if machine.unsynced_at == machine.steps_taken:  # after a backward DDP did not synchronise (engine.unsynced)
            machine.refused = machine.refused or message
            return
        raise RuntimeError(message)

    def before_step(self, machine: Any, optimizer: torch.optim.Optimizer) -> None:
        """At an engine step of ``optimizer``, before it: refuse parameters here that held a gradient at the end of
        the last backward and were written since, with no engine step between (a raw optimizer stepped before the
        prepared one: engine.beside_steps), unless the registered optimizers' parameters were written since too (a
        whole-model write: a weight decay by hand over every parameter). Kept in ``machine.refused``, which the step
        raises (on every rank, where they meet)."""
        stepped = written_before_step(self.note, self.grad_ids, machine.steps_taken)
        stepped = [p for p in stepped if not machine.loaded_since_step(p, written=True)]  # a load's write: no step
        if stepped and not held_written(machine):  # a whole-model write (a weight decay by hand) is no raw step
            when = f"between a backward of lightning_mpx and the step of its prepared {type(optimizer).__name__}"
            self._refuse_beside(stepped, machine, when, at_step=True)

    def after_step(self, machine: Any) -> None:
        """At the end of an engine step: what it left of these parameters, for a raw step after it
        (:class:`~lightning_mpx.engine.beside_steps.StepsBeside`)."""
        note = self.note
        if note is not None:
            self.beside.after_step(note[0], machine)

    def _refuse_beside(
        self, stepped: Sequence[torch.Tensor], machine: Any, when: str, *, at_step: bool = False
    ) -> None:
        """Refuse a raw step beside an engine step over ``stepped`` (those a registered optimizer holds now, at O2
        with a unit scale those not half, and the weights an ``nn.Embedding(max_norm=...)`` renormalises at each
        forward, left out), at once or where the ranks meet."""
        note = self.note
        half_only = note is not None and note[4]
        left = _held(machine) | machine.renormed
        stepped = [p for p in stepped if id(p) not in left and (not half_only or p.dtype in _HALF)]
        if not stepped:
            return
        self.forget()  # raised once: a caller that catches it is not told again for the same writes
        shown = _shown(stepped, machine.masters.weights, machine.names)
        message = f"parameters {shown}, which no optimizer prepared by lightning_mpx holds, were written {when}: "
        message += _BESIDE_FIX
        if at_step or machine.unsynced_at == machine.steps_taken:  # raised by the step (engine.unsynced)
            machine.refused = machine.refused or message
            return
        raise RuntimeError(message)

    def _unmet(self, machine: Any, stepped: Sequence[torch.Tensor]) -> bool:
        """Whether ``stepped`` may be an optimizer's write that the door has not met yet: before any registration, or
        (a GAN's second optimizer, met after the first) when each lies in a prepared model no registered optimizer
        holds any parameter of (Fabric's ``setup(model, optimizer)`` pairs them). A write over part of a model whose
        other parameters a registered optimizer holds (a head beside a set-up trunk) is no such write: refused."""
        if not machine.optimizers:
            return True
        whole = set()
        for ref in self.modules:
            module = ref()
            params = [] if module is None else [p for p in module.parameters() if p.requires_grad]
            if params and all(id(p) in self.ids for p in params):
                whole.update(map(id, params))
        return all(id(p) in whole for p in stepped)

    def settle(self, state: _OptimizerState, optimizer: torch.optim.Optimizer) -> None:
        """Where ``optimizer`` is registered: the loss and the scale that the gradients on its parameters carry across
        an update become its state's (:meth:`CarriedScales.settle`)."""
        if self.scales.records:
            self.scales.settle(state, list(itertools.chain.from_iterable(map(_PARAMS, optimizer.param_groups))))

    def take_over(self, old: UnheldParams) -> None:
        """Take what ``old`` (the engine's before the registrations changed) knows of the gradients left here."""
        self.scales = old.scales

    def _queue(self, noted_at: int, half_only: bool, loss_id: int | None, grad: torch.Tensor) -> None:
        """The scaled loss's gradient hook: the note is taken when the backward ends, after the callbacks queued during
        it (``_requeue``): DDP's, which gives a rank the all-reduced gradient of a parameter only another rank's
        forward used. Noted before it, which parameters hold a gradient differed between the ranks, and so did the
        refusal: one rank raised while the other went on into the next all-reduce (a hang). ``loss_id``: the loss's,
        where its scale is dynamic (the gradients recorded, :class:`CarriedScales`); ``None`` where it is static."""
        note = functools.partial(self._note, noted_at, half_only, loss_id)
        torch.autograd.Variable._execution_engine.queue_callback(  # type: ignore[attr-defined]
            functools.partial(_requeue, note)
        )

    def _note(self, noted_at: int, half_only: bool, loss_id: int | None) -> None:
        params = self.params()
        with torch._C.DisableTorchFunction():  # C-level maps
            versions = tuple(map(_VERSION, params))
            grads = tuple(map(_GRAD, params))
            had = tuple(map(operator.is_not, grads, itertools.repeat(None)))
            self.grad_ids = tuple(map(id, grads))
        if self.note is not None and not _same(params, self.note[0]):
            self.suspects = frozenset()  # positions among other parameters
        self.note = params, versions, had, noted_at, half_only
        if loss_id is not None:  # a dynamic scale: the gradients this backward made or added to carry it
            self.scales.note(params, grads, had, loss_id)


def find_unheld(models: Any, machine: Any) -> None:
    """Set ``machine.unheld`` (:class:`UnheldParams`, or ``None`` when there are none) for the engine's prepared models
    (``models``: its :class:`~lightning_mpx.engine.preparation.PreparedModels`); none for a sharded model (its
    parameters are the strategy's shards), and ``machine.frozen_writes`` (:func:`watch_frozen`). Also
    ``machine.renormed``: the weights an ``nn.Embedding(max_norm=...)`` renormalises in place at each forward (see
    :func:`refuse_raw_step`)."""
    old, machine.unheld, machine.renormed = machine.unheld, None, frozenset()
    modules: list[nn.Module] = [] if models.sharded else list(models._unsharded.keys())
    watch_frozen(modules, machine)  # a frozen half teacher written by hand (engine.frozen_writes), looked for once
    if models.sharded:
        return
    watch_ddp(modules, machine)  # their DDP wrappers, met in the forwards before the next backward (engine.unsynced)
    machine.renormed = frozenset(
        id(sub.weight)
        for module in modules
        for sub in module.modules()
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.max_norm is not None
    )
    held = _held(machine)
    ids: set[int] = set()
    owners = []
    for module in modules:
        new = {id(p) for p in module.parameters() if p.requires_grad and p.is_floating_point() and id(p) not in held}
        if new:
            owners.append(module)
            ids |= new
    if ids:
        machine.unheld = UnheldParams(owners, frozenset(ids))
        if old is not None:  # the gradients left on those still unheld, and the scales they carry (carry)
            machine.unheld.take_over(old)


def _requeue(callback: Any) -> None:
    """Queue ``callback`` at the end of the running backward's callbacks (after those queued since: DDP's)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]


def _same(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _held(machine: Any) -> set[int]:
    """The ids of the parameters the machine's registered optimizers hold."""
    optimizers = [o for state in machine.optimizers.values() if (o := state.optimizer_ref()) is not None]
    return {id(p) for o in optimizers for p in itertools.chain.from_iterable(map(_PARAMS, o.param_groups))}


def _all_cleared(machine: Any) -> bool:
    """Whether every parameter the machine's registered optimizers hold has its gradient cleared."""
    optimizers = [o for state in machine.optimizers.values() if (o := state.optimizer_ref()) is not None]
    groups = itertools.chain.from_iterable(o.param_groups for o in optimizers)
    return all(p.grad is None for p in itertools.chain.from_iterable(map(_PARAMS, groups)))
