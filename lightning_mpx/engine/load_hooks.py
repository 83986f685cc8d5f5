"""The load and ``state_dict`` hooks :class:`~lightning_mpx.engine.preparation.PreparedModels` puts on each model it
prepares for training (:func:`hook_loads`), and their base :class:`_EngineHook` (a hook that holds its engine weakly,
also the base of :mod:`lightning_mpx.apex`'s model hooks).

At O2 a ``load_state_dict`` sends the FP32 values it loads to the masters exactly (:class:`_LoadIntoMasters`; one
with ``assign=True`` is refused) and a ``state_dict`` right after a schedule-free optimizer's ``eval()`` holds the
point it asked for (:class:`_FollowModes`); without masters (O0, O1, O3) a load is noted as such
(:class:`_ForgetWrites`). Either way a load is no raw step (:mod:`lightning_mpx.engine.raw_steps`), the parameters it
writes are noted as loaded (:mod:`lightning_mpx.engine.held_masters`), and those a ``strict=False`` load lacked keep
this run's values (:class:`_MissingKept`). Every hook runs at a load or a save only, never per step.
:mod:`lightning_mpx.engine.preparation` re-exports :class:`_EngineHook` (its import path is kept).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch import nn

from lightning_mpx.common.dtypes import HALF_DTYPES
from lightning_mpx.masters.swap import follow_modes

if TYPE_CHECKING:
    from lightning_mpx.engine.preparation import PreparedModels


def hook_loads(
    models: PreparedModels, module: nn.Module, hooks: weakref.WeakKeyDictionary[nn.Module, list[Any]], *, masters: bool
) -> None:
    """Put the load hooks on ``module``, a model ``models`` prepared for training, their handles in ``hooks[module]``:
    with ``masters`` (O2) :class:`_LoadIntoMasters` on each submodule with parameters of its own and
    :class:`_FollowModes` on the root, without (O0, O1, O3) :class:`_ForgetWrites` on each such submodule; and
    :class:`_MissingKept` on the root. A model prepared again (a head added since) has its hooks put on anew, the new
    submodules' included."""
    for handle in hooks.pop(module, ()):
        handle.remove()
    hook = _LoadIntoMasters(models) if masters else _ForgetWrites(models)
    hooks[module] = [
        sub.register_load_state_dict_pre_hook(hook)
        for sub in module.modules()
        if any(True for _ in sub.parameters(recurse=False))
    ]
    if masters:
        hooks[module].append(module.register_state_dict_pre_hook(_FollowModes(models)))
    hooks[module].append(module.register_load_state_dict_post_hook(_MissingKept(models)))


class _EngineHook:
    """A model hook that needs its engine (or a part of it, ``amp``): held weakly, and dropped by a copy or a pickle
    of the model (whose parameters have no masters in it). Used by :class:`_LoadIntoMasters` and by
    ``lightning_mpx.apex``'s hooks."""

    def __init__(self, amp: Any) -> None:
        self._amp: Callable[[], Any] | None = weakref.ref(amp)

    def engine(self) -> Any:
        return self._amp() if self._amp is not None else None

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._amp = None


class _LoadIntoMasters(_EngineHook):
    """``load_state_dict`` pre-hook on each submodule of a model prepared at O2: a floating-point value of another
    dtype loaded into a half parameter goes to its master (or to the value its master will be made from) as an FP32
    model takes it (FP32 and the other half dtype exactly, float64 rounded to FP32); the model takes its rounding. A
    value in the parameter's own dtype is its rounding already (the master takes it from the model). It acts on the
    module it is called for (a ``copy.deepcopy`` of the model, an EMA copy, has no masters) and holds the engine's
    :class:`PreparedModels` weakly; a copied or pickled hook holds none."""

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        models: PreparedModels | None = self.engine()
        if models is None:
            return
        if args and isinstance(args[0], dict) and args[0].get("assign_to_params_buffers"):
            _refuse_assign(models, module, state_dict, prefix)
        models.machine.forget_writes(loaded=True)  # a load writes the parameters (a rollback): no raw step
        written = []
        for name, param in _unhooked_parameters(module, type(self)):
            value = state_dict.get(prefix + name)
            if torch.is_tensor(value):
                written.append(param)
            # Any floating dtype but the parameter's own (FP32 alone before: a float16 checkpoint into a bfloat16
            # model, a float64 one, left the masters the model's half rounding)
            if param.dtype in HALF_DTYPES and torch.is_tensor(value) and value.dtype in _LOADED_EXACTLY[param.dtype]:
                models.masters.take_loaded(param, value, models.machine.optimizers.values())
        models.machine.note_loaded(written)  # the user's values now (engine.held_masters)


