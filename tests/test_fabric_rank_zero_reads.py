"""Helper attack64: a hostile user of stop 63's surfaces (Fabric's optimizers met at ``fabric.setup``, rank-0-only
reads, peft merges at O2, exports that leave the masters alone, ``Amp.true_grads``, misspelt keywords).

Found and fixed:

1. Under DDP, ``mpx.metrics()`` read on rank 0 alone between ``opt_a.step()`` and the first step of an optimizer set
   up apart (``fabric.setup_optimizers``) over parameters that got no gradient yet ended the iteration on rank 0 only
   (no gradient waited, so no step seemed to follow); the late step then opened a second iteration there: rank 0's
   scale ran a factor 2 ahead of rank 1's for good, and DDP averaged gradients carrying two scales (weights parted).
   A read under a process group now never ends the iteration (``tests/fabric_rank_zero_reads_script.py``).
2. A weight moved by ``torch.nn.utils.parametrize`` (``spectral_norm``) after set-up at O2: its FP32 value loaded
   went into the half parameter rounded, not into its master. After ``fabric.load`` the plugin's check refused to
   train on, saying the model's weights were not loaded (they were); after ``accelerator.load_state`` the run went on
   from the rounding, silently (the resumed weights parted from the uninterrupted run's).
3. ``Amp.true_grads(params)`` returned the gradients of parameters without a master (O1's FP32 model, batch norm at
   O2) with the loss scale still in them between the backward and the unscale (x1024); one tensor given for an
   iterable gave a list of ``None`` (its rows), ``named_parameters()`` an ``AttributeError``.
4. A misspelt keyword of ``fabric.backward``/``accelerator.backward``/``Amp.backward`` (``loss_idx=1``) got torch's
   ``Tensor.backward() got an unexpected keyword argument``, naming neither ``loss_id`` nor the valid ones; an
   ``MpxTrainer`` given ``opt_lvl=`` or ``half_dtype=`` got the Trainer's, naming neither ``opt_level`` nor
   ``mpx_kwargs``.
5. peft's ``add_weighted_adapter`` at O2 combined the adapters' half copies: the new adapter, and its merge, were not
   the FP32 combination of the masters (a bfloat16 ulp off, ``"svd"`` an SVD of rounded products).

Tiny models on CPU, bfloat16 unless the scale is the point.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_mpx import Amp, FabricMixedPrecisionPlugin
from tests.launch import case_results


def _net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)


# -- 1. rank-0-only reads under DDP: one launch -------------------------------------------------------------------
@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out: Path = tmp_path_factory.mktemp("attack64")
    return case_results("fabric_rank_zero_reads_script.py", out, timeout=150)


@pytest.mark.parametrize("case", ["unmet_nograd", "accum_skip", "two_opts_skip"])
def test_rank_zero_reads_part_no_ranks(launched: list[dict[str, Any]], case: str) -> None:
    """Rank 0 reads (``metrics()``, ``scaler.get_scale()``, ``state_dict()``, ``step_was_skipped``), rank 1 does not:
    the scale after every ``fabric.backward``, the skip count and the final weights are the same on both ranks (an
    overflow on rank 1 only; fused AdamW skipped on the device: no hang). Before, ``unmet_nograd``'s first read ended
    the iteration on rank 0 alone: its scale ran 2x ahead (16384 against 8192 after 6 steps), the weights parted."""
    zero, one = launched[0][case], launched[1][case]
    assert zero["live"] == one["live"] and zero["skipped"] == one["skipped"]
    assert zero["final"] == one["final"]
    live = zero["live"]
    assert any(b < a for a, b in zip(live, live[1:])) and max(live) > live[0]  # backed off at the overflow, and grew


def test_rank_zero_reads_show_the_scale_the_update_leaves(launched: list[dict[str, Any]]) -> None:
    """Each read after an iteration's steps shows the scale that iteration's update leaves: what every rank's scale is
    after the next ``fabric.backward``."""
    unmet, accum = launched[0]["unmet_nograd"], launched[0]["accum_skip"]
    assert unmet["reads"] == unmet["live"][1:]  # read between opt_a's step and opt_b's: the iteration's update
    after_steps = accum["reads"][3::5]  # per iteration: 2 backward reads, after the clip, after the steps, skipped
    assert after_steps == accum["live"][2::2]
    assert accum["reads"][4::5] == [False, False, True, False, False, False]  # rank 1's overflow skipped it


# -- 2. a weight moved by parametrize after fabric.setup, saved and resumed ---------------------------------------
def _spectral_run(door: str, start: int, stop: int, load: Path | None = None, save: Path | None = None) -> Any:
    """O2 bfloat16 through ``door`` (the Fabric plugin, the Accelerate adapter), ``spectral_norm`` on the head after
    set-up, steps ``start`` to ``stop``: the FP32 weights (a fresh model with other weights loads ``load`` first)."""
    net = _net(0 if load is None else 7)
    if door == "fabric":
        mpx = FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx])
        model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        amp, backward, state = mpx.amp, fabric.backward, {"model": model, "optimizer": optimizer, "mpx": mpx}
    else:
        from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
        from tests.accelerate_helpers import reset_accelerate_state

        reset_accelerate_state()
        accelerator = Accelerator(mixed_precision="O2", kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16")])
        model, optimizer = accelerator.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        amp, backward = accelerator.amp, accelerator.backward
    torch.manual_seed(1)  # spectral_norm's power-iteration vectors
    nn.utils.parametrizations.spectral_norm(net[2])
    if load is not None:
        fabric.load(load, state) if door == "fabric" else accelerator.load_state(str(load))
    for step in range(start, stop):
        x, y = _batch(step)
        backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    if save is not None:
        fabric.save(save, state) if door == "fabric" else accelerator.save_state(str(save))
    return amp.fp32_state_dict(net)


@pytest.mark.parametrize("door", ["fabric", "accelerate"])
def test_o2_parametrized_after_setup_resumes_bit_exact(tmp_path: Path, door: str, request: Any) -> None:
    """2 steps, save (``fabric.save``, ``accelerator.save_state``), a fresh run (other weights, the same habit) loads
    it, 2 more steps: the FP32 weights of 4 steps, bit for bit. Before, the moved weight loaded rounded: under Fabric
    the resumed run's first forward raised "the model's weights were not loaded", under Accelerate it trained on from
    the rounding."""
    if door == "accelerate":
        request.getfixturevalue("fresh_accelerate_state")
    whole = _spectral_run(door, 0, 4)
    _spectral_run(door, 0, 2, save=tmp_path / "ckpt")
    resumed = _spectral_run(door, 2, 4, load=tmp_path / "ckpt")
    assert resumed.keys() == whole.keys() and "2.parametrizations.weight.original" in whole
    for name, value in whole.items():
        assert torch.equal(resumed[name], value), name


def test_o2_load_raw_into_a_parametrized_weight_reaches_its_master(tmp_path: Path) -> None:
    """``fabric.load_raw`` of FP32 weights into a model parametrized after ``fabric.setup``: every master (the moved
    weight's too) is the loaded FP32 value exactly, not its bfloat16 rounding."""
    mpx = FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx])
    net = _net()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    nn.utils.parametrize.register_parametrization(net[2], "weight", nn.Identity())
    wanted = {k: torch.randn_like(v, dtype=torch.float32) for k, v in net.state_dict().items()}
    torch.save(wanted, tmp_path / "fp32.pt")
    fabric.load_raw(tmp_path / "fp32.pt", model)
    got = mpx.fp32_state_dict(net)
    for name, value in wanted.items():
        assert torch.equal(got[name], value), name


