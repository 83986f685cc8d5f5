"""A prepared model's ``forward`` under the opt level, for the Accelerate adapter
(:mod:`lightning_mpx.integrations.accelerate`).

:class:`AmpForward` replaces ``forward`` on the prepared instance only (as Accelerate's own autocast wrapper), and
keeps what a copy of the model needs to run the same casts with an engine of its own (a deep copy, a pickle).
"""

from __future__ import annotations

import copy
import functools
import types
import weakref
from typing import Any, Callable

import torch
from torch import nn

from lightning_mpx.casting.boundary import DtypeProbe
from lightning_mpx.casting.replicas import bound_weakly
from lightning_mpx.casting.table import _NAMESPACES as _TABLE_NAMESPACES
from lightning_mpx.casting.table import CastTable
from lightning_mpx.casting.targets import cast_model_inputs
from lightning_mpx.common.containers import _cast_collection
from lightning_mpx.common.imports import require
from lightning_mpx.engine.amp import Amp
from lightning_mpx.engine.optimizer_state import optimizer_params
from lightning_mpx.integrations.fp32_export import MastersInStateDict
from lightning_mpx.masters.rank_zero import agree_on_rank_zero, several_ranks

require("accelerate", feature="lightning_mpx.accelerate")
from accelerate.utils import extract_model_from_parallel, is_compiled_module  # type: ignore[import-untyped]  # noqa: E402

__all__ = ["AmpForward", "AmpGenerate", "engine_of", "install_forward", "release_optimizers", "take_over"]


