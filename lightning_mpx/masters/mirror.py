"""What a step at O2 sees of a model's FP32 masters: one :class:`_Entry` per half parameter (its master, and the
version and address it had when the two last matched), the writes made to the half parameters taken into their
masters (:func:`_take_writes`), and the :class:`Mirror` of the parameters one optimizer steps, which takes those writes
before the step and copies the masters into the model after it (:func:`step_mirrored`). The masters themselves, made,
kept and checkpointed per model, are :class:`~lightning_mpx.masters.weights.MasterWeights`'.
"""

from __future__ import annotations

import functools
import operator
import weakref
from typing import Callable

import torch

from lightning_mpx.masters.watch import _DataWatch
from lightning_mpx.scaling.unscale import UnscaleWorkspace, _one_copy_group, cast_copy_

__all__ = ["Mirror", "handed_over_error", "step_mirrored"]

_VERSION = operator.attrgetter("_version")
_HANDED_OVER = -2  # an _Entry's version once its parameter went to another engine (MasterWeights.hand_over)
_CONVERTED = -3  # ... once its parameter was made another dtype, which took its master (hand_over(converted=True))


#: Said after a refusal of parameters made another dtype (``_CONVERTED``): the user's own conversion, diffusers'.
CONVERTED_HINT = (
    "If your code made them another dtype after the model was prepared at O2 (p.data = p.to(torch.float32), which "
    "diffusers' cast_training_params(model, dtype=torch.float32) does, or .float()): the optimizer steps FP32 masters "
    "of the half parameters already, so call cast_training_params before the model is prepared (accelerator.prepare, "
    "fabric.setup, the Trainer's fit), which makes them half with FP32 masters from those values, or leave it out (in "
    "a load_state hook the masters take the checkpoint's FP32 values exactly); to train them as FP32 parameters, name "
    "their modules in fp32_modules=[...] or train at O1."
)


def handed_over_error(name: str, *, converted: bool) -> RuntimeError:
    """The refusal of a step of parameter ``name``, handed over by its masters (``converted``: made another dtype),
    at any step: the first one (:func:`~lightning_mpx.masters.swap.mirrors`, where no mirror holds it yet) or a
    later one (:meth:`Mirror.take_writes`)."""
    hint = f" {CONVERTED_HINT}" if converted else ""
    return RuntimeError(
        f"parameter {name!r} was handed to another engine, which prepared its model since (a new "
        "MixedPrecisionPlugin, FabricMixedPrecisionPlugin or Amp: a second stage) and steps its FP32 master now, or "
        "was made another dtype since (the model's .float(), .double(), .half(), which took its FP32 master) or let "
        "go (release_masters); this optimizer's engine no longer holds it. Step the model with the optimizer of the "
        f"engine that prepared it last (prepare it again after changing its dtype).{hint}"
    )


