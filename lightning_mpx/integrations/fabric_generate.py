"""A set-up model's ``generate`` at O2/O3 under Fabric: its float inputs cast to the model's half dtype.

Fabric calls ``generate`` on the module itself (single device), not through ``_FabricModule.forward`` and the
precision's ``convert_input``: a Hugging Face ``generate`` that hands a float input to its encoder itself (Whisper's
``input_features``) would meet half weights with FP32 inputs. :func:`install_generate` gives the set-up module a
``generate`` of its own (an instance attribute, as the Accelerate adapter's ``AmpGenerate``): the casts only, once per
call, no scope (each step's forward enters its own), so a generated token costs what it did.

The attribute is a bound method (``types.MethodType``), so that ``_FabricModule.mark_forward_method("generate")`` and
its DDP call tracker see the method they expect; it is bound to a :class:`_ModuleRef`, which holds the module weakly,
not to the module itself, so that the module holding its own method makes no reference cycle (a model the user drops
is freed at once, and the engine lets its masters go, as without the method). A deep copy binds the same casts to
the copy, which then follow the copy's own parameters (none once it is converted to FP32); a pickle restores the
class's ``generate``.
"""

from __future__ import annotations

import types
import weakref
from typing import Any, Callable

import torch
from torch import nn

from lightning_mpx.common.containers import _cast_collection
from lightning_mpx.common.dtypes import HALF_DTYPES

__all__ = ["HalfGenerate", "install_generate"]

_FLOATS = (torch.float32, torch.float64)


class HalfGenerate:
    """``generate`` (the class's function) with the bound module's float inputs cast to its half dtype and its half
    outputs to FP32, as Fabric's forward casts them.

    Args:
        generate: The function to call with the module first (``type(module).generate``).
        module: The set-up module (held weakly): its casts are to ``dtype``; any other (a deep copy) follows its own
            first floating parameter.
        dtype: The engine's half dtype.
    """

    def __init__(self, generate: Callable[..., Any], module: nn.Module, dtype: torch.dtype) -> None:
        self.generate = generate
        self._module = weakref.ref(module)
        self._dtype = dtype
        self.__name__ = "generate"  # a bound method's name (its pickle looks the class's generate up by it)
        self.__doc__ = getattr(generate, "__doc__", None)

    def __call__(self, bound: Any, *args: Any, **kwargs: Any) -> Any:
        module = bound.ref() if isinstance(bound, _ModuleRef) else bound
        if module is None:
            raise ReferenceError("generate() of a module that no longer exists")
        if self._module() is module:
            dtype: torch.dtype | None = self._dtype
        else:  # a copy: its own dtype, none once converted to FP32
            first = next((p for p in module.parameters() if p.is_floating_point()), None)
            dtype = first.dtype if first is not None and first.dtype in HALF_DTYPES else None
        if dtype is None:
            return self.generate(module, *args, **kwargs)
        args, kwargs = _cast_collection((args, kwargs), dtype, _FLOATS)
        output = self.generate(module, *args, **kwargs)
        return _cast_collection(output, torch.float32, (torch.float16, torch.bfloat16))


class _ModuleRef:
    """What a :class:`HalfGenerate` method is bound to: its module, held weakly (the module holds the method). A deep
    copy of the module gives the copy's method a reference to the copy; a pickle, the module itself (whose
    ``getattr(module, "generate")`` is then the class's)."""

    __slots__ = ("ref", "__weakref__")

    def __init__(self, module: nn.Module) -> None:
        self.ref = weakref.ref(module)

    def __deepcopy__(self, memo: dict[int, Any]) -> _ModuleRef:
        module = self.ref()
        copied = memo.get(id(module)) if module is not None else None
        return _ModuleRef(copied if copied is not None else module)  # type: ignore[arg-type]

    def __reduce__(self) -> tuple[Any, ...]:
        return (_same, (self.ref(),))


def _same(obj: Any) -> Any:
    return obj


def install_generate(module: nn.Module, dtype: torch.dtype | None) -> None:
    """Give ``module`` a :class:`HalfGenerate` of ``dtype`` when its class has a ``generate`` (``dtype=None``: O0/O1,
    the one an earlier set-up gave taken off)."""
    installed = module.__dict__.get("generate")
    if isinstance(installed, types.MethodType) and isinstance(installed.__func__, HalfGenerate):
        del module.__dict__["generate"]  # an earlier engine's (set up again): replaced, not wrapped again
    generate = getattr(type(module), "generate", None)
    if dtype is None or not callable(generate) or "generate" in module.__dict__:
        return
    module.__dict__["generate"] = types.MethodType(HalfGenerate(generate, module, dtype), _ModuleRef(module))
