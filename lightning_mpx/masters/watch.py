"""Half parameters that know their FP32 masters (O2): :class:`WatchedParameter` and its :class:`_DataWatch`.

A half parameter with a master is made a :class:`WatchedParameter` in place: its ``.data`` tells the masters when it
is handed out or replaced, and its watch links back to the :class:`~lightning_mpx.masters.weights.MasterWeights` that
holds the master, which so lives as long as the model does (as an FP32 model's weights), not only as long as the
engine that made it (a Trainer let go between two stages). Through that link:

* another engine that prepares the model (a new Trainer or Fabric plugin for a second stage) takes the masters over
  (:func:`take_fp32_value`): the old engine hands each one over, no FP32 copy made, and refuses a later step of its
  optimizers on it, so that every master has one owner;
* ``copy.deepcopy`` gives the copy's parameters their own FP32 values (a copy of the masters), carried until an
  engine prepares the copy (its masters start from them) or the copy is made FP32 (``.float()``, ``.to(float32)``:
  it takes them exactly), as a deep copy of a model trained in FP32 is FP32-exact. They cost the copy 4 bytes per
  parameter meanwhile, as an FP32 copy's weights do; a frozen copy (``requires_grad_(False)``) lets them go;
* the model made another dtype (``.float()``, ``.double()``, a bfloat16 model's ``.half()``) takes its masters and
  their engine lets them go; :func:`release_masters` lets a model kept in half let them go.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Protocol

import torch
from torch import nn

from lightning_mpx.common.dtypes import HALF_DTYPES

__all__ = ["WatchedParameter", "carried_value", "release_masters", "take_fp32_value"]

_WATCH = "_mpx_data_watch"  # a parameter's __dict__ key: its _DataWatch
_CARRIED = "_mpx_fp32"  # a deep copy's parameter's __dict__ key: the FP32 value it carries
_CARRIED_AT = "_mpx_fp32_version"  # ... and the parameter's version then: a write since (in place) makes it stale


class _Holder(Protocol):
    """What a watch's owner (a ``MasterWeights``) does for the parameters it watches."""

    def refresh(self, params: Any = None, *, force: bool = False) -> list[str]: ...

    def fp32_value(self, param: torch.Tensor) -> torch.Tensor | None: ...

    def hand_over(self, param: torch.Tensor, *, converted: bool = False) -> torch.Tensor | None: ...


class _DataWatch:
    """Which half parameters had their ``.data`` taken since the masters last looked (see :class:`WatchedParameter`).

    ``p.data`` is an alias of ``p`` with a version counter of its own, so writes through it (``p.data.copy_``,
    ``p.data.clamp_``) leave no trace on ``p``. The watch keeps, per parameter, a weak reference to each alias
    handed out and its version: an alias written while alive moves its own version; an alias that dies (the usual
    ``p.data.clamp_()`` temporary) marks its parameter for one value comparison, as nothing can tell any more
    whether it was written.

    Args:
        owner: The masters the watched parameters' masters belong to.
    """

    __slots__ = ("dirty", "aliases", "owner")

    def __init__(self, owner: _Holder | None = None) -> None:
        self.dirty: set[int] = set()  # ids of parameters to compare once
        # The masters that made the watch: a second stage's engine takes them over from the model, whether or not the
        # first stage's Trainer still exists (the masters hold their parameters weakly: no cycle keeps a model).
        self.owner = owner
        self.aliases: dict[int, list[tuple[weakref.ref[torch.Tensor], int]]] = {}  # live aliases and their versions

    def active(self) -> bool:
        return bool(self.dirty or self.aliases)

    def handed_out(self, param: torch.Tensor, alias: torch.Tensor) -> None:
        key, dirty = id(param), self.dirty
        live = [(ref, version) for ref, version in self.aliases.get(key, ()) if ref() is not None]
        live.append((weakref.ref(alias, lambda _: dirty.add(key)), alias._version))
        self.aliases[key] = live

    def assigned(self, param: torch.Tensor) -> None:
        self.dirty.add(id(param))

    def pending(self, keys: set[int]) -> set[int]:
        """The parameters among ``keys`` that :meth:`due` would give now, forgetting nothing (an export's look)."""
        due = self.dirty & keys
        for key in keys & self.aliases.keys():
            if any((alias := ref()) is not None and alias._version != version for ref, version in self.aliases[key]):
                due.add(key)
        return due

    def due(self, keys: set[int]) -> set[int]:
        """The parameters among ``keys`` whose ``.data`` may have been written since the last call (then forgotten,
        but for their live aliases' current versions)."""
        due = self.dirty & keys
        self.dirty -= due
        for key in [key for key in self.aliases if key in keys]:
            live = []
            for ref, version in self.aliases[key]:
                alias = ref()
                if alias is None:
                    continue
                if alias._version != version:
                    due.add(key)
                live.append((ref, alias._version))
            if live:
                self.aliases[key] = live
            else:
                del self.aliases[key]
        return due


