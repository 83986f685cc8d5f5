"""The exact FP32 weights an O2 checkpoint's masters give a model resumed at O0/O1, whatever the load order.

Resuming an O2 checkpoint at a level without masters writes the checkpoint's FP32 masters into the model's
parameters (:meth:`~lightning_mpx.engine.amp.Amp.load_state_dict`). The same checkpoint also holds the model's own state
dict, whose weights are the masters' half rounding. Which of the two is loaded last depends on the front door:
Accelerate's ``load_state`` loads the engine's state (a load-state pre-hook) before the models, and
``fabric.load`` follows the order of the user's state dict (``{"mpx": mpx, "model": model}`` loads the engine
first). A model load after the engine's would put the rounding back over the exact values.

:class:`ExactWeights` guards against that: a parameter the engine wrote keeps its exact value when a later
``load_state_dict`` brings that value's rounding (the same checkpoint's half weights), as long as nothing else
wrote the parameter in between (its version counter has not moved). A load of other values (other weights, a later
checkpoint) goes through untouched.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


class ExactWeights:
    """Parameters holding exact FP32 values the engine loaded, to keep through a later load of their rounding.

    Holds no copy of the values (the parameters hold them) and no strong reference to a model; the load hooks it
    puts on the prepared models go once no parameter is guarded.
    """

    def __init__(self) -> None:
        # id(param) -> (the parameter, its version counter right after the engine wrote it)
        self._guarded: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self._handles: list[RemovableHandle] = []

    def guard(self, models: list[nn.Module], params: list[torch.Tensor]) -> None:
        """Guard ``params`` (just written by the engine) until a load of ``models`` brings their rounding."""
        self.release()
        self._guarded = {id(p): (weakref.ref(p), p._version) for p in params}
        if self._guarded:
            self._handles = [model.register_load_state_dict_pre_hook(self._pre_hook) for model in models]

    def release(self) -> None:
        """Stop guarding (remove the load hooks)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._guarded = {}

    def __getstate__(self) -> dict[str, Any]:
        # A pickled or deep-copied model carries its hooks: the copy's parameters are not the ones the engine wrote.
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def _pre_hook(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
        seen: set[int] = set()
        # remove_duplicate=False: a tied weight is loaded once per name, and each name must get the exact value.
        for name, param in module.named_parameters(remove_duplicate=False):
            entry = self._guarded.get(id(param))
            key = prefix + name
            if entry is None or entry[0]() is not param or key not in state_dict:
                continue
            seen.add(id(param))
            incoming = state_dict[key]
            if (
                param._version == entry[1]  # nothing wrote the parameter since the engine's load
                and isinstance(incoming, torch.Tensor)
                and type(incoming) is torch.Tensor
                and incoming.dtype != param.dtype
                and incoming.shape == param.shape
                and torch.equal(incoming, param.detach().to(device=incoming.device, dtype=incoming.dtype))
            ):
                state_dict[key] = param.detach().clone()  # the exact value, not its rounding
        for key in seen:  # guarded until the first load that names them, whatever it brought
            self._guarded.pop(key, None)
        if not self._guarded:
            self.release()
