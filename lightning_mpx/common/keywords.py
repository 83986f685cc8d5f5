"""Keyword arguments a callable does not take, refused with the value given, the valid ones and the closest of them
(Python's own ``TypeError`` names neither): :func:`check_keywords` for a check written in place, :func:`checks_keywords`
to wrap a function or a dataclass's generated ``__init__``.

A function called at every step (a clip, an optimizer's ``step``, Apex's ``scale_loss``) is not wrapped (the wrapper
would be a Python call more per step): it takes the misspelt ones itself, ``**misspelt: NoReturn`` (no keyword a type
checker accepts there), and refuses any with :func:`check_keywords` in its body, which costs nothing when there are
none."""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar, cast

__all__ = ["check_keywords", "checks_keywords", "checks_method_keywords"]

F = TypeVar("F", bound=Callable[..., Any])
_BY_NAME = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def check_keywords(where: str, given: Iterable[str] | Mapping[str, Any], valid: Sequence[str]) -> None:
    """Raise ``TypeError`` naming the first of ``given`` that is not in ``valid``, the valid keywords and the closest
    of them, as Python does for a keyword a function does not take (``where``: the callable's name, e.g.
    ``"LossScaler()"``); ``given`` a mapping (the keyword arguments): the value given too."""
    for name in given:
        if name not in valid:
            near = difflib.get_close_matches(name, valid, n=1)
            value = f" (given: {name}={_short(given[name])})" if isinstance(given, Mapping) else ""
            choices = f"valid choices: {', '.join(valid)}." if valid else "it takes no keyword arguments."
            raise TypeError(
                f"{where} got an unexpected keyword argument {name!r}; {choices}"
                + (f" Did you mean {near[0]}=?" if near else "")
                + value
            )


def _short(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (a tensor's or a model's would fill the message)."""
    text = " ".join(repr(value).split())  # one line (an optimizer's repr spans several)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def checks_keywords(where: str, valid: Sequence[str] | None = None) -> Callable[[F], F]:
    """Decorator: the function refuses a keyword it does not take with :func:`check_keywords`' message before it
    runs (``valid``: its parameters that can be passed by name, when not given). Its signature, name and docstring
    stay the function's own (``functools.wraps``: ``inspect.signature`` and IDEs show the real parameters)."""

    def decorate(function: F) -> F:
        names = tuple(valid) if valid is not None else tuple(
            name for name, p in inspect.signature(function).parameters.items() if p.kind in _BY_NAME
            and name != "self"
        )  # fmt: skip

        @functools.wraps(function)
        def checked(*args: Any, **kwargs: Any) -> Any:
            check_keywords(where, kwargs, names)
            return function(*args, **kwargs)

        return cast(F, checked)

    return decorate


def checks_method_keywords(prefix: str, names: Sequence[str]) -> Callable[[type], type]:
    """Class decorator: each method of the class named in ``names`` (its own or inherited) refuses a keyword it does
    not take as :func:`checks_keywords` does, as ``f"{prefix}.{name}()"`` (``"accelerator.prepare()"``); the methods
    are wrapped once, on this class (a method of a base class is left as it is there)."""

    def decorate(cls: type) -> type:
        for name in names:
            method = getattr(cls, name)
            setattr(cls, name, checks_keywords(f"{prefix}.{name}()")(method))
        return cls

    return decorate
