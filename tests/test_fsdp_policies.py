"""lightning_mpx.integrations.fsdp: the FSDP policies of each opt level, shard_model and check_sharded_model.

In one process (a gloo group of world size 1, where ``fully_shard`` and FSDP1 run as they do on more ranks), plus
one two-process launch (tests/fsdp_policies_script.py) that measures what each rank holds at O2.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from lightning_mpx import Amp, MixedPrecisionSettings
from lightning_mpx.integrations.fsdp import (
    check_sharded_model,
    fsdp1_mixed_precision,
    mixed_precision_policy,
    shard_model,
)
from lightning_mpx.masters.weights import convert_module
from tests.launch import one_process_group, rank_results, run_script

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(scope="module", autouse=True)
def process_group():
    """A gloo group of one process for the module's tests, destroyed after them."""
    with one_process_group():
        yield


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.blocks = nn.ModuleList([Block(16), Block(16)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.inp(x)))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def net() -> Net:
    torch.manual_seed(0)
    return Net()


def data(steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(steps)]


def train(model: nn.Module, amp: Amp | None, batches, record=None) -> list[float]:
    """SGD on ``batches``, the loss in FP32 on the model's output; the forward inside the engine's forward context
    (the cast table at O1), as the plugins run it."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in batches:
        with amp.forward_context() if amp is not None else contextlib.nullcontext():
            out = model(x)
        if record is not None:
            record["output"] = out.dtype
        loss = F.mse_loss(out.float(), y)
        loss.backward()
        if record is not None:
            record["grads"] = {p.grad.dtype for p in model.parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def watch(model: Net) -> dict[str, tuple[torch.dtype, torch.dtype, torch.dtype]]:
    """Forward hooks recording (input, weight, output) dtypes of the model's modules as they run."""
    seen: dict[str, tuple[torch.dtype, torch.dtype, torch.dtype]] = {}
    for name in ("inp", "bn", "blocks.0.fc", "head"):
        module = model.get_submodule(name)

        def hook(mod, args, output, name=name):
            seen[name] = (args[0].dtype, mod.weight.dtype, output.dtype)

        module.register_forward_hook(hook)
    return seen


