"""A hostile Accelerate / HF Trainer / Apex user of stop 66's surfaces, against the frameworks' own precisions.

1. ``ACCELERATE_MIXED_PRECISION`` holding a misspelt opt level (``o2``, as ``mixed_precision='o2'`` is refused with a
   hint) was passed on to Accelerate, which takes any value of it unchecked: the run trained without mixed precision,
   silently. Now refused as the argument is, naming the variable.
2. Raw and prepared optimizers beside each other (``engine/beside_steps.py``): two optimizers prepared in separate
   calls (the model first) train as Accelerate's own ``"bf16"``; a head's optimizer never prepared is refused at O2,
   naming the fix; at O1 bfloat16 (no hazard) it trains as ``"bf16"``.
3. Apex O2 inference-first masters (``amp.initialize(model, opt_level="O2")`` then with the optimizer) with
   ``keep_batchnorm_fp32=False``, ``master_weights=False`` and an ``amp.state_dict()`` round trip before the first
   step: the run initialized once, bit for bit.
4. Apex: two optimizers, only the first named in ``scale_loss`` and both stepped: one overflow backs the scale off
   twice (``GradScaler``: once) -- a strict xfail.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("accelerate")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.trunk(x)))


def _batches(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def _accelerator(level: str) -> Any:
    from tests.accelerate_helpers import reset_accelerate_state

    reset_accelerate_state()
    if level == "bf16":
        import accelerate

        return accelerate.Accelerator(mixed_precision="bf16", cpu=True)
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

    return Accelerator(mixed_precision=level, cpu=True, kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16")])


# -- 1. the environment's mixed precision ----------------------------------------------------------------------------
@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize(("value", "hint"), [("o2", "did you mean 'O2'"), ("BF16", "valid choices")])
def test_misspelt_environment_mixed_precision_is_refused(
    monkeypatch: pytest.MonkeyPatch, value: str, hint: str
) -> None:
    """``ACCELERATE_MIXED_PRECISION=o2`` with ``mixed_precision`` left out: Accelerate took it unchecked and ran with
    no mixed precision (``accelerator.mixed_precision == 'o2'``, FP32 weights, no opt level), silently; it is
    refused as ``mixed_precision='o2'`` is, naming the variable. An opt level and Accelerate's own values in it
    still work."""
    from lightning_mpx.accelerate import Accelerator

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", value)
    with pytest.raises(ValueError, match=f"ACCELERATE_MIXED_PRECISION={value!r} is not valid.*{hint}"):
        Accelerator(cpu=True)
    for good, level in (("O2", "O2"), ("bf16", None), ("", None)):
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", good)
        from tests.accelerate_helpers import reset_accelerate_state

        reset_accelerate_state()
        assert Accelerator(cpu=True).opt_level == level


# -- 2. raw and prepared optimizers beside each other ---------------------------------------------------------------
def _two_optimizers(level: str, habit: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The trunk and the head each with an SGD, prepared as ``habit`` says, stepped together for 4 steps."""
    torch.manual_seed(0)
    model, accelerator = _Net(), _accelerator(level)
    trunk = torch.optim.SGD(model.trunk.parameters(), lr=0.1, momentum=0.9)
    head = torch.optim.SGD(model.head.parameters(), lr=0.1)
    if habit == "separate calls":
        model = accelerator.prepare(model)
        trunk = accelerator.prepare(trunk)
        head = accelerator.prepare(head)
    else:  # the head's optimizer never prepared
        model, trunk = accelerator.prepare(model, trunk)
    losses = []
    for x, y in _batches():
        loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        trunk.step()
        head.step()
        trunk.zero_grad()
        head.zero_grad()
        losses.append(loss.item())
    state = accelerator.get_state_dict(model)
    return losses, {k: v.detach().float() for k, v in state.items()}


@pytest.mark.parametrize(("level", "habit"), [("O2", "separate calls"), ("O1", "separate calls"), ("O1", "raw head")])
def test_two_optimizers_train_as_bf16(level: str, habit: str) -> None:
    """The model, then each optimizer in a call of its own (and, at O1 bfloat16, whose scale is 1, a head's optimizer
    never prepared): the losses and weights of Accelerate's own ``"bf16"`` (the same bfloat16 products here)."""
    want = _two_optimizers("bf16", habit)
    got = _two_optimizers(level, habit)
    assert got[0] == pytest.approx(want[0], abs=1e-4)
    assert all(torch.allclose(got[1][k], want[1][k], rtol=0, atol=1e-4) for k in want[1])


@pytest.mark.filterwarnings("ignore:lightning_mpx. 2 bfloat16 parameters")  # the EMA warning, at the same backward
def test_raw_head_optimizer_at_o2_is_refused_naming_the_fix() -> None:
    """At O2 the head's optimizer never given to ``prepare`` steps its half weights (no FP32 master, gradients the
    engine did not unscale): refused at the next backward, naming the parameters and ``accelerator.prepare``."""
    with pytest.raises(RuntimeError, match=r"'head\.weight', 'head\.bias'.*accelerator\.prepare") as error:
        _two_optimizers("O2", "raw head")
    assert "no optimizer prepared by lightning_mpx holds" in str(error.value)


# -- 3. Apex O2 inference-first masters ------------------------------------------------------------------------------
class _BnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.bn(self.a(x))))


