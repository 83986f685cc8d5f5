"""At O2 and O3, the forward policy (loss functions in FP32; at O3 promoted when their arguments differ) only where
the model's code can compute a loss.

The O2 policy is a torch-function mode, and a mode is handed every torch call made while it is on the stack: pushed
for a whole forward it costs a Python call per op of the half model (3-5 us each, issue 25), to catch the few loss
calls. Losses are computed by a model's own code (a Hugging Face ``...ForSequenceClassification.forward``, a
LightningModule's ``training_step``), not inside its blocks. So when a model is prepared at O2, :class:`LossRegions`
reads each submodule's code and takes the mode off the stack while the topmost submodules whose subtree computes no
loss run (a forward pre-hook and an always-called forward hook on each of them; the prepared module itself is never
hooked: Lightning runs ``training_step`` through it under DDP and FSDP).

A module *computes a loss* when it is a ``torch.nn`` loss module, or when its ``forward`` (or a function or method it
calls, its own or a child module's, three calls deep, nested functions included) names a function of the O2 table
(``cross_entropy``...) or any name containing ``loss`` or ``criterion`` (``self.loss_fct``, ``CrossEntropyLoss``,
``self.loss_function``); a forward whose code cannot be read counts as computing one. A loss computed where the code
does not say so (a loss function reached through an object that names none of these) runs as the half model gives it, as
it did at Apex's O2.

The names are the policy's table's, read live: a row registered later (``amp.policy.table.register(my_fn, "float")``
with ``@dispatchable``), or a table put in its place, makes the regions :meth:`LossRegions.stale`, and ``Amp`` hooks
its models again at the next forward.
"""

from __future__ import annotations

import inspect
import threading
import types
from typing import Any, Callable, Iterable

import torch
from torch import nn

from lightning_mpx.casting.mode import _CastMode

#: Words that mark a name as a loss in a module's code (lower-cased substring match).
LOSS_WORDS = ("loss", "criterion")
_DEPTH = 3  # calls followed from a forward
_COMPILER = torch.compiler
_dynamo_compiling = torch.compiler.is_dynamo_compiling


