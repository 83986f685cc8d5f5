"""Helper attack63b: the Fabric plugin's optimizers registered at ``fabric.setup(model, *optimizers)`` (stop 63), from
a hostile Fabric user's side.

Since stop 63 the plugin reads the optimizers of ``fabric.setup(model, *optimizers)`` from Fabric's call and registers
them there (single device and DDP, an optimizer over models it prepared); one set up apart (``fabric.setup_module`` +
``fabric.setup_optimizers``) is still met at its first step. Registering earlier must change nothing a loop computes:
each habit below trains bit for bit as the same loop set up apart (the path before stop 63), at O1 and O2, and the
loops are held to Fabric's own ``"16-mixed"`` (a ``GradScaler``) and ``"bf16-mixed"``. Found and fixed:

* the same model set up again with a new optimizer (a second stage on the same ``Fabric``): ``convert_module``
  returned before reading Fabric's call, so the new optimizer was not registered at set-up; ``fabric.load`` into it
  at O2 then stopped the first step ("call plugin.setup_optimizers");
* a subclass of the plugin overriding ``convert_module`` (calling ``super()``): the plugin read its own frame, not
  Fabric's, so nothing was registered at set-up, and under DDP the masters started from the half rounding of rank
  0's weights, not its FP32 values (``tests/fabric_setup_optimizers_script.py``).

Tiny MLPs on CPU; float16 only where the dynamic scale is the point.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin
from tests.fabric_setup_optimizers_script import _FabricSubclass, _my_setup, _PluginSubclass, _registered
from tests.launch import case_results

SCALING = {"init_scale": 2.0**10, "growth_interval": 2}
Weights = dict[str, torch.Tensor]


def _net(seed: int, width_in: int = 8, width_out: int = 4) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width_in, 16), nn.Tanh(), nn.Linear(16, width_out))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)


class _Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net(0)

    def forward(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


# -- one loop per habit, set up with fabric.setup(model, *optimizers) or apart -----------------------------------------
class _Run:
    """A Fabric with the plugin and the way ``habit`` sets up its models: ``fabric.setup(model, *optimizers)`` or,
    ``apart``, ``fabric.setup_module`` and ``fabric.setup_optimizers`` (the plugin meets the optimizer at its first
    step)."""

    def __init__(self, habit: str, level: str, apart: bool, **settings: Any) -> None:
        settings = {"half_dtype": "bfloat16", **settings}
        plugin_class = _PluginSubclass if habit == "plugin_subclass" else FabricMixedPrecisionPlugin
        self.mpx = plugin_class(level, **settings)
        fabric_class = _FabricSubclass if habit == "fabric_subclass" else Fabric
        self.fabric = fabric_class(accelerator="cpu", devices=1, plugins=[self.mpx])
        self.habit, self.apart = habit, apart

    def setup(self, model: nn.Module, *optimizers: Any) -> Any:
        fabric = self.fabric
        if self.apart:
            wrapped = fabric.setup_module(model)
            return (
                (wrapped, *fabric.setup_optimizers(*optimizers))
                if len(optimizers) > 1
                else ((wrapped, fabric.setup_optimizers(*optimizers)) if optimizers else wrapped)
            )
        if self.habit == "wrapper":
            return _my_setup(fabric, model, *optimizers)
        if self.habit == "no_move":
            return fabric.setup(model, *optimizers, move_to_device=False)
        return fabric.setup(model, *optimizers)


def _plain(run: _Run, net: nn.Module, optimizer: Any, steps: range = range(3), model: Any = None) -> None:
    model = model if model is not None else run.setup(net, optimizer)
    if isinstance(model, tuple):
        model, optimizer = model
    for step in steps:
        x, y = _batch(step)
        run.fabric.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()


def _habit(habit: str, level: str, apart: bool) -> tuple[list[Weights], dict[str, float], list[Any]]:
    """``habit``'s loop: the FP32 weights of its models, the plugin's metrics, its optimizers' state dicts."""
    settings: dict[str, Any] = {"num_losses": 2} if habit == "two_losses" else {}
    if habit in ("gan", "two_losses"):
        settings.update(half_dtype="float16", **SCALING)
    run = _Run(habit, level, apart, **settings)
    fabric, mpx = run.fabric, run.mpx
    nets: list[nn.Module] = []
    optimizers: list[Any] = []
    registered_at_setup: list[bool] = []
    if habit in ("gan", "two_losses"):
        disc_net, gen_net = _net(0, 4, 1), _net(1, 4, 4)
        disc, opt_d = run.setup(disc_net, torch.optim.SGD(disc_net.parameters(), lr=0.05))
        gen, opt_g = run.setup(gen_net, torch.optim.SGD(gen_net.parameters(), lr=0.05))
        if apart and habit == "two_losses":
            mpx.setup_optimizers(opt_d, opt_g)  # needed with num_losses > 1 for an optimizer set up apart
        nets, optimizers = [disc_net, gen_net], [opt_d, opt_g]
        ids = (0, 1) if habit == "two_losses" else (0, 0)
        for step in range(6):
            real = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            fake = gen(torch.randn(8, 4, generator=torch.Generator().manual_seed(100 + step)))
            loss_d = F.softplus(-disc(real)).mean() + F.softplus(disc(fake.detach())).mean()
            fabric.backward(loss_d, loss_id=ids[0])
            if step == 2:
                disc_net[2].weight.grad[0, 0] = float("inf")  # D's loss overflows: step skipped, scale backed off
            opt_d.step()
            opt_d.zero_grad()
            fabric.backward(F.softplus(-disc(fake)).mean(), loss_id=ids[1])
            opt_g.step()
            opt_g.zero_grad()
            opt_d.zero_grad()
    elif habit == "shared":  # one optimizer over two models set up one by one
        first, second = _net(0), _net(1, 4, 4)
        optimizer = torch.optim.AdamW([*first.parameters(), *second.parameters()], lr=1e-2)
        model_a = run.setup(first)
        model_b, optimizer = run.setup(second, optimizer)
        nets, optimizers = [first, second], [optimizer]
        registered_at_setup.append(_registered(mpx, optimizer))
        _plain(run, first, optimizer, model=(lambda x: model_b(model_a(x)), optimizer))
    elif habit == "outside":  # the optimizer also holds a module that was not set up: met at its first step
        net, head = _net(0), nn.Linear(4, 4)
        model, optimizer = run.setup(net, torch.optim.AdamW([*net.parameters(), *head.parameters()], lr=1e-2))
        nets, optimizers = [net], [optimizer]
        registered_at_setup.append(_registered(mpx, optimizer))
        _plain(run, net, optimizer, model=(lambda x: head(model(x)), optimizer))
        nets.append(head)
    elif habit == "lightning_module":
        module = _Classifier()
        model, optimizer = run.setup(module, module.configure_optimizers())
        nets, optimizers = [module], [optimizer]
        registered_at_setup.append(_registered(mpx, optimizer))
        for step in range(3):
            # model(batch), as a single-device Fabric calls training_step on the module itself (no input cast)
            fabric.backward(model(_batch(step)))
            optimizer.step()
            optimizer.zero_grad()
    elif habit == "schedule_free":
        from tests.test_lightning_schedule_free import ScheduleFreeAdamW

        net = _net(0)
        model, optimizer = run.setup(net, ScheduleFreeAdamW(net.parameters(), lr=1e-2))
        nets, optimizers = [net], [optimizer]
        registered_at_setup.append(_registered(mpx, optimizer))
        for step in range(3):
            optimizer.train()
            x, y = _batch(step)
            fabric.backward(F.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            optimizer.eval()
            with torch.no_grad():
                model(x)  # evaluated at the averaged point
    else:
        if habit == "init_module":
            with fabric.init_module():
                net = _net(0)
        else:
            net = _net(0)
        if habit == "frozen":  # frozen before set-up, held by the optimizer, unfrozen before its first step
            net[0].requires_grad_(False)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
        setup_net = torch.compile(net, backend="eager") if habit == "compile_before" else net
        model, optimizer = run.setup(setup_net, optimizer)
        if habit == "compile_after":
            model = torch.compile(model, backend="eager")
        nets, optimizers = [net], [optimizer]
        registered_at_setup.append(_registered(mpx, optimizer))
        if habit == "again":
            mpx.setup_optimizers(optimizer)
        if habit == "frozen":
            net[0].requires_grad_(True)
        _plain(run, net, optimizer, model=(model, optimizer))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a frozen parameter's rounding noted
        weights = [mpx.fp32_state_dict(net) for net in nets]
    if not apart:
        assert all(registered_at_setup) == (habit != "outside"), registered_at_setup
    return weights, mpx.metrics(), [opt.state_dict() for opt in optimizers]


def _same_state(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


HABITS = [
    "gan", "two_losses", "shared", "outside", "frozen", "again", "init_module", "schedule_free", "lightning_module",
    "wrapper", "fabric_subclass", "no_move", "plugin_subclass",
]  # fmt: skip
# torch.compile before or after fabric.setup: at O2 only (dynamo's tracing is the slow part)
CASES = [(habit, level) for habit in HABITS for level in ("O1", "O2")] + [
    ("compile_before", "O2"),
    ("compile_after", "O2"),
]


@pytest.mark.parametrize(("habit", "level"), CASES)
def test_optimizers_met_at_setup_train_bit_for_bit_as_those_met_at_their_first_step(habit: str, level: str) -> None:
    """Each habit with ``fabric.setup(model, *optimizers)`` against the same loop set up apart: the same FP32 weights
    (masters at O2), metrics and optimizer state, bit for bit; the optimizer registered at set-up except the one that
    also holds a module not set up (met at its first step, as documented)."""
    weights, metrics, states = _habit(habit, level, apart=False)
    ref_weights, ref_metrics, ref_states = _habit(habit, level, apart=True)
    for got, want in zip(weights, ref_weights, strict=True):
        assert got.keys() == want.keys()
        for name, value in want.items():
            assert torch.equal(got[name], value), name
    assert metrics == ref_metrics
    assert _same_state(states, ref_states)


# -- held to Fabric's own precisions -------------------------------------------------------------------------------
def _gan_against(precision: Any) -> tuple[list[Weights], list[float]]:
    """The GAN loop of :func:`_habit` (D's loss overflows at step 2) under ``precision`` (a plugin, or Fabric's own),
    both models and optimizers given to ``fabric.setup``: FP32 weights, loss 0's scale after each iteration."""
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[precision])
    disc_net, gen_net = _net(0, 4, 1), _net(1, 4, 4)
    disc, opt_d = fabric.setup(disc_net, torch.optim.SGD(disc_net.parameters(), lr=0.05))
    gen, opt_g = fabric.setup(gen_net, torch.optim.SGD(gen_net.parameters(), lr=0.05))
    scales = []
    for step in range(6):
        real = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        fake = gen(torch.randn(8, 4, generator=torch.Generator().manual_seed(100 + step)))
        fabric.backward(F.softplus(-disc(real)).mean() + F.softplus(disc(fake.detach())).mean())
        if step == 2:
            disc_net[2].weight.grad[0, 0] = float("inf")
        opt_d.step()
        opt_d.zero_grad()
        fabric.backward(F.softplus(-disc(fake)).mean())
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()
        scales.append(precision.scaler.get_scale())
    if isinstance(precision, FabricMixedPrecisionPlugin):
        return [precision.fp32_state_dict(net) for net in (disc_net, gen_net)], scales
    return [{k: v.float() for k, v in net.state_dict().items()} for net in (disc_net, gen_net)], scales


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_gan_set_up_model_by_model_follows_16_mixed_overflow_for_overflow(level: str) -> None:
    """``fabric.setup(D, opt_d)``, ``fabric.setup(G, opt_g)`` in float16, D's gradient inf at step 2: the same scale
    after every iteration as ``"16-mixed"``'s ``GradScaler`` (backed off once, grown every second iteration), the
    same skipped step, weights within float16's rounding of its."""
    scaler = torch.amp.GradScaler("cpu", **SCALING)
    want, want_scales = _gan_against(MixedPrecision("16-mixed", "cpu", scaler=scaler))
    got, scales = _gan_against(FabricMixedPrecisionPlugin(level, half_dtype="float16", **SCALING))
    assert scales == want_scales and scales[2] == scales[1] / 2
    for ours, theirs in zip(got, want, strict=True):
        for name, value in theirs.items():
            torch.testing.assert_close(ours[name], value, atol=1e-4, rtol=0), name


def _shared_against(precision: Any) -> list[Weights]:
    """One AdamW over two models set up one by one (``fabric.setup(a)``, ``fabric.setup(b, optimizer)``), four steps
    under ``precision`` (a plugin, or Fabric's own precision string): the FP32 weights."""
    plugin = isinstance(precision, FabricMixedPrecisionPlugin)
    fabric = Fabric(accelerator="cpu", devices=1, **({"plugins": [precision]} if plugin else {"precision": precision}))
    first, second = _net(0), _net(1, 4, 4)
    model_a = fabric.setup(first)
    model_b, optimizer = fabric.setup(second, torch.optim.AdamW([*first.parameters(), *second.parameters()], lr=1e-2))
    for step in range(4):
        x, y = _batch(step)
        fabric.backward(F.cross_entropy(model_b(model_a(x)), y))
        optimizer.step()
        optimizer.zero_grad()
    if plugin:
        return [precision.fp32_state_dict(net) for net in (first, second)]
    return [{k: v.float() for k, v in net.state_dict().items()} for net in (first, second)]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_one_optimizer_over_two_models_set_up_one_by_one_trains_as_bf16_mixed(level: str) -> None:
    """Registered at the second set-up (every parameter it holds is of a model the plugin prepared): the weights
    (masters at O2) of ``"bf16-mixed"``'s FP32 model, to bfloat16's rounding (bit for bit, measured), not FP32's
    (0.02 apart after four AdamW steps)."""
    want, fp32 = _shared_against("bf16-mixed"), _shared_against("32-true")
    got = _shared_against(FabricMixedPrecisionPlugin(level, half_dtype="bfloat16"))
    for ours, theirs, full in zip(got, want, fp32, strict=True):
        for name, value in theirs.items():
            torch.testing.assert_close(ours[name], value, atol=1e-3, rtol=0)
        assert any(not torch.equal(ours[name], full[name]) for name in full)


# -- a second stage: the model set up again with a new optimizer ---------------------------------------------------
def _stage_one(tmp_path: Path) -> tuple[Fabric, FabricMixedPrecisionPlugin, nn.Module, Path]:
    mpx = FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx])
    net = _net(0)
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    _plain(_RunOf(fabric, mpx), net, optimizer, range(2), model=(model, optimizer))
    path = tmp_path / "stage1.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "mpx": mpx})
    return fabric, mpx, net, path


