"""``plugin.scaler``: a read-only view of loss 0's loss scaler with ``torch.amp.GradScaler``'s read API.

Code ported from Lightning's ``"16-mixed"`` reads the scale through the precision plugin's ``GradScaler``
(``self.trainer.precision_plugin.scaler.get_scale()``, ``trainer.scaler.state_dict()``,
``fabric._precision.scaler.get_scale()``). The Trainer and Fabric plugins hand such code a :class:`GradScalerView`:
it reads the engine's :class:`~lightning_mpx.scaling.scaler.LossScaler` at each call (it holds no state of its own:
the engine's scaler is the one owner), and refuses the calls that would change it, naming what does that here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

if TYPE_CHECKING:
    from lightning_mpx.engine.amp import Amp
    from lightning_mpx.scaling.scaler import LossScaler

__all__ = ["GradScalerView"]

Front = Literal["trainer", "fabric"]

#: What does each refused call's work, by front door.
_INSTEAD: dict[str, dict[Front, str]] = {
    "scale": {
        "trainer": "the plugin scales the loss in the Trainer's backward (automatic optimization) or in "
                   "self.manual_backward(loss) (self.manual_backward(loss, loss_id=i) for loss i's scale)",
        "fabric": "fabric.backward(loss) scales the loss (fabric.backward(loss, loss_id=i) for loss i's scale)",
    },
    "unscale_": {
        "trainer": "the plugin unscales the gradients once at each optimizer step, before on_before_optimizer_step "
                   "and configure_gradient_clipping, which see them unscaled",
        "fabric": "fabric.clip_gradients(...) unscales the gradients (and optimizer.step() does when nothing did)",
    },
    "step": {
        "trainer": "the Trainer's optimizer step (optimizer.step() in manual optimization) steps through the plugin, "
                   "which skips it on overflow; plugin.step_was_skipped(optimizer) says whether it did",
        "fabric": "optimizer.step() (the optimizer fabric.setup returned) steps through the plugin, which skips it on "
                  "overflow; plugin.step_was_skipped(optimizer) says whether it did",
    },
    "update": {
        "trainer": "the plugin updates the scale once per iteration, after its optimizer steps",
        "fabric": "the plugin updates the scale once per iteration, at its first call after the optimizer steps",
    },
    **{
        f"set_{name}": {
            front: f"{name} is a setting of the engine's scaler, fixed for the run: pass it to the plugin, "
                   f"{plugin}(opt_level, {name}=...)"
            for front, plugin in (("trainer", "MixedPrecisionPlugin"), ("fabric", "FabricMixedPrecisionPlugin"))
        }
        for name in ("growth_factor", "backoff_factor", "growth_interval")
    },
    "load_state_dict": {
        "trainer": "the plugin's entry of the checkpoint carries the scale: trainer.fit(model, ckpt_path=...) "
                   "restores it",
        "fabric": "the plugin's entry of the state carries the scale: fabric.load(path, {..., 'mpx': plugin}) "
                  "restores it",
    },
}


class _Owner(Protocol):
    amp: Amp

    def _read_scalers(self) -> list[LossScaler]: ...


class GradScalerView:
    """Loss 0's loss scaler as ``torch.amp.GradScaler``'s read API shows it (``plugin.scaler``).

    Each read goes to the engine's scaler of the plugin at that moment (``plugin.amp.scalers[0]``), after the scale
    update a finished iteration still owes (as ``plugin.metrics()`` does), so that it shows what a ``GradScaler``
    would: the scale the next backward uses. Before the first backward it shows the configured scale (or the
    scale a loaded checkpoint holds), as a ``GradScaler`` shows its ``init_scale`` before its first ``scale()``.
    Reads wait for the device, as a ``GradScaler``'s do.

    With several losses (``num_losses``) this is loss 0's; loss ``i``'s scaler is ``plugin.amp.scalers[i]`` (a
    :class:`~lightning_mpx.scaling.scaler.LossScaler`: ``get_scale()``, ``state_dict()``), and its scale is
    ``plugin.metrics()["mpx/loss_scale/loss{i}"]``.

    Pickled, it is its plugin's (which pickles as its settings): it reads a fresh engine.
    """

    def __init__(self, owner: _Owner, front: Front) -> None:
        self._owner = owner
        self._front = front

    def _scaler(self) -> LossScaler:
        return self._owner._read_scalers()[0]

    # -- GradScaler's read API ---------------------------------------------------------------------------------
    def get_scale(self) -> float:
        """The current scale as a Python float (a static scale's value; 1.0 where losses are not scaled)."""
        scaler = self._scaler()
        if scaler.device is None:  # no backward yet: read without making the scaler's device state
            return float(scaler.state_dict()["scale"])
        return scaler.get_scale()

    def is_enabled(self) -> bool:
        """Whether the scale is dynamic, as a ``GradScaler``'s always is (a static scale has no ``GradScaler``
        equivalent: :meth:`state_dict` is then ``{}``, a disabled ``GradScaler``'s)."""
        return self._scaler().dynamic

    def get_growth_factor(self) -> float:
        return self._scaler().growth_factor

    def get_backoff_factor(self) -> float:
        return self._scaler().backoff_factor

    def get_growth_interval(self) -> int:
        return int(self._scaler().growth_interval)

    def state_dict(self) -> dict[str, Any]:
        """The scale, growth settings and growth tracker in ``GradScaler.state_dict()``'s format
        (``torch.amp.GradScaler().load_state_dict(plugin.scaler.state_dict())`` resumes from them; a ``GradScaler``
        has no hysteresis nor scale bounds); ``{}`` for a static scale. The plugin's own checkpoint entry is
        ``plugin.state_dict()``."""
        return self._scaler().grad_scaler_state() or {}

    def _get_growth_tracker(self) -> int:
        """The unskipped steps since the scale last grew or backed off, as a Python int: ``GradScaler``'s private
        method, which callbacks ported from ``"16-mixed"`` log (``scaler._get_growth_tracker()``); 0 before the
        first backward (a ``GradScaler``'s ``init`` value), or a loaded checkpoint's."""
        return int(self._scaler().state_dict()["growth_tracker"])

    @property
    def _scale(self) -> torch.Tensor | None:
        """A copy of the scale as a 0-d FP32 tensor on its device; ``None`` before the first backward (a
        ``GradScaler``'s before its first ``scale()``)."""
        scaler = self._scaler()
        return None if scaler.device is None else scaler.scale_tensor.clone()

    # -- what it refuses --------------------------------------------------------------------------------------
    def _refuse(self, name: str) -> RuntimeError:
        return RuntimeError(
            f"plugin.scaler.{name}() was called, but plugin.scaler is a read-only view of the engine's loss scaler "
            f"(torch.amp.GradScaler's read API: get_scale(), state_dict()...): {_INSTEAD[name][self._front]}."
        )

    def scale(self, outputs: Any) -> Any:
        raise self._refuse("scale")

    def unscale_(self, optimizer: Any) -> None:
        raise self._refuse("unscale_")

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse("step")

    def update(self, new_scale: Any = None) -> None:
        raise self._refuse("update")

    def load_state_dict(self, state_dict: Any) -> None:
        raise self._refuse("load_state_dict")

    # GradScaler's setters (its growth settings): a bare AttributeError before
    def set_growth_factor(self, new_factor: float) -> None:
        raise self._refuse("set_growth_factor")

    def set_backoff_factor(self, new_factor: float) -> None:
        raise self._refuse("set_backoff_factor")

    def set_growth_interval(self, new_interval: int) -> None:
        raise self._refuse("set_growth_interval")

    def __repr__(self) -> str:
        return f"GradScalerView(loss 0 of {self._owner!r}: {self._owner.amp.scalers[0]!r})"  # reads nothing