@pytest.mark.parametrize("half", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_shard_model_runs_each_level_like_fp32(level, half):
    settings = MixedPrecisionSettings.from_kwargs(level, half_dtype=half)
    reference = train(net(), None, data())
    model = shard_model(net(), settings, blocks=Block)
    seen, record = watch(model), {}
    losses = train(model, Amp.from_settings(settings), data(), record)

    assert all(isinstance(m, FSDPModule) for m in (model, *model.blocks))
    assert isinstance(model.bn, FSDPModule) == (level != "O3")  # an FP32 island but at O3

    for name in ("inp", "blocks.0.fc", "head"):
        assert seen[name][1:] == (half, half), f"{name} computes in {seen[name][1:]}, not {half}"
    stored = {p.dtype for p in model.parameters()}
    if level == "O1":  # FP32 model gathered in half, batch norm gathered in FP32, no output casts
        assert seen["bn"] == (FP32, FP32, FP32)
        assert stored == {FP32} and record["grads"] == {FP32} and record["output"] == half
    elif level == "O2":  # FP32 shards are the masters; batch norm an FP32 island; FP32 gradients and outputs
        assert seen["bn"] == (FP32, FP32, half)
        assert seen["inp"][0] == half  # the root cast the input
        assert stored == {FP32} and record["grads"] == {FP32} and record["output"] == FP32
    else:  # O3: all half (batch norm too: keep_batchnorm_fp32=False), the root's output FP32
        assert seen["bn"] == (half, half, half)
        assert stored == {half} and record["grads"] == {half} and record["output"] == FP32
    check_sharded_model(model, settings)
    tolerance = 1e-2 if half == BF16 else 1e-3  # measured: at most 1.3e-3 (bf16), 8e-5 (fp16)
    assert losses == pytest.approx(reference, rel=tolerance)


def test_o3_with_batchnorm_kept_fp32_shards_it_on_its_own():
    settings = MixedPrecisionSettings.from_kwargs("O3", half_dtype="bfloat16", keep_batchnorm_fp32=True)
    model = shard_model(net(), settings)
    seen = watch(model)
    train(model, Amp.from_settings(settings), data(1))
    assert {p.dtype for p in model.bn.parameters()} == {FP32}
    assert seen["bn"] == (FP32, FP32, BF16) and seen["head"][1] == BF16
    check_sharded_model(model, settings)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_fp32_modules_are_fp32_units(level):
    settings = MixedPrecisionSettings.from_kwargs(level, half_dtype="bfloat16", fp32_modules=["blocks.0"])
    model = shard_model(net(), settings)
    seen = watch(model)
    train(model, Amp.from_settings(settings), data(1))
    assert isinstance(model.blocks[0], FSDPModule) and not isinstance(model.blocks[1], FSDPModule)
    assert seen["blocks.0.fc"] == (FP32, FP32, FP32)  # in FP32, the block's output cast back to half
    assert seen["head"][1:] == (BF16, BF16)
    assert {p.dtype for p in model.blocks[0].parameters()} == {FP32}
    check_sharded_model(model, settings)


def test_fp32_island_needs_its_output_cast_back_to_half():
    """Why role="fp32" casts the island's output to half: without it, the next half Linear gets FP32 inputs."""
    model = net()
    no_cast = MixedPrecisionPolicy(param_dtype=FP32, reduce_dtype=FP32)
    fully_shard(model.bn, mp_policy=no_cast)
    fully_shard(model, mp_policy=mixed_precision_policy(MixedPrecisionSettings("O2", "bfloat16"), role="root"))
    with pytest.raises(RuntimeError, match="same dtype"):
        model(torch.randn(4, 8))
    assert mixed_precision_policy(MixedPrecisionSettings("O2", "bfloat16"), role="fp32").output_dtype == BF16


def test_policies_per_level():
    o2 = MixedPrecisionSettings("O2", "bfloat16")
    assert mixed_precision_policy(o2, role="root") == MixedPrecisionPolicy(BF16, FP32, FP32, True)
    assert mixed_precision_policy(o2) == MixedPrecisionPolicy(BF16, FP32, None, True)
    assert mixed_precision_policy("O0", role="root") == MixedPrecisionPolicy()
    o1 = mixed_precision_policy(MixedPrecisionSettings("O1", "float16"))
    assert (o1.param_dtype, o1.reduce_dtype, o1.cast_forward_inputs) == (FP16, FP32, False)
    assert mixed_precision_policy("O1", gather="fp32").param_dtype is None


def test_precision_accepts_the_plugin_and_amp():
    from lightning_mpx import MixedPrecisionPlugin

    plugin = MixedPrecisionPlugin("O2", half_dtype="bfloat16")
    assert mixed_precision_policy(plugin).param_dtype == BF16
    assert mixed_precision_policy(Amp("O2", half_dtype="bfloat16")).param_dtype == BF16


# -- refusals -----------------------------------------------------------------------------------------------------
def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match=r"role='leaf'.*'root', 'block', 'fp32'"):
        mixed_precision_policy("O2", role="leaf")
    with pytest.raises(ValueError, match=r"gather='bf16'.*'half', 'fp32'"):
        mixed_precision_policy("O1", gather="bf16")
    with pytest.raises(ValueError, match="gather='fp32' does not apply at opt_level='O2'"):
        shard_model(net(), "O2", gather="fp32")
    with pytest.raises(TypeError, match="precision=3 is not valid"):
        mixed_precision_policy(3)
    with pytest.raises(ValueError, match="opt_level='O4'"):
        shard_model(net(), "O4")
    with pytest.raises(ValueError, match="blocks=.*Conv2d.*matches no submodule"):
        shard_model(net(), "O2", blocks=nn.Conv2d)
    with pytest.raises(ValueError, match="not a submodule"):
        shard_model(net(), "O2", blocks=[nn.Linear(2, 2)])
    settings = MixedPrecisionSettings.from_kwargs("O2", fp32_modules=["lm_head"])
    with pytest.raises(ValueError, match="'lm_head' match no module"):
        shard_model(net(), settings)


def test_shard_model_refuses_a_sharded_model():
    model = fully_shard(net())
    with pytest.raises(ValueError, match="already sharded"):
        shard_model(model, "O2")


def test_check_refuses_a_model_sharded_without_the_policy_at_o2():
    with pytest.raises(ValueError, match=r"without lightning_mpx's policy.*lightning_mpx\.fsdp\.shard_model"):
        check_sharded_model(fully_shard(net()), "O2")
    check_sharded_model(fully_shard(net()), "O1")  # O1 with an FP32 gather: Apex's exact O1, fine


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_check_refuses_a_gather_in_the_other_half_dtype(level):
    """shard_model(net, float16 settings) gathers in float16; an engine in bfloat16 would meet float16
    weights in its bfloat16 matmuls (O1), or run float16 compute with bfloat16's static scale (O2): refused, naming
    the unit, both dtypes and what to pass instead."""
    model = shard_model(net(), MixedPrecisionSettings(level, "float16"))
    with pytest.raises(ValueError, match=(
        rf"another half dtype than opt_level='{level}' with half_dtype=bfloat16: .*param_dtype=torch.float16.*"
        r"pass the plugin or the Amp")):
        check_sharded_model(model, MixedPrecisionSettings(level, "bfloat16"))
    check_sharded_model(model, MixedPrecisionSettings(level, "float16"))


