"""Steps skipped on the device (``skip_on_device``, on by default where the optimizer can): the overflow flag goes to
the optimizer's own step instead of being read on the host first, and what the step did is read later.

``torch.amp.GradScaler`` hands the flag to optimizers that can skip on the device (``_step_supports_amp_scaling``:
torch's fused implementations) and never reads it on the host. :meth:`Amp.step <lightning_mpx.engine.amp.Amp.step>` does
the same for :data:`DEVICE_SKIP_OPTIMIZERS` with ``fused=True`` (by default; every other optimizer reads the flag on the
host, one sync per step) and returns a :class:`StepOutcome`; the flags, with the scales they were computed with, are
copied to the host behind the step (a non-blocking copy and an event on CUDA), and read when the outcome is used as a
bool or, at the latest, at the engine's next backward or step (:class:`PendingSteps`). By then the device has usually
passed that point: the read does not wait. A read is local (rank 0 alone may make one, to log); what needs every rank
(the overflow records merged across them) is done at the engine's next backward or step, where every rank is.

Only Adam and AdamW: torch's fused SGD with momentum leaves its momentum buffers uninitialized (``torch.empty_like``)
when its first step is skipped on the device, so a skipped first step would put garbage into every later one
(torch 2.13, found while building this; ``GradScaler`` with a fused SGD has the same problem).
"""

from __future__ import annotations

import itertools
import math
import operator
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from lightning_mpx.health.forensics import OverflowRecord

#: The optimizers whose ``fused=True`` step skips on the device exactly (nothing changes, their step count
#: included; their state is made on the first call, zeros, as the first real step would make it).
DEVICE_SKIP_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW)