class LossRegions:
    """The modules of one model that run with an O2 policy's mode off the stack, and the hooks that do it.

    Args:
        policy: The O2 cast policy whose modes are taken off (``Amp.policy``); other modes stay. The names of its
            table's functions count as losses (read when the regions are found, see :meth:`stale`).
        loss_names: The names to use instead (an unpickled copy, whose hooks take off nothing).
    """

    def __init__(self, policy: Any, loss_names: Iterable[str] | None = None) -> None:
        self.policy = policy
        self._fixed_names = None if loss_names is None else frozenset(loss_names)
        self._local = threading.local()  # per thread: the modes each hooked call took off, innermost last
        self._verdicts: dict[Any, bool] = {}  # code object or class -> computes a loss
        self._read: tuple[Any, int] | None = None  # the (table, version) the names and verdicts were read from
        self._names: frozenset[str] = frozenset()

    @property
    def loss_names(self) -> frozenset[str]:
        """The function names that count as losses: the policy's table's, as it is now."""
        return self._current_names()

    def _current_names(self) -> frozenset[str]:
        if self._fixed_names is not None:
            return self._fixed_names
        table = self.policy.table
        if self._read != (table, table._version):
            self._names = frozenset(entry.name for entry in table)
            self._verdicts.clear()  # decided with other names
            self._read = (table, table._version)
        return self._names

    def stale(self) -> bool:
        """Whether the policy's table changed (a row registered, removed or replaced, or another table put in its
        place) since the regions were last found: hooks installed before then may take the mode off around code
        that calls a function the table now casts."""
        if self._fixed_names is not None or self._read is None:
            return False
        table = self.policy.table
        return self._read != (table, table._version)

    def __deepcopy__(self, memo: dict[int, Any]) -> LossRegions:
        # A deep copy of the model (EMA, AveragedModel) shares the hooks: they take off this policy's modes only, so
        # a copy forwarding under an engine of its own keeps its own mode (its exact semantics, at the mode's cost).
        return self

    def __getstate__(self) -> dict[str, Any]:
        # A pickled model (torch.save, ddp_spawn) carries the hooks without the engine: unpickled, they take off no
        # mode (a new engine preparing the model hooks it again).
        return {"loss_names": self.loss_names}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(None, state["loss_names"])  # type: ignore[misc]

    # -- finding the regions -----------------------------------------------------------------------------------
    def free_modules(self, root: nn.Module) -> list[nn.Module]:
        """The topmost submodules of ``root`` (not ``root`` itself) whose whole subtree computes no loss, and that
        can be called: a container without a ``forward`` (``nn.ModuleList``, ``nn.ModuleDict``) never runs its hooks,
        so its children stand in for it (a GPT's ``self.blocks``, iterated by its parent's forward)."""
        self._current_names()  # (re)read the table's names first: the verdicts below are made with them
        free: dict[int, bool] = {}

        def visit(module: nn.Module) -> bool:
            key = id(module)
            if key not in free:
                free[key] = False  # a cycle (a module holding an ancestor) counts as computing one
                children = [visit(child) for child in module.children()]
                free[key] = all(children) and not self.computes_loss(module)
            return free[key]

        visit(root)
        found: dict[int, nn.Module] = {}
        stack = [root]
        while stack:
            parent = stack.pop()
            for child in parent.children():
                if free[id(child)] and _callable(child):
                    found.setdefault(id(child), child)
                else:
                    stack.append(child)
        return list(found.values())

    def computes_loss(self, module: nn.Module) -> bool:
        """Whether ``module``'s own code can compute a loss (see the module's docstring)."""
        if isinstance(module, nn.modules.loss._Loss):
            return True
        forward = module.__dict__.get("forward", type(module).forward)
        forward = inspect.unwrap(getattr(forward, "__func__", forward))
        code = getattr(forward, "__code__", None)
        if code is None:
            return not isinstance(forward, types.BuiltinFunctionType)  # unreadable Python: assume it may
        # Methods are looked up on the module's class and on its children's (``self.head.compute(...)`` runs a
        # child's method inside this forward, outside the child's own hooks).
        owners = tuple(dict.fromkeys((type(module), *(type(child) for child in module.children()))))
        return self._code_computes_loss(code, getattr(forward, "__globals__", {}), owners, _DEPTH)

    def _code_computes_loss(self, code: types.CodeType, globals_: dict[str, Any], owners: tuple[type, ...],
                            depth: int) -> bool:
        key = (code, owners)
        verdict = self._verdicts.get(key)
        if verdict is not None:
            return verdict
        self._verdicts[key] = False  # recursion through itself: decided by the other names
        names = set(_names(code))
        loss_names = self.loss_names
        verdict = any(name in loss_names or any(w in name.lower() for w in LOSS_WORDS) for name in names)
        if not verdict and depth > 0:
            for name in names:
                for target in (*(inspect.getattr_static(owner, name, None) for owner in owners), globals_.get(name)):
                    target = getattr(target, "__func__", target)  # staticmethod, classmethod
                    called = None if isinstance(target, type) else _python_code(target)
                    if called is not None and self._code_computes_loss(
                            called, getattr(target, "__globals__", globals_), owners, depth - 1):
                        verdict = True
                        break
                if verdict:
                    break
        self._verdicts[key] = verdict
        return verdict

    # -- the hooks --------------------------------------------------------------------------------------------
    def install(self, root: nn.Module) -> list[Any]:
        """Hook the free modules of ``root``; returns the hook handles. The forward hook that puts the mode back runs
        before the module's other forward hooks (``prepend``): a loss a user's hook on it computes (a distillation or
        MoE aux-loss hook) runs in FP32, whenever that hook was registered."""
        handles = []
        for module in self.free_modules(root):
            handles.append(module.register_forward_pre_hook(self._off))
            handles.append(module.register_forward_hook(self._on, always_call=True, prepend=True))
        return handles

    def _off(self, module: nn.Module, args: Any) -> None:
        # torch.compiler.is_compiling(), a call saved per hooked module: dynamo makes is_dynamo_compiling() a
        # constant True (the flag is not traced), eager code reads the flag that is_compiling() returns there.
        if _dynamo_compiling() or _COMPILER._is_compiling_flag:  # traced: the casts are in the graph, not per call
            return
        popped = []
        length, at = torch._C._len_torch_function_stack, torch._C._get_function_stack_at
        while length():
            top = at(length() - 1)
            if not (type(top) is _CastMode and top.policy is self.policy):
                break
            popped.append(torch._C._pop_torch_function_stack())
        taken = getattr(self._local, "taken", None)  # self._taken(), inline (a call saved per hooked module)
        if taken is None:
            taken = self._local.taken = []
        taken.append(popped)

    def _on(self, module: nn.Module, args: Any, output: Any) -> None:
        # always_call: also when the forward raised, so the stack is whole again.
        if _dynamo_compiling() or _COMPILER._is_compiling_flag:  # torch.compiler.is_compiling(), as in _off
            return
        taken = getattr(self._local, "taken", None)  # self._taken(), inline
        for mode in reversed(taken.pop() if taken else ()):
            torch._C._push_on_torch_function_stack(mode)


def _callable(module: nn.Module) -> bool:
    """Whether ``module`` has a ``forward`` of its own (``nn.ModuleList`` and ``nn.ModuleDict`` have none)."""
    return "forward" in module.__dict__ or type(module).forward is not nn.Module.forward


def _names(code: types.CodeType) -> Iterable[str]:
    """The global and attribute names ``code`` uses, nested functions and comprehensions included."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _python_code(target: Any) -> types.CodeType | None:
    """The code object of a plain Python function (or method) ``target``, else ``None``."""
    if isinstance(target, (types.FunctionType, types.MethodType)):
        function: Callable[..., Any] = inspect.unwrap(getattr(target, "__func__", target))
        return getattr(function, "__code__", None)
    return None
