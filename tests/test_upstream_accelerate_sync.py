"""Accelerate's own gradient-synchronisation checks (``src/accelerate/test_utils/scripts/test_sync.py``, 1.15, run
by ``tests/test_grad_sync.py::SyncScheduler::test_gradient_sync_cpu_noop``), their single-process part, ported to the
adapter: ``no_sync`` and ``accumulate`` under ``mixed_precision`` O1 and O2 with float16 and bfloat16.

The reference model is a plain FP32 model with a plain ``loss.backward()`` (upstream calls ``accelerator.backward``
on it too, which with an opt level would scale its loss as well); the prepared model's gradients are compared with it
once divided by the loss scale, to the half dtype's tolerance. The multi-process checks are not ported
(docs/testing.md, "Ported framework tests").
"""

from __future__ import annotations

from copy import deepcopy

import pytest
import torch
import torch.nn.functional as F
from torch.optim import AdamW
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader

pytest.importorskip("accelerate")

from accelerate.state import GradientState  # noqa: E402
from accelerate.test_utils import RegressionDataset, RegressionModel  # noqa: E402
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, set_seed  # noqa: E402

from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("fresh_accelerate_state"),  # Accelerate's singleton state: none at each start
    pytest.mark.parametrize("level, half", [(lv, h) for lv in ("O1", "O2") for h in ("float16", "bfloat16")]),
]
# Relative tolerance of a gradient computed in the half dtype (O1's matmuls, O2's half model) against FP32.
RTOL = {"float16": 2e-3, "bfloat16": 2e-2}


def _accelerator(level, half, growth_interval=2000, **kwargs):
    # A loss scale of 2**8: upstream's gradients (about 6 a sample at the start, summed over three backward passes)
    # times float16's initial 2**16 overflow in a half model, which upstream's FP32 model never meets.
    settings = MixedPrecisionKwargs(half_dtype=half, init_scale=2.0**8, growth_interval=growth_interval)
    return Accelerator(mixed_precision=level, kwargs_handlers=[settings], **kwargs)


def _unscaled_grads(accelerator, model):
    """The prepared model's gradients as FP32 true values (they are scaled until the optimizer step unscales)."""
    scale = accelerator.amp.scalers[0].get_scale()
    return [p.grad.float() / scale for p in model.parameters() if p.requires_grad]


def check_model_parameters(accelerator, model_a, model_b, did_step, iteration, rtol):
    for ref_grad, grad in zip((p.grad for p in model_a.parameters() if p.requires_grad),
                              _unscaled_grads(accelerator, model_b)):
        if not did_step:
            # Grads should not be in sync
            assert torch.allclose(ref_grad, grad, rtol=rtol) is False, iteration
        else:
            # Grads should be in sync
            assert torch.allclose(ref_grad, grad, rtol=rtol, atol=1e-6) is True, (iteration, ref_grad, grad)


def step_model(model, input, target, accelerator, do_backward=True):
    model.train()
    output = model(input)
    loss = F.mse_loss(output, target.to(output.device))
    if not do_backward:
        loss /= accelerator.gradient_accumulation_steps
        loss.backward()
    else:
        accelerator.backward(loss)


def get_training_setup(accelerator, sched=False):
    "Returns everything needed to perform basic training"
    set_seed(42)
    model = RegressionModel()
    ddp_model = deepcopy(model)
    dset = RegressionDataset(length=80, seed=42)  # upstream draws other data in each run
    dataloader = DataLoader(dset, batch_size=16)
    model.to(accelerator.device)
    if sched:
        opt = AdamW(params=model.parameters(), lr=1e-3)
        ddp_opt = AdamW(params=ddp_model.parameters(), lr=1e-3)
        sched = LambdaLR(opt, lr_lambda=lambda epoch: epoch**0.65)
        ddp_sched = LambdaLR(ddp_opt, lr_lambda=lambda epoch: epoch**0.65)
    # Make a copy of `model`
    if sched:
        ddp_model, ddp_opt, ddp_sched, dataloader = accelerator.prepare(ddp_model, ddp_opt, ddp_sched, dataloader)
    else:
        ddp_model, dataloader = accelerator.prepare(ddp_model, dataloader)
    if sched:
        return (model, opt, sched, dataloader, ddp_model, ddp_opt, ddp_sched)
    return model, ddp_model, dataloader


def test_noop_sync(level, half):
    """test_utils/scripts/test_sync.py::test_noop_sync: on one process ``no_sync`` changes nothing, so the prepared
    model's gradients, accumulated over three backward passes, follow the FP32 model's."""
    accelerator = _accelerator(level, half)
    model, ddp_model, dataloader = get_training_setup(accelerator)
    # Use a single batch
    ddp_input, ddp_target = next(iter(dataloader)).values()
    for iteration in range(3):
        # Gather the distributed inputs and targs for the base model
        input, target = accelerator.gather((ddp_input, ddp_target))
        input, target = input.to(accelerator.device), target.to(accelerator.device)
        # Perform our initial ground truth step in non "DDP"
        step_model(model, input, target, accelerator, do_backward=False)
        # Do "gradient accumulation" (noop)
        if iteration % 2 == 0:
            # Accumulate grads locally
            with accelerator.no_sync(ddp_model):
                step_model(ddp_model, ddp_input, ddp_target, accelerator)
        else:
            # Sync grads
            step_model(ddp_model, ddp_input, ddp_target, accelerator)

        # Since `no_sync` is a noop, `ddp_model` and `model` grads should always be in sync
        check_model_parameters(accelerator, model, ddp_model, True, iteration, RTOL[half])

        # Shuffle ddp_input on each iteration
        torch.manual_seed(1337 + iteration)
        ddp_input = ddp_input[torch.randperm(len(ddp_input))]


