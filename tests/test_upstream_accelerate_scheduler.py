"""Accelerate's own ``tests/test_scheduler.py`` (1.15), ported to the adapter: a prepared scheduler steps with its
optimizer, not on a skipped step, and once per real step under gradient accumulation, under ``mixed_precision`` O1
and O2 with float16 and bfloat16.

Upstream runs each check through ``debug_launcher`` (forked processes in a gloo group); the single-process ones run
here in the test's process, with real overflows where upstream sets ``optimizer._is_overflow`` by hand. The
multi-process variants are not ported (docs/testing.md, "Ported framework tests").
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate.state import GradientState  # noqa: E402
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin  # noqa: E402

from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # Accelerate's singleton state: none at each start
# As upstream's, the one-cycle tests step the scheduler before any optimizer step, which torch warns about.
NO_STEP_WARNING = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")

@pytest.fixture(autouse=True)
def _seeded():
    """The same weights and inputs in every run (upstream leaves the first unseeded)."""
    torch.manual_seed(0)


LEVELS_AND_HALVES = [(level, half) for level in ("O1", "O2") for half in ("float16", "bfloat16")]


def _accelerator(level, half, *, step_scheduler_with_optimizer=True, split_batches=False, **kwargs):
    # on_floor="continue": an overflow at bfloat16's static scale (its floor) skips the step and training goes on,
    # as these tests' injected overflows need (the default raises after skipping).
    return Accelerator(
        mixed_precision=level,
        kwargs_handlers=[MixedPrecisionKwargs(half_dtype=half, on_floor="continue")],
        step_scheduler_with_optimizer=step_scheduler_with_optimizer,
        dataloader_config=DataLoaderConfiguration(split_batches=split_batches),
        **kwargs,
    )


def _real_step(accelerator, model, optimizer, *, overflow):
    """A forward, backward and optimizer step; with ``overflow`` an inf in a gradient makes the step skip."""
    accelerator.backward(model(torch.ones(2, 2)).mean())
    if overflow:
        with torch.no_grad():
            next(model.parameters()).grad[0, 0] = float("inf")
    optimizer.step()
    assert optimizer.step_was_skipped is overflow
    optimizer.zero_grad()


def one_cycle_test(level, half, num_processes=1, step_scheduler_with_optimizer=True, split_batches=False):
    accelerator = _accelerator(
        level, half, step_scheduler_with_optimizer=step_scheduler_with_optimizer, split_batches=split_batches
    )
    model = torch.nn.Linear(2, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.01, steps_per_epoch=2, epochs=1)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    # Optimizer has stepped (upstream's words: it has not, and has not skipped either)
    scheduler.step()
    if step_scheduler_with_optimizer or (num_processes == 1):
        assert scheduler.scheduler.last_epoch == num_processes
    else:
        assert scheduler.scheduler.last_epoch != num_processes


def lambda_test(level, half, num_processes=1, step_scheduler_with_optimizer=True, split_batches=False):
    accelerator = _accelerator(
        level, half, step_scheduler_with_optimizer=step_scheduler_with_optimizer, split_batches=split_batches
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda n: 1 - n / 10)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    # Optimizer has stepped
    _real_step(accelerator, model, optimizer, overflow=False)
    scheduler.step()
    expected_lr = 1 - (num_processes if (step_scheduler_with_optimizer and not split_batches) else 1) / 10
    assert scheduler.get_last_lr()[0] == expected_lr

    # Optimizer has not stepped (an overflow skipped it)
    _real_step(accelerator, model, optimizer, overflow=True)
    scheduler.step()
    if not step_scheduler_with_optimizer:
        expected_lr = 1 - 2 / 10
    assert scheduler.get_last_lr()[0] == expected_lr
    assert optimizer.param_groups[0]["lr"] == expected_lr


@pytest.mark.parametrize("split_batches", [False, True])
@pytest.mark.parametrize("level, half", LEVELS_AND_HALVES)
def test_lambda_scheduler_steps_with_optimizer_single_process(level, half, split_batches):
    """tests/test_scheduler.py::SchedulerTester::test_lambda_scheduler_steps_with_optimizer_single_process: the
    schedule advances after a step taken and stays after a step skipped on overflow."""
    lambda_test(level, half, split_batches=split_batches)


@NO_STEP_WARNING
@pytest.mark.parametrize("split_batches", [False, True])
@pytest.mark.parametrize("level, half", LEVELS_AND_HALVES)
def test_one_cycle_scheduler_steps_with_optimizer_single_process(level, half, split_batches):
    """tests/test_scheduler.py::SchedulerTester::test_one_cycle_scheduler_steps_with_optimizer_single_process: an
    optimizer that has not stepped has not skipped, so the schedule advances."""
    one_cycle_test(level, half, split_batches=split_batches)


@pytest.mark.parametrize("level, half", LEVELS_AND_HALVES)
def test_lambda_scheduler_not_step_with_optimizer_single_process(level, half):
    """tests/test_scheduler.py::SchedulerTester::test_lambda_scheduler_not_step_with_optimizer_single_process:
    with ``step_scheduler_with_optimizer=False`` the schedule advances also after a skipped step."""
    lambda_test(level, half, step_scheduler_with_optimizer=False)


@NO_STEP_WARNING
@pytest.mark.parametrize("level, half", LEVELS_AND_HALVES)
def test_one_cycle_scheduler_not_step_with_optimizer_single_process(level, half):
    """tests/test_scheduler.py::SchedulerTester::test_one_cycle_scheduler_not_step_with_optimizer_single_process."""
    one_cycle_test(level, half, step_scheduler_with_optimizer=False)


@pytest.mark.parametrize("level, half", LEVELS_AND_HALVES)
def test_accumulation(level, half):
    """tests/test_scheduler.py::SchedulerTester::test_accumulation (its single-process half: upstream's
    ``debug_launcher`` call starts two processes in both of its calls, so each real step advances its 20-step
    schedule twice; here one process, a 10-step schedule). Each micro-batch runs a forward and backward (upstream
    calls ``optimizer.step()`` without a backward): the schedule ends at zero after 10 real steps whatever the
    number of micro-batches per step, and the loss scale is updated once per real step."""
    from transformers import get_linear_schedule_with_warmup

    steps = [1, 2, 4]
    for num_steps in steps:
        plugin = GradientAccumulationPlugin(num_steps=num_steps, adjust_scheduler=num_steps > 1)
        accelerator = Accelerator(
            mixed_precision=level,
            kwargs_handlers=[MixedPrecisionKwargs(half_dtype=half, init_scale=16.0, growth_interval=1)],
            gradient_accumulation_plugin=plugin,
        )
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 4)
        optimizer = torch.optim.AdamW(model.parameters(), lr=10.0)
        scheduler = get_linear_schedule_with_warmup(optimizer=optimizer, num_warmup_steps=0, num_training_steps=10)

        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        scale = accelerator.amp.scalers[0].get_scale()

        for i in range(10 * num_steps):
            with accelerator.accumulate(model):
                accelerator.backward(model(torch.ones(2, 2)).mean() * 1e-3)  # small: no step is skipped
                optimizer.step()
                assert not optimizer.step_was_skipped
                scheduler.step()
                optimizer.zero_grad()

            if i == (10 * num_steps - 2):
                assert scheduler.get_last_lr()[0] != 0
        assert scheduler.get_last_lr()[0] == 0
        # growth_interval=1: a dynamic scale (float16) doubles once per real step, below its cap; bfloat16's is static
        assert accelerator.amp.scalers[0].get_scale() == (scale * 2**10 if half == "float16" else scale)
        GradientState._reset_state()
