"""Half models and FP32 master weights (O2, O3).

:func:`convert_module` casts a module's floating-point parameters and buffers to half in place, keeping batch norm
in FP32 when asked. :class:`MasterWeights` holds FP32 copies of the half parameters; :meth:`MasterWeights.attach`
hands them to the optimizer in place of the half parameters, so that the optimizer's update and its state are FP32,
and :meth:`MasterWeights.copy_to_model` writes the result back to the model after each real step.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_mpx._dtypes import HALF_DTYPES
from lightning_mpx.unscale import BACKENDS, UnscaleWorkspace, cast_copy_


def has_floating_parameters(module: nn.Module) -> bool:
    return any(p.is_floating_point() for p in module.parameters())


def convert_module(module: nn.Module, dtype: torch.dtype, *, keep_batchnorm_fp32: bool = True) -> nn.Module:
    """Cast ``module``'s floating-point parameters and buffers to ``dtype`` in place and return it.

    Parameters keep their identity (``param.data`` is replaced), so references held elsewhere, an optimizer's
    included, stay valid. Batch-norm modules (every subclass of ``_BatchNorm``, ``SyncBatchNorm`` included) are left
    in FP32 when ``keep_batchnorm_fp32``: their statistics need the range, and torch runs them on half inputs.

    Raises:
        ValueError: when the module has no floating-point parameters (there would be nothing to train in half).
    """
    if not has_floating_parameters(module):
        raise ValueError(
            f"module={type(module).__name__} has no floating-point parameters, so casting it to {dtype} would do "
            "nothing; use opt_level='O0' or 'O1' for it, or check that the module was built before conversion."
        )
    for submodule in module.modules():
        if keep_batchnorm_fp32 and isinstance(submodule, _BatchNorm):
            continue
        for param in submodule._parameters.values():
            if param is not None and param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
                if param.grad is not None:
                    param.grad = None
        for name, buffer in submodule._buffers.items():
            if buffer is not None and buffer.is_floating_point() and buffer.dtype != dtype:
                submodule._buffers[name] = buffer.to(dtype)
    return module


class MasterWeights:
    """FP32 master copies of a model's half parameters.

    Args:
        named_parameters: ``(name, parameter)`` pairs of the model; FP32 parameters (batch norm kept FP32) are their
            own masters, half parameters get an FP32 copy.
        copy_backend: How :meth:`copy_to_model` copies: ``"auto"`` (the fused Triton kernel for CUDA parameters when
            triton is installed, else torch's foreach copy), ``"foreach"``, ``"reference"`` or ``"triton"``.

    Attributes:
        workspace: The copy kernel's table cache, kept across steps.
    """

    def __init__(self, named_parameters: Iterable[tuple[str, nn.Parameter]], *, copy_backend: str = "auto") -> None:
        if copy_backend not in BACKENDS:
            raise ValueError(f"copy_backend={copy_backend!r} is not valid; valid choices: {', '.join(BACKENDS)}.")
        self.copy_backend = copy_backend
        self.workspace = UnscaleWorkspace()
        self.names: list[str] = []
        self.model_params: list[torch.Tensor] = []
        self.masters: list[torch.Tensor] = []
        seen: set[int] = set()
        for name, param in named_parameters:
            if id(param) in seen or not param.requires_grad:
                continue
            seen.add(id(param))
            self.names.append(name)
            self.model_params.append(param)
            if param.dtype in HALF_DTYPES:
                master = param.detach().clone().float().requires_grad_(True)
            else:
                master = param
            self.masters.append(master)
        self._master_of = {id(p): m for p, m in zip(self.model_params, self.masters)}
        self._model_of = {id(m): p for p, m in zip(self.model_params, self.masters)}

    @property
    def half_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(model parameter, FP32 master)`` for every half parameter."""
        return [(p, m) for p, m in zip(self.model_params, self.masters) if m is not p]

    def covers(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is one of the model parameters these masters were made for."""
        return id(param) in self._master_of

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        return self._master_of.get(id(param), param)

    def model_of(self, master: torch.Tensor) -> torch.Tensor:
        return self._model_of.get(id(master), master)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Put the masters in ``optimizer``'s parameter groups in place of the half parameters.

        Any optimizer state already held for a half parameter moves to its master, in FP32.
        """
        for group in optimizer.param_groups:
            for index, param in enumerate(group["params"]):
                master = self._master_of.get(id(param))
                if master is None or master is param:
                    continue
                group["params"][index] = master
                if param in optimizer.state:
                    state = optimizer.state.pop(param)
                    optimizer.state[master] = {
                        k: v.float() if torch.is_tensor(v) and v.is_floating_point() and k != "step" else v
                        for k, v in state.items()
                    }

    def sync_from_model(self) -> None:
        """Re-take the masters from the model parameters, on the model's current device.

        For frameworks that move the model to its device, or broadcast rank zero's weights to every process, after
        the masters were made: the masters then follow the model the optimizer will train. Identity is kept (the
        optimizer's references stay valid).
        """
        with torch.no_grad():
            for param, master in self.half_pairs:
                if master.device != param.device:
                    master.data = master.data.to(param.device)
                master.copy_(param)

    def copy_to_model(self) -> None:
        """Write the masters into the half model parameters (after a real optimizer step).

        One pass that reads 4 bytes and writes 2 per element; on CUDA with triton, one launch per dtype pair.
        """
        pairs = self.half_pairs
        if pairs:
            params, masters = zip(*pairs)
            cast_copy_(params, masters, backend=self.copy_backend, workspace=self.workspace)

    def clear_model_grads(self) -> None:
        """Drop the half model gradients once they have been unscaled into the masters."""
        for param, _ in self.half_pairs:
            param.grad = None

    def state_dict(self) -> dict[str, Any]:
        """The FP32 masters of the half parameters, by name, cloned (exact, not rounded through half)."""
        return {name: m.detach().clone() for name, p, m in zip(self.names, self.model_params, self.masters) if m is not p}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore masters bit-exactly and refresh the half model parameters from them."""
        expected = {name for name, p, m in zip(self.names, self.model_params, self.masters) if m is not p}
        missing, unexpected = expected - set(state), set(state) - expected
        if missing or unexpected:
            raise KeyError(
                f"master-weight state does not match the model: missing {sorted(missing)}, unexpected "
                f"{sorted(unexpected)}."
            )
        with torch.no_grad():
            for name, param, master in zip(self.names, self.model_params, self.masters):
                if master is not param:
                    master.copy_(state[name])
        self.copy_to_model()
