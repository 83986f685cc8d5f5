"""A hostile Accelerate / HF Trainer / Apex user of stop 65's surfaces, against the frameworks' own precisions.

1. Keywords: every keyword of Accelerate 1.15's own methods (the installed one's signatures) and of Apex's ``amp``
   and ``fp16_utils`` (their signatures, written out here from Apex's source) is taken by name and in the same
   positional order: Apex's ``amp.load_state_dict(state_dict=...)`` and ``amp.half_function(fn=...)`` were refused.
2. Models cast to half before training: transformers' ``Trainer.evaluate()``/``predict()`` before ``train()`` on a
   Trainer made without a ``train_dataset`` (the dataset given after) made the O2 masters from the half rounding of
   the weights silently (the Trainer's ``free_memory()`` hands the model to a new engine, which found it half): now
   warned, as ``accelerator.free_memory()`` between ``prepare_model(model, evaluation_mode=True)`` and ``prepare(model,
   optimizer)`` is, and a part frozen at ``prepare`` and unfrozen after ``free_memory()``; such a Trainer resumed
   with ``train(resume_from_checkpoint=...)`` was refused at its first step (the checkpoint's FP32 weights were
   rounded into the half model): it resumes the uninterrupted run bit for bit. A lazy module materialized by a dry
   forward before ``prepare`` trains as under ``"bf16"``.
3. Accumulation under DDP (one 2-rank launch, ``tests/accelerate_ddp_accumulation_script.py``): ``accumulate``,
   ``no_sync`` by hand and ``sync_each_batch=True`` with a float16 overflow on rank 1 only (inside the window and at its
   synchronising micro-batch) skip the same steps with the same scales on both ranks as Accelerate's own ``"fp16"``
   (``GradScaler``), the weights equal on both ranks and to its.
4. Apex ``amp.state_dict()``/``amp.load_state_dict(state_dict=...)`` across a restart resumes bit for bit at O1/O2.
"""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.launch import case_results

pytest.importorskip("accelerate")

BF16 = {"half_dtype": "bfloat16"}


# -- 1. keywords: nothing valid refused ------------------------------------------------------------------------------
def _names(function: Any) -> list[str]:
    """The parameters a caller can pass by name, in their order (``self`` left out)."""
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    parameters = inspect.signature(function).parameters.values()
    return [p.name for p in parameters if p.kind in by_name and p.name != "self"]


_ACCELERATE_METHODS = (
    "prepare", "prepare_model", "prepare_optimizer", "get_state_dict", "free_memory", "autocast", "log",
    "register_save_state_pre_hook", "save_model", "backward", "clip_grad_norm_", "clip_grad_value_",
    "unscale_gradients", "save_state", "load_state",
)  # fmt: skip


@pytest.mark.parametrize("name", _ACCELERATE_METHODS)
def test_accelerator_methods_take_every_keyword_of_accelerate(name: str) -> None:
    """Each method the adapter overrides (or wraps to refuse misspelt keywords) takes Accelerate's own parameters by
    name, in Accelerate's positional order (a script's positional call means the same)."""
    import accelerate

    from lightning_mpx.accelerate import Accelerator

    theirs = _names(inspect.unwrap(getattr(accelerate.Accelerator, name)))  # log: under on_main_process
    ours = _names(getattr(Accelerator, name))
    assert ours[: len(theirs)] == theirs, (ours, theirs)


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("level", ["O2", "bf16"])
def test_accelerator_positional_arguments_in_accelerate_order(level: str) -> None:
    """``Accelerator(True, None, level, 2)``: Accelerate's order (device_placement, split_batches, mixed_precision,
    gradient_accumulation_steps) means what it means to ``accelerate.Accelerator``, an opt level and its native values
    alike (Python refused it: "got multiple values for argument 'mixed_precision'", given once); a value given both
    ways is refused naming the argument."""
    import accelerate

    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Accelerate's deprecation of split_batches there
        native = level == "bf16"
        handlers = None if native else [MixedPrecisionKwargs(**BF16)]
        ours = Accelerator(True, None, level, 2, kwargs_handlers=handlers)
        assert (ours.mixed_precision, ours.opt_level, ours.gradient_accumulation_steps) == (
            level, None if native else level, 2)  # fmt: skip
        reset_accelerate_state()
        if native:
            theirs = accelerate.Accelerator(True, None, level, 2)
            assert (theirs.mixed_precision, theirs.gradient_accumulation_steps) == (level, 2)
            reset_accelerate_state()
        with pytest.raises(TypeError, match=r"multiple values for argument 'mixed_precision': positional argument 3"):
            Accelerator(True, None, level, mixed_precision=level)


