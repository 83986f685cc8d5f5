"""The cast policy: apply a :class:`~lightning_mpx.cast_table.CastTable` during a scope.

Nothing in torch is patched. Inside ``with policy.scope():`` a :class:`torch.overrides.TorchFunctionMode` sees every
call to a torch function, ``torch.nn.functional`` function or ``Tensor`` method made on this thread, looks the
function up in the table and casts the floating-point tensor arguments:

* ``half``: FP32 inputs become the half dtype (FP64 is left alone, as ``torch.autocast`` does);
* ``float``: half inputs become FP32;
* ``promote`` and ``sequence``: when the floating inputs disagree, all become the widest of them;
* ``banned``: :class:`BannedOpError`, or FP32 when the policy allows banned ops;
* anything else runs with its inputs as given, and so does a call with an ``out=`` tensor: casting ``out`` would
  write the result into a copy (as ``torch.autocast``, such calls are not cast).

Torch dispatches a torch function written in Python (``F.softmax``, ``F.multi_head_attention_forward``...) to the
mode as one call, and the ops it calls internally run with the mode set aside: such a function is cast as a whole,
by its own table entry, or runs as given when the table does not list it.

Casts of leaf tensors that require grad (the parameters) are cached until :meth:`CastPolicy.clear_cache`, which the
training loop calls at each iteration boundary; a parameter changed in place since (an optimizer step between two
forward passes) is cast again. Casts are differentiable, so gradients reach the FP32 parameters in FP32.
"""

from __future__ import annotations

import contextlib
from types import MappingProxyType
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from lightning_mpx._dtypes import parse_half_dtype
from lightning_mpx.cast_table import CastTable

# Actions, resolved once per function and memoised by each policy.
_PASS, _HALF, _FLOAT, _PROMOTE, _SEQUENCE, _BANNED = range(6)
_CATEGORY_ACTION = MappingProxyType(
    {"half": _HALF, "float": _FLOAT, "promote": _PROMOTE, "sequence": _SEQUENCE, "banned": _BANNED}
)
_LOW = (torch.float16, torch.bfloat16)


class BannedOpError(RuntimeError):
    """A banned op (such as ``binary_cross_entropy``) was called inside a cast-policy scope."""


class CastPolicy:
    """Applies a cast table to torch calls made inside :meth:`scope`.

    Args:
        table: The table to apply; a fresh :meth:`CastTable.default` when ``None``. The policy reads the table live,
            so registering into it later takes effect at the next scope.
        half_dtype: ``torch.float16`` or ``torch.bfloat16`` (or their names).
        allow_banned: Run banned ops in FP32 instead of raising :class:`BannedOpError`.
        cache_casts: Cache the half copies of parameters until :meth:`clear_cache`.

    Example:
        >>> policy = CastPolicy(half_dtype="bfloat16")
        >>> with policy.scope():  # doctest: +SKIP
        ...     loss = model(x).sum()
        >>> loss.backward(); optimizer.step(); policy.clear_cache()  # doctest: +SKIP
    """

    def __init__(
        self,
        table: CastTable | None = None,
        half_dtype: str | torch.dtype = torch.float16,
        *,
        allow_banned: bool = False,
        cache_casts: bool = True,
    ) -> None:
        self.table = table if table is not None else CastTable.default()
        self.half_dtype = parse_half_dtype(half_dtype)
        self.allow_banned = allow_banned
        self.cache_casts = cache_casts
        self._actions: dict[Callable[..., Any], int] = {}
        # The table and table version that _actions was memoised from. The table itself, not its id(): an id can be
        # reused by a new table once the old one is freed.
        self._actions_of: tuple[CastTable | None, int] = (None, -1)
        # (id(tensor), dtype, grad enabled) -> (tensor._version when cast, cast tensor, tensor)
        self._cache: dict[tuple[int, torch.dtype, bool], tuple[int, torch.Tensor, torch.Tensor]] = {}

    @contextlib.contextmanager
    def scope(self) -> Iterator[CastPolicy]:
        """Apply the policy to torch calls on this thread until the block ends (also when it raises)."""
        table, version = self._actions_of
        if table is not self.table or version != self.table._version:
            self._actions = {}
            self._actions_of = (self.table, self.table._version)
        with _CastMode(self):
            yield self

    def clear_cache(self) -> None:
        """Drop the cached casts of parameters: call it at each iteration boundary, after the optimizer step."""
        self._cache.clear()

    @property
    def cache_size(self) -> int:
        return len(self._cache)

    # -- internals ----------------------------------------------------------------------------------------------
    def _classify(self, func: Callable[..., Any]) -> int:
        category = self.table.category_of(func)
        action = _PASS if category is None else _CATEGORY_ACTION[category]
        self._actions[func] = action
        return action

    def _cast(self, value: Any, dtype: torch.dtype, castable: tuple[torch.dtype, ...]) -> Any:
        if isinstance(value, torch.Tensor):
            if value.dtype not in castable or value.dtype is dtype:
                return value
            if value.requires_grad and value.is_leaf and self.cache_casts:
                # Keyed by id() (Tensor.__hash__ is a Python call); the entry keeps the tensor alive, so the id
                # cannot be reused while the entry exists.
                key = (id(value), dtype, torch.is_grad_enabled())
                hit = self._cache.get(key)
                version = value._version
                if hit is not None and hit[0] == version:
                    return hit[1]
                cast = value.to(dtype)
                self._cache[key] = (version, cast, value)
                return cast
            return value.to(dtype)
        if type(value) is list or (isinstance(value, tuple) and not isinstance(value, torch.Size)):
            if not value:
                return value
            cast_items = [self._cast(item, dtype, castable) for item in value]
            if all(new is old for new, old in zip(cast_items, value)):
                return value  # nothing to cast: keep the caller's container, whatever its type
            if isinstance(value, list):
                return cast_items
            return type(value)(*cast_items) if hasattr(value, "_fields") else tuple(cast_items)  # namedtuple
        return value

    def _cast_all(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None, dtype: torch.dtype,
                  castable: tuple[torch.dtype, ...]) -> tuple[tuple[Any, ...], dict[str, Any] | None]:
        cast = self._cast
        args = tuple([cast(a, dtype, castable) for a in args])
        if kwargs:
            kwargs = {k: cast(v, dtype, castable) for k, v in kwargs.items()}
        return args, kwargs


