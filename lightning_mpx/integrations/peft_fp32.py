"""peft's own code run on FP32 values at O2, where it reads or writes a model's weights outside the forward:

* :class:`MergeInFp32`: a peft tuner layer's ``merge``/``unmerge`` runs on the adapters' FP32 masters and the half
  base upcast exactly, and the merged base is rounded once, so that ``merge_and_unload()``, ``merge_adapter()`` and
  ``unmerge_adapter()`` of a model trained at O2 give the half rounding of the FP32 merge, not peft's merge of the
  adapters' half copies (rounded, multiplied in half, then added to the half base: two roundings);
* :class:`CombineInFp32`: a LoRA model's ``add_weighted_adapter`` reads the adapters it combines as their FP32
  masters, so that the new adapter (and a merge of it) is what FP32 training's gives, not a combination of the
  adapters' half copies (``"linear"``: rounded twice; ``"svd"``: an SVD of the rounded products);
* :class:`AllocateInFp32`: AdaLoRA's ``update_and_allocate`` reads the adapters as their FP32 masters and their
  gradients as FP32 training holds them (:meth:`Amp.true_grads <lightning_mpx.engine.amp.Amp.true_grads>`: at O2 the
  half gradients keep the loss scale after the step), so that its importance scores, and the ranks it masks, are
  FP32's with float16 and a changing scale too; its masks are written into the masters exactly.

Both are attributes of the instance (its class and other instances untouched), put there with the FP32 state-dict
hook, :class:`~lightning_mpx.integrations.fp32_export.MastersInStateDict` (every door at O2). Without the engine
(gone, another level now) or FP32 values (a copy of the model), peft's method runs as it is; a deep copy or pickle of
the module gets the plain method back."""

from __future__ import annotations

import abc
import sys
import weakref
from typing import Any, Callable

import torch
from torch import nn

from lightning_mpx.common.dtypes import HALF_DTYPES
from lightning_mpx.engine.amp import Amp

__all__ = [
    "AllocateInFp32",
    "CombineInFp32",
    "MergeInFp32",
    "holds_own",
    "is_adalora_model",
    "is_lora_model",
    "is_tuner_layer",
]


def is_tuner_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a peft tuner layer (a LoRA, DoRA, IA3, LoHa, LoKr... layer: a ``BaseTunerLayer``)."""
    utils = sys.modules.get("peft.tuners.tuners_utils")  # peft imported (a peft model exists): no import here
    layer = getattr(utils, "BaseTunerLayer", None) if utils is not None else None
    return layer is not None and isinstance(module, layer)


def is_adalora_model(module: nn.Module) -> bool:
    """Whether ``module`` is peft's AdaLoRA tuner (``peft_model.base_model``, whose ``update_and_allocate`` the
    training loop calls)."""
    adalora = sys.modules.get("peft.tuners.adalora.model")
    model = getattr(adalora, "AdaLoraModel", None) if adalora is not None else None
    return model is not None and isinstance(module, model)


def is_lora_model(module: nn.Module) -> bool:
    """Whether ``module`` is peft's LoRA tuner (``peft_model.base_model``, whose ``add_weighted_adapter`` combines
    adapters; AdaLoRA's is one too)."""
    lora = sys.modules.get("peft.tuners.lora.model")
    model = getattr(lora, "LoraModel", None) if lora is not None else None
    return model is not None and isinstance(module, model)


