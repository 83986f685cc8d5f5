"""transformers' ``TrainerCallback`` events through the HF Trainer door (stop 61c; docs/testing.md "transformers'
Trainer tests (stop 61)"): upstream ``tests/trainer/test_trainer_callback.py`` ran unchanged under ``mpx_trainer``
with no difference from the plain Trainer; this pins what a user's callback relies on, against the plain Trainer:
the same events in the same order at the same steps (accumulation, evaluation, saving, a callback stopping training),
the same ``control.should_*`` flags at ``on_step_end``, ``mpx/*`` keys on training logs only, and the optimizer's
update visible in the model's weights at ``on_optimizer_step``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_mpx.accelerate import MixedPrecisionKwargs, mpx_trainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

transformers.logging.set_verbosity_error()

_EVENTS = (
    "on_train_begin", "on_epoch_begin", "on_step_begin", "on_substep_end", "on_pre_optimizer_step",
    "on_optimizer_step", "on_step_end", "on_log", "on_evaluate", "on_save", "on_epoch_end", "on_train_end",
)  # fmt: skip


class _Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(4))
        self.b = torch.nn.Parameter(torch.zeros(4))

    def forward(self, input_x: torch.Tensor, labels: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        y = input_x * self.a + self.b
        return (torch.nn.functional.mse_loss(y.float(), labels),) if labels is not None else (y,)


class _Recorder(transformers.TrainerCallback):
    """Records (event, global_step, detail) and stops training after step 5 through ``control``."""

    def __init__(self) -> None:
        self.rows: list[tuple[Any, ...]] = []
        self.updated: list[bool] = []
        self._before: torch.Tensor | None = None

    def _row(self, name: str, state: Any, control: Any, logs: dict[str, float] | None, model: Any) -> None:
        detail: Any = None
        if name == "on_log":
            assert logs is not None
            detail = (sorted(k for k in logs if not k.startswith("mpx/")), any(k.startswith("mpx/") for k in logs))
        elif name == "on_step_end":
            detail = (control.should_log, control.should_save, control.should_evaluate, control.should_training_stop)
            if state.global_step >= 5:
                control.should_training_stop = True
        elif name == "on_pre_optimizer_step":
            self._before = model.a.detach().float().clone()
        elif name == "on_optimizer_step":
            self.updated.append(not torch.equal(model.a.detach().float(), self._before))
        self.rows.append((name, state.global_step, detail))


def _attach(name: str) -> None:
    def hook(self: _Recorder, args: Any, state: Any, control: Any, logs: Any = None, model: Any = None, **kw: Any):
        self._row(name, state, control, logs, model)

    setattr(_Recorder, name, hook)


for _name in _EVENTS:
    _attach(_name)


def _run(tmp_path, level: str | None) -> _Recorder:
    g = torch.Generator().manual_seed(0)
    data = [{"input_x": x, "labels": 2 * x + 3} for x in torch.randn(24, 4, generator=g)]
    args = transformers.TrainingArguments(
        str(tmp_path / str(level)), report_to="none", per_device_train_batch_size=2, gradient_accumulation_steps=2,
        num_train_epochs=2, learning_rate=0.1, logging_steps=2, eval_strategy="steps", eval_steps=3, save_steps=4,
        disable_tqdm=True,
    )
    rec = _Recorder()
    if level is None:
        trainer = transformers.Trainer(_Regression(), args, train_dataset=data, eval_dataset=data[:4], callbacks=[rec])
    else:
        kwargs = MixedPrecisionKwargs(half_dtype=torch.bfloat16)
        trainer = mpx_trainer()(_Regression(), args, train_dataset=data, eval_dataset=data[:4], callbacks=[rec],
                                opt_level=level, mpx_kwargs=kwargs)  # fmt: skip
    trainer.train()
    return rec


def test_callback_events_match_the_plain_trainer_at_o2(tmp_path):
    reference = _run(tmp_path, None)
    ours = _run(tmp_path, "O2")
    strip = [(n, s, d[0] if n == "on_log" else d) for n, s, d in ours.rows]
    assert strip == [(n, s, d[0] if n == "on_log" else d) for n, s, d in reference.rows]
    assert reference.rows[-1][:2] == ("on_train_end", 5)  # the callback's should_training_stop ended it at step 5
    training_logs = [d[1] for n, _, d in ours.rows if n == "on_log" and "loss" in d[0]]
    other_logs = [d[1] for n, _, d in ours.rows if n == "on_log" and "loss" not in d[0]]
    assert training_logs and all(training_logs)  # mpx/loss_scale, ... on every training log
    assert other_logs and not any(other_logs)  # not on evaluation logs nor the run's summary
    assert len(ours.updated) == 5 and all(ours.updated)  # the model's weights hold the step at on_optimizer_step
