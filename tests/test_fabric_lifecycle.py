"""The Fabric plugin where its features meet (issue 39): several optimizers without ``mpx.setup_optimizers``, FP32
weights loaded after ``fabric.setup`` under DDP, checkpoints taken before an optimizer's first step, clipping by
value on an overflow step, parameter-free models at O2, and what differs from Fabric's own precisions. Each is a real
``Fabric`` loop on CPU, compared with a reference: the FP32 weights given (the masters must be them, exactly), the
run that was never interrupted, Fabric's own precisions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin
from tests.launch import rank_results, run_script

HALF = "bfloat16"


def _fabric(precision: str | FabricMixedPrecisionPlugin) -> Fabric:
    if isinstance(precision, str):
        return Fabric(accelerator="cpu", devices=1, precision=precision)  # type: ignore[arg-type]
    return Fabric(accelerator="cpu", devices=1, plugins=[precision])


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``model``'s FP32 weights, checked to be values bfloat16 cannot hold (else the test could not fail)."""
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert all(not torch.equal(v.to(torch.bfloat16).float(), v) for v in weights.values())
    return weights


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def _assert_masters_are(mpx: FabricMixedPrecisionPlugin, module: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Every master of ``module`` is exactly its FP32 weight (not its bfloat16 rounding), and so is its export."""
    for name, param in module.named_parameters():
        master = mpx.amp.master_of(param)
        assert master.dtype == torch.float32 and param.dtype == torch.bfloat16, name
        assert torch.equal(master, weights[name]), f"{name}: the master is not the FP32 weight given"
    exported = mpx.amp.fp32_state_dict(module)
    for name, value in weights.items():
        assert torch.equal(exported[name], value), name


# -- item 2: several optimizers, no setup_optimizers -------------------------------------------------------------------
def test_a_second_optimizer_over_the_same_model_steps_the_exact_fp32_weights():
    """Body and head with their own optimizers, ``fabric.setup(model, opt_body, opt_head)``, no
    ``setup_optimizers``: the body steps first; the head's masters (stepped at learning rate 0) are its FP32 weights."""
    mpx = FabricMixedPrecisionPlugin("O2", half_dtype=HALF)
    fabric = _fabric(mpx)
    model = _net(0)
    weights = _weights(model)
    opt_body = torch.optim.SGD(model[0].parameters(), lr=0.1)
    opt_head = torch.optim.SGD(model[2].parameters(), lr=0.0)
    model, opt_body, opt_head = fabric.setup(model, opt_body, opt_head)
    for step in range(2):
        x, y = _batch(step)
        fabric.backward(F.cross_entropy(model(x), y))
        opt_body.step()
        opt_head.step()
        opt_body.zero_grad()
        opt_head.zero_grad()
    head = model.module[2]
    _assert_masters_are(mpx, head, {k: weights[f"2.{k}"] for k in ("weight", "bias")})


def test_a_gan_set_up_model_by_model_keeps_the_discriminators_fp32_weights():
    """``G, opt_g = fabric.setup(G, opt_g)``, then D: the generator steps first, the discriminator (learning rate
    0) after it; D's masters are D's FP32 weights."""
    mpx = FabricMixedPrecisionPlugin("O2", half_dtype=HALF)
    fabric = _fabric(mpx)
    generator, discriminator = nn.Linear(4, 8), _net(1)
    weights = _weights(discriminator)
    generator, opt_g = fabric.setup(generator, torch.optim.Adam(generator.parameters(), lr=1e-3))
    discriminator, opt_d = fabric.setup(discriminator, torch.optim.SGD(discriminator.parameters(), lr=0.0))
    for step in range(2):
        z, y = torch.randn(8, 4), _batch(step)[1]
        fabric.backward(F.cross_entropy(discriminator(generator(z)), y))  # the generator's loss
        opt_g.step()
        opt_g.zero_grad()
        discriminator.zero_grad()
        fabric.backward(F.cross_entropy(discriminator(generator(z).detach()), y))  # the discriminator's
        opt_d.step()
        opt_d.zero_grad()
    _assert_masters_are(mpx, discriminator.module, weights)


def test_a_head_set_up_mid_run_starts_from_its_fp32_weights():
    """A body trains; a head is set up after some steps (its own ``fabric.setup``); the body keeps stepping before
    the head's first step. The head's masters are its FP32 weights."""
    mpx = FabricMixedPrecisionPlugin("O2", half_dtype=HALF)
    fabric = _fabric(mpx)
    body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
    body, opt_body = fabric.setup(body, torch.optim.SGD(body.parameters(), lr=0.1))
    for step in range(2):
        x, y = _batch(step)
        fabric.backward(body(x).square().mean())
        opt_body.step()
        opt_body.zero_grad()
    torch.manual_seed(3)
    head = nn.Linear(16, 4)
    weights = _weights(head)
    head, opt_head = fabric.setup(head, torch.optim.SGD(head.parameters(), lr=0.0))
    for step in range(2, 4):
        x, y = _batch(step)
        fabric.backward(F.cross_entropy(head(body(x)), y))
        opt_body.step()  # first, in an iteration where the head's optimizer has not stepped yet
        opt_head.step()
        opt_body.zero_grad()
        opt_head.zero_grad()
    _assert_masters_are(mpx, head.module, weights)


# -- item 4: a checkpoint taken before an optimizer's first step -------------------------------------------------------
def _staged(mpx: FabricMixedPrecisionPlugin, fabric: Fabric, seed: int, *, register: bool) -> tuple[Any, ...]:
    model = _net(seed)
    opt_body = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
    opt_head = torch.optim.AdamW(model[2].parameters(), lr=1e-2)
    model, opt_body, opt_head = fabric.setup(model, opt_body, opt_head)
    if register:
        mpx.setup_optimizers(opt_body, opt_head)
        mpx.setup_optimizers(opt_head)  # again: nothing changes (idempotent)
    return model, opt_body, opt_head


def _train(fabric: Fabric, model: Any, opt_body: Any, opt_head: Any, steps: range, *, head_from: int) -> None:
    """Staged training: the body steps from the start, the head from step ``head_from``."""
    for step in steps:
        x, y = _batch(step)
        fabric.backward(F.cross_entropy(model(x), y))
        opt_body.step()
        if step >= head_from:
            opt_head.step()
        opt_body.zero_grad()
        opt_head.zero_grad()


@pytest.mark.parametrize("saved_at", [0, 2], ids=["step-0 snapshot", "head not stepped yet"])
def test_a_checkpoint_before_an_optimizers_first_step_resumes_as_the_straight_run(saved_at, tmp_path):
    """Saved before the head's optimizer has stepped (at step 0, or while only the body trains), loaded the
    documented way (``setup``, ``setup_optimizers``, ``load``) into a model built from other weights: the resumed
    run ends with the straight run's weights and masters, bit for bit."""
    total, head_from = 5, 3
    mpx = FabricMixedPrecisionPlugin("O2", half_dtype=HALF)
    fabric = _fabric(mpx)
    given = _weights(_net(0))
    straight = _staged(mpx, fabric, seed=0, register=False)
    # Before the first step: the export is the FP32 weights given, not their rounding.
    assert all(torch.equal(v, given[k]) for k, v in mpx.amp.fp32_state_dict(straight[0].module).items())
    _train(fabric, *straight, range(saved_at), head_from=head_from)
    path = tmp_path / "staged.ckpt"
    fabric.save(path, {"model": straight[0], "opt_body": straight[1], "opt_head": straight[2], "mpx": mpx})
    _train(fabric, *straight, range(saved_at, total), head_from=head_from)

    mpx2 = FabricMixedPrecisionPlugin("O2", half_dtype=HALF)
    fabric2 = _fabric(mpx2)
    resumed = _staged(mpx2, fabric2, seed=7, register=True)
    fabric2.load(path, {"model": resumed[0], "opt_body": resumed[1], "opt_head": resumed[2], "mpx": mpx2})
    _train(fabric2, *resumed, range(saved_at, total), head_from=head_from)

    for (name, a), b in zip(straight[0].module.named_parameters(), resumed[0].module.parameters()):
        assert torch.equal(a, b), name
        assert torch.equal(mpx.amp.master_of(a), mpx2.amp.master_of(b)), name


# -- item 9: clipping by value on an overflow step ---------------------------------------------------------------------
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_clip_by_value_on_an_overflow_step_skips_the_step_without_raising(level):
    """float16, a gradient made inf after the backward: ``fabric.clip_gradients(clip_val=...)`` clips nothing and
    the step is skipped (weights unchanged); the next step clips and steps as usual."""
    mpx = FabricMixedPrecisionPlugin(level, half_dtype="float16", init_scale=2.0**10)
    fabric = _fabric(mpx)
    model = _net(0)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _batch(0)
    fabric.backward(F.cross_entropy(model(x), y))
    model.module[0].weight.grad[0, 0] = float("inf")
    fabric.clip_gradients(model, optimizer, clip_val=0.01)
    optimizer.step()
    assert mpx.step_was_skipped(optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    optimizer.zero_grad()
    x, y = _batch(1)
    fabric.backward(F.cross_entropy(model(x), y))
    fabric.clip_gradients(model, optimizer, clip_val=0.01)
    grads = [p.grad for p in mpx.main_params(optimizer)]
    assert all(g is not None and g.abs().max() <= 0.01 for g in grads)
    optimizer.step()
    assert not mpx.step_was_skipped(optimizer)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_clip_by_value_trains_as_fabrics_bf16_mixed(level):
    """No overflow: clipping by value (a bound most gradients exceed) gives the weights Fabric's own "bf16-mixed"
    gives, to bfloat16's tolerance (two kernel paths)."""
    runs = {}
    for name, precision in (("mpx", FabricMixedPrecisionPlugin(level, half_dtype=HALF)), ("bf16-mixed", "bf16-mixed")):
        fabric = _fabric(precision)
        model = _net(0)
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
        for step in range(4):
            x, y = _batch(step)
            fabric.backward(F.cross_entropy(model(x), y))
            fabric.clip_gradients(model, optimizer, clip_val=0.005)
            optimizer.step()
            optimizer.zero_grad()
        module = model.module
        runs[name] = (
            precision.amp.fp32_state_dict(module) if isinstance(precision, FabricMixedPrecisionPlugin)
            else {k: v.float() for k, v in module.state_dict().items()}
        )
    start = _net(0).state_dict()
    for key, reference in runs["bf16-mixed"].items():
        assert not torch.allclose(reference, start[key]), key  # the steps moved it
        torch.testing.assert_close(runs["mpx"][key], reference, rtol=2e-2, atol=2e-3, msg=key)


def test_a_float16_loop_that_clips_by_value_goes_on_past_its_overflows():
    """A dynamic scale that starts too high overflows on the first steps: the loop backs off and trains on."""
    mpx = FabricMixedPrecisionPlugin("O2", half_dtype="float16", init_scale=2.0**24)
    fabric = _fabric(mpx)
    model = _net(0)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    skipped = []
    for step in range(10):
        x, y = _batch(step)
        fabric.backward(F.cross_entropy(model(x), y))
        fabric.clip_gradients(model, optimizer, clip_val=0.01)
        optimizer.step()
        skipped.append(mpx.step_was_skipped(optimizer))
        optimizer.zero_grad()
    assert skipped[0] and not skipped[-1], skipped  # float16's range at 2**24: seven steps back off to 2**17
    assert all(torch.isfinite(p).all() for p in model.parameters())


# -- item 10: a model without floating-point parameters ----------------------------------------------------------------
class _Scale(nn.Module):
    """Parameter-free: a floating buffer only."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("factor", torch.tensor([1.0 / 3.0, 2.0, 0.1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("make", [nn.Identity, _Scale], ids=["Identity", "buffers only"])
def test_a_parameter_free_model_is_set_up_as_fabrics_own_precisions_do(level, make):
    """``fabric.setup(nn.Identity())`` at every level; at O2/O3 the model and its output are those of Fabric's own
    "bf16-true" (buffers and inputs in bfloat16, the output in FP32); at O1 those of "32-true" (the cast table has
    no op to cast here)."""
    x = torch.randn(5, 3)
    mpx = FabricMixedPrecisionPlugin(level, half_dtype=HALF)
    model = _fabric(mpx).setup(make())
    reference = _fabric("32-true" if level == "O1" else "bf16-true").setup(make())
    for (name, a), b in zip(model.named_buffers(), reference.buffers()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    out, expected = model(x), reference(x)
    assert out.dtype == expected.dtype == torch.float32 and torch.equal(out, expected)


def test_a_parameter_free_model_next_to_a_trained_one_at_o2():
    """A parameter-free wrapper set up beside a model: the model trains and keeps its exact FP32 masters."""
    mpx = FabricMixedPrecisionPlugin("O2", half_dtype=HALF)
    fabric = _fabric(mpx)
    scale = fabric.setup(_Scale())
    model = nn.Linear(3, 4)
    weights = _weights(model)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.0))
    fabric.backward(model(scale(torch.randn(6, 3))).square().mean())
    optimizer.step()
    _assert_masters_are(mpx, model.module, weights)


# -- item 14: what differs from Fabric's own precisions (docs/fabric.md) -----------------------------------------------
class _Probe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += [x.dtype, torch.get_default_dtype()]
        return self.linear(x)


def test_o1_passes_fp32_inputs_to_the_model_where_fabrics_mixed_precision_casts_them():
    """docs/fabric.md: at O1 the cast table casts op by op (an FP32 op sees the FP32 input, not its rounding);
    Fabric's "bf16-mixed" casts every floating input to bfloat16 first."""
    seen = {}
    for name, precision in (("O1", FabricMixedPrecisionPlugin("O1", half_dtype=HALF)), ("bf16", "bf16-mixed")):
        model = _fabric(precision).setup(_Probe())
        model(torch.randn(2, 3))
        seen[name] = model.module.seen[0]
    assert seen == {"O1": torch.float32, "bf16": torch.bfloat16}


def test_o2_keeps_the_default_dtype_fp32_where_fabrics_half_precision_sets_it_to_half():
    """docs/fabric.md: the plugin reports "bf16-true" at O2, but ``fabric.init_module()`` builds the model in FP32
    (the masters start from those FP32 values) and the forward creates FP32 tensors by default; inputs reach the
    model in bfloat16 either way."""
    for precision, dtype in ((FabricMixedPrecisionPlugin("O2", half_dtype=HALF), torch.float32),
                             ("bf16-true", torch.bfloat16)):  # fmt: skip
        fabric = _fabric(precision)
        with fabric.init_module():
            model = _Probe()
        assert model.linear.weight.dtype == dtype
        model = fabric.setup(model)
        model(torch.randn(2, 3))
        assert model.module.seen == [torch.bfloat16, dtype]
    assert torch.get_default_dtype() == torch.float32


# -- item 3: FP32 weights loaded after fabric.setup under DDP (two gloo processes) -------------------------------------
def test_ddp_load_raw_after_setup_and_a_step_0_checkpoint(tmp_path: Path):
    """Two processes, ``strategy="ddp"``, no ``setup_optimizers``: pretrained FP32 weights loaded with
    ``fabric.load_raw`` after ``fabric.setup`` are the masters on both ranks (two optimizers, the second stepping
    after the first); a step-0 checkpoint taken without them resumes, the documented way, as the straight run."""
    run_script("fabric_lifecycle_ddp_script.py", tmp_path, timeout=150)  # ~15 s alone on 2 cores
    ranks = rank_results(tmp_path)
    for rank in ranks:
        assert rank["world_size"] == 2
        assert rank["exact_masters"] == rank["masters"] == 4, rank  # every master is its FP32 weight
        assert rank["exact_export"] == 4, rank
        assert rank["resumed_equal"], rank
    assert ranks[0]["params"] == ranks[1]["params"]
