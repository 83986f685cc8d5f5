"""The argument casts of a :class:`~lightning_mpx.casting.policy.CastPolicy` (:class:`ArgumentCasts`, its base): a
call's floating tensor arguments cast to the dtype its table action asks for, in lists and tuples too, with the casts
of parameters (leaf tensors that require grad) cached until the policy drops them (:func:`_cached_cast`). Called per
torch call by the policy's mode (:mod:`lightning_mpx.casting.mode`, which inlines the common case of
:meth:`~ArgumentCasts._cast_all`) and by the loss policy; the policy's cache itself and its clearing stay on
``CastPolicy``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from lightning_mpx.casting.mode import _CONTAINERS, _UNSET

__all__ = ["ArgumentCasts"]


class ArgumentCasts:
    """The argument casts of a :class:`~lightning_mpx.casting.policy.CastPolicy` (the attributes below are its own,
    see it)."""

    cache_casts: bool
    _grad_cache: dict[Any, Any]  # parameter casts made with gradients enabled: (id, dtype) -> _CacheEntry's fields
    _no_grad_cache: dict[Any, Any]  # ... and without

    def _cast_changed(
        self, value: Any, dtype: torch.dtype, castable: tuple[torch.dtype, ...], cache: Any = _UNSET
    ) -> Any:
        """``value`` with its floating tensors of a ``castable`` dtype cast to ``dtype`` (in lists and tuples too),
        or ``None`` when nothing changes.

        ``cache``: the parameter-cast cache to use (``None``: no caching; ``_UNSET``: :meth:`_cache_now`'s, looked
        up only when a parameter is cast). Callers test the result against ``None``, not against ``value``: dynamo
        cannot trace ``is`` between two lists or tuples (torch 2.11: neither; 2.13: tuples), and the casts run inside
        compiled code.
        """
        if isinstance(value, torch.Tensor):
            current = value.dtype
            if current is dtype or current not in castable:
                return None
            return self._cast_tensor(value, dtype, cache)
        if type(value) is list or (isinstance(value, tuple) and not isinstance(value, torch.Size)):
            return self._cast_sequence(value, dtype, castable, cache)
        return None

    def _cast_tensor(self, value: torch.Tensor, dtype: torch.dtype, cache: Any = _UNSET) -> torch.Tensor:
        # ``to(dtype=...)``: the keyword form skips the argument parser's failed try of ``to(device, ...)``, about
        # 2 us of a ~4 us cast of a small tensor.
        if value.requires_grad and value.is_leaf:
            if cache is _UNSET:
                cache = self._cache_now()
            if cache is not None:
                return _cached_cast(cache, value, dtype)
        return value.to(dtype=dtype)

    def _cast_sequence(
        self, value: Any, dtype: torch.dtype, castable: tuple[torch.dtype, ...], cache: Any = _UNSET
    ) -> Any:
        """The list or tuple ``value`` with its items cast (:meth:`_cast_changed`), or ``None`` when no item changes."""
        items = None  # a copy, made at the first item that changes
        for index, item in enumerate(value):
            if isinstance(item, _CONTAINERS):
                cast = self._cast_changed(item, dtype, castable, cache)
                if cast is not None:
                    if items is None:
                        items = list(value)
                    items[index] = cast
        if items is None:
            return None  # nothing to cast: the caller keeps its container, whatever its type
        if isinstance(value, list):
            return items
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)  # namedtuple

    def _cache_now(self) -> dict[Any, Any] | None:
        """The parameter-cast cache for a call made now: ``None`` when caching is off or while compiling (under
        ``torch.compile`` the cast is a node of the graph, done once per use in the compiled code; a cache read while
        tracing would guard on the cache's size and keys and recompile as it fills)."""
        if not self.cache_casts or torch.compiler.is_compiling():
            return None
        return self._grad_cache if torch.is_grad_enabled() else self._no_grad_cache

    def _cast_all(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        dtype: torch.dtype,
        castable: tuple[torch.dtype, ...],
    ) -> tuple[tuple[Any, ...], dict[str, Any] | None]:
        """The call's arguments with :meth:`_cast_changed` applied; the same objects where nothing changes.

        The hook's hot path: the tensor arguments are handled inline (no call per tensor), and the parameter-cast
        cache is looked up once, at the first parameter to cast.
        """
        cache = _UNSET
        new_args = None  # a copy, made at the first argument that changes
        index = 0
        for item in args:
            if isinstance(item, torch.Tensor):
                current = item.dtype
                if current is not dtype and current in castable:
                    if new_args is None:
                        new_args = list(args)
                    if item.requires_grad and item.is_leaf:  # a parameter: cached
                        if cache is _UNSET:
                            cache = self._cache_now()
                        new_args[index] = item.to(dtype=dtype) if cache is None else _cached_cast(cache, item, dtype)
                    else:
                        new_args[index] = item.to(dtype=dtype)
            elif type(item) is tuple or type(item) is list:
                # not torch.Size or a namedtuple: _cast_changed sees to those
                cast = self._cast_sequence(item, dtype, castable, cache)
                if cast is not None:
                    if new_args is None:
                        new_args = list(args)
                    new_args[index] = cast
            elif isinstance(item, (list, tuple)):
                cast = self._cast_changed(item, dtype, castable, cache)
                if cast is not None:
                    if new_args is None:
                        new_args = list(args)
                    new_args[index] = cast
            index += 1
        if new_args is not None:
            args = tuple(new_args)
        if kwargs:
            new_kwargs = None
            for name, item in kwargs.items():
                if isinstance(item, torch.Tensor):
                    current = item.dtype
                    if current is dtype or current not in castable:
                        continue
                    cast = self._cast_tensor(item, dtype, cache)
                elif isinstance(item, (list, tuple)):
                    cast = self._cast_changed(item, dtype, castable, cache)
                    if cast is None:
                        continue
                else:
                    continue
                if new_kwargs is None:
                    new_kwargs = dict(kwargs)
                new_kwargs[name] = cast
            if new_kwargs is not None:
                kwargs = new_kwargs
        return args, kwargs


def _cached_cast(cache: dict[Any, Any], value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``value.to(dtype=dtype)`` through ``cache``, for a leaf tensor that requires grad (a parameter).

    Keyed by id() (Tensor.__hash__ is a Python call); the entry keeps the tensor alive, so the id cannot be reused
    while the entry exists. A tensor changed in place since (its version) or given new storage (its address) is cast
    again.
    """
    key = (id(value), dtype)
    hit = cache.get(key)
    try:
        version, address = value._version, value.data_ptr()
    except RuntimeError:
        # A tensor made under inference_mode has no version counter, and torch.func's wrappers (grad, vjp) no
        # storage: nothing tells a later change, so it is cast each time (free with a try in the usual case).
        return value.to(dtype=dtype)
    if hit is not None and hit[0] == version and hit[1] == address:
        return hit[2]
    cast = value.to(dtype=dtype)
    cache[key] = (version, address, cast, value, value.untyped_storage())  # see _CacheEntry
    return cast


class _CacheEntry(NamedTuple):
    """A cached cast and what it was made from (the cache stores it as a plain tuple in this order)."""

    version: int  # the tensor's version counter: in-place updates through the tensor itself bump it
    address: int  # its data_ptr(): ``p.data = other`` changes it
    cast: torch.Tensor
    tensor: torch.Tensor  # keeps the tensor alive, so that its id() is not reused while the entry exists
    storage: Any  # the storage cast from, kept alive so that a new storage cannot take its address
