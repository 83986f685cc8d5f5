"""``lightning-mpx doctor RUN_DIR`` and the plot's extra panels, on event files written as a run writes them."""

from __future__ import annotations

import json
import math
import runpy
from pathlib import Path

import matplotlib
import pytest
from torch.utils.tensorboard import SummaryWriter

from lightning_mpx.cli import main
from lightning_mpx.demo import DemoConfig, train
from lightning_mpx.health import doctor
from lightning_mpx.health.plot import plot_figure, plot_run, read_scalars

matplotlib.use("Agg")
STEPS = 120


def write_run(path: Path, series: dict[str, list[tuple[int, float]]]) -> Path:
    writer = SummaryWriter(str(path))
    for tag, points in series.items():
        for step, value in points:
            writer.add_scalar(tag, value, step)
    writer.close()
    return path


def dynamic_scale(overflow_steps: set[int], start: float = 2.0**16, growth: int = 25, floor: float = 1.0) -> dict:
    """The mpx tags of a dynamic scaler logged every step: halves on an overflow step (not below ``floor``), doubles
    after ``growth`` clean steps."""
    scale, clean, skipped = start, 0, 0
    series: dict[str, list[tuple[int, float]]] = {"mpx/loss_scale": [], "mpx/overflows": [], "mpx/skipped_steps": []}
    for step in range(STEPS):
        if step in overflow_steps:
            scale, clean, skipped = max(floor, scale / 2), 0, skipped + 1
        else:
            clean += 1
            if clean == growth:
                scale, clean = scale * 2, 0
        series["mpx/loss_scale"].append((step, scale))
        series["mpx/overflows"].append((step, float(step in overflow_steps)))
        series["mpx/skipped_steps"].append((step, float(skipped)))
    return series


def loss_curve(nan_from: int | None = None) -> list[tuple[int, float]]:
    return [(s, math.nan if nan_from is not None and s >= nan_from else 3.0 * 0.99**s) for s in range(STEPS)]


def telemetry(underflow: dict[str, float], headroom: dict[str, float]) -> dict:
    series = {}
    for group, value in underflow.items():
        series[f"mpx/underflow/{group}"] = [(s, value) for s in range(STEPS)]
    for group, value in headroom.items():
        series[f"mpx/headroom/{group}"] = [(s, value) for s in range(STEPS)]
    return series


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    made = {}
    made["healthy"] = write_run(
        root / "healthy",
        {
            **dynamic_scale({40, 90}),
            "train/loss": loss_curve(),
            # "embed": the rows of tokens not in the batch get exactly zero gradients (counted as underflow), but
            # its largest gradient is near the top of the range: not underflow to report.
            **telemetry(
                {"encoder": 0.02, "head": 0.01, "embed": 0.7}, {"encoder": 0.2, "head": 0.05, "embed": 2.0**-5}
            ),
            # A module that overflowed once, at the scaler's probing overflow: not persistent.
            "mpx/overflow/encoder": [(s, float(s == 40)) for s in range(STEPS)],
            # The logging step 90 overflowed: its headroom is inf.
            "mpx/headroom/head": [(s, math.inf if s == 90 else 0.05) for s in range(STEPS)],
        },
    )
    made["too_low"] = write_run(
        root / "too_low",
        {
            "mpx/loss_scale": [(s, 1.0) for s in range(STEPS)],
            "mpx/overflows": [(s, 0.0) for s in range(STEPS)],
            "mpx/skipped_steps": [(s, 0.0) for s in range(STEPS)],
            "train/loss": loss_curve(),
            **telemetry({"encoder": 0.93, "head": 0.71}, {"encoder": 2.0**-22, "head": 2.0**-19}),
        },
    )
    # Layer "boom" overflows in the forward from step 30: the scale halves down to its floor of 1 by step 46 and
    # stays there; every module's gradients are non-finite from then, "boom"'s first.
    overflowing = set(range(30, STEPS))
    made["overflow"] = write_run(
        root / "overflow",
        {
            **dynamic_scale(overflowing),
            "train/loss": loss_curve(nan_from=30),
            # As forensics logs them: a module's tag appears at its first overflow, and reports 0 when clean since.
            "mpx/overflow/boom": [(s, 1.0) for s in range(30, STEPS)],
            # An old blip, and two steps where its gradients were non-finite too: not a culprit.
            "mpx/overflow/encoder": [(s, float(s in (12, 60, 61))) for s in range(12, STEPS)],
        },
    )
    made["old_tags_overflow"] = write_run(
        root / "old_tags_overflow", {**dynamic_scale(overflowing), "train/loss": loss_curve()}
    )
    made["underflow"] = write_run(
        root / "underflow",
        {
            **dynamic_scale({60}),
            "train/loss": loss_curve(),
            **telemetry({"encoder": 0.01, "tiny": 0.84}, {"encoder": 0.4, "tiny": 2.0**-24}),
        },
    )
    made["promoted"] = write_run(
        root / "promoted",
        {
            **dynamic_scale(set(range(30, 50))),  # overflowed down to the floor, then "boom" ran in FP32
            "train/loss": loss_curve(),
            "mpx/overflow/boom": [(s, float(30 <= s < 50)) for s in range(STEPS)],
            "mpx/promoted/boom": [(s, float(s >= 50)) for s in range(STEPS)],
            # In FP32 its gradients do not underflow, however small: not judged.
            **telemetry({"boom": 1.0, "head": 0.0}, {"boom": 2.0**-30, "head": 0.3}),
        },
    )
    made["no_mpx"] = write_run(root / "no_mpx", {"train/loss": loss_curve()})
    return made