class _RunOf(_Run):
    def __init__(self, fabric: Fabric, mpx: FabricMixedPrecisionPlugin) -> None:  # noqa: D107
        self.fabric, self.mpx, self.habit, self.apart = fabric, mpx, "", False


def test_a_model_set_up_again_with_a_new_optimizer_registers_it_and_resumes_bit_exact(tmp_path: Path) -> None:
    """The same ``Fabric`` sets the model up again with a new AdamW (a second stage), which ``fabric.load`` restores
    from the first stage's checkpoint before its first step: it is registered at that set-up (its FP32 state goes to
    the masters) and the run goes on bit for bit as the first optimizer would have. Before, ``convert_module``
    returned for the model it had prepared before reading Fabric's call: the new optimizer was met at its first step,
    which refused the state ``fabric.load`` had rounded to bfloat16 ("call plugin.setup_optimizers")."""
    fabric, mpx, net, path = _stage_one(tmp_path)
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    assert _registered(mpx, optimizer)
    fabric.load(path, {"model": model, "optimizer": optimizer, "mpx": mpx})
    assert {v.dtype for s in optimizer.state_dict()["state"].values() for k, v in s.items() if k != "step"} == {
        torch.float32
    }
    _plain(_RunOf(fabric, mpx), net, optimizer, range(2, 4), model=(model, optimizer))

    whole_mpx = FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")
    whole_fabric = Fabric(accelerator="cpu", devices=1, plugins=[whole_mpx])
    whole = _net(0)
    whole_model, whole_opt = whole_fabric.setup(whole, torch.optim.AdamW(whole.parameters(), lr=1e-2))
    _plain(_RunOf(whole_fabric, whole_mpx), whole, whole_opt, range(4), model=(whole_model, whole_opt))
    assert _same_state(mpx.fp32_state_dict(net), whole_mpx.fp32_state_dict(whole))
    assert _same_state(optimizer.state_dict(), whole_opt.state_dict())