# -- 3. Amp.true_grads --------------------------------------------------------------------------------------------
class _BnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.norm, self.head = nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(x)))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_true_grads_between_backward_and_step_are_fp32_training_s(level: str) -> None:
    """float16 at a scale of 1024: ``amp.true_grads(model.parameters())`` after the backward, after the unscale and
    after the step are the FP32 run's gradients to float16's tolerance, batch norm's (no master at O2) included.
    Before, those without a master came back x1024 until the unscale."""
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    reference = _BnNet()
    F.mse_loss(reference(x), torch.zeros(8, 2)).backward()
    want = [p.grad for p in reference.parameters()]
    model = _BnNet()
    amp = Amp(level, half_dtype="float16", init_scale=2.0**10)
    amp.prepare_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    amp.prepare_optimizer(optimizer)
    out = model(x.half() if level == "O2" else x).float()
    amp.backward(F.mse_loss(out, torch.zeros(8, 2)))
    for when in ("backward", "unscale", "step"):
        if when == "unscale":
            amp.unscale_(optimizer)
        elif when == "step":
            amp.step(optimizer)
        got = amp.true_grads(model.parameters())
        for grad, expected in zip(got, want, strict=True):
            assert grad is not None and grad.dtype == torch.float32, when
            torch.testing.assert_close(grad, expected, atol=2e-3, rtol=2e-2, msg=when)
    optimizer.zero_grad(set_to_none=True)
    assert amp.true_grads(model.parameters()) == [None] * 6


