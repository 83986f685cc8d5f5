"""One iteration of Apex's loss scaling: the optimizer wrapper ``initialize`` returns and the ``scale_loss`` block.

A block scales the loss, and at its end unscales the gradients of the optimizers it names (Apex's stash of earlier
blocks' unscaled gradients, at O2 the FP32 master ones, added after); an overflow marks their next ``step()`` to be
skipped; once every optimizer touched in the iteration has stepped, each engine involved updates its scales
(:func:`_update`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import operator
from typing import Any, Callable, Iterator, NoReturn, Sequence

import torch
from torch import nn

from lightning_mpx.apex._state import AmpState, _amp_state, is_rank_zero
from lightning_mpx.apex.cast_mode_aside import put_back, set_aside, stack_depth
from lightning_mpx.apex.charges import (
    _charge_unnamed,
    _charged_still,
    _grad_marks,
    _held,
    _left_over,
    _params,
    _recharge,
    _renote,
)
from lightning_mpx.apex.fp16_utils import _HalfParameters
from lightning_mpx.apex.stash import _chain_cleared, _forget_pending, _restore_stash, _stash, _tag_zeros
from lightning_mpx.apex.step_refusals import refuse_original_step, refuse_unscaled_step
from lightning_mpx.common.keywords import check_keywords, checks_keywords
from lightning_mpx.engine.amp import Amp
from lightning_mpx.engine.master_writes import cleared
from lightning_mpx.engine.optimizer_state import _Stage
from lightning_mpx.engine.raw_steps import is_two_pass

log = logging.getLogger("lightning_mpx.apex")

_GRAD = operator.attrgetter("grad")
_VERSION = operator.attrgetter("_version")
_SOME_GRAD = functools.partial(operator.is_not, None)
_PARAMS = operator.itemgetter("params")
_NO_GRAD = functools.partial(operator.is_, None)
_NO_OTHERS: frozenset[int] = frozenset()


class AmpOptimizer(torch.optim.Optimizer):
    """The optimizer ``initialize`` returns: ``step()`` runs through :meth:`Amp.step`; everything else is the wrapped
    optimizer's. A subclass of ``Optimizer`` (without its ``__init__``) so that learning-rate schedulers accept it.

    Attributes:
        optimizer: The wrapped optimizer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, state: AmpState, amp: Amp) -> None:  # noqa: D107
        # No super().__init__: every piece of optimizer state lives in the wrapped optimizer.
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "_amp_state", state)
        # The engine of the initialize() call that wrapped it: a later call leaves it working (as Apex did).
        object.__setattr__(self, "_engine", amp)
        object.__setattr__(self, "_step_hook", None)

    def guard_original(self) -> None:
        """Refuse ``step()`` of the wrapped optimizer itself: Apex patched it in place, so old scripts step the one
        they passed in; its step would bypass the skip and the scale's update (inf/NaN into the weights at O1).
        Registered before the engine's own hooks, so that its message is the one seen at O2 too."""
        hooks = [self.optimizer.register_step_pre_hook(refuse_original_step)]
        base = getattr(self.optimizer, "base_optimizer", None) if is_two_pass(self.optimizer) else None
        if isinstance(base, torch.optim.Optimizer):
            # davda54's second_step steps its base optimizer itself: at O1 that step bypassed the skip of an
            # overflowed step (inf into the weights) and the scale's update; at O2 it stepped the half weights.
            hooks.append(base.register_step_pre_hook(functools.partial(_refuse_base_step, self)))
        object.__setattr__(self, "_step_hook", hooks)

    def unguard_original(self) -> None:
        """Take :meth:`guard_original`'s hooks off (the optimizer is released)."""
        if self._step_hook is not None:
            for hook in self._step_hook:
                hook.remove()
            object.__setattr__(self, "_step_hook", None)

    # Attributes the base class would otherwise read from self.
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(object.__getattribute__(self, "optimizer"), name)
        if name in ("train", "eval") and callable(attribute):
            # A schedule-free optimizer's train()/eval() moves the parameters its groups hold between steps (at O2
            # the half ones, its state keyed by the FP32 masters): run on the masters, then copied into the model.
            return functools.partial(_on_masters, self, attribute)
        return attribute

    def step(self, closure: Callable[[], Any] | None = None, **misspelt: NoReturn) -> Any:  # type: ignore[override]
        """Step through ``Amp.step()`` unless a ``scale_loss`` block that named this optimizer overflowed; returns
        what the optimizer's ``step()`` returned (``None`` when skipped), as Apex's patched step."""
        if misspelt:  # refused naming the valid one (common/keywords.py: no wrapper on a per-step call)
            check_keywords("optimizer.step()", misspelt, ("closure",))
        if closure is not None:
            raise NotImplementedError(
                "closure: Currently, Amp does not support closure use with optimizers (loss scaling cannot re-run "
                "the closure inside the step); run the closure first, then call step() without it."
            )
        aside = set_aside() if stack_depth() else None  # the O1 cast mode: its calls per torch call saved
        try:
            return _optimizer_step(self._amp_state, self)
        finally:
            if aside is not None:
                put_back(aside)

    def zero_grad(self, set_to_none: bool = True, **misspelt: NoReturn) -> None:
        """The wrapped optimizer's; at O2 the FP32 masters' gradients (zeroed or set to None alike) and the stash of
        earlier blocks go too, as with Apex's O2 ``zero_grad`` (a ``delay_unscale`` chain given up leaves nothing to
        the next step, and a clip of ``amp.master_params()`` before the next block sees no gradient)."""
        if misspelt:
            check_keywords("optimizer.zero_grad()", misspelt, ("set_to_none",))
        aside = set_aside() if stack_depth() else None  # the O1 cast mode, as for step(): the optimizer's own calls
        try:
            self.optimizer.zero_grad(set_to_none=set_to_none)
        finally:
            if aside is not None:
                put_back(aside)
        self._amp_state.stash.pop(id(self.optimizer), None)
        self._amp_state.delayed.pop(id(self.optimizer), None)
        self._amp_state.charged.pop(id(self.optimizer), None)
        pending = self._engine._optimizers.get(id(self.optimizer))  # the core's state (a C-level getter)
        if pending is not None and pending.loss_id is not None and pending.stage is _Stage.READY:
            _forget_pending(self._engine, self.optimizer)  # a delay_unscale chain given up counts for no loss's scale
        elif pending is not None and pending.stage is _Stage.UNSCALED:
            self._amp_state.cleared.add(id(self.optimizer))  # a block given up: nothing of it to keep aside (_stash)
        if self._engine.properties.master_weights:
            params = itertools.chain.from_iterable(map(_PARAMS, self.optimizer.param_groups))
            for param, master in zip(params, self._engine.master_params(self.optimizer)):
                if master is not param and master.grad is not None:
                    if set_to_none:
                        master.grad = None
                    else:
                        master.grad.zero_()  # as the model's: a step then moves by momentum alone, as FP32's
            if pending is not None and pending.stage is _Stage.UNSCALED:  # the writes to the masters' before: gone
                cleared(pending)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    @checks_keywords("optimizer.load_state_dict()")
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
        if self._amp_state.amp is self._engine:
            self._amp_state.restored = self._engine  # Apex's documented order: initialize(), then the loads

    @checks_keywords("optimizer.add_param_group()")
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer; at O2 its half parameters get FP32 masters at the next step, those of
        a model ``initialize`` did not prepare (a new head made half) too, as Apex's patched ``add_param_group``
        did."""
        engine = self._engine
        if engine.properties.master_weights and "params" in param_group:
            params = param_group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)  # a generator, read once
            param_group = {**param_group, "params": params}
            prepared = {id(p) for model, e in self._amp_state.models.items() if e is engine for p in model.parameters()}
            stray = [p for p in params if p.dtype in (torch.float16, torch.bfloat16) and id(p) not in prepared]
            if stray:
                holder = engine.prepare_model(_HalfParameters(stray))  # already half: only their masters are made
                self._amp_state.models[holder] = engine
                object.__setattr__(self, "_holders", [*self.__dict__.get("_holders", []), holder])
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"AmpOptimizer({self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("AmpOptimizer cannot be pickled; save optimizer.state_dict() instead.")


def _on_masters(wrapper: AmpOptimizer, call: Callable[[], Any]) -> Any:
    """Run ``call`` (the wrapped optimizer's ``train``/``eval``) through :meth:`Amp.call_on_masters`; its result."""
    result: list[Any] = []
    wrapper._engine.call_on_masters(wrapper.optimizer, lambda: result.append(call()))
    return result[0] if result else None


def _refuse_base_step(wrapper: AmpOptimizer, base: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Refuse a SAM-style optimizer's ``base_optimizer.step()`` outside the step of the optimizer ``initialize``
    returned (davda54's ``second_step``), unless nothing is scaled and there are no masters (a static scale of 1 at
    O1/O3: the step is FP32's)."""
    engine, optimizer = wrapper._engine, wrapper.optimizer
    if _amp_state.stepping is optimizer or _wrapper_of(wrapper) is not wrapper:
        return  # the wrapper's own step, or a dropped wrapper
    if id(optimizer) not in engine._optimizers:
        return  # another engine took it over: its own guard
    masters, unit = engine.properties.master_weights, all(scaler._unit for scaler in engine.scalers)
    if not masters and unit:
        return
    harm = (
        []
        if unit
        else ["bypass the skip of a step whose gradients overflowed (inf into the weights) and the loss scale's update"]
    )
    harm += ["step the half weights instead of the FP32 masters"] if masters else []
    raise RuntimeError(
        f"base_optimizer.step() ({type(base).__name__}) of the SAM-style optimizer {type(optimizer).__name__} passed "
        "to amp.initialize() was called outside the step of the optimizer amp.initialize() returned (davda54's "
        f"second_step() steps it itself): that step would {' and '.join(harm)}. Make second_step() undo the "
        "perturbation only and step() "
        "the base step (def step(self, closure=None): return self.base_optimizer.step(closure)); then, after the "
        "second scale_loss block: optimizer.second_step(); optimizer.step(); optimizer.zero_grad(). See 'SAM' in "
        "docs/apex.md."
    )


# -- the loss -------------------------------------------------------------------------------------------------------
_SCALE_LOSS_KEYWORDS = ("loss", "optimizers", "loss_id", "model", "delay_unscale", "delay_overflow_check")


@contextlib.contextmanager
def scale_loss(
    loss: torch.Tensor,
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    loss_id: int = 0,
    model: nn.Module | None = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
    **misspelt: NoReturn,
) -> Iterator[torch.Tensor]:
    """Yield ``loss`` times the scale of ``loss_id``; at the end of the block, unscale the gradients of
    ``optimizers`` (into the FP32 masters at O2) unless ``delay_unscale``.

    Several blocks before one ``step()`` accumulate: a later block's backward adds to the unscaled gradients of the
    earlier ones (they are scaled back up first). An overflow in the block skips the next ``step()`` of every
    optimizer it names and backs off this loss's scale.

    ``model`` and ``delay_overflow_check`` are accepted for compatibility and unused (as in Apex's last releases).
    """
    if misspelt:  # refused naming the valid ones (common/keywords.py: no wrapper on a per-step call)
        check_keywords("amp.scale_loss()", misspelt, _SCALE_LOSS_KEYWORDS)
    if not isinstance(delay_unscale, bool):  # a string ("False") was taken as true: the block then kept its gradients
        raise TypeError(f"delay_unscale={delay_unscale!r} must be True or False.")
    state = _amp_state
    items = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
    if state.amp is None and all(_wrapper_of(item) is None for item in items):
        if state.enabled is None:  # Apex's own refusal: nothing was initialized, the loss would go unscaled
            raise RuntimeError(
                "amp.scale_loss() was invoked, but amp.initialize() has not been called: call "
                "model, optimizer = amp.initialize(model, optimizer, opt_level=...) before `with amp.scale_loss`."
            )
        yield loss  # enabled=False, as Apex (an earlier call's optimizers keep scaling: their step unscales)
        return
    wrapped = _resolve(optimizers)
    amp = wrapped[0]._engine
    if state.held is not None and state.amp is amp:
        state.held.check(amp)  # the masters the loaded amp entry left to the model's: given by now?
        state.held = None
    if state.loaded is amp:
        state.loaded = None  # what was loaded is in use: a later initialize() drops nothing unused
    if state.restored is amp:
        state.restored = None
    ids = [id(w.optimizer) for w in wrapped]
    if any(i in state.stepped for i in ids):
        # A new iteration began for an optimizer that already stepped: close the last one.
        _update(state)
    state.touched.update(ids)
    # charged by another loss's block, gradients kept: that loss's overflow, counted already (charges._recharge); a
    # comprehension only where there is a charge (a Python call per block otherwise)
    others = _NO_OTHERS
    if state.charged:
        others = {id(w.optimizer) for w in wrapped if id(w.optimizer) in state.charged and _recharge(state, w, loss_id)}
    # The core scales every unscaled gradient of this engine's optimizers back up for this block's backward, named
    # or not.
    own = [w for w in state.optimizers.values() if w._engine is amp]
    unscaled = [w.optimizer for w in own if amp.is_unscaled(w.optimizer)]
    # What earlier blocks left non-finite stays so: only an overflow this block makes skips what it names (Apex
    # checked only the block's own new gradients).
    overflowed_before = [_overflowed(amp, w.optimizer) for w in wrapped]
    if unscaled or state.delayed:  # else nothing to keep aside (the usual block: one per step)
        _stash(state, amp, own, unscaled, delay_unscale)
        # What was kept aside is not checked again: the block's check sees its own gradients alone.
        overflowed_before = [b and id(w.optimizer) not in state.stash for w, b in zip(wrapped, overflowed_before)]
    if others:
        overflowed_before = [b or id(w.optimizer) in others for w, b in zip(wrapped, overflowed_before)]
    # The core brings every optimizer's pending gradients to this loss's scale, checking them. What an optimizer
    # whose step was skipped and is not named here holds is left from that step (DCGAN's netG before netG.zero_grad():
    # inf): Apex never looked at it, so the core does not see it either (else its next step would be skipped for it,
    # and this loss's scale backed off). A taken step's leftovers are the core's (scaled up: the backward adds to them
    # as FP32's does, for a script that steps the optimizer again without zero_grad).
    # Told by the gradients' identities and versions (charges._left_over): a clear since (either zero_grad) and the
    # gradients of an earlier block of this iteration are new values, which the core brings to this loss's scale.
    left = [w.optimizer for w in own if id(w.optimizer) in state.after_step and id(w.optimizer) not in ids
            and _left_over(state, w)]  # fmt: skip
    with _hidden_grads(left, named=[w.optimizer for w in wrapped]):
        scaled = amp.scale_loss(loss, loss_id)
    for key in ids:
        state.after_step.pop(key, None)
    state.idle.difference_update(id(w.optimizer) for w in own)
    state.gradless.clear()
    yield scaled
    # The layer's own work from here on meets no O1 cast mode (apex.cast_mode_aside): the mode is back in the finally.
    aside = set_aside() if stack_depth() else None
    try:
        if amp.policy is not None and amp.properties.patch_torch_functions:
            amp.policy._clear_casts()  # Apex cleared its cast cache at the end of every block (Amp.update the rest)
        if delay_unscale and not amp.properties.master_weights and any(
            state.stash.get(id(w.optimizer)) for w in wrapped
        ):
            # O1: earlier blocks' gradients were unscaled and kept aside (a block without delay_unscale before this
            # one, a step due after them): unscaled at the end as a block without it, the stash added back, so that
            # the gradients until the next block or the step are the sum's true values, as FP32's. A change of them
            # there (a clip, p.grad.mul_(0.5), a clear through .data) then reaches the earlier blocks' too (kept aside
            # until the step, they missed it; Apex, whose chain added into the same tensors, clipped scaled values).
            # At O2 the step uses the masters' gradients, which a change of the model's through .data would not
            # reach: the chain stays.
            delay_unscale = False
        if delay_unscale:
            _record_gradless(state, own)
            for wrapper in own:  # what a clear of the chain's gradients before the next block is told apart by
                params = [p for group in wrapper.optimizer.param_groups for p in group["params"]]
                if id(wrapper.optimizer) in state.stash:  # earlier blocks kept aside (rare: a step is due after them)
                    _tag_zeros(params)
                state.delayed[id(wrapper.optimizer)] = _grad_marks(params)
            if state.charged:  # an overflow charged to an optimizer no block named (rare)
                _renote(state, wrapped)
            return
        overflow = False
        for wrapper, before in zip(wrapped, overflowed_before):
            amp.unscale_(wrapper.optimizer)
            if not overflow and not before:
                # this block's own overflow: the core charges what was non-finite before the block (another loss's inf
                # brought to this loss's scale at its start) to that loss. One flag (the usual case): read as the step
                # reuses it; several: this loss's
                flags = amp._optimizers[id(wrapper.optimizer)].found_by_loss
                overflow = _overflowed(amp, wrapper.optimizer) if len(flags) <= 1 else _loss_overflowed(flags, loss_id)
        for key in list(state.stash):
            _restore_stash(state, state.optimizers[key])
        for optimizer in unscaled:
            if not amp.is_unscaled(optimizer):
                # Not named here: Apex left its gradients unscaled, so unscale them again (exactly where the scales are
                # powers of two, as Apex's are; an overflow there counts at its own step).
                amp.unscale_(optimizer)
        for key in others:
            # Another loss's overflow, counted for that loss, is in these gradients: the step is skipped all the same
            # (the skip apart from the back-off; without it a later block's stash hid the inf from the step: weights
            # NaN).
            state.skip_next.setdefault(key, state.charged[key][0] if key in state.charged else loss_id)
        if overflow:
            state.skip_next.update(dict.fromkeys(ids, loss_id))
            _charge_unnamed(state, amp, own, ids + [id(o) for o in left], loss_id)
            _log_overflow(amp, loss_id)
        _record_gradless(state, own)
        if amp.properties.master_weights:
            for wrapper in wrapped:
                state.graded[id(wrapper.optimizer)] = _grad_versions(amp, wrapper.optimizer)
        if state.charged:  # an overflow charged to an optimizer no block named (rare)
            _renote(state, wrapped)
    finally:
        if aside is not None:
            put_back(aside)


def _grad_versions(amp: Amp, optimizer: torch.optim.Optimizer) -> tuple[tuple[int, int], ...]:
    """Identity and version of ``optimizer``'s master gradients (C-level maps, no Python per parameter): a write since
    (a clip of ``amp.master_params()``, which hands them out as tensors of their own: engine.master_writes) moves it."""
    with torch._C.DisableTorchFunction():
        masters = amp._machine.master_params(optimizer, with_masters=True, hand=False)  # not handed out to the user
        grads = list(filter(_SOME_GRAD, map(_GRAD, masters)))
        return tuple(zip(map(id, grads), map(_VERSION, grads)))


def _record_gradless(state: AmpState, own: list[AmpOptimizer]) -> None:
    """At a block's end (after its unscale, which may give the model half copies of the gradients): the parameters
    of ``own`` without a gradient, which a backward outside any block would give one before the step."""
    for wrapper in own:
        params = list(itertools.chain.from_iterable(map(_PARAMS, wrapper.optimizer.param_groups)))
        with torch._C.DisableTorchFunction():  # C-level maps, no Python per parameter (O1's cast mode included)
            state.gradless[id(wrapper.optimizer)] = list(itertools.compress(params, map(_NO_GRAD, map(_GRAD, params))))


@contextlib.contextmanager
def _hidden_grads(optimizers: list[torch.optim.Optimizer], named: list[torch.optim.Optimizer]) -> Iterator[None]:
    """Take the gradients of ``optimizers``' parameters (but those of ``named``) away for the block, then put the
    same tensors back."""
    keep = {id(p) for opt in named for group in opt.param_groups for p in group["params"]}
    hidden = [
        (p, p.grad)
        for opt in optimizers
        for group in opt.param_groups
        for p in group["params"]
        if p.grad is not None and id(p) not in keep
    ]
    for param, _ in hidden:
        param.grad = None
    try:
        yield
    finally:
        for param, grad in hidden:
            param.grad = grad


def _overflowed(amp: Amp, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s gradients held non-finite values at their last check since its step (a host read)."""
    return amp.overflowed(optimizer)  # the step that follows does not read the same flag again


def _loss_overflowed(flags: dict[int, torch.Tensor], loss_id: int) -> bool:
    """Whether the checks of an optimizer's gradients charged an overflow to ``loss_id`` (``flags``: its core state's
    ``found_by_loss``; a host read)."""
    flag = flags.get(loss_id)
    return flag is not None and bool(flag.item() > 0)


def _wrapper_of(item: Any) -> AmpOptimizer | None:
    """The live wrapper of an optimizer, or of the optimizer a wrapper wraps; ``None`` when there is none (or the
    wrapper was replaced by a later ``initialize`` of the same optimizer)."""
    inner = item.optimizer if isinstance(item, AmpOptimizer) else item
    wrapper = _amp_state.optimizers.get(id(inner))
    if wrapper is None or wrapper.optimizer is not inner or (isinstance(item, AmpOptimizer) and wrapper is not item):
        return None
    return wrapper


def _resolve(optimizers: Any) -> list[AmpOptimizer]:
    items = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
    out: list[AmpOptimizer] = []
    for item in items:
        wrapper = _wrapper_of(item)
        if wrapper is None:
            raise ValueError(
                f"optimizers={type(item).__name__} (id {id(item):#x}) was not passed to amp.initialize() (or a later "
                "amp.initialize() was given its optimizer again: use the optimizer that call returned). Build the "
                "optimizer before amp.initialize(), pass it there and use the one returned: "
                "`model, optimizer = amp.initialize(model, optimizer, opt_level=...)`."
            )
        if all(wrapper is not seen for seen in out):
            out.append(wrapper)
    if any(w._engine is not out[0]._engine for w in out):
        raise ValueError(
            "optimizers: the optimizers named in one scale_loss() block come from different amp.initialize() calls, "
            "whose loss scalers differ; give each call's optimizers their own block."
        )
    return out


def _log_overflow(amp: Amp, loss_id: int) -> None:
    if _amp_state.verbosity <= 0 or not is_rank_zero():
        return
    scaler = amp.scalers[loss_id]
    scale = scaler.get_scale()
    if scaler.dynamic:
        new = max(scale * scaler.backoff_factor, scaler.min_loss_scale)
        log.info("Gradient overflow.  Skipping step, loss scaler %d reducing loss scale to %s", loss_id, new)
    else:
        log.info("Gradient overflow.  Skipping step, loss scaler %d keeps its static loss scale %s", loss_id, scale)


def _optimizer_step(state: AmpState, wrapper: AmpOptimizer) -> Any:
    if _wrapper_of(wrapper) is None:
        raise RuntimeError(
            "step(): this optimizer was given to a later amp.initialize() (or _amp_state.reset() ran); step the "
            "optimizer that call returned."
        )
    key = id(wrapper.optimizer)
    if state.cleared:
        state.cleared.discard(key)  # stepped: what its next unscale leaves is the next block's to keep aside
    skipped = key in state.skip_next
    marks = state.delayed.pop(key, None)  # a delay_unscale chain ends at the step
    if marks is not None and _chain_cleared(
        marks, [p for group in wrapper.optimizer.param_groups for p in group["params"]], key in state.stash
    ):
        # The chain's gradients were cleared since its last block (model.zero_grad() either way: a batch dropped
        # mid-accumulation), and the step comes next: what earlier blocks kept aside goes with them, as at a next
        # block (_stash), and the chain's loss counts nothing.
        state.stash.pop(key, None)
        _forget_pending(wrapper._engine, wrapper.optimizer)
    if key in state.idle or any(p.grad is not None for p in state.gradless.pop(key, ())):
        refuse_unscaled_step(wrapper)
    if key in state.skip_next:
        # A block that named it overflowed (in its gradients or another optimizer's): the block charged the overflow
        # to it, so the engine's step skips it, as Apex did, and counts, records and acts on it (on_floor) as any
        # skipped step; that block's loss scale backs off in the update below. Earlier blocks' stashed gradients go.
        loss_id = state.skip_next.pop(key)
        state.stash.pop(key, None)
        # Charged here, at the step: a later block's backward and unscale start its checks afresh.
        if not wrapper._engine.is_unscaled(wrapper.optimizer):
            wrapper._engine.unscale_(wrapper.optimizer)
        wrapper._engine.share_overflow([wrapper.optimizer], loss_id)
    else:
        _restore_stash(state, wrapper)
        # What a taken step leaves to a loop without zero_grad() is the model's half copy of the gradients, which
        # the next block scales up: made again from the masters' when they were written since the block (a clip of
        # amp.master_params(); Apex kept the clipped FP32 master gradients), not on every step (a copy of every
        # gradient that the usual loop's zero_grad() throws away).
        engine, inner = wrapper._engine, wrapper.optimizer
        graded = state.graded.pop(key, None)
        if engine.properties.master_weights and (graded is None or graded != _grad_versions(engine, inner)):
            engine.show_unscaled_on_model(inner)
    # No block's gradients pending (none since its last step, or a delay_unscale chain given up): Apex updated a
    # scaler only at the end of a block it unscaled, so the flags this step records count for no loss's scale.
    machine = wrapper._engine._machine
    core = machine.optimizers.get(key)
    counted = (
        set(machine.iteration_found)
        if core is not None and core.loss_id is None and core.stage is _Stage.READY and not skipped
        else None
    )
    charged, marks = state.charged.pop(key, (None, None))  # a block's gradients whose overflow was counted
    if charged is not None and core is not None and _charged_still(wrapper, marks):
        before = (dict(machine.iteration_found), dict(machine.iteration_read))  # all of them: restored after the step
    else:
        charged = None
    state.stepping = wrapper.optimizer
    try:
        stepped = wrapper._engine.step(wrapper.optimizer)
    finally:
        state.stepping = None
    if counted is not None:
        for loss_id in [i for i in machine.iteration_found if i not in counted]:
            del machine.iteration_found[loss_id]
            machine.iteration_read.pop(loss_id, None)
    if charged is not None:  # the flags as they were before this step (record_found makes new tensors), every loss's
        machine.iteration_found.clear()  # (one brought to a later loss's scale since the charge holds the inf too)
        machine.iteration_read.clear()
        machine.iteration_found.update(before[0])
        machine.iteration_read.update(before[1])
    # the optimizer's step's value, taken before _update's amp.update() drops it (the engine keeps no user value)
    stepper = wrapper._engine._stepper
    returned, stepper.returned = stepper.returned, None
    _mark_for_schedulers(wrapper, stepped=stepped)
    state.stepped.add(key)
    if skipped:
        state.after_step[key] = _held(_params(wrapper))
    state.idle.add(key)
    if {key for key in state.touched if key in state.optimizers} <= state.stepped:  # a dropped wrapper will not step
        _update(state)
    return returned


def _mark_for_schedulers(wrapper: AmpOptimizer, stepped: bool) -> None:
    """A learning-rate scheduler made on the wrapper marks it ``_opt_called`` whenever its ``step()`` is called; a
    skipped step is no call of the optimizer's step (Apex and ``GradScaler`` skip without one), so until a step is
    taken the mark is taken off again: a scheduler stepped after a skipped first step warns of it, as there."""
    marks = wrapper.__dict__
    if stepped:
        marks["_took_a_step"] = True
    elif not marks.get("_took_a_step"):
        marks.pop("_opt_called", None)


def _update(state: AmpState) -> None:
    """Close the iteration: the scales of the losses that overflowed back off, in each engine involved."""
    engines: list[Amp] = []
    for key in state.touched:
        wrapper = state.optimizers.get(key)
        if wrapper is not None and all(wrapper._engine is not e for e in engines):
            engines.append(wrapper._engine)
    for engine in engines:
        engine.update()
    state.touched.clear()
    state.stepped.clear()
    state.skip_next.clear()
    state.stash.clear()
