"""Helper attack65b: a hostile Accelerate / HF Trainer / Apex / peft user, against Accelerate's own ``"bf16"``, FP32
and Apex's documented behaviour.

Found and fixed:

1. Apex: ``amp.initialize`` given again a model an earlier call prepared, beside a model it then refused (a lazy
   module, one on the meta device, one with nothing to cast), dropped the earlier call's hooks and optimizer wrapper
   before the refusal; the ``_Undo`` put ``_amp_state`` back, not them. A script that caught the error and trained on
   with the earlier ``(model, optimizer)`` failed at O2 in torch's ``mat1 and mat2 must have the same dtype``. These
   refusals now come before anything is touched: the earlier pair trains on as if the call had not been made.
2. A lazy module (``nn.LazyLinear``) at O2 through the Accelerate adapter, the Apex layer or the core got torch's
   ``Can't access the shape of an uninitialized parameter ... in load_state_dict``; it now gets the Lightning doors'
   refusal, naming the parameters, the call (``accelerator.prepare``, ``amp.initialize``, ``prepare_model()``) and the
   remedy (one forward first).
3. A misspelt keyword of the Accelerate adapter's own methods, of the Apex layer (``amp``, the optimizer it returns,
   ``FP16_Optimizer``, ``fp16_utils``) and of ``mpx_trainer`` got Python's ``TypeError`` (naming an internal class,
   ``GradientClipping.clip_grad_norm_()``, and no valid keyword): now the valid ones, the closest and the value.
4. At O2 a model prepared for evaluation only (``accelerator.prepare_model(model, evaluation_mode=True)``, an
   evaluation) then for training got FP32 masters from its bfloat16 rounding, silently (``"bf16"`` trains the FP32
   weights): now warned, with the remedy, which gives the run prepared for training first bit for bit.

Held (probe scripts, against ``"bf16"``/FP32/Apex): ``accumulate`` with ``gradient_accumulation_steps`` and
``GradientAccumulationPlugin(sync_with_dataloader=False)``, clips (norm 1/2/inf, value, a numpy or tensor limit, part
of the parameters, two optimizers), ``unscale_gradients`` then torch's clip, two models one optimizer and one model two
optimizers in any prepare order, ``unwrap_model`` training, ``DataParallel`` on CPU, ``torch.compile`` before/after
``prepare``, ``free_memory`` then ``prepare``, ``save_state`` before the first step with a registered scheduler,
O1/O2/O3 resume crossings (Accelerate and Apex, both half dtypes), edited or ``strict=False`` checkpoints, the HF
Trainer with LoRA + ``modules_to_save`` + accumulation + clipping + ``load_best_model_at_end`` + resume, Apex lists
with ``num_losses``/``loss_id``/``delay_unscale`` and one loss overflowing, ``Amp.true_grads`` at each phase.

Tiny models on CPU, bfloat16 unless the scale is the point.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp
from lightning_mpx.apex import amp as apex_amp
from lightning_mpx.apex._state import _amp_state

BF16 = torch.bfloat16


def _net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)


@pytest.fixture
def fresh_apex() -> Any:
    _amp_state.reset()
    yield
    _amp_state.reset()


# -- 1. a refused amp.initialize given the earlier call's model again ------------------------------------------------
def _apex_steps(model: nn.Module, optimizer: Any, start: int, stop: int) -> None:
    for step in range(start, stop):
        x, y = _batch(step)
        with apex_amp.scale_loss(F.cross_entropy(model(x), y), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()


def _apex_run(refused: Callable[[], nn.Module] | None) -> dict[str, torch.Tensor]:
    """O2 bfloat16 (a dynamic scale: the scale's path counts too), 3 steps, then (``refused``) a second
    ``amp.initialize`` of the same model and optimizer beside a model it refuses, then 3 steps more with the first
    call's pair: the FP32 weights."""
    _amp_state.reset()
    net = _net()
    base = torch.optim.Adam(net.parameters(), lr=1e-2)
    kw = dict(opt_level="O2", cast_model_type=BF16, loss_scale="dynamic", verbosity=0)
    model, optimizer = apex_amp.initialize(net, base, **kw)
    _apex_steps(model, optimizer, 0, 3)
    if refused is not None:
        with pytest.raises(ValueError) as error:
            apex_amp.initialize([net, refused()], base, **kw)
        assert "amp.initialize" in str(error.value) or "module=" in str(error.value)
    _apex_steps(model, optimizer, 3, 6)
    return {k: v.float().clone() for k, v in model.state_dict().items()}


REFUSED: dict[str, Callable[[], nn.Module]] = {
    "lazy": lambda: nn.LazyLinear(4),
    "meta": lambda: nn.Linear(4, 4, device="meta"),
    "nothing_to_cast": lambda: nn.ReLU(),
}


@pytest.mark.usefixtures("fresh_apex")
@pytest.mark.parametrize("refused", list(REFUSED))
def test_a_refused_initialize_given_the_model_again_leaves_the_earlier_pair_training(refused: str) -> None:
    """The earlier ``(model, optimizer)`` trains on after the refused call exactly as if it had not been made (bit
    for bit: its hooks, wrapper, masters and scale untouched). Before, its hooks were gone: the next forward failed
    with torch's "mat1 and mat2 must have the same dtype"."""
    want, got = _apex_run(None), _apex_run(REFUSED[refused])
    assert all(torch.equal(want[k], got[k]) for k in want)


# -- 2. lazy modules at O2 outside the Lightning doors ---------------------------------------------------------------
def _lazy() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.LazyLinear(16), nn.Tanh(), nn.Linear(16, 4))


