"""The registry under a :class:`~lightning_mpx.engine.optimizers.StepMachine` (the base of its
:class:`~lightning_mpx.engine.unscaling.UnscalePath`): an optimizer's state found by the optimizer, with an error that
names the cause for one the engine does not hold (never registered, taken over by another engine, not an optimizer)
and the door's own call to fix it. Registering and releasing stay on the machine.
"""

from __future__ import annotations

import weakref

import torch

from lightning_mpx.engine.optimizer_state import _OptimizerState


class Registry:
    """The optimizers one engine registered, by ``id`` (the attributes are the machine's, see
    :class:`~lightning_mpx.engine.optimizers.StepMachine`)."""

    optimizers: dict[int, _OptimizerState]
    taken: dict[int, weakref.ref[torch.optim.Optimizer]]  # optimizers another engine took over
    _register_call: str

    @property
    def register_call(self) -> str:
        """What the error for an unregistered optimizer tells the user to do: the door's own call
        (:attr:`Amp.register_call <lightning_mpx.engine.amp.Amp.register_call>`)."""
        return self._register_call

    @register_call.setter
    def register_call(self, value: str) -> None:
        if not isinstance(value, str) or not value:
            raise TypeError(f"register_call={value!r} must be a non-empty str (the words that end the error).")
        self._register_call = value

    def state(self, optimizer: torch.optim.Optimizer) -> _OptimizerState:
        """The state of a registered ``optimizer``; an error naming the cause (and the door's call) for any other."""
        state = self.optimizers.get(id(optimizer))
        if state is None:
            taken = self.taken.get(id(optimizer))
            if taken is not None and taken() is optimizer:
                raise RuntimeError(
                    f"optimizer={type(optimizer).__name__} was taken over by another engine that registered it since "
                    "(a later stage's prepare_optimizer(), Trainer or fabric.setup()): an optimizer is stepped by one "
                    "engine at a time. Step it through that engine; to step it through this one again, prepare its "
                    f"model with this one again, then {self.register_call} (that takes both back). Two engines "
                    "training at once need an optimizer each."
                )
            if not isinstance(optimizer, torch.optim.Optimizer):  # said "was not registered; call prepare_optimizer()"
                raise TypeError(
                    f"optimizer={type(optimizer).__name__} is not a torch.optim.Optimizer: pass the optimizer itself "
                    "(its step, unscale and clip cover the parameters it trains), not a model or its parameters."
                )
            raise RuntimeError(f"optimizer={type(optimizer).__name__} was not registered; {self.register_call}.")
        return state
