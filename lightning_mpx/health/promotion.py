"""Modules that run in FP32 inside a mixed-precision model: pinned up front, or promoted at the loss-scale floor.

Two ways in, one mechanism:

* ``Amp(..., fp32_modules=["lm_head", "*.norm"])`` pins modules to FP32 when the model is prepared, at every opt
  level. A pattern is an :mod:`fnmatch` pattern matched against the names that ``model.named_modules()`` gives
  (``"blocks.0.norm"``); it also matches a module whose name ends with ``"." + a match``, so ``"lm_head"`` finds
  ``"model.lm_head"`` inside a LightningModule that wraps the network. The root module itself is never matched
  (the whole model in FP32 is ``opt_level="O0"``).
* ``Amp(..., on_floor="promote")``: when the loss scale is at ``min_loss_scale`` and the overflows keep coming from
  the same modules (the modules :meth:`OverflowRecord.culprits` names in each of the last
  :data:`FLOOR_OVERFLOWS_TO_PROMOTE` overflows at the floor), those modules run in FP32 from then on. The decision is
  logged with its evidence (a warning on the ``lightning_mpx`` logger, rank zero), shown as ``mpx/promoted/<module>``
  metrics, and saved in :meth:`Amp.state_dict <lightning_mpx.engine.amp.Amp.state_dict>`, so a resumed run keeps it. The
  overflows counted need not fall on consecutive steps (a clean step between them does not reset the count): at the
  floor any overflow is serious, and ``on_floor="raise"`` would have ended the run at the first.

What "runs in FP32" means per opt level:

* **O1**: the model is FP32 already; forward hooks on the module cast its half floating-point inputs to FP32 and,
  while its forward runs, make the cast policy run the table's half ops (matmuls, convolutions...) in FP32. Its
  outputs are left FP32 (the policy casts them where the next half op needs it).
* **O2/O3**: the module's parameters (and floating buffers) are FP32. Pinned modules are converted back right after
  the model is cast to half, so they never get an FP32 master. A promoted module is converted in place: each
  parameter keeps its identity (optimizer ``param_groups`` stay valid), takes its FP32 master's exact value, and the
  master is dropped (the parameter is its own master from then on, as an FP32 parameter is); the optimizer's state
  moves from the master to the parameter, so its FP32 moments are kept (at O3, where the state is half, it is made
  FP32). Forward hooks cast the module's floating inputs to FP32 and its FP32 outputs back to the half dtype, so the
  next half module works. A module whose *output* exceeds the half range is therefore not cured by promoting it
  alone: when a module that already runs in FP32 is blamed again at the floor, its parent is promoted instead.
* **O0**: everything is FP32; patterns are checked and reported, nothing changes.

Non-finite values made by code between two module calls (``h = self.blow(h) * 1e5`` in a forward: attention scores, a
residual sum; see :class:`~lightning_mpx.health.forensics.CodeRegion`) are blamed on the module whose output fed that
code: at O1 its FP32 output keeps the code after it in FP32. At O2/O3 that output goes back to half before the code
runs, so the module whose forward runs the code is promoted instead (never the root: code in the root's forward or in
the training step cannot be promoted; the floor error then names it).

Promotion refuses (and the floor error is raised as with ``on_floor="raise"``) when no module can be blamed: no
parameter had non-finite gradients on this process, the last overflows came from different modules, the culprits are
every module that has parameters (an overflow that the gradients cannot localise: a forward overflow without the
forward watched, or a NaN in the data), promoting would take the whole model to FP32, or at O2/O3 under a
distributed strategy (DDP's gradient buckets are fixed when it wraps the model: pass ``fp32_modules`` instead).
"""

from __future__ import annotations

import fnmatch
import logging
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, Sequence

import torch
from torch import nn

from lightning_mpx.casting.policy import enter_fp32, exit_fp32
from lightning_mpx.common.containers import _cast_collection
from lightning_mpx.common.dtypes import HALF_DTYPES, set_param_data
from lightning_mpx.health.floor_promotion import FloorDecision
from lightning_mpx.health.forensics import ROOT_TAG, OverflowRecord
from lightning_mpx.masters.state_keys import has_own_key, put_by_param

if TYPE_CHECKING:
    from lightning_mpx.masters.weights import MasterWeights
    from lightning_mpx.opt_levels import Properties

log = logging.getLogger("lightning_mpx")


