"""Apex compatibility: ``from lightning_mpx.apex import amp`` in place of ``from apex import amp``.

See :mod:`lightning_mpx.apex.amp` for what maps onto :class:`lightning_mpx.Amp` and what differs, and
:mod:`lightning_mpx.apex._state` for ``_amp_state``.
"""

from lightning_mpx.apex import amp, fp16_utils
from lightning_mpx.apex._state import _amp_state

__all__ = ["_amp_state", "amp", "fp16_utils"]
