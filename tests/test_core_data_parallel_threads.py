"""Stop 66 (dp66): O1 under ``nn.DataParallel``'s worker threads.

Over two or more GPUs ``nn.DataParallel`` replicates the model on the calling thread (``replicate``) and runs each
replica's forward in a thread of its own (``parallel_apply``), which carries grad mode and autocast's on/off only: O1's
cast scope (a torch-function mode of the calling thread) was not in effect there, and the replicas ran uncast,
silently. The prepared model's replicas now enter the calling thread's scope (``lightning_mpx.casting.replicas``).

No GPU here: :func:`_data_parallel` runs what ``DataParallel.forward`` runs over two devices, on the CPU: torch's own
``replicate`` (its broadcast of the parameters to the devices replaced by views, through which the gradients come
back as Broadcast's backward brings them), one thread per replica as ``parallel_apply``'s worker (grad mode and
autocast's on/off carried), and the outputs concatenated (``gather``).
"""

from __future__ import annotations

import copy
import gc
import threading
import types
import weakref
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp, CastTable


@pytest.fixture
def cpu_broadcast(monkeypatch: pytest.MonkeyPatch) -> None:
    """``replicate``'s broadcast to the devices (CUDA only) as views of the parameters on the CPU."""
    import sys

    replicate_module = sys.modules["torch.nn.parallel.replicate"]  # (the package's name is the function)

    def broadcast(tensors: list[torch.Tensor], devices: list[int], detach: bool = False) -> list[list[torch.Tensor]]:
        with torch._C.DisableTorchFunction():  # (the real broadcast is no torch function a mode sees)
            return [[t.detach() if detach else t.view_as(t) for t in tensors] for _ in devices]

    monkeypatch.setattr(replicate_module, "_broadcast_coalesced_reshape", broadcast)


def _worker(replica: nn.Module, x: torch.Tensor, results: dict[int, Any], i: int, grad: bool, autocast: bool) -> None:
    """``parallel_apply``'s worker, on the CPU."""
    torch.set_grad_enabled(grad)
    with torch.amp.autocast("cpu", enabled=autocast):
        results[i] = replica(x)


def _data_parallel(model: nn.Module, x: torch.Tensor, replicas: int = 2) -> torch.Tensor:
    """``nn.DataParallel(model)(x)`` over ``replicas`` devices, on the CPU (see the module's docstring)."""
    from torch.nn.parallel import replicate

    copies = replicate(model, list(range(replicas)), not torch.is_grad_enabled())
    results: dict[int, Any] = {}
    grad, autocast = torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")
    if replicas == 1:  # parallel_apply calls a single replica on the calling thread
        _worker(copies[0], x, results, 0, grad, autocast)
    else:
        threads = [threading.Thread(target=_worker, args=(replica, chunk, results, i, grad, autocast))
                   for i, (replica, chunk) in enumerate(zip(copies, x.chunk(replicas)))]  # fmt: skip
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return torch.cat([results[i] for i in range(replicas)])


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _x() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def _core_outputs(level: str, forward: Callable[[nn.Module, torch.Tensor], torch.Tensor], **amp: Any) -> torch.Tensor:
    engine = Amp(level, **{"half_dtype": "bfloat16", **amp})
    model = engine.prepare_model(_net())
    with engine.forward_context():
        return forward(model, engine.cast_inputs(_x()))


@pytest.mark.usefixtures("cpu_broadcast")
@pytest.mark.parametrize(
    ("level", "amp"),
    [("O1", {}), ("O2", {}), ("O1", {"half_dtype": "float16", "cast_table": "autocast"})],
    ids=["O1", "O2", "O1-autocast-float16"],
)
@pytest.mark.parametrize("replicas", [2, 1])
def test_data_parallel_replicas_compute_as_the_calling_thread(level: str, amp: dict[str, Any], replicas: int) -> None:
    """The core, ``forward_context()`` around ``DataParallel(model)``: the replicas' outputs have the dtype and the
    values of the single-thread forward (O1: bfloat16, were FP32; O1 on ``torch.autocast`` alone (a CUDA run's path)
    with float16: float16, were the worker's default autocast dtype, bfloat16 on the CPU). O2's model is half
    itself: its replicas computed in half before too."""
    if amp.get("cast_table") == "autocast":
        amp = {**amp, "cast_table": CastTable.autocast_aligned("cpu")}
    want = _core_outputs(level, lambda model, x: model(x), **amp)
    got = _core_outputs(level, lambda model, x: _data_parallel(model, x, replicas), **amp)
    assert want.dtype == (torch.float16 if amp.get("half_dtype") == "float16" else torch.bfloat16)
    assert got.dtype == want.dtype and torch.equal(got, want)


