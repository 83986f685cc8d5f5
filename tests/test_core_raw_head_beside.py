"""A raw optimizer stepped in the same iteration as the prepared one (engine/beside_steps.py): a head's optimizer never
given to the door, stepped by the user's code before or after the prepared optimizer's step. The engine's backward
scaled the head's gradients too; the raw step applied them times the loss scale (O1 float16: NaN in 3 steps) or, at
O2, to the half weights with no FP32 master, silently: an engine step between the backward's note and the next
backward voided the note (engine/raw_steps.py, there so that an EMA swap after the step passes). Now refused, naming
the head's parameters and each door's fix, at the prepared step (raw step before it) or at the next backward (after
it), for the core, Fabric, Accelerate and the Trainer's manual optimization. At O1 bfloat16 (static scale 1, FP32
weights) the raw step is a plain step: no hazard, trains as FP32. What users legitimately do beside (EMA ``copy_`` swap
and hand weight decay after the step, ``AveragedModel``, a parameter left out of every optimizer whose gradient is
freed by ``model.zero_grad()``, a temperature set by hand after the step, unscaled gradients given by
``amp.true_grads``) trains as FP32 does. The DDP case (both ranks refuse alike) runs in
tests/fabric_raw_head_ddp_script.py."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp

HEAD = r"(?s)'head\.weight', 'head\.bias', which no optimizer prepared by lightning_mpx holds, were written"
LEVELS = [("O1", "float16"), ("O2", "bfloat16")]


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.trunk(x.to(self.trunk.weight.dtype)))).float()


def _iterate(
    order: str,
    backward: Callable[[torch.Tensor], Any],
    step: Callable[[], Any],
    head: Any,
    zero: Callable[[], Any],
    model: nn.Module,
    steps: int = 3,
) -> int:
    """``steps`` iterations, the raw head stepped ``order`` ("before"/"after") the prepared step; returns how many
    backwards ran before it raised (or all of them)."""
    done = 0
    for i in range(steps):
        x, y = _batch(i)
        backward(F.mse_loss(model(x), y))
        done += 1
        if order == "before":
            head.step()
            step()
        else:
            step()
            head.step()
        zero()
        head.zero_grad()
    return done


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize(("opt_level", "half_dtype"), LEVELS)
def test_core_raw_head_beside_the_prepared_step_is_refused(opt_level: str, half_dtype: str, order: str) -> None:
    amp = Amp(opt_level=opt_level, half_dtype=half_dtype)
    model = amp.prepare_model(Net())
    opt = amp.prepare_optimizer(torch.optim.SGD(model.trunk.parameters(), lr=0.05))
    head = torch.optim.SGD(model.head.parameters(), lr=0.05)  # never prepared
    backwards: list[int] = []

    def backward(loss: torch.Tensor) -> None:
        backwards.append(1)
        amp.backward(loss)

    def step() -> None:
        amp.step(opt)
        amp.update()

    with pytest.raises(RuntimeError, match=HEAD + r".*amp\.prepare_optimizer\(optimizer\).*amp\.true_grads"):
        _iterate(order, backward, step, head, opt.zero_grad, model)
    # before: at the first prepared step (the trunk not stepped); after: at the second backward, before it ran
    assert len(backwards) == (1 if order == "before" else 2)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _fp32_run(order: str, steps: int = 3) -> nn.Module:
    ref = Net()
    opt = torch.optim.SGD(ref.trunk.parameters(), lr=0.05)
    head = torch.optim.SGD(ref.head.parameters(), lr=0.05)
    _iterate(order, lambda loss: loss.backward(), opt.step, head, opt.zero_grad, ref, steps)
    return ref


@pytest.mark.parametrize("order", ["before", "after"])
def test_o1_bfloat16_a_raw_head_is_a_plain_step_and_trains_as_fp32(order: str) -> None:
    """A static scale of 1 and FP32 weights: the gradients the raw head steps on are the true ones. No hazard, no
    refusal (the backward notes nothing at O1 with a unit scale)."""
    amp = Amp(opt_level="O1", half_dtype="bfloat16")
    model = amp.prepare_model(Net())
    opt = amp.prepare_optimizer(torch.optim.SGD(model.trunk.parameters(), lr=0.05))
    head = torch.optim.SGD(model.head.parameters(), lr=0.05)

    def step() -> None:
        amp.step(opt)
        amp.update()

    assert _iterate(order, amp.backward, step, head, opt.zero_grad, model) == 3
    want = _fp32_run(order).state_dict()
    got = model.state_dict()
    assert all(torch.allclose(got[k], want[k], atol=2e-2) for k in want)


def test_o1_float16_a_raw_head_on_the_true_gradients_trains_as_fp32() -> None:
    """The refusal's way out at O1 without preparing the head's optimizer: give its parameters their unscaled
    gradients (``amp.true_grads``, new tensors) before the raw step, as GradScaler's ``unscale_`` would."""
    amp = Amp(opt_level="O1", half_dtype="float16")
    model = amp.prepare_model(Net())
    opt = amp.prepare_optimizer(torch.optim.SGD(model.trunk.parameters(), lr=0.05))
    raw = torch.optim.SGD(model.head.parameters(), lr=0.05)
    params = list(model.head.parameters())

    class Unscaled:
        def step(self) -> None:
            for p, g in zip(params, amp.true_grads(params)):
                p.grad = g
            raw.step()

        def zero_grad(self) -> None:
            raw.zero_grad()

    def step() -> None:
        amp.step(opt)
        amp.update()

    for order in ("before", "after"):
        assert _iterate(order, amp.backward, step, Unscaled(), opt.zero_grad, model, steps=2) == 2
    ref = Net()
    ref_opt = torch.optim.SGD(ref.trunk.parameters(), lr=0.05)
    ref_head = torch.optim.SGD(ref.head.parameters(), lr=0.05)
    for order in ("before", "after"):
        _iterate(order, lambda loss: loss.backward(), ref_opt.step, ref_head, ref_opt.zero_grad, ref, steps=2)
    got, want = model.state_dict(), ref.state_dict()
    assert all(torch.allclose(got[k], want[k], atol=2e-2) for k in want)


