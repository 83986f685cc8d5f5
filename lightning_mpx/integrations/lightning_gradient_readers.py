"""Which of the Lightning Trainer's hooks read the gradients before the optimizer step.

The Trainer plugin unscales before those hooks when there are any (they must see true gradients); without them the
unscale is left to the clip (one fused pass) or to the step. :class:`GradientReaders` answers per LightningModule
class and hook, once per fit: Lightning's ``is_overridden`` reads several attributes and compares code objects, a cost
on every step otherwise.
"""

from __future__ import annotations

from typing import Any, Callable

from lightning_mpx.common.imports import require

_pl = require("lightning.pytorch", extra="lightning", feature="lightning_mpx.MixedPrecisionPlugin")

from lightning.pytorch.utilities.model_helpers import is_overridden  # noqa: E402

__all__ = ["GradientReaders"]

#: The LightningModule's hooks that read the gradients (and may clip them itself).
_MODULE_HOOKS = ("on_before_optimizer_step", "configure_gradient_clipping")
#: The callbacks' hook that reads the gradients.
_HOOK = "on_before_optimizer_step"


class GradientReaders:
    """Whether a LightningModule or the Trainer's callbacks read the gradients before the optimizer step."""

    def __init__(self) -> None:
        # is_overridden() answers per (LightningModule class, hook), asked anew in every fit (see clear()).
        self._overrides: dict[tuple[type, str], bool] = {}

    def clear(self) -> None:
        """Forget the answers: a new fit (classes may have changed since the last one)."""
        self._overrides.clear()

    def overridden(self, model: Any, name: str) -> bool:
        """``is_overridden(name, model)``, asked once per fit and class. A hook set on the instance itself counts as
        overridden, even when it wraps the default one (``is_overridden`` sees through a wrapper: a profiler's, a
        callback's or ``mock.patch.object(..., wraps=...)``, whose caller may read the gradients)."""
        if name in vars(model):
            return True
        key = (type(model), name)
        answer = self._overrides.get(key)
        if answer is None:
            answer = self._overrides[key] = is_overridden(name, model)
        return answer

    def read_gradients(self, model: Any, callbacks: list[Any], *, plugin_clips: Callable[[], bool]) -> bool:
        """Whether the LightningModule implements ``on_before_optimizer_step`` or ``configure_gradient_clipping``
        (which reads the gradients and may clip them itself), the plugin's ``clip_grad_by_*`` is overridden
        (``plugin_clips()``: a subclass's own clips what ``main_params()`` holds, true values), or one of the
        Trainer's ``callbacks`` implements ``on_before_optimizer_step``."""
        # Asked at every step: plain loops over the hooks and callbacks, no call but the cache's first answer.
        own = vars(model)
        for name in _MODULE_HOOKS:
            if name in own:
                return True
            answer = self._overrides.get((type(model), name))
            if answer is None:
                answer = self.overridden(model, name)
            if answer:
                return True
        if plugin_clips():
            return True
        base = _pl.Callback.on_before_optimizer_step
        for cb in callbacks:
            # getattr on the type: a ``Mock(spec=ModelCheckpoint)`` callback's type (``Mock``) has no hook of its own.
            if getattr(type(cb), _HOOK, None) is not base or _HOOK in getattr(cb, "__dict__", ()):
                return True
        return False
