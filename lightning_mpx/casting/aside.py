"""Cast modes set aside while a framework's own module hooks run (FSDP's gathers and frees around each forward).

A cast scope's mode is handed every torch call made while it is on the stack, the framework's own bookkeeping too:
under FSDP2 each sharded module's forward pre-hook all-gathers and copies out its parameters, and its post-hook frees
them, in some hundred torch calls per module that no cast table acts on (views, ``numel``, storage calls). Around
hooks registered through :func:`around_hooks`, the cast modes at the top of the stack are popped, and pushed back
when those hooks are done, so those calls reach torch directly. The module's forward itself, and every other hook
(registered before or after), run with the modes in place.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_mpx.casting.checkpointing import _push_back
from lightning_mpx.casting.mode import _CastMode


class _Aside:
    """The cast modes one module's hooks set aside, a list per entry (pushed back in the order they were popped)."""

    def __init__(self) -> None:
        self.held: list[list[TorchFunctionMode]] = []

    def set_aside(self, *_: Any) -> None:
        if torch.compiler.is_compiling():  # a compiled module's hooks: the hand-off keeps modes out of its region
            return
        popped = []
        stack_len, stack_at = torch._C._len_torch_function_stack, torch._C._get_function_stack_at
        while stack_len():
            top = stack_at(stack_len() - 1)
            if type(top) is not _CastMode:  # another mode above (a user's): everything below it stays
                break
            popped.append(torch._C._pop_torch_function_stack())
        self.held.append(popped)

    def restore(self, *_: Any) -> None:
        if self.held and not torch.compiler.is_compiling():
            _push_back(self.held.pop())


def around_hooks(module: nn.Module, register: Callable[[], None]) -> None:
    """Call ``register()``, which registers forward hooks on ``module`` (``fully_shard(module)``: a pre-hook put
    first, a forward hook put last), so that the cast modes are set aside while those hooks run.

    Each of ``register``'s hooks ends up between two of this function's: the forward pre-hook between one put first
    after ``register`` (sets aside) and one put first before it (pushes back), the forward hook between one put last
    before (sets aside) and one put last after (pushes back, also when the forward or a hook raises). Hooks that
    ``register`` puts elsewhere run with the modes in place, as do the module's other hooks.
    """
    aside = _Aside()
    module.register_forward_pre_hook(aside.restore, prepend=True)
    module.register_forward_hook(aside.set_aside)
    register()
    module.register_forward_pre_hook(aside.set_aside, prepend=True)
    module.register_forward_hook(aside.restore, always_call=True)


def around_fsdp_hooks(module: nn.Module) -> bool:
    """:func:`around_hooks` for a module that ``fully_shard`` sharded already (Accelerate shards the model itself):
    FSDP2's forward hooks are registered again between the set-aside hooks, in the same places. Done only where
    that changes no order: FSDP's pre-hook is the module's first forward pre-hook and its forward hook the last
    forward hook, one module per FSDP state (not a grouped ``fully_shard([a, b])``); otherwise nothing changes, and
    the hooks' torch calls go through the cast modes as before. Returns whether the hooks were moved.
    """
    get_state = getattr(module, "_get_fsdp_state", None)
    state = get_state() if callable(get_state) else None
    pre = getattr(state, "_pre_forward_hook_handle", None)
    post = getattr(state, "_post_forward_hook_handle", None)
    if pre is None or post is None or len(getattr(state, "_modules", ())) != 1:
        return False
    pre_hooks, post_hooks = module._forward_pre_hooks, module._forward_hooks
    if not pre_hooks or not post_hooks or next(iter(pre_hooks)) != pre.id or next(reversed(post_hooks)) != post.id:
        return False
    pre_hook, post_hook = pre_hooks[pre.id], post_hooks[post.id]
    with_kwargs = pre.id in module._forward_pre_hooks_with_kwargs
    always = post.id in module._forward_hooks_always_called
    post_with_kwargs = post.id in module._forward_hooks_with_kwargs
    pre.remove()
    post.remove()

    def register() -> None:
        state._pre_forward_hook_handle = module.register_forward_pre_hook(
            pre_hook, prepend=True, with_kwargs=with_kwargs
        )
        state._post_forward_hook_handle = module.register_forward_hook(
            post_hook, with_kwargs=post_with_kwargs, always_call=always
        )

    around_hooks(module, register)
    return True