@pytest.mark.usefixtures("fresh_apex")
def test_a_lazy_module_at_o2_is_refused_naming_the_call_at_every_door(fresh_accelerate_state: None) -> None:
    """Accelerate's ``prepare``, Apex's ``initialize`` and the core's ``prepare_model`` at O2 name the lazy parameters,
    their call and the remedy (torch's error spoke of ``load_state_dict``); O1 and O3 still take the lazy module."""
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

    pattern = r"0\.weight, 0\.bias of Sequential are not initialized yet .* before any forward\. Run one forward on"
    accelerator = Accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bf16")])
    model = _lazy()
    with pytest.raises(ValueError, match=pattern + r" an example batch before accelerator\.prepare"):
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model = _lazy()
    with pytest.raises(ValueError, match=pattern + r" an example batch before amp\.initialize"):
        apex_amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    with pytest.raises(ValueError, match=pattern + r" an example batch before prepare_model\(\)"):
        Amp("O2", half_dtype="bfloat16").prepare_model(_lazy())
    for level in ("O1", "O3"):  # no masters: the lazy module trains
        amp = Amp(level, half_dtype="bfloat16")
        model = amp.prepare_model(_lazy())
        optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = _batch(0)
        with amp.forward_context():
            amp.backward(F.cross_entropy(amp.cast_outputs(model(amp.cast_inputs(x))), y))
        assert amp.step(optimizer)