class Wide(nn.Module):
    """A trunk, a head, a parameter left out of every optimizer that gets gradients (``keep``) and a temperature set by
    hand (``tau``, an ``nn.Parameter``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.head, self.keep = nn.Linear(4, 8), nn.Linear(8, 1), nn.Linear(4, 1)
        self.tau = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.trunk.weight.dtype)
        return (self.head(torch.tanh(self.trunk(x))) + self.keep(x)).float() / self.tau.float()


def _legit(model: nn.Module, backward: Any, step: Any, zero: Any) -> None:
    """After the prepared step, before ``model.zero_grad()`` (which frees the gradients no optimizer holds): an EMA
    weight swap by ``copy_`` over the whole model and back, a decoupled weight decay written by hand over every
    parameter, an ``AveragedModel`` updated; after it, the temperature set by hand."""
    averaged = torch.optim.swa_utils.AveragedModel(model)
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for i in range(3):
        x, y = _batch(i)
        backward(F.mse_loss(model(x), y))
        step()
        with torch.no_grad():
            kept = {k: v.detach().clone() for k, v in model.state_dict().items()}
            for name, p in model.named_parameters():
                p.copy_(ema[name])  # the EMA weights in, for an evaluation
            for name, p in model.named_parameters():
                p.copy_(kept[name])
            for p in model.parameters():
                p.mul_(1 - 0.05 * 0.01)
        averaged.update_parameters(model)
        zero()
        with torch.no_grad():
            model.tau.fill_(1.0 + 0.1 * i)


@pytest.mark.filterwarnings("ignore:.*require grad but no optimizer holds them")
@pytest.mark.parametrize(("opt_level", "half_dtype"), LEVELS)
def test_legitimate_writes_beside_the_step_train_as_fp32(opt_level: str, half_dtype: str) -> None:
    ref = Wide()
    ref_opt = torch.optim.SGD([*ref.trunk.parameters(), *ref.head.parameters()], lr=0.05)

    def ref_step() -> None:
        ref_opt.step()

    _legit(ref, lambda loss: loss.backward(), ref_step, ref.zero_grad)
    amp = Amp(opt_level=opt_level, half_dtype=half_dtype)
    model = amp.prepare_model(Wide())
    opt = amp.prepare_optimizer(torch.optim.SGD([*model.trunk.parameters(), *model.head.parameters()], lr=0.05))

    def step() -> None:
        amp.step(opt)
        amp.update()

    _legit(model, amp.backward, step, model.zero_grad)  # no error
    got, want = amp.fp32_state_dict(model), ref.state_dict()
    assert all(torch.allclose(got[k].float(), want[k], atol=3e-2) for k in want), {
        k: (got[k].float() - want[k]).abs().max().item() for k in want
    }


def test_fabric_raw_head_stepped_after_the_prepared_one_at_o2_is_refused() -> None:
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    fabric = Fabric(accelerator="cpu", devices=1, plugins=FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16"))
    net = Net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.trunk.parameters(), lr=0.05))
    head = torch.optim.SGD(net.head.parameters(), lr=0.05)
    with pytest.raises(RuntimeError, match=HEAD + r".*fabric\.setup\(model, optimizer, head_optimizer\)"):
        _iterate("after", fabric.backward, optimizer.step, head, optimizer.zero_grad, model)


def test_accelerate_raw_head_stepped_before_the_prepared_one_is_refused(fresh_accelerate_state: Any) -> None:
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

    accelerator = Accelerator(
        mixed_precision="O1", cpu=True, kwargs_handlers=[MixedPrecisionKwargs(half_dtype="float16")]
    )
    net = Net()
    model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.trunk.parameters(), lr=0.05))
    head = torch.optim.SGD(net.head.parameters(), lr=0.05)
    with pytest.raises(RuntimeError, match=HEAD + r".*accelerator\.prepare\(model, optimizer, head_optimizer\)"):
        _iterate("before", accelerator.backward, optimizer.step, head, optimizer.zero_grad, model)
    # refused before the prepared step ran (the head took the raw step: at 65536 its gradients overflowed to inf)
    assert torch.equal(accelerator.amp.master_of(net.trunk.weight), Net().trunk.weight)


def test_trainer_manual_optimization_raw_head_is_refused(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from lightning_mpx import MixedPrecisionPlugin

    class Manual(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.net = Net()
            self.head_opt: Any = None

        def training_step(self, batch: Any, _: int) -> None:
            opt = self.optimizers()
            if self.head_opt is None:  # the head's optimizer built by hand, never returned by configure_optimizers
                self.head_opt = torch.optim.SGD(self.net.head.parameters(), lr=0.05)
            self.manual_backward(F.mse_loss(self.net(batch[0]), batch[1]))
            opt.step()
            self.head_opt.step()
            opt.zero_grad()
            self.head_opt.zero_grad()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.net.trunk.parameters(), lr=0.05)

    data = torch.utils.data.DataLoader([_batch(i) for i in range(4)], batch_size=None)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=4, plugins=[MixedPrecisionPlugin("O1", half_dtype=torch.float16)],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match=r"(?s)'net\.head\.weight'.*which no optimizer prepared.*configure_optim"):
        trainer.fit(Manual(), data)


def test_a_backbone_left_requiring_grad_pays_a_fixed_few_calls_per_step() -> None:
    """A backbone left requiring grad (its gradients never cleared: the prepared optimizer's ``zero_grad`` clears its
    own): its gradients are marked once, so a step pays the same calls into engine/beside_steps.py at any depth."""

    def calls(layers: int) -> float:
        amp = Amp("O1", half_dtype="float16")
        model = amp.prepare_model(nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)]))
        opt = amp.prepare_optimizer(torch.optim.SGD(model[-1].parameters(), lr=1e-3))
        x = torch.randn(4, 8)
        count = [0]

        def profile(frame: Any, event: str, arg: Any) -> None:
            count[0] += event == "call" and frame.f_code.co_filename.endswith("beside_steps.py")

        for i in range(5):
            if i == 2:
                sys.setprofile(profile)
            amp.backward(model(x).float().pow(2).mean())
            amp.step(opt)
            amp.update()
            opt.zero_grad()
        sys.setprofile(None)
        return count[0] / 3

    shallow, deep = calls(2), calls(6)
    assert shallow == deep and 0 < shallow <= 3, (shallow, deep)  # before the step; after it (2)


def test_a_marked_gradient_saved_and_copied_carries_an_inert_mark(tmp_path: Path) -> None:
    """The mark in a gradient's ``__dict__`` (an empty set) travels with ``torch.save`` (``weights_only`` loads it)
    and ``copy.deepcopy`` of the model, inert: the copy's gradients freed call nothing, and training goes on."""
    amp = Amp(opt_level="O1", half_dtype="float16")
    model = amp.prepare_model(Net())
    opt = amp.prepare_optimizer(torch.optim.SGD(model.trunk.parameters(), lr=0.05))
    x, y = _batch(0)
    amp.backward(F.mse_loss(model(x), y))
    amp.step(opt)
    amp.update()
    assert hasattr(model.head.weight.grad, "_mpx_freed")
    torch.save([p.grad for p in model.parameters()], tmp_path / "grads.pt")
    loaded = torch.load(tmp_path / "grads.pt", weights_only=True)
    assert torch.equal(loaded[-1], model.head.bias.grad)
    clone = copy.deepcopy(model)
    clone.zero_grad()
    del clone, loaded
    model.zero_grad()
    amp.backward(F.mse_loss(model(x), y))
    assert amp.step(opt)