_TENSOR_DATA = torch._C.TensorBase.data  # the C-level ``.data`` descriptor that WatchedParameter wraps
_APPLY = nn.Module._apply.__code__  # Module._apply: its conversions under swap (see _converting)


def _converting(name: str) -> Any:
    """``Tensor.<name>`` (a conversion: ``float``, ``to``, ...) for :class:`WatchedParameter`: as torch's, but called
    by ``Module._apply`` when it swaps tensors (``torch.__future__.set_swap_module_params_on_conversion(True)``),
    which sets no ``.data`` that the parameter could see, it gives the FP32 values (the masters', a deep copy's
    carried ones) converted; a parameter with masters (which hold it weakly: torch cannot swap it) is refused."""
    method = getattr(torch.Tensor, name)

    def convert(self: WatchedParameter, *args: Any, **kwargs: Any) -> torch.Tensor:
        value = method(self, *args, **kwargs)
        if torch.is_grad_enabled() or not torch.__future__.get_swap_module_params_on_conversion():
            return value
        frame, depth = sys._getframe(1), 0  # the conversion's lambda, then Module._apply
        while frame is not None and frame.f_code is not _APPLY and depth < 3:
            frame, depth = frame.f_back, depth + 1
        if frame is None or frame.f_code is not _APPLY:
            return value  # a user's own p.float(): a plain conversion, nothing taken
        old = _TENSOR_DATA.__get__(self)
        if _owner(self) is not None:  # refused before anything is taken: swap_tensors would fail on it after, even
            # for a move that returns the parameter itself (Module._apply swaps whatever the conversion returns)
            raise RuntimeError(
                f"a {old.dtype} parameter with FP32 masters cannot be moved or converted (to {value.dtype} on "
                f"{value.device}) with torch.__future__.set_swap_module_params_on_conversion(True): torch swaps the "
                "tensors, which it refuses for a parameter its engine refers to (weakly). Move or convert the model "
                "with the swap setting off (the masters' exact values are taken then), or convert "
                "copy.deepcopy(model), which takes them too."
            )
        if value is self or value.dtype == old.dtype:  # moved in half: the swap drops what the parameter carries
            # A plain tensor: Module._apply wraps it in nn.Parameter, which refuses this subclass ("Couldn't swap").
            return value.as_subclass(torch.Tensor) if isinstance(value, WatchedParameter) else value
        if _CARRIED in self.__dict__:
            return _with_carried(self, value)
        return value

    convert.__name__ = convert.__qualname__ = name
    return convert


