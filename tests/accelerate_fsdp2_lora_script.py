"""Run by tests/test_accelerate_fsdp2_lora.py: FSDP2 with peft LoRA adapters on a frozen base, at O2, on two CPU ranks
(gloo).

A tiny Llama (2 layers, hidden 32, vocab 128, built from a config: nothing downloaded) wrapped by
``peft.get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))``, trained as a user does:

- ``accelerate``: ``FullyShardedDataParallelPlugin(fsdp_version=2)`` (each ``LlamaDecoderLayer`` a unit) through
  ``lightning_mpx.accelerate.Accelerator(mixed_precision="O2")`` and through Accelerate's own ``"bf16"``, the same
  seed and batches: the losses, the adapters and base after the steps (gathered), ``accelerator.get_state_dict``,
  then ``save_state`` half-way and ``load_state`` into a fresh run. As in tests/accelerate_fsdp_script.py, the one
  step no user takes: Accelerate's shared state is told the processes are ``MULTI_GPU`` on device ``cpu`` (Accelerate
  selects FSDP on GPU-like devices only). ``accelerate_O2_half_base``: the base in bfloat16 before ``get_peft_model``
  (as ``from_pretrained(..., dtype=torch.bfloat16)``), peft's adapters FP32.
- ``lightning``: ``Trainer(strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))`` with the
  peft model in a LightningModule, sharded per decoder layer in ``configure_model`` (``shard_model`` with the
  plugin at O2; ``fully_shard`` per layer and root for ``"bf16-mixed"``).

Every rank writes ``$MPX_OUT/{part}_rank{r}.json``; a part that raises leaves its traceback in ``"error"``.
"""

import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

from tests.launch import case_error, end_ranks

STEPS = 4
HALF_AT = 2  # Accelerate's save_state after this many steps
BATCH = 4  # per rank
SEQ = 8
LR = 1e-2


def lora_llama(half_base: bool = False):
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=128, max_position_embeddings=32)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = LlamaForCausalLM(config)
        if half_base:  # as from_pretrained(..., dtype=torch.bfloat16); peft makes the adapters FP32
            base.to(torch.bfloat16)
        return peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 128, (2 * BATCH, SEQ), generator=g)[rank * BATCH:(rank + 1) * BATCH]


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def snapshot(model) -> dict:
    """Every parameter gathered, FP64 lists, by name (``lora_`` and the base apart), and the stored dtypes."""
    adapters, base, dtypes = {}, {}, {}
    for name, p in model.named_parameters():
        values = full(p.detach()).double().flatten().tolist()
        (adapters if "lora_" in name else base)[name] = values
        dtypes[name] = str(p.dtype)
    return {"adapters": adapters, "base": base, "dtypes": dtypes}


def mean_loss(loss: torch.Tensor) -> float:
    total = loss.detach().float().reshape(1).clone()
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