def run_doctor(run: Path, capsys, *flags: str) -> tuple[int, str]:
    status = main(["doctor", str(run), *flags])
    captured = capsys.readouterr()
    return status, captured.out + captured.err


def test_healthy_run(runs, capsys):
    status, out = run_doctor(runs["healthy"], capsys)
    assert status == 0, out
    assert "OK: healthy" in out and "diagnosis: healthy" in out
    assert "2 overflow steps in 120" in out  # the evidence
    assert "underflow at most 0.700 (group embed" in out
    assert "largest gradient 0.2 (2^-2.3) of the half maximum (group encoder, steps 90-119; 1 logged overflow" in out
    assert "PROBLEM" not in out


def test_static_scale_too_low(runs, capsys):
    status, out = run_doctor(runs["too_low"], capsys)
    assert status == 1, out
    diagnosis = doctor.diagnose(runs["too_low"])
    (finding,) = [f for f in diagnosis.findings if f.problem]
    assert finding.kind == "scale_too_low"
    assert finding.modules == ("encoder", "head")  # the heavier underflow first
    assert "never changed" in out and "0.930" in out
    # Largest headroom 2^-19; aiming at 2^-3 means 2^16 more.
    assert "loss_scale=65536" in finding.fix


def test_persistent_overflow_names_the_module_and_the_step(runs, capsys):
    status, out = run_doctor(runs["overflow"], capsys)
    assert status == 1, out
    assert "PROBLEM: persistent overflow in module boom since step 30" in out
    (finding,) = doctor.diagnose(runs["overflow"]).findings
    assert (finding.kind, finding.modules, finding.since_step) == ("persistent_overflow", ("boom",), 30)
    assert "unchanged since step 46" in out  # the floor (2^16 halved 16 times)
    assert "the forward already produces non-finite values" in out
    assert 'fp32_modules=["boom"]' in finding.fix


def test_old_tags_alone_still_find_the_overflow(runs, capsys):
    status, out = run_doctor(runs["old_tags_overflow"], capsys)
    assert status == 1, out
    (finding,) = doctor.diagnose(runs["old_tags_overflow"]).findings
    assert (finding.kind, finding.modules, finding.since_step) == ("persistent_overflow", (), 30)
    assert "no mpx/overflow/<module> scalars" in out
    assert "underflow (a scale that is too low) could not be judged" in out


