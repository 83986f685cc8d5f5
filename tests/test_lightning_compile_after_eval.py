"""A hostile user, round two: ``torch.compile`` after an evaluation, a scale that changes every step, a float16 model
under a bfloat16 O1 run compiled with ``fullgraph=True``, FSDP2 through the Trainer (tied embedding and head,
``fp32_modules``, clipping with accumulation) against Lightning's own ``bf16-mixed``, and ``model.to()`` under
``torch.__future__.set_swap_module_params_on_conversion(True)`` at O2.

Compiled runs use the ``aot_eager`` backend (tests/compile_helpers.py says why)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

from lightning_mpx import Amp


class _Net(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ln = nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.ln(x))))


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(2, 3, 8, generator=g), torch.randint(0, 4, (2, 3), generator=g)) for _ in range(steps)]


def _train(amp: Amp | None, model: nn.Module, steps: int, evaluate_first: bool = False) -> dict[str, list[Any]]:
    """Steps of SGD through ``amp`` (``None``: ``torch.autocast`` bfloat16, the reference); the losses, and dynamo's
    graph count after each step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if amp is not None:
        optimizer = amp.prepare_optimizer(optimizer)
    if evaluate_first:  # a plain loop's evaluation: no_grad, not inference mode
        with torch.no_grad():
            if amp is None:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    model(torch.randn(3, 8))
            else:
                with amp.forward_context():
                    model(amp.cast_inputs(torch.randn(3, 8)))
    losses, graphs, scales = [], [], []
    for x, y in _batches(steps):
        if amp is None:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x).float().reshape(-1, 4), y.reshape(-1))
            loss.backward()
            optimizer.step()
        else:
            with amp.forward_context():
                out = amp.cast_outputs(model(amp.cast_inputs(x)))
                loss = F.cross_entropy(out.float().reshape(-1, 4), y.reshape(-1))
            amp.backward(loss)
            amp.step(optimizer)
            amp.update()
            scales.append(float(amp.scalers[0].get_scale()))
        optimizer.zero_grad()
        losses.append(loss.item())
        graphs.append(counters["stats"]["unique_graphs"])
    return {"losses": losses, "graphs": graphs, "scales": scales}


def _compiled(model: nn.Module, **kwargs: Any) -> nn.Module:
    return torch.compile(model, backend="aot_eager", **kwargs)  # type: ignore[return-value]


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_o1_model_evaluated_under_no_grad_then_trained_compiles_as_autocast_does() -> None:
    """A compiled model evaluated under ``no_grad`` (taken for a reentrant checkpoint's forward, which set the policy's
    "recomputes seen" flag) then trained: the first training graph guarded on that flag and recompiled at the second
    step, when the iteration boundary cleared it. Now: the graphs ``torch.autocast`` compiles (the evaluation's and the
    training's), and eager O1's losses."""
    amp = Amp("O1", half_dtype="bfloat16")
    ours = _train(amp, _compiled(amp.prepare_model(_Net())), 3, evaluate_first=True)
    # torch.autocast's count for the same loop (_train(None, ...), measured: [2, 2, 2]; not run here, to save the
    # two compiles): the evaluation's graph and the training's, then none
    assert ours["graphs"] == [2, 2, 2]
    assert not counters["graph_break"], dict(counters["graph_break"])
    eager_amp = Amp("O1", half_dtype="bfloat16")
    eager = _train(eager_amp, eager_amp.prepare_model(_Net()), 3, evaluate_first=True)
    assert ours["losses"] == pytest.approx(eager["losses"], rel=1e-3)


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_loss_scale_that_changes_every_step_does_not_recompile() -> None:
    """float16 O2 with a scale that backs off and grows at every other step: one graph, eager's losses."""
    settings = dict(half_dtype="float16", init_scale=2.0**20, growth_interval=1, max_loss_scale=2.0**22)
    amp = Amp("O2", **settings)  # type: ignore[arg-type]
    ours = _train(amp, _compiled(amp.prepare_model(_Net())), 5)
    assert len(set(ours["scales"])) > 1, ours["scales"]  # the scale did change
    assert ours["graphs"] == [1] * 5 and not counters["graph_break"]
    eager_amp = Amp("O2", **settings)  # type: ignore[arg-type]
    eager = _train(eager_amp, eager_amp.prepare_model(_Net()), 5)
    assert ours["scales"] == eager["scales"]
    assert ours["losses"] == pytest.approx(eager["losses"], rel=1e-3)


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_float16_model_compiled_fullgraph_trains_at_bfloat16_o1_as_in_eager() -> None:
    """A float16 checkpoint's model compiled with ``fullgraph=True`` before ``prepare_model`` (which has the policy
    cast the other half dtype): one graph, eager's losses."""
    amp = Amp("O1", half_dtype="bfloat16")
    ours = _train(amp, amp.prepare_model(_compiled(_Net().half(), fullgraph=True)), 3)
    assert ours["graphs"] == [1] * 3
    eager_amp = Amp("O1", half_dtype="bfloat16")
    eager = _train(eager_amp, eager_amp.prepare_model(_Net().half()), 3)
    assert ours["losses"] == pytest.approx(eager["losses"], rel=1e-3)