def device_skip_refusal(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer`` cannot skip its step on the device (``None`` when it can)."""
    kind = type(optimizer)
    if kind not in DEVICE_SKIP_OPTIMIZERS:
        return f"optimizer={kind.__name__} is not one of torch.optim.Adam, torch.optim.AdamW"
    unfused = [i for i, group in enumerate(optimizer.param_groups) if not group.get("fused")]
    if unfused or not getattr(optimizer, "_step_supports_amp_scaling", False):
        return f"optimizer={kind.__name__} is not fused (param group(s) {unfused or 'all'} without fused=True)"
    return None


@dataclass(init=False)
class PendingStep:
    """One step handed to the device with its flag, until the host reads what it did and settles it.

    Attributes:
        optimizer: The optimizer that stepped (weakly: a dropped optimizer's step is still counted).
        loss_ids: The losses whose gradients it held.
        values: Their flags (1.0: overflow) and then their scales at the step, FP32, on the host once ``ready``.
        ready: The CUDA event after the copy of ``values`` to the host (``None``: ``values`` is read as it is).
        step: The engine's step index (``OverflowRecord.step``).
        iteration: The engine's iteration (its ``update()`` calls so far) when it stepped.
        gather: Whether the flags were reduced across ranks: then settling it is a collective (the overflow records
            of every rank are merged), made only where every rank is (:meth:`PendingSteps.settle`).
        outcome: The :class:`StepOutcome` handed to the caller.
        overflowed: Once read: the losses that overflowed (``None`` before the read).
        scales: Once read: every loss's scale at the step.
        examined: Once read: what the engine made of it on this process alone (its overflow record), for the settle.
        shared: Whether :meth:`Amp.share_overflow <lightning_mpx.engine.amp.Amp.share_overflow>` charged an overflow
            to it (its own gradients may be finite).
    """

    optimizer: weakref.ref[torch.optim.Optimizer]
    loss_ids: list[int]
    values: torch.Tensor
    ready: torch.cuda.Event | None
    step: int
    iteration: int
    gather: bool
    outcome: StepOutcome
    overflowed: list[int] | None = None
    scales: dict[int, float] | None = None
    examined: OverflowRecord | None = None
    shared: bool = False  # the overflow was charged to it by Amp.share_overflow

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        loss_ids: list[int],
        flags: torch.Tensor,
        scales: list[torch.Tensor],
        *,
        step: int,
        iteration: int,
        gather: bool,
        read: Callable[[], None],
        shared: bool = False,
    ) -> None:
        """The pending step of ``flags`` (one per loss) and the loss ``scales`` now, copied to the host behind the
        work queued so far (one kernel and one copy on CUDA; no wait), with its :attr:`outcome`, which ``read()``
        makes known. Its own constructor (not a classmethod over the dataclass's): one Python call a step."""
        if flags.dim() == 0:  # one loss: its flag and its scale, one kernel
            values = torch.stack([flags, scales[0]])
        else:
            values = torch.cat([flags.reshape(-1), torch.stack(scales)])
        ready = None
        if values.device.type == "cuda":
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            values = host
        self.optimizer, self.loss_ids, self.values, self.ready = weakref.ref(optimizer), loss_ids, values, ready
        # StepOutcome(read), without its __init__'s call (its two slots set here)
        self.outcome = outcome = _new_object(StepOutcome)
        outcome._read, outcome._stepped = read, None
        self.step, self.iteration, self.gather = step, iteration, gather
        self.overflowed, self.scales, self.examined, self.shared = None, None, None, shared

    def read(self) -> None:
        """Read the losses that overflowed and every loss's scale at the step into :attr:`overflowed` and
        :attr:`scales` (waits for the copy, not for later work), and make the outcome known. This process only."""
        if self.ready is not None:
            self.ready.synchronize()
        values = self.values.tolist()
        count = len(self.loss_ids)
        flags, scales = values[:count], values[count:]
        self.overflowed = list(itertools.compress(self.loss_ids, map(operator.gt, flags, itertools.repeat(0))))
        self.scales = dict(zip(self.loss_ids, scales))
        self.outcome._stepped = not self.overflowed


_new_object = object.__new__


def _as_bool(value: Any) -> Any:
    """``value``, or the ``bool`` a :class:`StepOutcome` reads as."""
    return value.stepped if isinstance(value, StepOutcome) else value


def _binary(op: Callable[[Any, Any], Any], *, reflected: bool = False) -> Callable[[StepOutcome, Any], Any]:
    """The operator ``op`` of a :class:`StepOutcome`: the bool's own, with the bool on the same side."""
    if reflected:
        return lambda self, other: op(_as_bool(other), self.stepped)
    return lambda self, other: op(self.stepped, _as_bool(other))


def _unary(op: Callable[[Any], Any]) -> Callable[[StepOutcome], Any]:
    return lambda self: op(self.stepped)


class StepOutcome:
    """Whether a step that skipped on the device stepped, read when it is used: it behaves as that ``bool``
    everywhere Python and torch take one (``if amp.step(optimizer): ...``, ``sum(outcomes)`` to count the steps
    taken, ``int()``, ``float()``, arithmetic, comparisons, ``hash()``, ``torch.tensor(outcome)``,
    ``numpy.array(outcomes)``, ``f"{outcome}"``), waiting for the device only if it has not reached the step yet.

    Reading it reads every earlier pending step of the engine too, in order, on this process only: it is never a
    collective, so rank 0 alone may read it (to log). Under a process group, what needs every rank (the overflow
    record merged across ranks, its log message and ``on_floor``) is settled at the engine's next backward or step,
    where every rank is; in one process it is settled at the read (an ``on_floor="raise"`` error is raised there).

    What a ``bool`` does that this cannot: ``outcome is True``, ``isinstance(outcome, bool)``, ``json.dumps``, the
    ``statistics`` module, indexing a tensor with it (a ``bool`` index adds a dimension; this picks a row) and
    ``torch.tensor(list_of_outcomes)`` (torch looks at the items' types), and ``torch.load(weights_only=True)`` of a
    saved outcome (it is saved as a call to ``bool``, which that loader does not allow unless
    ``torch.serialization.add_safe_globals([bool])``); ``bool(outcome)`` first for those.
    """

    __slots__ = ("_read", "_stepped", "__weakref__")

    def __init__(self, read: Callable[[], None]) -> None:
        self._read = read
        self._stepped: bool | None = None

    @property
    def known(self) -> bool:
        """Whether the outcome has been read (reading :attr:`stepped` then does not touch the device)."""
        return self._stepped is not None

    @property
    def stepped(self) -> bool:
        """Whether the optimizer stepped (``False``: its gradients overflowed and nothing changed)."""
        if self._stepped is None:
            self._read()  # in one process an earlier step's error (on_floor="raise") propagates
        assert self._stepped is not None
        return self._stepped

    def __bool__(self) -> bool:
        return self.stepped

    def __reduce__(self) -> tuple[type[bool], tuple[bool]]:
        """Pickled and copied (``pickle``, ``torch.save``, ``copy.copy``, ``copy.deepcopy``) as the ``bool`` it reads
        as: the outcome is read first, and the copy holds no link to the engine (whose masters a deep copy would
        copy too)."""
        return bool, (self.stepped,)

    # A bool is an int: the numeric protocols read the outcome and answer as the bool would.
    __int__ = _unary(int)
    __index__ = _unary(operator.index)
    __float__ = _unary(float)
    __complex__ = _unary(complex)
    __trunc__ = _unary(math.trunc)
    __floor__ = _unary(math.floor)
    __ceil__ = _unary(math.ceil)
    __neg__ = _unary(operator.neg)
    __pos__ = _unary(operator.pos)
    __abs__ = _unary(operator.abs)
    __invert__ = _unary(operator.invert)
    __add__, __radd__ = _binary(operator.add), _binary(operator.add, reflected=True)
    __sub__, __rsub__ = _binary(operator.sub), _binary(operator.sub, reflected=True)
    __mul__, __rmul__ = _binary(operator.mul), _binary(operator.mul, reflected=True)
    __truediv__, __rtruediv__ = _binary(operator.truediv), _binary(operator.truediv, reflected=True)
    __floordiv__, __rfloordiv__ = _binary(operator.floordiv), _binary(operator.floordiv, reflected=True)
    __mod__, __rmod__ = _binary(operator.mod), _binary(operator.mod, reflected=True)
    __divmod__, __rdivmod__ = _binary(divmod), _binary(divmod, reflected=True)
    __pow__, __rpow__ = _binary(operator.pow), _binary(operator.pow, reflected=True)
    __lshift__, __rlshift__ = _binary(operator.lshift), _binary(operator.lshift, reflected=True)
    __rshift__, __rrshift__ = _binary(operator.rshift), _binary(operator.rshift, reflected=True)
    __and__, __rand__ = _binary(operator.and_), _binary(operator.and_, reflected=True)
    __or__, __ror__ = _binary(operator.or_), _binary(operator.or_, reflected=True)
    __xor__, __rxor__ = _binary(operator.xor), _binary(operator.xor, reflected=True)
    __eq__ = _binary(operator.eq)  # type: ignore[assignment]
    __ne__ = _binary(operator.ne)  # type: ignore[assignment]
    __lt__, __le__ = _binary(operator.lt), _binary(operator.le)
    __gt__, __ge__ = _binary(operator.gt), _binary(operator.ge)

    def __round__(self, ndigits: int | None = None) -> int:
        return round(self.stepped, ndigits)

    def __hash__(self) -> int:
        # Equal to the bool it reads as, so it hashes as that bool: hashing reads it, and it never changes after.
        return hash(self.stepped)

    def __str__(self) -> str:
        return str(self.stepped)

    def __format__(self, spec: str) -> str:
        return format(self.stepped, spec)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> Any:
        """``numpy.array(outcome)`` and ``numpy.array(outcomes)``: the bools."""
        import numpy

        return numpy.array(self.stepped, dtype=dtype)

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        """``torch.tensor(outcome)`` (and other DLPack consumers): the bool's tensor."""
        return torch.tensor(self.stepped).__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return torch.tensor(self.stepped).__dlpack_device__()

    def __repr__(self) -> str:
        return f"StepOutcome(stepped={self._stepped})" if self.known else "StepOutcome(not read yet)"


class PendingSteps:
    """The steps of one engine handed to the device and not settled yet, oldest first.

    A step is first *read* (its flags on the host: the outcome is known, ``examine`` counts it on this process),
    which any process may do at any time, alone; then *settled* (``settle``: the overflow record merged across ranks
    when the flags were reduced across them, logged, ``on_floor``), which under a process group is a collective and
    is made only where every rank is: :meth:`settle`, called by the engine at its next backward or step and at
    teardown. A step of one process is settled at its read.

    Args:
        examine: Called with each step once it is read and found to overflow, in order: what needs this process
            only (the skipped step counted, this process's overflow record built while the gradients are still
            there).
        settle: Called with each step once read, in order: the rest (may raise ``on_floor``'s error; may be a
            collective when ``step.gather``); not called for a step that did not overflow unless ``watch.active``.
        watch: What tells whether ``settle`` is due for a step that did not overflow (``watch.active``: the
            forensics' forward watch, which such a step ends); ``None``: always due.

    Attributes:
        steps: The pending steps, oldest first: a caller tells from it, without a call, whether any is left to
            settle (changed only here).
    """

    def __init__(
        self, examine: Callable[[PendingStep], None], settle: Callable[[PendingStep], None], watch: Any = None
    ) -> None:
        self._examine = examine
        self._settle = settle
        self._watch = watch
        self.steps: list[PendingStep] = []

    def __len__(self) -> int:
        return len(self.steps)

    def add(self, step: PendingStep) -> None:
        self.steps.append(step)

    def read(self) -> None:
        """Read every pending step on this process, oldest first (never a collective: rank 0 alone may call it).
        Steps that need no other process (one process: the flags were not reduced) are settled now, in order; an
        error from one (``on_floor="raise"``) leaves the later ones for the next read."""
        for step in self.steps:  # each read in order (examined when it overflowed), inline: a call saved per read
            if step.overflowed is None:
                step.read()
                if step.overflowed:  # nothing to examine otherwise (OptimizerStep.examine)
                    self._examine(step)
        while self.steps and not self.steps[0].gather:
            step = self.steps.pop(0)
            if step.overflowed or self._watch is None or self._watch.active:
                self._settle(step)

    def settle(self, before: int | None = None) -> None:
        """Read and settle every pending step, oldest first, on every rank together (under a process group: a
        collective); ``before``: only those of iterations before it (the steps of the iteration under way are left
        to a later call, so that a second optimizer's backward does not wait for the first one's step). An error
        from one (``on_floor="raise"``) leaves the later ones pending."""
        for step in self.steps:  # as in read(), up to ``before``
            if before is not None and step.iteration >= before:
                break
            if step.overflowed is None:
                step.read()
                if step.overflowed:
                    self._examine(step)
        while self.steps and (before is None or self.steps[0].iteration < before):
            step = self.steps.pop(0)
            if step.overflowed or self._watch is None or self._watch.active:  # the usual step: nothing to settle
                self._settle(step)
