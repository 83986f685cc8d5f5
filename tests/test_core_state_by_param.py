"""``optimizer.state[p]`` by a model parameter at O2 (stop 61): the user's optimizer holds the half model parameters
in its groups outside the step while its state is kept by the FP32 masters the step swaps in; a lookup by a half
parameter with a master now gives the master's entry (the same dict), at every door, after a checkpoint load too,
against a reference run. SAM-style optimizers keep torch's ``defaultdict`` (their ``old_p`` is the half parameter's).
"""

from __future__ import annotations

import collections
import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp
from lightning_mpx.masters.state_keys import KeyedOnCopy


def _core_steps(amp: Amp, model: nn.Module, optimizer: torch.optim.Optimizer, n: int) -> None:
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        with amp.forward_context():
            loss = amp.cast_outputs(model(amp.cast_inputs(torch.randn(4, 8, generator=g)))).float().pow(2).mean()
        amp.backward(loss)
        amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _by_param_is_masters(optimizer: torch.optim.Optimizer, params: list, masters: list, steps: int) -> None:
    for p, m in zip(params, masters):
        assert m is not p and p.dtype == torch.bfloat16
        assert optimizer.state[p] is optimizer.state[m]  # one owner: the master's entry itself
        assert int(optimizer.state[p]["step"]) == steps
        assert optimizer.state[p]["exp_avg_sq"].dtype == torch.float32


def test_core_amp_state_by_param_follows_loads_replacements_and_release():
    amp = Amp("O2", half_dtype=torch.bfloat16)
    model = amp.prepare_model(_net())
    optimizer = amp.prepare_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    params = list(model.parameters())
    _core_steps(amp, model, optimizer, 2)
    masters = amp.master_params(optimizer)
    _by_param_is_masters(optimizer, params, masters, 2)
    # membership and .get by a half parameter: its master's entry (tests/test_core_state_membership.py)
    assert params[0] in optimizer.state and optimizer.state.get(params[0]) is optimizer.state[masters[0]]
    assert len(optimizer.state) == len(masters)  # the lookups inserted nothing

    # torch's load_state_dict replaces optimizer.state with its own defaultdict: the engine's load hook re-keys it
    optimizer.load_state_dict(optimizer.state_dict())
    _by_param_is_masters(optimizer, params, masters, 2)
    _core_steps(amp, model, optimizer, 1)
    _by_param_is_masters(optimizer, params, masters, 3)
    # the user's own defaultdict put in: re-keyed at the next step
    optimizer.state = collections.defaultdict(dict, optimizer.state)
    _core_steps(amp, model, optimizer, 1)
    _by_param_is_masters(optimizer, params, masters, 4)

    # copies and pickles are torch's plain defaultdict of the same entries
    copies = copy.deepcopy(optimizer).state, pickle.loads(pickle.dumps(optimizer.state)), copy.copy(optimizer.state)
    for state in copies:
        assert type(state) is collections.defaultdict and state.default_factory is dict
        assert len(state) == len(masters)

    amp.release_optimizer(optimizer)  # keyed by its own parameters again, torch's defaultdict back
    assert type(optimizer.state) is collections.defaultdict
    assert params[0] in optimizer.state and int(optimizer.state[params[0]]["step"]) == 4


def test_sam_and_schedule_free_keep_torch_state():
    from tests.test_accelerate_schedule_free import ScheduleFreeSGD
    from tests.test_core_sam import DoorSAM

    amp = Amp("O2", half_dtype=torch.bfloat16)
    model = amp.prepare_model(_net())
    # SAM's old_p is the half parameter's (docs/master_weights.md); a schedule-free eval()/train() on the half
    # parameters must find no state (the engine redoes it on the masters: tests/test_lightning_schedule_free.py); the
    # schedule-free one's KeyedOnCopy redirects no lookup, it only re-keys its copies (tests/test_core_state_copies.py)
    for optimizer, kind in ((DoorSAM(model.parameters(), torch.optim.SGD, lr=0.1), collections.defaultdict),
                            (ScheduleFreeSGD(model.parameters()), KeyedOnCopy)):  # fmt: skip
        assert type(amp.prepare_optimizer(optimizer).state) is kind
        amp.release_optimizer(optimizer)
        assert type(optimizer.state) is collections.defaultdict


