"""The metric readers attacked from the user's side, against a reference (``torch.amp.GradScaler`` on the same
injected overflows): TensorBoard curves across resumes into and out of runs without a logger, checkpoints whose
``metric_readers`` a user wrote by hand, odd reader names through ``torch.load(weights_only=True)``, the docs' recipe
on two DDP ranks, and a long run of tiny steps read every step."""

from __future__ import annotations

import gc
import io
import math
import shutil
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_mpx import Amp

INIT, GROWTH = 2.0**10, 3


# -- the core engine ---------------------------------------------------------------------------------------------
def _engine(**settings: Any) -> tuple[Amp, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    amp = Amp("O1", half_dtype="bfloat16", loss_scale="dynamic", **{"skip_on_device": False, **settings})
    model = amp.prepare_model(nn.Linear(8, 2))
    return amp, model, amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))


def _steps(amp: Amp, model: nn.Module, optimizer: torch.optim.Optimizer, infs: list[bool]) -> None:
    for inf in infs:
        with amp.forward_context():
            loss = model(torch.randn(4, 8)).float().pow(2).mean() * (float("inf") if inf else 1.0)
        amp.backward(loss)
        amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()


@pytest.mark.parametrize(
    "readers",
    [
        {3: {"mpx/overflows": 1}},  # a name Amp.metrics() refuses: the next state_dict() raised a KeyError
        {"": {"mpx/overflows": 1}},
        {"x": {3: 1}},  # a count that is not a metric's name: the next metrics() raised
        {"x": {"mpx/overflows": math.nan}},  # raised only after the scale was loaded
        {"x": {"mpx/overflows": math.inf}},
        {"x": {"mpx/overflows": 0.5}},
        {"x": {"mpx/overflows": 1e30}},  # loaded, then every state_dict() raised (int too big to convert)
    ],
    ids=["int-name", "empty-name", "int-count", "nan", "inf", "fraction", "huge"],
)
def test_hand_written_metric_readers_are_refused_before_anything_is_loaded(readers):
    amp, model, optimizer = _engine()
    _steps(amp, model, optimizer, [True, True])
    state = amp.state_dict()
    fresh, _, _ = _engine()
    before = fresh.state_dict()
    with pytest.raises(TypeError, match="metric_readers entry"):
        fresh.load_state_dict({**state, "metric_readers": readers})
    after = fresh.state_dict()  # still saves: nothing was taken
    assert after["scalers"] == before["scalers"] and after["metric_readers"] == before["metric_readers"]


