"""The ``on_floor="promote"`` decision of a :class:`~lightning_mpx.health.promotion.Promotion` (:class:`FloorDecision`,
its base): which modules the last overflows at the loss-scale floor blame (the streak of culprits, a code region's
parent module at O2/O3, the nearest ancestor not in FP32 yet), or why none can be promoted (the reason the floor error
then gives). The conversion itself, the hooks and the checkpoints stay on ``Promotion``; this is called from
``Amp``'s floor handling (:meth:`FloorDecision.floor_overflow`).
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import TYPE_CHECKING, Callable, Iterable

import torch
from torch import nn

from lightning_mpx.health.forensics import CodeRegion, OverflowRecord

if TYPE_CHECKING:
    from lightning_mpx.health.promotion import _Engine

log = logging.getLogger("lightning_mpx")

__all__ = ["FloorDecision"]


class FloorDecision:
    """The floor decision of a :class:`~lightning_mpx.health.promotion.Promotion` (the attributes and methods
    declared here are the promotion's, see there)."""

    # What the Promotion this is a base of provides (declared here for readers and type checkers).
    amp: _Engine
    patience: int
    _streak: list[frozenset[str]]
    _roots: list[tuple[str, weakref.ref[nn.Module]]]  # (name prefix, prepared model)
    runs_fp32: Callable[[str], bool]
    _root_of: Callable[[str], tuple[str, nn.Module] | None]
    _parameter_owners: Callable[..., frozenset[str]]
    _promote: Callable[[list[str], OverflowRecord | None, Iterable[str]], None]

    def floor_overflow(self, record: OverflowRecord | None) -> str | None:
        """Decide what an overflow at the loss-scale floor does under ``on_floor="promote"``.

        Returns ``None`` when it is handled (the culprits were promoted, or the evidence is not complete yet: the
        step is skipped and training goes on), else why no module can be blamed (the caller raises the floor error
        with it).
        """
        amp = self.amp
        culprits, why = self._culprits(record)
        if why is not None:
            self._streak.clear()
            return why
        if not culprits:
            self._streak.clear()
            return (
                "on_floor='promote' could not blame a module: no parameter had non-finite gradients on this process "
                "(the overflow flag came from another process, or the non-finite values were cleared)"
            )
        self._streak = (self._streak + [culprits])[-self.patience :]
        if len(self._streak) < self.patience:
            if amp.log_overflows:
                log.info(
                    "Overflow at the loss-scale floor (%d of %d before on_floor='promote' acts) in %s",
                    len(self._streak),
                    self.patience,
                    ", ".join(sorted(culprits)),
                )
            return None
        why = self._why_not(self._common(), record)
        self._streak.clear()  # a decision was made (promoted, or the floor error is raised): the next starts afresh
        return why

    def _common(self) -> frozenset[str]:
        """The latest overflow's culprits that every earlier one in the streak blamed too: the same module, or one
        inside or around it (an unwatched overflow blames the modules that hold the non-finite gradients, say
        ``block.norm``; the watched one after it names the code in ``block``'s forward). An earlier overflow that
        blamed every module with trainable parameters (the unwatched one that armed the watch, after a forward
        overflow: all gradients non-finite) agrees with any culprit: the one a watched forward names may hold no
        trainable parameter (a LoRA adapter's frozen ``base_layer``, a frozen backbone's layer)."""
        *earlier, latest = self._streak
        trainable = self._parameter_owners(trainable=True) if earlier else frozenset()

        def related(a: str, b: str) -> bool:
            return a == b or a.startswith(b + ".") or b.startswith(a + ".")

        def agrees(culprit: str, other: frozenset[str]) -> bool:
            return (bool(trainable) and other >= trainable) or any(related(culprit, m) for m in other)

        return frozenset(c for c in latest if all(agrees(c, other) for other in earlier))

    def _culprits(self, record: OverflowRecord | None) -> tuple[frozenset[str], str | None]:
        """The modules to promote for ``record`` (see the module docstring for code between module calls), or why
        none can be."""
        if record is None:
            return frozenset(), None
        if getattr(getattr(self.amp, "forensics", None), "unseen_inside", False):
            return frozenset(), (
                "on_floor='promote' cannot tell which module overflowed: the forward watch armed at the floor saw the "
                "call of the whole model but of no module inside it, as under torch.compile applied after the model "
                "was prepared (fabric.setup and Accelerate's dynamo_backend compile after preparing it): hooks put on "
                "after compilation are not traced in; pass diagnose_overflows=True (its hooks are put on when the "
                "model is prepared, before it is compiled) or, with the core Amp, compile the model before preparing "
                "it (a model class compiled before in this process reuses the code traced then: torch._dynamo.reset())"
            )
        region = record.region if record.origin == "forward" else None
        if region is None or region.after is None or not self.amp.properties.casts_model:
            return frozenset(record.culprits()), None
        if region.parent is None or any(self._whole(prefix, region.parent) for prefix, _ in self._roots):
            region = self._shown(region)  # the user's names (as without torch.compile's _orig_mod)
            return frozenset(), (
                f"on_floor='promote' cannot run the code {region.describe()} in FP32 at opt_level="
                f"{self.amp.opt_level!r}: that code made the non-finite values ({region.kind}), a promoted module's "
                "output is cast back to half before it runs, and it runs "
                + ("outside every module" if region.parent is None else "in the root model's forward")
                + "; compute it in FP32 (cast its inputs with .float())"
                + (
                    ", move it into a submodule's forward, or use half_dtype='bfloat16'"
                    if self.amp.half_dtype == torch.float16
                    else " or move it into a submodule's forward"
                )
            )
        return frozenset({region.parent}), None  # its forward runs the code: in FP32 once it is promoted

    def _why_not(self, common: frozenset[str], record: OverflowRecord | None) -> str | None:
        """Promote the modules in ``common``, or say why they cannot be."""
        amp = self.amp
        if not common:
            seen = " / ".join(", ".join(sorted(c)) for c in self._streak)
            return (
                f"on_floor='promote' could not blame a module: the last {self.patience} overflows at the floor came "
                f"from different modules ({seen})"
            )
        if record is not None and record.origin != "forward":
            owners = self._parameter_owners()
            if owners and common >= owners:
                return (
                    f"on_floor='promote' could not blame a module: every module with parameters ({len(owners)}) had "
                    f"non-finite gradients (origin {record.origin!r}), which points at the forward pass or the data "
                    "rather than one layer's backward"
                )
        if amp.properties.casts_model and amp.found_inf_reducer is not None:
            return (
                f"on_floor='promote' cannot convert {', '.join(sorted(common))} to FP32 in place at "
                f"opt_level={amp.opt_level!r} under a distributed strategy (DDP's gradient buckets are fixed when it "
                f"wraps the model); pass fp32_modules={sorted(common)!r} when you build the plugin or adapter"
            )
        targets, why = self._targets(common)
        if why is not None:
            return why
        self._promote(targets, record, common)
        return None

    def _shown(self, region: CodeRegion) -> CodeRegion:
        """``region`` with the user's module names (:class:`~lightning_mpx.health.tags.UserNames`)."""
        forensics = getattr(self.amp, "forensics", None)
        if forensics is None:
            return region
        names = forensics.user_names
        return dataclasses.replace(
            region,
            parent=None if region.parent is None else names(region.parent),
            after=None if region.after is None else names(region.after),
            before=names(region.before),
        )

    def _whole(self, prefix: str, name: str) -> bool:
        """Whether module ``name`` is the whole model prepared with ``prefix``: its root, or a wrapper's module inside
        it (torch.compile's ``_orig_mod``, a data-parallel wrapper's ``module``: the same user's model)."""
        forensics = getattr(self.amp, "forensics", None)
        shown: Callable[[str], str] = forensics.user_names if forensics is not None else str
        return name == prefix.rstrip(".") or shown(name) == shown(prefix.rstrip("."))

    def _targets(self, culprits: Iterable[str]) -> tuple[list[str], str | None]:
        """The modules to promote for ``culprits``: each one, or for one that runs in FP32 already its nearest
        ancestor that does not; never a whole model."""
        targets: list[str] = []
        for name in sorted(culprits):
            found = self._root_of(name)
            if found is None:
                return [], f"on_floor='promote' could not find module {name!r} in the prepared model(s)"
            prefix, _ = found
            relative = name[len(prefix) :]
            while self.runs_fp32(prefix + relative) and not self._whole(prefix, prefix + relative):
                relative = relative.rpartition(".")[0]
            if self._whole(prefix, prefix + relative):
                return [], (
                    f"on_floor='promote' would have to run the whole model in FP32 to cure overflows in {name!r}; use "
                    + (
                        "opt_level='O0' or half_dtype='bfloat16'"
                        if self.amp.half_dtype == torch.float16
                        else "opt_level='O0'"
                    )
                )
            if prefix + relative not in targets:
                targets.append(prefix + relative)
        return [t for t in targets if not any(t.startswith(o + ".") for o in targets)], None