# -- 3. misspelt keywords: the argument, its value, the valid choices ------------------------------------------------
def _accelerate_rows(tmp: str) -> tuple[Any, Any, list[tuple[str, Callable[[], Any], str, str]]]:
    """The accelerator, its model and (where, call with one keyword misspelt, misspelt, the keyword meant) for each
    public keyword of the Accelerate adapter's own methods, at O2 bfloat16 after one backward (the gradients scaled,
    not unscaled yet)."""
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

    kwargs = [MixedPrecisionKwargs(half_dtype="bfloat16", loss_scale="dynamic", init_scale=1024.0)]
    accelerator = Accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=kwargs)
    model, optimizer = accelerator.prepare(_net(), torch.optim.SGD(_net().parameters(), lr=0.1))
    x, y = _batch(0)
    accelerator.backward(F.cross_entropy(model(x), y))
    a, params = accelerator, model.parameters
    rows = [
        ("accelerator.prepare()", lambda: a.prepare(_net(), device_placment=[True]), "device_placment", ""),
        ("accelerator.prepare_model()", lambda: a.prepare_model(_net(), evaluation_mod=True), "evaluation_mod", ""),
        ("accelerator.prepare_optimizer()", lambda: a.prepare_optimizer(optimizer, device_placment=True), "", ""),
        ("accelerator.clip_grad_norm_()", lambda: a.clip_grad_norm_(params(), 1.0, norm_typ=2), "norm_typ", ""),
        ("accelerator.clip_grad_value_()", lambda: a.clip_grad_value_(params(), 1.0, clip_val=1), "clip_val", ""),
        ("accelerator.unscale_gradients()", lambda: a.unscale_gradients(optimzer=optimizer), "optimzer", ""),
        ("accelerator.get_state_dict()", lambda: a.get_state_dict(model, unwarp=True), "unwarp", ""),
        ("accelerator.save_model()", lambda: a.save_model(model, tmp, max_shard_sze="1GB"), "max_shard_sze", ""),
        ("accelerator.autocast()", lambda: a.autocast(autocast_handlr=None).__enter__(), "autocast_handlr", ""),
        ("accelerator.log()", lambda: a.log({"loss": 1.0}, stpe=1), "stpe", ""),
        ("accelerator.register_save_state_pre_hook()", lambda: a.register_save_state_pre_hook(hok=print), "hok", ""),
        ("accelerator.free_memory()", lambda: a.free_memory(objs=[model]), "objs", "-"),
        ("accelerator.mpx_metrics()", lambda: a.mpx_metrics(reset=True), "reset", "-"),
        ("accelerator.backward()", lambda: a.backward(F.cross_entropy(model(x), y), loss_idx=0), "loss_idx", ""),
        ("optimizer.step()", lambda: optimizer.step(closre=None), "closre", "closure"),
        ("Accelerator()", lambda: Accelerator(mixed_precision="O2", gradient_accumulation_step=2), "", ""),
        ("MixedPrecisionKwargs()", lambda: MixedPrecisionKwargs(half_dtyp="bfloat16"), "half_dtyp", "half_dtype"),
    ]
    return accelerator, model, rows


def _apex_rows() -> list[tuple[str, Callable[[], Any], str, str]]:
    """The same for each public keyword of the Apex layer (``amp``, the optimizer it returns, ``fp16_utils``)."""
    from lightning_mpx.apex import fp16_utils

    net = _net()
    model, optimizer = apex_amp.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    half = nn.Linear(2, 2).half()
    fp16 = fp16_utils.FP16_Optimizer(torch.optim.SGD(half.parameters(), lr=0.1), dynamic_loss_scale=True)
    loss = model(_batch(0)[0]).float().sum()
    scale_loss, masters = apex_amp.scale_loss, fp16_utils.prep_param_lists(nn.Linear(2, 2))
    return [
        ("amp.initialize()", lambda: apex_amp.initialize(_net(), opt_levl="O2"), "opt_levl", "opt_level"),
        ("amp.init()", lambda: apex_amp.init(enable_cashing=True), "enable_cashing", "enable_caching"),
        ("amp.scale_loss()", lambda: scale_loss(loss, optimizer, loss_idx=0).__enter__(), "loss_idx", "loss_id"),
        ("amp.scale_loss()", lambda: scale_loss(loss, optimizer, delay_unscaled=True).__enter__(), "", ""),
        ("amp.state_dict()", lambda: apex_amp.state_dict(destinaton={}), "destinaton", "destination"),
        ("amp.load_state_dict()", lambda: apex_amp.load_state_dict(state_dct={}), "state_dct", "state_dict"),
        ("amp.master_params()", lambda: list(apex_amp.master_params(optimizer, opt=None)), "opt", "-"),
        ("amp.register_half_function()", lambda: apex_amp.register_half_function(torch, fname="mm"), "fname", "name"),
        ("amp.register_float_function()", lambda: apex_amp.register_float_function(torch, nme="mm"), "nme", "name"),
        ("amp.register_promote_function()", lambda: apex_amp.register_promote_function(torch, nam="mm"), "nam", ""),
        ("optimizer.step()", lambda: optimizer.step(closre=None), "closre", "closure"),
        ("optimizer.zero_grad()", lambda: optimizer.zero_grad(set_to_non=True), "set_to_non", "set_to_none"),
        ("optimizer.load_state_dict()", lambda: optimizer.load_state_dict(state={}), "state", "state_dict"),
        ("optimizer.add_param_group()", lambda: optimizer.add_param_group(group={}), "group", "param_group"),
        ("FP16_Optimizer()", lambda: fp16_utils.FP16_Optimizer(fp16.optimizer, dynamic_loss_scal=True), "", ""),
        ("FP16_Optimizer.backward()", lambda: fp16.backward(loss, update_master_grad=False), "", ""),
        ("FP16_Optimizer.clip_master_grads()", lambda: fp16.clip_master_grads(1.0, norm_typ=2), "norm_typ", ""),
        ("FP16_Optimizer.step()", lambda: fp16.step(closre=None), "closre", "closure"),
        ("FP16_Optimizer.zero_grad()", lambda: fp16.zero_grad(set_grads_to_none=True), "", "set_grads_to_None"),
        ("FP16_Optimizer.load_state_dict()", lambda: fp16.load_state_dict(state={}), "state", "state_dict"),
        ("network_to_half()", lambda: fp16_utils.network_to_half(netwrk=_net()), "netwrk", "network"),
        ("BN_convert_float()", lambda: fp16_utils.BN_convert_float(modul=_net()), "modul", "module"),
        ("convert_network()", lambda: fp16_utils.convert_network(_net(), dtyp=torch.half), "dtyp", "dtype"),
        ("prep_param_lists()", lambda: fp16_utils.prep_param_lists(_net(), flat_mastr=True), "flat_mastr", ""),
        ("model_grads_to_master_grads()", lambda: fp16_utils.model_grads_to_master_grads(*masters, flat=1), "", "-"),
        (
            "master_params_to_model_params()",
            lambda: fp16_utils.master_params_to_model_params(*masters, flatmaster=1),
            "flatmaster",
            "flat_master",
        ),
        ("to_python_float()", lambda: fp16_utils.to_python_float(torch.ones(1), tensor=1), "tensor", "-"),
    ]


