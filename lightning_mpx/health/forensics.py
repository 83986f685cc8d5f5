"""Overflow forensics: how the record of an overflow step is built, and the forward watch that tells where it came
from. The record itself, as data, is :mod:`lightning_mpx.health.overflow_record`'s :class:`OverflowRecord`
(re-exported here).

:class:`OverflowForensics` builds it on overflow steps only, where the overflow flag is read on the host anyway; a
step that does not overflow builds nothing and reads nothing.

Where the non-finite values came from (the forward or the backward, and the first module whose output held them) is
known only when the forward was watched: :class:`ForwardWatch` puts forward hooks on the prepared models that flag
non-finite inputs and outputs on the device, without a host sync (and gradient hooks that keep what each backward
produced). When the first non-finite values are a module's *input* while the module output before it was finite, they
were made by code between two module calls (``h = self.blow(h) * 1e5`` in a forward, attention scores, a residual
sum): the record names that code (:class:`CodeRegion`) and blames the module whose output fed it.
:class:`~lightning_mpx.Amp` watches every step with ``diagnose_overflows=True``; otherwise it watches only after an
overflow with the loss scale at its floor, until a step that does not overflow, so that the overflows that matter (the
ones the scale cannot absorb) get a diagnosis and a healthy run has no hook at all (but inactive ones inside a model
compiled before it was prepared, traced away by ``torch.compile``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from typing import Any, Callable, Collection, Iterable, Mapping, Sequence

import torch
from torch import nn

from lightning_mpx.casting.policy import disable_casts
from lightning_mpx.health.overflow_record import (  # noqa: F401  (re-exported: the import path is kept)
    FIRST_TAG,
    OVERFLOW_TAG,
    ROOT_TAG,
    CodeRegion,
    Kind,
    Origin,
    OverflowRecord,
    merge_kinds,
    merge_records,
    module_of,
    overflow_tag,
)
from lightning_mpx.health.tags import UserNames


class ForwardWatch:
    """Forward hooks on the prepared models that record, on the device, which modules received and produced
    non-finite values.

    Each watched call (a module's inputs and its output, the loss, a gradient) writes the largest magnitude of what it
    saw (``inf`` or ``NaN`` when non-finite; one reduction) into the next entry of a preallocated FP32 tensor, and the
    host appends which call it was to a list: torch ops only, no host sync. On an overflow step the written entries
    are read with the rest of the record, and the first non-finite entry names the first module (a non-finite output)
    or the code between two module calls (a non-finite input after a finite output, see :class:`CodeRegion`). A
    module whose inputs are the very tensors the module before it returned, unwritten since, shares that entry. Forwards
    run with gradients disabled (validation) are not watched: they cannot cause an overflow; a call inside one that
    began with gradients is (``torch.utils.checkpoint(use_reentrant=True)`` runs its blocks under ``no_grad`` within
    the training forward). Gradient hooks on the
    parameters record each backward's own gradients the same way: before a clip changes them (at O1 the unscaled
    gradients are clipped in place) and before DDP averages them across processes. The hooks are removable handles
    owned by the watch; :meth:`disarm` removes them, except the forward hooks of the modules inside a model compiled
    before it was prepared (``torch.compile`` traces in only the hooks present at its first call): those are put on
    when the model is added and stay, returning at once while the watch is disarmed.
    """

    def __init__(self) -> None:
        self._models: list[tuple[weakref.ref[nn.Module], str]] = []
        self._handles: list[Any] = []
        # The forward hooks of the modules that torch.compile traces (inside an OptimizedModule), by id(module): put
        # on when the model is added and kept while disarmed (they return at once), since hooks put on after the
        # first compiled call are not traced in, and the watch armed at the floor would see only the wrapper's call.
        self._resident: dict[int, tuple[weakref.ref[nn.Module], list[Any]]] = {}
        self._names: list[str] = []  # (slot - _HEAD) // 2 -> module name (even: its output, odd: its inputs)
        self._slot_of: dict[str, int] = {}  # module name -> its index in _names (kept while disarmed: resident hooks)
        self._params: list[str] = []  # -1 - slot -> parameter name
        self._values: torch.Tensor | None = None  # the largest magnitudes the calls measured since the last step
        self._count = 0  # entries of _values written since the last step
        self._calls: list[int] = []  # the slot of each watched call since the last step
        self._at: list[int] = []  # each call's entry in _values (-1: no floating tensor, nothing measured)
        # The tensors the last output call measured (weakly, with their versions) and its entry: a module whose
        # inputs are exactly those, unchanged since (the next layer of a Sequential), shares that entry, with nothing
        # computed on the device.
        self._last: tuple[list[tuple[weakref.ref[torch.Tensor], int]], int] | None = None
        self._stale = True  # a step has run since the calls were cleared: the next watched call clears them first
        # Whether each module call in progress began with gradients enabled, and how many did: a call inside one that
        # did is watched even without gradients (torch.utils.checkpoint(use_reentrant=True) runs its blocks under
        # no_grad within the training forward); a forward that begins without them (validation) is not.
        self._open: list[tuple[int, bool]] = []  # (output slot, began with gradients) of each call in progress
        self._grad_calls = 0
        self.active = False
        self.automatic = False  # armed by an overflow at the floor (disarmed by the next step that does not overflow)
        self.complete = False  # the forwards since the last step were all watched

    def add_model(self, module: nn.Module, prefix: str) -> None:
        """Watch ``module`` too (now if the watch is active, else from the next :meth:`arm`); names get ``prefix``."""
        if any(ref() is module for ref, _ in self._models):
            return
        self._models.append((weakref.ref(module), prefix))
        self._hook_compiled(module, prefix)
        if self.active:
            self._hook(module, prefix)
            self.complete = False

    def arm(self, *, automatic: bool = False) -> None:
        """Register the hooks (nothing when they are registered already). The forwards after the next step are the
        first fully watched ones."""
        if self.active:
            return
        self._models = [(ref, prefix) for ref, prefix in self._models if ref() is not None]
        for ref, prefix in self._models:
            module = ref()
            if module is not None:
                self._hook(module, prefix)
        self.active, self.automatic, self.complete = True, automatic, False

    def disarm(self) -> None:
        """Remove every hook (but the resident ones of compiled modules, which then do nothing) and drop what was
        recorded."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._params.clear()
        self._clear()
        self._open, self._grad_calls = [], 0
        self._values = None
        self.active = self.automatic = self.complete = False

    def __getstate__(self) -> dict[str, Any]:
        # A model pickled or deep-copied with the hooks on it (torch.save(model), an EMA copy) takes a disarmed
        # watch along: its hooks then do nothing, and the models it watched are not pickled with it.
        state = dict(self.__dict__)
        state.update(_models=[], _handles=[], _resident={}, _names=[], _slot_of={}, _params=[], _values=None)
        state.update(_count=0, _calls=[], _at=[])
        state.update(_last=None, _open=[], _grad_calls=0)
        state.update(active=False, automatic=False, complete=False)
        return state

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Record the loss (slot 0), on the device."""
        if torch.is_tensor(loss) and loss.is_floating_point():
            self._record(0, [loss])

    def step_done(self) -> None:
        """A step has read the records: the next watched call starts afresh."""
        self._stale = True
        self._open, self._grad_calls = [], 0  # (a forward that raised left its calls open)

    def flags(self) -> torch.Tensor | None:
        """The device tensor of the watched calls' largest magnitudes since the last step (in call order), or
        ``None`` when nothing was watched."""
        if not self.active or self._values is None or not self._count:
            return None
        return self._values[: self._count]

    def called(self) -> set[str]:
        """The modules whose calls were watched since the last step."""
        if self._stale:
            return set()
        return {self._names[(slot - _HEAD) // 2] for slot in self._calls if slot > 0}

    @property
    def parameter_names(self) -> frozenset[str]:
        """The parameters whose gradients the hooks watch."""
        return frozenset(self._params)

    def decode(self, values: Sequence[float]) -> tuple[bool, dict[str, Kind], dict[str, Kind], CodeRegion | None]:
        """From the values of :meth:`flags` read on the host: whether the loss was non-finite, the modules with
        non-finite outputs and their kind in forward order (of their first non-finite output), the parameters whose
        gradients a backward produced non-finite, with their kind, in backward order, and the code between module
        calls that made the forward's first non-finite values (``None`` when a module made them, or they came in with
        the data)."""
        loss = False
        outputs: dict[str, Kind] = {}
        grads: dict[str, Kind] = {}
        region: CodeRegion | None = None
        forward_bad = False  # a non-finite input, output or loss seen so far
        running: list[str] = []  # the modules whose forwards are running, outermost first
        roots = {prefix.rstrip(".") for _, prefix in self._models}
        previous: tuple[bool, str] | None = None  # (is input, module) of the forward call recorded just before
        for slot, at in zip(self._calls, self._at):
            value = values[at] if at >= 0 else 0.0
            kind: Kind | None = None if math.isfinite(value) else "nan" if math.isnan(value) else "inf"
            call: tuple[bool, str] | None = None
            if slot == 0:
                loss = loss or kind is not None
                forward_bad = forward_bad or kind is not None
            elif slot < 0:
                if kind is not None:
                    name = self._params[-1 - slot]
                    grads[name] = merge_kinds(grads.get(name), kind)
            else:
                index, is_input = divmod(slot - _HEAD, 2)
                name = self._names[index]
                call = (bool(is_input), name)
                if is_input:
                    if kind is not None and not forward_bad:
                        region = _region(running, previous, name, kind, roots)
                    running.append(name)
                else:
                    if name in running:  # a forward that raised left no output call: pop to this one
                        del running[len(running) - 1 - running[::-1].index(name) :]
                    if kind is not None:
                        outputs[name] = merge_kinds(outputs.get(name), kind)
                forward_bad = forward_bad or kind is not None
            previous = call
        return loss, outputs, grads, region

    # -- internals ----------------------------------------------------------------------------------------------
    def _hook(self, module: nn.Module, prefix: str) -> None:
        for name, child in module.named_modules():
            resident = self._resident.get(id(child))
            if resident is None or resident[0]() is not child:
                self._handles.extend(self._module_hooks(child, prefix + name if name else prefix.rstrip(".")))
        for name, param in module.named_parameters():
            if param.requires_grad:
                # A tensor hook sees this backward's own gradient: before it is accumulated, unscaled, clipped or
                # averaged across processes by DDP's reducer.
                self._params.append(prefix + name)
                self._handles.append(param.register_hook(functools.partial(self._on_grad, -len(self._params))))

    def _hook_compiled(self, module: nn.Module, prefix: str) -> None:
        """Put the resident forward hooks on the modules of ``module`` that torch.compile traces (an OptimizedModule's
        ``_orig_mod`` and the modules inside it), before their first compiled call: a hook put on later is not traced
        in. Inactive, they return at once (torch.compile guards on :attr:`active`: arming recompiles once)."""
        traced: list[str] = []
        for name, child in module.named_modules():
            inside = any(name == t or name.startswith(t + ".") for t in traced)
            if not inside and isinstance(getattr(child, "_orig_mod", None), nn.Module):
                traced.append(f"{name}._orig_mod" if name else "_orig_mod")
            elif inside and id(child) not in self._resident:
                handles = self._module_hooks(child, prefix + name)
                self._resident[id(child)] = (weakref.ref(child), handles)

    def _module_hooks(self, child: nn.Module, name: str) -> list[Any]:
        """Hook ``child``'s calls (its inputs and its output), named ``name``; the handles."""
        index = self._slot_of.get(name)
        if index is None:
            index = self._slot_of[name] = len(self._names)
            self._names.append(name)
        slot = _HEAD + 2 * index
        inputs = functools.partial(self._on_input, slot + 1)
        # always_call: a forward that raises (an out-of-memory error the user catches) still closes its call
        output = functools.partial(self._on_output, slot)
        return [
            child.register_forward_pre_hook(inputs, with_kwargs=True),
            child.register_forward_hook(output, always_call=True),
        ]

    def _on_grad(self, slot: int, grad: torch.Tensor) -> None:
        if self.active and grad.is_floating_point() and not grad.is_sparse:
            self._record(slot, [grad])

    def _on_input(self, slot: int, module: nn.Module, args: Any, kwargs: Any) -> None:
        # Every call is recorded, with floating inputs or not: decode() follows the calls' nesting.
        if not self.active:  # a disarmed copy
            return
        enabled = torch.is_grad_enabled()
        if enabled or self._grad_calls:  # not evaluation (no gradient can come of it)
            self._record(slot, list(_floating_tensors((args, kwargs))), inputs=True)
        self._open.append((slot - 1, enabled))
        self._grad_calls += enabled

    def _on_output(self, slot: int, module: nn.Module, args: Any, output: Any) -> None:
        if not self.active:
            return
        # This module's call, and any call opened after it that never closed (a hook before ours that raised)
        at = next((i for i in range(len(self._open) - 1, -1, -1) if self._open[i][0] == slot), None)
        enabled = torch.is_grad_enabled() if at is None else self._open[at][1]
        if at is not None:
            self._grad_calls -= sum(opened for _, opened in self._open[at:])
            del self._open[at:]
        if enabled or self._grad_calls:  # a call that began with gradients, or inside one that did
            self._record(slot, list(_floating_tensors(output)), outputs=True)

    def _clear(self) -> None:
        self._calls.clear()
        self._at.clear()
        self._count = 0
        self._last = None

    def _record(self, slot: int, tensors: list[torch.Tensor], *, inputs: bool = False, outputs: bool = False) -> None:
        if self._stale:
            # Cleared here, at the first watched call after a step, rather than in the step, so that a second
            # optimizer stepping on the same forward still reads them.
            self._clear()
            self._stale = False
            self.complete = True
        self._calls.append(slot)
        last = self._last
        if not tensors:
            self._at.append(-1)
            return
        if inputs and last is not None and len(last[0]) == len(tensors):
            if all(ref() is t and _version(t) == version for (ref, version), t in zip(last[0], tensors)):
                self._at.append(last[1])  # the very tensors the last output call measured, not written since
                return
        # Our bookkeeping is not the model's compute: no casts, and no autograd graph (under activation checkpointing
        # a tensor saved for the backward by it would make the recomputation's saved tensors differ from the
        # forward's, and torch.utils.checkpoint refuses the backward).
        with disable_casts(), torch.no_grad():
            device = tensors[0].device
            index = self._count
            values = self._values
            if values is None or values.device != device or index >= len(values):
                # First use, more calls than ever before, or the model moved to its device after it was prepared.
                grown = torch.empty(max(64, 2 * index), dtype=torch.float32, device=device)
                if values is not None and index:
                    grown[:index].copy_(values[:index])
                values = self._values = grown
            if len(tensors) == 1:
                peak = torch.linalg.vector_norm(tensors[0], math.inf)  # inf or NaN when they are there
            else:
                peak = torch.stack([torch.linalg.vector_norm(t, math.inf).float().to(device) for t in tensors]).amax()
            values[index].copy_(peak)
        self._count = index + 1
        self._at.append(index)
        if outputs:
            self._last = ([(weakref.ref(t), _version(t)) for t in tensors], index)