# Apex's signatures (apex/amp/frontend.py, amp.py, handle.py; apex/fp16_utils), by name in order.
_APEX = {
    "initialize": ["models", "optimizers", "enabled", "opt_level", "cast_model_type", "patch_torch_functions",
                   "keep_batchnorm_fp32", "master_weights", "loss_scale", "cast_model_outputs", "num_losses",
                   "verbosity", "min_loss_scale", "max_loss_scale"],
    "scale_loss": ["loss", "optimizers", "loss_id", "model", "delay_unscale", "delay_overflow_check"],
    "state_dict": ["destination"],
    "load_state_dict": ["state_dict"],
    "master_params": ["optimizer"],
    "register_half_function": ["module", "name"],
    "register_float_function": ["module", "name"],
    "register_promote_function": ["module", "name"],
    "half_function": ["fn"],
    "float_function": ["fn"],
    "promote_function": ["fn"],
}  # fmt: skip
_FP16_UTILS = {
    "FP16_Optimizer": ["init_optimizer", "static_loss_scale", "dynamic_loss_scale", "dynamic_loss_args", "verbose"],
    "FP16_Optimizer.zero_grad": ["set_grads_to_None"],
    "FP16_Optimizer.backward": ["loss", "update_master_grads", "retain_graph"],
    "FP16_Optimizer.clip_master_grads": ["max_norm", "norm_type"],
    "FP16_Optimizer.step": ["closure"],
    "FP16_Optimizer.load_state_dict": ["state_dict"],
    "network_to_half": ["network"],
    "convert_network": ["network", "dtype"],
    "prep_param_lists": ["model", "flat_master"],
    "model_grads_to_master_grads": ["model_params", "master_params", "flat_master"],
    "master_params_to_model_params": ["model_params", "master_params", "flat_master"],
    "to_python_float": ["t"],
    "BN_convert_float": ["module"],
}  # fmt: skip


def test_apex_layer_takes_apex_keywords_in_apex_order() -> None:
    """Every public function of Apex's ``amp`` and ``fp16_utils`` takes Apex's parameters by Apex's names, in Apex's
    positional order: ``amp.load_state_dict(state_dict=ckpt["amp"])`` was refused (ours was named ``state``), and
    ``amp.half_function(fn=f)`` failed naming an inner ``decorate()``."""
    from lightning_mpx.apex import amp, fp16_utils

    for name, expected in _APEX.items():
        assert _names(getattr(amp, name)) == expected, name
    for name, expected in _FP16_UTILS.items():
        owner, _, method = name.partition(".")
        function = getattr(getattr(fp16_utils, owner), method) if method else getattr(fp16_utils, owner)
        assert _names(function) == expected, name


