"""The FP32 sources of a half model's boundary casts, for the losses computed inside its forward.

At O2 and O3 the model boundary casts every floating input to half (Apex's ``cast_model_inputs``), keyword arguments
included: a Hugging Face model's float ``labels=`` (a regression head's targets, SpeechT5's mel frames, which its
decoder prenet reads in half) come in rounded. The loss policy then upcasts a half argument of a loss function to
FP32, which restores the dtype but not the values: targets near 300 are off by up to 1 in bfloat16.

So each boundary cast *notes* its half tensors' sources: the half tensor carries its source (an attribute, set by
:func:`remember`) until the forward ends, then weakly (:func:`forget`, called by the boundary that noted it: the
Trainer plugin's hooks, the Accelerate adapter's forward, or, for ``Amp.cast_inputs``, :func:`forget_scope` when the
thread's outermost scope of the cast policy ends). Where the
loss policy upcasts a half argument (a table with :attr:`~lightning_mpx.casting.table.CastTable.exact_sources`: O2's
and O3's), :func:`exact_sources` gives it the source's own values: the tensor itself, or a view of it
(``labels.squeeze()``, ``labels[:, 1:]``, ``.view(-1)``: the same elements of the source, through ``as_strided``).
Anything else derived from it (``labels * 2``, a copy to another device) or a tensor written in place since the cast
(its version counter) is upcast as before, rounded; of the rest, only the elements whose half value is still the
source's rounding take the source (a write through ``.data`` or into the source has no trace on the counter), and
the gradient goes where the half value's would. Compute keeps the half tensor.

Under ``torch.compile`` nothing is noted (dynamo cannot trace an attribute set on a tensor without a graph break):
compiled code upcasts the rounded values, as before.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any

import torch

from lightning_mpx.common.containers import _cast_collection
from lightning_mpx.common.dtypes import HALF_DTYPES

#: The attribute a noted half tensor carries: ``(source, version of the half tensor when cast)``.
SOURCE_ATTRIBUTE = "_lightning_mpx_source"

_new_object = object.__new__  # a slotted note made without its __init__'s call (one per noted tensor, every step)
_COMPILER = torch.compiler
_dynamo_compiling = torch.compiler.is_dynamo_compiling
_stack_length, _stack_at = torch._C._len_torch_function_stack, torch._C._get_function_stack_at
# Torch functions run without any torch-function mode (a C context manager: no Python call to enter or leave).
_no_torch_function = torch._C.DisableTorchFunction
_ref = weakref.ref


class _Source:
    """A noted half tensor's source: held while its forward runs, weakly after it (:meth:`release`): a half tensor
    that autograd keeps holds no FP32 batch, and a checkpoint's loss recomputed in the backward pass takes the
    values its forward took while the caller still holds the batch. A copy or pickle of the half tensor (a model
    deep-copied mid-forward) carries none."""

    __slots__ = ("tensor", "ref")

    def __init__(self, tensor: torch.Tensor | None = None) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.ref: weakref.ref[torch.Tensor] | None = None

    def get(self) -> torch.Tensor | None:
        if self.tensor is not None:
            return self.tensor
        return None if self.ref is None else self.ref()

    def release(self) -> None:
        if self.tensor is not None:
            self.ref, self.tensor = weakref.ref(self.tensor), None

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Source, ())


def _release(half: torch.Tensor) -> None:
    note = half.__dict__.get(SOURCE_ATTRIBUTE)
    if note is not None:
        note[0].release()


class _Note:
    """A noted half tensor (weakly) and the thread that noted it; compared by identity (a list removes it)."""

    __slots__ = ("ref", "thread")

    def __init__(self, half: torch.Tensor, thread: int) -> None:
        self.ref, self.thread = weakref.ref(half), thread


class Notes(list):  # type: ignore[type-arg]
    """A cast policy's notes (:class:`_Note`: a noted half tensor, weakly, and its thread) until the thread's
    outermost scope of the policy ends (:func:`forget_scope`).

    Weak: a cast made where no scope follows (``Amp.cast_inputs`` in a plain evaluation loop) keeps no FP32 batch
    alive once the caller drops its half tensors. Per thread: one thread's scope leaves another thread's forward its
    notes. A copy or pickle of the policy holds none (it is in no forward)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (Notes, ())


