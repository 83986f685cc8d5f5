"""Stop 51's engine and casting changes used as a demanding user would (O3's loss promotion, complex parameters, FP32
buffers), each against a reference: the call on FP32 arguments, the loop on one process, the buffer before preparing.

Found and fixed: a complex parameter appended to an existing group's ``params`` list (the group count unchanged)
crashed the next unscale in torch's kernel ("not implemented for 'ComplexFloat'"): the engine noted complex
parameters once per number of groups, now once per number of parameters. ``shard_model`` with a complex parameter
failed inside FSDP2: a unit mixing it with real parameters with FSDP's "expects uniform original parameter dtype"
(naming neither), a unit of complex parameters only at O1/O2 in the backward ("torch.cat(): input types can't be
cast to the desired output type Float", the FP32 reduction); the first is refused naming the unit, the parameters and
the fix, the second reduces in the parameters' dtype and trains as on one process. An ``fp32_modules`` module tied
to one outside it (``lm_head`` and the embedding) failed in FSDP2, and at O3 with a message that said to call the
``shard_model`` that had been called; it is refused naming both. O3 under ``shard_model`` with
``fp32_modules``: the pinned module's parameters and buffers were the upcast of their half rounding (a weight 9.4e-4
off, a constant of 3.14159 9.7e-4 off), as without FSDP before stop 51's fix; they keep their exact values now.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_mpx import Amp
from tests.test_complex_params import Spectral, _data
from tests.test_fp32_buffers import _HFRotaryEmbedding

HALF = torch.bfloat16


# -- O3: mixed only through a weight, loss modules, kl_div's log_target, recompute -------------------------------
def test_o3_promotes_a_loss_mixed_only_through_its_weight_or_a_module_as_on_fp32_arguments() -> None:
    """At O3 a half-logit loss whose only FP32 argument is a class weight (``cross_entropy(weight=)``,
    ``pos_weight``), an ``nn.HuberLoss`` module and ``kl_div(log_target=True)`` run in FP32, bit for bit the calls on
    arguments cast to FP32 first; an integer target alone promotes nothing (the half loss is the bare call's)."""
    torch.manual_seed(0)
    amp = Amp("O3", half_dtype=HALF)
    model = amp.prepare_model(nn.Linear(8, 4))
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    weight, soft = torch.rand(4), torch.rand(6, 4).to(HALF)
    with amp.forward_context():
        logits = model(amp.cast_inputs(x))
        got = {
            "ce_weight": F.cross_entropy(logits, y, weight=weight),
            "bce_pos_weight": F.binary_cross_entropy_with_logits(logits, soft, pos_weight=weight),
            "huber_module": nn.HuberLoss()(amp.cast_outputs(logits), soft),
            "kl_log_target": F.kl_div(F.log_softmax(logits.float(), -1), soft.log(), log_target=True, reduction="sum"),
            "ce_int": F.cross_entropy(logits, y),
        }
    logits, wide = logits.detach(), soft.float()
    want = {
        "ce_weight": F.cross_entropy(logits.float(), y, weight=weight),
        "bce_pos_weight": F.binary_cross_entropy_with_logits(logits.float(), wide, pos_weight=weight),
        "huber_module": nn.HuberLoss()(logits.float(), wide),
        "kl_log_target": F.kl_div(
            F.log_softmax(logits.float(), -1), soft.log().float(), log_target=True, reduction="sum"
        ),
        "ce_int": F.cross_entropy(logits, y),
    }
    for name, value in want.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name].detach(), value), name
    assert got["ce_int"].dtype == HALF