# -- Accelerate ----------------------------------------------------------------------------------------------------
def fsdp_accelerator(level: str):
    from accelerate import Accelerator as NativeAccelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    reset_accelerate_state()
    PartialState(cpu=True)
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU  # see the module docstring
    PartialState._shared_state["device"] = torch.device("cpu")
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        state_dict_type="SHARDED_STATE_DICT",
    )
    if level == "bf16":
        accelerator = NativeAccelerator(mixed_precision="bf16", fsdp_plugin=plugin, cpu=True)
    else:
        accelerator = Accelerator(mixed_precision=level, fsdp_plugin=plugin, cpu=True,
                                  kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16")])  # fmt: skip
    assert accelerator.distributed_type == DistributedType.FSDP, accelerator.distributed_type
    return accelerator


def accelerate_prepared(level: str, half_base: bool = False):
    accelerator = fsdp_accelerator(level)
    model = lora_llama(half_base)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def accelerate_steps(accelerator, model, optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        ids = batch(step, accelerator.process_index)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(mean_loss(loss))
    return losses


def accelerate_run(level: str, out: str, half_base: bool = False) -> dict:
    result: dict = {}
    with case_error(result):
        accelerator, model, optimizer = accelerate_prepared(level, half_base)
        result["before"] = snapshot(model)
        result["losses"] = accelerate_steps(accelerator, model, optimizer, range(STEPS))
        result["after"] = snapshot(model)
        if half_base or level == "bf16":
            return result
        state = accelerator.get_state_dict(model)
        result["state_dict"] = {
            k: {"dtype": str(v.dtype), "values": v.double().flatten().tolist() if "lora_" in k else None}
            for k, v in state.items()
        } if accelerator.is_main_process else None
    with case_error(result.setdefault("resume", {})) as resume:
        checkpoint = os.path.join(out, f"accelerate_{level}_checkpoint")
        accelerator, model, optimizer = accelerate_prepared(level)
        resume["first"] = accelerate_steps(accelerator, model, optimizer, range(HALF_AT))
        accelerator.save_state(checkpoint)
        resume["straight"] = accelerate_steps(accelerator, model, optimizer, range(HALF_AT, STEPS))
        resume["straight_adapters"] = snapshot(model)["adapters"]
        accelerator, model, optimizer = accelerate_prepared(level)
        accelerator.load_state(checkpoint)
        resume["resumed"] = accelerate_steps(accelerator, model, optimizer, range(HALF_AT, STEPS))
        resume["resumed_adapters"] = snapshot(model)["adapters"]
        resume["files"] = sorted(os.listdir(checkpoint))
    return result


# -- Lightning -----------------------------------------------------------------------------------------------------
def lightning_run(precision: str, half_base: bool = False) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from lightning_mpx import MixedPrecisionPlugin
    from lightning_mpx.fsdp import shard_model
    from tests.lightning_helpers import make_trainer

    class LoraModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = lora_llama(half_base)
            self.losses: list[float] = []
            self.before: dict = {}

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            if precision == "O2":
                shard_model(self.model, self.trainer.precision_plugin, mesh=mesh, blocks=LlamaDecoderLayer)
                return
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for layer in self.model.base_model.model.model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(self.model, mesh=mesh, mp_policy=policy)

        def on_fit_start(self) -> None:
            self.before = snapshot(self.model)

        def training_step(self, ids: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = self.model(input_ids=ids, labels=ids).loss
            self.losses.append(mean_loss(loss))
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=LR)

    result: dict = {}
    with case_error(result):
        rank = dist.get_rank()
        data = [batch(step, rank) for step in range(STEPS)]
        loader = torch.utils.data.DataLoader(data, batch_size=None)  # each rank its own batches, in order
        settings: dict = dict(strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), devices=2,
                              use_distributed_sampler=False)  # fmt: skip
        if precision == "O2":
            trainer = make_trainer(MixedPrecisionPlugin("O2", half_dtype="bfloat16"), **settings)
        else:
            trainer = make_trainer(precision="bf16-mixed", **settings)
        module = LoraModule()
        trainer.fit(module, loader)
        result.update(losses=module.losses, before=module.before, after=snapshot(module.model),
                      global_step=trainer.global_step)  # fmt: skip
    return result


def main() -> None:
    out, rank = os.environ["MPX_OUT"], int(os.environ["RANK"])
    parts = [(f"accelerate_{level}", lambda level=level: accelerate_run(level, out)) for level in ("O2", "bf16")]
    parts += [("accelerate_O2_half_base", lambda: accelerate_run("O2", out, half_base=True))]
    parts += [(f"lightning_{p}", lambda p=p: lightning_run(p)) for p in ("O2", "bf16-mixed")]
    for name, run in parts:
        start = time.perf_counter()
        result = run()
        result["seconds"] = time.perf_counter() - start  # shown by the test on failure
        with open(os.path.join(out, f"{name}_rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()
    end_ranks()


if __name__ == "__main__":
    sys.exit(main())