def test_apex_load_state_dict_by_apex_keyword_resumes(tmp_path: Path) -> None:
    """Apex's checkpoint habit with the keyword spelled out (``amp.load_state_dict(state_dict=checkpoint["amp"])``),
    across a restart (``torch.load`` of the file) at O1 and O2 with float16 and a dynamic scale that backed off:
    the resumed run ends at the uninterrupted run's weights and loss scale, bit for bit."""
    from lightning_mpx.apex import amp
    from lightning_mpx.apex._state import _amp_state

    gen = torch.Generator().manual_seed(3)
    xs, ys = torch.randn(6, 4, 4, generator=gen), torch.randn(6, 4, 2, generator=gen)

    def start(level: str) -> tuple[nn.Module, Any]:
        _amp_state.reset()
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        return amp.initialize(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), opt_level=level,
                              loss_scale="dynamic", verbosity=0)  # fmt: skip

    def steps(model: nn.Module, optimizer: Any, first: int, last: int) -> None:
        for i in range(first, last):
            loss = ((model(xs[i].to(next(model.parameters()).dtype)).float() - ys[i]) ** 2).mean()
            with amp.scale_loss(loss * (float("inf") if i == 1 else 1.0), optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            optimizer.zero_grad()

    try:
        for level in ("O1", "O2"):
            model, optimizer = start(level)
            steps(model, optimizer, 0, 6)
            want, want_scale = dict(model.state_dict()), amp.state_dict()["loss_scaler0"]
            model, optimizer = start(level)
            steps(model, optimizer, 0, 3)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()},
                       tmp_path / f"{level}.pt")  # fmt: skip
            checkpoint = torch.load(tmp_path / f"{level}.pt", weights_only=True)
            model, optimizer = start(level)
            model.load_state_dict(state_dict=checkpoint["model"])
            optimizer.load_state_dict(state_dict=checkpoint["optimizer"])
            amp.load_state_dict(state_dict=checkpoint["amp"])
            steps(model, optimizer, 3, 6)
            got = model.state_dict()
            assert all(torch.equal(got[k], want[k]) for k in want), level
            assert amp.state_dict()["loss_scaler0"] == want_scale, level
            assert want_scale["loss_scale"] < 2.0**16  # the overflow backed it off
    finally:
        _amp_state.reset()


def test_apex_initialized_for_inference_then_for_training_keeps_fp32() -> None:
    """Apex's evaluation first: ``amp.initialize(model, opt_level="O2")`` without an optimizer (inference), an
    evaluation, then ``amp.initialize(model, optimizer, opt_level="O2")``: the second call carries the model's state
    over (``model.state_dict()``), which gave the half rounding of the FP32 weights kept for its masters (no optimizer
    had made them yet), so the run trained from the rounding (up to 1e-3 off), silently. It trains as the model
    initialized with its optimizer at once, bit for bit, and ``model.state_dict()`` after the first call is the FP32
    weights."""
    from lightning_mpx.apex import amp
    from lightning_mpx.apex._state import _amp_state

    xs = torch.randn(3, 4, 4, generator=torch.Generator().manual_seed(2))

    def train(evaluate_first: bool) -> list[torch.Tensor]:
        _amp_state.reset()
        net = _mlp()
        fp32 = {k: v.clone() for k, v in net.state_dict().items()}
        if evaluate_first:
            net = amp.initialize(net, opt_level="O2", cast_model_type=torch.bfloat16, verbosity=0)
            assert all(torch.equal(v, fp32[k]) for k, v in net.state_dict().items())
            with torch.no_grad():
                net(xs[0])
        model, optimizer = amp.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), opt_level="O2",
                                          cast_model_type=torch.bfloat16, verbosity=0)  # fmt: skip
        for x in xs:
            with amp.scale_loss(model(x).float().pow(2).mean(), optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            optimizer.zero_grad()
        return list(model.state_dict().values())

    try:
        assert all(torch.equal(a, b) for a, b in zip(train(True), train(False)))
    finally:
        _amp_state.reset()


# -- 2. models cast to half before training --------------------------------------------------------------------------
def _accelerator(level: str = "O2") -> Any:
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

    return Accelerator(mixed_precision=level, kwargs_handlers=[MixedPrecisionKwargs(**BF16)])


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _rounding_warnings(record: list[Any]) -> list[str]:
    return [str(w.message) for w in record if "masters start from their half rounding" in str(w.message)]


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("cause", ["evaluation", "frozen"])
def test_masters_from_rounding_after_free_memory_are_warned(cause: str) -> None:
    """A model an engine cast to half without keeping FP32 values (prepared with ``evaluation_mode=True``; or a part
    frozen at ``prepare``), handed to the next engine by ``accelerator.free_memory()`` and prepared for training (the
    part unfrozen): its masters start from the half rounding, which was warned about without ``free_memory()`` and
    silent with it."""
    accelerator = _accelerator()
    model = _mlp()
    if cause == "evaluation":
        model = accelerator.prepare_model(model, evaluation_mode=True)
    else:
        model[0].requires_grad_(False)
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.free_memory()
    model[0].requires_grad_(True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        accelerator.backward(model(torch.randn(2, 4)).float().sum())
        optimizer.step()
    found = _rounding_warnings(record)
    assert len(found) == 1 and "0.weight, 0.bias" in found[0], found
    assert ("prepared for evaluation only" in found[0]) == (cause == "evaluation"), found


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_lazy_module_materialized_before_prepare_trains_as_bf16() -> None:
    """``nn.LazyLinear`` given its shape by a dry forward before ``prepare`` (as the O2 refusal says) trains as
    Accelerate's own ``"bf16"``: the masters start from its FP32 weights."""
    from accelerate import Accelerator as NativeAccelerator

    from tests.accelerate_helpers import reset_accelerate_state

    gen = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(4, 6, 4, generator=gen), torch.randint(0, 2, (4, 6), generator=gen)

    def train(accelerator: Any, model: nn.Module) -> list[torch.Tensor]:
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        for x, y in zip(xs, ys):
            accelerator.backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        return [v.float() for v in accelerator.get_state_dict(model).values()]

    want = train(NativeAccelerator(mixed_precision="bf16"), _mlp())
    reset_accelerate_state()
    torch.manual_seed(0)
    lazy = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 2))
    with torch.no_grad():
        lazy(xs[0])
    lazy.load_state_dict(_mlp().state_dict())
    got = train(_accelerator(), lazy)
    assert all(torch.allclose(g, w, rtol=0, atol=2e-3) for g, w in zip(got, want))