@pytest.mark.parametrize("reentrant", [False, True])
def test_o3_recomputed_blocks_give_the_gradients_of_the_plain_forward(reentrant: bool) -> None:
    """Activation checkpointing at O3: the recompute runs under the loss mode as the forward did (a mixed loss after
    it in FP32), and the gradients are those of the same forward without checkpointing."""

    class Net(nn.Module):
        def __init__(self, ckpt: bool) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b, self.ckpt = nn.Linear(8, 8), nn.Linear(8, 4), ckpt

        def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            block = lambda z: F.gelu(self.a(z))  # noqa: E731
            h = checkpoint(block, x, use_reentrant=reentrant) if self.ckpt else block(x)
            return F.huber_loss(self.b(h).float(), t)

    x, t = torch.randn(4, 8, requires_grad=True), torch.randn(4, 4).to(HALF)
    grads = []
    for ckpt in (True, False):
        amp = Amp("O3", half_dtype=HALF)
        model = amp.prepare_model(Net(ckpt))
        with amp.forward_context():
            loss = model(amp.cast_inputs(x), t)
        amp.backward(loss)
        assert loss.dtype == torch.float32
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


# -- complex parameters --------------------------------------------------------------------------------------------
def test_o2_complex_parameter_resumes_from_a_checkpoint_as_the_run_that_went_on() -> None:
    """O2 with Adam: the engine's, optimizer's and model's state dicts after 2 steps, loaded into a fresh engine and
    model, give bit for bit the weights of the run that went on (the complex parameter its own FP32 master)."""

    def run(amp: Amp, model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            x, y = _data(step)
            with amp.forward_context():
                loss = F.cross_entropy(amp.cast_outputs(model(amp.cast_inputs(x))).float(), y)
            amp.backward(loss)
            amp.step(opt)
            amp.update()
            opt.zero_grad()

    def fresh() -> tuple[Amp, nn.Module, torch.optim.Optimizer]:
        amp = Amp("O2", half_dtype=HALF, loss_scale="dynamic")
        model = amp.prepare_model(Spectral())
        return amp, model, amp.prepare_optimizer(torch.optim.Adam(model.parameters(), lr=0.01))

    amp, model, opt = fresh()
    run(amp, model, opt, range(2))
    saved = copy.deepcopy((amp.state_dict(), opt.state_dict(), model.state_dict()))
    run(amp, model, opt, range(2, 4))
    amp2, model2, opt2 = fresh()
    model2.load_state_dict(saved[2])
    opt2.load_state_dict(saved[1])
    amp2.load_state_dict(saved[0])
    run(amp2, model2, opt2, range(2, 4))
    assert model2.phase.dtype == torch.complex64
    for name, value in model.state_dict().items():
        assert torch.equal(model2.state_dict()[name], value), name


def test_shard_model_refuses_a_unit_mixing_complex_and_real_parameters_naming_them() -> None:
    """FSDP2 shards a unit as one buffer of one dtype: a root holding the complex ``phase`` beside ``lin``'s real
    parameters is refused before any sharding, naming the unit, the parameter and ``blocks=``."""
    from lightning_mpx.integrations.fsdp import shard_model

    amp = Amp("O1", half_dtype=HALF)
    with pytest.raises(ValueError, match=r"unit '<root>' holds complex parameters \(phase\).*blocks="):
        shard_model(Spectral(), amp)


@pytest.mark.parametrize("level", ["O1", "O3"])
def test_shard_model_refuses_an_fp32_module_tied_to_one_outside_it_naming_both(level: str) -> None:
    """``fp32_modules=["head"]`` with ``head.weight`` tied to the embedding: FSDP2 keeps a parameter in one unit. It
    failed in FSDP ("already managed by another FSDP group", a fix ``shard_model`` does not take) and at O3 in the
    engine's check, which said to shard with ``shard_model`` (the call that had); refused before sharding."""
    from lightning_mpx.integrations.fsdp import shard_model

    model = nn.ModuleDict(dict(emb=nn.Embedding(16, 8), head=nn.Linear(8, 16, bias=False)))
    model.head.weight = model.emb.weight
    amp = Amp(level, half_dtype=HALF, fp32_modules=["head"])
    with pytest.raises(ValueError, match=r"unit 'head' .*shares a parameter with 'emb.weight'.*fp32_modules"):
        shard_model(model, amp)
    assert model.emb.weight.dtype == torch.float32  # refused before any cast


def test_complex_parameters_under_fsdp2_and_ddp_train_as_on_one_process(tmp_path: Path) -> None:
    """Two ranks (gloo), half a batch each, an inf in an imaginary part of rank 1's shard at step 1: under
    ``shard_model`` (the complex parameter alone in the root's unit, reduced as complex; O1's FP32 reduction failed)
    and under DDP, every rank skips that step and the parameter stays complex and ends as on one process with the
    whole batch. O3 under FSDP2 runs a loss on its FP32 output and a half target in FP32, and keeps an
    ``fp32_modules`` module's exact values."""
    from lightning_mpx.integrations.fsdp import _gathers_complex_as_is
    from tests.launch import rank_results, run_script

    gathers_complex = _gathers_complex_as_is()  # what this torch's FSDP2 does (2.12 does as 2.13), not its number
    run_script("core_o3_complex_params_script.py", tmp_path, timeout=150)
    for rank in rank_results(tmp_path):
        for level, how in (("O1", "fsdp2"), ("O3", "fsdp2"), ("O2", "ddp")):
            got, want = rank[f"{level}/{how}"], rank[f"{level}/one"]
            if how == "fsdp2" and not gathers_complex:  # 2.11's FSDP2 would drop the imaginary part: refused
                assert got["error"].startswith("ValueError: shard_model: the unit '<root>' holds complex"), got
                continue
            assert "error" not in got, got
            assert got["phase_dtype"] == "torch.complex64" and got["skipped"] == want["skipped"] == [False, True, False]
            torch.testing.assert_close(torch.tensor(got["phase"]), torch.tensor(want["phase"]), rtol=0, atol=2e-4)
            torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(want["norms"]), rtol=2e-3, atol=0)
        assert rank["o3_loss"] == {"dtype": "torch.float32", "out_dtype": "torch.float32"}
        # O3 under FSDP2 with fp32_modules: the pinned module's weight and buffer hold their exact FP32 values, as
        # without FSDP (they were the upcast of their rounding: 9.4e-4 and 9.7e-4 off).
        assert rank["pinned"] == {"dtypes": ["torch.float32"] * 2, "off": [0.0, 0.0]}


