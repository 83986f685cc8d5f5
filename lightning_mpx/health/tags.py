"""The module names the ``mpx/*`` tags use: the names of the model the user wrote.

A model given to :meth:`~lightning_mpx.Amp.prepare_model` inside ``nn.DataParallel`` or ``DistributedDataParallel``
names its parameters ``module.<the user's name>``; ``torch.compile``, FSDP1 and activation checkpointing insert
``_orig_mod``, ``_fsdp_wrapped_module`` and ``_checkpoint_wrapped_module``. Every report names a module the same way
(``mpx/overflow/<module>``, ``mpx/overflow_first/<module>``, ``mpx/promoted/<module>``, the groups of
``mpx/underflow/<group>``), and as a run without the wrapper does (one device, a resume without it): the wrappers'
segments are left out. Which ``module`` is a wrapper's is told by the type of the model prepared, not by the name: a
user's own child called ``module`` keeps its segment.

:class:`UserNames` is the overflow forensics' (:class:`~lightning_mpx.health.forensics.OverflowForensics`), shared by
the telemetry and the promotion of the same :class:`~lightning_mpx.Amp`. It holds strings only (it pickles).
"""

from __future__ import annotations

from torch import nn

__all__ = ["UserNames", "WRAPPER_SEGMENTS"]

#: The name segments that ``torch.compile``, FSDP1 and activation checkpointing insert: never a user's module.
WRAPPER_SEGMENTS = frozenset(("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"))


def _data_parallel_types() -> tuple[type, ...]:
    from torch.nn.parallel import DistributedDataParallel

    return (nn.DataParallel, DistributedDataParallel)


class UserNames:
    """The data-parallel wrappers among the models an engine prepared, and the user's name of a module or parameter.

    Attributes:
        wrappers: The name of each prepared wrapper's ``module`` attribute, with the model's prefix (``"module"``,
            ``"model1.module"``), without the segments of :data:`WRAPPER_SEGMENTS`.
    """

    def __init__(self) -> None:
        self.wrappers: list[str] = []

    def add_model(self, module: nn.Module, prefix: str) -> None:
        """Note ``module`` (named with ``prefix``, ``""`` or ``"model1."``) if it is a data-parallel wrapper (or a
        compiled one: ``torch.compile(nn.DataParallel(model))``)."""
        inner, path = module, prefix
        while isinstance(getattr(inner, "_orig_mod", None), nn.Module):  # torch.compile's OptimizedModule
            inner, path = inner._orig_mod, path + "_orig_mod."
        if isinstance(inner, _data_parallel_types()):
            wrapper = self._clean(path + "module")
            if wrapper not in self.wrappers:
                self.wrappers.append(wrapper)

    def __call__(self, name: str) -> str:
        """``name`` (a module's or a parameter's, as the prepared models name it) as the user's model names it: without
        the data-parallel wrappers' ``module`` and the segments of :data:`WRAPPER_SEGMENTS` (``""``: the root)."""
        name = self._clean(name)
        for wrapper in self.wrappers:
            if name == wrapper:
                return wrapper.rpartition(".")[0]
            if name.startswith(wrapper + "."):
                head = wrapper.rpartition(".")[0]
                return (head + "." if head else "") + name[len(wrapper) + 1 :]
        return name

    @staticmethod
    def _clean(name: str) -> str:
        if not any(segment in name for segment in WRAPPER_SEGMENTS):
            return name
        head, bracket, flat = name.partition("[")  # an FSDP1 flat parameter's "[flat: 0.weight, ...]" is one part
        return ".".join(part for part in head.split(".") if part not in WRAPPER_SEGMENTS) + bracket + flat
