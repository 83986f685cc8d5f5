"""Lightning Fabric with ``FabricMixedPrecisionPlugin``: real ``Fabric`` loops on CPU, compared with Fabric's own
precisions ("32-true", "bf16-mixed", and "16-mixed" built by hand: on CPU ``precision="16-mixed"`` turns into
bfloat16) and with torch's own clipping."""

from __future__ import annotations

import copy
import json
import pickle
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.loggers import TensorBoardLogger
from lightning.fabric.plugins import MixedPrecision, Precision
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin, MixedPrecisionPlugin, doctor
from lightning_mpx.health.plot import plot_run, read_scalars
from tests.launch import run_script
from tests.lightning_helpers import Classifier

ROOT = Path(__file__).resolve().parents[1]
CASES = [(level, half) for level in ("O1", "O2", "O3") for half in ("bfloat16", "float16")]


# -- helpers -----------------------------------------------------------------------------------------------------------
def make_fabric(precision: str | Precision, **kwargs: Any) -> Fabric:
    if isinstance(precision, Precision):
        return Fabric(accelerator="cpu", devices=1, plugins=[precision], **kwargs)
    return Fabric(accelerator="cpu", devices=1, precision=precision, **kwargs)  # type: ignore[arg-type]


def hand_built_16_mixed() -> MixedPrecision:
    """Fabric's float16 AMP with its GradScaler, as Fabric builds it on a GPU (``precision="16-mixed"``)."""
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU())
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 4, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(16, 8, generator=g)
        out.append((x, (x @ w).argmax(-1)))
    return out


def setup_net(fabric: Fabric, optimizer: Any = torch.optim.SGD, late: bool = False, **settings: Any) -> tuple[Any, Any]:
    """``fabric.setup`` of a ``Net`` and an optimizer of class ``optimizer`` over its parameters (``late``:
    ``fabric.setup_module`` then ``fabric.setup_optimizers``: the plugin meets the optimizer at its first step)."""
    net = Net()
    settings.setdefault("lr", 0.1)
    if late:
        model = fabric.setup_module(net)
        return model, fabric.setup_optimizers(optimizer(net.parameters(), **settings))
    return fabric.setup(net, optimizer(net.parameters(), **settings))


def plugin_of(fabric: Fabric) -> FabricMixedPrecisionPlugin | None:
    precision = fabric.strategy.precision
    return precision if isinstance(precision, FabricMixedPrecisionPlugin) else None


def train(
    fabric: Fabric,
    steps: int,
    *,
    inf_at: tuple[int, ...] = (),
    max_norm: float | None = 1.0,
    optimizer: str = "sgd",
) -> dict[str, Any]:
    """A plain Fabric loop (clip, step, a per-step schedule held on skipped steps) over ``Net``."""
    mpx = plugin_of(fabric)
    model = Net()
    opt: torch.optim.Optimizer = (
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if optimizer == "sgd"
        else torch.optim.AdamW(model.parameters(), lr=1e-2)
    )
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    model, opt = fabric.setup(model, opt)
    record: dict[str, Any] = {"losses": [], "skipped": [], "lrs": [], "out_dtype": None, "model": model, "opt": opt}
    for step, (x, y) in enumerate(batches(steps)):
        out = model(x)
        record["out_dtype"] = out.dtype
        loss = F.cross_entropy(out, y)
        fabric.backward(loss)
        if step in inf_at:
            model.head.weight.grad[0, 0] = float("inf")
        if max_norm is not None:
            fabric.clip_gradients(model, opt, max_norm=max_norm)
        opt.step()
        skipped = mpx is not None and mpx.step_was_skipped(opt)
        if not skipped:
            scheduler.step()
        opt.zero_grad()
        record["losses"].append(loss.item())
        record["skipped"].append(skipped)
        record["lrs"].append(opt.param_groups[0]["lr"])
    return record


_REFERENCES: dict[str, list[float]] = {}


def reference_losses(precision: str | Precision, key: str) -> list[float]:
    if key not in _REFERENCES:
        _REFERENCES[key] = train(make_fabric(precision), 8)["losses"]
    return _REFERENCES[key]