# By half parameter dtype, the dtypes of loaded values its master takes (an FP32 model's copy_ of them).
_LOADED_EXACTLY = {
    torch.bfloat16: frozenset((torch.float32, torch.float64, torch.float16)),
    torch.float16: frozenset((torch.float32, torch.float64, torch.bfloat16)),
}


def _unhooked_parameters(module: nn.Module, hook: type) -> Iterator[tuple[str, nn.Parameter]]:
    """``module``'s own parameters, and those of its submodules without a ``hook`` of their own (made since the
    hooks were put on: ``torch.nn.utils.parametrize`` moves a weight into ``parametrizations.weight.original``, a
    module of its own), by their names under ``module``: the parameters whose load ``module``'s hook takes."""
    yield from module.named_parameters(recurse=False)
    todo = [(name + ".", child) for name, child in module.named_children()]
    while todo:
        prefix, sub = todo.pop()
        if any(isinstance(getattr(h, "hook", h), hook) for h in sub._load_state_dict_pre_hooks.values()):
            continue  # its own hook takes its parameters
        for name, param in sub.named_parameters(recurse=False):
            yield prefix + name, param
        todo += [(prefix + name + ".", child) for name, child in sub.named_children()]


class _FollowModes(_EngineHook):
    """``state_dict`` pre-hook on a model prepared at O2: a schedule-free optimizer's ``eval()``/``train()`` since the
    last forward (which moved no half weight: its state is keyed by the masters) redone on the masters and copied into
    the model first, so ``torch.save(model.state_dict())`` right after ``optimizer.eval()`` holds the point it asked
    for (the Fabric and Trainer hooks of ``fp32_export`` do the same for their FP32 values). On the root module,
    acting once per call of its own (``prefix`` empty)."""

    def __call__(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        models: PreparedModels | None = self.engine()
        if models is None:
            return
        for state in list(models.machine.optimizers.values()):
            if state.train_modes is not None:
                follow_modes(state, models.masters.weights)


class _ForgetWrites(_EngineHook):
    """``load_state_dict`` pre-hook on each submodule of a model prepared for training without masters (O0, O1,
    O3): a load between a backward and the next (a rollback after a loss spike) writes the parameters, which the
    raw-step check (:mod:`lightning_mpx.engine.raw_steps`) must not take for a step outside the engine, and the
    parameters it writes are noted as loaded (:mod:`lightning_mpx.engine.held_masters`). At O2
    :class:`_LoadIntoMasters` does the same."""

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        models: PreparedModels | None = self.engine()
        if models is not None:
            models.machine.forget_writes(loaded=True)
            models.machine.note_loaded(  # the user's values now (engine.held_masters)
                param for name, param in _unhooked_parameters(module, type(self)) if prefix + name in state_dict
            )


class _MissingKept(_EngineHook):
    """``load_state_dict`` post-hook on a prepared model: the parameters a ``strict=False`` load lacked (a
    checkpoint saved with ``fabric.save(..., filter=...)``) keep this run's values by the user's choice, as in an
    FP32 model, and are noted as loaded with the others, so that the held-masters check (engine.held_masters) does not
    take them for a model entry never loaded. On the model's root: the keys are named from it."""

    def __call__(self, module: nn.Module, incompatible: Any) -> None:
        models: PreparedModels | None = self.engine()
        if models is not None and incompatible.missing_keys:  # at a load only, and one with keys missing
            missing = set(incompatible.missing_keys)
            models.machine.note_loaded((p for name, p in module.named_parameters() if name in missing), written=False)


def _refuse_assign(models: PreparedModels, module: nn.Module, state_dict: dict[str, Any], prefix: str) -> None:
    """``load_state_dict(..., assign=True)`` into a model prepared at O2 would put the loaded tensors in place of its
    half parameters or those with masters: the FP32 masters and the optimizer would keep the old ones, and the model
    would hold the loaded dtype. A model made FP32 since (``model.float()`` after the fit: its masters let go) is
    FP32's, and loads as in FP32."""
    name = next(
        (
            prefix + n
            for n, p in module.named_parameters(recurse=False)
            if prefix + n in state_dict and (p.dtype in HALF_DTYPES or models.masters.covered(p))
        ),
        None,
    )
    if name is not None:
        raise ValueError(
            f"load_state_dict(..., assign=True) would replace the parameters of a model prepared at opt_level='O2' "
            f"(first: {name!r}) with the loaded tensors, cutting them off from their FP32 masters and from the "
            "optimizer; load with assign=False (the default): FP32 values go to the masters exactly and the model "
            "takes their rounding."
        )