# -- set_swap_module_params_on_conversion at O2 ----------------------------------------------------------------------
@pytest.mark.parametrize("move", ["to_device", "cpu", "to_dtype"])
def test_moving_an_o2_model_under_swap_on_conversion_is_refused_with_the_ways_that_work(move: str) -> None:
    """Under ``set_swap_module_params_on_conversion(True)`` torch swaps every parameter ``Module._apply`` converts,
    even for a move that returns the parameter itself, and refuses one the masters refer to (weakly): a move raised
    torch's bare "Couldn't swap Linear.weight". Now the error names the setting and the ways that work, raised before
    anything is swapped: the model trains on, its masters intact."""
    amp = Amp("O2", half_dtype="bfloat16")
    model = amp.prepare_model(nn.Linear(4, 3))
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    amp.backward(amp.cast_outputs(model(amp.cast_inputs(torch.randn(2, 4)))).float().sum())
    amp.step(optimizer)
    amp.update()
    optimizer.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with pytest.raises(RuntimeError, match=r"on_conversion\(True\).*with the swap setting off"):
            {"to_device": lambda: model.to(torch.device("cpu")), "cpu": model.cpu,
             "to_dtype": lambda: model.to(torch.float32)}[move]()  # fmt: skip
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, b) for p, b in zip(model.parameters(), before))
    model.to(torch.device("cpu"))  # the setting off: moves
    amp.backward(amp.cast_outputs(model(amp.cast_inputs(torch.randn(2, 4)))).float().sum())
    assert amp.step(optimizer)
    assert not any(torch.equal(p, b) for p, b in zip(model.parameters(), before))


# -- FSDP2 through the Trainer ------------------------------------------------------------------------------------
V, D = 16, 8


@pytest.fixture
def group_of_one(monkeypatch: Any) -> Any:
    """The environment of a gloo group of one process, this one; the group and the environment undone after."""
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_network_port()), RANK="0", LOCAL_RANK="0")
    for name, value in dict(env, WORLD_SIZE="1", NODE_RANK="0").items():
        monkeypatch.setenv(name, value)
    try:
        yield
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _tied_lm(precision: str) -> Any:
    """A language model whose head is tied to its embedding, a LayerNorm kept FP32 (``fp32_modules``), sharded in
    ``configure_model`` by ``shard_model`` (or plain ``fully_shard`` on the same units for ``bf16-mixed``)."""
    import lightning.pytorch as pl
    from torch.distributed.fsdp import fully_shard

    from lightning_mpx.integrations.fsdp import shard_model

    class TiedLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(V, D)
            self.body = nn.Sequential(nn.Linear(D, D), nn.LayerNorm(D))
            self.head = nn.Linear(D, V, bias=False)
            self.head.weight = self.emb.weight
            self.losses: list[float] = []

        def configure_model(self) -> None:
            if getattr(self, "sharded", False):  # a second fit: sharded already
                return
            self.sharded, mesh = True, self.device_mesh["data_parallel"]
            if precision == "bf16-mixed":
                fully_shard(self.body, mesh=mesh)
                fully_shard(self, mesh=mesh)
            else:
                shard_model(self, self.trainer.precision_plugin, mesh=mesh, blocks=[self.body])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(self.emb(x)))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (x,) = batch
            loss = F.cross_entropy(self(x[:, :-1]).float().reshape(-1, V), x[:, 1:].reshape(-1))
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return TiedLM()