def _widest(values: Any, found: set[torch.dtype]) -> None:
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.is_floating_point():
                found.add(value.dtype)
        elif isinstance(value, (list, tuple)):
            _widest(value, found)


def _promote_dtype(found: set[torch.dtype]) -> torch.dtype | None:
    if len(found) < 2:
        return None
    widest = found.pop()
    for dtype in found:
        widest = torch.promote_types(widest, dtype)
    return widest


_ALL_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class _CastMode(TorchFunctionMode):
    """The torch-function mode behind :meth:`CastPolicy.scope`; one per scope entry."""

    def __init__(self, policy: CastPolicy) -> None:
        super().__init__()
        self.policy = policy
        self.disabled = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        policy = self.policy
        action = policy._actions.get(func)
        if action is None:
            action = policy._classify(func)
        if action == _PASS or self.disabled:
            return func(*args, **kwargs) if kwargs else func(*args)
        if action != _BANNED and kwargs and kwargs.get("out") is not None:
            # Casting the out= tensor would write the result into a copy that the caller never sees.
            return func(*args, **kwargs)
        if action == _HALF:
            args, kwargs = policy._cast_all(args, kwargs, policy.half_dtype, (torch.float32,))
        elif action == _FLOAT:
            args, kwargs = policy._cast_all(args, kwargs, torch.float32, _LOW)
        elif action == _PROMOTE or action == _SEQUENCE:
            found: set[torch.dtype] = set()
            _widest(args, found)
            if kwargs:
                _widest(tuple(kwargs.values()), found)
            widest = _promote_dtype(found)
            if widest is not None:
                args, kwargs = policy._cast_all(args, kwargs, widest, _ALL_FLOATS)
        elif action == _BANNED:
            if not policy.allow_banned:
                raise BannedOpError(policy.table.banned_advice(func))
            args, kwargs = policy._cast_all(args, kwargs, torch.float32, _LOW)
        return func(*args, **kwargs) if kwargs else func(*args)


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Run the enclosed code with every active cast policy on this thread turned off.

    Useful inside a model's forward for a block that must see its inputs exactly as given. The policies are found on
    torch's own torch-function mode stack; their state is restored when the block ends, also when it raises.
    """
    modes = [mode for mode in torch.overrides._get_current_function_mode_stack() if isinstance(mode, _CastMode)]
    for mode in modes:
        mode.disabled += 1
    try:
        yield
    finally:
        for mode in modes:
            mode.disabled -= 1
