"""An attribute held by weak reference, for a plugin that must remember the model it prepared without keeping it (and
its Trainer, optimizers and FP32 masters) alive after the user lets it go."""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["WeakAttribute", "WeakHook"]


class WeakAttribute:
    """A data descriptor: ``obj.name = value`` keeps a weak reference (``None`` as is); ``obj.name`` is the object, or
    ``None`` once it was collected. :meth:`held` tells whether one was ever set (collected since or not)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_weak{name}"

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        ref = obj.__dict__.get(self.slot)
        return None if ref is None else ref()

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.slot] = None if value is None else weakref.ref(value)

    def held(self, obj: Any) -> bool:
        """Whether ``obj`` was given an object (alive or collected since)."""
        return obj.__dict__.get(self.slot) is not None


class WeakHook:
    """A hook that calls a bound method through a weak reference, so that registering ``obj.method`` as a hook on
    ``obj`` itself makes no reference cycle (``obj`` is freed as soon as the user drops it, not at the next cyclic
    collection). Once ``obj`` is gone the hook does nothing. It pickles as the bound method."""

    def __init__(self, method: Any) -> None:
        self._method = weakref.WeakMethod(method)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        method = self._method()
        return None if method is None else method(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return (WeakHook, (self._method(),))
