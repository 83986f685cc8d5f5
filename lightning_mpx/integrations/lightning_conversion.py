"""What the Trainer and Fabric plugins check and record on the models they convert for the opt level.

* Lazy modules (``nn.LazyLinear``, ``nn.LazyConv2d``...): their parameters have no shape until their first forward,
  and O2 makes each parameter's FP32 master when the model is prepared for training (``trainer.fit``,
  ``fabric.setup``), before any forward. O1 and O3 make no masters and train a lazy module as Lightning's own
  precisions do; at O2 the plugins refuse it with the remedy rather than fail inside the engine on a parameter
  without a shape.
* A model trained at O2 before (a second stage: a new Trainer with a new plugin, a new Fabric plugin) or a deep copy
  of one: its new masters start from the FP32 values, taken over from the engine that holds them (which lets them go)
  or carried by the copy (:mod:`lightning_mpx.masters.watch`). Where that engine was let go (garbage-collected), or
  across processes (the masters are then taken from rank zero's half weights), they start from the half weights,
  which the Trainer and Fabric plugins say with a warning.
* The dtype Lightning's modules report (``LightningModule.dtype``, kept by Lightning's ``.to()``, which the engine's
  conversion does not go through): at O2/O3 the half dtype, as under Lightning's own ``"bf16-true"``, so that
  ``x.to(self.dtype)`` and ``torch.zeros(..., dtype=self.dtype)`` in a step give what the weights hold.
"""

from __future__ import annotations

import itertools
from typing import Iterable

import torch
from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.nn.parameter import is_lazy

from lightning_mpx.masters.watch import WatchedParameter, masters_lost

__all__ = ["record_half_dtype", "refuse_lazy", "warn_foreign_masters"]


def refuse_lazy(module: nn.Module, call: str) -> None:
    """Raise a ``ValueError`` naming ``module``'s uninitialized (lazy) parameters, which O2 cannot make masters of
    yet; ``call`` is the user's call that prepares the model (``"trainer.fit"``, ``"fabric.setup"``)."""
    names = [name for name, param in module.named_parameters() if is_lazy(param)]
    if not names:
        return
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    verb = "is" if len(names) == 1 else "are"
    # Layers built in the LightningModule's configure_model do not exist before trainer.fit: the forward goes there.
    built = ", in configure_model after building them for layers built there" if call == "trainer.fit" else ""
    raise ValueError(
        f"opt_level='O2': {shown} of {type(module).__name__} {verb} not initialized yet (a lazy module such as "
        f"nn.LazyLinear gets its shape at its first forward), and O2 makes the FP32 master weights at {call}, before "
        f"any forward. Run one forward on an example batch before {call} (it materializes the lazy modules){built}, or "
        "give the layers their input sizes (nn.Linear(in_features, ...)); O1 and O3 make no masters and take lazy "
        "modules."
    )


def record_half_dtype(module: nn.Module, half_dtype: torch.dtype) -> None:
    """Record ``half_dtype`` as the dtype of ``module`` and of its Lightning submodules (``LightningModule.dtype``)
    that hold half tensors, as Lightning's ``module.to(half_dtype)`` does, after the plugin converted it to half
    (O2/O3); a Lightning submodule kept in FP32 whole (``fp32_modules``) keeps its FP32."""
    for sub in module.modules():
        if isinstance(sub, _DeviceDtypeModuleMixin):
            if any(t.dtype == half_dtype for t in itertools.chain(sub.parameters(), sub.buffers())):
                sub._dtype = half_dtype


#: What a Trainer or Fabric user does to go on from the FP32 masters of the engine that trained the model last.
_CARRY_ON = {
    "trainer.fit": "keep the Trainer (or its plugin) that fitted it alive until this fit starts, or resume from a "
    "checkpoint of that fit (trainer.fit(model, ckpt_path=...))",
    "fabric.setup": "keep the plugin that trained it alive until this setup, or load the earlier run's checkpoint with "
    "the plugin's entry after fabric.setup (plugin.setup_optimizers(optimizer), then fabric.load(path, {'model': "
    "model, 'optimizer': optimizer, 'mpx': mpx}))",
}


def warn_foreign_masters(module: nn.Module, call: str = "trainer.fit", known: Iterable[nn.Parameter] = ()) -> None:
    """Warn (rank zero) when ``module``'s trained half parameters had FP32 masters that the plugin about to make its
    own cannot start from: the engine that held them was let go, or (across processes, where masters are taken from
    rank zero's half weights) another engine holds them. Its masters start from the half weights, one rounding of
    the FP32 values trained so far (what FP32 training would carry on from exactly). ``call``: the user's call that
    prepares the model (``"trainer.fit"``, ``"fabric.setup"``); ``known``: parameters whose masters are the plugin's
    own (a model set up before)."""
    own = {id(param) for param in known}
    several = torch.distributed.is_available() and torch.distributed.is_initialized()
    names = [
        name
        for name, p in module.named_parameters()
        if p.requires_grad and id(p) not in own and (masters_lost(p) or several and type(p) is WatchedParameter)
    ]
    if not names:
        return
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    where = "across processes, where masters start from rank zero's half weights" if several else (
        "and the engine that held them was let go"
    )
    rank_zero_warn(
        f"{type(module).__name__} was trained at O2 by another MixedPrecisionPlugin or FabricMixedPrecisionPlugin "
        f"(or by this one before it took another model), {where}: the FP32 master weights ({shown}) cannot be taken "
        f"over at {call}, and its masters start from the half weights, rounded. To go on from the FP32 values, "
        f"{_CARRY_ON[call]}."
    )
