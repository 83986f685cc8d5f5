"""Casting the tensors inside a collection (lists, tuples, namedtuples, mappings, dataclasses), rebuilt as their types.

Shared by :class:`~lightning_mpx.engine.amp.Amp`, the adapters and :mod:`lightning_mpx.health.promotion`; it imports
nothing of the package, so none of them has to import another to use it. :func:`read_floats` reads a metrics dict
on the host in one transfer per device.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from typing import Any, Mapping, MutableMapping

import torch


def _cast_collection(data: Any, dtype: torch.dtype, castable: tuple[torch.dtype, ...],
                     noted: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> Any:
    """``data`` with its tensors of a ``castable`` dtype cast to ``dtype``, through lists, tuples, namedtuples,
    mappings and dataclasses, each rebuilt as its own type (a Hugging Face ``ModelOutput``, which is both an
    ``OrderedDict`` and a dataclass, stays one; a ``defaultdict`` keeps its ``default_factory``).

    ``noted``: a list that each cast is appended to as ``(cast, tensor)`` (the model boundary's casts, whose sources
    the losses inside the forward take: :mod:`lightning_mpx.casting.targets`)."""
    # Exact types first, in loops rather than comprehensions: a step's inputs and outputs (a tensor, Fabric's
    # ``(args, kwargs)``) cost one call per container, not the ABC checks' and generators' several.
    kind = type(data)
    if kind is torch.Tensor:
        if data.dtype not in castable:
            return data
        return data.to(dtype) if noted is None else _noted_cast(data, dtype, noted)
    if kind is tuple or kind is list:
        items = []
        for value in data:
            inner = type(value)
            if inner is torch.Tensor:  # _noted_cast inline: no call per tensor
                if value.dtype in castable:
                    cast = value.to(dtype)
                    if noted is not None:
                        noted.append((cast, value))
                    value = cast
                items.append(value)
            elif inner is dict and not value:  # Fabric's empty kwargs: a new empty dict, as the call below makes
                items.append({})
            else:
                items.append(_cast_collection(value, dtype, castable, noted))
        return items if kind is list else tuple(items)
    if kind is dict:
        new = {}
        for key, value in data.items():
            if type(value) is torch.Tensor:  # as in the loop above
                if value.dtype in castable:
                    cast = value.to(dtype)
                    if noted is not None:
                        noted.append((cast, value))
                    value = cast
                new[key] = value
            else:
                new[key] = _cast_collection(value, dtype, castable, noted)
        return new
    if isinstance(data, torch.Tensor):
        if data.dtype not in castable:
            return data
        return data.to(dtype) if noted is None else _noted_cast(data, dtype, noted)
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        return _cast_dataclass(data, dtype, castable, noted)
    if isinstance(data, Mapping):
        return _cast_mapping(data, dtype, castable, noted)
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(_cast_collection(v, dtype, castable, noted) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(_cast_collection(v, dtype, castable, noted) for v in data)
    return data


def _noted_cast(tensor: torch.Tensor, dtype: torch.dtype, noted: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> torch.Tensor:
    cast = tensor.to(dtype)
    noted.append((cast, tensor))
    return cast


def _cast_dataclass(data: Any, dtype: torch.dtype, castable: tuple[torch.dtype, ...], noted: Any = None) -> Any:
    # replace() runs __init__ and __post_init__ again, which a ModelOutput needs to rebuild its mapping.
    changes = {
        f.name: _cast_collection(getattr(data, f.name), dtype, castable, noted)
        for f in dataclasses.fields(data)
        if f.init and hasattr(data, f.name)
    }
    new = dataclasses.replace(data, **changes)
    if isinstance(data, MutableMapping):  # keys set as items, outside the fields, come along too
        for key, value in data.items():
            if key not in new:
                new[key] = _cast_collection(value, dtype, castable, noted)
    return new


def _cast_mapping(data: Mapping[Any, Any], dtype: torch.dtype, castable: tuple[torch.dtype, ...],
                  noted: Any = None) -> Any:
    items = {key: _cast_collection(value, dtype, castable, noted) for key, value in data.items()}
    if isinstance(data, collections.defaultdict):
        return type(data)(data.default_factory, items)
    try:
        return type(data)(items)
    except TypeError:  # a constructor that takes no mapping: fill a shallow copy instead
        if not isinstance(data, MutableMapping):
            raise TypeError(
                f"cannot rebuild a {type(data).__name__} with cast tensors: its constructor takes no mapping and it "
                "cannot be changed in place; return a dict, a dataclass or a MutableMapping from the model."
            ) from None
        new = copy.copy(data)
        new.update(items)
        return new


def read_floats(values: Mapping[str, Any]) -> dict[str, float]:
    """``values`` (tensors of one element or Python numbers) as Python floats, the tensors of each device read in one
    host transfer (``float()`` of each would wait for the device once per tensor: a metrics dict read on a logging
    step). Each value is exactly what ``float(value)`` gives."""
    out = {name: value for name, value in values.items() if not isinstance(value, torch.Tensor)}
    by_device: dict[torch.device, list[str]] = {}
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            by_device.setdefault(value.device, []).append(name)
    for names in by_device.values():
        # float64 holds every float32 and every integer up to 2**53 exactly: float() of each gives the same number
        read = torch.stack([values[n].detach().reshape(()).to(torch.float64) for n in names]).tolist()
        out.update(zip(names, read))
    return {name: float(out[name]) for name in values}