def _gpt2_trainer(tmp: Path, *, train_data: bool, steps: int = 4, save_steps: int | None = None) -> Any:
    transformers = pytest.importorskip("transformers")
    from lightning_mpx.accelerate import MixedPrecisionKwargs, mpx_trainer

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=2)
    ids = torch.randint(0, 32, (8, 6), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp), use_cpu=True, report_to=[], max_steps=steps, per_device_train_batch_size=4,
        per_device_eval_batch_size=4, learning_rate=1e-2, save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500, disable_tqdm=True, seed=0, data_seed=0,
    )  # fmt: skip
    trainer = mpx_trainer()(
        model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=data if train_data else None,
        eval_dataset=data[:4], opt_level="O2", mpx_kwargs=MixedPrecisionKwargs(**BF16),
    )  # fmt: skip
    trainer.data = data
    return trainer


def _fp32(trainer: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in trainer.accelerator.get_state_dict(trainer.model).items()}


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("first", ["evaluate", "predict"])
def test_trainer_evaluated_without_train_dataset_warns_at_train(tmp_path: Path, first: str) -> None:
    """transformers' ``Trainer`` made without a ``train_dataset`` (evaluation first: TRL's habit), ``evaluate()``
    (or ``predict()``), then the dataset given and ``train()``: the model was cast to half for evaluation only, so
    the O2 masters start from the rounding of its weights (the Trainer's ``bf16=True`` trains the FP32 weights);
    that was silent (the Trainer's ``free_memory()`` hands the model to a new engine), and is warned now, naming the
    Trainer's remedy."""
    trainer = _gpt2_trainer(tmp_path, train_data=False, steps=1)
    getattr(trainer, first)(trainer.data[:4])
    trainer.train_dataset = trainer.data
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.train()
    found = _rounding_warnings(record)
    assert len(found) == 1 and "evaluate() or predict() before train()" in found[0], found
    assert "give it the train_dataset when it is made" in found[0]


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_trainer_evaluated_without_train_dataset_resumes_exactly(tmp_path: Path) -> None:
    """The same Trainer resumed with ``train(resume_from_checkpoint=...)`` after ``evaluate()``: the checkpoint's FP32
    weights were loaded into the half model (rounded), and the first step raised ("the model's weights were not
    loaded from it", blaming a load_state pre-hook). Now the model is prepared for training before the load: the run
    ends at the uninterrupted run's weights bit for bit, with no warning."""
    from tests.accelerate_helpers import reset_accelerate_state

    full = _gpt2_trainer(tmp_path / "full", train_data=True, steps=4, save_steps=2)
    full.train()
    want = _fp32(full)
    reset_accelerate_state()
    trainer = _gpt2_trainer(tmp_path / "full", train_data=False, steps=4)
    trainer.evaluate()
    trainer.train_dataset = trainer.data
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    assert not _rounding_warnings(record)
    got = _fp32(trainer)
    assert all(torch.equal(got[k], want[k]) for k in want)


