"""Underflow and headroom telemetry: the three unscale backends against known answers and each other, the group rule,
the engine's request/metrics cycle, and user-side Lightning and Accelerate runs.

The Triton backend runs in triton's interpreter on CPU (conftest.py sets ``TRITON_INTERPRET=1`` without a GPU), with
small chunks (16 elements, blocks of 4) so that chunk and block boundaries fall inside the tensors.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp
from lightning_mpx.health.telemetry import GradTelemetry, module_groups
from lightning_mpx.scaling.unscale import GradStats, UnscaleWorkspace, unscale_grads_

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # numpy under the interpreter

_TRITON_DEVICE = None  # where the "triton" backend runs here: CPU tensors in the interpreter, else CUDA ones
if importlib.util.find_spec("triton") is not None:
    from lightning_mpx.scaling import triton_unscale as kernels

    _TRITON_DEVICE = "cpu" if kernels.interpreting() else "cuda" if torch.cuda.is_available() else None
BACKENDS = [
    "reference",
    "foreach",
    pytest.param("triton", marks=pytest.mark.skipif(_TRITON_DEVICE is None, reason="triton is not installed")),
]


def _workspace() -> UnscaleWorkspace:
    return UnscaleWorkspace(chunk_size=16, block_size=4, num_warps=1)


def _known(half: torch.dtype, src: torch.dtype) -> tuple[list[torch.Tensor], list[int], list[int], list[float]]:
    """Gradients (in ``src``) with a known number of elements below ``finfo(half).tiny``, of exact zeros (some of them
    ``-0.0``) and a known peak.

    Each tensor mixes exact zeros, values just below tiny (subnormal in the half dtype), tiny itself (a normal number:
    not underflow), ordinary values and one large value, in sizes that cross the 16-element chunks.
    """
    info = torch.finfo(half)
    tiny = info.tiny
    below = tiny / 2 if src == half else tiny * 0.75  # half-representable subnormal / an FP32 value below tiny
    large = {torch.float16: 3.0e4, torch.bfloat16: 2.0**100}[half]
    layouts = [  # (zeros, below, at tiny, ordinary, large value or None)
        (3, 5, 2, 7, large),  # 17 elements: one past a chunk
        (0, 0, 0, 1, None),  # one ordinary element
        (10, 20, 1, 6, -large / 4),  # 37 elements, the peak negative
        (0, 0, 0, 0, None),  # empty
        (16, 0, 0, 0, None),  # all zeros, exactly one chunk
    ]
    g = torch.Generator().manual_seed(0)
    grads, counts, zero_counts, peaks = [], [], [], []
    for zeros, small, at_tiny, ordinary, big in layouts:
        values = [0.0 * (-1) ** i for i in range(zeros)] + [below * (-1) ** i for i in range(small)] + [tiny] * at_tiny
        values += (torch.rand(ordinary, generator=g) + 0.5).tolist()
        if big is not None:
            values.append(big)
        order = torch.randperm(len(values), generator=g)
        tensor = torch.tensor(values, dtype=torch.float64)[order].to(src)
        grads.append(tensor)
        counts.append(zeros + small)
        zero_counts.append(zeros)
        peaks.append(float(tensor.double().abs().max()) if tensor.numel() else 0.0)
    return grads, counts, zero_counts, peaks


def _measure(backend, grads, half, *, out=None, max_norm=None):
    """Unscale with statistics on the backend's device; the statistics and flag come back on the CPU, and ``grads``
    and ``out`` (lists, changed in place) hold the unscaled values, also on the CPU."""
    device = _TRITON_DEVICE if backend == "triton" else "cpu"
    on_device = [g.to(device) for g in grads]
    out_device = None if out is None else [o.to(device) for o in out]
    stats = GradStats(torch.finfo(half).tiny)
    found = torch.zeros((), device=device)
    unscale_grads_(
        on_device, torch.tensor(2.0**-3, device=device), found, out=out_device, max_norm=max_norm, backend=backend,
        workspace=_workspace(), stats=stats,
    )
    grads[:] = [g.cpu() for g in on_device]
    if out is not None:
        out[:] = [o.cpu() for o in out_device]
    assert stats.underflow is not None and stats.zeros is not None and stats.peak is not None
    stats.underflow, stats.zeros, stats.peak = stats.underflow.cpu(), stats.zeros.cpu(), stats.peak.cpu()
    return stats, found.cpu()


CASES = [  # (half dtype, source dtype, unscale into FP32 masters)
    pytest.param(torch.float16, torch.float32, False, id="O1-fp16"),
    pytest.param(torch.float16, torch.float16, True, id="O2-fp16"),
    pytest.param(torch.bfloat16, torch.float32, False, id="O1-bf16"),
    pytest.param(torch.bfloat16, torch.bfloat16, True, id="O2-bf16"),
]


@pytest.mark.parametrize("max_norm", [None, 1.0], ids=["unscale", "clip"])
@pytest.mark.parametrize("half, src, master", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_measure_the_known_answer(backend, half, src, master, max_norm):
    grads, counts, zero_counts, peaks = _known(half, src)
    out = [torch.empty(g.shape) for g in grads] if master else None
    stats, found = _measure(backend, grads, half, out=out, max_norm=max_norm)
    assert stats.underflow is not None and stats.zeros is not None and stats.peak is not None
    assert stats.underflow.dtype == stats.zeros.dtype == torch.int64 and stats.peak.dtype == torch.float32
    assert stats.underflow.tolist() == counts
    assert stats.zeros.tolist() == zero_counts  # -0.0 included; subnormals, tiny and NaN not
    assert stats.peak.tolist() == pytest.approx(peaks, rel=1e-6)  # the peaks are exact in FP32
    assert float(found) == 0.0


@pytest.mark.parametrize("half, src, master", CASES)
@pytest.mark.parametrize("backend", ["foreach", *BACKENDS[2:]])
def test_backends_agree_with_the_reference_and_leave_the_unscale_alone(backend, half, src, master):
    """Random gradients over the whole range (and an inf and a NaN): same statistics as the reference, and the
    unscaled values, flag and norm are those of a call without statistics."""
    g = torch.Generator().manual_seed(1)
    exponents = torch.randint(-150, 20, (5, 41), generator=g).double()
    base = (torch.rand(5, 41, generator=g, dtype=torch.float64) + 0.5) * torch.exp2(exponents)
    base[1, 3], base[3, 7] = math.inf, math.nan
    base[2, :9] = 0.0

    def fresh():
        return [row.to(src) for row in base.clone()]

    grads_ref = fresh()
    ref, ref_found = _measure("reference", grads_ref, half, out=[torch.empty(41) for _ in range(5)] if master else None)
    grads = fresh()
    out = [torch.empty(41) for _ in range(5)] if master else None
    got, found = _measure(backend, grads, half, out=out)
    assert torch.equal(got.underflow, ref.underflow)
    assert torch.equal(got.zeros, ref.zeros) and got.zeros[2] >= 9  # row 2 starts with 9 zeros
    assert torch.equal(got.peak, ref.peak)
    assert got.peak[1] == math.inf and got.peak[3] == math.inf  # inf and NaN read as infinitely large
    assert float(found) == float(ref_found) == 1.0
    plain = fresh()
    plain_out = [torch.empty(41) for _ in range(5)] if master else None
    device = _TRITON_DEVICE if backend == "triton" else "cpu"
    plain = [g.to(device) for g in plain]
    plain_out = None if plain_out is None else [o.to(device) for o in plain_out]
    unscale_grads_(plain, torch.tensor(2.0**-3, device=device), torch.zeros((), device=device), out=plain_out,
                   backend=backend, workspace=_workspace())
    plain = [g.cpu() for g in plain]
    plain_out = None if plain_out is None else [o.cpu() for o in plain_out]
    for a, b in zip(out if master else grads, plain_out if master else plain):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_grad_stats_refuses_a_bad_threshold():
    with pytest.raises(ValueError, match="tiny=0"):
        GradStats(0)
    with pytest.raises(TypeError, match="stats=dict"):
        unscale_grads_([torch.ones(2)], torch.tensor(1.0), torch.zeros(()), stats={})  # type: ignore[arg-type]


# -- groups -----------------------------------------------------------------------------------------------------------
def test_module_groups_rule():
    names = ["encoder.layers.0.weight", "encoder.layers.0.bias", "decoder.proj.weight", "scale"]
    assert module_groups(names) == ["encoder", "encoder", "decoder", "scale"]
    # Lightning's `self.model` holding everything is a lone wrapper: the groups are one level down.
    wrapped = ["model.encoder.weight", "model.decoder.weight", "model.decoder.bias"]
    assert module_groups(wrapped) == ["model.encoder", "model.decoder", "model.decoder"]
    # The decision is taken on the whole model: an optimizer of the decoder alone keeps the decoder's own name.
    assert module_groups(["decoder.proj.weight"], all_names=names) == ["decoder"]


# -- the engine -------------------------------------------------------------------------------------------------------
class _TwoParts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def _train(amp: Amp, model: nn.Module, optimizers: list[torch.optim.Optimizer], factor: float = 1.0) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    with amp.forward_context():
        loss = amp.cast_outputs(model(amp.cast_inputs(x))).float().square().mean() * factor
    amp.backward(loss)
    for optimizer in optimizers:
        amp.step(optimizer)
    amp.update()
    for optimizer in optimizers:
        optimizer.zero_grad()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_amp_measures_only_requested_iterations(level):
    amp = Amp(level, init_scale=2.0**10, half_dtype="float16")
    model = amp.prepare_model(_TwoParts())
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    _train(amp, model, [optimizer])
    assert amp.telemetry.measurements == 0
    assert not any(k.startswith(("mpx/underflow", "mpx/headroom")) for k in amp.metrics())
    amp.request_telemetry()
    _train(amp, model, [optimizer])
    assert not amp.telemetry.requested  # update() ended the request
    metrics = amp.metrics()
    assert {k for k in metrics if k.startswith("mpx/underflow")} == {"mpx/underflow/body", "mpx/underflow/head"}
    assert {k for k in metrics if k.startswith("mpx/zeros")} == {"mpx/zeros/body", "mpx/zeros/head"}
    for group in ("body", "head"):
        underflow, zeros = metrics[f"mpx/underflow/{group}"], metrics[f"mpx/zeros/{group}"]
        headroom = metrics[f"mpx/headroom_doublings/{group}"]
        for value in (underflow, zeros, headroom):
            assert isinstance(value, torch.Tensor) and value.dim() == 0  # device tensors: no sync to build
        assert 0.0 <= float(underflow) + float(zeros) <= 1.0 and 0.0 < float(headroom) < math.inf
    _train(amp, model, [optimizer])
    assert amp.telemetry.measurements == 1
    assert not any(k.startswith("mpx/underflow") for k in amp.metrics())  # consumed by the previous call


def test_amp_values_match_a_direct_count():
    """The engine's per-group fractions (non-zero below tiny; exact zeros) and headroom are those of the scaled
    gradients counted by hand."""
    amp = Amp("O1", init_scale=2.0**4, growth_interval=10**6, half_dtype="float16")
    model = amp.prepare_model(_TwoParts())
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    with amp.forward_context():
        loss = model(x).float().square().mean() * 1e-4
    amp.backward(loss)
    tiny, top = torch.finfo(torch.float16).tiny, torch.finfo(torch.float16).max
    expected = {}
    for group, module in (("body", model.body), ("head", model.head)):
        scaled = torch.cat([p.grad.flatten() for p in module.parameters()])  # still scaled before the step
        below = ((scaled.abs() < tiny) & (scaled != 0)).double().mean().item()
        expected[group] = (below, (scaled == 0).double().mean().item(), math.log2(top / scaled.abs().max().item()))
    amp.request_telemetry()
    amp.step(optimizer)
    amp.update()
    metrics = amp.metrics()
    for group, (fraction, zeros, headroom) in expected.items():
        assert float(metrics[f"mpx/underflow/{group}"]) == pytest.approx(fraction, abs=1e-7)
        assert float(metrics[f"mpx/zeros/{group}"]) == pytest.approx(zeros, abs=1e-7)
        assert float(metrics[f"mpx/headroom_doublings/{group}"]) == pytest.approx(headroom, abs=1e-5)
    assert 0.0 < expected["body"][0] < 1.0 and 0.0 < expected["body"][1] < 1.0  # the case is not trivial


def test_amp_merges_optimizers_by_group():
    amp = Amp("O1", half_dtype="float16")
    model = amp.prepare_model(_TwoParts())
    body = amp.prepare_optimizer(torch.optim.SGD(model.body.parameters(), lr=0.01))
    head = amp.prepare_optimizer(torch.optim.SGD(model.head.parameters(), lr=0.01))
    amp.request_telemetry()
    _train(amp, model, [body, head])
    assert amp.telemetry.measurements == 2
    assert {k for k in amp.metrics() if k.startswith("mpx/headroom")} == {
        "mpx/headroom_doublings/body", "mpx/headroom_doublings/head"}


def test_telemetry_merge_sums_counts_and_takes_the_largest_peak():
    telemetry = GradTelemetry(torch.float16)
    a, b = torch.zeros(4, requires_grad=True), torch.zeros(6, requires_grad=True)
    a.grad, b.grad = torch.zeros(4), torch.zeros(6)
    names = {id(a): "enc.w", id(b): "enc.v", 0: "dec.w"}  # two top-level modules: no lone wrapper
    for key, param, under, zeros, peak in ((1, a, 1, 1, 2.0), (2, b, 3, 1, 5.0)):
        stats = telemetry.stats()
        stats.underflow, stats.zeros, stats.peak = torch.tensor([under]), torch.tensor([zeros]), torch.tensor([peak])
        telemetry.record(key, [param.grad], [param], names, stats)
    metrics = telemetry.metrics()
    assert float(metrics["mpx/underflow/enc"]) == pytest.approx(2 / 10)  # below tiny and not zero
    assert float(metrics["mpx/zeros/enc"]) == pytest.approx(2 / 10)
    assert float(metrics["mpx/headroom_doublings/enc"]) == pytest.approx(math.log2(65504.0 / 5.0), abs=1e-5)


# -- Lightning --------------------------------------------------------------------------------------------------------
pl = pytest.importorskip("lightning.pytorch")
from tests.lightning_helpers import RecordingLogger  # noqa: E402  (needs Lightning)


class _TinyGradients(pl.LightningModule):
    """A classifier whose loss is multiplied by 1e-6: its gradients sit below float16's smallest normal number until
    the loss scale has grown enough."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x).float(), y) * 1e-6

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Measurements(pl.Callback):
    """The batches in which the engine measured gradients."""

    def __init__(self) -> None:
        self.batches: list[int] = []
        self._seen = 0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        count = trainer.precision_plugin.amp.telemetry.measurements
        if count != self._seen:
            self.batches.append(trainer.global_step - 1)
            self._seen = count


