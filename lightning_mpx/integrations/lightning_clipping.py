"""The Trainer plugin's gradient clipping and unscaling (:class:`GradientClipping`, a base of
:class:`~lightning_mpx.integrations.lightning.MixedPrecisionPlugin`): Lightning's ``Precision`` clip hooks on the
engine's fused unscale, so that a fused optimizer clips too and O2 clips the FP32 masters' gradients."""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.optim import Optimizer

from lightning_mpx.casting.policy import casts_off_if_on as _casts_off
from lightning_mpx.common.imports import require

require("lightning.pytorch", extra="lightning", feature="lightning_mpx.MixedPrecisionPlugin")
from lightning.pytorch.utilities import GradClipAlgorithmType  # noqa: E402

from lightning_mpx.integrations.lightning_strategies import unwrap_optimizer  # noqa: E402

__all__ = ["GradientClipping"]


class GradientClipping:
    """Lightning's clip and unscale hooks of a precision plugin whose ``amp`` is a :class:`~lightning_mpx.Amp`."""

    amp: Any

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip the unscaled gradients through :meth:`clip_grad_by_value` or :meth:`clip_grad_by_norm`, as
        Lightning's ``Precision.clip_gradients`` does (a subclass overrides those); nothing when ``clip_val <= 0``.

        Unlike Lightning's own AMP plugin this works with fused optimizers (``AdamW(fused=True)``): the plugin, not
        the optimizer, unscales. At O2 the FP32 masters' gradients are clipped (the step uses them) and the model's
        own gradients then hold the same unscaled, clipped values (what code after the clip reads, as with
        Lightning's own plugins). A subclass's own ``clip_grad_by_*`` gets the gradients unscaled (in the training
        loop they are unscaled before the hooks) and clips :meth:`main_params`'s.
        """
        if clip_val <= 0:
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            self.clip_grad_by_value(optimizer, clip_val)
        elif gradient_clip_algorithm == GradClipAlgorithmType.NORM:
            self.clip_grad_by_norm(optimizer, clip_val)
        else:
            return
        torch_optimizer = unwrap_optimizer(optimizer)
        if self._clip_overridden() and id(torch_optimizer) in self.amp._optimizers:
            with _casts_off():  # O2: the masters' gradients, clipped by the override, on the model too
                self.amp.show_unscaled_on_model(torch_optimizer)

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clip the unscaled gradients to a total norm of ``clip_val`` (under FSDP: the global norm over all
        ranks' shards); unscaling, the overflow check and the clip share one pass."""
        optimizer = unwrap_optimizer(optimizer)
        with _casts_off():
            self.amp.clip_grad_norm_(optimizer, float(clip_val))
            self.amp.show_unscaled_on_model(optimizer)  # O2 only: the masters' clipped gradients, on the model

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clip the unscaled gradients to ``[-clip_val, clip_val]``."""
        optimizer = unwrap_optimizer(optimizer)
        with _casts_off():
            self.amp.clip_grad_value_(optimizer, float(clip_val))
            self.amp.show_unscaled_on_model(optimizer)  # O2 only: the masters' clipped gradients, on the model

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Unscale ``optimizer``'s gradients now (once per step)."""
        optimizer = unwrap_optimizer(optimizer)
        if not self.amp.is_unscaled(optimizer):
            self.amp.unscale_(optimizer)

    def main_params(self, optimizer: Optimizer) -> Iterator[torch.Tensor]:  # type: ignore[override]
        """The parameters the optimizer updates (the FP32 masters at O2)."""
        yield from self.amp.master_params(unwrap_optimizer(optimizer))

    def _clip_overridden(self) -> bool:
        """Whether ``clip_grad_by_norm`` or ``clip_grad_by_value`` is not this plugin's own (a subclass's, or one
        set on the instance), which clips without the fused unscale of this plugin's own."""
        own = vars(self)
        for name in ("clip_grad_by_norm", "clip_grad_by_value"):  # a loop, not a generator: asked at every step
            if name in own or getattr(type(self), name) is not getattr(GradientClipping, name):
                return True
        return False