# -- 1. every opt level trains as Fabric's own precisions do ----------------------------------------------------------
@pytest.mark.parametrize("level,half", CASES)
def test_every_opt_level_trains_like_fabric_32_true_and_its_amp(level, half):
    mpx = FabricMixedPrecisionPlugin(level, half_dtype=half)
    run = train(make_fabric(mpx), 8)
    losses = torch.tensor(run["losses"])
    assert torch.isfinite(losses).all() and run["skipped"] == [False] * 8
    rtol = 3e-2 if half == "bfloat16" else 1e-2
    torch.testing.assert_close(losses, torch.tensor(reference_losses("32-true", "32")), rtol=rtol, atol=0)
    if level == "O1":  # the cast policy against Fabric's autocast of the same half dtype
        amp = reference_losses("bf16-mixed", "bf16") if half == "bfloat16" else reference_losses(
            hand_built_16_mixed(), "16")
        torch.testing.assert_close(losses, torch.tensor(amp), rtol=rtol, atol=0)
    model = run["model"]
    half_dtype = getattr(torch, half)
    assert run["out_dtype"] == torch.float32  # the loss after the forward runs in FP32 at every level
    expected = torch.float32 if level == "O1" else half_dtype
    assert model.head.weight.dtype == expected
    assert model.body[1].weight.dtype == (torch.float32 if level in ("O1", "O2") else half_dtype)  # batch norm
    if level == "O2":  # the step ran on FP32 masters
        masters = mpx.amp.master_params(run["opt"].optimizer)
        assert all(m.dtype == torch.float32 for m in masters)
        assert torch.equal(mpx.amp.master_of(model.head.weight).to(half_dtype), model.head.weight)


def test_o2_casts_at_the_model_boundary_and_keeps_fp32_modules_fp32():
    mpx = FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16", fp32_modules=["head"])
    fabric = make_fabric(mpx)
    model = fabric.setup_module(Net())  # litgpt's order: the module, then the optimizer over its parameters
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    seen: list[torch.dtype] = []
    model.body.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    out = model(torch.randn(4, 8))
    assert seen == [torch.bfloat16] and out.dtype == torch.float32
    assert model.body[0].weight.dtype == torch.bfloat16 and model.head.weight.dtype == torch.float32
    fabric.backward(out.sum())
    opt.step()
    # Fabric's own check: with a plugin that scales the loss, loss.backward() instead of fabric.backward() is refused.
    with pytest.raises(RuntimeError, match="fabric.backward"):
        model(torch.randn(4, 8)).sum().backward()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Fabric moves the model to CUDA after converting it")
def test_o2_masters_follow_the_model_to_the_gpu():
    mpx = FabricMixedPrecisionPlugin("O2", half_dtype="float16")
    fabric = Fabric(accelerator="cuda", devices=1, plugins=[mpx])
    model, opt = setup_net(fabric, torch.optim.AdamW, lr=1e-3)
    x, y = (t.cuda() for t in batches(1)[0])
    fabric.backward(F.cross_entropy(model(x), y))
    fabric.clip_gradients(model, opt, max_norm=1.0)
    opt.step()
    assert not mpx.step_was_skipped(opt)
    for param, master in zip(model.parameters(), mpx.amp.master_params(opt.optimizer)):
        assert master.device == param.device and master.dtype == torch.float32
        assert torch.equal(master.to(param.dtype), param)


def test_fabric_autocast_is_the_o1_cast_policy():
    fabric = make_fabric(FabricMixedPrecisionPlugin("O1", half_dtype="bfloat16"))
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with fabric.autocast():
        assert torch.mm(a, b).dtype == torch.bfloat16
        assert torch.softmax(a.bfloat16(), -1).dtype == torch.float32
    assert torch.mm(a, b).dtype == torch.float32


def test_a_compiled_model_trains_exactly_as_in_eager_mode():
    # fabric.setup takes the compiled model apart and compiles it again around its wrapper; the cast policy is
    # traced into the graph. "aot_eager" keeps torch's kernels: a difference would come from the casts.
    def run(compiled: bool) -> list[float]:
        torch._dynamo.reset()
        net = Net()
        fabric = make_fabric(FabricMixedPrecisionPlugin("O1", half_dtype="bfloat16"))
        model, opt = fabric.setup(torch.compile(net, backend="aot_eager") if compiled else net,
                                  torch.optim.SGD(net.parameters(), lr=0.1))  # fmt: skip
        losses = []
        for x, y in batches(3):
            loss = F.cross_entropy(model(x), y)
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    assert run(compiled=True) == run(compiled=False)


