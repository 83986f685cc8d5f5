"""transformers' own Trainer tests run through the HF Trainer door (stop 61; docs/testing.md): the one user's break they
found, ported. ``Adafactor(lr=None, relative_step=True)`` with its ``AdafactorSchedule`` (transformers' documented
pairing, upstream ``test_adafactor_lr_none``) passed as ``optimizers=(opt, sched)``."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_mpx.accelerate import MixedPrecisionKwargs, mpx_trainer  # noqa: E402
from tests.test_hf_trainer_callbacks import _Regression  # noqa: E402 - transformers' RegressionModel

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

transformers.logging.set_verbosity_error()


def _data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"input_x": x, "labels": 2 * x + 3} for x in torch.randn(16, 4, generator=g)]


def _adafactor_run(tmp_path, level: str) -> tuple[torch.Tensor, list[float]]:
    from transformers.optimization import Adafactor, AdafactorSchedule

    model = _Regression()
    opt = Adafactor(model.parameters(), scale_parameter=True, relative_step=True, warmup_init=True, lr=None)
    sched = AdafactorSchedule(opt)
    args = transformers.TrainingArguments(
        str(tmp_path / level), report_to="none", max_steps=3, per_device_train_batch_size=4, save_strategy="no",
        disable_tqdm=True, logging_steps=1,
    )
    trainer = mpx_trainer()(model, args, train_dataset=_data(), optimizers=(opt, sched), opt_level=level,
                            mpx_kwargs=MixedPrecisionKwargs(half_dtype=torch.bfloat16))  # fmt: skip
    trainer.train()
    logged = [entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry]
    return model.a.detach().float().clone(), logged


def test_adafactor_schedule_at_o2(tmp_path):
    """At O2 ``AdafactorSchedule.get_lr`` reads ``opt.state[group["params"][0]]["step"]`` by the half parameter its
    groups hold (the state is kept by the FP32 master: lightning_mpx.masters.state_keys): the learning rates the
    Trainer logs are those of the same run at O1, where the optimizer steps the FP32 model itself."""
    moved, logged = _adafactor_run(tmp_path, "O2")
    moved_o1, logged_o1 = _adafactor_run(tmp_path, "O1")
    assert moved.abs().sum() > 0 and len(logged) == 3
    # Adafactor's relative step: min(1e-6 * step, 1 / sqrt(step)) * max(eps, RMS(weights)): the RMS of the masters
    # at O2, of the FP32 weights at O1 (the half model's rounding apart)
    torch.testing.assert_close(torch.tensor(logged), torch.tensor(logged_o1), rtol=2e-2, atol=0)
    torch.testing.assert_close(moved, moved_o1, rtol=2e-2, atol=1e-7)
