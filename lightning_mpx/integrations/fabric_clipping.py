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
import weakref
from typing import Any, Iterable

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies.strategy import Strategy

from lightning_mpx.engine.optimizer_state import _Stage

try:  # torch's private helper (torch >= 2.1): without it, torch's own clip is used (_clip_norm)
    from torch.utils._foreach_utils import _device_has_foreach_support
except ImportError:  # pragma: no cover - an older or changed torch

    def _device_has_foreach_support(device: torch.device) -> bool:
        return False


__all__ = [
    "clip_for_fabric",
    "counted_stand_ins",
    "for_fabric_clip",
    "forget_unseen_reads",
    "note_unseen_clip",
    "scaled_for_user",
    "settle_reads",
]

# Lightning's own clip methods, which clip what main_params returns right after it (a strategy's override is not one)
_CLIPS = {Strategy.clip_gradients_norm.__code__: "norm", Strategy.clip_gradients_value.__code__: "value"}
# fabric.clip_gradients, which calls the strategy's clip; how far above main_params's caller it is looked for
_FABRIC_CLIP, _FRAMES_SEARCHED = Fabric.clip_gradients.__code__, 8


def scaled_for_user(state: Any) -> bool:
    """Whether an optimizer's gradients are a backward's, still scaled (no unscale since), when the user
    asks for ``main_params``: torch's ``clip_grad_norm_(mpx.main_params(optimizer), ...)`` right after
    ``fabric.backward`` (Apex's ``master_params`` habit) found at O2 the masters without gradients and clipped nothing
    (7.8e-2 off ``"bf16-mixed"`` in 3 steps, silently), and a read for a log found ``grad`` None; at O1/O3 with a
    loss scale (float16's dynamic one, a static one) it clipped the scaled gradients to ``max_norm`` and the step then
    divided them by the scale (3.3e-2 off in 3 steps, the norm returned and logged 128 times too big at a scale of
    128). The plugin unscales first, as ``fabric.clip_gradients`` does (per rank, no collective: the step reduces the
    flags as after any unscale; sharded too, where a read on rank 0 alone must enter no collective). Fabric's own
    clip unscales before it asks: nothing then. Not after a step (its gradients are the step's) nor before any
    backward. ``state``: the optimizer's (:class:`~lightning_mpx.engine.optimizer_state._OptimizerState`).

    An optimizer set up apart (``fabric.setup_optimizers``) is met at its first unscale or step, or at this read: after
    the first ``fabric.backward`` it carries no loss yet, and its gradients, that backward's, were taken for none (the
    first step's clip clipped nothing at O2, 8.0e-2 off ``"bf16-mixed"`` in 3 steps; the scaled ones at O1, 1.8e-2);
    gradients present then are unscaled, as ``fabric.clip_gradients``'s unscale takes them (one look at the
    gradients, before an optimizer's first backward only)."""
    if state.stage is not _Stage.READY:
        return False
    if state.loss_id is not None:
        return True
    optimizer = state.optimizer_ref()
    params = (param for group in optimizer.param_groups for param in group["params"]) if optimizer is not None else ()
    return any(param.grad is not None for param in params)


def for_fabric_clip(caller: types.FrameType) -> bool:
    """Whether ``caller`` (the frame of ``main_params``'s caller) is Fabric's clip: Lightning's
    ``Strategy.clip_gradients_norm``/``clip_gradients_value``, or a strategy's own clip inside
    ``fabric.clip_gradients``, which every rank calls and which clips what it is handed. Not the user's own code (a
    log of the gradients' or the weights' norm, torch's clip), which gets the parameters as they are."""
    return caller.f_code in _CLIPS or _in_fabric_clip(caller)


def clip_for_fabric(amp: Any, optimizer: torch.optim.Optimizer, caller: types.FrameType) -> list[torch.Tensor] | None:
    """At O2, unsharded, ``optimizer`` unscaled and not overflowed, called by Lightning's own
    ``Strategy.clip_gradients_norm``/``clip_gradients_value`` (``caller``, the frame of ``main_params``'s caller):
    clip the masters' gradients with torch's clip and ``caller``'s arguments, show them on the model's half gradients
    (:meth:`~lightning_mpx.engine.amp.Amp.show_unscaled_on_model`), and return the stand-in Fabric's clip then clips:
    one FP32 tensor whose gradient is the norm (torch's norm of one element is its absolute value, exactly for every
    p-norm and the infinity norms) or zero (by value); for the 0-"norm" as many ones as it counts. ``None``
    elsewhere: the masters are handed to Fabric's clip as before."""
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
    if norm is not None and args["norm_type"] == 0 and bool(norm > 1):
        # the "0-norm" (how many gradients hold a non-zero: torch's norm of the per-tensor counts) of one element is
        # 1, not the norm: as many stand-ins as that count, each whose gradient is 1 (it returned 1.0 where "bf16-mixed"
        # returns 4.0; a host read, for this norm type only)
        return [_one(device) for _ in range(int(norm))]
    return [stand_in]


