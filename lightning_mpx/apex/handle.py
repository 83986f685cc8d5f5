"""Apex's handles: :class:`AmpHandle` (the O1 cast scope that ``init()`` or ``initialize`` at O1 entered), with the
optimizer wrapper of Apex's first API (:class:`LegacyOptimizer`), and :class:`NoOpHandle` (``init(enabled=False)``)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, NoReturn

import torch

from lightning_mpx.apex._state import _amp_state
from lightning_mpx.apex.loss_scaling import AmpOptimizer, scale_loss
from lightning_mpx.casting.policy import disable_casts as _disable_casts
from lightning_mpx.common.keywords import check_keywords, checks_keywords
from lightning_mpx.engine.amp import Amp


class AmpHandle:
    """Apex's ``AmpHandle``: the O1 cast scope that :func:`init` (or ``initialize`` at O1) entered, over the engine
    in ``_amp_state``. ``_deactivate()`` leaves the scope (Apex restored the functions it had patched)."""

    def __init__(self, amp: Amp, scope: Any, *, verbose: bool = False) -> None:  # noqa: D107
        self._amp = amp
        self._scope = scope
        self._verbose = verbose

    def is_active(self) -> bool:
        """Whether this handle's cast scope is still entered."""
        return _amp_state.cast_scope is not None and _amp_state.cast_scope is self._scope

    def _deactivate(self) -> None:
        """Leave the cast scope, if it is still this handle's (a later ``init``/``initialize`` left it already).
        The engine, its scalers and the wrapped optimizers stay usable, without O1's casts."""
        if self.is_active():
            _amp_state.leave_cast_scope()

    def _disable_casts(self) -> contextlib.AbstractContextManager[None]:
        return _disable_casts()

    def _clear_cache(self) -> None:
        if self._amp.policy is not None:
            self._amp.policy._clear_casts()  # not the checkpoint marks: another block may recompute

    @property
    def has_cache(self) -> bool:
        return self._amp.policy is not None and self._amp.policy.cache_casts

    @property
    def verbose(self) -> bool:
        return self._verbose

    @checks_keywords("handle.wrap_optimizer()")
    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, num_loss: int = 1) -> LegacyOptimizer:
        """Apex's first optimizer wrapper: register ``optimizer`` with the engine and return it wrapped, with
        ``scale_loss(loss)`` (see :class:`LegacyOptimizer`)."""
        amp = self._current()
        if isinstance(num_loss, bool) or not isinstance(num_loss, int) or num_loss < 1:
            raise ValueError(f"num_loss={num_loss!r} must be a positive integer.")
        inner = optimizer.optimizer if isinstance(optimizer, AmpOptimizer) else optimizer
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"optimizer={type(optimizer).__name__} is not a torch.optim.Optimizer.")
        amp.prepare_optimizer(inner)
        wrapper = LegacyOptimizer(inner, _amp_state, amp)
        _amp_state.optimizers[id(inner)] = wrapper
        _amp_state.current.append(wrapper)
        _amp_state.idle.add(id(inner))
        return wrapper

    @contextlib.contextmanager
    def scale_loss(
        self, loss: torch.Tensor, optimizer: torch.optim.Optimizer, **misspelt: NoReturn
    ) -> Iterator[torch.Tensor]:
        """The module's :func:`scale_loss` for an optimizer that :meth:`wrap_optimizer` or ``initialize`` returned.

        Raises:
            TypeError: for an optimizer that was not wrapped: Apex patched its ``step`` to skip an overflowed step;
                nothing is patched here, so the wrapper's ``step`` is what skips.
        """
        if misspelt:  # refused naming the valid ones (common/keywords.py: no wrapper on a per-step call)
            check_keywords("handle.scale_loss()", misspelt, ("loss", "optimizer"))
        self._current()
        if not isinstance(optimizer, AmpOptimizer):
            raise TypeError(
                f"optimizer={type(optimizer).__name__}: handle.scale_loss() needs the optimizer returned by "
                "handle.wrap_optimizer(optimizer) (or amp.initialize()), whose step() skips a step that overflowed; "
                "lightning_mpx does not patch the optimizer's own step()."
            )
        with scale_loss(loss, optimizer) as scaled:
            yield scaled

    def _current(self) -> Amp:
        if _amp_state.amp is not self._amp:
            raise RuntimeError(
                "this handle belongs to an earlier amp.init()/amp.initialize(), which a later call replaced; use the "
                "handle the latest call returned (or _amp_state.handle)."
            )
        return self._amp

    def __repr__(self) -> str:
        return f"AmpHandle(active={self.is_active()}, {self._amp.properties.opt_level})"


class LegacyOptimizer(AmpOptimizer):
    """What :meth:`AmpHandle.wrap_optimizer` returns: an :class:`AmpOptimizer` with Apex's first API,
    ``with optimizer.scale_loss(loss) as scaled: scaled.backward()``. Its losses share loss 0's scaler (Apex's
    first wrapper kept one scaler per loss; ``initialize(num_losses=...)`` is the way to separate them)."""

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor, **misspelt: NoReturn) -> Iterator[torch.Tensor]:
        """:func:`scale_loss` for this optimizer."""
        if misspelt:
            check_keywords("optimizer.scale_loss()", misspelt, ("loss",))
        with scale_loss(loss, self) as scaled:
            yield scaled


class NoOpHandle:
    """What ``init(enabled=False)`` returns: no casts, no scaling; the optimizers are stepped as they are."""

    def is_active(self) -> bool:
        return False

    def _deactivate(self) -> None:
        pass

    def _disable_casts(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def _clear_cache(self) -> None:
        pass

    @property
    def has_cache(self) -> bool:
        return False

    @property
    def verbose(self) -> bool:
        return False

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, num_loss: int = 1) -> _PlainOptimizer:
        return _PlainOptimizer(optimizer)

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor, optimizer: Any) -> Iterator[torch.Tensor]:
        yield loss


class _PlainOptimizer:
    """``NoOpHandle.wrap_optimizer``: the optimizer itself, plus a ``scale_loss`` that yields the loss unscaled."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor) -> Iterator[torch.Tensor]:
        yield loss