def _tiny_run(logger: Any, steps: int, every: int) -> tuple[Any, _Measurements]:
    from lightning_mpx import MixedPrecisionPlugin

    plugin = MixedPrecisionPlugin("O1", half_dtype="float16", init_scale=1.0, growth_interval=2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(160, 16, generator=g)
    data = torch.utils.data.TensorDataset(x, (x @ torch.randn(16, 4, generator=g)).argmax(-1))
    measured = _Measurements()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, plugins=[plugin], logger=logger, log_every_n_steps=every, max_steps=steps,
        max_epochs=-1, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[measured],
    )
    trainer.fit(_TinyGradients(), torch.utils.data.DataLoader(data, batch_size=16))
    return plugin, measured


def test_lightning_logs_underflow_falling_as_the_scale_grows():
    logger = RecordingLogger()
    _, measured = _tiny_run(logger, steps=40, every=4)
    rows = [(step, m) for step, m in logger.logged if "mpx/underflow/model.0" in m]
    steps = [step for step, _ in rows]
    assert steps == [s for s in range(40) if (s + 1) % 4 == 0]  # every logging step, and only those
    # Telemetry was measured on the logging steps only: non-logging steps requested nothing.
    assert measured.batches == steps
    scales = [m["mpx/loss_scale"] for _, m in rows]
    assert scales == sorted(scales) and scales[-1] >= 2.0**15 * scales[0]  # the scale grew
    for group in ("model.0", "model.2"):
        # Below 2**-14: the non-zero values (subnormal in float16) and the zeros (most of them flushed at a low scale).
        zeros = [m[f"mpx/zeros/{group}"] for _, m in rows]
        under = [m[f"mpx/underflow/{group}"] + zero for (_, m), zero in zip(rows, zeros)]
        headroom = [m[f"mpx/headroom_doublings/{group}"] for _, m in rows]
        assert under[0] > 0.9  # at a scale of a few units almost every gradient is below 2**-14
        assert under[-1] < 0.05  # at 2**19 almost none
        assert all(later <= earlier + 0.02 for earlier, later in zip(under, under[1:]))
        assert headroom[-1] < headroom[0] - math.log2(1000) and headroom[-1] > 0  # 1000x nearer, short of the max
        # Tanh leaves no structural zeros: every zero here is a value flushed by the float16 backward, and the zeros
        # fall as the scale grows.
        assert zeros[0] > 0.1 and zeros[-1] == 0.0
        assert all(later <= earlier + 0.02 for earlier, later in zip(zeros, zeros[1:]))
    assert rows[0][1]["mpx/zeros/model.0"] > 0.5