def test_dataloader_break(level, half):
    """test_utils/scripts/test_sync.py::test_dataloader_break: ``gradient_state`` follows the active dataloader
    and its end, also with a second dataloader iterated inside the first."""
    accelerator = _accelerator(level, half)
    first_dset = RegressionDataset(length=80)
    first_dataloader = DataLoader(first_dset, batch_size=16)
    second_dset = RegressionDataset(length=96)
    second_dataloader = DataLoader(second_dset, batch_size=16)
    first_dataloader, second_dataloader = accelerator.prepare(first_dataloader, second_dataloader)

    assert accelerator.gradient_state.active_dataloader is None
    for iteration, _ in enumerate(first_dataloader):
        assert id(accelerator.gradient_state.active_dataloader) == id(first_dataloader)
        if iteration < len(first_dataloader) - 1:
            assert not accelerator.gradient_state.end_of_dataloader
            if iteration == 1:
                for batch_num, _ in enumerate(second_dataloader):
                    assert id(accelerator.gradient_state.active_dataloader) == id(second_dataloader)
                    if batch_num < len(second_dataloader) - 1:
                        assert not accelerator.gradient_state.end_of_dataloader
                    else:
                        assert accelerator.gradient_state.end_of_dataloader
        else:
            assert accelerator.gradient_state.end_of_dataloader
    assert accelerator.gradient_state.active_dataloader is None


def test_gradient_accumulation_with_opt_and_scheduler(level, half):
    """test_utils/scripts/test_sync.py::test_gradient_accumulation_with_opt_and_scheduler (its single-process
    call: ``split_batches``, ``dispatch_batches`` and ``sync_each_batch`` off): under ``accumulate`` with two
    micro-batches a step, the prepared optimizer and scheduler step only on the synchronising micro-batch, so the
    learning rate follows the reference's. Also: between real steps the prepared model does not change, no step
    is skipped, and the loss scale is updated once per real step."""
    gradient_accumulation_plugin = GradientAccumulationPlugin(num_steps=2, sync_each_batch=False)
    dataloader_config = DataLoaderConfiguration(split_batches=False, dispatch_batches=False)
    accelerator = _accelerator(
        level,
        half,
        growth_interval=1,  # float16's dynamic scale doubles at each real step, bfloat16's static one stays
        dataloader_config=dataloader_config,
        gradient_accumulation_plugin=gradient_accumulation_plugin,
    )
    # Test that context manager behaves properly
    model, opt, sched, dataloader, ddp_model, ddp_opt, ddp_sched = get_training_setup(accelerator, True)
    real_steps = 0
    for iteration, batch in enumerate(dataloader):
        ddp_input, ddp_target = batch.values()
        # Gather the distributed inputs and targs for the base model
        input, target = accelerator.gather((ddp_input, ddp_target))
        input, target = input.to(accelerator.device), target.to(accelerator.device)
        # Perform our initial ground truth step in non "DDP"
        model.train()
        ddp_model.train()
        step_model(model, input, target, accelerator, False)
        opt.step()

        if ((iteration + 1) % 2 == 0) or ((iteration + 1) == len(dataloader)):
            for _ in range(accelerator.num_processes):
                sched.step()

        # Perform gradient accumulation under wrapper
        before = [p.detach().clone() for p in ddp_model.parameters()]
        with accelerator.accumulate(ddp_model):
            step_model(ddp_model, ddp_input, ddp_target, accelerator)
            ddp_opt.step()
            ddp_sched.step()
            synced = accelerator.sync_gradients

        # Learning rates should be the same
        assert opt.param_groups[0]["lr"] == ddp_opt.param_groups[0]["lr"]
        did_step = (((iteration + 1) % 2) == 0) or ((iteration + 1) == len(dataloader))
        assert synced is did_step
        if not did_step:
            assert all(torch.equal(a, p) for a, p in zip(before, ddp_model.parameters()))
        else:
            real_steps += 1
            assert ddp_opt.step_was_skipped is False

        if did_step:
            opt.zero_grad()  # flush gradients every accum step
        ddp_opt.zero_grad()

        # Shuffle ddp_input on each iteration
        torch.manual_seed(1337 + iteration)
    assert real_steps == 3 and accelerator.mpx_metrics()["mpx/skipped_steps"] == 0
    assert accelerator.amp.scalers[0].get_scale() == (2.0**8 * 2**real_steps if half == "float16" else 1.0)
    GradientState._reset_state()
