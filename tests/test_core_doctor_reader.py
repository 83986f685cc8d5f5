"""review67b: what ``lightning-mpx doctor``/``plot`` report about a run, attacked from the user's side after stop 67's
reader (``health/events.py``): the verdicts against the run's own facts (the steps the optimizer skipped, the scale)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Collection

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("tensorboard")
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.loggers import TensorBoardLogger as FabricTensorBoardLogger  # noqa: E402

from lightning_mpx import FabricMixedPrecisionPlugin  # noqa: E402
from lightning_mpx.cli import main  # noqa: E402
from lightning_mpx.health.plot import read_scalars  # noqa: E402


def _doctor(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    """``lightning-mpx doctor RUN_DIR --json``: the exit status and the report (``{"error": stderr}`` without one)."""
    status = main(["doctor", str(run_dir), "--json"])
    out, err = capsys.readouterr()
    return status, (json.loads(out) if out else {"error": err})


def _fabric_run(
    root: Path,
    version: int,
    steps: int,
    inf_from: int | None,
    logged: Collection[int] | None = None,
    batch_tag: str | None = None,
    suffix: str = "",
    save: Path | None = None,
    load: Path | None = None,
    prefix: str = "",
) -> list[float]:
    """docs/fabric.md's loop at O1 float16 logging ``mpx.metrics()`` at its step (every step, or the steps in
    ``logged``) into ``root/run/version_<version>``; every loss inf from step ``inf_from`` on (the scale falls to its
    floor, every step skipped). ``batch_tag``: after each 5 steps a validation loop logs its loss at its batch index
    (0-2), through the logger (``"logger"``) or the user's own ``SummaryWriter`` in the logger's folder (``"own"``).
    ``save``/``load``: ``fabric.save``/``fabric.load`` of the model, optimizer, plugin and step after/before the loop
    (a resumed run goes on from the saved step). ``prefix``: the logger's (``train-mpx/loss_scale``). Returns the
    skipped-step totals after each step (the run's facts)."""
    mpx = FabricMixedPrecisionPlugin("O1", half_dtype="float16", init_scale=4.0, on_floor="continue")
    logger = FabricTensorBoardLogger(str(root), name="run", version=version, prefix=prefix)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx], loggers=[logger])
    own = None
    if batch_tag == "own":
        from torch.utils.tensorboard import SummaryWriter

        own = SummaryWriter(logger.log_dir, filename_suffix=".user")
    torch.manual_seed(0)
    model = fabric.setup_module(nn.Linear(4, 2))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.01))
    state = {"model": model, "optimizer": optimizer, "mpx": mpx, "step": 0}
    if load is not None:
        fabric.load(str(load), state)
    skipped = []
    for step in range(state["step"], steps):
        loss = model(torch.randn(2, 4)).square().mean()
        fabric.backward(loss * (float("inf") if inf_from is not None and step >= inf_from else 1.0))
        optimizer.step()
        optimizer.zero_grad()
        skipped.append(float(mpx.amp.skipped_steps[0]))
        if logged is None or step in logged:
            fabric.log_dict({f"{k}{suffix}": v for k, v in mpx.metrics().items()}, step=step)
        if batch_tag and step % 5 == 4:
            for index in range(3):  # validation: its own count, from 0 each time
                if own is not None:
                    own.add_scalar("val/batch_loss", 0.5, index)
                else:
                    fabric.log("val/batch_loss", 0.5, step=index)
    if own is not None:
        own.close()
    if save is not None:
        fabric.save(str(save), {**state, "step": steps})
    logger.finalize("success")
    return skipped


# -- a tag counting its own steps is no restart of the run -------------------------------------------------------------
@pytest.mark.parametrize("batch_tag", ["logger", "own"])
def test_a_validation_tag_at_its_batch_index_leaves_the_runs_points(tmp_path, capsys, batch_tag):
    # A collapse from step 3 on (40 steps, each logged), a validation loop logging its loss at its batch index 0-2
    # after each 5 steps, through Fabric's logger or a SummaryWriter of the user's in the same folder. Each validation
    # went back to step 0: read as a restart of the run, it left the last 5 steps: "healthy" (9 overflow steps in 9,
    # too few to persist) about a run that skipped 37 of its 40 steps.
    facts = _fabric_run(tmp_path, 0, 40, inf_from=3, batch_tag=batch_tag)
    status, report = _doctor(tmp_path / "run" / "version_0", capsys)
    assert status == 1 and report["steps"] == [0, 39]
    (finding,) = [f for f in report["findings"] if f["problem"]]
    assert finding["kind"] == "persistent_overflow" and finding["since_step"] == 3
    assert finding["evidence"][0].startswith(f"{facts[-1]:g} of the 37 steps 3-39 overflowed")
    assert f"skipped steps: {facts[-1]:g} at step 39, 0 before step 3" in finding["evidence"]
    assert not any("went back" in note for note in report["notes"])  # no restart
    scalars = read_scalars(tmp_path / "run" / "version_0")
    assert [v for _, v in scalars["mpx/skipped_steps"]] == facts  # what the plot draws
    assert [s for s, _ in scalars["val/batch_loss"]] == [0, 1, 2]  # the tag's own last count


