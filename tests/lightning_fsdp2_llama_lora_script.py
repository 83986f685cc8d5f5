"""Run by tests/test_lightning_fsdp2_llama_lora.py: a hostile FSDP2 user on two CPU processes (gloo), one launch. Cases:

* ``rope``: a tiny Hugging Face ``LlamaForCausalLM`` (from a config) trained by the Trainer under
  ``ModelParallelStrategy`` at O2 bfloat16, sharded per ``LlamaDecoderLayer``; against the same model and global
  batches trained unsharded at O2 by the core ``Amp`` in each rank (no collective). Records the rotary inverse
  frequencies (dtype, values) before and after.
* ``lora``: Fabric ``ModelParallelStrategy`` at O1 float16, dynamic scale (O2 is refused there, docs/fabric.md):
  blocks whose base ``Linear`` is frozen and whose LoRA-like adapters train (mixed ``requires_grad`` in one unit);
  two micro-batches a step under ``fabric.no_backward_sync``, an inf in rank 1's shard only at ``INF_AT``,
  ``clip_gradients`` by norm; ``fabric.save`` before the first step and after ``RESUME_AT`` steps, each resumed by a
  fresh Fabric.
* ``clip:<precision>``: the Trainer under ``ModelParallelStrategy`` with ``gradient_clip_val`` (by norm): the plugin
  at O1 and O2 bfloat16, and Lightning's own ``bf16-mixed`` (the reference).
* ``lora_trainer``: the same LoRA-like model through the Trainer at O2 float16 (accumulation, a clip by norm): a fit
  of ``STEPS`` steps against two stages (a new Trainer and plugin, another initial scale, fit the sharded model
  again), then a third stage at O1 (refused) and a stage after a fit that left its gradients.

Every rank writes ``$MPX_OUT/rank{r}.json``.
"""

from __future__ import annotations

import functools
import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.launch import case_error, end_ranks, launch_ranks, write_rank_results

STEPS = 4
INF_AT = 1  # lora: rank 1's shard of an adapter gradient gets an inf at this step
RESUME_AT = 2
CLIP = 0.05
VOCAB = 64
TIMEOUT = timedelta(seconds=60)  # a collective one rank alone makes fails rather than hangs


def local(t: torch.Tensor) -> torch.Tensor:
    from lightning_mpx.engine.sharding import local_tensor

    return local_tensor(t)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_params(model: nn.Module) -> dict[str, list[float]]:
    return {n: full(p).detach().double().flatten().tolist() for n, p in model.named_parameters()}


def tokens(step: int, rank: int | None) -> torch.Tensor:
    """Step ``step``'s global batch (``rank=None``) or rank ``rank``'s half of it."""
    ids = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(100 + step))
    return ids if rank is None else ids[rank * 2 : (rank + 1) * 2]


# -- rope --------------------------------------------------------------------------------------------------------------
def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rope_theta=10000.0, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def rotary(model: nn.Module) -> dict[str, Any]:
    return {
        n: {"dtype": str(b.dtype), "values": full(b).double().flatten().tolist()}
        for n, b in model.named_buffers()
        if n.endswith("inv_freq")
    }


def llama_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())


def rope_reference() -> dict[str, Any]:
    """Unsharded O2 bfloat16, the whole global batch, in this process alone."""
    from lightning_mpx import Amp

    amp = Amp("O2", half_dtype="bfloat16", loss_scale=1.0)
    model = amp.prepare_model(llama())
    opt = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    losses = []
    for step in range(STEPS):
        with amp.forward_context():
            loss = llama_loss(model, amp.cast_inputs(tokens(step, None)))
        amp.backward(loss)
        amp.step(opt)
        amp.update()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "rotary": rotary(model)}


def rope_case() -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from lightning_mpx import MixedPrecisionPlugin
    from lightning_mpx.integrations.fsdp import shard_model
    from tests.lightning_helpers import make_trainer

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.llama = llama()
            self.losses: list[float] = []
            self.before = rotary(self.llama)

        def configure_model(self) -> None:
            shard_model(self.llama, self.trainer.precision_plugin, mesh=self.device_mesh["data_parallel"],
                        blocks=LlamaDecoderLayer)  # fmt: skip
            self.sharded = rotary(self.llama)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            ids = tokens(self.global_step, self.global_rank)
            loss = llama_loss(self.llama, ids)
            reduced = loss.detach().clone()
            dist.all_reduce(reduced)
            self.losses.append(reduced.item() / 2)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.5)

    plugin = MixedPrecisionPlugin("O2", half_dtype="bfloat16", loss_scale=1.0)
    model = Lit()
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=TIMEOUT)
    trainer = make_trainer(plugin, strategy=strategy, devices=2, max_steps=STEPS, use_distributed_sampler=False)
    trainer.fit(model, torch.utils.data.DataLoader(range(STEPS), batch_size=None))
    return {"losses": model.losses, "before": model.before, "sharded": model.sharded, "after": rotary(model.llama),
            "reference": rope_reference()}  # fmt: skip