def test_check_refuses_batchnorm_gathered_in_half():
    model = net()
    fully_shard(model, mp_policy=mixed_precision_policy("O2", role="root"))
    with pytest.raises(ValueError, match="'bn' must run in FP32 at opt_level='O2'"):
        check_sharded_model(model, "O2")


def test_check_refuses_stored_dtypes_that_do_not_fit_the_level():
    half_model = fully_shard(convert_module(net(), BF16, keep_batchnorm_fp32=False))
    settings = MixedPrecisionSettings("O2", "bfloat16")
    with pytest.raises(ValueError, match="stores half parameters .* do not cast the model to half before sharding"):
        check_sharded_model(half_model, settings)
    with pytest.raises(ValueError, match="stores half parameters .*model in FP32 at O1"):
        check_sharded_model(half_model, "O1")
    with pytest.raises(ValueError, match="stores FP32 parameters .*needs the model cast to float16"):
        check_sharded_model(shard_model(net(), "O2"), MixedPrecisionSettings("O3", "float16"))


def test_check_warns_about_half_gradient_reduction():
    model = net()
    fully_shard(model.bn, mp_policy=mixed_precision_policy("O2", role="fp32"))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=FP16))  # reduce_dtype=None: reduces in fp16
    with pytest.warns(UserWarning, match="reduces the gradients of '<root>' in half"):
        check_sharded_model(model, MixedPrecisionSettings("O2", "float16"))


def test_check_refuses_promote_at_o2():
    settings = MixedPrecisionSettings.from_kwargs("O2", on_floor="promote")
    with pytest.raises(ValueError, match="on_floor='promote' cannot work on a sharded model"):
        check_sharded_model(shard_model(net(), settings), settings)
    o1 = MixedPrecisionSettings.from_kwargs("O1", on_floor="promote")
    check_sharded_model(shard_model(net(), o1), o1)  # O1: promotion is hooks on an FP32 model, no dtype change


def test_check_refuses_an_unsharded_model():
    with pytest.raises(ValueError, match="is not sharded"):
        check_sharded_model(net(), "O2")


# -- FSDP1 ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_fsdp1_mixed_precision_runs_each_level(level):
    settings = MixedPrecisionSettings(level, "bfloat16")
    model = net()
    if level == "O3":  # FSDP1 has no policy that casts the model: it is cast before wrapping
        convert_module(model, BF16, keep_batchnorm_fp32=False)
    model = FullyShardedDataParallel(
        model,
        device_id=torch.device("cpu"),
        mixed_precision=fsdp1_mixed_precision(settings),
        auto_wrap_policy=ModuleWrapPolicy({Block}),  # batch norm is wrapped on its own (_module_classes_to_ignore)
    )
    seen = watch(model.module)
    losses = train(model, Amp.from_settings(settings), data(2))
    assert losses == pytest.approx(train(net(), None, data(2)), rel=1e-2)
    assert seen["head"][1:] == (BF16, BF16) and seen["inp"][1] == BF16
    assert seen["bn"][1] == (BF16 if level == "O3" else FP32)
    assert {p.dtype for p in model.parameters()} == {BF16 if level == "O3" else FP32}
    check_sharded_model(model, settings)


def test_fsdp1_without_the_policy_is_refused_at_o2():
    assert fsdp1_mixed_precision("O0") is None and fsdp1_mixed_precision("O1", gather="fp32") is None
    plain = FullyShardedDataParallel(net(), device_id=torch.device("cpu"))
    with pytest.raises(ValueError, match="without lightning_mpx's policy"):
        check_sharded_model(plain, MixedPrecisionSettings("O2", "bfloat16"))


# -- two processes ----------------------------------------------------------------------------------------------------
def test_o2_ranks_hold_fp32_shards_only(tmp_path):
    """At O2 on 2 ranks each holds half of the model's FP32 bytes, and no full-size FP32 tensor is alive."""
    run_script("fsdp_policies_script.py", tmp_path, timeout=90)
    for rank, result in enumerate(rank_results(tmp_path)):
        full = result["model_fp32_bytes"]
        assert result["local_param_bytes"] == pytest.approx(full / 2, rel=0.02), result
        assert result["local_storage_bytes"] == result["local_param_bytes"]  # the shards are not views of a copy
        assert result["full_size_fp32_tensors"] == [], result
        assert result["grad_dtypes"] == ["torch.float32"] and result["param_dtypes"] == ["torch.float32"]
        assert result["compute_dtypes"] == ["torch.bfloat16"]
        assert result["losses"][-1] < result["losses"][0]
