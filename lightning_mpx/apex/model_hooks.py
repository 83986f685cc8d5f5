"""The hooks ``initialize`` puts on each model, in place of Apex's patched ``model.forward``: input and output casts
(O2/O3) and FP32 state dicts (O2/O3), each removable and acting on the module it is called for."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_mpx.apex._state import _amp_state
from lightning_mpx.common.containers import _cast_collection
from lightning_mpx.engine.amp import Amp
from lightning_mpx.engine.preparation import _EngineHook


def _add_model_hooks(
    amp: Amp, model: nn.Module, cast_model_outputs: torch.dtype | None, *, cast_model: bool = True
) -> None:
    """Apex patched ``model.forward``; here: removable hooks on this model instance only. Each hook acts on the
    module it is called for, so a copy of the model (``copy.deepcopy`` for EMA, ``torch.save(model)``) carries hooks
    that act on the copy: its ``state_dict()`` gives its own values (loading into it leaves this model's masters
    alone: the core's load hook acts on the module it is called for too). Apex's patched forward could not be
    pickled; these hooks can."""
    props = amp.properties
    casts = props.casts_model and cast_model
    hooks = _amp_state.hooks.setdefault(model, [])
    if casts:
        hooks.append(model.register_forward_pre_hook(_CastInputs(props.half_dtype), with_kwargs=True))
    out_dtype = cast_model_outputs if cast_model_outputs is not None else (torch.float32 if casts else None)
    if out_dtype is not None:
        hooks.append(model.register_forward_hook(_CastOutputs(out_dtype)))
    if props.master_weights or casts:  # O2 and O3: Apex's state dicts were FP32 whenever it cast the model
        hooks.append(model.register_state_dict_post_hook(_Fp32StateDict(amp)))


class _CastInputs:
    """Forward pre-hook: the model's floating-point inputs cast to its half dtype (Apex's ``to_type``: every floating
    dtype, the other half one included: bfloat16 data into a float16 model)."""

    def __init__(self, half: torch.dtype) -> None:
        self.half = half
        self.castable = tuple(d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16) if d != half)

    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        self._check_still_half(module)
        return _apex_cast(args, self.half, self.castable), _apex_cast(kwargs, self.half, self.castable)


    def _check_still_half(self, module: nn.Module) -> None:
        """A model converted after ``initialize`` (``model.float()``, ``.to(torch.float32)``, ``.half()`` under
        bfloat16) would meet its half inputs in the first matmul, with torch's dtype-mismatch error: say why."""
        found = None
        for param in module.parameters():
            if param.dtype == self.half:
                return
            if found is None and param.is_floating_point():
                found = param.dtype
        if found is not None:
            raise RuntimeError(
                f"model: amp.initialize() cast its parameters to {self.half} and casts its inputs to it, but none is "
                f"{self.half} now (found {found}): the model was converted after amp.initialize() (model.float(), "
                "model.half(), model.to(dtype)). Convert it before amp.initialize(), or pass it to amp.initialize() "
                "again."
            )


class _CastOutputs:
    """Forward hook: the model's floating-point outputs cast to ``dtype`` (FP32 by default, as in Apex)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.castable = tuple(d for d in (torch.float16, torch.bfloat16, torch.float32) if d != dtype)

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        return _apex_cast(output, self.dtype, self.castable)


#: Types that are never a custom batch: a list, tuple or dict of only these takes the core's cast whole.
_PLAIN = frozenset({torch.Tensor, int, float, bool, str, type(None)})


def _apex_cast(data: Any, dtype: torch.dtype, castable: tuple[torch.dtype, ...]) -> Any:
    """Apex's ``applier``: the core's container casts, plus a custom batch object with a ``to`` method (advanced.rst,
    "Custom data batch types") given ``data.to(dtype)``, also inside lists, tuples and dicts. Mappings, dataclasses
    and namedtuples keep the core's cast of their tensors (a Hugging Face ``BatchEncoding``'s ``to`` moves devices
    only)."""
    kind = type(data)
    if kind is torch.Tensor:
        return _cast_collection(data, dtype, castable)
    if kind is list or kind is tuple:
        if set(map(type, data)) <= _PLAIN:  # tensors and scalars (the usual batch): the core's cast, no call per item
            return _cast_collection(data, dtype, castable)
        return kind(_apex_cast(value, dtype, castable) for value in data)
    if kind is dict:
        if set(map(type, data.values())) <= _PLAIN:  # (as above; the usual empty kwargs too)
            return _cast_collection(data, dtype, castable)
        return {key: _apex_cast(value, dtype, castable) for key, value in data.items()}
    if _custom_batch(data):
        return data.to(dtype)
    return _cast_collection(data, dtype, castable)


def _custom_batch(data: Any) -> bool:
    """Whether Apex's patched forward called ``data.to(dtype)``: an object with a ``to`` method that is not a tensor,
    an array, a string, a module, or a container the core already rebuilds."""
    if isinstance(data, (torch.Tensor, str, bytes, nn.Module, Mapping, tuple)):
        return False
    if not callable(getattr(data, "to", None)):
        return False
    return not dataclasses.is_dataclass(data) and type(data).__module__ != "numpy"


class _Fp32StateDict(_EngineHook):
    """O2/O3: ``model.state_dict()`` holds FP32 tensors as in Apex; a parameter with a master gives the master's
    exact value (Apex gave the half value cast up), so a checkpoint resumes bit-exactly."""

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        amp = self.engine()
        if amp is not None:
            amp.refresh_masters()  # writes made to the half model since the last step
        params = {prefix + name: p for name, p in module.named_parameters()}
        for key, value in list(state_dict.items()):
            if not torch.is_tensor(value) or value.dtype not in (torch.float16, torch.bfloat16):
                continue
            param = params.get(key)
            master = amp.master_of(param, refresh=False) if amp is not None and param is not None else None
            if master is param:  # no master made yet (no optimizer holds it): the FP32 value kept for it, if any
                master = next((v for w in amp.master_weights if w.covers(param) for v in [w.fp32_value(param)]), None)
            state_dict[key] = master.detach().clone() if master is not None and master is not param else value.float()
