"""O1's cast table from Apex's API: ``register_*_function`` and the ``*_function`` decorators add functions to the
table (of the current engine, and of every later ``initialize``: see ``_amp_state.registrations``), and
``disable_casts()`` runs a block without O1's casts."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, TypeVar

from lightning_mpx.apex._state import _amp_state
from lightning_mpx.casting.policy import disable_casts as _disable_casts
from lightning_mpx.casting.table import _takes_part_in_dispatch, dispatchable
from lightning_mpx.common.keywords import checks_keywords

F = TypeVar("F", bound=Callable[..., Any])


def _register(function: Callable[..., Any], category: str) -> None:
    _amp_state.registrations.append((function, category))
    amp = _amp_state.amp
    if amp is not None and amp.policy is not None and amp.properties.patch_torch_functions:
        amp.policy.table.register(function, category)
        # The policy re-reads its table when a scope is entered; initialize's scope stays entered, so re-read now.
        amp.policy._refresh_actions()


def _register_named(module: Any, name: str, category: str) -> None:
    if isinstance(module, str):  # "'torch' has no attribute 'matmul'" before: the name was looked up on the string
        raise TypeError(
            f"module={module!r} must be the module or class that holds the function (torch, torch.nn.functional, "
            f"torch.Tensor...), not its name: amp.register_{category}_function(torch, {name!r})."
        )
    if not hasattr(module, name):
        raise ValueError(f"name={name!r}: {getattr(module, '__name__', module)!r} has no attribute {name!r}.")
    function = getattr(module, name)
    if not _takes_part_in_dispatch(function):
        raise TypeError(
            f"name={name!r}: {getattr(module, '__name__', module)}.{name} does not take part in torch's "
            "__torch_function__ protocol, so the scoped cast policy cannot see it (Apex patched the module instead). "
            f"Decorate its definition with @amp.{category}_function."
        )
    _register(function, category)


@checks_keywords("amp.register_half_function()")
def register_half_function(module: Any, name: str) -> None:
    """Run ``module.name`` with half inputs under O1 (from the next ``initialize`` on, or now if initialized)."""
    _register_named(module, name, "half")


@checks_keywords("amp.register_float_function()")
def register_float_function(module: Any, name: str) -> None:
    """Run ``module.name`` with FP32 inputs under O1."""
    _register_named(module, name, "float")


@checks_keywords("amp.register_promote_function()")
def register_promote_function(module: Any, name: str) -> None:
    """Run ``module.name`` in the widest floating type of its inputs under O1."""
    _register_named(module, name, "promote")


def _decorator(category: str) -> Callable[[F], F]:
    def decorate(fn: F) -> F:  # Apex's name for it: half_function(fn=...) works too
        wrapper = dispatchable(fn)
        _register(wrapper, category)
        return wrapper  # type: ignore[return-value]

    return decorate


half_function = _decorator("half")
half_function.__doc__ = "Decorator: the function runs with half inputs under O1."
float_function = _decorator("float")
float_function.__doc__ = "Decorator: the function runs with FP32 inputs under O1."
promote_function = _decorator("promote")
promote_function.__doc__ = "Decorator: the function runs in the widest floating type of its inputs under O1."


def disable_casts() -> contextlib.AbstractContextManager[None]:
    """Run the enclosed code without O1's casts (Apex's ``amp.disable_casts()``)."""
    return _disable_casts()
