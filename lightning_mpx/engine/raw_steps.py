"""A torch optimizer that lightning_mpx never prepared, stepping parameters by hand between the engine's backwards.

Under manual optimization a user may build an optimizer of their own (``torch.optim.SGD(self.parameters())`` in a
LightningModule's ``__init__``, one never passed to ``fabric.setup``, ``amp.prepare_optimizer`` or Accelerate's
``prepare``) and step it after the engine's backward. At O2 it steps the half parameters with the half gradients,
still scaled: no FP32 master update, and float16 training a factor of the loss scale off. Nothing of the engine runs
in that step, so the next backward tells it: the first backward after a prepared optimizer's step notes the versions
of its parameters (``StepMachine.before_backward``: C-level maps, no Python call); a later backward with no engine step
between (the gradients of the first still pending) finds parameters written since whose gradients were cleared
(:func:`refuse_raw_step`). Gradient accumulation keeps its gradients, a skipped batch (``zero_grad`` without a step)
writes no parameter, and a write between steps (a clamp after the step, ``load_state_dict``) comes before the first
backward: none of them is refused.
"""

from __future__ import annotations

import itertools
import operator
from typing import Sequence

import torch

from lightning_mpx.engine.optimizer_state import _OptimizerState
from lightning_mpx.masters.weights import MasterWeights

_PARAMS = operator.itemgetter("params")
_VERSION = operator.attrgetter("_version")


def refuse_raw_step(
    state: _OptimizerState, optimizer: torch.optim.Optimizer, master_weights: Sequence[MasterWeights]
) -> None:
    """Raise when, since the first backward after the last step, parameters of ``optimizer`` were written and their
    gradients cleared with no step of the engine between: another optimizer stepped them by hand."""
    noted = state.backward_versions
    with torch._C.DisableTorchFunction():
        params = list(itertools.chain.from_iterable(map(_PARAMS, optimizer.param_groups)))
        if noted is None or len(noted) != len(params) or tuple(map(_VERSION, params)) == noted:
            return  # the usual case: nothing written since (gradient accumulation, a skipped batch)
        stepped = [p for p, v in zip(params, noted) if p._version != v and p.grad is None]
    if not stepped:
        return  # written with the gradients kept (a clamp between accumulated backwards): the step takes it
    names = [_name(p, master_weights) for p in stepped]
    shown = ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    raise RuntimeError(
        f"parameters {shown} were written and their gradients cleared after a backward of lightning_mpx with no "
        f"step of its prepared {type(optimizer).__name__} between: a torch optimizer that lightning_mpx did not "
        "prepare stepped them by hand, with the half model's still-scaled gradients and no FP32 master update. Step "
        "a prepared optimizer instead: under the Trainer, return it from configure_optimizers and step "
        "self.optimizers() (manual optimization); with Fabric, fabric.setup(model, optimizer); with Accelerate, "
        "accelerator.prepare(model, optimizer); with the core Amp, amp.prepare_optimizer(optimizer) and "
        "amp.step(optimizer)."
    )


def _name(param: torch.Tensor, master_weights: Sequence[MasterWeights]) -> str:
    return next((n for m in master_weights if (n := m.name_of(param)) is not None), f"<{tuple(param.shape)}>")
