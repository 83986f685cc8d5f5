"""Two of issue 41's newest changes attacked as a user would.

1. The Trainer plugin under DDP (tests/hostile_redirect_ddp_script.py, one two-process launch): Lightning reaches
   ``training_step`` and ``validation_step`` through DDP's ``forward`` (its forward redirection), which the casts at the
   LightningModule's boundary (O2/O3) let pass. LightningModules with their layers on themselves (``self(x)``,
   ``self.forward(x)``), with a child model (``self.net(tokens)``, an embedding), dict batches with float targets:
   each held to the same module on one process with the global batch, and O3 to Lightning's ``"bf16-true"``.
2. The Fabric plugin under Fabric's ``FSDPStrategy`` (FSDP1; tests/hostile_fabric_fsdp1_script.py, one launch): a GAN
   set up model by model, activation checkpointing, ``use_orig_params=False``, a model the user wrapped, two
   optimizers over one model clipped by norm, ``clip_val``, the plugin object reused for a second Fabric; each held to
   Fabric's own ``"bf16-mixed"`` under the same strategy or to the plain run.
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


# -- 2. Fabric plugin, FSDPStrategy (FSDP1) -------------------------------------------------------------------------
FSDP_CASES = ["plain:O1", "plain:bf16-mixed", "gan:O1", "gan:bf16-mixed", "checkpointed:O1", "flat:O1",
              "user_wrapped:O1", "two_optimizers:O1", "unregistered:O1", "clip_value:O1", "clip_value:bf16-mixed",
              "reused:O1"]  # fmt: skip


@pytest.fixture(scope="module")
def fsdp1(tmp_path_factory: Any) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("fabric_fsdp1")
    run_script("hostile_fabric_fsdp1_script.py", out, timeout=300, MPX_CASES=",".join(FSDP_CASES))
    ranks = rank_results(out)
    for case in FSDP_CASES:
        assert "error" not in ranks[0][case], f"{case}: {ranks[0][case]['error']}"
    for case in FSDP_CASES:  # the gathered weights, and the ranks' answers, agree
        assert ranks[0][case].get("weights") == ranks[1][case].get("weights"), case
        assert ranks[0][case].get("refusal") == ranks[1][case].get("refusal"), case
    return ranks[0]


def _close(a: list[float], b: list[float], tol: float) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol


def test_fsdp1_plain_o1_is_close_to_fabrics_bf16_mixed(fsdp1):
    plugin, own = fsdp1["plain:O1"], fsdp1["plain:bf16-mixed"]
    assert _close(plugin["norms"], own["norms"], 1e-3) and _close(plugin["weights"], own["weights"], 2e-3)
    assert min(plugin["norms"]) > 0.05  # every step clips


@pytest.mark.parametrize("kind", ["checkpointed", "flat", "user_wrapped", "reused"])
def test_fsdp1_setups_train_as_the_plain_setup(fsdp1, kind):
    # activation checkpointing (recomputed under the cast policy), use_orig_params=False (the optimizer over the flat
    # parameters), a model the user wrapped in FSDP1 before fabric.setup, and the plugin of a finished run given to a
    # second Fabric: the plain run's numbers
    run, plain = fsdp1[f"{kind}:O1"], fsdp1["plain:O1"]
    # (flat parameters: a reduction order of their own, an FP32 ulp or two)
    assert _close(run["norms"], plain["norms"], 1e-6) and _close(run["losses"], plain["losses"], 1e-6)
    assert _close(run["weights"], plain["weights"], 1e-6)
    if kind == "checkpointed":
        assert run["checkpoint_wrappers"] == 2 and plain["checkpoint_wrappers"] == 0  # it is checkpointed


def test_fsdp1_gan_set_up_model_by_model_matches_fabrics_bf16_mixed(fsdp1):
    # the generator set up, run once, then the discriminator set up: both sharded, both trained
    plugin, own = fsdp1["gan:O1"], fsdp1["gan:bf16-mixed"]
    assert _close(plugin["norms"], own["norms"], 2e-3)
    assert _close(plugin["weights"], own["weights"], 2e-3)


def test_fsdp1_two_optimizers_over_one_model_clip_the_unscaled_norm(fsdp1):
    # Fabric unscales the optimizer it is given, then clips the whole FSDP1 model: the other optimizer's gradients
    # must be unscaled too (they counted scaled: a norm of ~2000, every step clipped to almost nothing)
    two, plain, own = fsdp1["two_optimizers:O1"], fsdp1["plain:O1"], fsdp1["plain:bf16-mixed"]
    assert _close(two["norms"][0::2], own["norms"], 1e-3)
    assert _close(two["norms"][1::2], [0.05] * 4, 1e-3)  # the second clip sees the first's result
    assert _close(two["weights"], plain["weights"], 1e-4)


def test_fsdp1_two_optimizers_the_plugin_does_not_know_are_refused(fsdp1):
    refusal = fsdp1["unregistered:O1"]["refusal"]
    assert "plugin.setup_optimizers(" in refusal and "clips the whole FSDP1 model" in refusal


def test_fsdp1_clip_by_value_is_close_to_fabrics_bf16_mixed(fsdp1):
    plugin, own = fsdp1["clip_value:O1"], fsdp1["clip_value:bf16-mixed"]
    assert "refusal" not in plugin and "refusal" not in own
    assert _close(plugin["losses"], own["losses"], 2e-3) and _close(plugin["weights"], own["weights"], 2e-3)
    assert not _close(plugin["weights"], fsdp1["plain:O1"]["weights"], 1e-3)  # the clip by value changed the run