def _fit(model: Any, precision: str, steps: int) -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_mpx import MixedPrecisionPlugin
    from tests.lightning_helpers import make_trainer

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, V, (16, 6), generator=g))
    mixed = precision == "bf16-mixed"
    plugin = None if mixed else MixedPrecisionPlugin(precision, half_dtype="bfloat16", fp32_modules=["body.1"])
    make_trainer(
        plugin, strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1), max_steps=steps,
        gradient_clip_val=0.5, accumulate_grad_batches=2, **({"precision": precision} if mixed else {}),
    ).fit(model, torch.utils.data.DataLoader(data, batch_size=4))  # fmt: skip


@pytest.mark.skipif(not torch.distributed.is_available(), reason="ModelParallelStrategy needs torch.distributed")
def test_fsdp2_tied_head_fp32_modules_clipping_and_accumulation_then_a_second_fit_at_o1(group_of_one: Any) -> None:
    """Under ``ModelParallelStrategy``: a head tied to its embedding, a LayerNorm in ``fp32_modules``, clipping by
    norm with accumulation, fit at O2, then fit again by a new plugin at O1 on the model sharded already: the losses
    of Lightning's own FSDP2 ``bf16-mixed`` doing the same, and the head still tied."""
    reference = _tied_lm("bf16-mixed")
    _fit(reference, "bf16-mixed", 2)
    _fit(reference, "bf16-mixed", 1)
    ours = _tied_lm("O2")
    _fit(ours, "O2", 2)
    _fit(ours, "O1", 1)
    assert len(ours.losses) == len(reference.losses) == 6
    assert ours.losses == pytest.approx(reference.losses, rel=1e-2)
    assert ours.head.weight is ours.emb.weight



# -- fp32_modules naming a module inside a compiled submodule ---------------------------------------------------------
class _Compiled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D, D), nn.LayerNorm(D))
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_fp32_modules_match_through_a_compiled_submodule() -> None:
    """``fp32_modules=["body.1"]`` with ``model.body = torch.compile(model.body)`` (whose modules are named
    ``body._orig_mod.1``): the pattern matched nothing and ``prepare_model`` raised; now the LayerNorm is kept FP32
    as in the uncompiled model."""
    model = _Compiled()
    model.body = torch.compile(model.body, backend="eager")  # type: ignore[assignment]  (never run)
    Amp("O2", half_dtype="bfloat16", fp32_modules=["body.1"]).prepare_model(model)
    assert [p.dtype for p in model.parameters()] == [torch.bfloat16] * 2 + [torch.float32] * 2 + [torch.bfloat16] * 2


@pytest.mark.skipif(not torch.distributed.is_available(), reason="FSDP2 needs torch.distributed")
@pytest.mark.usefixtures("one_rank")
def test_fp32_modules_of_a_model_sharded_then_compiled_are_taken_as_its_fp32_units() -> None:
    """``shard_model`` with ``fp32_modules``, then a block compiled (as in a Lightning ``configure_model``): the check
    of the sharded model took ``body._orig_mod.1``, the FP32 unit, for a unit gathering in the wrong dtype and
    raised at the first forward; now the forward runs, its output FP32."""
    from lightning_mpx.integrations.fsdp import shard_model

    amp = Amp("O2", half_dtype="bfloat16", fp32_modules=["body.1"])
    model = _Compiled()
    shard_model(model, amp, blocks=[model.body])
    model.body = torch.compile(model.body, backend="eager")  # type: ignore[assignment]  (the names are the point)
    amp.prepare_model(model)
    with amp.forward_context():  # the engine takes the sharded model (and checks it) at its first forward
        out = amp.cast_outputs(model(amp.cast_inputs(torch.randn(2, D))))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