def test_a_fused_optimizer_is_clipped_and_stepped_as_the_unfused_one():
    # Fabric's own "16-mixed" refuses to clip for an optimizer that unscales in its step; here the plugin unscales.
    def run(fused: bool) -> list[torch.Tensor]:
        fabric = make_fabric(FabricMixedPrecisionPlugin("O2", half_dtype="float16"))
        model, opt = setup_net(fabric, torch.optim.AdamW, lr=1e-2, fused=fused)
        for x, y in batches(3):
            fabric.backward(F.cross_entropy(model(x), y))
            fabric.clip_gradients(model, opt, max_norm=0.5)
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    for fused, unfused in zip(run(True), run(False)):
        torch.testing.assert_close(fused, unfused, rtol=0, atol=1e-3)


# -- 2. an overflow step is skipped quietly, clipping included ---------------------------------------------------------
@pytest.mark.parametrize("level,half", [("O1", "float16"), ("O2", "float16"), ("O2", "bfloat16"), ("O3", "bfloat16")])
def test_an_overflow_step_is_skipped_and_leaves_weights_state_and_schedule_as_they_were(level, half):
    # on_floor="continue": bfloat16's static scale of 1 is its floor, where an overflow raises by default.
    mpx = FabricMixedPrecisionPlugin(level, half_dtype=half, on_floor="continue")
    fabric = make_fabric(mpx)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt = fabric.setup(model, opt)
    norms, scales, lrs = [], [], []

    def step(x: torch.Tensor, y: torch.Tensor, inf: bool) -> None:
        fabric.backward(F.cross_entropy(model(x), y))
        if inf:
            model.head.weight.grad[0, 0] = float("inf")
        norms.append(fabric.clip_gradients(model, opt, max_norm=1.0))  # no "non-finite norm" error
        opt.step()
        if not mpx.step_was_skipped(opt):
            scheduler.step()
        opt.zero_grad()
        scales.append(mpx.metrics()["mpx/loss_scale"])
        lrs.append(opt.param_groups[0]["lr"])

    data = batches(4)
    for x, y in data[:2]:
        step(x, y, inf=False)
    params = [p.detach().clone() for p in model.parameters()]
    masters = [m.detach().clone() for m in mpx.amp.master_params(opt.optimizer)]
    state = copy.deepcopy(opt.state_dict())
    step(*data[2], inf=True)
    assert mpx.step_was_skipped(opt)
    assert float(norms[-1]) == 0.0  # nothing clipped on a skipped step
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(masters, mpx.amp.master_params(opt.optimizer)))
    after = opt.state_dict()
    assert after["param_groups"] == state["param_groups"]  # the held schedule: the same learning rate
    for key, values in state["state"].items():
        assert all(torch.equal(v, after["state"][key][name]) for name, v in values.items())
    assert lrs[-1] == lrs[-2] == 1e-2 * 0.5**2
    dynamic = half == "float16" and level != "O3"
    assert scales[-1] == (scales[-2] / 2 if dynamic else scales[-2])
    step(*data[3], inf=False)  # and training goes on
    assert not mpx.step_was_skipped(opt) and lrs[-1] == 1e-2 * 0.5**3
    assert mpx.metrics()["mpx/skipped_steps"] == 1.0


def test_fabric_bf16_mixed_raises_on_the_same_overflow_in_its_clip():
    # The reference behaviour the plugin improves on: Fabric's own AMP hands the inf to torch's clip, which raises.
    fabric = make_fabric("bf16-mixed")
    model, opt = setup_net(fabric, torch.optim.AdamW)
    x, y = batches(1)[0]
    fabric.backward(F.cross_entropy(model(x), y))
    model.head.weight.grad[0, 0] = float("inf")
    with pytest.raises(RuntimeError, match="non-finite"):
        fabric.clip_gradients(model, opt, max_norm=1.0)