def _hold(held: Notes, noted: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    _note(noted, held, set_sources=False)


def _note(noted: list[tuple[torch.Tensor, torch.Tensor]], held: Notes | None, *, set_sources: bool = True) -> None:
    """With ``set_sources``, let each half tensor of ``noted`` carry its source (:class:`_Source`, with the version a
    new cast has: 0, ``None`` under inference mode); with ``held``, a policy's notes, drop its dead notes and note
    each half tensor there for this thread. One call for both (the usual O2 input cast, every step): the notes and
    sources are made without their ``__init__``'s calls."""
    if set_sources:
        # A cast is a new tensor: its version is 0 (read, it would be a call into an active torch-function mode). Made
        # under inference mode it has no version counter: None, and the values tell a write (see exact_source).
        version = None if torch.is_inference_mode_enabled() else 0
        for half, source in noted:
            kept = _new_object(_Source)
            kept.tensor, kept.ref = source, None
            setattr(half, SOURCE_ATTRIBUTE, (kept, version))
    if held is None:
        return
    thread = threading.get_ident()
    for entry in list(held):  # drop the dead (bounded where no scope ends); removal one by one: other threads append
        if entry.ref() is None:
            try:
                held.remove(entry)
            except ValueError:
                pass
    for half, _ in noted:
        note = _new_object(_Note)
        note.ref, note.thread = _ref(half), thread
        held.append(note)


def remember(noted: list[tuple[torch.Tensor, torch.Tensor]], *, share: bool = True
             ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Let each half tensor of ``noted`` carry its source; returns what :func:`forget` takes back (empty under
    ``torch.compile``, where nothing is set).

    Under inference mode a view does not know its base (``_base`` is ``None``): the loss policy then finds a view's
    noted tensor by its storage among the notes its policy holds, so with ``share`` the notes are also given to the
    cast policies active on this thread (the boundary's hooks run inside the step's policy scope), until their scope
    ends."""
    if not noted:
        return noted
    # torch.compiler.is_compiling() with a call saved: dynamo makes is_dynamo_compiling() a constant True (the flag
    # is not traced); eager code reads the flag that is_compiling() returns there.
    if _dynamo_compiling() or _COMPILER._is_compiling_flag:
        return []
    _note(noted, None)
    if share and torch.is_inference_mode_enabled():
        for mode in torch.overrides._get_current_function_mode_stack():
            held = getattr(getattr(mode, "policy", None), "_noted", None)
            if type(held) is Notes:
                _hold(held, noted)
    return noted


def cast_model_inputs(policy: Any, data: Any, dtype: torch.dtype) -> Any:
    """``Amp.cast_inputs``: the FP32 and FP64 tensors in ``data`` cast to ``dtype``, each noted with its source on
    ``policy`` (when its table takes sources: O2's, O3's) until the policy's scope ends (the forward that
    ``forward_context`` runs: Fabric casts the inputs just before it)."""
    if policy is None or not policy.table.exact_sources:
        if type(data) is torch.Tensor:  # _cast_collection's usual case, without its call
            return data.to(dtype) if data.dtype in (torch.float32, torch.float64) else data
        return _cast_collection(data, dtype, (torch.float32, torch.float64))
    if type(data) is torch.Tensor:  # the usual case, without a call
        eager = not (_dynamo_compiling() or _COMPILER._is_compiling_flag)  # torch.compiler.is_compiling(), a call saved
        # In eager code with no mode on or only this policy's (the forward scope, which passes both through), the
        # dtype read and the cast run with torch-function handling off: each would be a call into the mode.
        plain = eager and (not _stack_length() or (
            _stack_length() == 1 and getattr(_stack_at(0), "policy", None) is policy))
        with _no_torch_function() if plain else contextlib.nullcontext():
            if data.dtype not in (torch.float32, torch.float64):
                return data  # token ids
            noted = [(data.to(dtype), data)]
        data = noted[0][0]
    else:
        noted = []
        data = _cast_collection(data, dtype, (torch.float32, torch.float64), noted)
        # Asked when cast. `if noted`, not bool(noted): dynamo of torch 2.11 cannot trace bool() of a list (a break).
        eager = not (_dynamo_compiling() or _COMPILER._is_compiling_flag) if noted else False
    # Nothing cast (token ids in a tuple): no call. Else, in one call, each half tensor carries its source and the
    # policy holds a note of it (remember(noted, share=False) and _hold(policy._noted, noted) in one); nothing under
    # torch.compile (as remember).
    if noted and eager:
        _note(noted, policy._noted)
    return data


def forget(noted: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Take the sources back from the half tensors :func:`remember` gave them to (the forward ended: a half tensor
    that autograd keeps for the backward pass must not keep an FP32 batch alive with it)."""
    for half, _ in noted:
        _release(half)
    noted.clear()


def forget_scope(policy: Any) -> None:
    """A scope of ``policy`` ended: at this thread's outermost one, the sources of the casts this thread noted on
    the policy go (a scope nested inside a forward, a teacher's inside a student's, leaves the outer forward its
    notes; another thread's forward keeps its own)."""
    for at in range(_stack_length()):  # the mode stack read at the C level (torch's helper takes two calls)
        if getattr(_stack_at(at), "policy", None) is policy:
            return
    held, thread = policy._noted, threading.get_ident()
    for entry in list(held):
        if entry.thread == thread:
            half = entry.ref()
            if half is not None:  # _release(half) and _Source.release, written out: two calls saved per note
                note = half.__dict__.get(SOURCE_ATTRIBUTE)
                if note is not None and (source := note[0]).tensor is not None:
                    source.ref, source.tensor = _ref(source.tensor), None
            try:
                held.remove(entry)
            except ValueError:
                pass


def exact_source(value: torch.Tensor, dtype: torch.dtype, held: Notes) -> torch.Tensor | None:
    """The source's values of the half tensor ``value`` (a noted tensor or a view of one) in ``dtype``, or ``None``
    (also under ``torch.compile``). ``held``: the notes of the policy, searched by storage for a view that does not
    know its base."""
    if torch.compiler.is_compiling():
        return None
    base = value._base
    root = value if base is None else base
    note = getattr(root, SOURCE_ATTRIBUTE, None)
    if note is None:
        if base is not None or not held:
            return None
        address = value.untyped_storage().data_ptr()  # a view made under inference mode: its storage tells
        root = next((half for half in (note.ref() for note in held)
                     if half is not None and half.untyped_storage().data_ptr() == address), None)
        note = None if root is None else getattr(root, SOURCE_ATTRIBUTE, None)
        if note is None:
            return None
    source, version = note[0].get(), note[1]
    if source is None:
        return None  # the forward ended and the caller dropped the batch
    if value.dtype is not root.dtype or (version is not None and root._version != version):
        return None  # a view as another dtype, or written in place since the cast (a view shares its base's counter)
    if root.shape != source.shape:
        return None  # given other data since the cast (``labels.data = ...``)
    # The gradient goes where the half value's would: nowhere through a detach() or a view made under no_grad (found
    # by its base or storage), and a half tensor made a leaf of its own (``labels.requires_grad_()``) keeps it.
    if value.requires_grad:
        if not source.requires_grad:
            return None
    elif source.requires_grad:
        source = source.detach()
    if value is not root:
        if source.stride() != root.stride():
            source = source.contiguous()  # the cast of a tensor that is not dense made a contiguous one
            if source.stride() != root.stride():
                return None
        offset = value.storage_offset() - root.storage_offset() + source.storage_offset()
        source = source.as_strided(value.size(), value.stride(), offset)
    # The source only where the half value is still its rounding (no sync): under inference mode (no version
    # counter), and for a write the counter does not see (``labels.data.mul_(2)``: ``.data`` has a counter of its
    # own) or one into the source since the cast (the model never saw those values).
    return torch.where(source.to(dtype=value.dtype) == value, source.to(dtype=dtype), value.to(dtype=dtype))


def exact_sources(args: tuple[Any, ...], kwargs: dict[str, Any] | None, dtype: torch.dtype,
                  held: Notes) -> tuple[tuple[Any, ...], dict[str, Any] | None]:
    """The call's arguments with each noted half tensor (or view of one) replaced by its source in ``dtype``; the
    same objects where none is (the loss policy's casts then handle the rest as before). ``held``: the policy's
    notes (see :func:`exact_source`)."""
    if torch.compiler.is_compiling():
        return args, kwargs
    new_args = _with_sources(enumerate(args), dtype, held)
    if new_args:
        args = tuple(new_args.get(index, item) for index, item in enumerate(args))
    if kwargs:
        new_kwargs = _with_sources(kwargs.items(), dtype, held)
        if new_kwargs:
            kwargs = {**kwargs, **new_kwargs}
    return args, kwargs


def _with_sources(items: Any, dtype: torch.dtype, held: Notes) -> dict[Any, torch.Tensor]:
    """The exact sources of the noted half tensors among ``items`` (key, value pairs), by key; empty when none."""
    found = {}
    for key, item in items:
        if isinstance(item, torch.Tensor) and item.dtype in HALF_DTYPES:
            exact = exact_source(item, dtype, held)
            if exact is not None:
                found[key] = exact
    return found
