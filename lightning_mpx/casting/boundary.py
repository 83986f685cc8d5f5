"""Casts at a half model's boundary that a copy of the model can carry.

Apex casts an O2/O3 model's floating inputs to half and its half outputs to FP32. The Lightning plugin does it with
forward hooks (:class:`BoundaryCast`), the Accelerate adapter with an instance ``forward``; both travel with the model
when it is deep-copied or pickled (an EMA model, ``AveragedModel``, ``copy.deepcopy(model).float()``,
``torch.save(model)``). So they hold no engine, only the half dtype and weak references, and a copy's casts follow the
copy's own parameters (:class:`DtypeProbe`): a half copy takes FP32 inputs as the model did, a copy converted with
``.float()`` runs in FP32 on FP32 inputs.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch import nn

from lightning_mpx.casting.targets import forget, remember
from lightning_mpx.common.containers import _cast_collection
from lightning_mpx.common.dtypes import HALF_DTYPES

#: The input dtypes a boundary casts to half (as Apex's ``cast_model_inputs``: FP64 too).
INPUT_DTYPES = (torch.float32, torch.float64)


class DtypeProbe:
    """The half dtype a model's boundary casts to.

    For the model that was prepared it is the engine's (``dtype``), whatever its parameters hold (a module promoted
    to FP32 does not change it). A deep copy or pickle of it belongs to a copy of the model, which no engine manages:
    it follows one of the copy's own parameters, one that was half when the copy was made, and answers ``None`` (no
    casts) once that parameter is no longer half (``.float()``, ``.to(torch.float32)``).

    Args:
        dtype: The half dtype.
        module: The module whose parameters a copy takes its probe from (held weakly).
    """

    def __init__(self, dtype: torch.dtype, module: nn.Module) -> None:
        self._dtype: torch.dtype | None = dtype
        self._module: weakref.ref[nn.Module] | None = weakref.ref(module)
        self._probe: weakref.ref[torch.Tensor] | None = None

    def dtype(self, module: nn.Module) -> torch.dtype | None:
        """The dtype to cast ``module``'s inputs to, or ``None`` for none (a copy that is not half any more)."""
        if self._module is not None:
            return self._dtype
        probe = self._probe() if self._probe is not None else None
        if probe is None:  # the parameter it followed was replaced: follow the copy's first floating one now
            probe = next((p for p in module.parameters() if p.is_floating_point()), None)
            if probe is None:
                return None
            self._probe = weakref.ref(probe)
        return probe.dtype if probe.dtype in HALF_DTYPES else None

    def __getstate__(self) -> dict[str, Any]:
        # The copy keeps the parameter it follows (copied or pickled with the model's own, so it is the copy's).
        if self._module is not None:
            module = self._module()
            probe = None if module is None else next((p for p in module.parameters() if p.dtype in HALF_DTYPES), None)
        else:
            probe = self._probe() if self._probe is not None else None
        return {"probe": probe}

    def __setstate__(self, state: dict[str, Any]) -> None:
        probe = state["probe"]
        self._dtype, self._module = None, None
        self._probe = weakref.ref(probe) if probe is not None else None


class _Depth(threading.local):
    """The state of one model's :class:`BoundaryCast` hooks that belongs to the forward in progress, per thread (as
    ``torch.autocast`` keeps its state): threads running the same model at once (``torch.nn.DataParallel``'s replicas,
    which share the hooks; a serving thread pool) each count their own calls. Shared by that model's hooks; a copy's
    hooks share a fresh one.

    Attributes:
        value: How many hooked modules' forwards are running on this thread.
        noted: The boundary casts of this thread's forward and their FP32 sources, given back when it ends
            (:mod:`~lightning_mpx.casting.targets`).
        passed: Per hooked call in progress, whether the outermost hook let it pass (see the Trainer plugin's
            ``_PastRedirection``).
    """

    def __init__(self) -> None:  # run again on each thread's first use
        self.value = 0
        self.noted: list[tuple[torch.Tensor, torch.Tensor]] | tuple[()] = ()
        self.passed: list[bool] = []

    def __reduce__(self) -> tuple[type[_Depth], tuple[()]]:
        return type(self), ()  # a copy (deepcopy, pickle) starts with no forward in progress


class BoundaryCast:
    """The boundary casts of one module as a forward pre-hook (:meth:`pre`: floating inputs to half) and a forward
    hook (:meth:`post`: half outputs to FP32; register it with ``always_call=True``).

    :meth:`pre` notes each cast with its FP32 source until :meth:`post`: a loss computed inside the forward from a
    boundary-cast target (``labels=``) takes the source's values at O2 and O3 (:mod:`~lightning_mpx.casting.targets`).

    The hooks of one model share a depth counter, per thread: a hooked module called from inside another hooked
    module's forward (``self.embed(tokens)`` in the model's own forward) is inside the boundary, and its inputs and
    outputs are left as they are; another thread's forward of the same model (``torch.nn.DataParallel``) is not.

    Args:
        depth: The model's shared counter (:meth:`for_model` makes one).
        probe: Which dtype to cast to (see :class:`DtypeProbe`).
    """

    def __init__(self, depth: _Depth, probe: DtypeProbe) -> None:
        self._depth = depth
        self._probe = probe

    @classmethod
    def for_model(cls, modules: list[nn.Module], dtype: torch.dtype) -> list[BoundaryCast]:
        """One hook pair per module of one model, sharing a depth counter."""
        depth = _Depth()
        return [cls(depth, DtypeProbe(dtype, module)) for module in modules]

    def pre(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        depth, probe = self._depth, self._probe
        depth.value += 1
        # The prepared model's probe holds its dtype (read here without a call: this runs at every forward).
        dtype = (probe._dtype or probe.dtype(module)) if depth.value == 1 else None
        if dtype is None:
            return None  # called from inside the model, or a copy that runs in FP32
        # Each cast noted with its source: a loss inside the forward takes the source's values (casting.targets).
        noted: list[tuple[torch.Tensor, torch.Tensor]] = []
        kwargs = _cast_collection(kwargs, dtype, INPUT_DTYPES, noted) if kwargs else kwargs
        if len(args) == 1 and type(args[0]) is torch.Tensor:  # the usual call, model(x): no container walk
            tensor = args[0]
            if tensor.dtype in INPUT_DTYPES:
                cast = tensor.to(dtype)
                noted.append((cast, tensor))
                args = (cast,)
        else:
            args = _cast_collection(args, dtype, INPUT_DTYPES, noted)
        if noted:
            depth.noted = remember(noted)
        return args, kwargs

    def post(self, module: nn.Module, args: Any, output: Any) -> Any:
        depth, probe = self._depth, self._probe
        depth.value = max(0, depth.value - 1)
        if depth.value == 0 and depth.noted:
            forget(depth.noted)  # the sources go with the forward (not kept with what autograd saves)
            depth.noted = ()
        dtype = (probe._dtype or probe.dtype(module)) if depth.value == 0 else None
        if dtype is None:
            return None  # returning from a call inside the model, or a copy that runs in FP32
        if type(output) is torch.Tensor:  # the usual output: no container walk
            return output.to(torch.float32) if output.dtype == dtype else output
        return _cast_collection(output, torch.float32, (dtype,))
