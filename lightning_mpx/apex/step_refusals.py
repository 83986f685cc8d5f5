"""The Apex layer's refusals of a step that would bypass it: the wrapped optimizer's own ``step()`` (Apex patched the
optimizer in place; ``initialize`` here returns a wrapper) and a step after a backward outside any ``scale_loss``
block."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lightning_mpx.apex._state import _amp_state

if TYPE_CHECKING:
    from lightning_mpx.apex.loss_scaling import AmpOptimizer

__all__ = ["refuse_original_step", "refuse_unscaled_step"]


def refuse_original_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    wrapper = _amp_state.optimizers.get(id(optimizer))
    if _amp_state.stepping is optimizer or wrapper is None or wrapper.optimizer is not optimizer:
        return  # the wrapper's own step, or no live wrapper (the script dropped it: the optimizer is its own again)
    if id(optimizer) not in wrapper._engine._optimizers:
        return  # another engine took it over (a core Amp's prepare_optimizer): that engine's hooks guard its steps
    raise RuntimeError(
        f"step() of the {type(optimizer).__name__} passed to amp.initialize(): step the optimizer amp.initialize() "
        "returned (`model, optimizer = amp.initialize(model, optimizer, ...)`). Apex patched the optimizer in place; "
        "here initialize() returns a wrapper whose step() skips a step whose gradients overflowed and updates the "
        "loss scale, which this step would bypass."
    )


def refuse_unscaled_step(wrapper: AmpOptimizer) -> None:
    """A step after a backward outside any ``scale_loss`` block: the step would divide the gradients by the loss
    scale (Apex's O1 stepped them as they were, its O2 not at all): refused while the scale is not 1."""
    amp, optimizer = wrapper._engine, wrapper.optimizer
    if not any(p.grad is not None for group in optimizer.param_groups for p in group["params"]):
        return
    scale = amp.scalers[0].get_scale()
    if scale != 1.0:
        raise RuntimeError(
            "step(): no amp.scale_loss() block ran since this optimizer's last step (or amp.initialize()), or its "
            "parameters' gradients appeared after the last block ended: a backward outside a block is not scaled, "
            f"and the step would divide it by "
            f"the loss scale ({scale:g}). Backward inside `with amp.scale_loss(loss, optimizer) as scaled_loss: "
            "scaled_loss.backward()`."
        )
