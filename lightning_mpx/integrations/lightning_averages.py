"""The FP32 averages of Lightning's weight-averaging callbacks at O2.

``EMAWeightAveraging``/``WeightAveraging`` and ``StochasticWeightAveraging`` copy the LightningModule in their
``setup``, before the plugin converts it: on a model still in FP32 the copy, and so the average, is FP32. A model
converted already (a second ``fit`` on the same Trainer, a ``validate`` before the first ``fit``) is copied in half,
and an average kept in bfloat16 stops moving once its updates fall under half a unit in the last place (an EMA with
``decay=0.999``). :func:`average_in_fp32` gives such a copy the FP32 values of the masters, and its dtype
(``LightningModule.dtype``) FP32, as on the first fit.

At the end of ``fit`` the callbacks write their FP32 average into the model, which keeps its half rounding; the
masters would take only the elements whose rounding changed and keep their trained value elsewhere, a value neither
the average nor the trained weight. :func:`take_averages` gives them the FP32 average, as "bf16-mixed"'s FP32 model
holds it (``fp32_state_dict``, a checkpoint's masters).

``WeightAveraging`` averages the model it is given, whose O2 parameters hold the half rounding: :func:`average_in_fp32`
has its ``AveragedModel`` average the FP32 masters instead (:class:`_FromMasters`), as ``"bf16-mixed"`` averages its
FP32 weights.

``WeightAveraging`` swaps its average with the model's weights around every validation, through the half model: the
swap back would leave the average rounded to half. :class:`KeepAveragesInFP32` (added to the Trainer's callbacks by
:func:`average_in_fp32`) puts the FP32 average back after the validation.
"""

from __future__ import annotations

import inspect
import itertools
import weakref
from typing import Any, Iterator

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from lightning_mpx.common.dtypes import HALF_DTYPES
from lightning_mpx.common.imports import require
from lightning_mpx.engine.amp import Amp

require("lightning.pytorch", extra="lightning", feature="lightning_mpx.MixedPrecisionPlugin")

from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin  # noqa: E402
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging  # noqa: E402

try:  # Lightning 2.6 and later
    from lightning.pytorch.callbacks import WeightAveraging
except ImportError:  # an earlier release: only StochasticWeightAveraging averages
    WeightAveraging = None  # type: ignore[assignment,misc]

__all__ = ["KeepAveragesInFP32", "average_in_fp32", "take_averages"]

_AVERAGING = tuple(c for c in (WeightAveraging, StochasticWeightAveraging) if c is not None)


def _averaged_module(callback: Any) -> nn.Module | None:
    """The copy of the LightningModule that ``callback`` averages into (``AveragedModel.module`` for
    ``WeightAveraging``), or None before its ``setup`` made one."""
    average = getattr(callback, "_average_model", None)
    inner = getattr(average, "module", average)  # AveragedModel wraps the copy in .module
    return inner if isinstance(inner, nn.Module) else None


def _averages(callbacks: list[Any]) -> list[nn.Module]:
    """The copies the weight-averaging ``callbacks`` average into (those made already)."""
    found = (_averaged_module(c) for c in callbacks if isinstance(c, _AVERAGING))
    return [average for average in found if average is not None]