class WatchedParameter(nn.Parameter):
    """An ``nn.Parameter`` whose ``.data`` tells its FP32 masters when it is handed out or replaced.

    The half parameters of a model with masters (O2, O3) get this class in place (``param.__class__``) for as long
    as they have masters; it behaves as ``nn.Parameter`` in every other way (``isinstance`` checks,
    ``torch.compile``, DDP, ``state_dict``). ``copy.deepcopy`` gives a parameter that carries a copy of its FP32
    value (see the module's notes; a plain ``nn.Parameter`` where there is none); pickling a plain one.
    """

    @property  # type: ignore[override]
    def data(self) -> torch.Tensor:
        alias = _TENSOR_DATA.__get__(self)
        watch = self.__dict__.get(_WATCH)
        if watch is not None:
            watch.handed_out(self, alias)
        return alias

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        if _CARRIED in self.__dict__:
            value = _with_carried(self, value)
        elif _WATCH in self.__dict__ and value.dtype != _TENSOR_DATA.__get__(self).dtype:
            value = _converted_from_masters(self, value)
        _TENSOR_DATA.__set__(self, value)
        if _CARRIED in self.__dict__:  # moved in half: the version to compare with is the new tensor's
            self.__dict__[_CARRIED_AT] = self._version
        watch = self.__dict__.get(_WATCH)
        if watch is not None:
            watch.assigned(self)
        elif _CARRIED not in self.__dict__:  # a deep copy made FP32: a plain parameter again
            self.__class__ = nn.Parameter

    float = _converting("float")  # type: ignore[assignment]
    double = _converting("double")  # type: ignore[assignment]
    half = _converting("half")  # type: ignore[assignment]
    bfloat16 = _converting("bfloat16")  # type: ignore[assignment]
    to = _converting("to")  # type: ignore[assignment]
    cpu = _converting("cpu")  # type: ignore[assignment]
    cuda = _converting("cuda")  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(nn.Parameter(_TENSOR_DATA.__get__(self), self.requires_grad))

    def requires_grad_(self, requires_grad: bool = True) -> WatchedParameter:
        # A deep copy frozen (a DPO reference, a distillation teacher: copy.deepcopy(model).requires_grad_(False))
        # lets its carried FP32 value go: 4 bytes per parameter on a 2-byte one, for a value an engine would not take
        # (a frozen half parameter gets no master) and only .float() would read.
        result = super().requires_grad_(requires_grad)
        if not requires_grad and _CARRIED in self.__dict__:
            _drop_carry(self)
            if _WATCH not in self.__dict__:
                self.__class__ = nn.Parameter
        return result

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Parameter:
        if id(self) in memo:
            return memo[id(self)]
        data = _TENSOR_DATA.__get__(self).clone(memory_format=torch.preserve_format)
        # A copy made under torch.inference_mode has no version counter to tell when its carried value goes stale:
        # it is a half copy, as in plain torch (an inference-only copy, which cannot be trained).
        value = carried_value(self) if not data.is_inference() else None
        result = (nn.Parameter if value is None else WatchedParameter)(data, self.requires_grad)
        if value is not None:
            result.__dict__[_CARRIED] = value.detach().clone()
            result.__dict__[_CARRIED_AT] = result._version
        memo[id(self)] = result
        return result

    def __reduce_ex__(self, protocol: Any) -> Any:
        plain = nn.Parameter(_TENSOR_DATA.__get__(self), self.requires_grad)
        plain.__dict__.update((k, v) for k, v in self.__dict__.items() if k not in (_WATCH, _CARRIED, _CARRIED_AT))
        return plain.__reduce_ex__(protocol)


def _owner(param: torch.Tensor) -> _Holder | None:
    """The masters ``param``'s watch belongs to (``None``: no watch)."""
    watch = param.__dict__.get(_WATCH)
    return watch.owner if watch is not None else None


def carried_value(param: torch.Tensor) -> torch.Tensor | None:
    """``param``'s FP32 value beyond its half one, changing no owner: the value a deep copy carries, or its master
    (the FP32 value kept for it) with the writes made to ``param`` since the last step taken first, as a step
    takes them; ``None`` when it has neither."""
    if type(param) is not WatchedParameter:
        return None
    if _CARRIED in param.__dict__:
        return _still_carried(param)
    owner = _owner(param)
    if owner is None:
        return None
    owner.refresh([param])
    return owner.fp32_value(param)


