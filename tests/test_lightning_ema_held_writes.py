"""An EMA child INSIDE the optimizer at O2, judged where the step takes the hand writes (engine/frozen_writes.py
``HeldWrites``, called by masters/mirror.py ``step_mirrored`` only when ``Mirror.take_writes`` found writes): a held
half parameter written since the last step whose FP32 master has no gradient at this step and no optimizer state is
warned about once. Writes that are no hand update of an untrained part are not: weights set after set-up before the
first step, a half state dict loaded into a layer no step reaches. The Trainer with gradient accumulation, an EMA
updated through ``.data`` every 5 optimizer steps: warned once, naming the child. bfloat16, tiny."""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp, MixedPrecisionPlugin
from tests.lightning_helpers import classification_data, loader, make_trainer

HALF = torch.bfloat16
WARNED = "that the optimizer holds got no gradient"


def _caught(run: Callable[[], Any]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if "lightning_mpx:" in str(w.message) and "EMA" in str(w.message)]


class WithSpare(nn.Module):
    """A network and a layer no step reaches (no gradient ever), both in ``SGD(model.parameters())``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.spare = nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _core(before_first: Callable[[WithSpare], None], between: Callable[[WithSpare, int], None]) -> list[str]:
    def run() -> None:
        amp = Amp("O2", half_dtype=HALF)
        model = amp.prepare_model(WithSpare())
        optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        before_first(model)
        g = torch.Generator().manual_seed(1)
        for i in range(4):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            with amp.forward_context():
                loss = F.cross_entropy(amp.cast_outputs(model(amp.cast_inputs(x))).float(), y)
            amp.backward(loss)
            amp.step(optimizer)
            amp.update()
            optimizer.zero_grad(set_to_none=True)
            between(model, i)

    return _caught(run)


def _nothing(*args: Any) -> None:
    pass


def _reinit(model: WithSpare) -> None:
    with torch.no_grad():  # weights set after set-up (a re-initialisation), before the first step
        torch.manual_seed(7)
        model.spare.weight.normal_()


def _half_load(model: WithSpare, i: int) -> None:
    torch.manual_seed(10 + i)  # a rollback or swap of the unreached layer from a half checkpoint
    model.spare.load_state_dict({k: v.to(HALF) for k, v in nn.Linear(16, 4).state_dict().items()})


def test_weights_set_before_the_first_step_are_not_warned() -> None:
    assert _core(_reinit, _nothing) == []


def test_a_half_state_dict_loaded_into_a_layer_without_gradient_is_not_warned() -> None:
    assert _core(_nothing, _half_load) == []


def test_an_ema_update_of_the_unreached_layer_after_a_step_is_warned_once() -> None:
    """The sharp counterpart of the two above: the same layer written by hand after a step (``lerp_``)."""

    def lerp(model: WithSpare, i: int) -> None:
        with torch.no_grad():
            model.spare.weight.lerp_(model.net.weight, 0.01)

    messages = _core(_nothing, lerp)
    assert len(messages) == 1 and WARNED in messages[0] and "('spare')" in messages[0], messages


class Accumulated(pl.LightningModule):
    """An EMA child in ``SGD(self.parameters())``, updated through ``.data`` every 5 optimizer steps (10 batches at
    ``accumulate_grad_batches=2``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        self.ema = copy.deepcopy(self.net)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self.net(batch[0]).float(), batch[1])

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx % 10 == 9:
            for e, s in zip(self.ema.parameters(), self.net.parameters()):
                e.data.mul_(0.99).add_(s.data, alpha=0.01)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def test_trainer_accumulated_ema_through_data_every_5_steps_is_warned_once_naming_the_child() -> None:
    trainer = make_trainer(MixedPrecisionPlugin("O2", half_dtype=HALF), max_epochs=1, accumulate_grad_batches=2)
    messages = _caught(lambda: trainer.fit(Accumulated(), loader(classification_data(n=192), batch_size=8)))
    assert len(messages) == 1, messages
    assert WARNED in messages[0] and "4 bfloat16 parameters of Accumulated ('ema')" in messages[0], messages[0]