def test_heavy_underflow_in_one_module(runs, capsys):
    status, out = run_doctor(runs["underflow"], capsys)
    assert status == 1, out
    assert "PROBLEM: heavy underflow in module tiny" in out
    (finding,) = doctor.diagnose(runs["underflow"]).findings
    assert finding.modules == ("tiny",) and 'fp32_modules=["tiny"]' in finding.fix
    assert "encoder" not in finding.summary


def test_promotion_that_healed_the_run_is_reported_and_healthy(runs, capsys):
    status, out = run_doctor(runs["promoted"], capsys)
    assert status == 0, out
    assert "INFO: running in FP32: boom" in out
    assert "mpx/promoted/boom: 1 since step 50; its gradients overflowed in 20 steps up to step 49, none after" in out


def test_json_output(runs, capsys):
    status, out = run_doctor(runs["overflow"], capsys, "--json")
    data = json.loads(out)
    assert status == data["exit_status"] == 1 and data["healthy"] is False
    (finding,) = data["findings"]
    assert finding["kind"] == "persistent_overflow" and finding["modules"] == ["boom"] and finding["since_step"] == 30
    assert data["steps"] == [0, STEPS - 1]
    status, out = run_doctor(runs["too_low"], capsys, "--json")
    assert [f["kind"] for f in json.loads(out)["findings"]] == ["scale_too_low"]
    status, out = run_doctor(runs["healthy"], capsys, "--json")
    assert status == 0 and json.loads(out)["findings"][0]["kind"] == "healthy"


def test_a_run_without_mpx_tags_exits_2(runs, tmp_path, capsys):
    status, out = run_doctor(runs["no_mpx"], capsys)
    assert status == 2
    assert "holds no mpx/* scalars (scalars found: train/loss)" in out
    status, out = run_doctor(tmp_path, capsys)
    assert status == 2 and "holds no TensorBoard event files" in out