def _check_row(where: str, call: Callable[[], Any], misspelt: str, meant: str) -> None:
    """The refusal names where, the keyword (its value too) and the valid ones, and the closest of them (``meant``;
    ``"-"``: none close; empty: the keyword with its last letter dropped or one swapped, read from the message)."""
    with pytest.raises(TypeError) as error:
        call()
    message = str(error.value)
    assert message.startswith(f"{where} got an unexpected keyword argument "), message
    given = misspelt or message.split("'")[1]
    assert f"argument {given!r}; " in message and f"(given: {given}=" in message, message
    assert "valid choices: " in message or "takes no keyword arguments" in message, message
    if meant == "-":
        assert "Did you mean" not in message, message
    else:
        assert "Did you mean " in message and (not meant or f"Did you mean {meant}=?" in message), message


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_misspelt_keyword_of_the_accelerate_adapter_is_named_with_its_value_and_the_valid_ones(tmp_path) -> None:
    """Each public keyword of the adapter's own methods, misspelt once: before, Python's ``TypeError`` named the class
    the method lives in (``GradientClipping.clip_grad_norm_()``, ``WholeModelExport.save_model()``) and no valid
    keyword. A misspelt clip is refused before anything is unscaled. (A required argument misspelt,
    ``clip_grad_norm_(params, max_nrom=1.0)``, got Python's "missing 1 required positional argument: 'max_norm'":
    the per-step methods take no wrapper; it is named as the others now, with no check per call: fsdp1find66.)"""
    accelerator, model, rows = _accelerate_rows(str(tmp_path))
    for row in rows:
        _check_row(*row)
    optimizer = accelerator._amp_optimizers()[0]
    assert not accelerator.amp.is_unscaled(optimizer.optimizer)  # the refused clips and unscale touched nothing
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'max_nrom'; .* Did you mean max_norm=\?"):
        accelerator.clip_grad_norm_(model.parameters(), max_nrom=1.0)


@pytest.mark.usefixtures("fresh_apex")
def test_a_misspelt_keyword_of_the_apex_layer_is_named_with_its_value_and_the_valid_ones() -> None:
    """Each public keyword of ``amp``, of the optimizer ``initialize`` returns and of ``fp16_utils``, misspelt once:
    before, Python's ``TypeError`` (``scale_loss() got an unexpected keyword argument 'loss_idx'``) named no valid
    keyword (``amp.initialize``/``amp.init`` did, without the value)."""
    for row in _apex_rows():
        _check_row(*row)