def test_lightning_without_a_logger_measures_nothing():
    plugin, measured = _tiny_run(False, steps=6, every=1)
    assert measured.batches == [] and plugin.amp.telemetry.measurements == 0


# -- Accelerate -------------------------------------------------------------------------------------------------------
@pytest.fixture
def accelerate_state():
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _accelerate_run(steps: int, request_at: tuple[int, ...] = (), **settings: Any) -> list[dict[str, float]]:
    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

    accelerator = Accelerator(mixed_precision="O1", kwargs_handlers=[MixedPrecisionKwargs(**settings)])
    logged: list[dict[str, float]] = []
    tracker = type("T", (), {"name": "fake", "log": lambda self, values, step, **kw: logged.append(values)})()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = accelerator.prepare(model, opt)
    accelerator.trackers = [tracker]
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        if step in request_at:
            accelerator.request_mpx_telemetry()
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
        accelerator.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
        accelerator.log({"loss": 0.0}, step=step)
    return logged


def test_accelerate_telemetry_every_n_steps(accelerate_state):
    logged = _accelerate_run(7, telemetry_every_n_steps=3)
    measured = [step for step, values in enumerate(logged) if "mpx/underflow/0" in values]
    assert measured == [0, 3, 6]
    assert {"mpx/underflow/2", "mpx/headroom_doublings/0", "mpx/headroom_doublings/2", "loss"} <= set(logged[3])


def test_accelerate_explicit_request(accelerate_state):
    logged = _accelerate_run(4, request_at=(2,))
    assert [step for step, values in enumerate(logged) if "mpx/headroom_doublings/2" in values] == [2]


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_accelerate_refuses_a_bad_telemetry_interval(bad):
    pytest.importorskip("accelerate")
    from lightning_mpx.integrations.accelerate import MixedPrecisionKwargs

    with pytest.raises(ValueError, match="telemetry_every_n_steps"):
        MixedPrecisionKwargs(telemetry_every_n_steps=bad)


def test_accelerate_native_mode_refuses_a_request(accelerate_state):
    from lightning_mpx.integrations.accelerate import Accelerator

    with pytest.raises(ValueError, match="request_mpx_telemetry"):
        Accelerator(mixed_precision="no").request_mpx_telemetry()