class _WithLoss(nn.Module):
    """A model that computes its loss in its forward (as Hugging Face models given labels do)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(x), torch.zeros(len(x), dtype=torch.long), reduction="none")


@pytest.mark.usefixtures("cpu_broadcast")
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_loss_computed_in_a_replica_is_fp32(level: str) -> None:
    """O2 needs the scope too: a loss function called inside the model runs in FP32 under ``forward_context()``
    (O2's loss policy); in a replica's thread it ran in bfloat16."""
    engine = Amp(level, half_dtype="bfloat16")
    model = engine.prepare_model(_WithLoss())
    with engine.forward_context():
        want = model(engine.cast_inputs(_x()))
        got = _data_parallel(model, engine.cast_inputs(_x()))
    assert want.dtype == got.dtype == torch.float32
    assert torch.equal(got, want)


@pytest.mark.usefixtures("cpu_broadcast")
@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("wrap", ["after", "before"])
def test_core_training_through_data_parallel_replicas(level: str, wrap: str) -> None:
    """Three SGD steps of the core loop through two replicas (``nn.DataParallel`` around the prepared model, or
    prepared itself) against the same steps without it: the same weights and masters, to the tolerance of a
    gradient summed over two half batches."""

    def run(parallel: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        engine = Amp(level, half_dtype="bfloat16")
        net = _net()
        model = engine.prepare_model(nn.DataParallel(net) if wrap == "before" else net)
        optimizer = engine.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        target = torch.randn(4, 4, generator=torch.Generator().manual_seed(2))
        for _ in range(3):
            with engine.forward_context():
                x = engine.cast_inputs(_x())
                out = _data_parallel(net, x) if parallel else net(x)
                assert out.dtype == torch.bfloat16
                loss = F.mse_loss(engine.cast_outputs(out), target)
            engine.backward(loss)
            engine.step(optimizer)
            engine.update()
            optimizer.zero_grad()
        return [p.detach().float() for p in net.parameters()], [m.clone() for m in engine.master_params(optimizer)]

    (weights, masters), (ref_weights, ref_masters) = run(True), run(False)
    for got, want in zip(weights + masters, ref_weights + ref_masters, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    assert not torch.equal(ref_masters[0], _net()[0].weight)  # it trained


@pytest.mark.usefixtures("cpu_broadcast")
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_apex_initialize_then_data_parallel(level: str) -> None:
    """Apex's documented order, ``amp.initialize`` then ``nn.DataParallel(model)``: the replicas compute as the
    model does on the calling thread (O1: the scope ``initialize`` entered; O2: the input cast of the model's
    hook, which the replica shares)."""
    from lightning_mpx.apex import _amp_state
    from lightning_mpx.apex import amp as apex_amp

    _amp_state.reset()
    try:
        model = _net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = apex_amp.initialize(model, optimizer, opt_level=level, verbosity=0,
                                               cast_model_type=torch.bfloat16 if level == "O2" else None)  # fmt: skip
        want = model(_x())
        got = _data_parallel(model, _x())
    finally:
        _amp_state.reset()
        _amp_state.registrations.clear()
    assert want.dtype == (torch.float16 if level == "O1" else torch.float32)  # (O2: the output cast back)
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.usefixtures("cpu_broadcast")
def test_nothing_is_carried_outside_a_scope_and_a_copy_replicates_itself() -> None:
    """Outside ``forward_context()`` the replicas run as the model does there (FP32 at O1); a deep copy of the
    prepared model (an EMA copy) replicates itself, not the original; a replica is not replicated again."""
    engine = Amp("O1", half_dtype="bfloat16")
    model = engine.prepare_model(_net())
    assert _data_parallel(model, _x()).dtype == torch.float32
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin[0].weight.zero_()
    with engine.forward_context():
        assert torch.equal(_data_parallel(twin, _x()), twin(_x()))
        assert not torch.equal(twin(_x()), model(_x()))
    replica = model._replicate_for_data_parallel()
    assert "_replicate_for_data_parallel" not in replica.__dict__
    seen = []

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        seen.append(self)
        return x

    model.forward = types.MethodType(forward, model)  # bound to the model: Accelerate's autocast wrapper's habit
    replica = model._replicate_for_data_parallel()
    replica(_x())
    assert seen == [replica]  # it ran the model's parameters from every replica
    del model.forward  # (the test's own cycle)
    with engine.forward_context():  # a replica with the scope carried, and the model, are freed without a gc pass
        replica, gone = model._replicate_for_data_parallel(), weakref.ref(model)
    gone_replica = weakref.ref(replica)
    gc.disable()
    try:
        del model, replica
        assert gone() is None and gone_replica() is None
    finally:
        gc.enable()


# -- 2. an FP32 module's output cast follows the model's dtype (model.float() after an O2 fit) -----------------------
class _Tied(nn.Module):
    """An embedding, a half layer, and a head whose weight is the embedding's (tied)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(ids))))


def _ids() -> torch.Tensor:
    return torch.randint(0, 10, (4, 3), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("pinned", ["1", "head"])
def test_core_o2_fp32_module_output_follows_the_model_made_fp32(pinned: str) -> None:
    """Core O2, ``fp32_modules`` (a middle layer; a tied head, whose embedding runs FP32 too): trained one step, the
    model half; then ``model.float()``: the forward runs in FP32 (it failed at the layer after the FP32 module with
    "mat1 and mat2 must have the same dtype") and equals the FP32 model's with the same weights. A deep copy made FP32
    while the original stays half: the original's FP32 module still casts its output to half."""
    engine = Amp("O2", half_dtype="bfloat16", fp32_modules=[pinned])
    model = engine.prepare_model(_net() if pinned == "1" else _Tied())
    x = _x() if pinned == "1" else _ids()
    optimizer = engine.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with engine.forward_context():
        loss = engine.cast_outputs(model(engine.cast_inputs(x))).float().square().mean()
    engine.backward(loss)
    engine.step(optimizer)
    engine.update()
    twin = copy.deepcopy(model).float()
    with engine.forward_context():
        assert model(engine.cast_inputs(x)).dtype == torch.bfloat16  # the original: half still
    for fp32 in (twin, model.float()):
        reference = _net() if pinned == "1" else _Tied()  # hookless, with the same weights
        with torch.no_grad():
            for name, param in fp32.named_parameters():
                reference.get_parameter(name).copy_(param)
            out = fp32(x)
            assert out.dtype == torch.float32
            assert torch.equal(out, reference(x))


def test_fabric_o2_fp32_module_output_follows_the_model_made_fp32() -> None:
    """Fabric, O2 with ``fp32_modules``, one step; then the user's own model made FP32 (``net.float()``) for an FP32
    evaluation: it runs in FP32 (the FP32 module's output was cast to half, and the next layer failed). Fabric's
    wrapper refuses the converted model with a message that names the conversion (as before)."""
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    net = nn.Sequential(_net(), nn.Tanh(), nn.Linear(4, 4))
    plugin = FabricMixedPrecisionPlugin("O2", half_dtype=torch.bfloat16, fp32_modules=["0.2"])
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    fabric.backward(model(_x()).float().square().mean())
    optimizer.step()
    assert net[0][2].weight.dtype == torch.float32 and net[2].weight.dtype == torch.bfloat16
    net.float()
    with torch.no_grad():
        assert net(_x()).dtype == torch.float32
    with pytest.raises(RuntimeError, match="converted to torch.float32 after prepare_model"):
        model(_x())


# -- 3. the lazy-module refusal names the door the user used --------------------------------------------------------
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_the_lazy_module_refusal_names_trainer_train_through_mpx_trainer(tmp_path: Any) -> None:
    """``mpx_trainer`` at O2 with an ``nn.LazyLinear`` not materialized: the refusal names ``trainer.train`` (the
    user's call, where the model is prepared), not ``accelerator.prepare``, which the user never called."""
    transformers = pytest.importorskip("transformers")

    from lightning_mpx.accelerate import MixedPrecisionKwargs, mpx_trainer

    class Lazy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 2))

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": F.cross_entropy(self.net(x), labels)}

    data = [{"x": torch.randn(8), "labels": torch.tensor(i % 2)} for i in range(4)]
    args = transformers.TrainingArguments(str(tmp_path), report_to=[], use_cpu=True, max_steps=1,
                                          per_device_train_batch_size=4, save_strategy="no")  # fmt: skip
    trainer = mpx_trainer(transformers.Trainer)(model=Lazy(), args=args, train_dataset=data, opt_level="O2",
                                                mpx_kwargs=MixedPrecisionKwargs(half_dtype="bfloat16"))  # fmt: skip
    with pytest.raises(ValueError, match=r"O2 makes the FP32 master weights at trainer\.train, before any") as error:
        trainer.train()
    assert "accelerator.prepare" not in str(error.value)
    assert "Run one forward on an example batch before trainer.train" in str(error.value)


