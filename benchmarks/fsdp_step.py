"""Sharded training speed and memory: lightning_mpx under FSDP against the frameworks' own FSDP mixed precision.

One GPU, one rank (world size 1, one process group for the whole run): FSDP still runs its whole machinery (the
all-gather of each block's parameters before its forward and backward, the reduce-scatter of the gradients, the
sharded optimizer step), so the figures say what the mixed-precision layer costs on top of it, not what sharding saves
across ranks. Every model is ``benchmarks/step.py``'s GPT (pre-norm blocks, tied embedding), AdamW (lr 1e-3). Four
comparisons (groups), each against its reference row:

* ``gpt2``: GPT-2 small (sequence 512, batch 8) under Lightning's FSDP2 ``ModelParallelStrategy`` (``fully_shard`` per
  block and on the root in ``configure_model``): ``fsdp2-lightning-bf16-mixed`` (Lightning's ``precision="bf16-mixed"``,
  the reference; Lightning refuses "16-mixed" there) against ``MixedPrecisionPlugin`` at O2/O1, fp16/bf16, sharded with
  ``lightning_mpx.integrations.fsdp.shard_model``. Goals: O2 throughput >= 1.05x and peak memory <= 0.8x; O1
  throughput >= 0.97x.
* ``gpt1b``: the same rows and goals on a GPU-bound GPT of 1.31B parameters (24 layers, width 2048, 16 heads,
  sequence 1024, batch 4: the five rows alive together fit an 80 GB H100, about 26 GB of FP32 shards at rest plus
  the running row's gradients, AdamW state and activations).
* ``fsdp1``: GPT-2 small under Lightning's ``FSDPStrategy`` (FSDP1, one unit per block): "bf16-mixed" (reference),
  "16-mixed" (``ShardedGradScaler``; information only) and the plugin at O2 fp16/bf16. Goal: O2 >= 1.05x.
* ``accelerate``: GPT-2 small under Accelerate's ``FullyShardedDataParallelPlugin(fsdp_version=2)`` (blocks
  auto-wrapped): ``Accelerator(mixed_precision="bf16")`` (reference) against ``lightning_mpx.accelerate.Accelerator(
  mixed_precision="O2")`` in fp16 and bf16. Goal: O2 >= 1.05x.

Method: the rows of a group are measured in this one process, round by round, the order rotated every round
(``_harness.rotation``); never one process per row. A Lightning row is built once (model, Trainer), warmed up, and
continues each round with ``step.fit_more`` (``Trainer.fit`` again, ``max_steps`` raised; ``configure_model`` skips a
model already sharded; FSDP1's root wrapper is kept from the first fit). Lightning makes a new optimizer at every fit:
after its round a row's finished optimizer state and gradients are released, so a row at rest holds its sharded
parameters only. Accelerate's state is a process singleton, so its rows cannot live side by side: each round rebuilds
the row (state reset, the same initial weights from a CPU state dict, prepare, 3 untimed steps) and
frees it after. A round of a row is ``steps + 1`` steps; the first (a new optimizer's state, made lazily) is dropped
and the round's figure is the median of the others, each timed between two ``torch.cuda.synchronize()``. Per round
the throughput ratio to the reference is paired (its step time / the row's, the same round); the JSON keeps every
round's ratio, the median and the spread, and ``gpu_report.py`` judges the goals on the median, calling a goal met
only when two runs agree.

Peak memory (CUDA) is each row's own: for a round, the memory the row holds at rest (measured as the change of
``torch.cuda.memory_allocated`` over its build and over each of its rounds, the rest released) plus the highest
``torch.cuda.max_memory_allocated`` above what was allocated when its round began (peak statistics reset then); the
row's figure is the highest round. The process's cuBLAS workspaces and first collective are made before any row,
so that no row is charged with them. On CPU (``--check``) no memory is measured.

    python benchmarks/fsdp_step.py --device cuda --out DIR/fsdp_step_cuda.json     # every group, ~5.5 min (H100)
    python benchmarks/fsdp_step.py --device cuda --groups gpt1b --out FILE          # one group (~2 min)
    python benchmarks/fsdp_step.py --check --out FILE                                # CPU, tiny, every code path

``--budget`` (seconds, default 330) is shared out between the groups; a group stops starting rounds when the next
would pass its share (after ``MIN_ROUNDS``) or the budget; the file is rewritten after every round.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import socket
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import _harness  # benchmarks/ is on sys.path when a script runs
import step

#: The reference of every group's ratios, and the rows the groups measure (goal rows and information rows).
FSDP2_VARIANTS = ("fsdp2-lightning-bf16-mixed", "fsdp2-mpx-O2-fp16", "fsdp2-mpx-O2-bf16", "fsdp2-mpx-O1-fp16",
                  "fsdp2-mpx-O1-bf16")  # fmt: skip
FSDP1_VARIANTS = ("fsdp1-lightning-bf16-mixed", "fsdp1-lightning-16-mixed", "fsdp1-mpx-O2-fp16", "fsdp1-mpx-O2-bf16")
ACCELERATE_VARIANTS = ("accelerate-bf16", "accelerate-mpx-O2-fp16", "accelerate-mpx-O2-bf16")
#: A GPT of 1.31B parameters: GPU-bound on an H100 at sequence 1024.
GPT_1B = step.ModelSpec(batch=4, vocab=50257, seq=1024, dim=2048, layers=24, heads=16)
#: --check's tiny stand-in for it (another shape than GPT-2 small's stand-in, step.py's "tiny" GPT; the same code).
GPT_1B_CHECK = step.ModelSpec(batch=2, vocab=32, seq=8, dim=16, layers=2, heads=2)
#: Rounds a group runs before the budget may stop it (fewer are not judged: gpu_report needs three paired ratios).
MIN_ROUNDS = 3
#: --check's rounds: both orders of a group's two rows and a second continued fit (or rebuild) of each row, the paths
#: a GPU run's later rounds take; a third round would repeat the first's order (~2.5 s of CPU in the test suite).
CHECK_ROUNDS = 2


@dataclass(frozen=True)
class Group:
    """One comparison: its rows (the reference first), model, steps per round and share of the budget."""

    name: str
    title: str
    variants: tuple[str, ...]
    spec: step.ModelSpec
    check_spec: step.ModelSpec
    steps: int  # timed steps per round (one more runs first, untimed)
    warmup: int  # steps at build (Lightning) or before each round (Accelerate)
    weight: float  # share of --budget
    check_variants: tuple[str, ...]

    @property
    def reference(self) -> str:
        return self.variants[0]


GROUPS: dict[str, Group] = {g.name: g for g in (
    Group("gpt2", "GPT-2 small, FSDP2 (ModelParallelStrategy)", FSDP2_VARIANTS, step.SPECS[("gpt", "real")],
          step.SPECS[("gpt", "tiny")], 20, 5, 1.0, ("fsdp2-lightning-bf16-mixed", "fsdp2-mpx-O2-bf16")),
    Group("fsdp1", "GPT-2 small, FSDP1 (FSDPStrategy)", FSDP1_VARIANTS, step.SPECS[("gpt", "real")],
          step.SPECS[("gpt", "tiny")], 20, 5, 0.8, ("fsdp1-lightning-bf16-mixed", "fsdp1-mpx-O2-bf16")),
    Group("accelerate", "GPT-2 small, Accelerate FSDP2", ACCELERATE_VARIANTS, step.SPECS[("gpt", "real")],
          step.SPECS[("gpt", "tiny")], 20, 3, 0.8, ("accelerate-bf16", "accelerate-mpx-O2-bf16")),
    Group("gpt1b", "GPT 1.3B (sequence 1024), FSDP2 (ModelParallelStrategy)", FSDP2_VARIANTS, GPT_1B, GPT_1B_CHECK,
          6, 2, 1.6, ("fsdp2-lightning-bf16-mixed", "fsdp2-mpx-O2-bf16")),
)}  # fmt: skip


@dataclass(frozen=True)
class Goal:
    """A row against its group's reference: throughput (paired per round) at least, or peak memory at most, ``bar``."""

    group: str
    variant: str
    measure: str  # "throughput" or "memory"
    bar: float

    @property
    def label(self) -> str:
        sign = ">=" if self.measure == "throughput" else "<="
        return f"{self.variant} {self.measure} {sign} {self.bar:.2f}x {GROUPS[self.group].reference}"


