"""What one overflow step found, as data: :class:`OverflowRecord` (with :class:`CodeRegion`, the code between module
calls that made a forward's first non-finite values), the kinds of non-finite values, the metric tags of the
per-module counts, and the merge of every process's record of one step under DDP.

:class:`OverflowRecord` is what :attr:`lightning_mpx.Amp.last_overflow` holds after a step that overflowed. It is
built by :class:`~lightning_mpx.health.forensics.OverflowForensics` (with what its
:class:`~lightning_mpx.health.forensics.ForwardWatch` recorded) on overflow steps only, where the overflow flag is read
on the host anyway; a step that does not overflow builds nothing and reads nothing. Read by the engine's overflow
handling (:mod:`lightning_mpx.engine.overflow`), the promotion of FP32 modules (:mod:`lightning_mpx.health.promotion`)
and the metrics. :mod:`lightning_mpx.health.forensics` re-exports every name here (its import path is kept).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Sequence

Kind = Literal["inf", "nan", "inf+nan"]
Origin = Literal["forward", "backward", "unknown"]

#: The tag prefix of the per-module overflow counts that :meth:`lightning_mpx.Amp.metrics` reports.
OVERFLOW_TAG = "mpx/overflow/"
#: The name the root module's own parameters go by in a tag (the module name itself is ``""``).
ROOT_TAG = "_root"
#: The metric prefix of the first module whose forward output went non-finite (watched overflow steps only).
FIRST_TAG = "mpx/overflow_first/"


def _shown(module: str) -> str:
    return module or "<root>"


@dataclasses.dataclass(frozen=True)
class CodeRegion:
    """Code outside every module's own forward where the first non-finite values of a watched forward were made: the
    values a module received (``before``) were non-finite, while the module output just before them (``after``'s) was
    finite.

    Attributes:
        parent: The module whose forward runs that code (``""``: the root model's); ``None`` when it runs outside
            every watched module (in the training step or the loop).
        after: The module whose finite output came last before the code (``None``: the code starts at ``parent``'s
            own input).
        before: The module that received the non-finite values.
        kind: What ``before`` received (``"inf"``, ``"nan"`` or ``"inf+nan"``).
    """

    parent: str | None
    after: str | None
    before: str
    kind: Kind

    @property
    def culprit(self) -> str:
        """The module to blame: the one whose output fed the code (in FP32 its output keeps the code in FP32 at
        O1), else the module whose forward runs it."""
        culprit = self.after if self.after is not None else self.parent
        assert culprit is not None  # a region outside every module starts at a module's output
        return culprit

    def describe(self) -> str:
        """``"in <parent>'s forward, between <after>'s output and <before>'s input"``."""
        where = (
            f"in {_shown(self.parent)}'s forward"
            if self.parent is not None
            else "outside the modules' forwards (in the training step or the loop)"
        )
        start = f"{_shown(self.after)}'s output" if self.after is not None else "its input"
        return f"{where}, between {start} and {_shown(self.before)}'s input"


@dataclasses.dataclass(frozen=True)
class OverflowRecord:
    """One overflow step, as found on the host.

    Attributes:
        step: The number of :meth:`~lightning_mpx.Amp.step` calls made before this one (all optimizers).
        loss_ids: The losses the overflow was charged to.
        scales: The loss scale of each of those losses when the gradients were computed.
        parameters: Parameter name to the kind of non-finite values its gradient held (``"inf"``, ``"nan"`` or
            ``"inf+nan"``). When the backward was watched, as the backward produced them (before a clip, and under
            DDP this process's own, before the averaging); otherwise as the step found them: a norm clip
            (:meth:`~lightning_mpx.Amp.clip_grad_norm_`) leaves an overflow step's gradients as they were, while a
            value clip has already clamped their inf to the clip value (such parameters are then missing here; watch
            with ``diagnose_overflows=True`` to see them).
        modules: The same, per module (the parameter name without its last component; ``""`` for parameters of
            the root module).
        origin: ``"forward"`` when the forward already produced non-finite values (the loss or a module's output),
            ``"backward"`` when the forward was finite and the gradients were not, ``"unknown"`` when the forward
            was not watched on this step.
        first_module: The first module, in forward order, whose output held non-finite values (``None`` unless
            ``origin == "forward"`` and the forward was watched).
        rank: The process that found it (0 without a distributed strategy). Merged under DDP: the first of
            :attr:`ranks`.
        ranks: The processes that found non-finite values. Merged under DDP: those whose own forward produced them
            when any did, else those whose own backward did (known when watched), else those whose gradients held
            them (DDP averages gradients across processes before the step, so that is every process). Without a
            distributed strategy: ``(rank,)``, or empty when nothing was found (the flag came from elsewhere).
        loss_nonfinite: Whether a loss passed to :meth:`~lightning_mpx.Amp.scale_loss` was non-finite (``None``
            when the forward was not watched).
        nonfinite_outputs: Every module whose output held non-finite values, in forward order, with the kind of
            those values (empty when the forward was not watched): ``"inf"`` in the first one is an activation past
            the half dtype's range, ``"nan"`` a NaN that came in (data) or was made there (``inf - inf``).
        backward_nonfinite: Whether this process's own backward produced non-finite gradients, before they were
            clipped or averaged across processes (``None`` when the backward was not watched).
        region: When the forward's first non-finite values were made by code between two module calls rather than
            inside a module (``first_module`` is then the module that received them): that code (``None``
            otherwise, or when the forward was not watched). A NaN in the data the model received is not a region,
            nor is code at the start of a model's own forward (it cannot be told from the data): the first module
            to see it is ``first_module``.
    """

    step: int
    loss_ids: tuple[int, ...]
    scales: tuple[float, ...]
    parameters: dict[str, Kind]
    modules: dict[str, Kind]
    origin: Origin = "unknown"
    first_module: str | None = None
    rank: int = 0
    ranks: tuple[int, ...] = ()
    loss_nonfinite: bool | None = None
    nonfinite_outputs: dict[str, Kind] = dataclasses.field(default_factory=dict)
    backward_nonfinite: bool | None = None
    region: CodeRegion | None = None

    def culprits(self) -> list[str]:
        """The modules to blame: for a forward overflow made by code between module calls, the module whose output
        fed that code (:attr:`CodeRegion.culprit`); else the first non-finite module of the forward when it is known;
        else every module whose parameters got non-finite gradients."""
        if self.origin == "forward" and self.region is not None:
            return [self.region.culprit]
        if self.origin == "forward" and self.first_module is not None:
            return [self.first_module]
        return list(self.modules)

    def describe(self) -> str:
        """One line for the log: the culprit modules with their kind, the origin and the rank(s)."""
        culprits = self.culprits()
        if self.origin == "forward" and self.region is not None:
            region = self.region
            text = (
                f"culprit {_shown(region.culprit)} (non-finite values ({region.kind}) first made by the code "
                f"{region.describe()}); origin forward"
            )
        elif self.origin == "forward" and self.first_module is not None:
            kind = self.nonfinite_outputs.get(self.first_module)
            text = f"culprit {self.first_module or '<root>'} (first non-finite output, {kind}); origin forward"
        else:
            shown = ", ".join(f"{name or '<root>'} ({self.modules[name]})" for name in culprits[:5])
            more = f" (+{len(culprits) - 5} more)" if len(culprits) > 5 else ""
            text = f"culprit {shown or 'unknown'}{more}; origin {self.origin}"
            if self.origin == "forward" and self.loss_nonfinite:
                text += " (the loss was non-finite)"
        ranks = self.ranks or (self.rank,)
        return text + f"; rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def module_of(parameter: str) -> str:
    """The module a parameter name belongs to: the name without its last component (``""`` for the root's own)."""
    return parameter.rpartition(".")[0]


def overflow_tag(module: str) -> str:
    """The metric tag of a module's overflow count: ``mpx/overflow/<module>`` (``mpx/overflow/_root`` for ``""``)."""
    return OVERFLOW_TAG + (module or ROOT_TAG)


def merge_kinds(a: Kind | None, b: Kind | None) -> Kind:
    """The kind of a tensor or module holding both ``a`` and ``b``."""
    found = {part for kind in (a, b) if kind for part in kind.split("+")}
    return "inf+nan" if found == {"inf", "nan"} else ("nan" if "nan" in found else "inf")


def merge_records(records: Sequence[OverflowRecord]) -> OverflowRecord:
    """One record from every process's record of the same overflow step (rank 0's view under DDP).

    The parameters and modules are the union; the origin, the first module and :attr:`OverflowRecord.rank` come
    from the first process whose forward produced non-finite values, else from the first whose own backward did,
    else from the first whose gradients held them.
    """
    if not records:
        raise ValueError("records=[] holds no record to merge.")
    forward = [r for r in records if r.origin == "forward"]
    backward = [r for r in records if r.backward_nonfinite]
    found = [r for r in records if r.parameters]
    blamed = sorted(forward or backward or found, key=lambda r: r.rank)
    lead = blamed[0] if blamed else min(records, key=lambda r: r.rank)
    parameters: dict[str, Kind] = {}
    modules: dict[str, Kind] = {}
    for record in sorted(records, key=lambda r: r.rank):
        for name, kind in record.parameters.items():
            parameters[name] = merge_kinds(parameters.get(name), kind)
        for name, kind in record.modules.items():
            modules[name] = merge_kinds(modules.get(name), kind)
    if forward:
        origin: Origin = "forward"
    elif all(r.origin == "backward" for r in records):
        origin = "backward"
    else:
        origin = "unknown"
    return dataclasses.replace(
        lead,
        parameters=parameters,
        modules=modules,
        origin=origin,
        first_module=lead.first_module if origin == "forward" else None,
        region=lead.region if origin == "forward" else None,
        ranks=tuple(r.rank for r in blamed),
        loss_nonfinite=None if lead.loss_nonfinite is None else any(bool(r.loss_nonfinite) for r in records),
    )