def test_accelerate_o2_exp_avg_sq_by_param_matches_bf16(fresh_accelerate_state):
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    def run(level: str) -> tuple[list, object, object]:
        reset_accelerate_state()
        kwargs = [MixedPrecisionKwargs(half_dtype=torch.bfloat16)] if level == "O2" else []
        accelerator = Accelerator(mixed_precision=level, cpu=True, kwargs_handlers=kwargs)
        net = _net()
        model, optimizer = accelerator.prepare(net, torch.optim.Adam(net.parameters(), lr=1e-2))
        for i in range(3):
            g = torch.Generator().manual_seed(i)
            accelerator.backward(model(torch.randn(4, 8, generator=g)).float().pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
        return list(accelerator.unwrap_model(model).parameters()), optimizer, accelerator

    params, optimizer, _ = run("O2")
    masters = optimizer.amp.master_params(optimizer.optimizer)
    _by_param_is_masters(optimizer, params, masters, 3)  # through the AcceleratedOptimizer, as users read it
    ref_params, ref_optimizer, _ = run("bf16")
    for p, r in zip(params, ref_params):
        got, want = optimizer.state[p]["exp_avg_sq"], ref_optimizer.state[r]["exp_avg_sq"]
        torch.testing.assert_close(got, want, rtol=0.1, atol=1e-7)


def test_lightning_o2_state_by_param_after_fit_and_resume(tmp_path):
    pytest.importorskip("lightning.pytorch")
    from lightning_mpx import MixedPrecisionPlugin
    from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer

    data = loader(classification_data(32))
    model = Classifier(optimizer="adamw", lr=1e-2)
    trainer = make_trainer(MixedPrecisionPlugin("O2", half_dtype=torch.bfloat16), max_steps=2)
    trainer.fit(model, data)
    optimizer = trainer.optimizers[0]
    masters = trainer.precision_plugin.amp.master_params(optimizer)
    _by_param_is_masters(optimizer, list(model.parameters()), masters, 2)
    trainer.save_checkpoint(tmp_path / "a.ckpt")

    resumed = Classifier(optimizer="adamw", lr=1e-2)
    trainer2 = make_trainer(MixedPrecisionPlugin("O2", half_dtype=torch.bfloat16), max_steps=3, max_epochs=2)
    trainer2.fit(resumed, data, ckpt_path=tmp_path / "a.ckpt")  # the load replaced the optimizer's state object
    optimizer2 = trainer2.optimizers[0]
    masters2 = trainer2.precision_plugin.amp.master_params(optimizer2)
    _by_param_is_masters(optimizer2, list(resumed.parameters()), masters2, 3)


def test_fabric_o2_state_by_param_matches_bf16_mixed():
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    def run(precision: object) -> tuple[list, object]:
        plugins = {"plugins": [precision]} if not isinstance(precision, str) else {"precision": precision}
        fabric = Fabric(accelerator="cpu", devices=1, **plugins)
        model = fabric.setup_module(_net())
        optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
        for i in range(2):
            g = torch.Generator().manual_seed(i)
            fabric.backward(F.mse_loss(model(torch.randn(4, 8, generator=g)).float(), torch.zeros(4, 4)))
            optimizer.step()
            optimizer.zero_grad()
        return list(model.parameters()), optimizer

    mpx = FabricMixedPrecisionPlugin("O2", half_dtype=torch.bfloat16)
    params, optimizer = run(mpx)
    _by_param_is_masters(optimizer, params, mpx.master_params(optimizer), 2)  # through Fabric's wrapper
    ref_params, ref_optimizer = run("bf16-mixed")
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(optimizer.state[p]["exp_avg"], ref_optimizer.state[r]["exp_avg"], rtol=0.1,
                                   atol=1e-4)  # fmt: skip