def test_a_misspelt_keyword_of_mpx_trainer_is_named_with_its_value_and_the_valid_ones() -> None:
    """``mpx_trainer(trainer_class=...)``: refused before transformers is imported (``MpxTrainer(opt_lvl=...)`` is
    ``tests/test_fabric_rank_zero_reads.py``'s; its message now shows the value too: ``(given: opt_lvl='O2')``)."""
    from lightning_mpx.accelerate import mpx_trainer

    _check_row("mpx_trainer()", lambda: mpx_trainer(trainer_class=None), "trainer_class", "trainer_cls")


# -- 4. a model prepared for evaluation only, then for training -----------------------------------------------------
def _evaluated_first(level: str, *, evaluate_first: bool, reload: bool = False) -> tuple[dict, list[str]]:
    """An SGD run of 4 steps through the Accelerate adapter (``level``, bfloat16) or Accelerate's own ``level``; with
    ``evaluate_first`` the model is prepared for evaluation only (and evaluated) before ``prepare(model, optimizer)``
    (``reload``: its FP32 weights loaded again after that, the warning's remedy). The FP32 weights before the first
    step and after the last, and the warnings."""
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    reset_accelerate_state()
    ours = [MixedPrecisionKwargs(half_dtype="bfloat16")] if level.startswith("O") else None
    accelerator = Accelerator(mixed_precision=level, cpu=True, kwargs_handlers=ours)
    net = _net()
    fp32 = {k: v.clone() for k, v in net.state_dict().items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if evaluate_first:
            model = accelerator.prepare_model(net, evaluation_mode=True)
            with torch.no_grad():
                model(_batch(9)[0])
        model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        if reload:
            accelerator.unwrap_model(model).load_state_dict(fp32)
        start = {k: v.float().clone() for k, v in accelerator.get_state_dict(model).items()}
        for step in range(4):
            x, y = _batch(step)
            accelerator.backward(F.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    end = {k: v.float().clone() for k, v in accelerator.get_state_dict(model).items()}
    reset_accelerate_state()
    return {"fp32": fp32, "start": start, "end": end}, [
        str(w.message) for w in caught if "lightning_mpx" in str(w.message)
    ]


def test_a_model_evaluated_before_it_is_prepared_for_training_is_warned_about() -> None:
    """``accelerator.prepare_model(model, evaluation_mode=True)`` (no FP32 copy), an evaluation, then
    ``accelerator.prepare(model, optimizer)``: the FP32 masters start from the bfloat16 rounding of the weights
    (up to 1e-3 off), where Accelerate's own ``"bf16"`` trains the FP32 weights; it was silent. Now a warning says
    so when the masters are made, naming the remedy, and the remedy (the FP32 weights loaded again) gives the run that
    prepared the model for training first, bit for bit. No warning for that run, nor under ``"bf16"``."""
    bf16, bf16_warned = _evaluated_first("bf16", evaluate_first=True)
    direct, direct_warned = _evaluated_first("O2", evaluate_first=False)
    rounded, warned = _evaluated_first("O2", evaluate_first=True)
    reloaded, _ = _evaluated_first("O2", evaluate_first=True, reload=True)
    assert not bf16_warned and not direct_warned
    assert len(warned) == 1 and "prepared for evaluation only" in warned[0] and "0.weight, 0.bias" in warned[0]
    assert "model.load_state_dict(fp32_state_dict)" in warned[0]
    fp32 = direct["fp32"]
    assert all(torch.equal(direct["start"][k], fp32[k]) and torch.equal(bf16["start"][k], fp32[k]) for k in fp32)
    off = max((rounded["start"][k] - fp32[k]).abs().max().item() for k in fp32)
    assert 1e-4 < off < 1e-2  # the masters started from the bfloat16 rounding
    assert all(torch.equal(reloaded[when][k], direct[when][k]) for when in ("start", "end") for k in fp32)
    # The core's own door: prepare_model(train=False), then for training, warns the same way.
    amp, net = Amp("O2", half_dtype="bfloat16"), _net()
    amp.prepare_model(net, train=False)
    with pytest.warns(UserWarning, match=r"prepared for evaluation only .* Amp\.prepare_model\(model, train=False\)"):
        amp.prepare_optimizer(torch.optim.SGD(amp.prepare_model(net).parameters(), lr=0.1))
