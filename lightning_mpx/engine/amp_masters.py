"""The FP32 masters of :class:`~lightning_mpx.engine.amp.Amp`, as its user reads them: the tensors an optimizer
updates, the master of one parameter, a refresh from writes made to the half model, and an FP32 export of a module.

:class:`AmpMasters` is the base of :class:`~lightning_mpx.engine.amp.Amp` over the masters' read side; the masters
themselves are owned by :class:`~lightning_mpx.masters.store.Masters` (``self._masters``), and the training calls
(prepare, backward, step, update) stay on :class:`~lightning_mpx.engine.amp.Amp` (the forward on its base
:class:`~lightning_mpx.engine.amp_forward.AmpForward`).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from lightning_mpx.engine.amp_records import AmpRecords
from lightning_mpx.engine.true_grads import true_grad, unscaled_grad
from lightning_mpx.masters.pairs import param_pairs
from lightning_mpx.masters.swap import follow_modes


class AmpMasters(AmpRecords):
    """The base of :class:`~lightning_mpx.engine.amp.Amp` over the FP32 masters: :meth:`master_params`,
    :meth:`master_of`, :meth:`true_grads`, :meth:`refresh_masters`, :meth:`fp32_state_dict`, and
    :meth:`follow_optimizer_modes` (a schedule-free optimizer's point taken into the masters)."""

    def follow_optimizer_modes(self) -> None:
        """At O2, a schedule-free optimizer's ``eval()``/``train()`` called where its groups held the half parameters
        (through Fabric's or Lightning's optimizer wrapper: it moved none of them, its state is keyed by the masters)
        redone on the FP32 masters and copied into the model. Done at every forward, before a state dict is made
        (the model's and the optimizer's) and at the Trainer's teardown; nothing for other optimizers."""
        for state in list(self._machine.optimizers.values()):
            if state.train_modes is not None:
                follow_modes(state, self._machine.masters.weights)

    def master_params(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The tensors ``optimizer`` updates: the FP32 masters of its half parameters at O2, its parameters
        otherwise. Their ``.grad`` holds the unscaled gradients between an unscale and the step."""
        return self._machine.master_params(optimizer, with_masters=self._with_masters)

    def master_of(self, param: torch.Tensor, *, refresh: bool = True) -> torch.Tensor:
        """The FP32 master of a model parameter at O2 (the parameter itself when it has none: an FP32 parameter, or
        a half one that no prepared optimizer holds). A write made to the model parameter since the last step is
        taken into the master first, as the next step would take it (``refresh=False``: not looked for, for code that
        needs the tensor, such as where its ``.grad`` lives, not its value)."""
        return self._masters.master_of(param, self._optimizers.values(), refresh=refresh)

    def true_grads(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor | None]:
        """The gradients of model parameters as FP32 training would hold them now, for code that reads ``.grad``
        outside the step (peft's AdaLoRA scores): at O2 a new FP32 tensor for each half parameter a registered
        optimizer holds (its half gradient keeps the loss scale it was computed with until the next backward or
        ``zero_grad``: divided by it, the clips since the unscale applied; between an unscale and the step its master's
        gradient), ``None`` where it has no gradient. A parameter without a master that a registered optimizer holds
        (O1's FP32 model, batch norm at O2): after a backward and before the unscale a new FP32 tensor, its ``.grad``
        divided by the scale it carries; after the unscale its ``.grad`` (unscaled in place). A parameter of a
        prepared model that no registered optimizer holds (yet: a door that meets its optimizer at its first step, or
        none) a new FP32 tensor, its ``.grad`` divided by the scale of the engine backward that made it (kept across an
        update), as ``GradScaler.unscale_`` and a read of ``.grad``; with every scale 1, ``.grad`` as it is.

        Raises:
            TypeError: ``params`` is not an iterable of tensors (a single tensor, a module, ``named_parameters()``).
            RuntimeError: a parameter no registered optimizer holds has a gradient whose scale cannot be known (of no
                prepared model, or made by no engine backward of a dynamic scale).
        """
        wanted = _tensors(params)
        ids = {id(p) for p in wanted}
        found: dict[int, torch.Tensor | None] = {}
        machine = self._machine
        for state in list(machine.optimizers.values()):
            optimizer = state.optimizer_ref()
            if optimizer is None:
                continue
            for param, master in param_pairs(state, machine.masters.weights, optimizer=optimizer):
                if id(param) in ids:
                    found[id(param)] = (
                        true_grad(state, machine.scalers, param, master)
                        if master is not param
                        else unscaled_grad(state, machine.scalers, param)
                    )
        return [found[id(p)] if id(p) in found else _unheld_true_grad(machine, p) for p in wanted]

    def refresh_masters(self, params: Iterable[torch.Tensor] | None = None, *, force: bool = False) -> list[str]:
        """Take writes made to the half model into the FP32 masters now (done before every step anyway); returns
        the names of the parameters whose masters took one. ``params``: the parameters to check (default: all);
        ``force``: compare values whatever the version counters say (writes through a kept ``p.data`` tensor, or
        through ``.data`` of a user's ``nn.Parameter`` subclass)."""
        if force:
            self._machine.forget_writes()  # a forced refresh follows writes by the user's code (engine.raw_steps)
        return self._masters.refresh(params, force=force)

    def fp32_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """``module.state_dict()`` in FP32, to export what training produced (the model is not changed): half
        parameters as their FP32 masters (writes made to the model since the last step taken first) or the FP32 value
        kept for a master not made yet, other half tensors upcast exactly, the rest (FP32, integer, extra state) as is;
        keyed as ``module.state_dict()``, so ``model.save_pretrained(path, state_dict=amp.fp32_state_dict(model))``
        (Hugging Face, peft) or ``torch.save`` take it as the model's own.

        Raises:
            TypeError: ``module`` is not an ``nn.Module``.
            ValueError: for an FSDP-sharded model, whose parameters are FP32 already (use the strategy's state dict).
        """
        if not isinstance(module, nn.Module):
            raise TypeError(f"module={type(module).__name__} is not a torch.nn.Module.")
        if self.sharded:
            raise ValueError(
                f"module={type(module).__name__}: this Amp trains an FSDP-sharded model, whose parameters are FP32 "
                "already; export it with the strategy's own state dict (it gathers the shards), not fp32_state_dict()."
            )
        self.follow_optimizer_modes()  # a schedule-free optimizer's eval() since the last forward: its point
        return self._masters.fp32_state_dict(module)


def _unheld_true_grad(machine: Any, param: torch.Tensor) -> torch.Tensor | None:
    """:meth:`AmpMasters.true_grads` of ``param``, which no registered optimizer holds: its ``.grad`` divided by the
    scale it carries (a new FP32 tensor), or ``.grad`` as it is when every scale is 1; refused when that scale cannot
    be known."""
    grad = param.grad
    scalers = machine.scalers
    if grad is None or all(scaler._unit for scaler in scalers):
        return grad
    unheld = machine.unheld
    known = unheld is not None and id(param) in unheld.ids
    carried = unheld.scales.last_loss(param) if known else None
    if carried is not None:
        loss_id, scale = carried
        scale = scalers[loss_id].scale_tensor if scale is None else scale
    elif known and not any(s.dynamic for s in scalers) and len({float(s.scale_tensor) for s in scalers}) == 1:
        scale = scalers[0].scale_tensor  # a static scale (every loss's): nothing recorded, nothing moves
    else:
        where = "a model prepared by this Amp" if known else "no model prepared by this Amp"
        raise RuntimeError(
            f"true_grads: a parameter (shape {tuple(param.shape)}, {param.dtype}) of {where}, which no optimizer "
            "registered with it holds, has a gradient that no backward of this Amp with a dynamic loss scale is known "
            "to have made: the scale it carries cannot be known. Register its optimizer (prepare_optimizer, or the "
            "door's own call) before reading it, or read its .grad yourself."
        )
    return grad.detach().to(torch.float32, copy=True).div_(scale.to(grad.device))


def _tensors(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``params`` as a list of tensors, refusing what is not an iterable of tensors with a ``TypeError`` that says
    what to pass (a single tensor iterates over its rows; ``named_parameters()`` gives pairs)."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params is one tensor (iterated, it gives its rows): pass [param], or model.parameters().")
    if isinstance(params, nn.Module) or not isinstance(params, Iterable):
        raise TypeError(
            f"params={type(params).__name__}: pass an iterable of parameters, such as model.parameters() or [param]."
        )
    wanted = list(params)
    for each in wanted:
        if not isinstance(each, torch.Tensor):
            hint = " (named_parameters() gives (name, parameter) pairs)" if isinstance(each, tuple) else ""
            raise TypeError(
                f"params holds a {type(each).__name__}, not a tensor{hint}: pass an iterable of parameters, such as "
                "model.parameters() or [param]."
            )
    return wanted
