"""``_amp_state``: the one piece of module-level state in lightning_mpx (Apex's own ``amp._amp_state``).

Apex kept its whole run in a module-level singleton, and old scripts read it (``_amp_state.loss_scalers[0]
.loss_scale()`` to log the scale). To run those scripts unchanged, :mod:`lightning_mpx.apex` keeps one such object,
:data:`_amp_state`, documented here and nowhere else:

* :func:`lightning_mpx.apex.amp.initialize` fills it with the :class:`~lightning_mpx.Amp` that does the work, the
  wrapped optimizers and the hooks it put on the models. A later ``initialize`` makes a new engine for what it is
  given and leaves the earlier calls' models and optimizers working with theirs, as Apex did (its patches were on the
  objects): a run restored into new objects trains beside the one it was saved from. Their loss scalers start
  afresh (Apex's were global, and each call made new ones). What the new call takes over: the O1 cast scope (one per
  thread, the latest call's), ``loss_scalers``, ``state_dict()``/``load_state_dict()``, and models or optimizers
  passed to it again (their earlier hooks and wrapper are dropped). An earlier call's wrapper is held weakly here: it
  lives as long as the script keeps it.
* :meth:`AmpState.reset` undoes every call (hooks, wrappers, the scope).
* The cast registrations made with ``register_*_function`` and the ``*_function`` decorators are the exception: they
  are made at import time, before ``initialize``, so ``initialize`` applies them to its cast table and keeps them
  (Apex's ``_USER_CAST_REGISTRY`` behaved the same).

Nothing else in the package holds state outside an object the user can see.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from lightning_mpx.engine.amp import Amp


class ScalerView:
    """Apex's ``LossScaler`` as scripts read it (``loss_scale()``), over the core's
    :class:`~lightning_mpx.LossScaler`."""

    def __init__(self, amp: Amp, loss_id: int) -> None:
        self._amp = amp
        self._loss_id = loss_id

    def loss_scale(self) -> float:
        """The current scale of this loss (waits for the device, as Apex's did)."""
        return self._amp.scalers[self._loss_id].get_scale()

    @property
    def _loss_scale(self) -> float:
        """Apex's attribute for the scale; old scripts and Apex's own tests set it to force a scale. Writing it sets
        the core scaler's scale (its trackers kept)."""
        return self.loss_scale()

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"_loss_scale={value!r} must be a positive finite number, e.g. 4.0.")
        scaler = self._amp.scalers[self._loss_id]
        state = scaler.state_dict()
        state["scale"] = float(value)
        scaler.load_state_dict(state)

    @property
    def dynamic(self) -> bool:
        return self._amp.scalers[self._loss_id].dynamic

    def __repr__(self) -> str:
        return f"ScalerView(loss_id={self._loss_id}, {self._amp.scalers[self._loss_id]!r})"


@dataclass(frozen=True)
class OptProperties:
    """Apex's ``_amp_state.opt_properties`` as scripts read it: what ``initialize`` resolved (read-only)."""

    enabled: bool
    opt_level: str | None = None
    cast_model_type: torch.dtype | None = None
    patch_torch_functions: bool = False
    keep_batchnorm_fp32: bool | None = None
    master_weights: bool = False
    loss_scale: float | str = 1.0