def test_trainer_validate_after_fit_keeps_the_fits_points(tmp_path, capsys):
    # trainer.fit, then trainer.validate into the same TensorBoardLogger: validate's step-level val_loss starts at
    # step 0 again. Read as a restart, every mpx/* point went: "holds no mpx/* scalars", exit 2, after a collapse.
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_mpx import MixedPrecisionPlugin
    from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer

    class ValidatedClassifier(Classifier):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self._step(batch, "val"), on_step=True, on_epoch=False)

    plugin = MixedPrecisionPlugin("O1", half_dtype="float16", init_scale=4.0, on_floor="continue")
    model = ValidatedClassifier(inject_inf_at=tuple(range(2, 100)))
    trainer = make_trainer(plugin, max_epochs=2, log_every_n_steps=1, logger=TensorBoardLogger(tmp_path, name="run"))
    val = loader(classification_data(n=8, seed=1), batch_size=4)
    trainer.fit(model, loader(classification_data(n=28), batch_size=4), val)
    trainer.validate(model, val, verbose=False)
    skipped = plugin.amp.skipped_steps[0]
    status, report = _doctor(tmp_path / "run", capsys)
    assert status == 1 and report["steps"] == [0, trainer.global_step - 1] == [0, 13]
    (finding,) = [f for f in report["findings"] if f["problem"]]
    assert finding["kind"] == "persistent_overflow" and finding["since_step"] == 2
    assert finding["evidence"][0].startswith(f"{skipped:g} of the 12 steps 2-13 overflowed") and skipped == 12
    assert [s for s, _ in read_scalars(tmp_path / "run")["val_loss"]] == [0, 1]  # validate's own points


# -- a count logged twice at one step ---------------------------------------------------------------------------------
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_accelerator_log_twice_a_step_keeps_the_overflows(tmp_path, capsys):
    # Accelerate's habit: accelerator.log({"train_loss": ...}) and accelerator.log({"eval_loss": ...}) at the same
    # step; each call adds the mpx/* metrics, the second's overflows since the first (0). The later point alone was
    # kept: "0 overflow steps in 12", healthy, for a run that skipped every step.
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

    accelerator = Accelerator(
        mixed_precision="O1", log_with="tensorboard", project_dir=str(tmp_path),
        kwargs_handlers=[MixedPrecisionKwargs(half_dtype="float16", init_scale=4.0, on_floor="continue")],
    )  # fmt: skip
    accelerator.init_trackers("run")
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    for step in range(12):
        accelerator.backward(model(torch.randn(2, 4)).square().mean() * float("inf"))
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"train_loss": 1.0}, step=step)
        accelerator.log({"eval_loss": 1.0}, step=step)
    skipped = accelerator.amp.skipped_steps[0]
    accelerator.end_training()
    logged = read_scalars(tmp_path / "run")
    assert [v for _, v in logged["mpx/overflows"]] == [1.0] * 12 and skipped == 12
    status, report = _doctor(tmp_path / "run", capsys)
    assert status == 1
    (finding,) = [f for f in report["findings"] if f["problem"]]
    assert finding["evidence"][0].startswith("12 of the 12 steps 0-11 overflowed")