# -- lora --------------------------------------------------------------------------------------------------------------
class LoRALinear(nn.Module):
    """A frozen base ``Linear`` and trainable low-rank adapters (``B`` starts at zero, as LoRA's)."""

    def __init__(self, features: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(features, features)
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(features, rank, bias=False)
        self.lora_b = nn.Linear(rank, features, bias=False)
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


def lora_model() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), LoRALinear(16), nn.Tanh(), LoRALinear(16), nn.Linear(16, 4))


def lora_batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + 10 * step + micro)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    return x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]


def lora_fabric() -> tuple[Any, Any, Any, Any]:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    from lightning_mpx import FabricMixedPrecisionPlugin
    from lightning_mpx.integrations.fsdp import shard_model

    # O1: Fabric's setup casts a model before parallelize_fn shards it, which O2 refuses (docs/fabric.md)
    plugin = FabricMixedPrecisionPlugin("O1", half_dtype="float16", init_scale=2.0**10, growth_interval=2,
                                        on_floor="continue")  # fmt: skip

    def parallelize(model: nn.Module, mesh: Any) -> nn.Module:
        return shard_model(model, plugin, mesh=mesh["data_parallel"], blocks=[model[2], model[4]])

    strategy = ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1, timeout=TIMEOUT)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin])
    fabric.launch()  # the first one starts the process group; later ones find it
    model = fabric.setup_module(lora_model())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01))
    return fabric, plugin, model, optimizer


def lora_train(fabric: Any, plugin: Any, model: Any, opt: Any, start: int, stop: int, out: dict[str, Any]) -> None:
    rank = fabric.global_rank
    for step in range(start, stop):
        for micro in range(2):
            x, y = lora_batch(step, micro, rank)
            with fabric.no_backward_sync(model, enabled=micro == 0):
                fabric.backward(F.mse_loss(model(x).float(), y))
        if step == INF_AT and rank == 1:
            local(model.module[4].lora_a.weight.grad).view(-1)[0] = float("inf")
        norm = fabric.clip_gradients(model, opt, max_norm=CLIP)
        out["norms"].append(float(full(norm)))
        opt.step()
        opt.zero_grad()
        out["skipped"].append(bool(plugin.step_was_skipped(opt)))
        out["scales"].append(float(plugin.metrics()["mpx/loss_scale"]))


def lora_case() -> dict[str, Any]:
    path = os.path.join(os.environ["MPX_OUT"], "lora")
    runs: dict[str, Any] = {}
    fabric, plugin, model, optimizer = lora_fabric()
    straight: dict[str, Any] = {"norms": [], "skipped": [], "scales": []}
    for start, stop in ((0, 0), (0, RESUME_AT), (RESUME_AT, STEPS)):
        lora_train(fabric, plugin, model, optimizer, start, stop, straight)
        if stop < STEPS:
            fabric.save(f"{path}{stop}", {"model": model, "optimizer": optimizer, "mpx": plugin})
    straight["params"] = full_params(model)
    straight["frozen_unchanged"] = all(
        torch.equal(full(model.module[i].base.weight), lora_model()[i].base.weight) for i in (2, 4)
    )
    runs["straight"] = straight
    for k in (0, RESUME_AT):
        fabric, plugin, model, optimizer = lora_fabric()
        state = {"model": model, "optimizer": optimizer, "mpx": plugin}
        fabric.load(f"{path}{k}", state)
        if state["mpx"] is not plugin:  # docs/fabric.md: ModelParallelStrategy hands back the plugin's state
            plugin.load_state_dict(state["mpx"])
        resumed: dict[str, Any] = {"norms": [], "skipped": [], "scales": []}
        lora_train(fabric, plugin, model, optimizer, k, STEPS, resumed)
        resumed["params"] = full_params(model)
        runs[f"from{k}"] = resumed
    return runs