class _Engine(Protocol):
    """What :class:`Promotion` reads from the engine that owns it (:class:`~lightning_mpx.engine.amp.Amp` is one): a
    protocol, so that this module never imports the engine back."""

    properties: Properties
    policy: Any  # the O1 cast policy (a CastPolicy), None at the other levels
    log_overflows: bool
    found_inf_reducer: Callable[[torch.Tensor], None] | None
    master_weights: list[MasterWeights]
    sharded: bool  # the model is FSDP-sharded: its dtypes are FSDP's policies', not changed here
    _optimizers: dict[int, Any]  # id(optimizer) -> its stage state (optimizer_ref, pairs_key, mirrors)

    @property
    def opt_level(self) -> str: ...

    @property
    def half_dtype(self) -> torch.dtype: ...


#: How many overflows in a row at the loss-scale floor must share a culprit before ``on_floor="promote"`` promotes
#: it (the default of :attr:`Promotion.patience`): one overflow at the floor can be a bad batch, two from the same
#: module are a pattern.
FLOOR_OVERFLOWS_TO_PROMOTE = 2


def check_patterns(fp32_modules: object) -> tuple[str, ...]:
    """``fp32_modules`` as a tuple of patterns.

    Raises:
        TypeError: for a single string (a list is expected) or a pattern that is not a string.
        ValueError: for an empty pattern.
    """
    if isinstance(fp32_modules, str):
        raise TypeError(
            f"fp32_modules={fp32_modules!r} must be a list of module-name patterns, not a string; did you mean "
            f"fp32_modules=[{fp32_modules!r}]?"
        )
    try:
        patterns = tuple(fp32_modules)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(
            f"fp32_modules={fp32_modules!r} must be a list of module-name patterns (fnmatch, e.g. ['lm_head', "
            "'*.norm'])."
        ) from None
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(
                f"fp32_modules holds {pattern!r} ({type(pattern).__name__}); each entry must be a module-name pattern "
                "(a string such as 'lm_head' or '*.norm')."
            )
        if not pattern:
            raise ValueError(
                "fp32_modules holds an empty pattern; the root module cannot be pinned (use opt_level='O0' for a "
                "model entirely in FP32), name a submodule such as 'lm_head' or '*.norm'."
            )
    return patterns


def matches(name: str, pattern: str) -> bool:
    """Whether module ``name`` matches ``pattern``: the whole name, or a tail of it after a dot. ``torch.compile``'s
    ``_orig_mod`` segments are part of neither (a compiled submodule's ``body._orig_mod.1`` is ``body.1``, and so is a
    pattern copied from ``named_modules()``, ``"body._orig_mod.1"``)."""
    if "_orig_mod" in name:
        name = ".".join(part for part in name.split(".") if part != "_orig_mod")
    if "_orig_mod" in pattern:
        pattern = ".".join(part for part in pattern.split(".") if part != "_orig_mod")
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


class _Entered(threading.local):
    """An FP32 module's :func:`enter_fp32` states of the calls in progress, per thread (each thread has its own cast
    modes: threads running one model at once must not leave each other's); a copy starts empty."""

    def __init__(self) -> None:  # run again on each thread's first use
        self.stack: list[Any] = []

    def __reduce__(self) -> tuple[type[_Entered], tuple[()]]:
        return type(self), ()