def _mastered(
    average: nn.Module, module: nn.Module, amp: Amp, *, copy_in_fp32: bool
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(parameter, its FP32 master, the average's copy) for ``module``'s half parameters with a master of their own
    and a copy of the same shape: the copies in FP32 (``copy_in_fp32``) or in the parameter's half dtype."""
    params = dict(module.named_parameters())
    out = []
    for name, copy in average.named_parameters():
        param = params.get(name)
        if param is None or param.dtype == torch.float32:
            continue
        if copy.dtype != (torch.float32 if copy_in_fp32 else param.dtype):
            continue
        master = amp.master_of(param)
        if master is not param and master.shape == copy.shape:
            out.append((param, master, copy))
    return out


def average_in_fp32(callbacks: list[Any], module: nn.Module, amp: Amp) -> None:
    """Turn the half parameters of the weight-averaging ``callbacks``' copies of ``module`` into FP32, with the values
    of ``module``'s FP32 masters (parameters without a master, or already FP32, are left as they are); add a
    :class:`KeepAveragesInFP32` to ``callbacks`` (once) where one of them is a ``WeightAveraging``."""
    if WeightAveraging is not None and any(isinstance(c, WeightAveraging) for c in callbacks):
        if not any(isinstance(c, KeepAveragesInFP32) for c in callbacks):
            callbacks.append(KeepAveragesInFP32())
    for average in _averages(callbacks):
        with torch.no_grad():
            for _, master, copy in _mastered(average, module, amp, copy_in_fp32=False):
                copy.data = master.detach().clone()  # the averaging's own tensor, not the optimizer's
        _record_fp32(average)
    for callback in callbacks:
        # This fit's engine (a later fit's replaces it).
        if isinstance(callback, StochasticWeightAveraging):  # update_parameters(average, model, n_averaged, avg_fn)
            # Lightning's is a staticmethod; a subclass may override it with a method of its own (its self: the
            # callback, held weakly by the wrapper the callback holds)
            static = inspect.getattr_static(type(callback), "update_parameters")
            if isinstance(static, staticmethod):
                callback.update_parameters = _FromMasters(static.__func__, module, amp, 1)
            else:
                callback.update_parameters = _FromMasters(type(callback).update_parameters, module, amp, 1, callback)
        is_weight_averaging = WeightAveraging is not None and isinstance(callback, WeightAveraging)
        averaged = getattr(callback, "_average_model", None) if is_weight_averaging else None
        if isinstance(averaged, AveragedModel):
            own = type(averaged).update_parameters.__get__(averaged)
            averaged.update_parameters = _FromMasters(own, module, amp)


class _FromMasters:
    """``AveragedModel.update_parameters`` of a ``WeightAveraging`` callback's average (or
    ``StochasticWeightAveraging.update_parameters``), given the LightningModule (argument ``at``): it averages the
    module's FP32 masters where the module holds their half rounding (as ``"bf16-mixed"`` averages its FP32 weights),
    not that rounding (an average of the rounding tends to the rounding: an EMA checkpoint, which
    ``load_from_checkpoint`` reads, was as far from ``"bf16-mixed"``'s as the half weights). Holds the module and the
    engine weakly; without them it averages what it is given."""

    def __init__(self, update: Any, module: nn.Module, amp: Amp, at: int = 0, owner: Any = None) -> None:
        self._update, self._at = update, at
        self._module, self._amp = weakref.ref(module), weakref.ref(amp)
        # A callback's own update_parameters method (``update`` its function): called with the callback first
        self._owner = weakref.ref(owner) if owner is not None else None

    def __getstate__(self) -> dict[str, Any]:
        return {"_update": self._update, "_at": self._at}  # a pickled copy averages what it is given

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._update, self._at, self._module, self._amp = state["_update"], state["_at"], _gone, _gone
        self._owner = None

    def __reduce__(self) -> Any:
        owner = self._owner() if self._owner is not None else None
        if owner is not None:  # its callback's own method again, as before this wrapper
            return (getattr, (owner, "update_parameters"))
        return super().__reduce__()

    def __call__(self, *args: Any) -> Any:
        amp, model = self._amp(), args[self._at]
        if amp is not None and model is self._module():
            args = (*args[: self._at], _MastersView(model, amp), *args[self._at + 1 :])
        if self._owner is not None:
            return self._update(self._owner(), *args)
        return self._update(*args)


def _gone() -> None:
    """A weak reference whose object is gone."""
    return None


class _MastersView:
    """What ``AveragedModel.update_parameters`` reads of a model (``parameters()``, ``buffers()``), with each half
    parameter that has an FP32 master replaced by the master."""

    def __init__(self, module: nn.Module, amp: Amp) -> None:
        self._module, self._amp = module, amp

    def parameters(self) -> Iterator[torch.Tensor]:
        for param in self._module.parameters():
            master = self._amp.master_of(param) if param.dtype in HALF_DTYPES else param
            yield master if master.shape == param.shape else param

    def buffers(self) -> Iterator[torch.Tensor]:
        return self._module.buffers()


def _record_fp32(average: nn.Module) -> None:
    """Record FP32 as the dtype (``LightningModule.dtype``) of the Lightning modules of ``average`` recorded in half
    that hold no half tensor any more, as on the first fit: the ``.data`` swap above does not go through Lightning's
    ``.to()``, which keeps the record."""
    for sub in average.modules():
        if isinstance(sub, _DeviceDtypeModuleMixin) and sub._dtype in HALF_DTYPES:
            if not any(t.dtype in HALF_DTYPES for t in itertools.chain(sub.parameters(), sub.buffers())):
                sub._dtype = torch.float32


def take_averages(callbacks: list[Any], module: nn.Module, amp: Amp) -> None:
    """Give ``module``'s FP32 masters the FP32 average of a weight-averaging callback when ``module`` holds that
    average's half rounding (the callback wrote it in at the end of ``fit``); otherwise change nothing."""
    for average in _averages(callbacks):
        pairs = _mastered(average, module, amp, copy_in_fp32=True)
        # Every parameter at once: a model that holds its trained weights (no average written) keeps its masters.
        if pairs and all(torch.equal(p, c.to(p.device, p.dtype)) for p, _, c in pairs):
            with torch.no_grad():
                for _, master, copy in pairs:
                    master.copy_(copy)


class KeepAveragesInFP32(Callback):
    """Keeps the FP32 averages of ``WeightAveraging`` callbacks across a validation. The callback swaps its average
    with the half model's weights at ``on_validation_epoch_start`` and back at ``on_validation_epoch_end``, through
    ``copy_``: the average comes back rounded to half (an EMA that then stalls, as one kept in half). The FP32 values
    are taken before (``on_validation_start``) and put back after (``on_validation_end``) where the swap left
    exactly their rounding."""

    def __init__(self) -> None:
        self._kept: list[tuple[torch.Tensor, torch.Tensor, torch.dtype]] = []

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._kept = []
        params = dict(pl_module.named_parameters())
        for callback in trainer.callbacks:
            average = _averaged_module(callback) if isinstance(callback, WeightAveraging) else None
            for name, copy in average.named_parameters() if average is not None else ():
                param = params.get(name)
                if param is not None and copy.dtype == torch.float32 and param.dtype != torch.float32:
                    self._kept.append((copy, copy.detach().clone(), param.dtype))

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        kept, self._kept = self._kept, []
        with torch.no_grad():
            for copy, value, dtype in kept:
                if torch.equal(copy, value.to(dtype).float()):  # the swap's rounding, nothing else wrote it
                    copy.copy_(value)