def test_true_grads_refuses_what_is_not_an_iterable_of_tensors() -> None:
    amp = Amp("O2", half_dtype="bfloat16")
    model = amp.prepare_model(_net())
    with pytest.raises(TypeError, match=r"one tensor .* pass \[param\]"):
        amp.true_grads(model[0].weight)
    with pytest.raises(TypeError, match=r"named_parameters\(\) gives \(name, parameter\) pairs"):
        amp.true_grads(model.named_parameters())
    with pytest.raises(TypeError, match="params=Sequential"):
        amp.true_grads(model)


# -- 4. misspelt keywords -----------------------------------------------------------------------------------------
def _two_loss_run(mistake: bool) -> dict[str, torch.Tensor]:
    mpx = FabricMixedPrecisionPlugin("O2", half_dtype="float16", num_losses=2, init_scale=2.0**8, growth_interval=1)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx])
    net = _net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for step in range(2):
        x, y = _batch(step)
        loss = F.cross_entropy(model(x), y)
        if mistake:
            with pytest.raises(
                TypeError, match=r"'loss_idx'; valid choices: loss_id, gradient, .*Did you mean loss_id"
            ):
                fabric.backward(loss, loss_idx=1)
        fabric.backward(loss, loss_id=1)
        optimizer.step()
        optimizer.zero_grad()
    return {**mpx.fp32_state_dict(net), "scale": torch.tensor([s.get_scale() for s in mpx.amp.scalers])}


def test_a_misspelt_backward_keyword_names_loss_id_and_changes_nothing() -> None:
    """``fabric.backward(loss, loss_idx=1)`` (``num_losses=2``) is refused naming ``loss_id`` before anything is noted:
    the run that retries with ``loss_id=1`` trains bit for bit as the one that never erred."""
    clean, retried = _two_loss_run(False), _two_loss_run(True)
    for name, value in clean.items():
        assert torch.equal(retried[name], value), name


def test_settings_objects_name_the_valid_keywords() -> None:
    """``MixedPrecisionSettings(halfdtype=...)`` and ``ScalerSettings(init_scal=...)`` (the objects every door takes)
    name the valid keywords and the closest, as ``Amp`` and ``MixedPrecisionKwargs`` do (Python's error named none)."""
    from lightning_mpx.settings import MixedPrecisionSettings, ScalerSettings

    with pytest.raises(TypeError, match=r"MixedPrecisionSettings\(\) .*'halfdtype'; valid choices: .*half_dtype=\?"):
        MixedPrecisionSettings(opt_level="O2", halfdtype="bfloat16")
    with pytest.raises(TypeError, match=r"ScalerSettings\(\) .*'init_scal'; valid choices: .*init_scale=\?"):
        ScalerSettings(init_scal=2.0)
    settings = MixedPrecisionSettings(opt_level="O2", half_dtype="bfloat16")
    assert dataclasses.replace(settings, num_losses=2).num_losses == 2  # replace goes through the checked __init__