def release_masters(module: nn.Module) -> int:
    """Let go of the FP32 values kept for ``module``'s half parameters (O2): the masters of the engine that prepared
    it (that engine refuses a later step on them, as after a second stage took them) and the values a deep copy
    carries; for a model kept in half after training (inference, a frozen reference), as the masters otherwise live
    as long as the model. The model's half values are unchanged (``module.float()`` instead takes the masters into the
    model and lets them go). Returns the number of parameters let go."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module={type(module).__name__} is not a torch.nn.Module (pass the model itself).")
    count = 0
    for param in module.parameters():
        if type(param) is not WatchedParameter:
            continue
        owner = _owner(param)
        if owner is not None:
            owner.hand_over(param)
        _drop_carry(param)
        param.__dict__.pop(_WATCH, None)
        param.__class__ = nn.Parameter
        count += 1
    return count


def take_fp32_value(param: torch.Tensor, watch: _DataWatch) -> torch.Tensor | None:
    """The FP32 value the master ``watch``'s masters make for ``param`` starts from: the master of the engine that
    holds it, handed over (that engine lets it go, see ``MasterWeights.hand_over``), or the value a deep copy
    carries (then dropped from the parameter); ``None`` when there is neither."""
    if type(param) is not WatchedParameter:
        return None
    carried = _still_carried(param)
    _drop_carry(param)
    old = param.__dict__.get(_WATCH)
    owner = _owner(param) if old is not watch else None
    handed = owner.hand_over(param) if owner is not None else None
    if handed is not None or carried is None:
        return handed
    half = _TENSOR_DATA.__get__(param)
    return _reconciled(carried.to(half.device), half) if carried.shape == half.shape else None


def _still_carried(param: torch.Tensor) -> torch.Tensor | None:
    """The FP32 value a deep copy's ``param`` carries, ``None`` (and dropped) once the copy was written in place
    since it was made (``AveragedModel.update_parameters``, an optimizer's step, ``p.mul_()`` under ``no_grad``): the
    copy's values are its own then, and the carried ones a stale copy of what it was."""
    carried = param.__dict__.get(_CARRIED)
    if carried is not None and param.__dict__.get(_CARRIED_AT) != param._version:
        _drop_carry(param)
        return None
    return carried


def _drop_carry(param: torch.Tensor) -> None:
    param.__dict__.pop(_CARRIED, None)
    param.__dict__.pop(_CARRIED_AT, None)


def _reconciled(carried: torch.Tensor, half: torch.Tensor) -> torch.Tensor:
    """A deep copy's carried FP32 value where it still rounds to the copy's half value, and the half value (upcast)
    where the copy was written since it was made (an ``AveragedModel``'s in-place average, an EMA's
    ``p.data.mul_().add_()``): a carried value is the copy's FP32 truth only while the copy is what it was. In place
    on ``carried``."""
    with torch.no_grad():
        return torch.where(carried.to(half.dtype) == half, carried, half.to(carried.dtype), out=carried)


def _with_carried(param: WatchedParameter, value: torch.Tensor) -> torch.Tensor:
    """What ``param.data = value`` sets on a parameter that carries an FP32 value (a deep copy): made FP32 (the
    copy's ``.float()`` or ``.to(torch.float32)``), the carried value wherever ``value`` is the half value it
    replaces, and the carried value is dropped; kept (on ``value``'s device) through a move in half."""
    carried = _still_carried(param)
    _drop_carry(param)
    old = _TENSOR_DATA.__get__(param)
    if carried is None or value.shape != carried.shape or old.shape != carried.shape or old.dtype not in HALF_DTYPES:
        return value
    if value.dtype == old.dtype:  # moved (.to(device)) or replaced in half: still the copy's FP32 value
        param.__dict__[_CARRIED] = carried.to(value.device)
        return value
    return _from_fp32(param, _reconciled(carried.to(old.device), old), old, value)


def _converted_from_masters(param: WatchedParameter, value: torch.Tensor) -> torch.Tensor:
    """What ``param.data = value`` sets on a half parameter with masters when ``value`` has another dtype (the
    model's ``.float()``, ``.double()``, ``.half()`` of a bfloat16 model, an engine's conversion for another opt
    level): its FP32 master converted, wherever ``value`` is the conversion of the half value it replaces, as a deep
    copy's carried value gives (not the half rounding, 1e-3 off); the engine that holds the master lets it go (it
    refuses a later step on it), so that a model made FP32 after training does not keep its masters (4 more bytes
    per parameter) for as long as it lives. Made another half dtype, the parameter carries the FP32 value, as a
    deep copy does, for an engine that prepares it next."""
    old = _TENSOR_DATA.__get__(param)
    owner = _owner(param)
    if owner is None or old.dtype not in HALF_DTYPES or not value.is_floating_point() or value.shape != old.shape:
        return value
    fp32 = owner.hand_over(param, converted=True)
    del param.__dict__[_WATCH]
    return value if fp32 is None or fp32.shape != old.shape else _from_fp32(param, fp32, old, value)


def _from_fp32(param: WatchedParameter, fp32: torch.Tensor, old: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (``old`` converted to another dtype, or other values) with ``fp32``'s values converted wherever it
    is ``old``'s conversion; kept as ``param``'s carried value when ``value`` is half. ``fp32`` may be written."""
    if not value.is_floating_point() or value.shape != fp32.shape:
        return value
    with torch.no_grad():
        fp32 = fp32.detach().to(value.device)  # a master requires grad: the model's data must not
        same = value == old.to(value.device, value.dtype)
        if value.dtype == torch.float32:
            return torch.where(same, fp32, value, out=fp32)
        out = torch.where(same, fp32.to(value.dtype), value)
        if value.dtype in HALF_DTYPES:
            param.__dict__[_CARRIED] = torch.where(same, fp32, out.float(), out=fp32)
        return out


def _watch_data(param: torch.Tensor, watch: _DataWatch) -> None:
    """Make ``param`` tell ``watch`` about its ``.data`` (a plain ``nn.Parameter`` only: a subclass of the user's
    is left as it is, and writes through its ``.data`` need ``refresh_masters(force=True)`` or
    ``model_writes="values"``)."""
    if type(param) is nn.Parameter:
        param.__class__ = WatchedParameter
    if type(param) is WatchedParameter:
        param.__dict__[_WATCH] = watch


def _unwatch_data(param: torch.Tensor) -> None:
    if type(param) is WatchedParameter:
        param.__dict__.pop(_WATCH, None)
        if _CARRIED not in param.__dict__:
            param.__class__ = nn.Parameter