# -- DDP: one 2-rank launch (tests/fabric_raw_head_ddp_script.py), Fabric O1 float16, the raw head stepped on both ranks
@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from tests.launch import case_results

    return case_results("fabric_raw_head_ddp_script.py", tmp_path_factory.mktemp("rawhead66"), timeout=150)


@pytest.mark.parametrize("order", ["before", "after"])
def test_ddp_raw_head_on_both_ranks_refused_alike_without_a_hang(ranks: list[dict[str, Any]], order: str) -> None:
    """Both ranks raise the same error at the same iteration (before: at the first prepared step, the trunk not
    stepped; after: at the second backward), and the process group works after it (case_results checks)."""
    got = [rank[f"raw_{order}"] for rank in ranks]
    assert [r["iterations"] for r in got] == [0 if order == "before" else 1] * 2, got
    messages = [r.get("refused", "") for r in got]
    assert all("'2.weight', '2.bias', which no optimizer prepared by lightning_mpx holds" in m for m in messages)
    assert messages[0] == messages[1]
    assert [r["trunk_moved"] for r in got] == [order == "after"] * 2


def test_ddp_head_given_to_fabric_setup_trains_on_both_ranks(ranks: list[dict[str, Any]]) -> None:
    got = [rank["raw_prepared"] for rank in ranks]
    assert all(r["iterations"] == 3 and "refused" not in r and r["finite"] and r["trunk_moved"] for r in got), got
    assert all(rank["after"]["sum"] == 2 for rank in ranks)


