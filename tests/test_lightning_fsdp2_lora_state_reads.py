"""A hostile user against stop 62's newest surfaces, from the user's side, against the framework's own precision:

- Lightning's ``ModelParallelStrategy`` (FSDP2, one CPU process) at O2 with a LoRA-style model on a frozen bfloat16
  base: the common ``configure_optimizers`` (``AdamW(self.parameters())``) is refused before any step, naming the fix
  in Lightning's terms; the fixed one trains as ``precision="bf16-mixed"``.
- Logging habits with ``optimizer.state`` by a half parameter at O2 (``StateByMasters``): a Callback reading
  ``trainer.optimizers[0].state.get(p, {}).get("exp_avg_sq")``, resetting a layer's moments (``state[p] = {}``,
  ``pop``), ``clip_grad_norm_`` then a moment read in manual optimization; all against ``"bf16-mixed"``.
- The Hugging Face Trainer door (``mpx_trainer``) with a custom ``create_optimizer`` building named groups and a
  ``TrainerCallback.on_step_end`` reading ``kwargs["optimizer"].state.get(p)``, against ``bf16=True``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from lightning_mpx import MixedPrecisionPlugin  # noqa: E402
from tests.lightning_helpers import make_trainer  # noqa: E402

BF16 = torch.bfloat16


class Lora(nn.Module):
    """A frozen base loaded in bfloat16 and an FP32 adapter and head (as peft on ``from_pretrained(dtype=bf16)``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Linear(8, 8).to(BF16).requires_grad_(False)
        self.adapter = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.base(x) + self.adapter(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)))


def _loader(n: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(n)]
    return torch.utils.data.DataLoader(data, batch_size=None)


def _trainer(precision: str, **settings: Any) -> pl.Trainer:
    if precision == "O2":
        return make_trainer(MixedPrecisionPlugin("O2", half_dtype="bfloat16"), **settings)
    return make_trainer(precision=precision, **settings)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().float().clone()


