"""At O2 and O3, the forward policy (loss functions in FP32; at O3 promoted when their arguments differ) only where
the model's code can compute a loss.

The O2 policy is a torch-function mode, and a mode is handed every torch call made while it is on the stack: pushed
for a whole forward it costs a Python call per op of the half model (3-5 us each, issue 25), to catch the few loss
calls. Losses are computed by a model's own code (a Hugging Face ``...ForSequenceClassification.forward``, a
LightningModule's ``training_step``), not inside its blocks. So when a model is prepared at O2, :class:`LossRegions`
reads each submodule's code and takes the mode off the stack while the topmost submodules whose subtree computes no
loss run (a forward pre-hook and an always-called forward hook on each of them).

A prepared module whose whole tree computes no loss (a GPT that returns logits, the loss computed by the loop after
the call) is hooked alone instead, when it runs its own ``forward``: one pair of hooks in place of a pair per child
(each pair costs about 7 host calls per step: torch's hooked call path, the two hooks, a dynamo question in each). Not
when the root's own code calls a callable it does not name (an instance attribute that is not a module, or a
``getattr``) whose code computes a loss or cannot be read (:meth:`LossRegions._hidden_callees`): a root hooked alone
would run that loss in half. Not when the tree holds a ``training_step`` (a LightningModule: the Trainer runs its
training code outside its forward, through it under DDP and FSDP with ``forward`` redirected), nor when the prepared
module is sharded (FSDP's wrapper runs its inner module's forward, which Lightning and Fabric redirect); and while a
``forward`` put on the root's instance since it was hooked runs (Lightning's and Fabric's redirection of another
method through the model's call, Accelerate's forward wrapper, which hooks the model again when it puts its forward
on) its hooks take nothing off. A free child called directly (not through the root) then runs with the mode on: the
same dtypes (the mode passes every function its table does not name), a call into the mode per op. Nor a root
whose code calls one of its arguments, or indexes a dict, list or tuple holding a loss function, or a closure holding
one; nor one whose topmost loss-free children have forward hooks: one registered after it was hooked (read with
builtins when torch's hook counter moved) keeps the mode on for that call and has its children hooked in its place
at the next forward (:meth:`stale`). The mode goes back on before a module's other forward hooks run.

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

import ast
import inspect
import textwrap
import threading
import types
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_mpx.casting.mode import _CastMode

#: Words that mark a name as a loss in a module's code (lower-cased substring match).
LOSS_WORDS = ("loss", "criterion")
_DEPTH = 3  # calls followed from a forward
_DYNAMIC = frozenset({"getattr", "eval", "exec"})  # names whose callee the code does not show
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
        # By the id of each root hooked alone: torch's hook counter when its free children's forward hooks were last
        # read, their hook dicts, and those hooks' (count, newest id). A forward hook put on one of them since (a
        # distillation or MoE aux-loss hook) runs code that was not read; before stop 58 it ran with the mode on.
        self._hook_marks: dict[int, tuple[int, list[Any], tuple[int, int]]] = {}
        self._demoted: set[int] = set()  # roots hooked alone found hooked below since: their children hooked next

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
        if self._demoted:
            return True
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
        free = self._free(root)
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

    def runs_alone(self, root: nn.Module) -> bool:
        """Whether ``root`` is hooked alone: its whole tree computes no loss, it has a ``forward`` of its own and no
        ``forward`` on its instance, and no module of its tree has a ``training_step`` (see the module's docstring)."""
        return (_callable(root) and "forward" not in root.__dict__
                and not any(hasattr(type(module), "training_step") for module in root.modules())
                and self._free(root)[id(root)] and not self._hidden_callees(root))

    def _hidden_callees(self, root: nn.Module) -> bool:
        """Whether ``root``'s own code (its ``forward`` and the methods of its class it calls, three deep) reaches a
        callable whose code its names do not show: an object it calls by a name that is an instance or class
        attribute, a global or a default argument (a loss function handed to ``__init__``, a lambda, a
        ``functools.partial``, a criterion object or loss module kept in a global) whose code computes a loss or
        cannot be read, or a name looked up at run time (``getattr``). A root hooked alone would run such a loss in
        half; the children's hooks keep the mode on for the root's own code (the layout before stop 58)."""
        owner = type(root)
        forward = inspect.unwrap(owner.forward)
        start = getattr(forward, "__code__", None)
        if start is None:
            return True
        kwdefaults = getattr(forward, "__kwdefaults__", None) or {}
        defaults = (*(getattr(forward, "__defaults__", None) or ()), *kwdefaults.values())
        if any(self._hides_loss(value, owner) for value in defaults):
            return True
        stack, seen = [(start, getattr(forward, "__globals__", {}), _DEPTH)], {start}
        while stack:
            code, globals_, depth = stack.pop()
            if _calls_an_argument(code):  # a loss function handed to the call (``forward(self, x, y, metric)``)
                return True
            for name in set(_names(code)):
                if name in _DYNAMIC:
                    return True
                if self._hides_loss(root.__dict__.get(name), owner) or (
                        not isinstance(globals_.get(name), types.FunctionType)
                        and self._hides_loss(globals_.get(name), owner)):
                    return True
                target = inspect.getattr_static(owner, name, None)
                target = getattr(target, "__func__", target)
                called = _python_code(target)
                if called is None and self._hides_loss(target, owner):  # a class attribute: a loss module
                    return True
                if called is not None and depth > 0 and called not in seen:
                    seen.add(called)
                    stack.append((called, getattr(target, "__globals__", globals_), depth - 1))
        return False

    def _hides_loss(self, value: Any, owner: type, depth: int = _DEPTH) -> bool:
        """Whether calling ``value`` (an object the code reaches by a name) may compute a loss: a loss module or a
        module whose tree computes one, a builtin named in the table, Python code that computes one (a function, a
        lambda, a ``functools.partial``'s function, a callable object's ``__call__``, a callable a closure holds), or
        code that cannot be read; a dict, list or tuple of callables indexed by the code (``self.fns["ce"](...)``,
        ``OBJECTIVES[name](...)``) when one of them may."""
        if depth < 0:
            return False
        if isinstance(value, (dict, list, tuple)):
            items = value.values() if isinstance(value, dict) else value
            return any(self._hides_loss(item, owner, depth - 1) for item in items)
        if value is None or not callable(value) or isinstance(value, (type, types.ModuleType, torch.Tensor)):
            return False
        if isinstance(value, nn.Module):
            return any(self.computes_loss(module) for module in value.modules())
        if isinstance(value, types.BuiltinFunctionType):  # torch.tanh, math.exp: named as they are
            return value.__name__ in self.loss_names
        inner = getattr(value, "func", value)  # functools.partial
        if inner is not value:
            return self._hides_loss(inner, owner, depth)
        called = _python_code(inner) or _python_code(getattr(type(inner), "__call__", None))
        function = getattr(inner, "__func__", inner)
        if called is None or self._code_computes_loss(called, getattr(function, "__globals__", {}), (owner,), _DEPTH):
            return True
        # A closure made in __init__ (``make_scorer(F.cross_entropy)``) calls what its cells hold.
        cells = getattr(function, "__closure__", None) or ()
        return any(self._hides_loss(_cell_value(cell), owner, depth - 1) for cell in cells)

    def _free(self, root: nn.Module) -> dict[int, bool]:
        """By ``id``: whether each module of ``root``'s tree, ``root`` included, computes no loss in its subtree."""
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
        return free

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
    def install(self, root: nn.Module, *, alone: bool = True) -> list[Any]:
        """Hook the free modules of ``root``, or ``root`` alone where :meth:`runs_alone` (``alone=False``: never, as
        for a sharded model); returns the hook handles."""
        self._demoted.discard(id(root))
        hooks = [module._forward_hooks for module in self.free_modules(root)]
        if alone and self.runs_alone(root) and _hook_print(hooks)[0] == 0:
            self._hook_marks[id(root)] = (RemovableHandle.next_id, hooks, _hook_print(hooks))
            return [root.register_forward_pre_hook(self._off_root),
                    root.register_forward_hook(self._on, always_call=True, prepend=True)]
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

    def _off_root(self, module: nn.Module, args: Any) -> None:
        # A root hooked alone: its code was judged, not a forward put on its instance since (a redirection of
        # training_step or another method through the model's call, a forward wrapper): that one keeps the mode on.
        if _dynamo_compiling() or _COMPILER._is_compiling_flag:  # traced, as in _off
            return
        if "forward" not in module.__dict__:
            mark = self._hook_marks.get(id(module))
            if mark is None or mark[0] == RemovableHandle.next_id:  # no hook registered anywhere since; or a deep
                self._off(module, args)  # copy of the root (an EMA), whose code is the original's: never demoted
                return
            hooks = mark[1] if mark is not None else ()  # _hook_print(hooks), inline: builtins, no Python call
            if mark is not None and (sum(map(len, hooks)), max(map(max, filter(None, hooks)), default=-1)) == mark[2]:
                self._hook_marks[id(module)] = (RemovableHandle.next_id, mark[1], mark[2])
                self._off(module, args)
                return
            # A forward hook put below it since it was hooked: this call keeps the mode on (the hook's loss in
            # FP32); its children are hooked in its place at the next forward (stale()).
            self._demoted.add(id(module))
            self._read = None  # the engine's per-forward look at the table then asks stale()
        taken = getattr(self._local, "taken", None)
        if taken is None:
            taken = self._local.taken = []
        taken.append(())  # _on puts nothing back

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


def _hook_print(hooks: list[Any]) -> tuple[int, int]:
    """The count of the hooks in the dicts ``hooks`` and the newest one's id (ids count up), by builtins alone."""
    return sum(map(len, hooks)), max(map(max, filter(None, hooks)), default=-1)


def _cell_value(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _calls_an_argument(code: types.CodeType) -> bool:
    """Whether ``code`` (a function, its nested functions included) calls one of its arguments, or an item of one
    (``forward(self, x, y, metric)`` calling ``metric(...)`` or ``fns[0](...)``); code whose source cannot be read
    counts as doing so."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(code)))
    except (OSError, TypeError, SyntaxError):
        return True
    function = next((node for node in ast.walk(tree)
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))), None)
    if function is None:
        return True
    spec = function.args
    arguments = {arg.arg for arg in (*spec.posonlyargs, *spec.args, *spec.kwonlyargs, spec.vararg, spec.kwarg)
                 if arg is not None}
    for node in ast.walk(function):
        if isinstance(node, ast.Call):
            callee = node.func
            while isinstance(callee, ast.Subscript):
                callee = callee.value
            if isinstance(callee, ast.Name) and callee.id in arguments and callee.id != "self":
                return True
    return False


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