class _Fp32Boundary:
    """The forward hooks of one FP32 module: its inputs to FP32 (and O1's half ops in FP32) on the way in, its FP32
    outputs back to the half dtype on the way out (O2/O3). Holds no engine, so a deep copy of the model (EMA,
    ``AveragedModel``) copies the hooks along with it.

    ``reference``: a parameter of the model that the prepare made half, outside the FP32 modules: the output is cast
    while it is half, and left as it is once the model was made another dtype since (``model.float()`` after training,
    for an FP32 export or evaluation: the layers after the FP32 module are FP32 then)."""

    def __init__(self, policy: bool, out_dtype: torch.dtype | None, reference: torch.Tensor | None = None) -> None:
        self.policy = policy
        self.out_dtype = out_dtype
        self.reference = reference  # not a weak reference: torch cannot swap a parameter that has one
        self._entered = _Entered()  # this thread's enter_fp32 states, innermost last (a module may call itself)

    def pre(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        if self.policy:
            self._entered.stack.append(enter_fp32())
        return _cast_collection(args, torch.float32, HALF_DTYPES), _cast_collection(kwargs, torch.float32, HALF_DTYPES)

    def post(self, module: nn.Module, args: Any, output: Any) -> Any:
        # always_call: also when the forward raised (output is None then), so the policy's state is restored.
        if self.policy:
            entered = self._entered.stack
            exit_fp32(entered.pop() if entered else None)
        if self.out_dtype is None or output is None:
            return None
        if (reference := self.reference) is not None and reference.dtype != self.out_dtype:
            return None  # the model is not half now (model.float() after training): its next layers are not either
        return _cast_collection(output, self.out_dtype, (torch.float32,))


def _half_reference(model: nn.Module, half: torch.dtype) -> torch.Tensor | None:
    """A parameter of ``model`` in the ``half`` dtype (made half by the prepare), which its FP32 modules' output casts
    follow (:class:`_Fp32Boundary`); ``None`` when it has none."""
    return next((p for p in model.parameters() if p.dtype == half), None)


class Promotion(FloorDecision):
    """The FP32 modules of one :class:`~lightning_mpx.engine.amp.Amp`: pinned by ``fp32_modules``, or promoted by
    ``on_floor="promote"``. Built by ``Amp``; reach it as ``amp.promotion``.

    Args:
        amp: The engine (held weakly).
        patterns: ``fp32_modules`` (see :func:`check_patterns`).

    Attributes:
        patience: How many of the last overflows at the floor must share a culprit before it is promoted
            (:data:`FLOOR_OVERFLOWS_TO_PROMOTE`).
        promoted: Module name to the evidence of its promotion (``step``, ``origin``, the code ``region`` that made
            the non-finite values when it was code between module calls, ``scale`` at the floor, the ``culprits``
            blamed, the non-finite ``parameters`` inside it), in the order the decisions were made.
    """

    def __init__(self, amp: _Engine, patterns: Sequence[str] = ()) -> None:
        self._amp = weakref.ref(amp)
        self.patterns = check_patterns(patterns)
        self.patience = FLOOR_OVERFLOWS_TO_PROMOTE
        self.promoted: dict[str, dict[str, Any]] = {}
        self._pinned: list[str] = []
        self._roots: list[tuple[str, weakref.ref[nn.Module]]] = []  # (name prefix, prepared model)
        self._matched: set[str] = set()
        self._streak: list[frozenset[str]] = []
        # The boundary hooks by prepared model: the engine that hands a model over takes its own off (masters.handover).
        self.hooks: weakref.WeakKeyDictionary[nn.Module, list[Any]] = weakref.WeakKeyDictionary()
        # A prepared model's torch.compile'd wrapper made after the prepare (fabric.setup's), by prepared model.
        self._compiled: weakref.WeakKeyDictionary[nn.Module, weakref.ref[nn.Module]] = weakref.WeakKeyDictionary()

    @property
    def amp(self) -> _Engine:
        amp = self._amp()
        if amp is None:
            raise RuntimeError("the Amp that owns these FP32 modules was garbage-collected")
        return amp

    # -- what runs in FP32 --------------------------------------------------------------------------------------
    @property
    def fp32_modules(self) -> list[str]:
        """Names of the modules that run in FP32: pinned ones, then promoted ones (submodules of those included
        implicitly)."""
        return self._pinned + [name for name in self.promoted if name not in self._pinned]

    def runs_fp32(self, name: str) -> bool:
        """Whether module ``name`` runs in FP32 (itself or an enclosing module pinned or promoted; O0: always)."""
        if self.amp.opt_level == "O0":
            return True
        return any(name == top or name.startswith(top + ".") for top in self.fp32_modules)

    def metrics(self) -> dict[str, float]:
        """``mpx/promoted/<module>``: 1.0 for each module pinned or promoted to FP32 (named as the other tags:
        without a data-parallel wrapper's ``module``, :class:`~lightning_mpx.health.tags.UserNames`)."""
        forensics = getattr(self.amp, "forensics", None)
        shown = forensics.user_names if forensics is not None else str
        return {f"mpx/promoted/{shown(name) or ROOT_TAG}": 1.0 for name in self.fp32_modules}

    # -- set-up (fp32_modules) ----------------------------------------------------------------------------------
    def add_model(self, module: nn.Module, prefix: str) -> None:
        """Pin the submodules of a model being prepared that the patterns match (after its cast to half)."""
        known = [p for p, ref in self._roots if ref() is module]
        if known:
            prefix = known[0]  # prepared again (evaluated, then trained): its names keep their first prefix
        else:
            self._roots = [(p, ref) for p, ref in self._roots if ref() is not None]
            self._roots.append((prefix, weakref.ref(module)))
        if not self.patterns:
            return
        for relative, _ in module.named_modules():
            if not relative:
                continue  # the root: the whole model in FP32 is O0
            name = prefix + relative
            hits = [pattern for pattern in self.patterns if matches(name, pattern)]
            if hits and name not in self._pinned:
                self._matched.update(hits)
                if not any(name.startswith(top + ".") for top in self._pinned):
                    self._pinned.append(name)
        self._pinned = [n for n in self._pinned if not any(n.startswith(t + ".") for t in self._pinned)]
        if self.amp.properties.casts_model and not self.amp.sharded:
            for name in self._pinned:
                target = self._module(name)
                if target is not None:
                    _module_to_fp32(target)
        self._rehook()

    def add_compiled(self, module: nn.Module, wrapper: nn.Module) -> None:
        """``wrapper``, made after ``module`` was prepared, holds it ``torch.compile``'d (``fabric.setup`` compiles the
        model it converted again): at O1 the cast policy is handed off to it as to a model compiled before the
        prepare, while ``module`` holds FP32 modules (:func:`_hand_off_compiled`)."""
        self._compiled[module] = weakref.ref(wrapper)
        if module in self.hooks:
            self._rehook()

    def check_patterns_matched(self) -> None:
        """Raise if a pattern matched no module of the models prepared so far.

        Raises:
            ValueError: naming the pattern and some of the module names it could have matched.
        """
        unmatched = [pattern for pattern in self.patterns if pattern not in self._matched]
        if not unmatched:
            return
        names = [
            prefix + name
            for prefix, ref in self._roots
            if (root := ref()) is not None
            for name, _ in root.named_modules()
            if name
        ]
        shown = ", ".join(map(repr, names[:12])) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
        raise ValueError(
            f"fp32_modules pattern(s) {', '.join(map(repr, unmatched))} match no module of the prepared model(s); "
            f"module names are {shown or 'none (no submodules)'}. Patterns are fnmatch patterns on these names "
            "(e.g. 'lm_head', '*.norm', 'blocks.*.attn')."
        )

    # -- on_floor="promote": the decision is FloorDecision's (floor_promotion.py), the conversion here ---------------
    def _promote(self, targets: list[str], record: OverflowRecord | None, culprits: Iterable[str]) -> None:
        amp = self.amp
        for name in targets:
            blamed = sorted(c for c in culprits if c == name or c.startswith(name + "."))
            module = self._module(name)
            assert module is not None
            if amp.properties.casts_model:
                self._module_to_fp32_in_place(module)
            params = (
                {} if record is None else {p: kind for p, kind in record.parameters.items() if p.startswith(name + ".")}
            )
            region = record.region if record is not None and record.origin == "forward" else None
            self.promoted[name] = {
                "step": -1 if record is None else int(record.step),
                "origin": "unknown" if record is None else str(record.origin),
                "region": None if region is None else region.describe(),
                "scale": None if record is None or not record.scales else float(min(record.scales)),
                "culprits": blamed,
                "parameters": params,
            }
            if amp.log_overflows:
                made = "" if region is None else f", made by the code {region.describe()}"
                shown = ", ".join(f"{p} ({kind})" for p, kind in list(params.items())[:5]) or "none recorded"
                log.warning(
                    "on_floor='promote': running %s in FP32 from now on (step %s, opt_level %s): the loss scale is at "
                    "its floor (%s) and the last %d overflows there came from %s (origin %s; non-finite gradients: "
                    "%s)",
                    name,
                    self.promoted[name]["step"],
                    amp.opt_level,
                    self.promoted[name]["scale"],
                    self.patience,
                    "it" if blamed == [name] else ", ".join(blamed) + ", which already ran in FP32",
                    self.promoted[name]["origin"] + made,
                    shown,
                )
        self._rehook()

    def _module_to_fp32_in_place(self, module: nn.Module) -> None:
        """O2/O3: the module's half parameters become FP32 with their masters' exact values (same objects); the
        masters are dropped and the optimizers' state moves to the parameters."""
        amp = self.amp
        optimizers = [state.optimizer for state in amp._optimizers.values() if state.optimizer_ref() is not None]
        with torch.no_grad():
            for param in module.parameters():
                if param.dtype not in HALF_DTYPES:
                    continue
                master = None
                for masters in amp.master_weights:
                    if masters.covers(param):
                        master = masters.release(param)
                set_param_data(param, master.data if master is not None else param.data.float())
                param.grad = None  # the overflowed half gradient; the next backward makes an FP32 one
                for optimizer in optimizers:
                    if master is not None and has_own_key(optimizer.state, master):
                        put_by_param(optimizer.state, param, optimizer.state.pop(master))  # FP32 moments, kept
                    elif has_own_key(optimizer.state, param):  # O3: the state was half like the parameter
                        optimizer.state[param] = {
                            k: v.float() if torch.is_tensor(v) and v.is_floating_point() and k != "step" else v
                            for k, v in optimizer.state[param].items()
                        }
            _module_to_fp32(module)  # buffers
        for state in amp._optimizers.values():
            state.pairs_key = None  # rebuild the (parameter, master) pairs and the mirrors at the next use
            state.mirrors = None

    # -- checkpoints --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The promotions and the exact FP32 weights of the promoted modules' parameters."""
        weights = {}
        for name in self.promoted:
            module = self._module(name)
            if module is not None:
                for param_name, param in module.named_parameters(prefix=name):
                    weights[param_name] = param.detach().clone()
        return {"promoted": {k: dict(v) for k, v in self.promoted.items()}, "weights": weights}

    def param_names(self, state: dict[str, Any] | None) -> list[str]:
        """The parameter names whose weights a :meth:`state_dict` holds."""
        return list((state or {}).get("weights", {}))

    def check_state_dict(self, state: dict[str, Any] | None) -> None:
        """Raise, changing nothing, if a promoted module of ``state`` is not in the prepared model(s)."""
        for name in (state or {}).get("promoted", {}):
            if self._local_name(name) is None:
                raise KeyError(
                    f"the checkpoint promoted module {name!r} to FP32, but the prepared model(s) have no module of "
                    "that name; resume with the same model."
                )

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Promote the modules ``state`` promoted (those not promoted yet; they were promoted in the run that
        saved it)."""
        if not state:
            return
        # by this run's names: a run compiled or in a data-parallel wrapper and its resume without (or the reverse)
        promoted = {self._local_name(n) or n: evidence for n, evidence in state.get("promoted", {}).items()}
        new = [n for n in promoted if not self.runs_fp32(n)]
        amp = self.amp
        for name in new:
            module = self._module(name)
            assert module is not None
            if amp.properties.casts_model:
                self._module_to_fp32_in_place(module)
        for name, evidence in promoted.items():
            self.promoted.setdefault(name, dict(evidence))
        self._rehook()

    def load_weights(self, state: dict[str, Any] | None) -> None:
        """Copy a :meth:`state_dict`'s exact FP32 weights into the promoted parameters (after the masters loaded)."""
        weights = (state or {}).get("weights", {})
        if not weights:
            return
        saved = {self._local_name(n) or n: n for n in (state or {}).get("promoted", {})}  # this run's: the saved
        with torch.no_grad():
            for name in self.promoted:
                module = self._module(name)
                if module is None:
                    continue
                for param_name, param in module.named_parameters():
                    key = f"{saved.get(name, name)}.{param_name}"
                    if key in weights:
                        param.copy_(weights[key])

    def remove_hooks(self) -> None:
        """Remove the forward hooks of the FP32 modules (at O2/O3 such a module then gets half inputs it cannot
        take: for a model you are done with)."""
        for handle in [handle for handles in self.hooks.values() for handle in handles]:
            handle.remove()
        self.hooks.clear()

    def forget_model(self, module: nn.Module) -> None:
        """Let go of a model another engine took over: its boundary hooks come off and stay off."""
        self._roots = [(prefix, ref) for prefix, ref in self._roots if ref() not in (module, None)]
        for handle in self.hooks.pop(module, ()):
            handle.remove()

    # -- internals ----------------------------------------------------------------------------------------------
    def _rehook(self) -> None:
        """Hooks on the outermost FP32 modules only (an inner one's half output cast would feed FP32 layers)."""
        self.remove_hooks()
        amp = self.amp
        if amp.opt_level == "O0":
            return
        out_dtype = amp.half_dtype if amp.properties.casts_model else None
        boundaries: dict[int, _Fp32Boundary] = {}  # by prepared model: each follows its own model's dtype
        tops = self.fp32_modules
        for name in tops:
            if any(name.startswith(other + ".") for other in tops):
                continue
            module, found = self._module(name), self._root_of(name)
            if module is None or found is None:
                continue
            boundary = boundaries.get(id(found[1]))
            if boundary is None:
                reference = _half_reference(found[1], out_dtype) if out_dtype is not None else None
                boundary = boundaries[id(found[1])] = _Fp32Boundary(
                    amp.properties.patch_torch_functions, out_dtype, reference
                )
            # Inputs: after any other pre-hook (an adapter's boundary cast to half). Outputs: before any other
            # forward hook (an adapter's boundary cast to FP32 must see the half output last).
            self.hooks.setdefault(found[1], []).extend(
                (
                    module.register_forward_pre_hook(boundary.pre, with_kwargs=True),
                    module.register_forward_hook(boundary.post, prepend=True, always_call=True),
                )
            )
        for root, handles in self.hooks.items():
            handles.extend(_hand_off_compiled(amp, root))
            wrapper = self._compiled[root]() if root in self._compiled else None
            if wrapper is not None:
                handles.extend(_hand_off_compiled(amp, wrapper))

    def _root_of(self, name: str) -> tuple[str, nn.Module] | None:
        for prefix, ref in reversed(self._roots):  # longest prefixes ("model1.") were added last
            root = ref()
            if root is not None and name.startswith(prefix):
                return prefix, root
        return None

    def _local_name(self, name: str) -> str | None:
        """This run's name of the module a checkpoint named ``name``: itself, or the module the user calls the same
        (:class:`~lightning_mpx.health.tags.UserNames`: a checkpoint of a compiled or data-parallel run names it
        ``_orig_mod.<name>`` or ``module.<name>``); ``None`` when there is none."""
        if self._module(name) is not None:
            return name
        forensics = getattr(self.amp, "forensics", None)
        if forensics is None:
            return None
        shown = forensics.user_names
        wanted = shown(name)
        for prefix, ref in self._roots:
            root = ref()
            if root is not None:
                for local, _ in root.named_modules(prefix=prefix.rstrip(".")):
                    if local and shown(local) == wanted:
                        return local
        return None

    def _module(self, name: str) -> nn.Module | None:
        found = self._root_of(name)
        if found is None:
            return None
        prefix, root = found
        try:
            return root.get_submodule(name[len(prefix) :])
        except AttributeError:
            return None

    def _parameter_owners(self, trainable: bool = False) -> frozenset[str]:
        """Names of the modules that hold parameters of their own (``trainable``: that require gradients), in every
        prepared model."""
        owners = set()
        for prefix, ref in self._roots:
            root = ref()
            if root is not None:
                for name, module in root.named_modules():
                    if any(p.requires_grad or not trainable for p in module.parameters(recurse=False)):
                        owners.add(prefix + name)
        return frozenset(owners)


def _hand_off_compiled(amp: _Engine, root: nn.Module) -> list[Any]:
    """O1: the cast policy handed off to the ``torch.compile``'d modules of ``root`` that hold FP32 modules
    (:meth:`CastPolicy.hand_off_compiled <lightning_mpx.casting.policy.CastPolicy.hand_off_compiled>`); the handles.

    An FP32 module's hooks, traced into a compiled graph, raise the FP32 count of the mode traced there, not of the
    mode left on the stack while the graph runs: under a backend that runs the graph's torch calls as they are
    (``backend="eager"``, a backend of the user's that returns ``gm.forward``) that mode cast them to half again, and a
    module pinned to FP32 ran in half (its overflow made every loss NaN). Handed off, no mode is on the stack there."""
    policy = amp.policy
    if policy is None or not amp.properties.patch_torch_functions or "torch._dynamo.eval_frame" not in sys.modules:
        return []  # (no module was compiled before dynamo was loaded)
    return policy.hand_off_compiled(root)


def _module_to_fp32(module: nn.Module) -> None:
    """Cast a module's half parameters and floating buffers to FP32 in place (parameters keep their identity)."""
    for submodule in module.modules():
        for param in submodule._parameters.values():
            if param is not None and param.dtype in HALF_DTYPES:
                set_param_data(param, param.data.float())  # a tensor-parallel DTensor: its local shard too
                param.grad = None
        for key, buffer in submodule._buffers.items():
            if buffer is not None and buffer.dtype in HALF_DTYPES:
                submodule._buffers[key] = buffer.float()