def test_a_second_stage_trains_alike_however_its_optimizer_is_set_up(tmp_path: Path) -> None:
    """Stage two over the stage-one model with a new SGD: a new ``Fabric`` and plugin (which take the masters over)
    with ``fabric.setup(model, optimizer)`` or set up apart, or the first ``Fabric`` again: the same bits (the
    optimizer registered at set-up in both ``fabric.setup`` runs)."""
    results = []
    for second in ("new_fabric", "new_fabric_apart", "same_fabric"):
        (tmp_path / second).mkdir()
        fabric, mpx, net, _ = _stage_one(tmp_path / second)
        if second != "same_fabric":
            mpx = FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")
            fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx])
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        if second == "new_fabric_apart":
            model, optimizer = fabric.setup_module(net), fabric.setup_optimizers(optimizer)
        else:
            model, optimizer = fabric.setup(net, optimizer)
            assert _registered(mpx, optimizer), second
        _plain(_RunOf(fabric, mpx), net, optimizer, range(2, 5), model=(model, optimizer))
        results.append((mpx.fp32_state_dict(net), optimizer.state_dict()))
    assert all(_same_state(result, results[0]) for result in results[1:])


# -- fabric.load before the first step, resumed -------------------------------------------------------------------
def _gan_state(seed: int) -> tuple[Fabric, FabricMixedPrecisionPlugin, dict[str, Any]]:
    mpx = FabricMixedPrecisionPlugin("O2", half_dtype="float16", **SCALING)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx])
    disc_net, gen_net = _net(seed, 4, 1), _net(seed + 1, 4, 4)
    disc, opt_d = fabric.setup(disc_net, torch.optim.AdamW(disc_net.parameters(), lr=1e-2))
    gen, opt_g = fabric.setup(gen_net, torch.optim.AdamW(gen_net.parameters(), lr=1e-2))
    return fabric, mpx, {"disc": disc, "gen": gen, "opt_d": opt_d, "opt_g": opt_g, "mpx": mpx}