def test_odd_reader_names_survive_a_weights_only_load_and_count_what_they_had_not_read():
    names = ["a/b", "x\0y", "\0", "log\0mpx/overflows", "é" * 300]
    amp, model, optimizer = _engine()
    _steps(amp, model, optimizer, [True, False])
    assert [float(amp.metrics(name)["mpx/overflows"]) for name in names] == [1.0] * len(names)
    _steps(amp, model, optimizer, [True])  # read by none of them before the save
    buffer = io.BytesIO()
    torch.save(amp.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    resumed, _, _ = _engine()
    resumed.load_state_dict(state)
    assert [float(resumed.metrics(name)["mpx/overflows"]) for name in names] == [1.0] * len(names)
    assert resumed.metrics("default")["mpx/skipped_steps"] == 2


def test_a_long_run_read_every_step_keeps_no_gradient_graph_or_growing_position():
    amp, model, optimizer = _engine(on_floor="continue", growth_interval=5)
    losses = []

    def run(steps: int) -> None:
        for i in range(steps):
            with amp.forward_context():
                loss = model(torch.randn(2, 8)).float().pow(2).mean() * (math.inf if i % 7 == 3 else 1.0)
            losses.append(weakref.ref(loss))
            amp.backward(loss)
            amp.clip_grad_norm_(optimizer, 1.0)  # a gradient norm each step: MetricsReader.norms holds them
            amp.step(optimizer)
            amp.update()
            optimizer.zero_grad()
            amp.metrics()
            amp.metrics("log")
            del loss

    def tensors() -> int:
        gc.collect()
        return sum(1 for obj in gc.get_objects() if torch.is_tensor(obj))

    run(50)
    alive, sizes = tensors(), [(len(r.counts), len(r.norms)) for r in amp._overflows.readers.values()]
    run(250)
    # Nothing kept per step (norms, positions, graphs). At most as many: under xdist the worker's earlier test files
    # may leave garbage that a collection here frees, so the count can only be bounded, not pinned.
    assert tensors() <= alive
    assert [(len(r.counts), len(r.norms)) for r in amp._overflows.readers.values()] == sizes == [(2, 1), (2, 1)]
    assert not any(ref() is not None for ref in losses)  # no loss graph kept alive by a reader
    assert float(amp.metrics("late")["mpx/overflows"]) == amp.metrics()["mpx/skipped_steps"] == 43


# -- the Trainer, read back from TensorBoard ------------------------------------------------------------------------
pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402

from lightning_mpx import MixedPrecisionPlugin  # noqa: E402
from lightning_mpx.health.plot import read_scalars  # noqa: E402
from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer  # noqa: E402
from tests.test_hostile_telemetry import reference  # noqa: E402


def _fit_in_segments(tmp: Path, segments: list[tuple[int, int | None, int]], inject: set[int], optimizer: str
                     ) -> dict[str, dict[int, float]]:
    """Fit up to each segment's ``(max_steps, log_every_n_steps or None: no logger, checkpoint every)``, each
    resumed from the one before's last checkpoint; the TensorBoard curves of every segment's log."""
    data = loader(classification_data(n=16 * 20))
    resume = None
    for i, (steps, every, checkpoint_every) in enumerate(segments):
        checkpoint = ModelCheckpoint(dirpath=str(tmp / f"ck{i}"), save_last=True, every_n_train_steps=checkpoint_every)
        logger = TensorBoardLogger(str(tmp), name="run", version=0) if every else False
        plugin = MixedPrecisionPlugin("O1", half_dtype="float16", init_scale=INIT, growth_interval=GROWTH)
        trainer = make_trainer(plugin, max_steps=steps, logger=logger, log_every_n_steps=every or 1,
                               enable_checkpointing=True, callbacks=[checkpoint])
        trainer.fit(Classifier(inject_inf_at=tuple(inject), optimizer=optimizer), data, ckpt_path=resume)
        resume = str(tmp / f"ck{i}" / "last.ckpt")
    return {tag: dict(points) for tag, points in read_scalars(tmp / "run" / "version_0").items()}


@pytest.mark.parametrize(
    "segments,optimizer",
    [
        # A run without a logger resumed into one that logs: its first log held none of the saved run's overflows
        # (0 where mpx/skipped_steps said 3): a reader the checkpoint did not hold counted from the loaded totals.
        ([(7, None, 7), (12, 3, 12)], "sgd"),
        # The reverse, twice resumed, into another log_every_n_steps, skipped on the device: the run without a logger
        # is in the next log.
        ([(5, 4, 5), (9, None, 9), (12, 3, 12)], "adamw_fused"),
    ],
    ids=["no-logger-then-logger", "logger-no-logger-logger-skip_on_device"],
)
def test_logged_overflows_sum_to_the_reference_across_runs_without_a_logger(tmp_path, segments, optimizer):
    inject = {1, 4, 6, 8, 10}
    logged = _fit_in_segments(tmp_path, segments, inject, optimizer)
    scales, skipped = reference(inject, segments[-1][0])
    at = sorted(logged["mpx/overflows"])
    bounds = [-1, *at]
    expected = [float(len([s for s in skipped if lo < s <= hi])) for lo, hi in zip(bounds, bounds[1:])]
    assert [logged["mpx/overflows"][x] for x in at] == expected
    assert [logged["mpx/loss_scale"][x] for x in at] == [scales[x] for x in at]
    assert [logged["mpx/skipped_steps"][x] for x in at] == [float(len([s for s in skipped if s <= x])) for x in at]
    assert sum(logged["mpx/overflow/net.0"].values()) == len([s for s in skipped if s <= at[-1]])
    shutil.rmtree(tmp_path)


# -- DDP: the docs' recipe on two ranks ------------------------------------------------------------------------------
def test_ddp_recipe_ranks_agree_with_the_reference_and_nothing_hangs(tmp_path):
    from tests.launch import rank_results, run_script

    run_script("hostile_readers_ddp_script.py", tmp_path, timeout=120, OMP_NUM_THREADS="1")
    scales, skipped = reference({2, 3, 6}, 8)
    ranks = rank_results(tmp_path)
    expected = {str(s): [scales[s], float(s in skipped)] for s in range(8)}
    assert ranks[0]["seen"] == ranks[1]["seen"] == expected  # callback_metrics, per step, on each rank
    assert ranks[0]["best"] == ranks[1]["best"] == max(scales) and ranks[0]["stopped"] == ranks[1]["stopped"] is False
    logged = {tag: dict(points) for tag, points in read_scalars(tmp_path / "run" / "version_0").items()}
    assert logged["mpx/overflows"] == {3: 2.0, 7: 1.0} and logged["mpx/loss_scale"] == {3: scales[3], 7: scales[7]}
