"""The refusal of a write to the model's half gradients at O2 between the engine's clip and the step (read by the step's
:func:`~lightning_mpx.engine.rescale.leftovers` and by another optimizer's unscale of a shared gradient,
:func:`~lightning_mpx.engine.grad_checks.unscale`)."""

from __future__ import annotations

from lightning_mpx.engine.optimizer_state import _OptimizerState
from lightning_mpx.scaling.unscale import clip_coefficient


def refuse_scaled_write(state: _OptimizerState) -> None:
    """At O2, a write to the model's half gradients between a clip (``clip_grad_norm_``/``clip_grad_value_``, which
    unscale into the FP32 masters' gradients only) and the step, other than a clear: those gradients still hold the
    scaled, unclipped values, so the write was made on them (``p.grad.mul_(0.5)`` as after torch's clip), and taking
    it as true values would step with it times the loss scale. Or, after ``unscale_()`` showed the true values on them,
    a clip of the masters' gradients since (``state.clips``): the write was made on the unclipped values, and taking
    it would undo the clip (0.13 off FP32, silently, before). Refused (the gradients are left as they are)."""
    if state.shown:
        raise RuntimeError(
            "a model gradient was written between clip_grad_norm_()/clip_grad_value_() and step() at O2, after "
            "unscale_() showed the true values on the model's half gradients: the clip clipped the FP32 master "
            "weights' gradients (what the step uses) only, so the write was made on the unclipped values and would "
            "undo the clip. Write before the clip, or write the masters' gradients (amp.master_params(optimizer): "
            "p.grad of each), or clip the model's gradients themselves after unscale_() (torch.nn.utils."
            "clip_grad_norm_(model.parameters(), ...)), or call amp.show_unscaled_on_model(optimizer) after the clip. "
            "Clearing them (zero_grad) is fine."
        )
    raise RuntimeError(
        "a model gradient was written between clip_grad_norm_()/clip_grad_value_() and step() at O2, where the clip "
        "unscales into the FP32 master weights' gradients only: the model's half gradients still hold the scaled, "
        "unclipped values the write was made on, and the step would apply it times the loss scale "
        f"({state.loss_id or 0!r} is the loss). Write the gradients the step uses instead, the masters' "
        "(amp.master_params(optimizer): p.grad of each), or call unscale_(optimizer) before the clip and the write "
        "(accelerator.unscale_gradients() with the Accelerate adapter, whose clip after it leaves the clipped values "
        "there; it puts the true values in the model's gradients, as torch.amp.GradScaler.unscale_ does; with the "
        "core Amp, clip them with torch.nn.utils.clip_grad_norm_(model.parameters(), ...) after it, or call "
        "amp.show_unscaled_on_model(optimizer) after the engine's clip). Clearing them (zero_grad) is fine."
    )


def clipped_nothing(state: _OptimizerState) -> bool:
    """Whether the write found is on the values the step would use: true values shown on the model, and every clip of
    the masters' gradients since a clip by norm that changed nothing (its norm within ``max_norm``: torch's
    coefficient 1). Read on a refusal's path only (one host read): a write after such a clip trains as FP32."""
    if not state.shown or not state.clips:
        return False
    if any(clip[0] != "norm" or clip[1] is None for clip in state.clips):
        return False
    # The check's flag: an infinite norm of finite gradients zeroed them (torch's coefficient), an overflow's did not
    return all(bool(clip_coefficient(clip[1], float(clip[2]), state.found_inf) == 1.0) for clip in state.clips)