# -- which run the user is told about ----------------------------------------------------------------------------------
def _shift_wall_times(folder: Path, seconds: float) -> None:
    """The folder's event files as written on a machine whose clock was ``seconds`` ahead (copied here since)."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto import event_pb2
    from torch.utils.tensorboard.writer import FileWriter

    for path in list(folder.glob("events.out.tfevents.*")):
        events = [event_pb2.Event.FromString(record) for record in RawEventFileLoader(str(path)).Load()]
        path.unlink()
        writer = FileWriter(str(folder))
        for event in events:
            event.wall_time += seconds
            writer.add_event(event)
        writer.close()


@pytest.mark.parametrize("latest", ["healthy", "collapsed"])
def test_version_1_is_the_run_told_about_whatever_the_clocks(tmp_path, capsys, latest):
    # version_0 ran on a machine whose clock was an hour ahead, version_1 (the user's next run, from step 0) here.
    # Read by wall time, version_0 came last: the doctor judged it, the old run (exit 1 for a healthy latest run).
    _fabric_run(tmp_path, 0, 12, inf_from=0 if latest == "healthy" else None)
    facts = _fabric_run(tmp_path, 1, 12, inf_from=0 if latest == "collapsed" else None)
    _shift_wall_times(tmp_path / "run" / "version_0", 3600.0)
    status, report = _doctor(tmp_path / "run", capsys)
    assert status == (latest == "collapsed")
    assert any("went back from 11 to 0" in note and "version_1" in note for note in report["notes"])
    assert [v for _, v in read_scalars(tmp_path / "run")["mpx/skipped_steps"]] == facts


def test_mpx_tags_under_a_rank_suffix_are_refused_not_called_healthy(tmp_path, capsys):
    # A loop logging {f"{k}/rank0": v}: no mpx/loss_scale, so nothing was judged; the doctor said "healthy", exit 0,
    # for a run that skipped every step.
    _fabric_run(tmp_path, 0, 12, inf_from=0, suffix="/rank0")
    status, report = _doctor(tmp_path / "run" / "version_0", capsys)
    assert status == 2
    error = report["error"]
    assert "no mpx/loss_scale" in error and "mpx/loss_scale/rank0" in error


def test_irregular_logging_every_step_then_every_tenth_counts_each_interval(tmp_path, capsys):
    # Held: a loop logging every step for 10 steps, then every 10th; a collapse from step 26. Each count covers the
    # steps since the previous log: the interval 20-29 overflowed on 4 of its 10 steps, not most.
    logged = {s for s in range(60) if s < 10 or s % 10 == 9}
    facts = _fabric_run(tmp_path, 0, 60, inf_from=26, logged=logged)
    status, report = _doctor(tmp_path / "run" / "version_0", capsys)
    assert status == 1
    (finding,) = [f for f in report["findings"] if f["problem"]]
    assert finding["since_step"] == 30 and facts[-1] == 34
    assert finding["evidence"][0].startswith("30 of the 30 steps 30-59 overflowed")


def test_a_resumed_runs_persistent_overflow_does_not_say_none_were_skipped_before(tmp_path, capsys):
    # A run collapses at step 2 and is saved after 12 steps; the resumed run (TensorBoardLogger's next version) goes
    # on from step 12. Its first point covers one interval (attack67c), so the overflow dates from step 12, and the
    # doctor said "skipped steps: 22 at step 23, 0 before step 12": 10 were, its own first point says 11.
    before = _fabric_run(tmp_path, 0, 12, inf_from=2, save=tmp_path / "c.ckpt")
    facts = _fabric_run(tmp_path, 1, 24, inf_from=0, load=tmp_path / "c.ckpt")
    assert before[-1] == 10 and facts[-1] == 22
    status, report = _doctor(tmp_path / "run" / "version_1", capsys)
    assert status == 1 and report["steps"] == [12, 23]
    (finding,) = [f for f in report["findings"] if f["problem"]]
    assert finding["since_step"] == 12 and finding["evidence"][0].startswith("12 of the 12 steps 12-23")
    assert "skipped steps: 22 at step 23" in finding["evidence"]  # not ", 0 before step 12"


def test_a_loggers_prefix_is_read_and_its_restart_purges(tmp_path, capsys):
    # TensorBoardLogger(prefix="train") logs train-mpx/loss_scale: the doctor said "holds no mpx/* scalars", exit 2.
    # Here a collapsed run, then a healthy one from step 0 in the same folder: judged on the healthy one, the collapsed
    # run's train-mpx/overflow/_root left out with the rest (it was kept: a tag the new run does not log).
    _fabric_run(tmp_path, 0, 14, inf_from=0, prefix="train")
    facts = _fabric_run(tmp_path, 0, 6, inf_from=None, prefix="train")
    status, report = _doctor(tmp_path / "run" / "version_0", capsys)
    assert status == 0 and report["steps"] == [0, 5]
    assert any("went back from 13 to 0" in note for note in report["notes"])
    assert any("logged as train-mpx/*" in note for note in report["notes"])
    scalars = read_scalars(tmp_path / "run" / "version_0")  # what the plot draws
    assert [v for _, v in scalars["mpx/skipped_steps"]] == facts == [0.0] * 6
    assert "mpx/overflow/_root" not in scalars


def test_a_resumed_run_of_two_logged_points_is_judged_on_its_steps(tmp_path, capsys):
    # Resumed at step 10 in its own folder, logging every 5th step (14, 19), every step skipped. Two points: the first
    # was taken to cover steps 0-14, 5 overflows in 15 steps, not most; "10 overflow steps in 20", healthy, for a run
    # that skipped each of its 10 steps.
    logged = {s for s in range(20) if s % 5 == 4}
    _fabric_run(tmp_path, 0, 10, inf_from=None, logged=logged, save=tmp_path / "c.ckpt")
    facts = _fabric_run(tmp_path, 1, 20, inf_from=0, logged=logged, load=tmp_path / "c.ckpt")
    assert facts == [float(n) for n in range(1, 11)]
    status, report = _doctor(tmp_path / "run" / "version_1", capsys)
    assert status == 1 and report["steps"] == [14, 19]
    (finding,) = [f for f in report["findings"] if f["problem"]]
    assert finding["since_step"] == 10 and finding["evidence"][0].startswith("10 of the 10 steps 10-19 overflowed")


def test_a_fresh_run_of_two_logged_points_counts_its_first_interval_from_zero(tmp_path, capsys):
    # Logged at step 9 and at its last, 12: one gap of 3 says nothing of the first point's interval, whose count (10
    # overflows) says it covered at least 10 steps. Every step overflowed: "13 of the 13 steps 0-12".
    facts = _fabric_run(tmp_path, 0, 13, inf_from=0, logged={9, 12})
    status, report = _doctor(tmp_path / "run" / "version_0", capsys)
    assert status == 1 and facts[-1] == 13
    (finding,) = [f for f in report["findings"] if f["problem"]]
    assert finding["since_step"] == 0 and finding["evidence"][0].startswith("13 of the 13 steps 0-12 overflowed")


# -- part 2: a parameter held by several optimizers at O1 float16 (shared67's fix), against FP32 ---------------------
def _three(net: nn.Sequential, fused: bool = False) -> list[torch.optim.Optimizer]:
    """Three optimizers over partly overlapping parameters: the first layer's weight and the head's; the head's own
    (weight and bias, with momentum); the two biases."""
    groups = ([net[0].weight, net[2].weight], [net[2].weight, net[2].bias], [net[0].bias, net[2].bias])
    if fused:
        return [torch.optim.AdamW(params, lr=1e-2, fused=True) for params in groups]
    return [
        torch.optim.SGD(groups[0], lr=0.05),
        torch.optim.SGD(groups[1], lr=0.3, momentum=0.9),
        torch.optim.SGD(groups[2], lr=0.1, momentum=0.5),
    ]


def _three_run(habit: str, level: str | None) -> list[torch.Tensor]:
    """Two accumulated backwards, then each optimizer (clipped first with ``"clip"``) steps; the first zeroes its
    gradients between (zeros at the overflow step, ``set_to_none`` at the others) with ``"zero"``; with
    ``"overflow"`` an inf in the shared head weight's gradient at step 1: FP32's reference skips the optimizers
    holding it (only the first with ``"zero"``: its zero_grad cleared it for the second), the third steps."""
    from lightning_mpx import Amp
    from tests.test_core_shared_params_o1 import _batch, _net

    net = _net()
    optimizers = _three(net, fused="fused" in habit)
    amp = None
    if level is not None:
        amp = Amp(opt_level=level, half_dtype="float16", **({"skip_on_device": True} if "fused" in habit else {}))
        net = amp.prepare_model(net)
        optimizers = [amp.prepare_optimizer(o) for o in optimizers]
    for step in range(3):
        for micro in range(2):
            x, y = _batch(10 * step + micro)
            if amp is None:
                (F.cross_entropy(net(x), y) / 2).backward()
                continue
            with amp.forward_context():
                loss = F.cross_entropy(net(amp.cast_inputs(x)).float(), y)
            amp.backward(loss / 2)
        over = "overflow" in habit and step == 1
        if over and amp is not None:
            net[2].weight.grad[0, 0] = float("inf")
        for i, optimizer in enumerate(optimizers):
            skip = over and amp is None and i in ((0,) if "zero" in habit else (0, 1))
            if "clip" in habit and not skip:
                if amp is None:
                    torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 0.05)
                else:
                    amp.clip_grad_norm_(optimizer, 0.05)
            if not skip:
                optimizer.step() if amp is None else amp.step(optimizer)
            if "zero" in habit and i == 0:
                optimizer.zero_grad(set_to_none=step != 1)
        if amp is not None:
            amp.update()
        for optimizer in optimizers:
            optimizer.zero_grad()
    return [p.detach().float().clone() for p in net.parameters()]


@pytest.mark.parametrize("habit", ["clip_zero", "clip_overflow", "zero_overflow", "fused_clip_overflow"])
def test_three_optimizers_partly_overlapping_train_as_fp32(habit):
    # Held: accumulated backwards, a clip before each step, a zero_grad of one between, an inf in the shared
    # gradient (the optimizers holding it skip, the other steps with its clean gradients), fused AdamW skipping on
    # the device.
    for got, want in zip(_three_run(habit, "O1"), _three_run(habit, None), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-3)


@pytest.mark.parametrize("door", ["amp", "fabric"])
def test_torch_clip_after_the_unscale_of_a_shared_head_trains_as_fp32(door):
    # GradScaler's habit, amp.unscale_ then torch's clip_grad_norm_ before each step (fabric.clip_gradients does the
    # same): the clip's write of the shared head's gradients was taken for a backward's, and the head's own unscale
    # divided them by the scale again: ~2e-2 off FP32.
    from lightning_mpx import Amp
    from tests.test_core_shared_params_o1 import _batch, _fp32, _net, _optimizers, _params

    net = _net()
    whole, head = _optimizers(net, "clip")
    if door == "fabric":
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[FabricMixedPrecisionPlugin("O1", half_dtype="float16")])
        model, whole, head = fabric.setup(net, whole, head)
    else:
        amp = Amp(opt_level="O1", half_dtype="float16")
        model = amp.prepare_model(net)
        whole, head = amp.prepare_optimizer(whole), amp.prepare_optimizer(head)
    for step in range(3):
        x, y = _batch(10 * step)
        if door == "fabric":
            fabric.backward(F.cross_entropy(model(x).float(), y))
        else:
            with amp.forward_context():
                amp.backward(F.cross_entropy(model(amp.cast_inputs(x)).float(), y))
        for optimizer in (whole, head):
            if door == "fabric":
                fabric.clip_gradients(model, optimizer, max_norm=0.1)  # the optimizer's own parameters
                optimizer.step()
            else:
                amp.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(_params(optimizer), 0.1)
                amp.step(optimizer)
        if door == "amp":
            amp.update()
        whole.zero_grad()
        head.zero_grad()
    for got, want in zip(net.parameters(), _fp32("clip"), strict=True):
        torch.testing.assert_close(got.detach().float(), want, rtol=0, atol=2e-3)


def test_a_backward_between_two_optimizers_steps_is_divided_at_the_next_unscale():
    # The whole model's optimizer steps on one batch; every gradient is zeroed in place (set_to_none=False) and a
    # second batch's backward feeds the head's own step. The head's gradient is the tensor the first unscale divided,
    # written by that backward: it holds scaled values, and is divided again (a clip's write is not a backward).
    from lightning_mpx import Amp
    from tests.test_core_shared_params_o1 import _batch, _net, _optimizers

    def run(level: str | None) -> list[torch.Tensor]:
        net = _net()
        whole, head = _optimizers(net, "plain")
        amp = Amp(opt_level=level, half_dtype="float16") if level else None
        if amp is not None:
            net = amp.prepare_model(net)
            whole, head = amp.prepare_optimizer(whole), amp.prepare_optimizer(head)
        for step in range(2):
            for optimizer, seed in ((whole, 10 * step), (head, 10 * step + 1)):
                x, y = _batch(seed)
                if amp is None:
                    F.cross_entropy(net(x), y).backward()
                    optimizer.step()
                else:
                    with amp.forward_context():
                        amp.backward(F.cross_entropy(net(amp.cast_inputs(x)).float(), y))
                    amp.step(optimizer)
                whole.zero_grad(set_to_none=False)
                head.zero_grad(set_to_none=False)
            if amp is not None:
                amp.update()
        return [p.detach().float().clone() for p in net.parameters()]

    for got, want in zip(run("O1"), run(None), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-3)