# -- the HF Trainer over several GPUs without a distributed launch (nn.DataParallel by itself) ----------------------
class _Labelled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()
        self.dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)
        self.dtypes.append(out.dtype)
        return {"loss": F.mse_loss(out.float(), labels)}


def _hf_run(level: str, gpus: int, tmp_path: Any) -> tuple[_Labelled, Any]:
    transformers = pytest.importorskip("transformers")

    from lightning_mpx.accelerate import MixedPrecisionKwargs, mpx_trainer

    g = torch.Generator().manual_seed(5)
    data = [{"x": torch.randn(8, generator=g), "labels": torch.randn(4, generator=g)} for _ in range(8)]
    args = transformers.TrainingArguments(str(tmp_path / str(gpus)), report_to=[], use_cpu=True, max_steps=2,
                                          per_device_train_batch_size=4 // gpus, save_strategy="no",
                                          learning_rate=0.1, lr_scheduler_type="constant")  # fmt: skip
    args._n_gpu = gpus  # (read after the devices are set up): the Trainer wraps nn.DataParallel itself when > 1
    model = _Labelled()
    trainer = mpx_trainer(transformers.Trainer)(model=model, args=args, train_dataset=data, opt_level=level,
                                                mpx_kwargs=MixedPrecisionKwargs(half_dtype="bfloat16"))  # fmt: skip
    trainer.train()
    return model, trainer


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_mpx_trainer_wrapping_data_parallel_itself_trains_with_the_opt_level(level: str, tmp_path: Any) -> None:
    """``mpx_trainer`` where the Trainer sees two GPUs without a distributed launch (``n_gpu=2``): it wraps the model
    in ``nn.DataParallel`` and prepared no model with the Accelerator. O1 trained in FP32, silently; O2 refused the
    optimizer ("prepared before its model", a call the user never made). Now the model is prepared inside the
    wrapper: it trains as on one device (DataParallel calls the model itself here, without a GPU), its replicas'
    forward bound to each replica."""
    pytest.importorskip("transformers")
    model, trainer = _hf_run(level, 2, tmp_path)
    reference, single = _hf_run(level, 1, tmp_path)
    assert type(trainer.model_wrapped) is nn.DataParallel and trainer.model_wrapped.module is model
    assert model.dtypes == reference.dtypes == [torch.bfloat16] * 2
    got = trainer.accelerator.amp.fp32_state_dict(model)
    want = single.accelerator.amp.fp32_state_dict(reference)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert not torch.equal(got["net.0.weight"], _net()[0].weight)  # it trained
    replica = model._replicate_for_data_parallel()  # as torch's replicate calls it over two GPUs
    assert replica.forward._forward._method().__self__ is replica  # the adapter's forward runs the replica's


def test_apex_o2_batch_norm_kept_fp32_has_no_output_cast_and_a_converted_model_is_named() -> None:
    """The Apex layer at O2 with ``keep_batchnorm_fp32``: batch norm takes the half input with its FP32 parameters
    (no hook of its own casts its output, unlike ``fp32_modules``); a model made FP32 after ``amp.initialize``
    (``model.float()``) is refused at its next forward with a message naming the conversion, as before."""
    from lightning_mpx.apex import _amp_state
    from lightning_mpx.apex import amp as apex_amp

    _amp_state.reset()
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = apex_amp.initialize(model, optimizer, opt_level="O2", keep_batchnorm_fp32=True,
                                               cast_model_type=torch.bfloat16, verbosity=0)  # fmt: skip
        assert model[1].weight.dtype == torch.float32 and model[2].weight.dtype == torch.bfloat16
        assert not model[1]._forward_hooks and not model[1]._forward_pre_hooks
        assert model(_x()).dtype == torch.float32  # (the model's output cast back, Apex's)
        model.float()
        with pytest.raises(RuntimeError, match=r"converted after amp\.initialize\(\) \(model\.float\(\)"):
            model(_x())
    finally:
        _amp_state.reset()
        _amp_state.registrations.clear()
