"""peft's merges at O2 in FP32: :class:`MergeInFp32`, a peft tuner layer's ``merge``/``unmerge`` (attributes of the
instance, put there with the FP32 state-dict hook,
:class:`~lightning_mpx.integrations.fp32_export.MastersInStateDict`) that run peft's own code on FP32 values (the
adapters' masters, the half base upcast exactly) and round the merged base once, so that ``merge_and_unload()``,
``merge_adapter()`` and ``unmerge_adapter()`` of a model trained at O2 give the half rounding of the FP32 merge, not
peft's merge of the adapters' half copies (rounded, multiplied in half, then added to the half base: two
roundings)."""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from torch import nn

from lightning_mpx.common.dtypes import HALF_DTYPES
from lightning_mpx.engine.amp import Amp

__all__ = ["MergeInFp32", "is_tuner_layer"]

_METHODS = ("merge", "unmerge")


def is_tuner_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a peft tuner layer (a LoRA, DoRA, IA3, LoHa, LoKr... layer: a ``BaseTunerLayer``)."""
    utils = sys.modules.get("peft.tuners.tuners_utils")  # peft imported (a peft model exists): no import here
    layer = getattr(utils, "BaseTunerLayer", None) if utils is not None else None
    return layer is not None and isinstance(module, layer)


class MergeInFp32:
    """A peft tuner layer's ``merge`` or ``unmerge`` (an attribute of the instance: its class and other instances are
    untouched) at O2: peft's own method runs on FP32 stand-ins of the layer's parameters, each adapter's its FP32
    master (the weights training produced; writes to the model since the last step taken first) and each other half
    parameter's its exact upcast (the frozen half base, which O2 keeps no FP32 copy of), put in the layer's modules
    for the call only; what the call wrote (the base layer's weight, a ``lora_bias``'s bias) is then written into the
    model once, rounded to its dtype (and into the master of a parameter that has one, exactly). The result is the
    half rounding of the FP32 merge of the masters, as close to Accelerate's ``"bf16"`` merge as the half base allows.
    Without the engine (gone, another level now) or FP32 values (a copy of the model), peft's method runs as it is. A
    deep copy or pickle of the layer gets the plain method back."""

    def __init__(self, layer: nn.Module, amp: Amp, name: str) -> None:
        self._layer = weakref.ref(layer)  # weakly: the layer holds this
        self._amp = weakref.ref(amp)
        self._name = name

    @classmethod
    def install(cls, layer: nn.Module, amp: Amp) -> _Installed:
        """Put ``merge`` and ``unmerge`` of ``amp`` on ``layer`` in place of earlier ones (not over a method the
        instance holds of its own); the returned handle's ``remove()`` takes them off."""
        wrappers = []
        for name in _METHODS:
            own = layer.__dict__.get(name)
            if (own is not None and not isinstance(own, cls)) or not callable(getattr(type(layer), name, None)):
                continue
            wrapper = cls(layer, amp, name)
            setattr(layer, name, wrapper)
            wrappers.append(wrapper)
        return _Installed(wrappers)

    def remove(self) -> None:
        """Take it off its layer (if still there)."""
        layer = self._layer()
        if layer is not None and layer.__dict__.get(self._name) is self:
            delattr(layer, self._name)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_class_method_of, (self._layer(), self._name))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        layer = self._layer()
        if layer is None:
            raise ReferenceError(f"{self._name} of a peft layer that no longer exists")
        method = getattr(type(layer), self._name)
        amp = self._amp()
        if amp is None or not amp.properties.master_weights or amp.sharded:
            return method(layer, *args, **kwargs)
        amp.refresh_masters()  # writes made to the model since the last step, as the step will take them
        fp32: dict[int, torch.Tensor] = {}
        for weights in amp._masters.prune():
            fp32.update(weights.fp32_values())  # by id of the half parameter: its master (or the FP32 value kept)
        held = [
            (owner, leaf, param)
            for owner in layer.modules()
            for leaf, param in owner._parameters.items()
            if param is not None and param.dtype in HALF_DTYPES
        ]
        if not any(id(param) in fp32 for _, _, param in held):
            return method(layer, *args, **kwargs)  # no master here (a copy, another engine's model now)
        stand_ins = []
        for owner, leaf, param in held:
            value = fp32.get(id(param))
            value = (value if value is not None else param).detach().to(torch.float32, copy=True)
            stand_in = nn.Parameter(value, requires_grad=param.requires_grad)
            stand_ins.append((owner, leaf, param, stand_in, value.clone()))
            owner._parameters[leaf] = stand_in
        try:
            output = method(layer, *args, **kwargs)
        finally:
            written = []
            for owner, leaf, param, stand_in, start in stand_ins:
                now = owner._parameters.get(leaf)  # the stand-in, or what the call set in its place
                owner._parameters[leaf] = param
                value = (now if now is not None else stand_in).detach()
                if value.shape == start.shape and not torch.equal(value, start):
                    written.append((param, value, fp32.get(id(param))))
        with torch.no_grad():
            for param, value, master in written:
                if master is not None and master is not param:
                    master.copy_(value)  # a trained parameter: its master takes the FP32 merge exactly
                param.data.copy_(value)  # once rounded to the half dtype (as peft writes it: through .data)
        return output


def _class_method_of(obj: Any, name: str) -> Any:
    """``obj``'s method ``name`` as its class defines it (what a copy or an unpickled wrapper becomes)."""
    return getattr(type(obj), name).__get__(obj)


class _Installed:
    """The wrappers :meth:`MergeInFp32.install` put on one layer."""

    def __init__(self, wrappers: list[MergeInFp32]) -> None:
        self.wrappers = wrappers

    def remove(self) -> None:
        """Take every wrapper off."""
        for wrapper in self.wrappers:
            wrapper.remove()
