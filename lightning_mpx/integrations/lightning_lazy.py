"""Lazy modules (``nn.LazyLinear``, ``nn.LazyConv2d``...) met by the Trainer and Fabric plugins at O2.

A lazy module's parameters have no shape until its first forward, and O2 makes each parameter's FP32 master when the
model is prepared for training (``trainer.fit``, ``fabric.setup``), before any forward. O1 and O3 make no masters and
train a lazy module as Lightning's own precisions do; at O2 the plugins refuse it with the remedy rather than fail
inside the engine on a parameter without a shape.
"""

from __future__ import annotations

from torch import nn
from torch.nn.parameter import is_lazy

__all__ = ["refuse_lazy"]


def refuse_lazy(module: nn.Module, call: str) -> None:
    """Raise a ``ValueError`` naming ``module``'s uninitialized (lazy) parameters, which O2 cannot make masters of
    yet; ``call`` is the user's call that prepares the model (``"trainer.fit"``, ``"fabric.setup"``)."""
    names = [name for name, param in module.named_parameters() if is_lazy(param)]
    if not names:
        return
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    verb = "is" if len(names) == 1 else "are"
    raise ValueError(
        f"opt_level='O2': {shown} of {type(module).__name__} {verb} not initialized yet (a lazy module such as "
        f"nn.LazyLinear gets its shape at its first forward), and O2 makes the FP32 master weights at {call}, before "
        f"any forward. Run one forward on an example batch before {call} (it materializes the lazy modules), or give "
        "the layers their input sizes (nn.Linear(in_features, ...)); O1 and O3 make no masters and take lazy modules."
    )
