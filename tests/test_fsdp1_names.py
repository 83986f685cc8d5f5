"""Overflow records and telemetry of a model wrapped in FSDP1 (``FullyShardedDataParallel``) given to the core
``Amp``: named by the model the user wrote, not by FSDP1's wrapper (``_fsdp_wrapped_module.0.weight``), and an FSDP1
flat parameter (``use_orig_params=False``) by the parameters it holds. One process, a gloo group of one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mpx import Amp
from lightning_mpx.integrations.fsdp import fsdp1_mixed_precision
from tests.launch import one_process_group

pytest.importorskip("torch.distributed.fsdp")

from torch.distributed.fsdp import FullyShardedDataParallel  # noqa: E402


@pytest.fixture(scope="module")
def process_group():
    with one_process_group():
        yield


def _overflow(use_orig_params: bool) -> Amp:
    torch.manual_seed(0)
    amp = Amp("O1", half_dtype="bfloat16", loss_scale="dynamic", init_scale=2.0**4)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2), nn.ReLU(), nn.Linear(2, 2))
    wrapped = FullyShardedDataParallel(model, mixed_precision=fsdp1_mixed_precision(amp.settings),
                                       device_id=torch.device("cpu"), use_orig_params=use_orig_params)  # fmt: skip
    amp.prepare_model(wrapped)
    optimizer = amp.prepare_optimizer(torch.optim.SGD(wrapped.parameters(), lr=0.1))
    amp.request_telemetry()
    with amp.forward_context():
        loss = wrapped(torch.randn(4, 8)).float().sum()
    amp.backward(loss * float("inf"))
    assert not amp.step(optimizer)
    amp.update()
    return amp


@pytest.mark.usefixtures("process_group")
def test_records_and_telemetry_name_the_users_parameters():
    amp = _overflow(use_orig_params=True)
    assert amp.last_overflow_parameters == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    groups = {key.rsplit("/", 1)[1] for key in amp.metrics() if key.startswith(("mpx/overflow/", "mpx/underflow/"))}
    assert groups == {"0", "2", "4"}, groups  # the model's own modules (a lone wrapper would add its segment)


@pytest.mark.usefixtures("process_group")
def test_a_flat_parameter_is_named_by_what_it_holds():
    amp = _overflow(use_orig_params=False)
    assert amp.last_overflow_parameters == ["[flat: 0.weight, 0.bias, 2.weight, +3 more]"]