def test_an_embedding_with_max_norm_left_out_renormalised_by_a_forward_beside_the_step_trains_on() -> None:
    """An ``nn.Embedding(max_norm=...)`` that no optimizer holds is renormalised in place by each forward (a version
    bump): a logging forward between the backward and the step, and an evaluation forward after the step before
    ``model.zero_grad()``, write it while it holds a gradient. No raw step: left out, as engine.raw_steps leaves it out
    for a held one (found while writing this task: the check before the step refused it)."""

    class Tokens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(6, 4, max_norm=0.5)
            self.head = nn.Linear(4, 1)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(ids).to(self.head.weight.dtype)).float().mean(1)

    amp = Amp(opt_level="O1", half_dtype="float16")
    model = amp.prepare_model(Tokens())
    opt = amp.prepare_optimizer(torch.optim.SGD(model.head.parameters(), lr=0.05))
    for i in range(3):
        ids = torch.randint(0, 6, (2, 3), generator=torch.Generator().manual_seed(i))
        amp.backward(model(ids).pow(2).mean())
        with torch.no_grad():
            model(ids)  # a logging forward: renormalises in place
        amp.step(opt)
        amp.update()
        with torch.no_grad():
            model(ids)  # an evaluation forward after the step
        model.zero_grad()
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("refresh", [False, True])
def test_a_clamp_of_your_own_beside_the_step_is_refused_unless_refresh_masters_takes_it(refresh: bool) -> None:
    """A parameter no optimizer holds (``keep``), clamped by hand after the step while it holds its gradient, then
    freed by ``model.zero_grad()``: its write cannot be told from a raw optimizer's (the error says so); the way out
    the error names, ``refresh_masters(force=True)`` right after the write, takes it as the user's."""
    amp = Amp(opt_level="O1", half_dtype="float16")
    model = amp.prepare_model(Wide())
    opt = amp.prepare_optimizer(torch.optim.SGD([*model.trunk.parameters(), *model.head.parameters()], lr=0.05))

    def run() -> None:
        for i in range(2):
            x, y = _batch(i)
            amp.backward(F.mse_loss(model(x), y))
            amp.step(opt)
            amp.update()
            with torch.no_grad():
                model.keep.weight.clamp_(-0.3, 0.3)
            if refresh:
                amp.refresh_masters(force=True)
            model.zero_grad()

    if refresh:
        run()
        assert model.keep.weight.abs().max() <= 0.3
    else:
        refused = r"(?s)'keep\.weight', which no.*after the step.*refresh_masters\(force=True\)"
        with pytest.raises(RuntimeError, match=refused):
            run()