@dataclass
class AmpState:
    """What ``amp.initialize`` set up (see the module docstring).

    Attributes:
        amp: The core engine, ``None`` before ``initialize`` (or after ``initialize(enabled=False)``).
        enabled: ``enabled`` of the last ``initialize``/``init`` (``None`` before the first).
        handle: Apex's ``_amp_state.handle``: the :class:`~lightning_mpx.apex.amp.AmpHandle` of the O1 cast scope
            that ``initialize`` (with ``patch_torch_functions``) or ``init`` entered; ``None`` otherwise.
        loss_scalers: One :class:`ScalerView` per loss.
        verbosity: Apex's ``verbosity``: 0 silences the overflow messages.
        optimizers: The live wrapped optimizers of every ``initialize`` call, by ``id`` of the optimizer they wrap
            (weakly: a wrapper the script dropped is gone).
        current: The latest call's wrappers (kept alive, so that its plain optimizers resolve too).
        hooks: Handles of the hooks put on each model (weakly keyed by the model).
        models: The engine that prepared each model (weakly keyed by the model), for ``add_param_group``.
        cast_scope: The O1 cast-policy scope entered by ``initialize`` on its thread (exited by the next one).
        touched: Optimizers named in ``scale_loss`` blocks since the last ``Amp.update()`` (by ``id``).
        stepped: Of those, the ones that stepped (or skipped) since.
        skip_next: Optimizers whose next ``step()`` is skipped because a block that named them overflowed, and
            the ``loss_id`` of that block.
        charged: Optimizers not named in a block that overflowed whose gradients its backward reached: the
            ``loss_id`` of that block and their gradients (weak references) and versions then. The block's overflow is
            counted once, so their step's flags (and a later block's of that loss naming them, their gradients as
            it left them) count for none.
        stash: Unscaled gradients of earlier blocks (at O2 the FP32 master gradients), per optimizer, added after
            the next unscale.
        delayed: Per optimizer, the identity and version of its parameters' gradients at the end of the last
            ``delay_unscale`` block: a clear of them before the next block is told apart by them.
        after_step: Optimizers whose step was skipped (an overflow) and that no ``scale_loss`` block named since,
            with their gradients (weak references) and versions then: while they are unchanged, what they hold is
            left from that step (the script zeroes it before their next block).
        cleared: Optimizers whose returned optimizer's ``zero_grad()`` ran while a block had left their gradients
            unscaled (the block given up, no step): the next block keeps nothing of theirs aside.
        idle: Optimizers with no ``scale_loss`` block of their engine since ``initialize`` or their last step: a
            gradient they hold came from a backward outside any block, unscaled.
        gradless: Per optimizer, the parameters without a gradient when the last ``scale_loss`` block ended: a
            gradient they hold at its ``step()`` came from a backward outside any block, unscaled.
        allow_incoming_model_not_fp32: Apex's switch: ``initialize`` then takes models with half parameters
            (otherwise refused, as Apex did, unless ``cast_model_type=False``).
        held: The FP32 masters a loaded ``amp.state_dict()`` names (the checkpoint's model entry holds them), checked
            at the next ``scale_loss`` block of its engine (``None``: none pending).
        loaded: The engine ``amp.load_state_dict()`` loaded into, until its next ``scale_loss`` block: a new
            ``initialize`` then would drop what was loaded (the wrong order, refused).
        restored: The engine whose returned optimizer was given a ``load_state_dict`` since ``initialize`` or its last
            ``scale_loss`` block: an ``amp.load_state_dict()`` then follows Apex's documented order (a later
            ``initialize``, the next checkpoint restored, is not refused).
        registrations: ``(function, category)`` from ``register_*_function`` and the decorators (kept across
            ``initialize``).
    """

    amp: Amp | None = None
    enabled: bool | None = None
    handle: Any = None
    loss_scalers: list[ScalerView] = field(default_factory=list)
    verbosity: int = 1
    optimizers: weakref.WeakValueDictionary[int, Any] = field(default_factory=weakref.WeakValueDictionary)
    current: list[Any] = field(default_factory=list)
    hooks: weakref.WeakKeyDictionary[torch.nn.Module, list[Any]] = field(default_factory=weakref.WeakKeyDictionary)
    models: weakref.WeakKeyDictionary[torch.nn.Module, Amp] = field(default_factory=weakref.WeakKeyDictionary)
    cast_scope: Any = None
    cast_thread: int | None = None
    holder: Any = None  # cast_model_type=False at O2: the module that holds the half parameters given masters
    touched: set[int] = field(default_factory=set)
    stepped: set[int] = field(default_factory=set)
    skip_next: dict[int, int] = field(default_factory=dict)
    charged: dict[int, tuple[int, tuple[tuple[weakref.ref[torch.Tensor], int] | None, ...]]] = field(
        default_factory=dict
    )
    stash: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    after_step: dict[int, tuple[tuple[weakref.ref[torch.Tensor], int] | None, ...]] = field(default_factory=dict)
    idle: set[int] = field(default_factory=set)
    cleared: set[int] = field(default_factory=set)
    gradless: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    delayed: dict[int, tuple[tuple[int, int] | None, ...]] = field(default_factory=dict)
    graded: dict[int, tuple] = field(default_factory=dict)  # O2: the masters' gradients' versions at a block's end
    allow_incoming_model_not_fp32: bool = False
    stepping: Any = None  # the optimizer whose step() the wrapper is running (its step pre-hook lets it through)
    loaded: Amp | None = None
    restored: Amp | None = None
    held: Any = None  # masters a loaded amp.state_dict() left to the model's entry: checked at the next block
    registrations: list[tuple[Callable[..., Any], str]] = field(default_factory=list)

    def reset(self) -> None:
        """Undo what every ``initialize`` set up (hooks, wrappers, the O1 scope) and forget it; keeps the
        registrations."""
        self.leave_cast_scope()
        for handles in list(self.hooks.values()):
            for handle in handles:
                handle.remove()
        for wrapper in list(self.optimizers.values()):
            wrapper._engine.release_optimizer(wrapper.optimizer)
            wrapper.unguard_original()
        registrations = self.registrations
        self.__init__()  # type: ignore[misc]
        self.registrations = registrations

    def begin_call(self, models: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        """Make way for a new ``initialize`` of ``models`` and ``optimizers``: leave the O1 scope and undo what earlier
        calls did to these objects; earlier calls' other objects go on with their engines."""
        self.leave_cast_scope()
        for model in models:
            for handle in self.hooks.pop(model, []):
                handle.remove()
        for optimizer in optimizers:
            wrapper = self.optimizers.get(id(optimizer))
            if wrapper is not None and wrapper.optimizer is optimizer:
                wrapper._engine.release_optimizer(optimizer)
                wrapper.unguard_original()
                del self.optimizers[id(optimizer)]
        live = set(self.optimizers.keys())
        for ids in (self.touched, self.stepped, self.idle, self.cleared):
            ids.intersection_update(live)
        for key in set(self.after_step) - live:
            del self.after_step[key]
        for key in set(self.skip_next) - live:
            del self.skip_next[key]
        for key in set(self.charged) - live:
            del self.charged[key]
        for key in set(self.stash) - live:
            del self.stash[key]
        for key in set(self.delayed) - live:
            del self.delayed[key]
        self.amp, self.enabled, self.handle, self.holder, self.loaded = None, None, None, None, None
        self.restored, self.held = None, None
        self.loss_scalers, self.current = [], []

    def leave_cast_scope(self) -> None:
        """Leave the O1 cast scope that ``initialize``/``init`` entered, if it is still entered (the engine, its
        scalers and the wrapped optimizers stay: training goes on without O1's casts)."""
        if self.cast_scope is None:
            return
        self._check_can_exit_scope()
        scope, self.cast_scope = self.cast_scope, None
        scope.__exit__(None, None, None)

    def _check_can_exit_scope(self) -> None:
        """The O1 scope is a mode on this thread's torch-function mode stack: only its thread can leave it, and only
        when it is on top (leaving it from under another mode would pop that mode instead)."""
        if threading.get_ident() != self.cast_thread:
            raise RuntimeError(
                "amp.initialize() (or _amp_state.reset()) was called on another thread than the one whose O1 cast "
                "scope it must leave; call it on the thread that called amp.initialize()."
            )
        stack = torch.overrides._get_current_function_mode_stack()
        amp = self.amp
        if not stack or getattr(stack[-1], "policy", None) is not (amp.policy if amp is not None else None):
            raise RuntimeError(
                "the O1 cast scope entered by amp.initialize() is not the innermost torch-function mode on this thread "
                "(a mode entered after initialize() is still active); leave that mode first."
            )

    @property
    def opt_properties(self) -> OptProperties:
        """Apex's ``_amp_state.opt_properties`` (``loss_scale``, ``master_weights``, ...), read from the engine.

        Raises:
            AttributeError: before ``amp.initialize()``, as in Apex (where the attribute did not exist yet).
        """
        if self.enabled is None:
            raise AttributeError("_amp_state.opt_properties: amp.initialize() has not been called.")
        if self.amp is None:
            return OptProperties(enabled=False)
        props = self.amp.properties
        return OptProperties(
            enabled=True,
            opt_level=props.opt_level,
            cast_model_type=props.cast_model_type,
            patch_torch_functions=props.patch_torch_functions,
            keep_batchnorm_fp32=props.keep_batchnorm_fp32,
            master_weights=props.master_weights,
            loss_scale=props.loss_scale,
        )

    def require(self) -> Amp:
        if self.amp is None:
            raise RuntimeError("amp.initialize() has not been called (or was called with enabled=False).")
        return self.amp


#: The documented exception to "no module-level mutable state" (see the module docstring).
_amp_state = AmpState()


def is_rank_zero() -> bool:
    return not (torch.distributed.is_available() and torch.distributed.is_initialized()) or (
        torch.distributed.get_rank() == 0
    )
