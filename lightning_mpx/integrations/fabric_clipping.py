"""``fabric.clip_gradients`` at O2: the clip of the FP32 masters' gradients, shown on the model's half gradients at
once (:func:`clip_for_fabric`), for the Fabric plugin's ``main_params``.

Fabric's ``Strategy.clip_gradients_norm``/``clip_gradients_value`` unscale (``unscale_gradients``: at O2 into the
masters, a half copy of the true values onto the model's gradients), then clip what ``main_params`` returns with
torch's clip. Handed the masters, that clip changed them alone: the model's gradients kept the unclipped values until
the step, and a write to them in between (``p.grad.mul_(0.5)``, noise, torch's ``clip_grad_value_`` by the user, a
``p.grad = p.grad * 0.5``), which the step takes into the masters, was a write on the unclipped values: the clip was
lost (2e-2 off FP32 in 3 steps, silently). So the clip is made here, with torch's function and the caller's
arguments (the masters' gradients and the returned norm as Fabric's own clip gives them), the clipped values are
shown on the model, and Fabric's clip gets one stand-in whose gradient is that norm.
"""

from __future__ import annotations

import functools
import math
import operator
import types
from typing import Any

import torch
from lightning.fabric.strategies.strategy import Strategy

try:  # torch's private helper (torch >= 2.1): without it, torch's own clip is used (_clip_norm)
    from torch.utils._foreach_utils import _device_has_foreach_support
except ImportError:  # pragma: no cover - an older or changed torch

    def _device_has_foreach_support(device: torch.device) -> bool:
        return False


__all__ = ["clip_for_fabric", "note_unseen_clip"]

# Lightning's own clip methods, which clip what main_params returns right after it (a strategy's override is not one)
_CLIPS = {Strategy.clip_gradients_norm.__code__: "norm", Strategy.clip_gradients_value.__code__: "value"}


def clip_for_fabric(amp: Any, optimizer: torch.optim.Optimizer, caller: types.FrameType) -> list[torch.Tensor] | None:
    """At O2, unsharded, ``optimizer`` unscaled and not overflowed, called by Lightning's own
    ``Strategy.clip_gradients_norm``/``clip_gradients_value`` (``caller``, the frame of ``main_params``'s caller):
    clip the masters' gradients with torch's clip and ``caller``'s arguments, show them on the model's half gradients
    (:meth:`~lightning_mpx.engine.amp.Amp.show_unscaled_on_model`), and return the stand-in Fabric's clip then clips:
    one FP32 tensor whose gradient is the norm (torch's norm of one element is its absolute value, exactly for the 1-,
    2- and infinity norms) or zero (by value). ``None`` elsewhere: the masters are handed to Fabric's clip as before."""
    kind = _CLIPS.get(caller.f_code)
    if kind is None:
        return None
    args = caller.f_locals
    masters = amp._machine.master_params(optimizer, with_masters=True, hand=False)  # the library's read (master_writes)
    if kind == "norm":
        # error_if_nonfinite: Fabric's clip of the stand-in raises it (one host read of the norm, as before)
        norm = _clip_norm(masters, args["max_norm"], args["norm_type"])
    else:
        torch.nn.utils.clip_grad_value_(masters, args["clip_val"])
        norm = None
    amp.show_unscaled_on_model(optimizer)  # the clipped values on the model: a write to them now is on those
    device = masters[0].device if masters else torch.device("cpu")
    stand_in = torch.zeros(1, device=device)
    stand_in.grad = torch.zeros(1, device=device) if norm is None else norm.detach().reshape(1).to(device).clone()
    return [stand_in]


def note_unseen_clip(amp: Any, optimizer: torch.optim.Optimizer) -> None:
    """At O2, unsharded, the masters handed to a clip :func:`clip_for_fabric` does not make (a strategy's own
    ``clip_gradients_norm`` clipping ``precision.main_params``): noted as a clip of the masters' gradients of unknown
    extent (by value, without bound: a no-op where clips are applied), so that a write to the model's gradients
    before the step, made on the unclipped values the unscale showed, is refused at the step (it was overwritten by
    the show there: lost, 7.5e-2 off FP32 in 3 steps, silently), naming the ways out."""
    state = amp._machine.state(optimizer)
    state.clips += (("value", None, math.inf),)


_GRAD, _DTYPE, _DEVICE = operator.attrgetter("grad"), operator.attrgetter("dtype"), operator.attrgetter("device")
_SOME = functools.partial(operator.is_not, None)
_PLAIN = frozenset(
    {torch.Tensor}
)  # the types torch's clip takes its foreach kernels for (_foreach_utils._has_foreach_support)


def _clip_norm(masters: list[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_(masters, max_norm, norm_type)``: where the gradients share one device and
    dtype (the FP32 masters do) and torch's clip would take its foreach kernels, those kernels in its order (one
    ``_foreach_norm``, the norm of the norms, the coefficient, one ``_foreach_mul_``: its values bit for bit) without
    its Python around them (a Fabric O2 clip row's calls per step 595 -> 505); torch's clip elsewhere."""
    grads = list(filter(_SOME, map(_GRAD, masters)))
    if (not grads or len(set(map(_DTYPE, grads))) != 1 or len(set(map(_DEVICE, grads))) != 1
        or set(map(type, grads)) != _PLAIN or not _device_has_foreach_support(grads[0].device)):  # fmt: skip
        return torch.nn.utils.clip_grad_norm_(masters, max_norm, norm_type=norm_type)
    norm_type = float(norm_type)
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, norm_type)), norm_type)
    torch._foreach_mul_(grads, torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0))
    return norm