def _apex_run(inference_first: bool, round_trip: bool, **overrides: Any) -> dict[str, torch.Tensor]:
    from lightning_mpx.apex import _amp_state, amp

    _amp_state.reset()
    torch.manual_seed(0)
    model = _BnNet()
    settings = {"opt_level": "O2", "cast_model_type": torch.bfloat16, "verbosity": 0, **overrides}
    if inference_first:
        model = amp.initialize(model, **settings)
        with torch.no_grad():
            model.eval()(torch.randn(4, 8))
        model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, **settings)
    if round_trip:  # a checkpoint's entries loaded before the first step, Apex's order
        checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()}
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        amp.load_state_dict(checkpoint["amp"])
    for x, y in _batches(3):
        with amp.scale_loss(F.cross_entropy(model(x).float(), y), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()
    out = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    _amp_state.reset()
    return out


@pytest.mark.parametrize(
    "overrides", [{"keep_batchnorm_fp32": False}, {"master_weights": False}, {"cast_model_outputs": torch.float32}]
)
def test_apex_inference_first_then_training_is_the_run_initialized_once(overrides: dict[str, Any]) -> None:
    """``amp.initialize(model, opt_level="O2", ...)`` for an evaluation, then ``amp.initialize(model, optimizer,
    ...)`` with the same overrides and a checkpoint's round trip before the first step: the weights and batch-norm
    statistics of the run initialized once with its optimizer, bit for bit."""
    want = _apex_run(False, False, **overrides)
    got = _apex_run(True, True, **overrides)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


# -- 4. Apex: an optimizer stepped but not named in its loss's block -------------------------------------------------
def _scales(apex: bool) -> list[float]:
    """O1 float16, the trunk's and the head's SGD both stepped, an inf loss at the third step; the loss scale after
    each step (``GradScaler``'s with ``apex=False``)."""
    torch.manual_seed(0)
    model = _Net()
    trunk = torch.optim.SGD(model.trunk.parameters(), lr=0.1)
    head = torch.optim.SGD(model.head.parameters(), lr=0.1)
    scales = []
    if apex:
        from lightning_mpx.apex import _amp_state, amp

        _amp_state.reset()
        model, (trunk, head) = amp.initialize(model, [trunk, head], opt_level="O1", loss_scale="dynamic", verbosity=0)
    else:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    for i, (x, y) in enumerate(_batches(5)):
        if apex:
            loss = F.cross_entropy(model(x), y) * (float("inf") if i == 2 else 1.0)
            with amp.scale_loss(loss, trunk) as scaled:  # the head's optimizer not named
                scaled.backward()
            trunk.step()
            head.step()
            scales.append(_amp_state.loss_scalers[0].loss_scale())
        else:
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = F.cross_entropy(out.float(), y) * (float("inf") if i == 2 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(trunk)
            scaler.step(head)
            scaler.update()
            scales.append(scaler.get_scale())
        trunk.zero_grad()
        head.zero_grad()
    if apex:
        _amp_state.reset()
    return scales


def test_apex_unnamed_optimizer_overflow_backs_off_once() -> None:
    """One overflow, one back-off, as ``GradScaler`` stepping both optimizers (the weights agree already). Was: the
    optimizer not named counted the block's overflow again at its own step, after the iteration's update
    (65536 -> 32768 -> 16384)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _scales(apex=True) == _scales(apex=False)


# -- 5. the HF Trainer wrapping nn.DataParallel itself, train() twice -------------------------------------------------
class _Labelled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)
        self.dtypes.append(out.dtype)
        return {"loss": F.mse_loss(out.float(), labels)}


def _trained_twice(level: str, gpus: int, tmp_path: Any) -> tuple[_Labelled, Any]:
    transformers = pytest.importorskip("transformers")
    from lightning_mpx.accelerate import MixedPrecisionKwargs, mpx_trainer
    from tests.accelerate_helpers import reset_accelerate_state

    reset_accelerate_state()
    g = torch.Generator().manual_seed(5)
    data = [{"x": torch.randn(8, generator=g), "labels": torch.randn(4, generator=g)} for _ in range(8)]
    args = transformers.TrainingArguments(
        str(tmp_path / f"{level}{gpus}"), report_to=[], use_cpu=True, max_steps=1, save_strategy="no",
        per_device_train_batch_size=4 // gpus, learning_rate=0.1, lr_scheduler_type="constant", disable_tqdm=True,
    )  # fmt: skip
    args._n_gpu = gpus  # (read after the devices are set up): the Trainer wraps nn.DataParallel itself when > 1
    torch.manual_seed(0)
    model = _Labelled()
    trainer = mpx_trainer(transformers.Trainer)(
        model=model, args=args, train_dataset=data, opt_level=level,
        mpx_kwargs=MixedPrecisionKwargs(half_dtype="bfloat16"),
    )  # fmt: skip
    trainer.train()
    trainer.args.max_steps = 2
    trainer.train()  # again, on the same Trainer (its free_memory() gives the Accelerator a new engine)
    return model, trainer


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_trainer_wrapping_data_parallel_trains_twice(level: str, tmp_path: Any) -> None:
    """``trainer.train()`` twice on an ``mpx_trainer`` that wraps ``nn.DataParallel`` itself (two GPUs without a
    distributed launch): at O2 the second ``train()`` was refused ("optimizer=SGD was prepared before its model, and no
    model has been prepared by this Accelerator", calls the user never made): the model prepared inside the wrapper
    by the first ``train()``'s engine was taken as prepared by the new one. Now both train as on one device."""
    model, trainer = _trained_twice(level, 2, tmp_path)
    reference, single = _trained_twice(level, 1, tmp_path)
    assert type(trainer.model_wrapped) is nn.DataParallel and trainer.model_wrapped.module is model
    assert model.dtypes == reference.dtypes == [torch.bfloat16] * 3  # 1 step, then 2
    got = trainer.accelerator.amp.fp32_state_dict(model)
    want = single.accelerator.amp.fp32_state_dict(reference)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