# -- FP32 buffers --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_rotary_frequencies_stay_exact_through_fp32_modules_deepcopy_and_pickle(level: str) -> None:
    """The rotary module named in ``fp32_modules``: its frequencies are the exact FP32 ones after preparing, in a deep
    copy of the prepared model and through ``torch.save``/``torch.load`` (a user's ``.to(torch.bfloat16)`` afterwards
    rounds them, as torch's ``.to`` does: the opt-out)."""
    model = nn.ModuleDict(dict(rotary=_HFRotaryEmbedding(), head=nn.Linear(8, 2)))
    exact = model.rotary.inv_freq.clone()
    Amp(level, half_dtype=HALF, fp32_modules=["rotary"]).prepare_model(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for copy_ in (model, copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        assert copy_.rotary.inv_freq.dtype == torch.float32 and torch.equal(copy_.rotary.inv_freq, exact)
        assert copy_.head.weight.dtype == HALF


def test_accelerate_fsdp_o3_keeps_an_fp32_modules_modules_exact_values() -> None:
    """The Accelerate adapter's preparation under FSDP (before Accelerate wraps the model) at O3 with
    ``fp32_modules``: the pinned module's weight and buffer should hold their FP32 values, as without FSDP."""
    from lightning_mpx.integrations.accelerate_fsdp import before_sharding
    from lightning_mpx.settings import MixedPrecisionSettings
    from tests.test_fp32_buffers import _Scaled

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _Scaled())
    weight, factor = model[1].lin.weight.detach().clone(), model[1].factor.clone()
    settings = MixedPrecisionSettings(opt_level="O3", half_dtype="bfloat16", fp32_modules=["1"])
    before_sharding(model, settings, 1, {})
    assert model[1].lin.weight.dtype == torch.float32 and model[0].weight.dtype == HALF
    assert torch.equal(model[1].lin.weight, weight) and torch.equal(model[1].factor, factor)
