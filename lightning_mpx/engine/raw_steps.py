"""A torch optimizer that lightning_mpx never prepared, stepping parameters by hand between the engine's backwards.

Under manual optimization a user may build an optimizer of their own (``torch.optim.SGD(self.parameters())`` in a
LightningModule's ``training_step``, one never returned from ``configure_optimizers`` nor passed to ``fabric.setup``,
``amp.prepare_optimizer`` or Accelerate's ``prepare``) and step it after the engine's backward. At O2 it steps the
half parameters with the half gradients, still scaled, and no FP32 master update (the next ``refresh_masters`` takes
its writes as a user's edits); under a loss scale other than 1 it applies the gradients multiplied by the scale.

Nothing of the engine runs in that step, so the next backward tells it: every backward notes the versions of each
registered optimizer's parameters and the count of the engine's steps (``StepMachine.before_backward``: C-level maps,
no Python call); a later backward with no engine step between (the gradients of the first still pending) that finds
versions changed looks for parameters written since whose gradients were cleared (:func:`refuse_raw_step`).
Gradient accumulation keeps its gradients, a skipped batch (``zero_grad`` without a step) writes no parameter, a write
after the step (a clamp, an EMA swap for validation) comes before the first backward, and the engine's own stage
changes that write parameters (a checkpoint loaded, a model prepared again, masters refreshed with ``force``, another
stage's engine taking over) forget what was noted (:meth:`StepMachine.forget_writes`): none of them is refused. Only
where the harm is real: with FP32 masters (O2), or a loss scale other than 1.
"""

from __future__ import annotations

import itertools
import operator
from typing import Sequence

import torch

from lightning_mpx.engine.optimizer_state import _OptimizerState
from lightning_mpx.masters.weights import MasterWeights

__all__ = ["refuse_raw_step"]

_PARAMS = operator.itemgetter("params")
_VERSION = operator.attrgetter("_version")


def refuse_raw_step(
    state: _OptimizerState, master_weights: Sequence[MasterWeights], names: dict[int, str], *, harmful: bool
) -> None:
    """Raise when, since the backward that noted them, parameters of the state's optimizer were written and their
    gradients cleared with no step of the engine between: another optimizer stepped them by hand. ``harmful``: with
    FP32 masters or a loss scale other than 1 (otherwise such a step is a plain step, and left alone)."""
    noted = state.backward_versions
    optimizer = state.optimizer_ref()
    if noted is None or optimizer is None or not harmful:
        return
    with torch._C.DisableTorchFunction():
        params = list(itertools.chain.from_iterable(map(_PARAMS, optimizer.param_groups)))
        if len(noted) != len(params) or tuple(map(_VERSION, params)) == noted:
            return  # the usual case: nothing written since (gradient accumulation, a skipped batch)
        stepped = [p for p, v in zip(params, noted) if p._version != v and p.grad is None]
    if not stepped:
        return  # written with the gradients kept (a clamp between accumulated backwards): the step takes it
    state.backward_versions = None  # raised once: a caller that catches it is not told again for the same writes
    named = [_name(p, master_weights, names) for p in stepped]
    shown = ", ".join(repr(n) for n in named[:5]) + (f" and {len(named) - 5} more" if len(named) > 5 else "")
    raise RuntimeError(
        f"parameters {shown} were written and their gradients cleared after a backward of lightning_mpx with no "
        f"step of its prepared {type(optimizer).__name__} between: a torch optimizer that lightning_mpx did not "
        "prepare (or a hand-written update) stepped them, with still-scaled gradients (at O2 the half model's, with no "
        "FP32 master update). Step a prepared optimizer instead: under the Trainer, return it from "
        "configure_optimizers and step self.optimizers() (manual optimization); with Fabric, "
        "fabric.setup(model, optimizer); with Accelerate, accelerator.prepare(model, optimizer); with the core Amp, "
        "amp.prepare_optimizer(optimizer) and amp.step(optimizer)."
    )


def _name(param: torch.Tensor, master_weights: Sequence[MasterWeights], names: dict[int, str]) -> str:
    found = next((n for m in master_weights if (n := m.name_of(param)) is not None), None)
    return found or names.get(id(param)) or f"<shape {tuple(param.shape)}>"
