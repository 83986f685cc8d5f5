"""The overflow counts have one owner, the engine's totals; each reader of the metrics owns only its position.

From the user's side: a core loop with two readers, a callback reading between the Trainer's logs, a checkpoint saved
between two reads or logs and resumed (Trainer, Fabric, Accelerate), a checkpoint of the release that kept the counts
not logged yet (``unlogged_counts``), and the recipe of docs/lightning.md that puts the ``mpx/*`` metrics into
``trainer.callback_metrics`` for ``ModelCheckpoint(monitor=...)``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_mpx import Amp

INIT, GROWTH = 2.0**10, 3
#: The keys of Amp.state_dict() as the release before this one wrote them (a door added "unlogged_counts").
OLD_ENGINE_KEYS = ("opt_level", "half_dtype", "scalers", "master_weights", "fp32_values", "skipped_steps", "promotion")


def old_format(state: dict[str, Any], unlogged: dict[str, float] | None) -> dict[str, Any]:
    """``state`` (this release's) as the release before wrote it: the engine's keys of then, and a door's counts not
    logged yet."""
    old = {key: state[key] for key in OLD_ENGINE_KEYS}
    if unlogged is not None:
        old["unlogged_counts"] = unlogged
    return old


# -- the core engine ---------------------------------------------------------------------------------------------
def _engine() -> tuple[Amp, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    amp = Amp("O1", half_dtype="bfloat16", loss_scale="dynamic", skip_on_device=False)
    model = amp.prepare_model(nn.Linear(8, 2))
    return amp, model, amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))


def _steps(amp: Amp, model: nn.Module, optimizer: torch.optim.Optimizer, infs: list[bool], clip: bool = False) -> None:
    for inf in infs:
        with amp.forward_context():
            loss = model(torch.randn(4, 8)).float().pow(2).mean() * (float("inf") if inf else 1.0)
        amp.backward(loss)
        if clip:
            amp.clip_grad_norm_(optimizer, 1.0)
        amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()


def _count(metrics: dict[str, Any], name: str = "mpx/overflows") -> float:
    return float(metrics.get(name, 0.0))


def test_core_readers_never_take_counts_from_each_other():
    amp, model, optimizer = _engine()
    _steps(amp, model, optimizer, [True, False, True])
    assert _count(amp.metrics()) == 2  # the default reader, since the start
    _steps(amp, model, optimizer, [True])
    assert _count(amp.metrics()) == 1  # since its previous call
    assert _count(amp.metrics()) == 0
    first_log = amp.metrics("log")  # another reader: every overflow since the start, whatever the default one read
    assert _count(first_log) == 3 and _count(first_log, "mpx/overflow/_root") == 3
    _steps(amp, model, optimizer, [True, False])
    assert _count(amp.metrics("log")) == 1 and _count(amp.metrics()) == 1
    assert amp.metrics()["mpx/skipped_steps"] == amp.metrics("log")["mpx/skipped_steps"] == 4  # a total: both


def test_core_gradient_norm_and_telemetry_are_reported_once_to_each_reader():
    amp, model, optimizer = _engine()
    amp.request_telemetry()
    _steps(amp, model, optimizer, [False], clip=True)
    default, log = amp.metrics(), amp.metrics("log")
    for read in (default, log):
        assert "mpx/grad_norm" in read and any(name.startswith("mpx/headroom_doublings/") for name in read)
    assert float(default["mpx/grad_norm"]) == float(log["mpx/grad_norm"])
    again = amp.metrics()  # nothing new since the default reader's previous call
    assert "mpx/grad_norm" not in again and not any(name.startswith("mpx/headroom_doublings/") for name in again)


def test_core_resume_counts_what_each_reader_had_not_read_when_saved():
    amp, model, optimizer = _engine()
    _steps(amp, model, optimizer, [True, False])
    amp.metrics("log")
    _steps(amp, model, optimizer, [True])
    assert _count(amp.metrics()) == 2
    _steps(amp, model, optimizer, [True])  # read by no reader before the save
    saved = amp.state_dict()
    resumed, model2, optimizer2 = _engine()
    resumed.load_state_dict(saved)
    assert _count(resumed.metrics()) == 1  # the last one: neither the saving run's total again, nor none
    log = resumed.metrics("log")
    assert _count(log) == 2 and _count(log, "mpx/overflow/_root") == 2
    # A reader the checkpoint does not hold never read: from the start, as in one uninterrupted run
    assert _count(resumed.metrics("new")) == 3
    _steps(resumed, model2, optimizer2, [True])
    assert [_count(resumed.metrics(r)) for r in ("default", "log", "new")] == [1, 1, 1]
    assert resumed.metrics()["mpx/skipped_steps"] == 4


def test_core_checkpoint_of_the_release_before_counts_from_the_loaded_totals():
    amp, model, optimizer = _engine()
    _steps(amp, model, optimizer, [True, True])
    resumed, model2, optimizer2 = _engine()
    resumed.load_state_dict(old_format(amp.state_dict(), None))
    assert _count(resumed.metrics()) == 0 and _count(resumed.metrics("log")) == 0
    _steps(resumed, model2, optimizer2, [True])
    read = resumed.metrics()
    assert _count(read) == 1 and _count(read, "mpx/overflow/_root") == 1 and read["mpx/skipped_steps"] == 3


def test_core_reader_name_is_checked():
    amp, _, _ = _engine()
    with pytest.raises(TypeError, match="reader=3"):
        amp.metrics(3)  # type: ignore[arg-type]


def test_core_checkpoint_with_bad_reader_positions_is_refused_before_anything_is_loaded():
    amp, model, optimizer = _engine()
    _steps(amp, model, optimizer, [True])
    state = amp.state_dict()
    fresh, _, _ = _engine()
    before = fresh.state_dict()
    with pytest.raises(TypeError, match="metric_readers"):
        fresh.load_state_dict({**state, "metric_readers": {"log": {"mpx/overflows": "one"}}})
    after = fresh.state_dict()
    assert after["scalers"] == before["scalers"] and after["skipped_steps"] == before["skipped_steps"] == [0]


# -- the Trainer ---------------------------------------------------------------------------------------------------
pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lightning_mpx import FabricMixedPrecisionPlugin, MixedPrecisionPlugin  # noqa: E402
from tests.lightning_helpers import Classifier, RecordingLogger, classification_data, loader, make_trainer  # noqa: E402


def fp16_plugin() -> MixedPrecisionPlugin:
    return MixedPrecisionPlugin("O1", half_dtype="float16", init_scale=INIT, growth_interval=GROWTH)


class Peek(pl.Callback):
    """Reads ``trainer.precision_plugin.metrics()`` after every batch (docs/lightning.md allows it)."""

    def __init__(self) -> None:
        self.overflows: list[float] = []

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self.overflows.append(trainer.precision_plugin.metrics()["mpx/overflows"])


def logged_overflows(logger: RecordingLogger) -> dict[int, float]:
    return {step: values["mpx/overflows"] for step, values in logger.logged if "mpx/overflows" in values}


def test_trainer_callback_reads_and_checkpoints_between_logs_take_nothing_from_the_logs_across_a_resume(tmp_path):
    data = loader(classification_data(n=16 * 6))
    peek, logger = Peek(), RecordingLogger()
    # Logs after steps 2, 5 and 8 (every 3rd); a checkpoint after step 4, whose overflow no log holds yet; the
    # callback reads after every step.
    ckpt = ModelCheckpoint(dirpath=str(tmp_path), save_last=True, every_n_train_steps=5)
    first = make_trainer(fp16_plugin(), max_steps=5, max_epochs=3, logger=logger, log_every_n_steps=3,
                         enable_checkpointing=True, callbacks=[peek, ckpt])
    first.fit(Classifier(inject_inf_at=(1, 4)), data)
    assert peek.overflows == [0.0, 1.0, 0.0, 0.0, 1.0]  # since the callback's own previous read
    assert logged_overflows(logger) == {2: 1.0}  # the overflow at step 1

    logger2, peek2 = RecordingLogger(), Peek()
    second = make_trainer(fp16_plugin(), max_steps=9, max_epochs=3, logger=logger2, log_every_n_steps=3,
                          callbacks=[peek2])
    second.fit(Classifier(inject_inf_at=(6,)), data, ckpt_path=str(tmp_path / "last.ckpt"))
    # The first log after the resume holds the overflow at 4 (saved, not logged yet), the next the one at 6.
    assert logged_overflows(logger2) == {5: 1.0, 8: 1.0}
    assert peek2.overflows == [0.0, 1.0, 0.0, 0.0]  # the callback had read step 4's before the save
    assert second.precision_plugin.metrics()["mpx/skipped_steps"] == 3


def test_trainer_checkpoint_of_the_release_before_gives_the_right_first_log(tmp_path):
    data = loader(classification_data(n=16 * 6))
    ckpt = ModelCheckpoint(dirpath=str(tmp_path), save_last=True, every_n_train_steps=5)
    first = make_trainer(fp16_plugin(), max_steps=5, max_epochs=3, logger=RecordingLogger(), log_every_n_steps=3,
                         enable_checkpointing=True, callbacks=[ckpt])
    first.fit(Classifier(inject_inf_at=(1, 4)), data)
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    key = next(k for k, v in checkpoint.items() if isinstance(v, dict) and "metric_readers" in v)
    # As the release before saved it: the overflow at step 4 among the counts not logged yet.
    checkpoint[key] = old_format(checkpoint[key], {"mpx/overflows": 1.0, "mpx/overflow/net.0": 1.0})
    torch.save(checkpoint, tmp_path / "old.ckpt")
    logger = RecordingLogger()
    second = make_trainer(fp16_plugin(), max_steps=9, max_epochs=3, logger=logger, log_every_n_steps=3)
    second.fit(Classifier(inject_inf_at=(6,)), data, ckpt_path=str(tmp_path / "old.ckpt"))
    assert logged_overflows(logger) == {5: 1.0, 8: 1.0}  # not 0 (from the loaded totals), not 2 (the whole total)
    first_log = next(values for step, values in logger.logged if step == 5)
    assert first_log["mpx/overflow/net.0"] == 1.0 and first_log["mpx/skipped_steps"] == 2


def docs_recipe() -> type:
    """The ``MpxMetricsToCallbacks`` callback of docs/lightning.md, run from the docs' own code block."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "lightning.md").read_text()
    (code,) = [b for b in re.findall(r"^```python\n(.*?)^```", text, re.S | re.M) if "class MpxMetricsToCallbacks" in b]
    namespace: dict[str, Any] = {}
    exec(compile(code, "docs/lightning.md", "exec"), namespace)  # builds the block's Trainer too (CPU, not fitted)
    return namespace["MpxMetricsToCallbacks"]


def test_recipe_lets_model_checkpoint_monitor_the_loss_scale(tmp_path):
    from tests.test_hostile_telemetry import reference

    steps, injected = 10, {2, 3, 7}
    logger = RecordingLogger()
    best = ModelCheckpoint(dirpath=str(tmp_path), monitor="mpx/loss_scale", mode="max", save_top_k=1,
                           every_n_train_steps=1, filename="{step}")
    trainer = make_trainer(fp16_plugin(), max_steps=steps, logger=logger, log_every_n_steps=1,
                           enable_checkpointing=True, callbacks=[docs_recipe()(), best])
    trainer.fit(Classifier(inject_inf_at=tuple(injected)), loader(classification_data(n=16 * steps)))
    scales, skipped = reference(injected, steps)
    assert float(best.best_model_score) == max(scales)
    assert Path(best.best_model_path).name == f"step={scales.index(max(scales)) + 1}.ckpt"  # the first to reach it
    assert float(trainer.callback_metrics["mpx/loss_scale"]) == scales[-1]
    assert float(trainer.callback_metrics["mpx/overflows"]) == float(steps - 1 in skipped)  # the last step's
    # Not logged twice: the loggers get the plugin's own log, once per step, whose counts the recipe took none of.
    assert [step for step, values in logger.logged if "mpx/loss_scale" in values] == list(range(steps))
    assert [v for _, v in sorted(logged_overflows(logger).items())] == [float(s in skipped) for s in range(steps)]


# -- Fabric --------------------------------------------------------------------------------------------------------
def _fabric_run(state: dict[str, Any] | None, inject: set[int], steps: int, read_every: int
                ) -> tuple[list[float], dict[str, Any]]:
    from lightning.fabric import Fabric

    mpx = FabricMixedPrecisionPlugin("O1", half_dtype="float16", init_scale=INIT, growth_interval=GROWTH)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx])
    torch.manual_seed(0)
    model = fabric.setup_module(nn.Linear(16, 4))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.01))
    if state is not None:
        mpx.load_state_dict(state)
    read = []
    for step in range(steps):
        fabric.backward(model(torch.randn(8, 16)).square().mean())
        if step in inject:
            model.weight.grad[0, 0] = float("inf")
        optimizer.step()
        optimizer.zero_grad()
        if step % read_every == read_every - 1:
            read.append(mpx.metrics()["mpx/overflows"])
    return read, mpx.state_dict()  # saved after steps no metrics() call read


