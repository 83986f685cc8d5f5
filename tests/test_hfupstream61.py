"""transformers' own Trainer tests run through the HF Trainer door (stop 61; docs/testing.md): the one user's break they
found, ported. ``Adafactor(lr=None, relative_step=True)`` with its ``AdafactorSchedule`` (transformers' documented
pairing, upstream ``test_adafactor_lr_none``) passed as ``optimizers=(opt, sched)``."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_mpx.accelerate import MixedPrecisionKwargs, mpx_trainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

transformers.logging.set_verbosity_error()


class _Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(4))
        self.b = torch.nn.Parameter(torch.zeros(4))

    def forward(self, input_x: torch.Tensor, labels: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        y = input_x * self.a + self.b
        return (torch.nn.functional.mse_loss(y.float(), labels),) if labels is not None else (y,)


def _data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"input_x": x, "labels": 2 * x + 3} for x in torch.randn(16, 4, generator=g)]


def _adafactor_run(tmp_path, level: str) -> torch.Tensor:
    from transformers.optimization import Adafactor, AdafactorSchedule

    model = _Regression()
    opt = Adafactor(model.parameters(), scale_parameter=True, relative_step=True, warmup_init=True, lr=None)
    sched = AdafactorSchedule(opt)
    args = transformers.TrainingArguments(
        str(tmp_path / level), report_to="none", max_steps=3, per_device_train_batch_size=4, save_strategy="no",
        disable_tqdm=True,
    )
    trainer = mpx_trainer()(model, args, train_dataset=_data(), optimizers=(opt, sched), opt_level=level,
                            mpx_kwargs=MixedPrecisionKwargs(half_dtype=torch.bfloat16))  # fmt: skip
    trainer.train()
    assert sched.get_last_lr()[0] > 0  # the schedule read the step count Adafactor keeps per parameter
    return model.a.detach().float().clone()


@pytest.mark.xfail(
    strict=True,
    raises=KeyError,
    reason="tests/test_hfupstream61.py: at O2 the user's optimizer keeps the half model parameters in param_groups "
    "(with their .grad until zero_grad) while its state is keyed by the FP32 masters the step swaps in, so "
    "AdafactorSchedule.get_lr's opt.state[group['params'][0]]['step'] after the step raises KeyError 'step'",
)
def test_adafactor_schedule_at_o2(tmp_path):
    moved = _adafactor_run(tmp_path, "O2")
    assert moved.abs().sum() > 0