class _OnFp32(abc.ABC):
    """A method of a peft module, as an attribute of the instance, that runs the class's method on FP32 stand-ins of
    the module's half parameters (see the subclasses)."""

    methods: tuple[str, ...] = ()

    def __init__(self, module: nn.Module, amp: Amp, name: str) -> None:
        self._module = weakref.ref(module)  # weakly: the module holds this
        self._amp = weakref.ref(amp)
        self._name = name

    @classmethod
    def install(cls, module: nn.Module, amp: Amp) -> _Installed:
        """Put the methods of ``amp`` on ``module`` in place of earlier ones (not over a method the instance holds of
        its own); the returned handle's ``remove()`` takes them off."""
        wrappers = []
        for name in cls.methods:
            if holds_own(module, name, _OnFp32) or not callable(getattr(type(module), name, None)):
                continue
            wrapper = cls(module, amp, name)
            setattr(module, name, wrapper)
            wrappers.append(wrapper)
        return _Installed(wrappers)

    def remove(self) -> None:
        """Take it off its module (if still there)."""
        module = self._module()
        if module is not None and module.__dict__.get(self._name) is self:
            delattr(module, self._name)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_class_method_of, (self._module(), self._name))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()
        if module is None:
            raise ReferenceError(f"{self._name} of a peft module that no longer exists")
        method = getattr(type(module), self._name)
        amp = self._amp()
        if amp is None or not amp.properties.master_weights or amp.sharded:
            return method(module, *args, **kwargs)
        return self._run(amp, module, lambda: method(module, *args, **kwargs), args, kwargs)

    @abc.abstractmethod
    def _run(self, amp: Amp, module: nn.Module, call: Callable[[], Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        """``call()`` (the class's method on ``module``, given ``args`` and ``kwargs``) run on FP32 stand-ins, as the
        subclass says."""


class MergeInFp32(_OnFp32):
    """A peft tuner layer's ``merge`` or ``unmerge`` at O2: peft's own method runs on FP32 stand-ins of the layer's
    half parameters, each adapter's its FP32 master (the weights training produced; writes to the model since the
    last step taken first) and each other one's its exact upcast (the frozen half base, which O2 keeps no FP32 copy
    of), put in the layer's modules for the call only; what the call wrote (the base layer's weight, a
    ``lora_bias``'s bias) is then written into the model once, rounded to its dtype (and into the master of a
    parameter that has one, exactly): the half rounding of the FP32 merge of the masters. ``merge(safe_merge=True)``
    refuses a merge whose FP32 values are finite but overflow the half dtype once rounded (peft's merge in half
    refuses it, non-finite there), with a ``ValueError`` before anything is written or noted as merged."""

    methods = ("merge", "unmerge")

    def _run(self, amp: Amp, module: nn.Module, call: Callable[[], Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        safe = self._name == "merge" and bool(kwargs.get("safe_merge", args[0] if args else False))
        merged = list(getattr(module, "merged_adapters", ()))
        try:
            return _on_fp32(amp, module, call, mastered_only=False, finite=safe)
        except _RoundedToNonFinite as error:  # nothing written: nothing merged either
            if isinstance(getattr(module, "merged_adapters", None), list):
                module.merged_adapters[:] = merged
            raise ValueError(str(error)) from None


class AllocateInFp32(_OnFp32):
    """AdaLoRA's ``update_and_allocate`` (on ``peft_model.base_model``) at O2: peft's own method runs on FP32
    stand-ins of the adapters (their masters), whose ``.grad`` is the true FP32 gradient
    (:meth:`Amp.true_grads <lightning_mpx.engine.amp.Amp.true_grads>`), put in the model for the call only; the
    ``lora_E`` entries it masks are written into the masters exactly and into the model rounded. Its importance
    scores are so FP32's (at float16 too, where the half gradients keep a changing loss scale after the step), and
    its running averages of them FP32 tensors, as under FP32 training."""

    methods = ("update_and_allocate",)

    def _run(self, amp: Amp, module: nn.Module, call: Callable[[], Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        return _on_fp32(amp, module, call, mastered_only=True)


class CombineInFp32(_OnFp32):
    """A LoRA model's ``add_weighted_adapter`` (on ``peft_model.base_model``) at O2: peft's own method runs with the
    adapters' FP32 masters standing in for their half copies, put in the model for the call only; the new adapter it
    makes is what peft makes from FP32 adapters (``"linear"``, ``"svd"`` and the other task-arithmetic kinds give FP32
    tensors, which it stores as they are, as under FP32 training; ``"cat"`` writes them into the new adapter's half
    weights, rounded once), so that ``merge_and_unload()`` of it is the rounding of FP32's merge. The adapters it reads
    are not written."""

    methods = ("add_weighted_adapter",)

    def _run(self, amp: Amp, module: nn.Module, call: Callable[[], Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        return _on_fp32(amp, module, call, mastered_only=True, grads=False)


class _RoundedToNonFinite(Exception):
    """A value :func:`_on_fp32` was to write is finite in FP32 and not in the parameter's half dtype."""


def _on_fp32(
    amp: Amp,
    module: nn.Module,
    call: Callable[[], Any],
    *,
    mastered_only: bool,
    finite: bool = False,
    grads: bool | None = None,
) -> Any:
    """``call()`` with each half parameter of ``module`` replaced, in its owner's ``_parameters``, by an FP32 stand-in
    (its master, or the FP32 value kept for it; else, unless ``mastered_only``, its exact upcast), whose ``.grad`` is
    the true gradient where ``mastered_only`` (unless ``grads`` is ``False``); then the stand-ins written (in place, or
    set anew) go to the model: into the master exactly, into the half parameter rounded. No FP32 value for any of
    them: ``call()`` as it is. ``finite``: raise :class:`_RoundedToNonFinite`, writing nothing, when a finite value
    written rounds to inf."""
    amp.refresh_masters()  # writes made to the model since the last step, as the step will take them
    fp32: dict[int, torch.Tensor] = {}
    for weights in amp._masters.prune():
        fp32.update(weights.fp32_values())  # by id of the half parameter: its master (or the FP32 value kept)
    held = [
        (owner, leaf, param)
        for owner in module.modules()
        for leaf, param in owner._parameters.items()
        if param is not None and param.dtype in HALF_DTYPES and (id(param) in fp32 or not mastered_only)
    ]
    if not any(id(param) in fp32 for _, _, param in held):
        return call()  # no master here (a copy, another engine's model now)
    with_grads = mastered_only if grads is None else grads
    true = amp.true_grads([param for _, _, param in held]) if with_grads else [None] * len(held)
    stand_ins = []
    for (owner, leaf, param), grad in zip(held, true):
        value = fp32.get(id(param))
        value = (value if value is not None else param).detach().to(torch.float32, copy=True)
        stand_in = nn.Parameter(value, requires_grad=param.requires_grad)
        if grad is not None:
            stand_in.grad = grad.to(torch.float32)
        # a merge writes through .data (no version moves: compared), AdaLoRA's masks in place (versions)
        start = None if mastered_only else value.clone()
        stand_ins.append((owner, leaf, param, stand_in, stand_in._version, start))
        owner._parameters[leaf] = stand_in
    try:
        output = call()
    finally:
        written = []
        for owner, leaf, param, stand_in, version, start in stand_ins:
            now = owner._parameters.get(leaf)  # the stand-in, or what the call set in its place
            owner._parameters[leaf] = param
            value = (now if now is not None else stand_in).detach()
            if (
                now is not stand_in
                or stand_in._version != version
                or (start is not None and value.shape == start.shape and not torch.equal(value, start))
            ):
                written.append((param, value, fp32.get(id(param))))
    if finite:  # (a merge's few tensors, once per merge)
        overflowed = [p for p, v, _ in written if not torch.isfinite(v.to(p.dtype)).all() and torch.isfinite(v).all()]
        if overflowed:
            names = {id(p): name for name, p in module.named_parameters()}
            raise _RoundedToNonFinite(
                f"NaNs detected in the merged weights: {', '.join(names.get(id(p), '?') for p in overflowed)} "
                f"overflow {overflowed[0].dtype} once rounded (the FP32 merge of the adapters' masters is finite, "
                "its rounding to the model's half dtype is not), so safe_merge=True merged nothing, as peft's merge "
                "in the half dtype refuses it. To merge, load the base model in FP32 and merge the adapter into it."
            )
    with torch.no_grad():
        for param, value, master in written:
            if value.shape != param.shape:
                continue  # (a resize: not this module's to make)
            if master is not None:
                master.copy_(value)  # a trained parameter: its master takes the FP32 value exactly
            param.data.copy_(value)  # once rounded to the half dtype (as peft writes it: through .data)
    return output


def _class_method_of(obj: Any, name: str) -> Any:
    """``obj``'s method ``name`` as its class defines it (what a copy or an unpickled wrapper becomes; read from the
    class: an object being unpickled has no state yet)."""
    return getattr(type(obj), name).__get__(obj)


def holds_own(module: nn.Module, name: str, kind: type) -> bool:
    """Whether ``module`` holds an attribute ``name`` of its own that a wrapper of ``kind`` must not replace: not one
    of ``kind``, nor the class's method bound to ``module`` that a deep copy or pickle of such a wrapper becomes (a
    copy prepared again at O2 gets its wrappers back)."""
    own = module.__dict__.get(name)
    if own is None or isinstance(own, kind):
        return False
    return not (
        getattr(own, "__self__", None) is module and getattr(own, "__func__", None) is getattr(type(module), name, None)
    )


class _Installed:
    """The wrappers :meth:`_OnFp32.install` put on one module."""

    def __init__(self, wrappers: list[_OnFp32]) -> None:
        self.wrappers = wrappers

    def remove(self) -> None:
        """Take every wrapper off."""
        for wrapper in self.wrappers:
            wrapper.remove()