_HEAD = 1  # slots before the modules': the loss (parameters have negative slots)


def _version(tensor: torch.Tensor) -> int:
    """``tensor._version``; an inference tensor has none (and cannot be written outside inference mode)."""
    try:
        return tensor._version
    except RuntimeError:
        return -1


def _region(
    running: list[str], previous: tuple[bool, str] | None, module: str, kind: Kind, roots: set[str]
) -> CodeRegion | None:
    """The code that made the non-finite values ``module`` received, from the forward call recorded just before
    (``previous``: a finite output, or the enclosing module's finite input) and the forwards running; ``None`` when
    no module ran before it in this forward: the data, or code at the start of a model's own forward, which cannot be
    told from the data (Lightning runs the training step as the model's forward under DDP, not on one device)."""
    parent = running[-1] if running else None
    if previous is None:
        return None
    is_input, name = previous
    if not is_input:
        return CodeRegion(parent, name, module, kind)  # after a module's output, in the parent's code
    if name == parent and parent not in roots:
        return CodeRegion(parent, None, module, kind)  # at the start of a submodule's forward
    return None


def _kind(inf: bool, nan: bool) -> Kind:
    return "inf+nan" if inf and nan else ("inf" if inf else "nan")


def _inf_nan(tensor: torch.Tensor, chunk: int = 1 << 24) -> torch.Tensor:
    """``[any inf, any NaN]`` of ``tensor`` as a device tensor, in chunks so that the temporary masks stay small
    next to a large gradient."""
    flat = tensor.reshape(-1)
    found = [torch.stack([torch.isinf(part).any(), torch.isnan(part).any()]) for part in flat.split(chunk)]
    return found[0] if len(found) == 1 else torch.stack(found).any(0)