def test_a_scale_still_climbing_is_not_a_problem():
    climbing = {
        "mpx/loss_scale": [(s, 2.0 ** (s // 10)) for s in range(STEPS)],
        "mpx/overflows": [(s, 0.0) for s in range(STEPS)],
        **telemetry({"encoder": 0.8}, {"encoder": 2.0**-20}),
    }
    diagnosis = doctor.diagnose_scalars(climbing)
    assert diagnosis.exit_status == 0
    assert [f.kind for f in diagnosis.findings] == ["healthy", "scale_climbing"]


def test_a_scale_backing_off_from_a_high_start_is_healthy():
    # A run of 8 steps that overflow while the scale halves from 2^24 to 2^16: the scaler doing its job.
    series = {tag: points[:8] for tag, points in dynamic_scale(set(range(8)), start=2.0**24).items()}
    assert series["mpx/overflows"] == [(s, 1.0) for s in range(8)]
    assert doctor.diagnose_scalars(series).exit_status == 0


def test_a_run_that_ends_while_its_scale_collapses_is_a_problem():
    # Overflows on every step from step 105: the scale halves each step and has not reached its floor at the end.
    series = dynamic_scale(set(range(105, STEPS)))
    scales = dict(series["mpx/loss_scale"])
    assert (scales[104], scales[119]) == (2.0**20, 2.0**5)
    (finding,) = doctor.diagnose_scalars(series).findings
    assert (finding.kind, finding.since_step) == ("persistent_overflow", 105)
    assert "the loss scale is collapsing" in finding.summary
    assert "loss scale falling: 1048576 (2^20) before step 105, 32 (2^5) at step 119" in finding.evidence[1]


def test_plot_adds_the_underflow_and_overflow_panels(runs, tmp_path):
    full = plot_figure({**read_scalars(runs["healthy"])})
    # scale, loss, underflow (+ its headroom twin axis), overflow by module
    assert len(full.axes) == 5
    assert {ax.get_title().split(" ")[0] for ax in full.axes} >= {"Loss", "Training", "Underflow", "Overflows"}
    old = plot_figure(read_scalars(runs["old_tags_overflow"]))
    assert len(old.axes) == 2
    overflow_only = plot_figure(read_scalars(runs["overflow"]))
    assert len(overflow_only.axes) == 3
    png = plot_run(runs["healthy"], tmp_path / "healthy.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_real_lightning_run_is_diagnosed_healthy(tmp_path, capsys):
    result = train(
        DemoConfig(
            steps=12, dim=16, layers=1, batch_size=4, seq_len=16, val_batches=1, corpus_bytes=20_000,
            progress_bar=False, log_every_n_steps=2, run_dir=str(tmp_path / "demo"),
        )
    )  # fmt: skip
    status, out = run_doctor(Path(result.run_dir), capsys)
    assert status == 0, out
    assert "OK: healthy" in out and "loss scale 65536 (2^16) throughout" in out
    assert "INFO" not in out  # a dynamic scale that has not grown yet is no static scale to question


def test_the_example_overflow_run_is_diagnosed_from_its_events(tmp_path, capsys):
    # examples/scale_collapse.py's "overflow" setting: layer boom's activations pass float16's maximum from step 4,
    # the scale halves from 2^16 down to its floor of 1 and stays there (on_floor="continue").
    example = runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "scale_collapse.py"))
    row = example["train"]("overflow", tmp_path, steps=36, log_every=2, boom_at_step=4)
    assert row["final loss scale"] == 1.0 and row["skipped steps"] == 32
    status, out = run_doctor(Path(row["run dir"]), capsys)
    assert status == 1, out
    (finding,) = doctor.diagnose(row["run dir"]).findings
    assert finding.kind == "persistent_overflow" and finding.since_step == 4
    assert "the forward already produces non-finite values" in out
    # Every module's gradients went NaN; the forward watch armed at the floor names the one that overflowed first.
    assert finding.modules == ("boom",), out
    assert "mpx/overflow_first/boom: the first non-finite forward output" in out


def test_without_telemetry_a_low_constant_scale_is_pointed_out_but_not_a_problem(runs):
    # The too-low run as written before the underflow tags existed.
    old = {
        tag: points
        for tag, points in read_scalars(runs["too_low"]).items()
        if not tag.startswith(("mpx/underflow/", "mpx/headroom"))  # mpx/headroom_doublings/ and the older tag
    }
    diagnosis = doctor.diagnose_scalars(old)
    assert diagnosis.exit_status == 0
    assert [f.kind for f in diagnosis.findings] == ["healthy", "constant_scale"]
    assert "could not be judged" in diagnosis.notes[0]


def test_two_loss_scales_are_judged_each_on_its_own():
    healthy = dynamic_scale({40})
    collapsed = dynamic_scale(set(range(30, STEPS)))
    series = {f"{tag}/loss0": points for tag, points in healthy.items()}
    series.update({f"{tag}/loss1": points for tag, points in collapsed.items()})
    diagnosis = doctor.diagnose_scalars(series)
    (finding,) = diagnosis.findings
    assert (finding.kind, finding.loss, finding.since_step) == ("persistent_overflow", "/loss1", 30)
    assert finding.summary.endswith("(loss scale/loss1)")
    assert "mpx/overflows/loss1" in finding.evidence[0]


def test_several_runs_under_one_folder_are_pointed_out(runs, tmp_path, capsys):
    root = tmp_path / "runs"
    write_run(root / "version_0", dynamic_scale(set()))
    write_run(root / "version_1", dynamic_scale(set()))
    status, out = run_doctor(root, capsys)
    assert status == 0
    assert "note: RUN_DIR holds event files in 2 folders" in out
    _, out = run_doctor(root / "version_0", capsys)
    assert "folders" not in out


# -- exact zeros apart from underflow (mpx/zeros/<group>) ------------------------------------------------------------
def _zeros_run(scales: list[float], zeros: list[float], below: list[float], room: float) -> dict:
    """New-style telemetry of one group "enc" logged every step, with the loss scale each step was measured at."""
    steps = range(len(scales))
    return {
        "mpx/loss_scale": list(zip(steps, scales)),
        "mpx/overflows": [(s, 0.0) for s in steps],
        "mpx/underflow/enc": list(zip(steps, below)),
        "mpx/zeros/enc": list(zip(steps, zeros)),
        "mpx/headroom/enc": [(s, room) for s in steps],
    }


def test_zeros_that_fall_as_the_scale_grows_are_underflow():
    # The scale doubles every 10 steps from 1 to its ceiling of 8 and stays there; the zeros fall at every doubling
    # (values the half backward flushed) and 0.3 are left at the ceiling, beside 0.4 of subnormal values.
    scales = [2.0 ** min(s // 10, 3) for s in range(STEPS)]
    zeros = [{1.0: 0.8, 2.0: 0.6, 4.0: 0.4, 8.0: 0.3}[scale] for scale in scales]
    diagnosis = doctor.diagnose_scalars(_zeros_run(scales, zeros, [0.4] * STEPS, 2.0**-20))
    (finding,) = [f for f in diagnosis.findings if f.problem]
    assert finding.kind == "scale_too_low" and finding.modules == ("enc",)
    assert "mpx/zeros/enc: 0.300 exact zeros counted too (they fall as the scale grows" in finding.evidence[0]
    # The same zeros unchanged by the doublings are structural: 0.4 below tiny is not heavy underflow.
    diagnosis = doctor.diagnose_scalars(_zeros_run(scales, [0.3] * STEPS, [0.4] * STEPS, 2.0**-20))
    assert diagnosis.exit_status == 0
    assert any(
        "(group enc): unchanged at the last 3 scale change(s)" in line for line in diagnosis.findings[0].evidence
    )


def test_with_a_constant_scale_zeros_count_only_beside_subnormal_values():
    # bfloat16 with its default static scale of 1: an embedding's absent rows, and nothing near the bottom of the
    # range (the headroom of every bfloat16 gradient is tiny: 2^-130 here).
    structural = doctor.diagnose_scalars(_zeros_run([1.0] * STEPS, [0.76] * STEPS, [0.0] * STEPS, 2.0**-130))
    assert structural.exit_status == 0, structural.format()
    # float16 at a static scale too low: the non-zero values are mostly subnormal, so the zeros are flushed ones too.
    too_low = doctor.diagnose_scalars(_zeros_run([1.0] * STEPS, [0.4] * STEPS, [0.5] * STEPS, 2.0**-20))
    (finding,) = too_low.findings
    assert finding.kind == "scale_too_low" and "0.400 exact zeros counted too" in finding.evidence[0]


def test_plot_draws_zeros_beside_underflow(tmp_path):
    scales = [2.0 ** (s // 30) for s in range(STEPS)]
    run = write_run(tmp_path / "zeros", _zeros_run(scales, [0.76] * STEPS, [0.01] * STEPS, 2.0**-6))
    fig = plot_figure(read_scalars(run))
    (panel,) = [ax for ax in fig.axes if ax.get_title().startswith("Underflow")]
    lines = {line.get_label(): line for line in panel.get_lines()}
    assert set(lines) == {"enc underflow", "enc zeros"}
    assert lines["enc zeros"].get_linestyle() == ":" and lines["enc underflow"].get_linestyle() == "-"
    assert list(lines["enc zeros"].get_ydata()) == pytest.approx([0.76] * STEPS)
    assert "exact zeros (dotted)" in panel.get_title()


# -- real Lightning runs --------------------------------------------------------------------------------------------
import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402

from lightning_mpx import MixedPrecisionPlugin  # noqa: E402


class _Bag(pl.LightningModule):
    """An embedding of 512 rows read by batches of 16 distinct tokens (97% of the rows absent), then a classifier."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(512, 16)
        self.head = torch.nn.Linear(16, 4)

    def training_step(self, batch, batch_idx):
        tokens, y = batch
        return F.cross_entropy(self.head(self.embed(tokens).mean(1)).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Tiny(pl.LightningModule):
    """A classifier whose loss is weighted by ``weight``: its gradients sit low in float16's range."""

    def __init__(self, weight: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = weight
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh())
        self.head = torch.nn.Linear(32, 4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(self.body(x)).float(), y) * self.weight

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(module: pl.LightningModule, data: torch.utils.data.Dataset, run: Path, steps: int, **plugin: object) -> Path:
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, plugins=[MixedPrecisionPlugin("O1", **plugin)], max_steps=steps, max_epochs=-1,
        logger=TensorBoardLogger(str(run.parent), name=run.name, version=""), log_every_n_steps=2,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    return run


def _random_data(n: int) -> torch.utils.data.Dataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g))


def _bag_data() -> torch.utils.data.Dataset:
    g = torch.Generator().manual_seed(0)
    tokens = torch.stack([torch.randperm(16, generator=g)[:6] for _ in range(256)])  # tokens 0-15 only
    return torch.utils.data.TensorDataset(tokens, tokens.sum(1) % 4)


@pytest.mark.parametrize("scale", ["dynamic", "static"])
def test_absent_embedding_rows_are_zeros_not_underflow(tmp_path, capsys, scale):
    """bfloat16 at O1 with the embedding of a bag-of-words model: the rows absent from the batch have exactly zero
    gradients. They are reported as zeros, and the doctor does not call them underflow, whether the scale grows
    (dynamic, doubling every 4 steps) or stays at bfloat16's default static 1."""
    settings = {"loss_scale": "dynamic", "growth_interval": 4} if scale == "dynamic" else {}
    run = _fit(_Bag(), _bag_data(), tmp_path / "bag", 24, half_dtype="bfloat16", **settings)
    series = read_scalars(run)
    assert all(value > 0.95 for _, value in series["mpx/zeros/embed"])
    assert all(value == 0.0 for _, value in series["mpx/underflow/embed"])
    scales = [value for _, value in series["mpx/loss_scale"]]
    assert (scales[-1] >= 2.0**20) if scale == "dynamic" else set(scales) == {1.0}
    status, out = run_doctor(run, capsys)
    assert status == 0, out
    diagnosis = doctor.diagnose(run)
    assert not any("embed" in finding.modules for finding in diagnosis.findings), out
    assert "exact zeros at most 0.9" in out and "(group embed)" in out and "structural, not underflow" in out


def test_tiny_gradients_are_reported_as_subnormal_and_flagged(tmp_path, capsys):
    """float16 at a static scale of 1 with a loss weighted by 1e-4: the gradients are float16 subnormals."""
    data = _random_data(64)
    run = _fit(_Tiny(1e-4), data, tmp_path / "tiny", 6, half_dtype="float16", loss_scale=1.0)
    series = read_scalars(run)
    assert all(value > 0.8 for _, value in series["mpx/underflow/body"])  # not zero, below 2**-14
    status, out = run_doctor(run, capsys)
    assert status == 1, out
    (finding,) = doctor.diagnose(run).findings
    assert finding.kind == "scale_too_low" and set(finding.modules) == {"body", "head"}
    assert "below the half dtype's smallest normal and not zero" in out


def test_flushed_zeros_count_when_the_scale_cannot_grow_further(tmp_path, capsys):
    """float16, a loss weighted by 1e-7 and a dynamic scale capped at 4: the head's gradients are all flushed to zero
    at scales 1 and 2, about 60% still at 4, where the scale stops; the rest are subnormal. The zeros moved with the
    scale: underflow, and the doctor says the scale is too low (the body's gradients are all zero: flushed too)."""
    run = _fit(
        _Tiny(1e-7), _random_data(160), tmp_path / "flushed", 20, half_dtype="float16", init_scale=1.0,
        growth_interval=4, max_loss_scale=4.0,
    )  # fmt: skip
    series = read_scalars(run)
    zeros, below = [v for _, v in series["mpx/zeros/head"]], [v for _, v in series["mpx/underflow/head"]]
    assert zeros[0] == 1.0 and 0.3 < zeros[-1] < 0.9  # fell as the scale grew, and many are left
    assert below[-1] < 0.5  # the subnormal values alone are no heavy underflow
    status, out = run_doctor(run, capsys)
    assert status == 1, out
    (finding,) = doctor.diagnose(run).findings
    assert finding.kind == "scale_too_low" and set(finding.modules) == {"head", "body"}
    assert "mpx/zeros/head:" in out and "exact zeros counted too (they fall as the scale grows" in out
    assert "no gradient of the group is non-zero at any scale tried" in out  # the body
