"""``p in optimizer.state`` and ``optimizer.state.get(p)`` by a model parameter at O2 (a ``StateByMasters``,
lightning_mpx/masters/state_keys.py): the optimizer's groups hold the half parameters outside the step and its state
is kept by their FP32 masters. Both answered by ``p`` alone before, so two common habits were silently wrong at O2:
``if p in optimizer.state: del optimizer.state[p]`` reset nothing, and ``optimizer.state.get(p, {}).get("exp_avg")``
gave ``None``. Now the master's entry answers both (neither makes one), as an FP32 (or ``"bf16-mixed"``) run's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.test_core_state_by_param_stateful import _Run


def _weights_close(ours: _Run, twin: _Run) -> float:
    return max((a - b).abs().max().item() for a, b in zip(ours.weights(), twin.weights(), strict=True))


def test_core_o2_guarded_reset_and_get_match_an_fp32_run():
    """AdamW at O2 bfloat16 beside an FP32 autocast twin: the moments read by ``.get(p, {})`` are the twin's, a reset
    guarded by ``p in optimizer.state`` resets (the next steps are a fresh Adam's, as the twin's), and lookups of a
    parameter without state (a group added, not stepped yet; a parameter of no group) make no entry."""
    ours, twin = (_Run(half, "adamw", frozen_first=False, unfrozen=False) for half in (True, False))
    for seed in range(2):
        for run in (ours, twin):
            run.iteration(seed)
            run.opt.zero_grad()
    for (name, p), r in zip(ours.named().items(), twin.named().values(), strict=True):
        got, want = ours.opt.state.get(p, {}).get("exp_avg"), twin.opt.state.get(r, {}).get("exp_avg")
        assert got is not None and got.dtype == torch.float32, f"{name}: get gave {got!r}"
        torch.testing.assert_close(got, want, rtol=0.05, atol=1e-5)
    for run in (ours, twin):  # a reset of the first layer's weight, as user code guards it
        p = run.model[0].weight
        assert p in run.opt.state
        del run.opt.state[p]
        assert p not in run.opt.state and run.opt.state.get(p) is None
    assert len(ours.opt.state) == len(twin.opt.state) == 1
    # not in any group, and a group added but not stepped: False / the default, and nothing made
    for run in (ours, twin):
        last = run.model[2]
        assert last.weight not in run.opt.state and run.opt.state.get(last.weight, "none") == "none"
        last.requires_grad_(True)
        run.opt.add_param_group({"params": list(last.parameters())})
        assert last.weight not in run.opt.state and run.opt.state.get(last.weight) is None
    assert len(ours.opt.state) == len(twin.opt.state) == 1
    for seed in range(2, 4):
        for run in (ours, twin):
            run.iteration(seed)
            run.opt.zero_grad()
    for run in (ours, twin):
        assert int(run.opt.state.get(run.model[0].weight)["step"]) == 2  # reset: counted from the reset
        assert int(run.opt.state.get(run.model[0].bias)["step"]) == 4
    assert _weights_close(ours, twin) < 2e-3  # a reset in one run only: off by whole Adam steps (~0.04)


def test_fabric_o2_get_and_membership_match_bf16_mixed():
    """Through Fabric's optimizer wrapper (a user's logging or reset code): ``.get(p)`` gives the moments and ``in``
    the membership ``"bf16-mixed"`` gives, and the guarded reset resets."""
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin
    from tests.test_core_state_by_param import _net

    def run(precision: object) -> tuple[list, object]:
        plugins = {"plugins": [precision]} if not isinstance(precision, str) else {"precision": precision}
        fabric = Fabric(accelerator="cpu", devices=1, **plugins)
        model = fabric.setup_module(_net())
        optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
        params = list(model.parameters())
        for i in range(3):
            g = torch.Generator().manual_seed(i)
            fabric.backward(F.mse_loss(model(torch.randn(4, 8, generator=g)).float(), torch.zeros(4, 4)))
            optimizer.step()
            optimizer.zero_grad()
            if i == 1 and params[0] in optimizer.state:
                del optimizer.state[params[0]]
        return params, optimizer

    params, optimizer = run(FabricMixedPrecisionPlugin("O2", half_dtype=torch.bfloat16))
    ref_params, ref_optimizer = run("bf16-mixed")
    for p, r in zip(params, ref_params, strict=True):
        assert p in optimizer.state and r in ref_optimizer.state
        got, want = optimizer.state.get(p), ref_optimizer.state.get(r)
        assert int(got["step"]) == int(want["step"])
        torch.testing.assert_close(got["exp_avg"], want["exp_avg"], rtol=0.1, atol=1e-4)
    assert int(optimizer.state.get(params[0])["step"]) == 1  # reset after the second step