# -- 3. clipping is torch's clip on the unscaled gradients -------------------------------------------------------------
@pytest.mark.parametrize("level,half", [("O1", "float16"), ("O2", "float16"), ("O2", "bfloat16"), ("O3", "bfloat16")])
@pytest.mark.parametrize("how", ["norm", "value"])
def test_clipping_equals_torch_clip_on_the_unscaled_gradients(level, half, how):
    mpx = FabricMixedPrecisionPlugin(level, half_dtype=half, init_scale=2.0**10)
    fabric = make_fabric(mpx)
    model, opt = setup_net(fabric, lr=0.5)
    x, y = batches(1)[0]
    fabric.backward(F.cross_entropy(model(x), y) * 10)
    scale = mpx.amp.scalers[0].get_scale()
    # What torch's clip gives on the unscaled gradients (at O2 the FP32 masters', which the step uses).
    reference = [nn.Parameter(p.detach().float() if level == "O2" else p.detach().clone()) for p in model.parameters()]
    for ref, p in zip(reference, model.parameters()):
        ref.grad = (p.grad.float() if level == "O2" else p.grad.clone()) * (1.0 / scale)
    masters_before = [r.detach().clone() for r in reference]
    if how == "norm":
        expected_norm = torch.nn.utils.clip_grad_norm_(reference, max_norm=0.1)
        norm = fabric.clip_gradients(model, opt, max_norm=0.1)
        assert torch.equal(norm, expected_norm) and expected_norm > 0.1  # it did clip
    else:
        torch.nn.utils.clip_grad_value_(reference, clip_value=1e-3)
        fabric.clip_gradients(model, opt, clip_val=1e-3)
    params = mpx.amp.master_params(opt.optimizer)
    assert all(torch.equal(p.grad, r.grad) for p, r in zip(params, reference))
    if level == "O2":  # the FP32 masters the step starts from (the model's FP32 weights, not their rounding)
        masters_before = [m.detach().clone() for m in params]
    opt.step()  # plain SGD: it stepped with the clipped gradients
    for p, before, ref in zip(mpx.amp.master_params(opt.optimizer), masters_before, reference):
        assert torch.equal(p.detach(), before - 0.5 * ref.grad)


# -- 4. several optimizers, several losses: one scale update per iteration ---------------------------------------------
def _two_optimizer_run(inf_at: int | None, split: bool) -> list[float]:
    mpx = FabricMixedPrecisionPlugin("O2", half_dtype="float16", init_scale=2.0**10, growth_interval=2)
    fabric = make_fabric(mpx)
    model = Net()
    groups = [list(model.body.parameters()), list(model.head.parameters())]
    optimizers = [torch.optim.SGD(g, lr=0.1) for g in (groups if split else [list(model.parameters())])]
    model, *optimizers = fabric.setup(model, *optimizers)
    scales = []
    for step, (x, y) in enumerate(batches(5)):
        fabric.backward(F.cross_entropy(model(x), y))
        if step == inf_at:
            model.body[0].weight.grad[0, 0] = float("inf")
            model.head.weight.grad[0, 0] = float("inf")
        for opt in optimizers:
            fabric.clip_gradients(model, opt, max_norm=1.0)
            opt.step()
            opt.zero_grad()
        scales.append(mpx.metrics()["mpx/loss_scale"])
    return scales


@pytest.mark.parametrize("inf_at", [None, 2])
def test_two_optimizers_on_one_loss_update_the_scale_as_one_optimizer_does(inf_at):
    # One loss stepped by two optimizers is one iteration: the scale grows every growth_interval iterations and backs
    # off once per overflow, as with one optimizer over all the parameters (an update after each step would double
    # both).
    assert _two_optimizer_run(inf_at, split=True) == _two_optimizer_run(inf_at, split=False)


def test_two_losses_each_keep_their_scale():
    mpx = FabricMixedPrecisionPlugin("O1", half_dtype="float16", num_losses=2, init_scale=2.0**10)
    fabric = make_fabric(mpx)
    gen, disc = Net(), nn.Linear(4, 1)
    gen_opt, disc_opt = torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.SGD(disc.parameters(), lr=0.1)
    gen, gen_opt = fabric.setup_module(gen), fabric.setup_optimizers(gen_opt)  # met at their first step
    disc, disc_opt = fabric.setup_module(disc), fabric.setup_optimizers(disc_opt)
    x, _ = batches(1)[0]
    # Unregistered optimizers cannot tell which loss's scale their gradients carry: refused, saying what to call.
    fabric.backward(disc(gen(x).detach()).mean(), loss_id=0)
    with pytest.raises(RuntimeError, match=r"setup_optimizers"):
        disc_opt.step()
    disc_opt.zero_grad()
    mpx.setup_optimizers(disc_opt, gen_opt)
    for step in range(3):
        fabric.backward(disc(gen(x).detach()).mean(), loss_id=0)
        disc_opt.step()
        disc_opt.zero_grad()
        fabric.backward(-disc(gen(x)).mean(), loss_id=1)
        if step == 1:
            gen.head.weight.grad[0, 0] = float("inf")  # the generator's loss overflows
        gen_opt.step()
        gen_opt.zero_grad()
        disc_opt.zero_grad()
    metrics = mpx.metrics()
    assert metrics["mpx/loss_scale/loss0"] == 2.0**10 and metrics["mpx/skipped_steps/loss0"] == 0
    assert metrics["mpx/loss_scale/loss1"] == 2.0**9 and metrics["mpx/skipped_steps/loss1"] == 1