def _gan_steps(fabric: Fabric, state: dict[str, Any], steps: range) -> None:
    disc, gen, opt_d, opt_g = state["disc"], state["gen"], state["opt_d"], state["opt_g"]
    for step in steps:
        real = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        fake = gen(torch.randn(8, 4, generator=torch.Generator().manual_seed(100 + step)))
        fabric.backward(F.softplus(-disc(real)).mean() + F.softplus(disc(fake.detach())).mean())
        if step == 1:
            next(disc.parameters()).grad[0, 0] = float("inf")
        opt_d.step()
        opt_d.zero_grad()
        fabric.backward(F.softplus(-disc(fake)).mean())
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()


def test_gan_o2_float16_resumed_from_a_load_before_the_first_step_is_bit_exact(tmp_path: Path) -> None:
    """A GAN at O2 float16 (D's overflow at step 1), both optimizers given to ``fabric.setup``: 3 steps, save, a fresh
    run with other weights loads it before any step (the AdamW state FP32, in the masters), 3 more steps: the weights,
    masters, optimizer states and scale of 6 steps, bit for bit."""
    fabric, mpx, whole = _gan_state(0)
    _gan_steps(fabric, whole, range(6))
    fabric, mpx, first = _gan_state(0)
    _gan_steps(fabric, first, range(3))
    fabric.save(tmp_path / "gan.ckpt", first)
    fabric, mpx, resumed = _gan_state(7)
    fabric.load(tmp_path / "gan.ckpt", resumed)
    for name in ("opt_d", "opt_g"):
        loaded = resumed[name].state_dict()["state"]
        assert _same_state(loaded, first[name].state_dict()["state"])  # FP32, not rounded to float16
    _gan_steps(fabric, resumed, range(3, 6))
    for name in ("disc", "gen"):
        assert _same_state(whole["mpx"].fp32_state_dict(whole[name]), resumed["mpx"].fp32_state_dict(resumed[name])), (
            name
        )
        for a, b in zip(whole[name].parameters(), resumed[name].parameters(), strict=True):
            assert torch.equal(a, b)
    for name in ("opt_d", "opt_g"):
        assert _same_state(whole[name].state_dict(), resumed[name].state_dict())
    assert whole["mpx"].metrics()["mpx/loss_scale"] == resumed["mpx"].metrics()["mpx/loss_scale"]


