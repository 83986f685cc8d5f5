"""The host work of a step under Lightning FSDP2, counted on two CPU processes: the deterministic proxy of issue 41.

On an H200, ``MixedPrecisionPlugin`` at O2 under ``ModelParallelStrategy`` (FSDP2) was 12 % slower than Lightning's
own FSDP2 ``precision="bf16-mixed"`` on GPT-2 small although it moves fewer bytes: the host is suspected. This script
counts that host work where no GPU is, in a way that does not move with the load of a shared machine.

The model is ``benchmarks/step.py``'s GPT at a tiny width (``--layers 6 --dim 32``: 77 parameter tensors, batch 2 x
sequence 8 per rank), so a step costs Python, not arithmetic. Two gloo processes (torchrun's environment variables,
``tests/launch.py``'s way) each run a Lightning ``Trainer(strategy=ModelParallelStrategy(data_parallel_size=2),
devices=2, accelerator="cpu")`` with AdamW, sharded in ``configure_model`` as ``benchmarks/fsdp_step.py`` does
(``fully_shard`` per block and on the root for the reference, ``lightning_mpx.integrations.fsdp.shard_model`` for the
plugin). Every variant runs in a fresh pair of processes; ``--variants`` picks a subset:

* ``lightning-bf16-mixed``: Lightning's own FSDP2 mixed precision (autocast over FP32 parameters): the reference;
* ``mpx-O1-bf16``, ``mpx-O2-bf16``: the plugin (bfloat16; ``--fp16`` adds ``mpx-O1-fp16`` and ``mpx-O2-fp16``:
  float16 matmuls are slow on most CPUs, and the counts say nothing a GPU would not);
* ``accelerate-bf16`` (the reference of the next row) and ``accelerate-mpx-O2-bf16``: the same model and batches in
  a hand-written Accelerate loop under ``FullyShardedDataParallelPlugin(fsdp_version=2)`` (the blocks auto-wrapped),
  Accelerate's own "bf16" and ``lightning_mpx.accelerate.Accelerator(mixed_precision="O2")``; split into phases around
  ``accelerator.backward``.

What is counted, per rank and per step (from one ``on_train_batch_start`` to the next, after ``--warmup`` steps), by a
``sys.setprofile`` function set on the main thread (where the CPU backward runs too):

* ``calls``: Python function calls (the profiler's ``call`` events: functions, generators resumed, class bodies);
* ``c_calls``: calls of built-in functions from Python (``c_call`` events: torch's operators among them);
* not counted in either: ``__eq__`` methods and what they call (reported apart as ``equals``). A dict's probe calls
  ``__eq__`` once per hash collision, and the hashes of DTensor's sharding cache keys come from ids, which differ from
  process to process: with them the counts moved by up to 150 calls between two runs of the same code;
* collectives: calls into ``torch.distributed``'s collective functions (``all_reduce``, ``all_gather_single``,
  ``reduce_scatter_single``, ``barrier``, ..., the functional collectives too) and into a ``ProcessGroup``'s own
  methods, counted once at the outermost (``all_gather_object`` calling ``all_gather`` is one call), by kind and by
  who called them: ``engine`` when the calling frame is lightning_mpx's code, else ``others`` (FSDP, Lightning).

The Python calls are also split into phases at Lightning's ``on_before_backward`` and ``on_after_backward`` hooks
(``forward``, ``backward``, ``step``: the optimizer step and the loop until the next batch).

Python calls move with the code, not with the machine: the same code gives the same counts on any machine and on
every run (``PYTHONHASHSEED=0`` in the ranks; ``--repeats 2`` runs everything twice and says whether the counts
agree). A row is the median over the counted steps of each rank; the ratio is its calls (the mean of the two ranks'
medians) over its reference's. The goals of issue 41: ``mpx-O2-bf16``'s calls per step <= 1.03 x the reference's
(``accelerate-mpx-O2-bf16``'s <= 1.03 x ``accelerate-bf16``'s), and exactly one all-reduce per step of the
engine's own (the overflow flags and the squared norm in one buffer): printed as verdicts, not asserted. The
per-function breakdown (``--top``) lists the functions whose calls per step differ most from the reference's: where
the extra host work is.

``--instructions N`` also counts instructions (valgrind's callgrind, each rank its own valgrind process), as
``benchmarks/o1_proxy.py`` does: a run of ``--warmup`` steps and one of ``N`` more, the difference over ``N``. It takes
minutes per variant on 2 cores.

    python benchmarks/fsdp_proxy.py [--steps 20] [--warmup 5] [--fp16] [--repeats 1] [--top 15] [--out PATH]
    python benchmarks/fsdp_proxy.py --check          # 3 steps after 2, the reference and mpx-O2-bf16 only
    python benchmarks/fsdp_proxy.py --instructions 10 [--variants ...]
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness  # noqa: E402

REFERENCE = "lightning-bf16-mixed"
BF16_VARIANTS = (REFERENCE, "mpx-O1-bf16", "mpx-O2-bf16")
FP16_VARIANTS = ("mpx-O1-fp16", "mpx-O2-fp16")
#: Accelerate's FSDP2 (``FullyShardedDataParallelPlugin(fsdp_version=2)``, the blocks auto-wrapped): its own "bf16"
#: (the reference of these rows) and ``lightning_mpx.accelerate.Accelerator`` at O2 in bfloat16, a hand-written loop.
ACCELERATE_REFERENCE = "accelerate-bf16"
ACCELERATE_VARIANTS = (ACCELERATE_REFERENCE, "accelerate-mpx-O2-bf16")
VARIANTS = BF16_VARIANTS + FP16_VARIANTS + ACCELERATE_VARIANTS
CHECK_VARIANTS = (REFERENCE, "mpx-O2-bf16")
#: The row the goals are about, and the goals: its calls per step over the reference's, and its engine all-reduces.
GOAL_ROW = "mpx-O2-bf16"
GOAL_ROWS = (GOAL_ROW, "accelerate-mpx-O2-bf16")
GOAL = 1.03
GOAL_ENGINE_ALL_REDUCES = 1
WORLD_SIZE = 2

#: ``torch.distributed`` functions counted as collectives (those this torch has), and the functional collectives.
C10D_COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_coalesced",
    "all_gather_single", "all_gather_object", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "reduce", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "gather", "gather_object",
    "scatter", "scatter_object_list", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "send_object_list", "recv_object_list", "_all_gather_base", "_reduce_scatter_base",
)  # fmt: skip
FUNCTIONAL_COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "all_gather_tensor", "all_gather_tensor_autograd",
    "all_gather_into_tensor_coalesced", "reduce_scatter_tensor", "reduce_scatter_tensor_autograd",
    "reduce_scatter_tensor_coalesced", "all_to_all_single", "all_to_all_single_autograd", "broadcast",
)  # fmt: skip
#: A ``ProcessGroup``'s own collective methods (its ``size()`` or ``rank()`` are not collectives).
PROCESS_GROUP_COLLECTIVES = frozenset((
    "allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced",
    "_allgather_base", "reduce_scatter", "reduce_scatter_tensor_coalesced", "_reduce_scatter_base", "reduce",
    "broadcast", "barrier", "monitored_barrier", "gather", "scatter", "alltoall", "alltoall_base", "send", "recv",
    "recv_anysource", "all_gather_single", "all_gather_single_coalesced", "reduce_scatter_single",
    "reduce_scatter_single_coalesced", "all_to_all_single",
))  # fmt: skip
#: A step's parts, split at Lightning's ``on_before_backward`` and ``on_after_backward``: the training step (the
#: forward, FSDP's all-gathers, the loss), the backward (FSDP's re-gathers and reduce-scatters), and the rest (the
#: unscale and check, the optimizer step, the loop until the next batch).
PHASES = ("forward", "backward", "step")
#: Files whose frames are the collective API itself: the caller of a collective is the first frame outside them.
_API_FILES = ("distributed_c10d.py", "c10d_logger.py", "_functional_collectives.py")


# -- counting (in a rank) ---------------------------------------------------------------------------------------------
def collective_codes() -> dict[CodeType, str]:
    """The code objects of the collective functions (unwrapped from torch's logging decorators) -> their names
    (``functional.`` before the functional collectives')."""
    import torch.distributed._functional_collectives as functional
    import torch.distributed.distributed_c10d as c10d

    codes: dict[CodeType, str] = {}
    for module, names, prefix in ((c10d, C10D_COLLECTIVES, ""), (functional, FUNCTIONAL_COLLECTIVES, "functional.")):
        for name in names:
            fn = getattr(module, name, None)
            if callable(fn):
                codes[inspect.unwrap(fn).__code__] = prefix + name
    return codes


class StepCounter:
    """A ``sys.setprofile`` function that counts Python calls, built-in calls and collectives until :meth:`cut`.

    Args:
        engine_dir: the lightning_mpx package's folder: a collective called from a frame in it is the engine's own.
    """

    def __init__(self, engine_dir: str) -> None:
        import torch

        self.engine_dir = engine_dir
        self.codes = collective_codes()
        self.process_group = torch._C._distributed_c10d.ProcessGroup
        self.functions: collections.Counter[CodeType] = collections.Counter()
        self.builtins: collections.Counter[str] = collections.Counter()
        self.calls = self.c_calls = self.equals = 0
        self.equal: FrameType | None = None
        self.collectives: collections.Counter[str] = collections.Counter()
        self.callers: collections.Counter[tuple[str, CodeType | None]] = collections.Counter()
        self.marks: dict[str, int] = {}

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.equal is not None:  # inside an __eq__: nothing counted until it returns
            if frame is self.equal and event == "return":
                self.equal = None
            return
        if event == "call":
            code = frame.f_code
            if code.co_name == "__eq__":
                # A dict's probe calls __eq__ once per hash collision, and hashes built from ids (DeviceMesh's, so
                # DTensorSpec's in DTensor's sharding cache) differ from process to process: counted apart.
                self.equals += 1
                self.equal = frame
                return
            self.calls += 1
            self.functions[code] += 1
            kind = self.codes.get(code)
            if kind is not None:
                self._collective(kind, frame.f_back)
        elif event == "c_call":
            self.c_calls += 1
            owner = getattr(arg, "__self__", None)
            self.builtins[_builtin_name(arg, owner)] += 1
            if isinstance(owner, self.process_group) and arg.__name__ in PROCESS_GROUP_COLLECTIVES:
                self._collective(f"ProcessGroup.{arg.__name__}", frame)

    def _collective(self, kind: str, caller: FrameType | None) -> None:
        while caller is not None and caller.f_code.co_filename.endswith(_API_FILES):
            if caller.f_code in self.codes:
                return  # inside another collective: counted there
            caller = caller.f_back
        outer = caller
        while outer is not None:  # re-entered through a torch function mode (the cast mode) from an outer collective
            if outer.f_code in self.codes:
                return
            outer = outer.f_back
        filename = caller.f_code.co_filename if caller is not None else ""
        who = "engine" if filename.startswith(self.engine_dir) else "others"
        self.collectives[f"{who}:{kind}"] += 1
        self.callers[(kind, caller.f_code if caller is not None else None)] += 1

    def mark(self, name: str) -> None:
        """Note the Python calls so far in this step (``before`` and ``after`` the backward: the phases)."""
        self.marks[name] = self.calls

    def cut(self) -> dict[str, Any]:
        """The counts since the last cut (one step), and zero them."""
        step = {"calls": self.calls, "c_calls": self.c_calls, "equals": self.equals,
                "collectives": dict(sorted(self.collectives.items()))}  # fmt: skip
        before, after = self.marks.get("before"), self.marks.get("after")
        if before is not None and after is not None:
            step["phases"] = {"forward": before, "backward": after - before, "step": self.calls - after}
        self.calls = self.c_calls = self.equals = 0
        self.marks = {}
        self.collectives = collections.Counter()
        return step


def _builtin_name(fn: Any, owner: Any) -> str:
    if owner is not None and not inspect.ismodule(owner):
        return f"{type(owner).__name__}.{getattr(fn, '__name__', '?')}"
    module = getattr(fn, "__module__", None) or getattr(owner, "__name__", None) or "?"
    return f"{module}.{getattr(fn, '__qualname__', getattr(fn, '__name__', '?'))}"


def function_name(code: CodeType) -> str:
    """``path:line(name)`` of a function, its path from the package's root (``torch/...``, ``lightning_mpx/...``)."""
    path = code.co_filename
    for marker in ("site-packages/", "/lightning_mpx/", "/benchmarks/", "/lib/python"):
        index = path.rfind(marker)
        if index >= 0:
            path = path[index + len(marker):] if marker == "site-packages/" else path[index + 1:]
            break
    return f"{path}:{code.co_firstlineno}({code.co_qualname})"


# -- one rank ---------------------------------------------------------------------------------------------------------
def _model_spec(args: argparse.Namespace) -> Any:
    import step

    return step.ModelSpec(batch=2, vocab=64, seq=8, dim=args.dim, layers=args.layers, heads=2)


def reference_of(variant: str) -> str:
    """The row a variant's counts are compared with: Accelerate's own for the Accelerate rows, else Lightning's."""
    return ACCELERATE_REFERENCE if variant.startswith("accelerate-") else REFERENCE


def run_accelerate_rank(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """:func:`run_rank` for an Accelerate row: a loop (``accelerator.backward``, ``optimizer.step``, ``zero_grad``)
    under Accelerate's FSDP2, counted from one step's start to the next's, split before and after the backward.

    Accelerate selects FSDP only for GPU-like devices: once its process group is up on CPU, its shared state is told
    the processes are ``MULTI_GPU`` on device ``cpu`` (``tests/accelerate_fsdp_script.py``'s one step no user takes);
    everything after is Accelerate's own FSDP2 code (auto-wrap, ``fully_shard``, the optimizer's parameter swap)."""
    import step
    import torch
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    import lightning_mpx

    torch.set_num_threads(1)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState(cpu=True)
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    PartialState._shared_state["device"] = torch.device("cpu")
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["Block"])  # fmt: skip
    if variant == ACCELERATE_REFERENCE:
        from accelerate import Accelerator

        accelerator = Accelerator(mixed_precision="bf16", fsdp_plugin=plugin, cpu=True)
    else:
        from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

        accelerator = Accelerator(mixed_precision=variant.split("-")[2], fsdp_plugin=plugin, cpu=True,
                                  kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16", on_floor="continue")])
    if accelerator.distributed_type != DistributedType.FSDP:
        raise RuntimeError(f"Accelerate chose {accelerator.distributed_type}, not FSDP")
    torch.manual_seed(0)
    spec = _model_spec(args)
    net = step.build_model("gpt", spec)
    model, optimizer = accelerator.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    batches = step.make_batches("gpt", spec, 4, torch.device("cpu"))
    counter = StepCounter(str(Path(lightning_mpx.__file__).resolve().parent) + os.sep)
    steps: list[dict[str, Any]] = []
    first, last = args.warmup, args.warmup + args.steps
    for index in range(last + 1):
        sys.setprofile(None)
        if first <= index <= last:
            record = counter.cut()  # at the first counted step: zeroes nothing counted yet
            if index > first:
                steps.append(record)
        if first <= index < last and not args._plain:
            sys.setprofile(counter)
        x, y = batches[index % len(batches)]
        loss = step._loss(model(x), y)
        counter.mark("before")
        accelerator.backward(loss)
        counter.mark("after")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sys.setprofile(None)
    return rank_record(variant, accelerator.process_index, accelerator.num_processes, last + 1,
                       len(list(model.parameters())), steps, counter)


def run_rank(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train ``variant`` on this rank for ``warmup + steps + 1`` steps, counting the ``steps`` after the warm-up."""
    if variant.startswith("accelerate-"):
        return run_accelerate_rank(variant, args)
    import fsdp_step
    import lightning.pytorch as pl
    import step
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy

    import lightning_mpx
    from lightning_mpx import MixedPrecisionPlugin

    torch.set_num_threads(1)
    torch.manual_seed(0)
    spec = _model_spec(args)
    net = step.build_model("gpt", spec)
    counter = StepCounter(str(Path(lightning_mpx.__file__).resolve().parent) + os.sep)
    steps: list[dict[str, Any]] = []
    first, last = args.warmup, args.warmup + args.steps

    class Count(pl.Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            sys.setprofile(None)
            if first <= batch_idx <= last:
                step = counter.cut()  # at the first counted step: zeroes what the warm-up's hooks marked
                if batch_idx > first:
                    steps.append(step)
            if first <= batch_idx < last and not args._plain:  # (--instructions: callgrind counts, no profiler)
                sys.setprofile(counter)

        def on_before_backward(self, trainer: Any, module: Any, loss: Any) -> None:
            counter.mark("before")

        def on_after_backward(self, trainer: Any, module: Any) -> None:
            counter.mark("after")

    if variant.startswith("mpx-"):
        _, level, half = variant.split("-")
        dtype = "bfloat16" if half == "bf16" else "float16"
        precision: dict[str, Any] = {"plugins": [MixedPrecisionPlugin(level, half_dtype=dtype, on_floor="continue")]}
    else:
        precision = {"precision": variant.removeprefix("lightning-")}
    total = last + 1
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD_SIZE, strategy=ModelParallelStrategy(data_parallel_size=WORLD_SIZE,
        tensor_parallel_size=1), max_steps=total, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=[Count()],
        **precision,
    )  # fmt: skip
    batches = step.make_batches("gpt", spec, 4, torch.device("cpu"))
    loader = torch.utils.data.DataLoader(step.ListDataset(batches, total), batch_size=None, shuffle=False)
    # fsdp_step.py's module: the same sharding (shard_model for the plugin, Lightning's recipe for the reference)
    trainer.fit(fsdp_step._module(net, "fsdp2-" + variant), loader)
    sys.setprofile(None)
    return rank_record(variant, trainer.global_rank, trainer.world_size, trainer.global_step,
                       len(list(net.parameters())), steps, counter)


def rank_record(variant: str, rank: int, world_size: int, global_step: int, parameter_tensors: int,
                steps: list[dict[str, Any]], counter: StepCounter) -> dict[str, Any]:
    """What a rank writes for one variant: its counted steps and the counter's per-function totals."""
    return {
        "variant": variant,
        "rank": rank,
        "world_size": world_size,
        "global_step": global_step,
        "parameter_tensors": parameter_tensors,
        "steps": steps,
        "functions": {function_name(code): n for code, n in counter.functions.items()},
        "builtins": dict(counter.builtins),
        "callers": {f"{kind} <- {function_name(code) if code else '?'}": n
                    for (kind, code), n in counter.callers.items()},  # fmt: skip
    }


def _rank_main(variants: list[str], args: argparse.Namespace) -> None:
    import torch.distributed as dist

    for variant in variants:  # later fits find the process group running
        record = run_rank(variant, args)
        path = Path(args.rank_out) / f"{variant}-rank{record['rank']}.json"
        path.write_text(json.dumps(record))
    if dist.is_initialized():  # every rank done with its collectives; then leave without the interpreter's teardown
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a gloo group left to the interpreter's exit can hang or abort it (tests/launch.py end_ranks)


# -- the launcher -----------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_command(variants: list[str], args: argparse.Namespace, steps: int, out: Path, plain: bool) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--_rank", ",".join(variants), "--rank-out", str(out), "--steps",
            str(steps), "--warmup", str(args.warmup), "--layers", str(args.layers), "--dim", str(args.dim),
            *(["--_plain"] if plain else [])]  # fmt: skip


def launch(variants: list[str], args: argparse.Namespace, out: Path, steps: int | None = None,
           valgrind: list[str] | None = None) -> list[subprocess.CompletedProcess[str]]:
    """Run ``variants``, one after the other, on :data:`WORLD_SIZE` fresh processes with torchrun's environment;
    each rank writes its record of each to ``out`` (``valgrind``: each rank under it, the list's ``{rank}`` filled
    in). Raises ``RuntimeError`` with the end of a failed rank's stderr."""
    env = dict(os.environ, WORLD_SIZE=str(WORLD_SIZE), LOCAL_WORLD_SIZE=str(WORLD_SIZE), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), PYTHONHASHSEED="0", PYTHONWARNINGS="ignore")  # fmt: skip
    root = str(_harness.ROOT)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = _rank_command(variants, args, args.steps if steps is None else steps, out, plain=valgrind is not None)
    procs = []
    for rank in range(WORLD_SIZE):
        prefix = [part.format(rank=rank) for part in valgrind or []]
        procs.append(subprocess.Popen(prefix + cmd, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))  # fmt: skip
    done = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=args.rank_timeout)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    for rank, result in enumerate(done):
        if result.returncode != 0:
            tail = "\n".join(result.stderr.strip().splitlines()[-20:])
            raise RuntimeError(f"{','.join(variants)} rank {rank} failed (exit {result.returncode}):\n{tail}")
    return done


def count(variants: list[str], args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Both ranks' records of each of ``variants``: each in a launch of its own, or with ``--one-launch`` all in
    one (faster: the libraries imported once; the counts of a step can differ from a fresh launch's)."""
    groups = [variants] if args.one_launch else [[v] for v in variants]
    records = {}
    with tempfile.TemporaryDirectory(prefix="fsdp-proxy-") as tmp:
        for group in groups:
            launch(group, args, Path(tmp))
            for v in group:
                records[v] = [json.loads((Path(tmp) / f"{v}-rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    return records


# -- instructions (callgrind) -----------------------------------------------------------------------------------------
def instructions(variant: str, args: argparse.Namespace) -> list[float]:
    """Instructions per step of each rank: a run of ``--warmup`` steps and one of ``--instructions`` more under
    callgrind, the difference over the extra steps (each rank its own valgrind process)."""
    totals: dict[int, list[int]] = {}
    with tempfile.TemporaryDirectory(prefix="fsdp-proxy-cg-") as tmp:
        for steps in (0, args.instructions):
            valgrind = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/{variant}-{steps}-{{rank}}.cg"]
            for rank, done in enumerate(launch([variant], args, Path(tmp), steps=steps, valgrind=valgrind)):
                match = re.search(r"Collected\s*:\s*(\d+)", done.stderr)
                if match is None:
                    raise RuntimeError(f"{variant} rank {rank}: no callgrind total:\n{done.stderr[-2000:]}")
                totals.setdefault(rank, []).append(int(match.group(1)))
    return [(b - a) / args.instructions for a, b in (totals[r] for r in range(WORLD_SIZE))]


# -- summaries --------------------------------------------------------------------------------------------------------
def summarise(variant: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One row: per rank the median calls and built-in calls per step, and the collectives per step (the same every
    step, else their median and ``collectives_steady: False``); medians are the lower middle value (a step's count)."""
    row: dict[str, Any] = {"variant": variant, "parameter_tensors": ranks[0]["parameter_tensors"],
                           "steps_counted": len(ranks[0]["steps"])}  # fmt: skip
    row["calls_per_rank"] = [statistics.median_low(s["calls"] for s in r["steps"]) for r in ranks]
    row["c_calls_per_rank"] = [statistics.median_low(s["c_calls"] for s in r["steps"]) for r in ranks]
    row["phases"] = {p: statistics.median_low(s["phases"][p] for s in ranks[0]["steps"]) for p in PHASES}
    row["equals_per_rank"] = [statistics.median_low(s["equals"] for s in r["steps"]) for r in ranks]
    row["calls"] = statistics.fmean(row["calls_per_rank"])
    row["c_calls"] = statistics.fmean(row["c_calls_per_rank"])
    per_rank = []
    for r in ranks:
        kinds = sorted({k for s in r["steps"] for k in s["collectives"]})
        per_rank.append({k: statistics.median_low(s["collectives"].get(k, 0) for s in r["steps"]) for k in kinds})
    row["collectives_per_rank"] = per_rank
    row["collectives"] = per_rank[0]
    row["engine_collectives"] = {k.split(":", 1)[1]: n for k, n in per_rank[0].items() if k.startswith("engine:")}
    row["other_collectives"] = {k.split(":", 1)[1]: n for k, n in per_rank[0].items() if k.startswith("others:")}
    row["engine_all_reduces"] = sum(n for k, n in row["engine_collectives"].items() if k.endswith("all_reduce"))
    row["collectives_steady"] = all(
        s["collectives"] == r["steps"][0]["collectives"] for r in ranks for s in r["steps"])
    row["ranks_agree_on_collectives"] = all(p == per_rank[0] for p in per_rank)
    steps = len(ranks[0]["steps"])
    row["collective_callers"] = {k: n / steps for k, n in sorted(ranks[0]["callers"].items())}  # rank 0, per step
    row["calls_every_step"] = [[s["calls"] for s in r["steps"]] for r in ranks]
    return row


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Calls and built-in calls of each row over its reference's (when it ran)."""
    for row in rows:
        ref = next((r for r in rows if r["variant"] == reference_of(row["variant"])), None)
        row["reference"] = reference_of(row["variant"])
        row["calls_vs_reference"] = None if ref is None else row["calls"] / ref["calls"]
        row["c_calls_vs_reference"] = None if ref is None else row["c_calls"] / ref["c_calls"]


def verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 41's goals for each of :data:`GOAL_ROWS` that ran: calls <= 1.03 x its reference's, one engine
    all-reduce per step."""
    out = []
    for name in GOAL_ROWS:
        row = next((r for r in rows if r["variant"] == name), None)
        if row is None:
            continue
        if row.get("calls_vs_reference") is not None:
            out.append({"goal": f"{name} Python calls per step <= {GOAL} x {reference_of(name)}",
                        "value": row["calls_vs_reference"], "met": row["calls_vs_reference"] <= GOAL})
        out.append({"goal": f"{name} engine all-reduces per step == {GOAL_ENGINE_ALL_REDUCES}",
                    "value": row["engine_all_reduces"], "met": row["engine_all_reduces"] == GOAL_ENGINE_ALL_REDUCES})
    return out  # fmt: skip


def per_step(ranks: list[dict[str, Any]], key: str) -> dict[str, float]:
    """A record's per-function counts (``functions`` or ``builtins``) per counted step, the mean of the ranks."""
    total: collections.Counter[str] = collections.Counter()
    for r in ranks:
        total.update(r[key])
    steps = len(ranks[0]["steps"]) * len(ranks)
    return {name: n / steps for name, n in total.items()}


def breakdown(ranks: list[dict[str, Any]], reference: list[dict[str, Any]], key: str, top: int) -> list[list[Any]]:
    """The ``top`` functions whose calls per step exceed the reference's most: ``[name, row, reference, extra]``."""
    mine, ref = per_step(ranks, key), per_step(reference, key)
    extra = {name: mine.get(name, 0.0) - ref.get(name, 0.0) for name in set(mine) | set(ref)}
    ranked = sorted(extra.items(), key=lambda item: (-item[1], item[0]))[:top]
    return [[name, mine.get(name, 0.0), ref.get(name, 0.0), d] for name, d in ranked]


def _counted(ranks: list[dict[str, Any]]) -> list[list[tuple[Any, ...]]]:
    """What must agree between two launches of the same code: each rank's calls, built-in calls and collectives of
    every counted step (not ``equals``, which moves with the hashes of ids)."""
    return [[(s["calls"], s["c_calls"], s["collectives"]) for s in r["steps"]] for r in ranks]


def _kinds(counts: dict[str, float]) -> str:
    return ", ".join(f"{k} {n:g}" for k, n in sorted(counts.items())) or "none"


def table(rows: list[dict[str, Any]]) -> str:
    columns = ("variant", "calls/step (rank 0, 1)", "x calls", "c calls/step (rank 0, 1)", "x c calls",
               "engine collectives/step", "other collectives/step")  # fmt: skip
    body = [
        (r["variant"], " / ".join(f"{c:,.0f}" for c in r["calls_per_rank"]), _harness.cell(r["calls_vs_reference"],
         ".3f"), " / ".join(f"{c:,.0f}" for c in r["c_calls_per_rank"]), _harness.cell(r["c_calls_vs_reference"],
         ".3f"), _kinds(r["engine_collectives"]), _kinds(r["other_collectives"]))
        for r in rows
    ]  # fmt: skip
    return _harness.markdown_table(columns, body)


def phase_table(rows: list[dict[str, Any]]) -> str:
    body = []
    for r in rows:
        ref = next((x for x in rows if x["variant"] == reference_of(r["variant"])), None)
        body.append((r["variant"], *(f"{r['phases'][p]:,}" for p in PHASES),
                     *("-" if ref is None else f"{r['phases'][p] - ref['phases'][p]:+,}" for p in PHASES)))
    return _harness.markdown_table(("variant", *PHASES, *(f"{p} - its reference" for p in PHASES)), body)


def breakdown_table(entries: list[list[Any]], reference: str = REFERENCE) -> str:
    return _harness.markdown_table(("function", "row/step", f"{reference}/step", "extra/step"),
                                   [(n, f"{a:,.1f}", f"{b:,.1f}", f"{d:+,.1f}") for n, a, b, d in entries])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=None, metavar="VARIANT",
                        help=f"default: {', '.join(BF16_VARIANTS + ACCELERATE_VARIANTS)} (--fp16 adds "
                             f"{', '.join(FP16_VARIANTS)})")
    parser.add_argument("--fp16", action="store_true", help="also the float16 rows")
    parser.add_argument("--steps", type=int, default=20, help="counted steps per rank")
    parser.add_argument("--warmup", type=int, default=5, help="uncounted steps first (FSDP's lazy set-up among them)")
    parser.add_argument("--layers", type=int, default=6, help="transformer blocks (each an FSDP unit)")
    parser.add_argument("--dim", type=int, default=32, help="width")
    parser.add_argument("--repeats", type=int, default=1, help="launches per variant; the counts must agree")
    parser.add_argument("--top", type=int, default=15, help="functions in each row's breakdown against the reference")
    parser.add_argument("--check", action="store_true",
                        help=f"small and fast: {', '.join(CHECK_VARIANTS)}, 3 steps after 2 (for the tests)")
    parser.add_argument("--one-launch", action="store_true",
                        help="every variant in the same two processes, one after the other (--check does)")
    parser.add_argument("--instructions", type=int, default=0, metavar="N",
                        help="also count instructions per step over N steps under callgrind (slow)")
    parser.add_argument("--rank-timeout", type=float, default=600.0, help="seconds a launch may take")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/fsdp_proxy.json")
    parser.add_argument("--_rank", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rank-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_plain", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args._rank:
        _rank_main(args._rank.split(","), args)
        return None
    if args.check:
        args.steps, args.warmup, args.one_launch = min(args.steps, 3), min(args.warmup, 2), True
    if args.steps < 1 or args.warmup < 1 or args.repeats < 1:
        parser.error(f"--steps={args.steps}, --warmup={args.warmup} and --repeats={args.repeats} must be at least 1 "
                     "(the first step sets FSDP up)")
    variants = args.variants or list(CHECK_VARIANTS if args.check else BF16_VARIANTS + (FP16_VARIANTS if args.fp16
                                                                                         else ()) + ACCELERATE_VARIANTS)
    for reference in dict.fromkeys(reference_of(v) for v in list(variants)):
        if reference not in variants:
            variants.insert(0, reference)
    runs = []
    for index in range(args.repeats):
        runs.append(count(variants, args))
        print(f"run {index + 1}/{args.repeats}, calls per step (rank 0, 1): " + ", ".join(
            f"{v} {summarise(v, runs[-1][v])['calls_per_rank']}" for v in variants), flush=True)
    records = runs[0]
    agree = {v: all(_counted(run[v]) == _counted(records[v]) for run in runs) for v in variants}
    rows = [summarise(v, records[v]) for v in variants]
    for row in rows:
        row["repeats_agree"] = agree[row["variant"]] if args.repeats > 1 else None
    add_ratios(rows)
    if args.instructions:
        for row in rows:
            row["instructions_per_rank"] = instructions(row["variant"], args)
            row["instructions"] = statistics.fmean(row["instructions_per_rank"])
        for row in rows:
            ref = next(r for r in rows if r["variant"] == reference_of(row["variant"]))
            row["instructions_vs_reference"] = row["instructions"] / ref["instructions"]
    goals = verdicts(rows)
    tables = {"calls per step (median over the counted steps)": table(rows),
              "Python calls per step by phase (rank 0; split at on_before_backward and on_after_backward)":
              phase_table(rows)}  # fmt: skip
    if args.instructions:
        tables[f"instructions per step (callgrind, {args.instructions} steps after {args.warmup})"] = (
            _harness.markdown_table(("variant", "instructions/step (rank 0, 1)", "x instructions"), [
                (r["variant"], " / ".join(f"{c:,.0f}" for c in r["instructions_per_rank"]),
                 f"{r['instructions_vs_reference']:.3f}") for r in rows]))  # fmt: skip
    breakdowns: dict[str, dict[str, list[list[Any]]]] = {}
    for variant in variants:
        reference = reference_of(variant)
        if variant == reference or args.top < 1:
            continue
        breakdowns[variant] = {key: breakdown(records[variant], records[reference], key, args.top)
                               for key in ("functions", "builtins")}  # fmt: skip
        tables[f"{variant}: the {args.top} Python functions with the most extra calls per step"] = breakdown_table(
            breakdowns[variant]["functions"], reference)
        tables[f"{variant}: the {args.top} built-ins with the most extra calls per step"] = breakdown_table(
            breakdowns[variant]["builtins"], reference)
    for title, text in tables.items():
        print(f"\n{title}:\n{text}")
    print()
    for goal in goals:
        value = goal["value"]
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"goal: {goal['goal']}: {shown}: {'met' if goal['met'] else 'NOT met'}")
    if args.repeats > 1:
        print("repeats agree: " + ", ".join(f"{v} {'yes' if ok else 'NO'}" for v, ok in agree.items()))
    model = vars(_model_spec(args))
    result = {"benchmark": "fsdp_proxy", **_harness.machine("cpu"), "command": _harness.command(argv),
              "model": {k: v for k, v in model.items() if v}, "world_size": WORLD_SIZE, "steps": args.steps,
              "warmup": args.warmup, "repeats": args.repeats, "reference": REFERENCE, "rows": rows, "goals": goals,
              "breakdowns": breakdowns}  # fmt: skip
    _harness.save(args.out or _harness.default_out("fsdp_proxy"), result, tables)
    return result


if __name__ == "__main__":
    main()