# -- 5. fabric.save / fabric.load: bit-exact resume --------------------------------------------------------------------
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_resume_through_fabric_save_and_load_is_bit_exact(level, tmp_path):
    def setup(seed: int) -> tuple[Fabric, FabricMixedPrecisionPlugin, dict[str, Any]]:
        mpx = FabricMixedPrecisionPlugin(level, half_dtype="float16", init_scale=2.0**10, growth_interval=2)
        fabric = make_fabric(mpx)
        torch.manual_seed(seed)
        model = Net()
        if seed:  # another initialisation: the checkpoint must bring back every weight
            for p in model.parameters():
                p.data.normal_()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        model, opt = fabric.setup(model, opt)
        if level == "O2":
            mpx.setup_optimizers(opt)  # before fabric.load: the optimizer's FP32 state belongs to the masters
        return fabric, mpx, {"model": model, "optimizer": opt, "scheduler": scheduler, "mpx": mpx, "step": 0}

    def run(fabric: Fabric, mpx: FabricMixedPrecisionPlugin, state: dict[str, Any], steps: range) -> None:
        model, opt = state["model"], state["optimizer"]
        data = batches(8)
        for step in steps:
            fabric.backward(F.cross_entropy(model(data[step][0]), data[step][1]))
            if step == 1:
                model.head.weight.grad[0, 0] = float("inf")
            fabric.clip_gradients(model, opt, max_norm=0.5)
            opt.step()
            if not mpx.step_was_skipped(opt):
                state["scheduler"].step()
            opt.zero_grad()
            state["step"] = step + 1

    fabric, mpx, whole = setup(0)
    run(fabric, mpx, whole, range(6))
    fabric, mpx, first = setup(0)
    run(fabric, mpx, first, range(3))
    fabric.save(tmp_path / "ckpt.pt", first)
    fabric, mpx, resumed = setup(1)
    fabric.load(tmp_path / "ckpt.pt", resumed)
    assert resumed["step"] == 3
    run(fabric, mpx, resumed, range(3, 6))
    for a, b in zip(whole["model"].parameters(), resumed["model"].parameters()):
        assert torch.equal(a, b)
    masters = [state["mpx"].amp.master_params(state["optimizer"].optimizer) for state in (whole, resumed)]
    assert all(torch.equal(a, b) for a, b in zip(*masters))
    states = [state["optimizer"].state_dict()["state"] for state in (whole, resumed)]
    assert states[0].keys() == states[1].keys()
    for index, values in states[0].items():
        assert all(torch.equal(value, states[1][index][name]) for name, value in values.items())
    assert whole["scheduler"].state_dict() == resumed["scheduler"].state_dict()
    metrics = [state["mpx"].metrics() for state in (whole, resumed)]
    for name in ("mpx/loss_scale", "mpx/overflows", "mpx/skipped_steps"):  # the scaler and the counters
        assert metrics[0][name] == metrics[1][name]


def test_loading_an_o2_optimizer_before_the_plugin_knows_it_is_refused(tmp_path):
    def setup() -> tuple[Fabric, dict[str, Any]]:
        mpx = FabricMixedPrecisionPlugin("O2", half_dtype="float16")
        fabric = make_fabric(mpx)
        model, opt = setup_net(fabric, torch.optim.AdamW, late=True, lr=1e-3)  # (fabric.setup meets it)
        return fabric, {"model": model, "optimizer": opt, "mpx": mpx}

    fabric, state = setup()
    x, y = batches(1)[0]
    fabric.backward(F.cross_entropy(state["model"](x), y))
    state["optimizer"].step()
    fabric.save(tmp_path / "ckpt.pt", state)
    fabric, state = setup()
    fabric.load(tmp_path / "ckpt.pt", state)  # Adam's FP32 state rounded to the half parameters' dtype by torch
    fabric.backward(F.cross_entropy(state["model"](x), y))
    with pytest.raises(RuntimeError, match=r"setup_optimizers\(optimizer\) after fabric.setup\(\) and before"):
        state["optimizer"].step()