@pytest.mark.parametrize("old", [False, True], ids=["this-release", "checkpoint-of-the-release-before"])
def test_fabric_resume_counts_what_metrics_had_not_read_when_saved(old):
    first, state = _fabric_run(None, {1, 4}, 5, read_every=3)  # read after step 2; step 4's overflow is not read
    assert first == [1.0]
    if old:
        state = old_format(state, {"mpx/overflows": 1.0, "mpx/overflow/_root": 1.0})
    second, _ = _fabric_run(state, {1}, 3, read_every=3)
    assert second == [2.0]  # the one the saving run had not read, and this run's


# -- Accelerate ------------------------------------------------------------------------------------------------------
def _accelerate_run(project: Path, resume: Path | None, inject: set[int], steps: range, peek: bool,
                    old: bool = False, log_every: int = 3) -> dict[int, float]:
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
    from lightning_mpx.integrations.accelerate_checkpoint import AMP_STATE_NAME

    accelerator = Accelerator(
        mixed_precision="O1", log_with="tensorboard", project_dir=str(project),
        kwargs_handlers=[MixedPrecisionKwargs(half_dtype="float16", init_scale=INIT, growth_interval=GROWTH)],
    )
    accelerator.init_trackers("run")
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    if resume is not None:
        if old:
            path = resume / AMP_STATE_NAME
            torch.save(old_format(torch.load(path), {"mpx/overflows": 1.0, "mpx/overflow/_root": 1.0}), path)
        accelerator.load_state(str(resume))
    peeked = {}
    for step in steps:
        accelerator.backward(model(torch.randn(8, 16)).square().mean())
        if step in inject:
            model.weight.grad[0, 0] = float("inf")
        optimizer.step()
        optimizer.zero_grad()
        if peek:
            peeked[step] = accelerator.mpx_metrics()["mpx/overflows"]  # between the logs
        if step % log_every == log_every - 1:
            accelerator.log({"step": float(step)}, step=step)
    if resume is None:
        accelerator.save_state(str(project / "ckpt"))  # after step 4, whose overflow no log holds yet
    accelerator.end_training()
    return peeked


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("old", [False, True], ids=["this-release", "checkpoint-of-the-release-before"])
def test_accelerate_mpx_metrics_between_logs_and_resume_take_nothing_from_the_logs(tmp_path, old):
    from lightning_mpx.health.plot import read_scalars
    from tests.accelerate_helpers import reset_accelerate_state

    peeked = _accelerate_run(tmp_path, None, {1, 4}, range(5), peek=True)
    assert peeked == {0: 0.0, 1: 1.0, 2: 0.0, 3: 0.0, 4: 1.0}  # since the previous mpx_metrics() call
    reset_accelerate_state()
    _accelerate_run(tmp_path, tmp_path / "ckpt", {6}, range(5, 9), peek=False, old=old)
    logged = {tag: dict(points) for tag, points in read_scalars(tmp_path / "run").items()}
    # The log at step 2 holds step 1's overflow; the first after the resume (step 5) step 4's: not lost, not twice.
    assert logged["mpx/overflows"] == {2: 1.0, 5: 1.0, 8: 1.0}
    assert logged["mpx/skipped_steps"][8] == 3

