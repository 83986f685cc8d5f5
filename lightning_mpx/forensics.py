"""Overflow forensics: what one overflow step found, as data.

:class:`OverflowRecord` is what :attr:`lightning_mpx.Amp.last_overflow` holds after a step that overflowed. It is
built on overflow steps only, where the overflow flag is read on the host anyway; a step that does not overflow
builds nothing and reads nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

Kind = Literal["inf", "nan", "inf+nan"]
Origin = Literal["forward", "backward", "unknown"]


@dataclasses.dataclass(frozen=True)
class OverflowRecord:
    """One overflow step, as found on the host.

    Attributes:
        step: The number of :meth:`~lightning_mpx.Amp.step` calls made before this one (all optimizers).
        loss_ids: The losses the overflow was charged to.
        scales: The loss scale of each of those losses when the gradients were computed.
        parameters: Parameter name to the kind of non-finite values its gradient held (``"inf"``, ``"nan"`` or
            ``"inf+nan"``).
        modules: The same, per module (the parameter name without its last component; ``""`` for parameters of
            the root module).
        origin: ``"forward"`` when the forward already produced non-finite values (the loss or a module's output),
            ``"backward"`` when the forward was finite and the gradients were not, ``"unknown"`` when the forward
            was not watched on this step.
        first_module: The first module, in forward order, whose output held non-finite values (``None`` unless
            ``origin == "forward"`` and the forward was watched).
        rank: The process that found it (0 without a distributed strategy).
    """

    step: int
    loss_ids: tuple[int, ...]
    scales: tuple[float, ...]
    parameters: dict[str, Kind]
    modules: dict[str, Kind]
    origin: Origin = "unknown"
    first_module: str | None = None
    rank: int = 0

    def culprits(self) -> list[str]:
        """The modules to blame: the first non-finite module of the forward when it is known, else every module
        whose parameters got non-finite gradients."""
        if self.origin == "forward" and self.first_module is not None:
            return [self.first_module]
        return list(self.modules)