# -- 6. metrics through fabric.log_dict: doctor and plot read a Fabric run ---------------------------------------------
def test_metrics_logged_through_fabric_are_read_by_doctor_and_plot(tmp_path):
    mpx = FabricMixedPrecisionPlugin("O1", half_dtype="float16", init_scale=2.0**8, on_floor="continue")
    logger = TensorBoardLogger(tmp_path / "logs", name="fabric")
    fabric = make_fabric(mpx, loggers=logger)
    model, opt = setup_net(fabric, lr=0.01)
    logged = []
    for step, (x, y) in enumerate(batches(40)):
        log = step % 2 == 0
        if log:
            mpx.request_telemetry()
        loss = F.cross_entropy(model(x), y)
        fabric.backward(loss)
        if step >= 8:
            model.head.weight.grad[0, 0] = float("inf")  # the head overflows from step 8 on
        fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad()
        if log:
            fabric.log_dict({"loss": loss.item(), **mpx.metrics()}, step=step)
            logged.append(step)
    logger.finalize("success")
    scalars = read_scalars(logger.log_dir)
    assert [s for s, _ in scalars["mpx/loss_scale"]] == logged  # on the steps the loop logged, no others
    assert scalars["mpx/loss_scale"][-1][1] == 1.0 and "mpx/underflow/head" in scalars
    (finding,) = doctor.diagnose(logger.log_dir).findings
    # Since step 7: the first step of the logging interval (7-8) that the first overflow showed in.
    assert finding.kind == "persistent_overflow" and finding.modules == ("head",) and finding.since_step == 7
    png = plot_run(logger.log_dir, tmp_path / "run.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- 7. each front door takes its own plugin ---------------------------------------------------------------------------
def test_the_trainer_plugin_given_to_fabric_says_which_plugin_to_use():
    fabric = make_fabric(MixedPrecisionPlugin("O2"))
    with pytest.raises(TypeError, match=r"Fabric\(plugins=\[FabricMixedPrecisionPlugin"):
        fabric.setup(Net())
    # A LightningModule passes setup (the Trainer hands the plugin LightningModules too): refused at its backward.
    fabric = make_fabric(MixedPrecisionPlugin("O1", half_dtype="bfloat16"))
    model = fabric.setup(Classifier())
    x = torch.randn(4, 16)
    with pytest.raises(TypeError, match="lightning_mpx.FabricMixedPrecisionPlugin"):
        fabric.backward(model(x).sum())


def test_the_fabric_plugin_given_to_a_trainer_says_which_plugin_to_use():
    with pytest.raises(MisconfigurationException, match=r"a Trainer takes lightning_mpx.MixedPrecisionPlugin"):
        pl.Trainer(plugins=[FabricMixedPrecisionPlugin("O2")], accelerator="cpu")


def test_bad_settings_fail_when_the_plugin_is_built_and_it_pickles_as_its_settings():
    with pytest.raises(ValueError, match="half_dtype"):
        FabricMixedPrecisionPlugin("O2", half_dtype="int8")
    with pytest.raises(ValueError, match="opt_level"):
        FabricMixedPrecisionPlugin("O4")
    with pytest.raises(TypeError, match="DDP strategies"):  # DeepSpeed hands its engine to the optimizer step
        FabricMixedPrecisionPlugin("O2").optimizer_step(nn.Linear(2, 2))
    mpx = FabricMixedPrecisionPlugin("O2", half_dtype="float16", init_scale=8.0, fp32_modules=["head"])
    train(make_fabric(mpx), 1)
    clone = pickle.loads(pickle.dumps(mpx))  # strategy="ddp_spawn" pickles Fabric into each process
    assert clone.amp is not mpx.amp and clone.amp.master_weights == []
    assert (clone.opt_level, clone.amp.half_dtype, clone.amp.scalers[0].get_scale()) == ("O2", torch.float16, 8.0)


# -- 8. litgpt: its pretraining loop with the plugin, against the same loop at "32-true" -------------------------------
_LITGPT: dict[str, dict[str, Any]] = {}


def _litgpt_run(precision: str, half: str, tmp_path: Path) -> dict[str, Any]:
    pytest.importorskip("litgpt")
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import fabric_litgpt
    finally:
        sys.path.remove(str(ROOT / "examples"))
    key = f"{precision}-{half}"
    if key not in _LITGPT:
        fabric = fabric_litgpt.make_fabric(precision, half)
        _LITGPT[key] = fabric_litgpt.main(fabric, fabric_litgpt.TrainArgs(max_iters=16), out_dir=tmp_path)
    return _LITGPT[key]


@pytest.mark.parametrize("level,half", [("O1", "float16"), ("O1", "bfloat16"), ("O2", "float16"), ("O2", "bfloat16")])
def test_litgpt_pretraining_loop_matches_32_true(level, half, tmp_path):
    reference = _litgpt_run("32-true", "", tmp_path / "ref")["losses"]
    result = _litgpt_run(level, half, tmp_path)
    losses = torch.tensor(result["losses"])
    assert len(losses) == 8 and torch.isfinite(losses).all()
    assert losses[-1] < losses[0] - 0.3  # it learns
    torch.testing.assert_close(losses, torch.tensor(reference), rtol=0.02, atol=0)
    model = result["model"]
    assert model.transformer.wte.weight is model.lm_head.weight  # tied weights stay tied
    mpx = result["state"]["mpx"]
    if level == "O2":
        assert model.lm_head.weight.dtype == getattr(torch, half)
        # One FP32 master for the tied weight, and the model holds its rounding.
        master = mpx.amp.master_of(model.lm_head.weight)
        assert master is mpx.amp.master_of(model.transformer.wte.weight) and master.dtype == torch.float32
        assert torch.equal(master.to(model.lm_head.weight.dtype), model.lm_head.weight)
    checkpoint = torch.load(tmp_path / "final" / "lit_model.pth", weights_only=False)
    assert checkpoint["mpx"]["opt_level"] == level and checkpoint["step_count"] == 8
    assert all(torch.isfinite(v).all() for v in checkpoint["model"].values() if v.is_floating_point())


# -- 9. DDP: two CPU processes make one skip decision ------------------------------------------------------------------
def test_ddp_two_processes_skip_together_and_stay_identical(tmp_path):
    run_script("fabric_ddp_script.py", tmp_path, timeout=180, MPX_LEVELS="O2:float16,O1:bfloat16")
    for level, dtype in (("O2", "torch.float16"), ("O1", "torch.float32")):
        ranks = [json.loads((tmp_path / f"{level}_rank{r}.json").read_text()) for r in (0, 1)]
        for rank in ranks:
            assert rank["world_size"] == 2 and rank["param_dtype"] == dtype
            # Rank 0's overflow at step 2, skipped by both; the schedule held there.
            assert rank["skipped"] == [False, False, True, False] and rank["skipped_steps"] == 1.0
            assert rank["lrs"] == [0.1, 0.05, 0.025, 0.025]
        assert ranks[0]["scale"] == ranks[1]["scale"] == (512.0 if level == "O2" else 1.0)
        assert ranks[0]["params"] == ranks[1]["params"] and ranks[0]["masters"] == ranks[1]["masters"]
        assert ranks[0]["norms"][2] == 0.0 and ranks[0]["norms"][3] == ranks[1]["norms"][3]


class _AutocastSeen(torch.autograd.Function):
    """Identity whose backward records whether ``torch.autocast`` was on while it ran."""

    seen: list[bool] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _AutocastSeen.seen.append(torch.is_autocast_enabled("cpu"))
        return grad


@pytest.mark.parametrize("scope", [False, True])
def test_fabric_backward_runs_without_a_users_autocast(scope):
    # O3 has no cast policy (the engine's backward checks no scope): the plugin turns a user's torch.autocast off
    # around fabric.backward itself, and skips that only outside every scope.
    fabric = make_fabric(FabricMixedPrecisionPlugin("O3", half_dtype="bfloat16"))
    model = fabric.setup(nn.Linear(4, 1))
    _AutocastSeen.seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16) if scope else torch.autocast("cpu", enabled=False):
        loss = _AutocastSeen.apply(model(torch.randn(2, 4)).float()).sum()
        fabric.backward(loss)
    assert _AutocastSeen.seen == [False]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