@pytest.fixture
def own_group():
    """Lightning's ``ModelParallelStrategy`` sets up a gloo group of one in this process: destroyed after the test."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class Sharded(pl.LightningModule):
    def __init__(self, precision: str, trainable_only: bool) -> None:
        super().__init__()
        self.model, self.precision, self.trainable_only = Lora(), precision, trainable_only
        self.losses: list[float] = []
        self.before: dict[str, torch.Tensor] = {}

    def configure_model(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from lightning_mpx.fsdp import shard_model

        mesh = self.device_mesh["data_parallel"]
        if self.precision == "O2":
            shard_model(self.model, self.trainer.precision_plugin, mesh=mesh)
        else:
            policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
            fully_shard(self.model, mesh=mesh, mp_policy=policy)
        self.before = {n: _full(p) for n, p in self.model.named_parameters()}

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.model(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = filter(lambda p: p.requires_grad, self.parameters()) if self.trainable_only else self.parameters()
        return torch.optim.AdamW(params, lr=1e-2)


def _fit_sharded(precision: str, trainable_only: bool) -> Sharded:
    from lightning.pytorch.strategies import ModelParallelStrategy

    module = Sharded(precision, trainable_only)
    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    _trainer(precision, strategy=strategy).fit(module, _loader(4))
    return module


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_lightning_fsdp2_o2_refuses_self_parameters_in_lightning_terms_then_the_fix_trains_as_bf16_mixed(own_group):
    refused = Sharded("O2", trainable_only=False)
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    with pytest.raises(ValueError, match=r"model\.base\.weight, model\.base\.bias\..*configure_optimizers: "
                                         r"filter\(lambda p: p\.requires_grad, self\.parameters\(\)\)"):  # fmt: skip
        _trainer("O2", strategy=strategy).fit(refused, _loader(4))
    assert refused.losses == []  # refused before any step: no weight moved
    assert {n: _full(p) for n, p in refused.model.named_parameters()}.keys() == refused.before.keys()
    for name, p in refused.model.named_parameters():
        assert torch.equal(_full(p), refused.before[name]), name
    torch.distributed.destroy_process_group()

    ours = _fit_sharded("O2", trainable_only=True)
    torch.distributed.destroy_process_group()
    native = _fit_sharded("bf16-mixed", trainable_only=True)
    assert ours.losses == pytest.approx(native.losses, rel=2.0**-7)
    for name, p in ours.model.named_parameters():
        after, reference = _full(p), _full(dict(native.model.named_parameters())[name])
        if name.startswith("base."):
            assert torch.equal(after, ours.before[name]), name  # the frozen base: unchanged
        else:
            assert not torch.equal(after, ours.before[name]), name
            assert (after - reference).abs().max() <= 2.5e-2, name  # lr 1e-2 a step: rounding flips only


class Reader(pl.Callback):
    """Reads Adam's second moments every other step by ``pl_module.named_parameters()``; at batch 3 resets the
    moments of ``l1`` (``state[p] = {}``) and of ``l2.bias`` (``state.pop(p)``), a plateau habit."""

    def __init__(self) -> None:
        self.reads: list[dict[str, float | None]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        state, batch_idx = trainer.optimizers[0].state, args[-1]
        if batch_idx % 2 == 1:
            moments = {n: state.get(p, {}).get("exp_avg_sq") for n, p in pl_module.named_parameters()}
            self.reads.append({n: None if v is None else v.float().sum().item() for n, v in moments.items()})
        if batch_idx == 3:
            for p in pl_module.model.l1.parameters():
                state[p] = {}
            state.pop(pl_module.model.l2.bias)


class Plain(pl.LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.model, self.automatic_optimization = Net(), not manual
        self.losses: list[float] = []
        self.clipped: list[tuple[float, dict[str, torch.Tensor]]] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        x, y = batch
        loss = nn.functional.cross_entropy(self.model(x).float(), y)
        self.losses.append(loss.item())
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        norm = torch.nn.utils.clip_grad_norm_(self.parameters(), 0.1)
        optimizer.step()
        state = optimizer.optimizer.state
        self.clipped.append((float(norm), {n: state[p]["exp_avg"].float().clone() for n, p in self.named_parameters()}))
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_a_callback_reading_and_resetting_adam_moments_at_o2_follows_bf16_mixed():
    runs = {}
    for precision in ("O2", "bf16-mixed"):
        reader, module = Reader(), Plain()
        _trainer(precision, callbacks=[reader]).fit(module, _loader(8))
        runs[precision] = reader, module
    (ours, ours_module), (native, native_module) = runs["O2"], runs["bf16-mixed"]
    assert len(ours.reads) == 4 and all(v is not None for read in ours.reads for v in read.values())
    for read, reference in zip(ours.reads, native.reads, strict=True):
        assert read == pytest.approx(reference, rel=2e-2)
    # the reset took: l1's moments after it are below their value before it, as in the reference
    assert ours.reads[2]["model.l1.weight"] < 0.6 * ours.reads[1]["model.l1.weight"]
    assert ours_module.losses == pytest.approx(native_module.losses, rel=2e-3)
    for (name, p), q in zip(ours_module.model.named_parameters(), native_module.model.parameters(), strict=True):
        assert (p.float() - q).abs().max() <= 1e-2, name


def test_clip_grad_norm_then_a_moment_read_in_manual_optimization_at_o2_follows_bf16_mixed():
    modules = {precision: Plain(manual=True) for precision in ("O2", "bf16-mixed")}
    for precision, module in modules.items():
        _trainer(precision).fit(module, _loader(4))
    for (norm, moments), (native_norm, native_moments) in zip(modules["O2"].clipped, modules["bf16-mixed"].clipped,
                                                              strict=True):  # fmt: skip
        assert norm == pytest.approx(native_norm, rel=2.0**-7)  # the half gradients' norm: bfloat16 rounding
        for name, moment in moments.items():
            assert moment.dtype == torch.float32  # the master's moment, not a half copy
            assert (moment - native_moments[name]).norm() <= 2e-2 * native_moments[name].norm(), name


def test_hf_trainer_named_groups_and_an_on_step_end_state_read_at_o2_follow_bf16(tmp_path):
    transformers = pytest.importorskip("transformers")
    from lightning_mpx.accelerate import MixedPrecisionKwargs, mpx_trainer
    from tests.accelerate_helpers import accelerate_state_reset

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    ids = torch.randint(0, 64, (12, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]

    class Groups:
        def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
            if self.optimizer is None:
                named = list(self.model.named_parameters())
                rest = [p for n, p in named if "ln_" in n or n.endswith("bias")]
                decay = [p for n, p in named if not any(p is q for q in rest)]
                self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1, "name": "decay"},
                                                    {"params": rest, "weight_decay": 0.0, "name": "no_decay"}],
                                                   lr=1e-3)  # fmt: skip
            return self.optimizer

    class StateReader(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.reads: list[dict[str, float | None]] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            optimizer = kwargs["optimizer"]
            read = {n: optimizer.state.get(p) for n, p in kwargs["model"].named_parameters()}
            self.reads.append({n: None if s is None else s["exp_avg_sq"].float().sum().item() for n, s in read.items()})

    results = {}
    for level in ("O2", None):
        with accelerate_state_reset():
            torch.manual_seed(0)
            args = transformers.TrainingArguments(output_dir=str(tmp_path / str(level)), use_cpu=True, report_to=[],
                                                  max_steps=3, per_device_train_batch_size=4, logging_steps=1,
                                                  save_strategy="no", disable_tqdm=True,
                                                  bf16=level is None)  # fmt: skip
            reader = StateReader()
            made = dict(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=data, callbacks=[reader])
            if level is None:
                trainer = type("Native", (Groups, transformers.Trainer), {})(**made)
            else:
                door = type("Ours", (Groups, mpx_trainer()), {})
                trainer = door(**made, opt_level=level, mpx_kwargs=MixedPrecisionKwargs(half_dtype="bfloat16"))
            trainer.train()
            assert [g["name"] for g in trainer.optimizer.param_groups] == ["decay", "no_decay"]
            results[level] = reader.reads, [log["loss"] for log in trainer.state.log_history if "loss" in log]
    (reads, losses), (native_reads, native_losses) = results["O2"], results[None]
    assert losses == pytest.approx(native_losses, rel=2e-3)
    assert len(reads) == 3 and all(v is not None for read in reads for v in read.values())
    for read, reference in zip(reads, native_reads, strict=True):
        assert read == pytest.approx(reference, rel=5e-2)