def lora_trainer_case() -> dict[str, Any]:
    """O2 float16 through the Trainer: ``accumulate_grad_batches=2``, a clip by norm (``gradient_clip_val``);
    ``stage1`` fits ``RESUME_AT`` steps, ``stage2`` a new Trainer and plugin (another initial scale) fits the sharded
    model to ``STEPS``; ``straight`` fits ``STEPS`` at once; ``other_level``: a third Trainer at O1."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_mpx import MixedPrecisionPlugin
    from lightning_mpx.integrations.fsdp import shard_model
    from tests.lightning_helpers import make_trainer

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = lora_model()
            self.zero_at_end = False

        def configure_model(self) -> None:
            shard_model(self.net, self.trainer.precision_plugin, mesh=self.device_mesh["data_parallel"],
                        blocks=[self.net[2], self.net[4]])  # fmt: skip

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = lora_batch(batch // 2, batch % 2, self.global_rank)  # the global micro-batch index
            return F.mse_loss(self.net(x).float(), y)

        def on_train_end(self) -> None:
            if self.zero_at_end:  # no gradient left for the next stage (the parameters' swap alone)
                self.trainer.optimizers[0].zero_grad(set_to_none=True)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5)

    def fit(model: Lit, start: int, stop: int, level: str = "O2", init_scale: float = 2.0**10) -> Any:
        plugin = MixedPrecisionPlugin(level, half_dtype="float16", init_scale=init_scale, growth_interval=100,
                                      on_floor="continue")  # fmt: skip
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=TIMEOUT)
        trainer = make_trainer(plugin, strategy=strategy, devices=2, max_steps=stop - start, gradient_clip_val=CLIP,
                               accumulate_grad_batches=2, use_distributed_sampler=False)  # fmt: skip
        batches = list(range(2 * start, 2 * stop))
        trainer.fit(model, torch.utils.data.DataLoader(batches, batch_size=None))
        return plugin

    out: dict[str, Any] = {}
    straight = Lit()
    plugin = fit(straight, 0, STEPS)
    out["straight"] = {"skipped": plugin.amp.skipped_steps, "params": full_params(straight.net),
                       "frozen_unchanged": all(torch.equal(full(straight.net[i].base.weight),
                                                           lora_model()[i].base.weight) for i in (2, 4))}  # fmt: skip
    staged = Lit()
    staged.zero_at_end = True
    first = fit(staged, 0, RESUME_AT)
    second = fit(staged, RESUME_AT, STEPS, init_scale=2.0**6)
    out["staged"] = {"skipped": [first.amp.skipped_steps, second.amp.skipped_steps],
                     "params": full_params(staged.net)}  # fmt: skip
    for name, level, model in (("other_level", "O1", staged), ("grads_kept", "O2", straight)):
        try:  # another level on the sharded model; a stage after a fit that left its gradients
            fit(model, STEPS, STEPS + 1, level=level)
            out[name] = "accepted"
        except Exception as error:  # noqa: BLE001 - the message is the result
            out[name] = f"{type(error).__name__}: {error}"
    return out


# -- clip --------------------------------------------------------------------------------------------------------------
def clip_case(precision: str) -> dict[str, Any]:
    """``gradient_clip_val`` (by norm, below every step's norm) under ``ModelParallelStrategy``: the plugin at
    ``precision`` (an opt level, bfloat16, ``shard_model``) or Lightning's own (``bf16-mixed``, plain ``fully_shard``
    on the same units)."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from lightning_mpx import MixedPrecisionPlugin
    from lightning_mpx.integrations.fsdp import shard_model
    from tests.lightning_helpers import make_trainer

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(2)
            self.net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
            self.losses: list[float] = []
            self.norms: list[float] = []

        def configure_model(self) -> None:
            mesh, units = self.device_mesh["data_parallel"], [self.net[0], self.net[2]]
            if precision == "bf16-mixed":
                for unit in units:
                    fully_shard(unit, mesh=mesh)
                fully_shard(self.net, mesh=mesh)
            else:
                shard_model(self.net, self.trainer.precision_plugin, mesh=mesh, blocks=units)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = lora_batch(batch, 0, self.global_rank)
            out = self.net(x)
            self.out_dtype = str(out.dtype)
            loss = F.mse_loss(out.float(), y)
            reduced = loss.detach().clone()
            dist.all_reduce(reduced)
            self.losses.append(reduced.item() / 2)
            return loss

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:  # before Lightning's clip
            scale = self.trainer.precision_plugin.amp.scalers[0].get_scale() if plugin is not None else 1.0
            norm = torch.stack([full(p.grad).double().norm() for p in self.parameters()]).norm() / scale
            self.norms.append(float(norm))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.5)

    mixed = precision == "bf16-mixed"
    kwargs: dict[str, Any] = {"precision": precision} if mixed else {}
    plugin = None if mixed else MixedPrecisionPlugin(precision, half_dtype="bfloat16", loss_scale=1.0)
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=TIMEOUT)
    model = Lit()
    trainer = make_trainer(plugin, strategy=strategy, devices=2, max_steps=STEPS, gradient_clip_val=CLIP,
                           use_distributed_sampler=False, **kwargs)  # fmt: skip
    trainer.fit(model, torch.utils.data.DataLoader(range(STEPS), batch_size=None))
    return {"losses": model.losses, "params": full_params(model.net), "norms": model.norms, "dtype": model.out_dtype}


def main() -> int:
    if "RANK" not in os.environ:
        return launch_ranks(__file__, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    rank = int(os.environ["RANK"])
    results: dict[str, Any] = {}
    cases = {"rope": rope_case, "lora": lora_case, "lora_trainer": lora_trainer_case}
    cases.update({f"clip:{p}": functools.partial(clip_case, p) for p in ("O1", "O2", "bf16-mixed")})
    for name, case in cases.items():
        with case_error(results.setdefault(name, {})) as record:
            record.update(case())
        dist.barrier()
    write_rank_results(results, rank=rank)
    end_ranks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