class Mirror:
    """The half parameters one optimizer steps and their masters, held for its steps.

    :meth:`take_writes` and :meth:`copy_to_model` are what a step adds at O2: a comparison of the parameters'
    version counters and addresses as two tuples (C-level maps, about 0.1 us per parameter) and one look at the
    masters' :class:`_DataWatch` (whether anyone took a parameter's ``.data``), which find nothing in the common
    case, and the copy of the masters into the model (torch's multi-tensor copy, or the fused kernel with
    ``backend="triton"``).
    """

    def __init__(
        self,
        pairs: list[tuple[_Entry, torch.Tensor]],
        copy_backend: str,
        compare: bool = False,
        watch: _DataWatch | None = None,
    ) -> None:
        self.compare = compare  # compare values every step, not only version counters and handed-out .data
        self._pairs = pairs
        self._entries = [entry for entry, _ in pairs]
        self.params = [param for _, param in pairs]
        self.masters = [entry.master for entry, _ in pairs]
        self.copy_backend = copy_backend
        self.workspace = UnscaleWorkspace()
        self._watch = watch if watch is not None else _DataWatch()
        self._keys = {id(param) for param in self.params}
        self._marks: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        # Whether torch's copy takes every pair in one call (the auto or foreach backend; CPU tensors, or one device
        # and one dtype on each side): asked again when a parameter was written or replaced since the last step (it
        # may have moved to another device). A stale answer would cost speed only: torch's copy takes any pair on
        # any device.
        self._one_call: bool | None = None

    def _current(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return tuple(map(_VERSION, self.params)), tuple(map(torch.Tensor.data_ptr, self.params))

    def take_writes(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Take writes made to the parameters since the masters last matched them (see
        :meth:`MasterWeights.refresh`); returns the ``(parameter, master)`` pairs found written (version, address or
        ``.data`` moved; with ``compare``, values), taken where their half values changed: none in the usual step."""
        if self.compare:
            taken = set(_take_writes(self._pairs))
            written = [(e, p) for e, p in self._pairs if e.name in taken] if taken else []
        else:
            watch, params = self._watch, self.params
            # the watch's active() and _current() written out: the step's usual case is this comparison alone
            handed_out = watch.due(self._keys) if watch.dirty or watch.aliases else ()
            current = tuple(map(_VERSION, params)), tuple(map(torch.Tensor.data_ptr, params))
            if not handed_out and current == self._marks:
                return []
            written = [(e, p) for e, p in self._pairs if id(p) in handed_out or not e.unchanged(p)]
            _take_writes(written)
        self._marks = self._current()
        self._one_call = None
        return [(param, entry.master) for entry, param in written]

    def overlook_writes(self) -> None:
        """Leave writes made to the parameters since the last step out of the masters (a SAM-style optimizer's
        ``first_step`` perturbation and its undo): the masters hold the weights the step starts from, and
        :meth:`copy_to_model` after it overwrites what was written."""
        self._watch.due(self._keys)  # .data handed out since: consumed, not compared
        self._one_call = None

    def copy_to_model(self) -> None:
        """Write the masters into the half parameters (after a real step) and remember their new versions."""
        if not self.params:
            return
        if self._one_call is None:
            self._one_call = self.copy_backend in ("auto", "foreach") and _one_copy_group(self.masters, self.params)
        if self._one_call:  # cast_copy_'s usual case, without its per-step look at every tensor's device and dtype
            # torch's multi-tensor copy with gradients off (parameters are written), as scaling.unscale's
            # _foreach_copy_: written out here so that a step enters the kernels' module once, for its unscale
            grad_mode = torch.is_grad_enabled()
            torch._C._set_grad_enabled(False)
            try:
                torch._foreach_copy_(self.params, self.masters)
            finally:
                torch._C._set_grad_enabled(grad_mode)
        else:
            cast_copy_(self.params, self.masters, backend=self.copy_backend, workspace=self.workspace)
        params = self.params
        self._marks = versions, addresses = tuple(map(_VERSION, params)), tuple(map(torch.Tensor.data_ptr, params))
        for entry, version, address in zip(self._entries, versions, addresses):
            entry.version, entry.address = version, address


def step_mirrored(
    mirrors: list[Mirror],
    step: Callable[[], object],
    *,
    take: bool = True,
    judge: Callable[[list[tuple[torch.Tensor, torch.Tensor]]], None] | None = None,
) -> object:
    """One optimizer step seen through ``mirrors``: each one's writes taken (:meth:`Mirror.take_writes`; with
    ``take=False`` overlooked, :meth:`Mirror.overlook_writes`), ``step`` called (the masters stand in for the
    parameters), and the masters copied into the model (:meth:`Mirror.copy_to_model`); nothing is copied when ``step``
    raises. ``judge``: called, before ``step``, with the ``(parameter, master)`` pairs a mirror found written (the
    masters' gradients are the step's then), only when it found some. Returns what ``step`` returned."""
    for mirror in mirrors:
        if not take:
            mirror.overlook_writes()
        elif (written := mirror.take_writes()) and judge is not None:  # the usual step: nothing written, no call
            judge(written)
    returned = step()
    for mirror in mirrors:
        mirror.copy_to_model()
    return returned


def _resized(param: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """A new FP32 master for ``param``, resized since (``resize_token_embeddings``): its value, but for the leading
    elements it shares with ``master`` (the rows kept) where it still holds their rounding: those keep FP32."""
    new = param.detach().float()
    if master.dim() == param.dim():
        common = tuple(slice(0, min(a, b)) for a, b in zip(master.shape, param.shape))
        kept = master.detach()[common]
        torch.where(param.detach()[common] != kept.to(param.dtype), new[common], kept, out=new[common])
    return new


def _take_writes(pairs: list[tuple[_Entry, torch.Tensor]]) -> list[str]:
    """Take the writes of ``pairs``' parameters into their masters where the two differ as half values (the other
    elements keep their FP32 master value), with one host read for all; returns the names of those that changed."""
    taken: list[str] = []
    compared = []
    with torch.no_grad():
        for entry, param in pairs:
            master = entry.master
            if entry.version in (_HANDED_OVER, _CONVERTED):
                raise handed_over_error(entry.name, converted=entry.version == _CONVERTED)
            assert master is not None
            entry.mark(param)
            if master.device != param.device:
                master.data = master.data.to(param.device)
            if master.shape != param.shape:  # resized (``p.data = t``): where the two overlap, as any write
                master.data = _resized(param, master)
                taken.append(entry.name)
                continue
            # NaN != NaN: a NaN written is taken. Whether any element differs, not the mask: one parameter's mask
            # and rounding alive at a time (a mask each was a quarter of the masters' bytes, a save after a fit)
            compared.append((entry, param, (param != master.to(param.dtype)).any()))
        if not compared:
            return taken
        device = compared[0][2].device
        hits = torch.stack([differs.to(device) for _, _, differs in compared]).tolist()
        for (entry, param, _), hit in zip(compared, hits):
            if hit:  # the same half values written again (a checkpoint's rounding) keep the FP32 masters
                master = entry.master
                assert master is not None
                master.copy_(torch.where(param != master.to(param.dtype), param.float(), master))
                taken.append(entry.name)
    return taken


class _Entry:
    """One model parameter: its name, a weak reference, its master (``None`` until made; FP32 parameters have
    none) and the version and address it had when the master last matched it. When the parameter is collected (the
    user let its model go) the master and the kept FP32 value go with it at once, not at the engine's next walk of its
    entries: an engine that lives on (a notebook's, a second stage's) holds no FP32 copy of a model nobody holds."""

    __slots__ = ("name", "param", "master", "initial", "rounded", "version", "address", "__weakref__")

    def __init__(self, name: str, param: torch.Tensor) -> None:
        self.name = name
        # The callback holds the entry weakly (no cycle): a dropped MasterWeights is freed by reference counting.
        self.param = weakref.ref(param, functools.partial(_let_values_go, weakref.ref(self)))
        self.master: torch.Tensor | None = None
        self.initial: torch.Tensor | None = None  # the FP32 value before the cast to half, until the master is made
        self.rounded = False  # frozen when cast to half, its FP32 value not kept: a master made later is its rounding
        self.version = -1
        self.address = -1

    def mark(self, param: torch.Tensor) -> None:
        self.version, self.address = param._version, param.data_ptr()

    def unchanged(self, param: torch.Tensor) -> bool:
        return param._version == self.version and param.data_ptr() == self.address


def _let_values_go(entry: weakref.ref[_Entry], _: object) -> None:
    """A parameter's weak-reference callback: its entry lets go of its FP32 master and kept value."""
    held = entry()
    if held is not None:
        held.master = held.initial = None