# -- 3. accumulation under DDP: one launch -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    ranks = case_results("accelerate_ddp_accumulation_script.py", tmp_path_factory.mktemp("attack66b"), timeout=150)
    assert [rank["after"]["sum"] for rank in ranks] == [2.0, 2.0]  # the process group works after every case
    return ranks


@pytest.mark.parametrize("case", ["accum/O1", "accum/O2", "no_sync/O2"])
def test_one_rank_overflow_in_accumulation_skips_as_gradscaler(launched: list[dict[str, Any]], case: str) -> None:
    """Rank 1 alone overflows, once under ``no_sync`` and once at the synchronising micro-batch: both ranks skip
    those two steps and back the scale off as Accelerate's own ``"fp16"`` (its ``GradScaler``) does, read the same
    ``sync_gradients`` and (NaN) clip norms, and end with equal weights, equal to ``"fp16"``'s (O1 and fp16 run the
    same float16 casts here; O2's FP32 masters within float16's rounding)."""
    zero, one = launched[0][case], launched[1][case]
    ref = launched[0][case.split("/")[0] + "/fp16"]
    assert zero["wrapper"] == "DistributedDataParallel"
    assert zero["weights"] == one["weights"]
    for key in ("skipped", "scales", "sync"):
        assert zero[key] == one[key] == ref[key], key
    assert zero["skipped"] == [False, True, True, False] and zero["scales"] == [256.0, 128.0, 64.0, 64.0]
    assert [n != n for n in zero["norms"]] == zero["skipped"]  # NaN where skipped, on both ranks
    assert torch.allclose(torch.tensor(zero["weights"]), torch.tensor(ref["weights"]), rtol=0, atol=2e-4)


def test_sync_each_batch_trains_as_bf16(launched: list[dict[str, Any]]) -> None:
    """``GradientAccumulationPlugin(sync_each_batch=True)`` (an all-reduce at every micro-batch) at O2 bfloat16: the
    ranks agree and end where Accelerate's ``"bf16"`` does, within bfloat16's rounding."""
    zero, one, ref = launched[0]["sync_each/O2"], launched[1]["sync_each/O2"], launched[0]["sync_each/bf16"]
    assert zero["weights"] == one["weights"] and zero["sync"] == ref["sync"] == [False, True] * 4
    assert not any(zero["skipped"])
    assert torch.allclose(torch.tensor(zero["weights"]), torch.tensor(ref["weights"]), rtol=0, atol=2e-3)


def test_overflow_in_a_short_last_window_skips_as_gradscaler(launched: list[dict[str, Any]]) -> None:
    """A prepared DataLoader of 5 batches under ``gradient_accumulation_steps=2``: Accelerate synchronises at its end,
    a window of one micro-batch, where rank 1 alone overflows. Both ranks skip that step and back the scale off as
    ``"fp16"``'s ``GradScaler`` does, and end equal, at ``"fp16"``'s weights within float16's rounding."""
    zero, one, ref = launched[0]["short_window/O2"], launched[1]["short_window/O2"], launched[0]["short_window/fp16"]
    assert zero["weights"] == one["weights"]
    assert zero["sync"] == ref["sync"] == [False, True, False, True, True]
    assert zero["skipped"] == one["skipped"] == ref["skipped"] == [False, False, True]
    assert zero["scales"] == ref["scales"] == [256.0, 512.0, 256.0]
    assert torch.allclose(torch.tensor(zero["weights"]), torch.tensor(ref["weights"]), rtol=0, atol=2e-4)