def _floating_tensors(data: Any) -> Iterable[torch.Tensor]:
    """The floating-point tensors in a module's output (through tuples, lists, mappings and dataclasses)."""
    if isinstance(data, torch.Tensor):
        if data.is_floating_point() and data.numel():
            yield data
    elif isinstance(data, Mapping):
        for value in data.values():
            yield from _floating_tensors(value)
    elif isinstance(data, (list, tuple)):
        for value in data:
            yield from _floating_tensors(value)
    elif dataclasses.is_dataclass(data) and not isinstance(data, type):
        for f in dataclasses.fields(data):
            yield from _floating_tensors(getattr(data, f.name, None))


class OverflowForensics:
    """The forensics of one :class:`~lightning_mpx.Amp`: builds the record of an overflow step, keeps the
    per-module counts for the metrics and owns the forward watch.

    Args:
        diagnose: Watch every forward (``diagnose_overflows=True``); otherwise only after an overflow at the floor.
    """

    def __init__(self, diagnose: bool = False) -> None:
        self.watch = ForwardWatch()
        # Totals since the run started (a checkpoint's carried on): each reader of the metrics reports their growth
        # since its own previous read, so no read takes counts from another.
        self._counts: dict[str, int] = {}  # overflow steps per module
        self._first_counts: dict[str, int] = {}  # watched forward overflows per first non-finite module
        # The user's names of the modules in the tags (without a data-parallel wrapper's "module"), the counts' (and
        # the checkpoint's) too.
        self.user_names = UserNames()
        # The last record's watched forward called the prepared models but no module inside them (_unseen_inside)
        self.unseen_inside = False
        self.diagnose = diagnose

    @property
    def diagnose(self) -> bool:
        """Whether every forward is watched (setting it registers or removes the hooks)."""
        return self._diagnose

    @diagnose.setter
    def diagnose(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"diagnose_overflows={value!r} must be True or False.")
        self._diagnose = value
        if value:
            self.watch.arm()
            self.watch.automatic = False
        else:
            self.watch.disarm()

    def build(
        self,
        grads: Sequence[tuple[str, torch.Tensor]],
        *,
        step: int,
        loss_ids: Sequence[int],
        scales: Sequence[torch.Tensor],
        rank: int = 0,
    ) -> OverflowRecord:
        """The record of an overflow step: one batched device computation and one host read.

        Args:
            grads: (parameter name, gradient) for the optimizer's parameters that have one.
            step: The number of steps before this one.
            loss_ids: The losses the overflow was charged to.
            scales: Their scales, as device tensors.
            rank: This process's rank.
        """
        parts: list[torch.Tensor] = []
        device = grads[0][1].device if grads else (scales[0].device if scales else torch.device("cpu"))
        with disable_casts():
            if grads:
                parts.append(torch.cat([_inf_nan(g).to(device) for _, g in grads]).double())
            parts.extend(s.reshape(1).to(device=device, dtype=torch.float64) for s in scales)
            flags = self.watch.flags()
            if flags is not None:
                parts.append(flags.to(device=device, dtype=torch.float64))
            values = torch.cat(parts).tolist() if parts else []  # the one host read
        parameters: dict[str, Kind] = {}
        for index, (name, _) in enumerate(grads):
            inf, nan = values[2 * index] > 0, values[2 * index + 1] > 0
            if inf or nan:
                parameters[name] = _kind(inf, nan)
        offset = 2 * len(grads)
        scale_values = tuple(values[offset : offset + len(scales)])
        origin: Origin = "unknown"
        first: str | None = None
        loss_bad: bool | None = None
        own_backward: bool | None = None
        outputs: dict[str, Kind] = {}
        region: CodeRegion | None = None
        if flags is not None:
            loss_bad, outputs, produced, region = self.watch.decode(values[offset + len(scales) :])
            order = {name: index for index, (name, _) in enumerate(grads)}  # this optimizer's, in its order
            produced = {name: kind for name, kind in produced.items() if name in order}
            self.unseen_inside = self._unseen_inside()
            complete = self.watch.complete and not self.unseen_inside
            if produced or complete:
                own_backward = bool(produced)
            if produced and complete:
                # What the backward produced stands for the watched parameters (a clip at O1 has changed what the
                # step found: NaN for inf, or the clip value); the others keep what the step found (also values
                # that only overflowed when accumulated).
                watched = self.watch.parameter_names
                merged = {**produced, **{n: k for n, k in parameters.items() if n not in watched}}
                parameters = dict(sorted(merged.items(), key=lambda item: order[item[0]]))
            if loss_bad or outputs or (region is not None and complete):
                origin = "forward"
                first = next(iter(outputs)) if outputs and complete else None
                region = region if complete else None
            elif complete:
                origin = "backward"
            if origin != "forward":
                region = None
            if not complete:
                loss_bad = loss_bad or None  # a False from a partial watch proves nothing
                own_backward = own_backward or None
        modules: dict[str, Kind] = {}
        for name, kind in parameters.items():
            module = module_of(name)
            modules[module] = merge_kinds(modules.get(module), kind)
        found = bool(parameters) or origin == "forward"
        return OverflowRecord(
            step=step,
            loss_ids=tuple(loss_ids),
            scales=scale_values,
            parameters=parameters,
            modules=modules,
            origin=origin,
            first_module=first,
            rank=rank,
            ranks=(rank,) if found else (),
            loss_nonfinite=loss_bad,
            nonfinite_outputs=outputs,
            backward_nonfinite=own_backward,
            region=region,
        )

    def _unseen_inside(self) -> bool:
        """Whether the watched forward since the last step called the prepared models but none of the modules inside
        them: their hooks were not traced in (a model compiled with torch.compile after it was prepared, as
        ``fabric.setup`` and Accelerate's ``dynamo_backend`` do, keeps the hooks put on later out of its compiled
        code), so that the whole model would be blamed for whatever overflowed in it."""
        called = {self.user_names(name) for name in self.watch.called()}
        roots: set[str] = set()
        inside = False
        for ref, prefix in self.watch._models:
            model = ref()
            if model is not None:
                root = self.user_names(prefix.rstrip("."))
                roots.add(root)
                if root in called and not inside:  # a called model with modules inside it
                    inside = any(self.user_names(prefix + name) != root for name, _ in model.named_modules())
        return bool(called) and called <= roots and inside

    def gather(self, record: OverflowRecord) -> OverflowRecord:
        """Under an initialised process group of several processes, every rank's record merged (all ranks call
        this together, on the same overflow step); ``record`` itself otherwise."""
        return self.gather_noted(record)[0]

    def gather_noted(self, record: OverflowRecord, note: Any = None) -> tuple[OverflowRecord, list[Any]]:
        """:meth:`gather`, with every rank's ``note`` (by rank) gathered in the same collective: ``[note]`` in one
        process."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return record, [note]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (record, note))
        return merge_records([r for r, _ in gathered]), [n for _, n in gathered]

    def count(self, modules: Iterable[str]) -> None:
        """Count one overflow step for each of ``modules`` (``mpx/overflow/<module>``)."""
        for module in modules:
            module = self.user_names(module)  # counted under the tag's name: the checkpoint's too
            self._counts[module] = self._counts.get(module, 0) + 1

    def overflowed(self, record: OverflowRecord, *, at_floor: bool, counted: Collection[str] = ()) -> None:
        """Count the record's modules (those not in ``counted``: this process counted them when it built its own
        record, :meth:`count`) and, at the floor, watch the following forwards."""
        self.count(module for module in record.modules if module not in counted)
        if record.origin == "forward" and (record.region is not None or record.first_module is not None):
            # the module that made the non-finite values, or fed the code that did
            first = self.user_names(record.culprits()[0])
            self._first_counts[first] = self._first_counts.get(first, 0) + 1
        if at_floor and not self.watch.active:
            self.watch.arm(automatic=True)
        self.watch.step_done()

    def stepped(self) -> None:
        """A step that did not overflow (call only while the watch is active): an automatic watch ends."""
        if self.watch.automatic:
            self.watch.disarm()
        else:
            self.watch.step_done()

    def totals(self) -> dict[str, int]:
        """``mpx/overflow/<module>``: overflow steps so far in which the module had non-finite gradients;
        ``mpx/overflow_first/<module>``: watched overflow steps so far whose forward went non-finite first in that
        module (a forward overflow poisons every gradient: this names the culprit). Totals: a reader of the metrics
        reports their growth since its previous read
        (:meth:`Amp.metrics <lightning_mpx.engine.amp.Amp.metrics>`)."""
        out = {overflow_tag(module): count for module, count in self._counts.items()}
        out.update({FIRST_TAG + (module or ROOT_TAG): n for module, n in self._first_counts.items()})
        return out

    def state_dict(self) -> dict[str, dict[str, int]]:
        """The totals, for the engine's checkpoint (host numbers: no device read), by the user's module names (a run
        with a data-parallel wrapper and its resume without it count the same modules)."""
        return {"modules": dict(self._counts), "first": dict(self._first_counts)}

    def loaded_names(self) -> Callable[[str], str]:
        """The tags' name of a module that an engine checkpoint counted: a name of the prepared models (a checkpoint
        written before stop 70 counted ``module.<name>`` for a model prepared in ``nn.DataParallel`` or DDP, and
        ``_orig_mod.<name>`` for a compiled one) as :attr:`user_names` gives it; any other (the user's names that
        :meth:`state_dict` saves now) as it is."""
        prepared: set[str] = set()
        for ref, prefix in self.watch._models:
            model = ref()
            if model is not None:
                prepared.update(prefix + name if name else prefix.rstrip(".") for name, _ in model.named_modules())
        return lambda name: self.user_names(name) if name in prepared else name

    def load_state_dict(self, state: Mapping[str, Any] | None, names: Callable[[str], str] = str) -> None:
        """Restore :meth:`state_dict`'s totals, each module named by ``names`` (:meth:`loaded_names`); ``None`` (a
        checkpoint of a release that kept none) starts them at zero."""
        state = state or {}
        self._counts, self._first_counts = {}, {}
        for key, counts in (("modules", self._counts), ("first", self._first_counts)):
            for module, count in dict(state.get(key) or {}).items():
                name = names(str(module))
                counts[name] = counts.get(name, 0) + int(count)
