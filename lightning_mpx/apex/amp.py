"""Apex's ``amp`` front end over :class:`lightning_mpx.Amp`: old Apex scripts run with one changed import.

::

    from lightning_mpx.apex import amp          # was: from apex import amp

    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()

Each ``initialize`` (or the older ``init()``, which returns Apex's handle) maps onto one :class:`~lightning_mpx.Amp`
(its loss scalers, its cast policy, its FP32 masters). What differs from Apex, and why:

* Nothing is patched process-wide. ``initialize`` returns each optimizer wrapped in a thin object whose ``step()``
  goes through ``Amp.step()`` (at O2 the masters stand in for the half parameters only there) and which delegates
  everything else (the optimizer passed in refuses a ``step()`` of its own, which would bypass the skip and the
  scale's update); models get removable forward hooks (input/output casts at O2/O3) and, at O2/O3, state-dict hooks.
* A later ``initialize`` leaves the earlier calls' models and optimizers working with their own engine, as Apex's
  per-object patches did, and their loss scalers start afresh as Apex's global ones did. One ``scale_loss`` block
  cannot name optimizers of two calls (their scalers differ).
* O1's cast policy is a scoped ``TorchFunctionMode`` that ``initialize`` enters **on the calling thread** and keeps
  entered until the next ``initialize``. Code on other threads runs uncast: ``torch.nn.DataParallel`` runs its
  replicas on worker threads, so under it nothing is cast (use ``DistributedDataParallel``, one process per device,
  or enter ``_amp_state.amp.forward_context()`` inside the module's forward).
* ``register_*_function`` registers into the cast table instead of patching the module: the function must take part
  in torch's ``__torch_function__`` protocol (torch functions, ``Tensor`` methods; for your own function use the
  ``half_function``/``float_function``/``promote_function`` decorators, which make it do so).
* The scale backs off when the skipped step happens (``Amp.update()`` after the last named optimizer's step), not
  at the end of the block; the overflow message, logged at the end of the block, names the scale it will back off to.
* ``min_loss_scale=None`` (Apex: no floor) means the smallest normal FP32 number, with a warning when reached. At
  any floor an overflow skips the step and warns; training goes on, as Apex's.

Where each part lives: :mod:`~lightning_mpx.apex.frontend` (``initialize``, ``init``),
:mod:`~lightning_mpx.apex.loss_scaling` (``scale_loss`` and the optimizer wrapper), :mod:`~lightning_mpx.apex.handle`
(the handles of ``init``), :mod:`~lightning_mpx.apex.checkpoints` (``state_dict``, ``load_state_dict``,
``master_params``), :mod:`~lightning_mpx.apex.casts` (``register_*_function``, the decorators, ``disable_casts``),
:mod:`~lightning_mpx.apex.model_hooks` (the hooks on the models) and :mod:`~lightning_mpx.apex._state`
(``_amp_state``); this module gathers Apex's ``amp`` namespace.
"""

# The classes and _amp_state stay importable from here, as from Apex's amp (outside __all__, as before).
from lightning_mpx.apex._state import AmpState, ScalerView, _amp_state  # noqa: F401
from lightning_mpx.apex.casts import (
    disable_casts,
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from lightning_mpx.apex.checkpoints import load_state_dict, master_params, state_dict
from lightning_mpx.apex.frontend import init, initialize
from lightning_mpx.apex.handle import AmpHandle, LegacyOptimizer, NoOpHandle  # noqa: F401
from lightning_mpx.apex.loss_scaling import AmpOptimizer, scale_loss  # noqa: F401

__all__ = [
    "disable_casts",
    "float_function",
    "half_function",
    "init",
    "initialize",
    "load_state_dict",
    "master_params",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "scale_loss",
    "state_dict",
]
