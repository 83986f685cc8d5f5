"""Keyword arguments a callable does not take, refused with the value given, the valid ones and the closest of them
(Python's own ``TypeError`` names neither): :func:`check_keywords` for a check written in place, :func:`checks_keywords`
to wrap a function or a dataclass's generated ``__init__``.

A function called at every step (a clip, an optimizer's ``step``, Apex's ``scale_loss``) is not wrapped (the wrapper
would be a Python call more per step): it takes the misspelt ones itself, ``**misspelt: NoReturn`` (no keyword a type
checker accepts there), and refuses any with :func:`check_keywords` in its body, which costs nothing when there are
none.
A required argument of such a function defaults to :func:`required` (Python's "missing 1 required positional
argument", raised before the body runs, named an internal class and not the misspelt keyword): the body's check then
names the misspelt keyword and the one meant, and an argument left out is refused, naming the call and the argument,
where it is first used (:class:`Required`), still with no check per call."""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar, cast

__all__ = ["Required", "check_keywords", "checks_keywords", "checks_method_keywords", "required"]

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


class Required:
    """The default of a required argument of a per-step function that takes misspelt keywords itself (``where``: the
    call's name, ``name``: the argument's): every use of it (a number, a comparison, arithmetic, iterating it, an
    attribute) raises ``TypeError`` naming the call and the argument, as Python's "missing 1 required argument" (see
    the module's notes). The function's body needs no check: where its own checks refuse the value (an error path),
    :meth:`refuse` says that instead."""

    __slots__ = ("where", "name")

    def __init__(self, where: str, name: str) -> None:
        self.where, self.name = where, name

    def refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Raise the ``TypeError`` of the argument left out."""
        raise TypeError(f"{self.where} missing 1 required argument: {self.name!r}")

    def __repr__(self) -> str:
        return "<required>"

    def __getattr__(self, attribute: str) -> NoReturn:  # only for attributes it has not (a tensor's, a list's)
        self.refuse()

    __float__ = __int__ = __index__ = __bool__ = __len__ = __iter__ = __contains__ = __getitem__ = refuse
    __lt__ = __le__ = __gt__ = __ge__ = __neg__ = __abs__ = refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = __pow__ = refuse


def required(where: str, name: str) -> Any:
    """A :class:`Required` default for the argument ``name`` of ``where`` (typed ``Any``: it stands for any value)."""
    return Required(where, name)