# -- the frame read fails: the optimizers are met at their first step -----------------------------------------------
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_when_fabrics_call_cannot_be_read_the_optimizer_is_met_at_its_first_step_alike(
    level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No ``fabric.setup`` frame found (a Fabric whose ``setup`` converts through code of its own): nothing is
    registered at set-up, and the loop trains as the one whose optimizer was registered there, bit for bit."""
    import lightning_mpx.integrations.fabric as fabric_module

    want, want_metrics, want_states = _habit("frozen", level, apart=False)
    monkeypatch.setattr(fabric_module, "_fabric_call", lambda frame: None)
    run = _Run("plain", level, apart=False)
    net = _net(0)
    net[0].requires_grad_(False)
    model, optimizer = run.fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    assert not _registered(run.mpx, optimizer)
    net[0].requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _plain(run, net, optimizer, model=(model, optimizer))
        assert _same_state(run.mpx.fp32_state_dict(net), want[0])
    assert run.mpx.metrics() == want_metrics
    assert _same_state([optimizer.state_dict()], want_states)


# -- under DDP: two gloo ranks, one launch ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out: Path = tmp_path_factory.mktemp("attack63b")
    return case_results("fabric_setup_optimizers_script.py", out, timeout=120)


DDP_CASES = ["plain", "resumed", "gan", "wrapper", "fabric_subclass", "plugin_subclass", "lost"]


@pytest.mark.parametrize("case", DDP_CASES)
def test_ddp_masters_start_from_rank_zeros_fp32_weights_and_the_ranks_stay_one(
    launched: list[dict[str, Any]], case: str
) -> None:
    """Rank 1 initialises its models unseeded (other weights than rank 0's): after ``fabric.setup`` every master is
    rank 0's FP32 weight exactly on both ranks (where the plugin cannot read Fabric's call, ``lost``: its bfloat16
    rounding, the same on both ranks), rank-0-only ``mpx.metrics()`` reads between steps change nothing, and after
    the steps (an overflow on rank 1 in the GAN) both ranks hold the same weights, masters and scale."""
    zero, one = launched[0][case], launched[1][case]
    assert zero["init"] != one["init"]  # the ranks built different weights
    for rank in (zero, one):
        want = zero["rounded_init"] if case == "lost" else zero["init"]
        assert rank["masters_at_setup"] == want
        assert rank["registered_at_setup"] == (case != "lost")
    assert zero["final"] == one["final"] and zero["final_masters"] == one["final_masters"]
    assert zero["scale"] == one["scale"] and zero["reads"]  # rank 0 read the metrics between steps


def test_ddp_load_before_the_first_step_resumes_bit_exact_on_both_ranks(launched: list[dict[str, Any]]) -> None:
    """``fabric.load`` of ``plain``'s checkpoint (3 steps) into a run with other weights, before its first step: the
    AdamW state FP32 as saved (into the masters), and 2 more steps give ``plain``'s 5-step weights, masters and state
    on each rank, bit for bit."""
    for rank in launched:
        plain, resumed = rank["plain"], rank["resumed"]
        assert resumed["loaded_state"] == plain["saved_state"]
        assert {dtype for key, dtype, _ in resumed["loaded_state"] if key != "step"} == {"torch.float32"}
        for key in ("final", "final_masters", "opt_state", "scale"):
            assert resumed[key] == plain[key], key
