"""The Trainer plugin under DDP attacked as a user would (tests/hostile_redirect_ddp_script.py, one two-process
launch): Lightning reaches ``training_step`` and ``validation_step`` through DDP's ``forward`` (its forward
redirection), which the casts at the LightningModule's boundary (O2/O3) let pass. LightningModules with their layers on
themselves (``self(x)``, ``self.forward(x)``), with a child model (``self.net(tokens)``, an embedding), dict batches
with float targets: each held to the same module on one process with the global batch, and O3 to Lightning's
``"bf16-true"``. (The Fabric plugin's FSDP1 set-ups attacked with it are in tests/test_fabric_fsdp1.py's launch.)
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.launch import rank_results, run_script

pytestmark = pytest.mark.filterwarnings("ignore")

BF16_TOL = 1.5e-2  # a few bfloat16 ulps of the weights (~1): DDP reduces bfloat16 gradients, one process does not


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for pa, pb in zip(a, b) for x, y in zip(pa, pb))


# -- 1. Trainer plugin, DDP's forward redirection -----------------------------------------------------------------
@pytest.fixture(scope="module")
def ddp(tmp_path_factory: Any) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("redirect_ddp")
    run_script("hostile_redirect_ddp_script.py", out, timeout=300)
    ranks = rank_results(out)
    for case, result in ranks[0].items():
        assert "error" not in result, f"{case}: {result.get('trace', result.get('error'))}"
    return ranks


def _one_process(case: str) -> dict[str, Any]:
    import logging

    from tests.hostile_redirect_ddp_script import fit, result

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    return result(fit(case)[0])


@pytest.mark.parametrize("model", ["flat_self", "flat_forward", "tokens_net", "tokens_self"])
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_ddp_steps_see_the_batch_as_on_one_device_and_train_as_one_process(ddp, level, model):
    case = f"{level}:{model}"
    r0, r1 = ddp[0][case], ddp[1][case]
    one = _one_process(case)
    # the step and validation step, reached through DDP's forward, get the batch as it is (float targets not cast to
    # half, tokens integer) and the model's output in FP32, as on one device
    x = "torch.int64" if model.startswith("tokens") else "torch.float32"
    expected = sorted(f"{step}:{name}:{dtype}" for step in ("train", "val")
                      for name, dtype in (("x", x), ("y", "torch.float32"), ("pred", "torch.float32")))  # fmt: skip
    assert r0["seen"] == r1["seen"] == one["seen"] == expected
    assert r0["params"] == r1["params"]
    assert _max_diff(r0["params"], one["params"]) < BF16_TOL
    assert _max_diff(one["params"], one["initial"]) > 3 * BF16_TOL  # it trained well past the tolerance
    # each validation batch's loss: the two ranks' halves averaged are the one process's global batch
    assert len(one["val_losses"]) == len(r0["val_losses"]) == 4  # sanity check (2) and one epoch (2)
    for whole, a, b in zip(one["val_losses"], r0["val_losses"], r1["val_losses"]):
        assert abs(whole - (a + b) / 2) < 2e-2 * max(1.0, whole)


@pytest.mark.parametrize("model", ["flat_self", "tokens_net"])
def test_ddp_o3_matches_lightnings_bf16_true(ddp, model):
    o3, own = ddp[0][f"O3:{model}"], ddp[0][f"bf16-true:{model}"]
    assert _max_diff(o3["params"], own["params"]) < BF16_TOL
    for a, b in zip(o3["val_losses"], own["val_losses"]):
        assert abs(a - b) < 2e-2 * max(1.0, b)