def _goals() -> tuple[Goal, ...]:
    goals: list[Goal] = []
    for group in ("gpt2", "gpt1b"):
        for half in ("fp16", "bf16"):
            goals += [Goal(group, f"fsdp2-mpx-O2-{half}", "throughput", 1.05),
                      Goal(group, f"fsdp2-mpx-O2-{half}", "memory", 0.8)]  # fmt: skip
        goals += [Goal(group, f"fsdp2-mpx-O1-{half}", "throughput", 0.97) for half in ("fp16", "bf16")]
    goals += [Goal("fsdp1", f"fsdp1-mpx-O2-{half}", "throughput", 1.05) for half in ("fp16", "bf16")]
    goals += [Goal("accelerate", f"accelerate-mpx-O2-{half}", "throughput", 1.05) for half in ("fp16", "bf16")]
    return tuple(goals)


#: Issue 41's goals, judged by ``gpu_report.py`` (met only when two runs agree).
GOALS = _goals()


# -- the process: one group of world size 1, what every row shares ----------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_process(device: str) -> None:
    """The process group every row shares (world size 1; NCCL on CUDA, gloo on CPU; Lightning and Accelerate find
    it initialized and use it), then, on CUDA, the process's one-time allocations (cuBLAS workspaces, the first
    collective) made before any row is built, so that no row's memory includes them."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", NODE_RANK="0")  # fmt: skip
    for name in ("lightning.pytorch", "lightning.fabric", "lightning.pytorch.utilities.rank_zero"):
        logging.getLogger(name).setLevel(logging.WARNING)  # the Trainers' banners, once per fit
    warnings.filterwarnings("ignore")
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    dev = torch.device(device)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        a = torch.randn(64, 64, device=dev, dtype=dtype, requires_grad=True)
        (a @ a).sum().backward()
    flag = torch.ones(1, device=dev)
    dist.all_reduce(flag)
    if cuda:
        torch.cuda.synchronize()


class Memory:
    """CUDA's allocated bytes and peak (``None`` on CPU, where nothing is measured); ``collect=False`` (``--check``)
    leaves the garbage to Python's own collections."""

    def __init__(self, device: str, collect: bool = True) -> None:
        import torch

        self.cuda, self.collect = device == "cuda", collect
        self.sync: Callable[[], None] = torch.cuda.synchronize if self.cuda else (lambda: None)

    def allocated(self) -> int | None:
        import torch

        if not self.cuda:
            return None
        torch.cuda.synchronize()
        return int(torch.cuda.memory_allocated())

    def reset_peak(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int | None:
        import torch

        return int(torch.cuda.max_memory_allocated()) if self.cuda else None

    def release(self) -> None:
        """Collect what a dropped row left and return CUDA's cached blocks."""
        import torch

        if self.collect:
            gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def _delta(after: int | None, before: int | None) -> int | None:
    return None if after is None or before is None else after - before


# -- Lightning rows (FSDP2 and FSDP1): built once, continued every round ---------------------------------------
def _module(net: Any, variant: str, fused: bool = False) -> Any:
    """A LightningModule over ``net`` (AdamW, lr 1e-3; ``fused``: ``fused=True``); FSDP2 variants shard it in
    ``configure_model``, once: a later fit finds it sharded and leaves it."""
    import lightning.pytorch as pl
    import torch

    class Sharded(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def configure_model(self) -> None:
            from torch.distributed.fsdp import FSDPModule, fully_shard

            if not variant.startswith("fsdp2") or isinstance(self.net, FSDPModule):
                return
            mesh = self.device_mesh["data_parallel"]
            if "-mpx-" in variant:
                from lightning_mpx.integrations.fsdp import shard_model

                shard_model(self.net, self.trainer.precision_plugin, mesh=mesh, blocks=list(self.net.blocks))
            else:  # Lightning's documented recipe: fully_shard per block, then the root; autocast does the rest
                for block in self.net.blocks:
                    fully_shard(block, mesh=mesh)
                fully_shard(self.net, mesh=mesh)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return step._loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=fused or None)

    return Sharded()


def _strategy(variant: str, net: Any, device: str) -> Any:
    """FSDP2's ``ModelParallelStrategy``, or FSDP1's ``FSDPStrategy`` (one unit per block) that keeps the root wrapper
    of its first fit: Lightning would otherwise find the blocks wrapped at the next fit and leave the root unwrapped.
    On CPU (``--check``) it wraps with ``device_id=cpu``, where Lightning's ``None`` makes FSDP1 look for a GPU."""
    if variant.startswith("fsdp2"):
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    import torch
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel

    class ContinuingFSDPStrategy(FSDPStrategy):
        def _setup_model(self, model: Any) -> Any:
            root = getattr(self, "_root", None)
            if root is not None and root.module is model:
                return root
            if device == "cpu":
                model = FullyShardedDataParallel(model, mixed_precision=self.mixed_precision_config,
                                                 device_id=torch.device("cpu"), **self.kwargs)  # fmt: skip
                self.kwargs.pop("auto_wrap_policy", None)  # applied above
            self._root = super()._setup_model(model)
            return self._root

    return ContinuingFSDPStrategy(auto_wrap_policy={type(net.blocks[0])})


def _precision(variant: str) -> dict[str, Any]:
    """The Trainer's precision arguments: Lightning's own string, or the plugin (``on_floor="continue"``: a run must
    go on to be timed)."""
    if "-mpx-" not in variant:
        return {"precision": variant.split("-lightning-")[1]}
    from lightning_mpx import MixedPrecisionPlugin

    level = variant.split("-")[2]
    return {"plugins": [MixedPrecisionPlugin(level, half_dtype=step.half_dtype_of(variant), on_floor="continue")]}


class LightningRow:
    """A Lightning row built once: model, Trainer (warmed up by a first fit) and loader; :meth:`advance` continues
    it with :func:`step.fit_more` and releases the finished fit's optimizer state and gradients after."""

    def __init__(self, variant: str, spec: step.ModelSpec, batches: list[Any], warmup: int, device: str,
                 memory: Memory, fused: bool = False) -> None:
        import lightning.pytorch as pl
        import torch

        self.variant, self.spec, self.memory = variant, spec, memory
        before = memory.allocated()
        torch.manual_seed(0)
        with torch.device(device):  # on the GPU directly: a 1.3B model initialises in seconds there
            self.net = step.build_model("gpt", spec)
        self.timer = step._step_timer(memory.sync)
        self.trainer = pl.Trainer(
            accelerator="gpu" if device == "cuda" else "cpu", devices=1, strategy=_strategy(variant, self.net, device),
            max_steps=max(warmup, 1), logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, callbacks=[self.timer], **_precision(variant),
        )  # fmt: skip
        self.module = _module(self.net, variant, fused)
        self.loader = torch.utils.data.DataLoader(step.ListDataset(batches), batch_size=None, shuffle=False)
        self.trainer.fit(self.module, self.loader)
        self._rest()
        self.idle = _delta(memory.allocated(), before)

    def _rest(self) -> None:
        """Lightning makes a new optimizer at the next fit: the finished one's state and the gradients go now."""
        for optimizer in self.trainer.optimizers:
            optimizer.state.clear()
        self.module.zero_grad(set_to_none=True)
        self.memory.release()

    def advance(self, steps: int) -> dict[str, Any]:
        """``steps + 1`` more steps (the first untimed); the round's times and own peak memory."""
        base = self.memory.allocated()
        self.memory.reset_peak()
        self.timer.times.clear()
        step.fit_more(self.trainer, self.module, self.loader, steps + 1)
        times = list(self.timer.times[1:])
        above = _delta(self.memory.peak(), base)
        self._rest()
        own = None if above is None or self.idle is None else self.idle + above
        change = _delta(self.memory.allocated(), base)
        self.idle = None if change is None or self.idle is None else self.idle + change
        from lightning_mpx import MixedPrecisionPlugin

        plugin = self.trainer.precision_plugin
        extra = {"skipped_steps": sum(plugin.amp.skipped_steps)} if isinstance(plugin, MixedPrecisionPlugin) else {}
        return {"times": times, "peak": own, "idle": self.idle, "precision": str(self.trainer.precision), **extra}

    def close(self) -> None:
        del self.trainer, self.module, self.loader, self.net
        self.memory.release()


# -- Accelerate rows: rebuilt every round (its state is a process singleton) -------------------------------------
class AccelerateRow:
    """An Accelerate row: each :meth:`advance` resets Accelerate's state, builds the accelerator and the model from
    the same initial weights (``state``, on the CPU), prepares them under ``FullyShardedDataParallelPlugin(
    fsdp_version=2)``, runs ``warmup`` untimed steps, times ``steps + 1`` (the first dropped) and frees it all."""

    def __init__(self, variant: str, spec: step.ModelSpec, batches: list[Any], warmup: int, device: str,
                 memory: Memory, state: dict[str, Any], fused: bool = False) -> None:
        self.variant, self.spec, self.batches, self.warmup, self.fused = variant, spec, batches, warmup, fused
        self.device, self.memory, self.state = device, memory, state
        self.idle = 0  # nothing stays between rounds

    def _accelerator(self) -> Any:
        import torch
        from accelerate.state import AcceleratorState, GradientState, PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        cpu = self.device == "cpu"
        if cpu:  # --check: Accelerate picks FSDP for GPU-like devices only (tests/accelerate_fsdp_script.py)
            PartialState(cpu=True)
            PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
            PartialState._shared_state["device"] = torch.device("cpu")
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                transformer_cls_names_to_wrap=["Block"])  # fmt: skip
        if self.variant == "accelerate-bf16":
            from accelerate import Accelerator

            accelerator = Accelerator(mixed_precision="bf16", fsdp_plugin=plugin, cpu=cpu)
        else:
            from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

            half = "bfloat16" if self.variant.endswith("bf16") else "float16"
            handler = MixedPrecisionKwargs(half_dtype=half, on_floor="continue")
            accelerator = Accelerator(mixed_precision=self.variant.split("-")[2], fsdp_plugin=plugin, cpu=cpu,
                                      kwargs_handlers=[handler])  # fmt: skip
        if accelerator.distributed_type != DistributedType.FSDP:
            raise RuntimeError(f"Accelerate chose {accelerator.distributed_type}, not FSDP")
        return accelerator

    def advance(self, steps: int) -> dict[str, Any]:
        from accelerate.state import AcceleratorState, GradientState

        base = self.memory.allocated()
        self.memory.reset_peak()
        times, extra = self._train(steps)  # its accelerator, model and optimizer end with its frame
        peak = _delta(self.memory.peak(), base)
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        self.memory.release()
        return {"times": times, "peak": peak, "idle": 0, "precision": self.variant.split("-", 1)[1], **extra}

    def _train(self, steps: int) -> tuple[list[float], dict[str, Any]]:
        import torch

        accelerator = self._accelerator()
        with torch.device(self.device):
            net = step.build_model("gpt", self.spec)
        net.load_state_dict(self.state)
        model, optimizer = accelerator.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-3,
                                                                      fused=self.fused or None))

        def one(x: Any, y: Any) -> None:
            accelerator.backward(step._loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step.time_steps(one, self.batches, self.warmup, self.memory.sync)
        times = step.time_steps(one, self.batches, steps + 1, self.memory.sync)[1:]
        amp = getattr(accelerator, "amp", None)
        extra = {"skipped_steps": sum(amp.skipped_steps)} if amp is not None else {}
        accelerator.free_memory()
        return times, extra

    def close(self) -> None:
        self.memory.release()


# -- rounds, rows and ratios ------------------------------------------------------------------------------------
def build_row(group: Group, variant: str, spec: step.ModelSpec, batches: list[Any], warmup: int, device: str,
              memory: Memory, state: dict[str, Any] | None, fused: bool = False) -> Any:
    if group.name == "accelerate":
        assert state is not None
        return AccelerateRow(variant, spec, batches, warmup, device, memory, state, fused)
    return LightningRow(variant, spec, batches, warmup, device, memory, fused)


def summarise(group: Group, spec: step.ModelSpec, rounds: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per variant from its rounds: the median of the round medians, the own peak memory (highest round),
    and against the reference the per-round paired throughput ratios (median, range, quartiles)."""
    rows = []
    for variant, samples in rounds.items():
        if not samples:
            continue
        per_round = [statistics.median(s["times"]) * 1e3 for s in samples]
        peaks = [s["peak"] for s in samples if s["peak"] is not None]
        median = statistics.median(per_round)
        rows.append({
            "group": group.name, "variant": variant, "reference": group.reference, "rounds": len(samples),
            "steps_per_round": len(samples[0]["times"]), "step_ms_rounds": per_round, "step_ms_median": median,
            "tokens_per_second": spec.batch * spec.seq / (median / 1e3),
            "peak_memory_bytes": max(peaks) if peaks else None, "idle_memory_bytes": samples[-1]["idle"],
            "peak_memory_kind": "own (at rest + above its round's start)" if peaks else None,
            "precision": samples[-1]["precision"], "skipped_steps": samples[-1].get("skipped_steps"),
        })  # fmt: skip
    ref = next((r for r in rows if r["variant"] == group.reference), None)
    for row in rows:
        if ref is None:
            continue
        n = min(row["rounds"], ref["rounds"])  # a row dropped mid-run pairs with the rounds both ran
        ratios = [b / a for a, b in zip(row["step_ms_rounds"][:n], ref["step_ms_rounds"][:n])]
        if ratios:
            s = _harness.spread(ratios)
            row.update(throughput_vs_reference_rounds=ratios, throughput_vs_reference=s.median,
                       throughput_vs_reference_range=[min(ratios), max(ratios)],
                       throughput_vs_reference_iqr=s.iqr)  # fmt: skip
        if row["peak_memory_bytes"] is not None and ref["peak_memory_bytes"]:
            row["memory_vs_reference"] = row["peak_memory_bytes"] / ref["peak_memory_bytes"]
    return rows


def check_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """This run's figure for each goal whose rows it holds (met or not in this run; the report asks for two)."""
    found = []
    for goal in GOALS:
        row = next((r for r in rows if r["group"] == goal.group and r["variant"] == goal.variant), None)
        key = "throughput_vs_reference" if goal.measure == "throughput" else "memory_vs_reference"
        if row is None or row.get(key) is None:
            continue
        value = row[key]
        met = value >= goal.bar if goal.measure == "throughput" else value <= goal.bar
        found.append({"group": goal.group, "target": goal.label, "value": value, "bar": goal.bar,
                      "rounds": row["rounds"], "met": met})  # fmt: skip
    return found


def run_group(group: Group, args: argparse.Namespace, memory: Memory, deadline: float, hard_end: float,
              publish: Callable[[list[dict[str, Any]], dict[str, Any]], None]) -> None:
    """Build the group's rows, then rounds (order rotated) until ``--rounds`` or the deadline; publish after each."""
    import torch

    check = args.check
    spec = group.check_spec if check else group.spec
    variants = [v for v in (group.check_variants if check else group.variants)
                if args.variants is None or v in args.variants or v == group.reference]  # fmt: skip
    steps = args.steps or (2 if check else group.steps)
    warmup = 1 if check else group.warmup
    batches = step.make_batches("gpt", spec, 4 if check else 8, torch.device(args.device))
    state = None
    if group.name == "accelerate":
        torch.manual_seed(0)
        state = {k: v.clone() for k, v in step.build_model("gpt", spec).state_dict().items()}
    info: dict[str, Any] = {"title": group.title, "spec": vars(spec), "reference": group.reference,
                            "variants": variants, "steps_per_round": steps, "warmup": warmup,
                            "rows_are": "rebuilt every round" if group.name == "accelerate" else "built once",
                            "rounds_done": 0, "failed": {}, "build_seconds": {}}  # fmt: skip
    started = time.perf_counter()
    live: dict[str, Any] = {}
    for variant in variants:
        t0 = time.perf_counter()
        try:
            live[variant] = build_row(group, variant, spec, batches, warmup, args.device, memory, state, args.fused)
        except Exception as error:  # noqa: BLE001 (a row that cannot run, e.g. out of memory, must not end the rest)
            info["failed"][variant] = f"build: {type(error).__name__}: {error}"[:2000]
            memory.release()
        info["build_seconds"][variant] = round(time.perf_counter() - t0, 2)
        print(f"  [{group.name}] built {variant} in {info['build_seconds'][variant]:.1f} s", flush=True)
    rounds: dict[str, list[dict[str, Any]]] = {v: [] for v in live}
    last_round = 0.0
    for index in range(args.rounds):
        now = time.perf_counter()
        if now + last_round > hard_end or (index >= MIN_ROUNDS and now + last_round > deadline):
            info["stopped"] = f"budget: {index} rounds done"
            break
        t0 = time.perf_counter()
        for variant in _harness.rotation(list(live), index):
            try:
                rounds[variant].append(live[variant].advance(steps))
            except Exception as error:  # noqa: BLE001
                info["failed"][variant] = f"round {index}: {type(error).__name__}: {error}"[:2000]
                live.pop(variant).close()
                continue
            print(f"  [{group.name}] round {index} {variant:<28} "
                  f"{statistics.median(rounds[variant][-1]['times']) * 1e3:9.2f} ms", flush=True)  # fmt: skip
        last_round = time.perf_counter() - t0
        info["rounds_done"] = index + 1
        info["wall_seconds"] = round(time.perf_counter() - started, 1)
        publish(summarise(group, spec, rounds), info)
    for row in live.values():
        row.close()
    live.clear()
    memory.release()
    info["wall_seconds"] = round(time.perf_counter() - started, 1)
    publish(summarise(group, spec, rounds), info)


# -- output -----------------------------------------------------------------------------------------------------
def table(rows: list[dict[str, Any]], pad: bool = False) -> str:
    """Per group and row: median ms/step over the rounds, tokens/s, own peak MiB, the paired throughput ratio to the
    group's reference (median [lowest, highest] over the rounds) and the peak-memory ratio."""

    def paired(r: dict[str, Any]) -> str | None:
        if r.get("throughput_vs_reference") is None:
            return None
        low, high = r.get("throughput_vs_reference_range") or [None, None]
        spread = f" [{low:.3f}, {high:.3f}]" if low is not None else ""
        return f"{r['throughput_vs_reference']:.3f}x{spread}"

    body = [
        (r.get("group", "-"), r["variant"], _harness.cell(r.get("rounds")), _harness.cell(r["step_ms_median"], ".2f"),
         _harness.cell(r.get("tokens_per_second"), ".0f"),
         _harness.cell(None if r.get("peak_memory_bytes") is None else r["peak_memory_bytes"] / 2**20, ".0f"),
         paired(r), _harness.cell(r.get("memory_vs_reference"), ".3f"), _harness.cell(r.get("skipped_steps")))
        for r in rows
    ]  # fmt: skip
    columns = ("group", "variant", "rounds", "ms/step", "tokens/s", "peak MiB", "x throughput (per round)",
               "x memory", "skipped")  # fmt: skip
    return _harness.markdown_table(columns, body, align="ll" + "r" * 7, pad=pad)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda (cpu with --check)")
    parser.add_argument("--check", action="store_true",
                        help=f"CPU, tiny models, two rows per group, {CHECK_ROUNDS} rounds of 2 steps: the code paths, "
                             "no figure")
    parser.add_argument("--groups", nargs="+", choices=tuple(GROUPS), default=list(GROUPS), metavar="GROUP",
                        help=f"which comparisons, in this order (default: all of {', '.join(GROUPS)})")
    parser.add_argument("--variants", nargs="+", default=None, metavar="VARIANT",
                        help="only these rows (each group's reference is always measured)")
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"rounds per group (default 5; {CHECK_ROUNDS} with --check)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per round (default: 20 on GPT-2 small, 6 on 1.3B; 2 with --check)")
    parser.add_argument("--budget", type=float, default=330.0,
                        help="seconds for every group together, shared by weight; 0: no limit (default 330)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (CPU)")
    parser.add_argument("--fused", action="store_true",
                        help="AdamW(fused=True) in every row, the references too (the plugin's and the adapter's "
                             "FSDP2 rows then skip on the device: no host read of the overflow flag per step)")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/fsdp_step_<device>.json")
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.device = args.device or ("cpu" if args.check else "cuda")
    if args.rounds is None:
        args.rounds = CHECK_ROUNDS if args.check else 5
    if args.rounds < 1 or (args.steps is not None and args.steps < 1) or args.budget < 0:
        parser.error(f"--rounds={args.rounds} and --steps={args.steps} must be at least 1, --budget={args.budget} "
                     "at least 0")  # fmt: skip
    known = {v for g in GROUPS.values() for v in g.variants}
    for variant in args.variants or ():
        if variant not in known:
            parser.error(f"--variants: {variant!r} is not a row; valid choices: {', '.join(sorted(known))}")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available (--check runs the code on CPU)")
    torch.set_num_threads(args.threads)
    init_process(args.device)
    # --check measures nothing: a full collection after every row and round (about a second each over Lightning's
    # objects, 48 of them) would be most of its run.
    memory = Memory(args.device, collect=not args.check)
    out = args.out or _harness.default_out(f"fsdp_step_{args.device}")
    started = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "fsdp_step", **_harness.machine(args.device), "command": _harness.command(argv),
        "check": args.check, "method": "rows of a group in one process, rounds rotated, paired per-round ratios",
        "optimizer": "AdamW(fused=True)" if args.fused else "AdamW",
        "rounds": args.rounds, "budget_s": args.budget, "groups": {}, "rows": [], "targets": [], "failed": {},
    }  # fmt: skip

    def publish(group: str) -> Callable[[list[dict[str, Any]], dict[str, Any]], None]:
        def write(rows: list[dict[str, Any]], info: dict[str, Any]) -> None:
            result["groups"][group] = info
            result["rows"] = [r for r in result["rows"] if r["group"] != group] + rows
            result["failed"] = {f"{g}/{v}": e for g, i in result["groups"].items() for v, e in i["failed"].items()}
            result["targets"] = check_targets(result["rows"])
            result["wall_seconds"] = round(time.perf_counter() - started, 1)
            _harness.write_json(out, result, default=str)

        return write

    hard_end = started + args.budget if args.budget else float("inf")
    for position, name in enumerate(args.groups):
        group = GROUPS[name]
        left = [GROUPS[n].weight for n in args.groups[position:]]
        now = time.perf_counter()
        deadline = now + (hard_end - now) * group.weight / sum(left) if args.budget else float("inf")
        print(f"[{name}] {group.title}: until +{deadline - started:.0f} s", flush=True)
        run_group(group, args, memory, deadline, hard_end, publish(name))
    text = table(result["rows"], pad=True)
    print(text)
    for t in result["targets"]:
        print(f"{t['target']} [{t['group']}]: {t['value']:.3f} over {t['rounds']} rounds -> "
              f"{'met in this run' if t['met'] else 'NOT MET'}")  # fmt: skip
    for key, error in result["failed"].items():
        print(f"{key} failed: {error}")
    _harness.save(out, result, {"": table(result["rows"])}, default=str)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