def counted_stand_ins(masters: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """On an overflow step, for a clip by the 0-"norm": as many stand-ins whose gradient is 1 as ``masters`` have
    gradients holding a non-zero (inf and NaN included), so that Fabric's clip returns torch's count, finite, as
    ``"16-mixed"`` does (it returned 0.0, or 1.0 with ``error_if_nonfinite=False``); none: one whose gradient is zero.
    One host read, on such steps only. Nothing real is clipped: the step is skipped."""
    grads = list(filter(_SOME, map(_GRAD, masters)))
    count = int(torch.stack([(grad != 0).any() for grad in grads]).sum()) if grads else 0
    if not count:
        stand_in = torch.zeros(1, device=device)
        stand_in.grad = torch.zeros(1, device=device)
        return [stand_in]
    return [_one(device) for _ in range(count)]


def _one(device: torch.device) -> torch.Tensor:
    tensor = torch.zeros(1, device=device)
    tensor.grad = torch.ones(1, device=device)
    return tensor


def note_unseen_clip(
    amp: Any, optimizer: torch.optim.Optimizer, caller: types.FrameType | None = None
) -> tuple[Any, ...]:
    """At O2, unsharded, the masters handed to a clip :func:`clip_for_fabric` does not make (a strategy's own
    ``clip_gradients_norm`` clipping ``precision.main_params``): noted as a clip of the masters' gradients of unknown
    extent (by value, without bound: a no-op where clips are applied), so that a write to the model's gradients
    before the step, made on the unclipped values the unscale showed, is refused at the step (it was overwritten by
    the show there: lost, 7.5e-2 off FP32 in 3 steps, silently), naming the ways out. Returns the masters, their
    gradients' identities and versions now and, where ``caller`` (the frame of ``main_params``'s caller) runs inside
    ``fabric.clip_gradients`` (a strategy's clip), their norms (a clip through ``.data``, older torch's and Apex's,
    moves no version: a write after it was lost), for :func:`forget_unseen_reads` at the step."""
    state = amp._machine.state(optimizer)
    state.clips += (_UNSEEN,)
    masters = tuple(amp.master_params(optimizer))
    return masters, _marks(masters), _norms(masters) if caller is not None and _in_fabric_clip(caller) else None


def _in_fabric_clip(frame: types.FrameType | None) -> bool:
    """Whether ``frame`` or one of the few above it is ``Fabric.clip_gradients``'s (a strategy's clip runs there)."""
    for _ in range(_FRAMES_SEARCHED):
        if frame is None:
            return False
        if frame.f_code is _FABRIC_CLIP:
            return True
        frame = frame.f_back
    return False


def forget_unseen_reads(
    amp: Any, handed: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any], optimizer: Any = None
) -> None:
    """At ``optimizer``'s step (before the plugin shows the masters' gradients on the model) or, with no
    ``optimizer``, at a backward before any step (for every optimizer): where no master's gradient was written or
    replaced since :func:`note_unseen_clip` handed them out (the marks ``handed`` holds, taken out of it), what took
    them only read them (the user's own ``main_params(optimizer)`` for a log, after ``fabric.clip_gradients``): its
    notes are dropped, so that a write to the model's gradients since is taken, as under FP32 (it was refused, naming
    a clip never made). A clip in place (torch's) or a replaced gradient moves the marks: the note stays and such a
    write is refused."""
    taken = [(optimizer, handed.pop(optimizer, None))] if optimizer is not None else list(handed.items())
    if optimizer is None:
        handed.clear()
    for each, marks in taken:
        # the masters handed out then: not those of a group added since (add_param_group), which no read handed out
        if marks is not None and _marks(marks[0]) == marks[1] and (marks[2] is None or _norms(marks[0]) == marks[2]):
            state = amp._machine.state(each)
            state.clips = tuple(clip for clip in state.clips if clip is not _UNSEEN)


def settle_reads(
    amp: Any,
    handed: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any],
    optimizer: torch.optim.Optimizer,
    *,
    itself: bool,
) -> None:
    """Before an engine write to masters' FP32 gradients that reads of ``main_params`` handed out, their
    :func:`note_unseen_clip` notes told now, as :func:`forget_unseen_reads` tells them at the step: before a Fabric
    clip of ``optimizer`` (``itself``: its own reads, which the clip's write would make look like a clip: a log after
    each of two ``fabric.clip_gradients`` in one step, then a write to the model's gradients, was refused) and, where
    parameters are held by more than one optimizer, before ``optimizer``'s unscale or step, which writes the FP32
    gradients of the masters it shares with the others (a read of the first optimizer's ``main_params`` for a log, then
    the second's clip or step, then a write was refused; ``"bf16-mixed"`` trains both). A read is dropped with its
    note; after a clip (the marks moved already) the note stays (to the step, which refuses a write since, or to the
    Fabric clip's show of ``optimizer``, which does) and its marks are let go."""
    shared = bool(amp._machine.shared.ids)  # a master held twice: another optimizer's write reaches the marks
    for each in list(handed.keys()):
        marks = handed.get(each)
        if marks is None or not (itself if each is optimizer else shared):
            continue
        if _marks(marks[0]) == marks[1] and (marks[2] is None or _norms(marks[0]) == marks[2]):
            state = amp._machine.state(each)
            state.clips = tuple(clip for clip in state.clips if clip is not _UNSEEN)
            del handed[each]  # a read only: its step has nothing of it to tell (a later main_params notes again)
        elif each is optimizer:  # its clip's show ends the note (or refuses a write since): a read after it is told
            del handed[each]  # by marks of its own (a strategy's own clip notes again, before it clips)
        else:
            handed[each] = None


def _marks(masters: Iterable[torch.Tensor]) -> tuple[tuple[int, int] | None, ...]:
    return tuple(None if (grad := master.grad) is None else (id(grad), grad._version) for master in masters)


def _norms(masters: Iterable[torch.Tensor]) -> list[float]:
    """The norms of the masters' gradients (one host read): a strategy's clip told from a read, no version moved."""
    grads = [grad.detach() for master in masters if (grad := master.grad) is not None]
    return torch.stack([torch.linalg.vector_norm(g).to(grads[0].device) for g in grads]).tolist() if grads else []


# note_unseen_clip's note (by value, without bound), told from others by identity
_UNSEEN = ("value", None, math.inf)

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
