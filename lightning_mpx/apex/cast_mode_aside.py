"""The O1 cast mode taken off this thread's torch-function mode stack while the Apex layer's own bookkeeping and the
optimizer's own calls run: the unscale at a ``scale_loss`` block's end, ``optimizer.step()`` (the engine's step, its
scale update) and ``optimizer.zero_grad()``.

Apex's O1 is one cast scope for the whole run (``initialize`` enters it), so every torch call of a step met the
mode, the library's own and the optimizer's too: two Python calls each (the mode's ``__torch_function__`` and its
table lookup), 241 of them per step of the census's GPT (921 Python calls a step against the core O1 loop's 403,
whose scope covers the forward alone; 494 with the mode set aside). The optimizer's step already runs with every cast
policy turned off (``casts_off_if_on``: an optimizer's calls are not the model's), its ``zero_grad`` reads and clears
gradients (nothing the table casts), and so do the unscale's ops (a flag, the reciprocal of a float64 scale, torch's
fused check-and-unscale): with the mode off the stack they run exactly as before, without its calls. Only the mode on
top of the stack is taken off (a mode the user entered after ``initialize`` stays, and the layer's calls then meet
the cast mode as before), and it goes back in a ``finally``. C calls only, no Python call, when no mode is on the
stack (O2, O3). The user's code between (the forward, the backward, a clip) keeps the O1 casts, as in Apex.
"""

from __future__ import annotations

import torch

from lightning_mpx.casting.mode import _CastMode

__all__ = ["put_back", "set_aside", "stack_depth"]

#: The number of modes on this thread's torch-function mode stack (a C call): a caller sets aside only when it is not 0.
stack_depth = torch._C._len_torch_function_stack
_mode_at = torch._C._get_function_stack_at
_pop = torch._C._pop_torch_function_stack
#: Push back what :func:`set_aside` returned (a C call).
put_back = torch._C._push_on_torch_function_stack


def set_aside() -> _CastMode | None:
    """Take the innermost torch-function mode off this thread's stack when it is a cast policy's mode; returns it
    (give it to :func:`put_back` in a ``finally``), or ``None`` when the innermost mode is not one (left in place)."""
    depth = stack_depth()
    if depth and type(_mode_at(depth - 1)) is _CastMode:
        mode: _CastMode = _pop()
        return mode
    return None