class AmpForward:
    """A prepared model's ``forward`` under the opt level: ``Amp.forward_context`` around it (O1's cast policy; at O2,
    loss functions in FP32), O2/O3's float inputs cast to half; half outputs cast to FP32 (as Accelerate's own
    wrapper) so that the loss is computed in FP32.

    A deep copy or pickle of the model (``AveragedModel``, an EMA model) gets a forward with an engine of its own
    whose O2/O3 casts follow the copy's own dtype (:class:`~lightning_mpx.casting.boundary.DtypeProbe`): a copy
    converted with ``.float()`` runs as a plain FP32 model."""

    def __init__(self, forward: Callable[..., Any], amp: Amp) -> None:
        # __wrapped__ is the plain function, so that Accelerate's unwrap_model(keep_fp32_wrapper=False) can restore it.
        module = getattr(forward, "__self__", None)
        probe = DtypeProbe(amp.half_dtype, module) if isinstance(module, nn.Module) else None
        self._init(forward, amp, probe)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        amp = self._amp
        if amp.properties.casts_model:
            dtype = amp.half_dtype if self._probe is None else self._probe.dtype(self._forward.__self__)
            if dtype is None:  # a copy converted to FP32: nothing to cast
                return self._forward(*args, **kwargs)
            # Each cast noted with its source on the policy until its scope ends: a loss computed inside the model
            # from a float labels= takes the source's values at O2 and O3 (casting.targets); compute keeps half.
            args, kwargs = cast_model_inputs(amp.policy, (args, kwargs), dtype)
        with amp.forward_context():
            output = self._forward(*args, **kwargs)
        # Accelerate's convert_to_fp32 loses defaultdicts and skips dataclasses; this keeps every container's type.
        return _cast_collection(output, torch.float32, (torch.float16, torch.bfloat16))

    def __getstate__(self) -> dict[str, Any]:
        # What the forward needs, not the engine (its masters, optimizers and scales stay with the original): a
        # pickled model gets an engine of its own with the same casts. The table travels as names, resolved
        # again on load (torch's functions pickle by name only where torch allows it).
        policy = self._amp.policy
        data: dict[str, dict[str, list[str]]] = {}
        extra: list[tuple[Any, str]] = []
        for entry in policy.table if policy is not None else ():
            if entry.namespace in _TABLE_NAMESPACES:
                data.setdefault(entry.namespace, {}).setdefault(entry.category, []).append(entry.name)
            else:
                extra.append((entry.function, entry.category))  # a user's @dispatchable: pickled by reference
        return {
            "forward": self._forward,
            "properties": self._amp.properties,
            "table": (data, extra) if policy is not None else None,
            "allow_banned": policy.allow_banned if policy is not None else False,
            "probe": self._probe,  # pickled as the copy's: it follows the copy's own dtype
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        table = None
        if state["table"] is not None:
            data, extra = state["table"]
            table = CastTable.from_data({ns: {c: tuple(names) for c, names in by.items()} for ns, by in data.items()})
            for function, category in extra:
                table.register(function, category)
        engine = _engine_for_forward(state["properties"], table, state["allow_banned"])
        self._init(state["forward"], engine, state.get("probe"))

    def __deepcopy__(self, memo: dict[int, Any]) -> AmpForward:
        # A deepcopy (AveragedModel, EMA callbacks) forwards through the copied model, with an engine of its own.
        policy = self._amp.policy
        engine = _engine_for_forward(
            self._amp.properties,
            policy.table.copy() if policy is not None else None,
            policy.allow_banned if policy is not None else False,
        )
        twin = type(self).__new__(type(self))
        twin._init(copy.deepcopy(self._forward, memo), engine, copy.deepcopy(self._probe, memo))
        return twin

    def for_replica(self, model: nn.Module, replica: nn.Module) -> AmpForward:
        """This forward for ``replica``, an ``nn.DataParallel`` replica of ``model``
        (:mod:`lightning_mpx.casting.replicas`): the same engine, the forward bound to the replica (which holds no
        parameters of its own to probe: the engine's half dtype)."""
        twin = type(self).__new__(type(self))
        twin.__dict__.update(self.__dict__)  # (its functools.update_wrapper attributes)
        if getattr(self._forward, "__self__", None) is model:  # bound weakly: no cycle through the replica
            twin._forward = bound_weakly(self._forward.__func__, replica)  # type: ignore[attr-defined]
        twin._probe = None
        return twin

    def _init(self, forward: Callable[..., Any], amp: Amp, probe: DtypeProbe | None) -> None:
        self._forward = forward
        self._amp = amp
        self._probe = probe
        functools.update_wrapper(self, getattr(forward, "__func__", forward))


class AmpGenerate(AmpForward):
    """A prepared model's ``generate`` at O2/O3: its float inputs cast to the model's half dtype (Whisper's
    ``input_features``, which ``generate`` hands to its encoder itself, outside ``forward``) and its half outputs to
    FP32, without the forward's scope: a mode on the stack for the whole call would be handed every torch call of the
    decoding loop (each token's logits processing, sampling and cache updates: +27% Python calls per token at O2, +87%
    at O1), while each step's ``forward`` enters the scope itself. The casts are plain (no source noted: ``generate``
    takes no labels)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        dtype = self._amp.half_dtype if self._probe is None else self._probe.dtype(self._forward.__self__)
        if dtype is None:  # a copy converted to FP32: nothing to cast
            return self._forward(*args, **kwargs)
        args, kwargs = _cast_collection((args, kwargs), dtype, (torch.float32, torch.float64))
        output = self._forward(*args, **kwargs)
        return _cast_collection(output, torch.float32, (torch.float16, torch.bfloat16))


def _engine_for_forward(properties: Any, table: CastTable | None, allow_banned: bool) -> Amp:
    """An :class:`Amp` with ``properties`` and ``table``, for a copied model's forward (no models, no optimizers)."""
    return Amp(
        properties.opt_level,
        half_dtype=properties.half_dtype,
        cast_table=table if properties.patch_torch_functions else None,  # O2's loss-only table is made by Amp
        allow_banned=allow_banned,
        cast_model_type=properties.cast_model_type,
        patch_torch_functions=properties.patch_torch_functions,
        keep_batchnorm_fp32=properties.keep_batchnorm_fp32,
        master_weights=properties.master_weights,
        loss_scale=properties.loss_scale,
    )


def install_forward(amp: Amp, model: nn.Module) -> None:
    """Replace ``model``'s forward with an :class:`AmpForward` of ``amp``, where the opt level casts anything."""
    if amp.properties.patch_torch_functions or amp.properties.casts_model:
        # An instance attribute, as Accelerate's own autocast wrapper: the class and other instances are untouched,
        # and unwrap_model(model, keep_fp32_wrapper=False) removes it through _original_forward.
        # A torch.compile'd model gets it on its original module, inside the compiled region: the policy is
        # traced into the graph and no mode is left on the stack while the compiled code runs.
        target = model._orig_mod if is_compiled_module(model) else model
        generate = target.__dict__.get("generate")
        if isinstance(generate, AmpForward):
            # One left by an earlier engine (Accelerate's unwrap_model(keep_fp32_wrapper=False) restores forward
            # only): replaced, not wrapped again.
            target.generate = generate._forward  # type: ignore[method-assign]
        restore = _ForwardRestore(target)
        target._original_forward = target.forward  # type: ignore[assignment]
        target.forward = restore.forward = AmpForward(target.forward, amp)
        if amp.properties.casts_model and callable(getattr(type(target), "generate", None)):
            # A Hugging Face model's generate() runs its encoder itself (Whisper: get_encoder()(input_features)),
            # outside forward: at O2/O3 its float inputs are cast to half too (AmpGenerate; at O1 the model is FP32).
            target.generate = AmpGenerate(target.generate, amp)  # type: ignore[method-assign]
        # Another engine taking the model over (a later stage's Trainer, Fabric or Amp, at O2 with these masters)
        # takes this forward off it with this engine's hooks: its own rules then apply alone.
        amp._models.hold(model, restore)


class _ForwardRestore:
    """Puts back on ``target`` the ``forward`` (and ``_original_forward``) it had before :func:`install_forward`
    (``remove()``), while the forward installed is still there.

    Refers to nothing that refers to ``target`` (its own bound methods are kept as their functions, the installed
    forward weakly): the engine keeps it in a dictionary weakly keyed by the model (``PreparedModels.hold``), whose
    entry a strong reference would keep, and the model with it, for as long as the engine lives."""

    def __init__(self, target: nn.Module) -> None:
        self._target = weakref.ref(target)
        keys = ("forward", "_original_forward", "generate")
        self._before = {key: _unbound(target.__dict__.get(key), target) for key in keys}
        self._forward: weakref.ref[AmpForward] | None = None

    @property
    def forward(self) -> AmpForward | None:
        """The forward installed (``None`` once it is gone or was taken off)."""
        return self._forward() if self._forward is not None else None

    @forward.setter
    def forward(self, value: AmpForward | None) -> None:
        self._forward = weakref.ref(value) if value is not None else None

    def remove(self) -> None:
        target, forward = self._target(), self.forward
        if target is None or forward is None or target.__dict__.get("forward") is not forward:
            return
        for key, (value, bound) in self._before.items():
            if value is None:
                target.__dict__.pop(key, None)
            else:
                target.__dict__[key] = value.__get__(target) if bound else value
        self.forward = None


def _unbound(value: Any, target: nn.Module) -> tuple[Any, bool]:
    """``value`` and ``False``, or its function and ``True`` when it is a method bound to ``target``."""
    if isinstance(value, types.MethodType) and value.__self__ is target:
        return value.__func__, True
    return value, False


def engine_of(model: nn.Module, default: Amp) -> Amp:
    """The engine whose forward ``model`` runs (the one that prepared it, which holds its masters: after
    ``Accelerator.free_memory()`` the previous engine until the model is prepared again), else ``default``."""
    inner = extract_model_from_parallel(model, keep_fp32_wrapper=True, keep_torch_compile=True)
    target = inner._orig_mod if is_compiled_module(inner) else inner
    forward = target.__dict__.get("forward")
    return forward._amp if isinstance(forward, AmpForward) else default


def take_over(amp: Amp, model: nn.Module, *, train: bool, rank_zero_fp32: bool = False) -> nn.Module | None:
    """Hand ``model`` to ``amp`` when another engine prepared it, and return the module that ``amp`` prepared
    (``None``: nothing to hand over).

    A model keeps its converted parameters and the forward of the engine that prepared it after
    ``Accelerator.free_memory()`` (or a pickle) gives the Accelerator a fresh engine; preparing it again is the habit
    of a training function that is retried (``find_executable_batch_size``). The new engine prepares it, its forward
    is replaced, and at O2 the new masters start from the old engine's FP32 masters, exactly (a copy's engine, of a
    pickle or a deep copy, has none: they start from the half weights).

    ``rank_zero_fp32`` (call it on every rank together): under a process group the masters start from rank zero's
    values on every rank (one broadcast, ``masters/rank_zero.py``), as ``prepare`` does; each rank's own would differ
    where one rank loaded other weights (a checkpoint read on rank 0 only), and a model kept wrapped is not
    broadcast by DDP again."""
    inner = extract_model_from_parallel(model, keep_fp32_wrapper=True, keep_torch_compile=True)
    target = inner._orig_mod if is_compiled_module(inner) else inner
    forward = target.__dict__.get("forward")
    if not isinstance(forward, AmpForward) or forward._amp is amp:
        return None
    old, weights = forward._amp, {}
    _refuse_if_still_trained(old, inner)
    evaluated: set[int] = set()
    frozen: set[int] = set()
    if amp.properties.master_weights and train and not old.sharded:  # FSDP: its sharded FP32 parameters
        # Made half by the old engine for evaluation only (no master covers them, no FP32 value was kept): their new
        # masters start from the rounding, which is warned about as at their first preparation for training.
        evaluated = {
            id(param) for param in inner.parameters()
            if old.made_half(param) and not any(masters.covers(param) for masters in old.master_weights)
        }  # fmt: skip
        frozen = _frozen_without_fp32(old, inner)  # frozen when the old engine cast them: the same, as "frozen"
        # The old engine's FP32 values where they hold more than the half weights: its masters, and the FP32 values it
        # kept for masters not made yet (a model prepared for training before any optimizer). A copy's forward-only
        # engine has neither: its half values are the weights.
        fp32 = old.fp32_state_dict(inner)
        named = dict(inner.named_parameters())
        if rank_zero_fp32 and several_ranks():  # rank zero's value (its master, else its half weight) on every rank
            names = {id(param): name for name, param in named.items()}
            agreed = agree_on_rank_zero(inner, lambda param: fp32.get(names[id(param)], param.detach().float()))
            weights = {name: agreed[id(param)] for name, param in named.items() if id(param) in agreed}
        else:
            weights = {
                name: fp32[name]
                for name, param in named.items()
                if param.requires_grad and name in fp32 and not torch.equal(fp32[name], param.detach().float())
            }
    target.forward = target.__dict__.pop("_original_forward", forward._forward)
    amp.prepare_model(inner, train=train)
    for masters in amp.master_weights if evaluated or frozen else ():
        masters.note_rounded(evaluated, cause="evaluation")
        masters.note_rounded(frozen)
    install_forward(amp, inner)
    if amp.properties.master_weights:  # its state_dict() gives this engine's masters, not the old one's
        MastersInStateDict.install(inner, amp)
    if weights:
        inner.load_state_dict(weights, strict=False)  # FP32 values go to the new masters exactly
    return inner


def _frozen_without_fp32(old: Amp, model: nn.Module) -> set[int]:
    """The ids of the parameters of ``model`` that ``old`` made half while they were frozen, keeping no FP32 value
    (its masters cover them, with none made): the new engine finds them half already, and a master made for one
    later (unfrozen after ``free_memory()``) starts from the rounding, warned about as in the old engine."""
    return {
        id(param) for param in model.parameters()
        if old.made_half(param)
        and (covering := [masters for masters in old.master_weights if masters.covers(param)])
        and all(masters.fp32_value(param) is None for masters in covering)
    }  # fmt: skip


def release_optimizers(amp: Amp) -> None:
    """Forget every optimizer ``amp`` steps (``Accelerator.free_memory()`` replaces the engine), each one's state
    moved from its FP32 masters back to the model's parameters: an optimizer prepared again (a retried training
    function that kept it) goes on with its state (Adam's moments, step count) in the next engine, whose masters
    start from these, and the old engine's hooks no longer refuse its steps."""
    for optimizer_state in list(amp._optimizers.values()):
        optimizer = optimizer_state.optimizer_ref()
        if optimizer is not None:
            amp.release_optimizer(optimizer)  # its state goes back to the model's parameters


def _refuse_if_still_trained(old: Amp, model: nn.Module) -> None:
    """Refuse to take ``model`` from ``old`` while an optimizer of ``old`` still trains it (another Accelerator's,
    not released by its ``free_memory()``): both engines would write their own weights into the model."""
    params = {id(param) for param in model.parameters()}
    names = []
    for optimizer_state in old._optimizers.values():
        optimizer = optimizer_state.optimizer_ref()
        if optimizer is not None and any(id(param) in params for param in optimizer_params(optimizer)):
            names.append(type(optimizer).__name__)
    if names:
        raise RuntimeError(
            f"model={type(model).__name__} was prepared by another Accelerator (or Amp) whose optimizer(s) "
            f"{names} still train it: both engines would write their own weights into it (at O2 each from its own FP32 "
            "masters). Call free_memory() on the Accelerator that prepared it first (it releases its optimizers), "
            "or go on training it with that Accelerator. A transformers Trainer (mpx_trainer) made earlier over this "
            "model holds that Accelerator: call trainer.accelerator.free_memory() on the earlier Trainer, or drop it "
            "(del trainer), before the next one trains."
        )