def test_mpx_trainer_names_opt_level_and_mpx_kwargs() -> None:
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from lightning_mpx.accelerate import mpx_trainer

    trainer_class = mpx_trainer(Trainer)
    args = TrainingArguments("unused", report_to=[], use_cpu=True)
    with pytest.raises(TypeError, match=r"'opt_lvl'; valid choices: opt_level, mpx_kwargs, .*Did you mean opt_level"):
        trainer_class(model=nn.Linear(2, 2), args=args, opt_lvl="O2")
    with pytest.raises(TypeError, match=r"mpx_kwargs=MixedPrecisionKwargs\(half_dtype=\.\.\.\)"):
        trainer_class(model=nn.Linear(2, 2), args=args, half_dtype="bfloat16")


# -- 5. peft's add_weighted_adapter at O2 -------------------------------------------------------------------------
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_o2_add_weighted_adapter_combines_the_fp32_masters() -> None:
    """Two LoRA adapters trained at O2 (bfloat16), combined with ``add_weighted_adapter``: ``"linear"`` and ``"svd"``
    give peft's FP32 combination of the masters exactly (FP32 tensors, as FP32 training's), and ``merge_and_unload``
    of it is the bfloat16 rounding of the FP32 merge; ``"cat"`` writes it into the new adapter's half weights, rounded
    once. Before, peft combined the half copies: a bfloat16 ulp off (``"svd"``: 2e-3)."""
    peft = pytest.importorskip("peft")
    from tests.test_accelerate_peft_lora import _config, _ids, _lora, _prepared, _train

    accelerator, model, optimizer = _prepared("O2", _lora())
    _train(accelerator, model, optimizer, range(2))
    inner = accelerator.unwrap_model(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inner.add_adapter("second", _config())
        inner.set_adapter("second")
        second = accelerator.prepare(torch.optim.AdamW([p for p in inner.parameters() if p.requires_grad], lr=1e-2))
        for seed in (2, 3):
            accelerator.backward(model(input_ids=_ids(seed), labels=_ids(seed)).loss)
            second.step()
            second.zero_grad()
        twin = copy.deepcopy(inner).float()  # peft's own methods, on FP32 copies of the masters
        with torch.no_grad():
            for (name, param), ours in zip(twin.named_parameters(), inner.parameters(), strict=True):
                param.copy_(accelerator.amp.master_of(ours) if ours.requires_grad or "lora" in name else ours)
        for kind in ("linear", "svd", "cat"):
            for each in (inner, twin):
                each.add_weighted_adapter(["default", "second"], [0.7, 0.3], kind, combination_type=kind)
            mine = {n: p for n, p in inner.named_parameters() if f".{kind}." in n}
            theirs = {n: p for n, p in twin.named_parameters() if f".{kind}." in n}
            assert mine.keys() == theirs.keys() and len(mine) == 2
            for name, value in theirs.items():
                want = value if kind != "cat" else value.to(torch.bfloat16)
                assert mine[name].dtype == want.dtype and torch.equal(mine[name], want), (kind, name)
        for each in (inner, twin):
            each.set_adapter("linear")
        merged = dict(inner.merge_and_unload().named_parameters())
        fp32 = dict(twin.merge_and_unload().named_parameters())
    assert isinstance(inner, peft.tuners.lora.LoraModel) or hasattr(inner, "base_model")
    for name, value in fp32.items():
        assert torch.equal(merged[name], value.to(merged[name].dtype)), name
