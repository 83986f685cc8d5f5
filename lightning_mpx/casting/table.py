"""The cast table: which function runs in which precision.

A :class:`CastTable` maps function objects to a category (see :mod:`lightning_mpx.casting.lists`). Every policy owns
its own table; :meth:`CastTable.default` returns a fresh copy of the default data that the user may extend without
affecting anyone else::

    table = CastTable.default()
    table.register(torch.outer, "half")
    table.register_float_function(torch.nn.functional, "silu")
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import MappingProxyType, ModuleType
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple

import torch
from torch.overrides import handle_torch_function, has_torch_function

from lightning_mpx.casting.lists import (
    AUTOCAST_ACTIONS,
    AUTOCAST_COMPOSITES,
    AUTOCAST_CUDA_BUILD_ONLY,
    AUTOCAST_CUDA_FLOAT16_ONLY,
    AUTOCAST_ENTRY_POINTS,
    AUTOCAST_EQUIVALENT,
    AUTOCAST_EQUIVALENT_CUDA,
    BANNED_ADVICE,
    CATEGORIES,
    DEFAULT_TABLE,
    O2_TABLE,
)
from lightning_mpx.common.dtypes import parse_half_dtype

_NAMESPACES: Mapping[str, Any] = MappingProxyType(
    {
        "torch": torch,
        "torch.nn.functional": torch.nn.functional,
        "torch.Tensor": torch.Tensor,
        "torch.fft": torch.fft,
        "torch.linalg": torch.linalg,
        "torch.special": torch.special,
    }
)
_DISPATCHABLE_MARK = "__lightning_mpx_dispatchable__"


@dataclass(frozen=True)
class CastEntry:
    """One row of a table: a function, where it was found, and its category."""

    namespace: str
    name: str
    function: Callable[..., Any]
    category: str

    @property
    def qualified_name(self) -> str:
        return f"{self.namespace}.{self.name}"


class _OpName(NamedTuple):
    """A ``torch.ops`` operator by name, as a pickled table holds it."""

    namespace: str
    name: str
    overload: str | None


class CastTable:
    """A mutable, per-owner map from functions to cast categories.

    Functions are matched by identity when torch dispatches them to the cast policy, so only callables that take
    part in torch's ``__torch_function__`` protocol can be registered: public torch functions, ``Tensor`` methods,
    ``torch.ops`` operators, and your own functions decorated with :func:`dispatchable`.
    """

    def __init__(self) -> None:
        self._entries: dict[Callable[..., Any], CastEntry] = {}
        self._version = 0  # bumped on every change, so that policies re-read the table
        # Set by autocast_aligned: the table takes autocast's choices, float16 cuDNN RNNs under bfloat16 included.
        self._follows_autocast = False
        #: Whether a policy of this table upcasts a half argument that a model boundary cast from FP32 to the FP32
        #: source's own values (:mod:`~lightning_mpx.casting.targets`): the tables of O2 and O3, whose loss functions
        #: are the only ones they cast up.
        self.exact_sources = False

    @classmethod
    def default(cls) -> CastTable:
        """A new table holding the default data of :mod:`lightning_mpx.casting.lists`."""
        return cls.from_data(DEFAULT_TABLE)

    @classmethod
    def for_device(cls, device_type: str, half_dtype: torch.dtype | str | None = None,
                   model: torch.nn.Module | None = None) -> CastTable:
        """O1's table for a model on ``device_type`` when the user gives none (``Amp`` picks it when the model is
        prepared).

        On ``"cuda"``: :meth:`default` with every row where it differs from CUDA's ``torch.autocast`` settled
        autocast's way (:meth:`autocast_aligned`), so O1 runs on ``torch.autocast``'s C++ dispatch with no Python per
        call. CUDA autocast already runs softmax, sums, norms, exp/log/pow and the losses in FP32; what it does
        differently from :meth:`default` is listed by ``CastTable.default().autocast_differences("cuda")``: ``std``
        and ``var`` in the half dtype, FFTs and the ops without half kernels (linear algebra, ``quantile``...) run as
        given (FP32 inputs stay FP32; half inputs raise where torch has no half kernel), 3-d pooling in half.
        Elsewhere (``"cpu"`` and any other device): :meth:`default`, whose FP32 rows CPU autocast's narrow lists do
        not have (softmax, norms, exp/log, sums), applied by the Python policy.

        CUDA autocast runs cuDNN RNNs in float16 even at bfloat16. When ``half_dtype`` is bfloat16 and ``model``
        holds an ``nn.RNNBase`` module (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``), the table keeps its RNN rows in the
        policy's dtype instead: they run in bfloat16 through the Python policy, which then sees every torch call of
        the forward (the mode's cost); a bfloat16 model without RNN modules, or float16, keeps autocast's dispatch
        alone.
        """
        if not isinstance(device_type, str):
            raise TypeError(f"device_type={device_type!r} must be a device type name such as 'cuda' or 'cpu'.")
        try:  # "cuda:0" is "cuda" (it got the CPU's table before); "gpu" is no device type (it got it silently)
            device_type = torch.device(device_type).type
        except RuntimeError:
            raise ValueError(
                f"device_type={device_type!r} is not a torch device type; valid choices: 'cuda', 'cpu', or another "
                "torch device type ('xpu', 'mps'...), as in model.device.type."
            ) from None
        dtype = None if half_dtype is None else parse_half_dtype(half_dtype)
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model={type(model).__name__} is not a torch.nn.Module (or None).")
        if device_type != "cuda":
            return cls.default()
        table = cls.autocast_aligned("cuda")
        if (dtype is torch.bfloat16 and model is not None
                and any(isinstance(m, torch.nn.RNNBase) for m in model.modules())):
            table._follows_autocast = False
        return table

    @classmethod
    def default_o2(cls) -> CastTable:
        """A new table for the forward pass of a half model (O2): loss functions in FP32, nothing else
        (:data:`~lightning_mpx.casting.lists.O2_TABLE`); a half argument that the model boundary cast from FP32 is
        upcast to its source's values (:attr:`exact_sources`)."""
        table = cls.from_data(O2_TABLE)
        table.exact_sources = True
        return table

    @classmethod
    def default_o3(cls) -> CastTable:
        """A new table for the forward pass of a half model without masters (O3): the loss functions of
        :meth:`default_o2` in the ``promote`` category (a loss on floating arguments of two dtypes, the boundary's FP32
        output beside a half target, runs in the widest; one on arguments of one dtype runs as given), nothing else
        (see :mod:`~lightning_mpx.casting.loss_promotion`); :attr:`exact_sources` as at O2."""
        table = cls.from_data({
            namespace: {"promote": tuple(name for names in by_category.values() for name in names)}
            for namespace, by_category in O2_TABLE.items()
        })
        table.exact_sources = True
        return table

    @classmethod
    def from_data(cls, data: Mapping[str, Mapping[str, tuple[str, ...]]]) -> CastTable:
        """Build a table from ``{namespace: {category: names}}`` data; names missing from this torch are skipped."""
        table = cls()
        for namespace, by_category in data.items():
            if namespace not in _NAMESPACES:
                raise ValueError(f"namespace={namespace!r} is not known; valid choices: {', '.join(_NAMESPACES)}.")
            owner = _NAMESPACES[namespace]
            for category, names in by_category.items():
                _check_category(category)
                for name in names:
                    function = getattr(owner, name, None)
                    if function is not None:
                        table._add(CastEntry(namespace, name, function, category))
        return table

    def copy(self) -> CastTable:
        """An independent copy: registering into it leaves this table as it is."""
        other = CastTable()
        other._entries = dict(self._entries)
        other._follows_autocast = self._follows_autocast
        other.exact_sources = self.exact_sources
        return other

    def __getstate__(self) -> dict[str, Any]:
        # Rows by name where a namespace holds the function: not every torch function can be pickled itself
        # (F.max_pool2d is a local function of boolean_dispatch, Tensor.pow is found as TensorBase.pow).
        # (torch.ops operators cannot be pickled either: they are found again by name.)
        rows = []
        for entry in self._entries.values():
            function: Any = entry.function
            owner = _NAMESPACES.get(entry.namespace)
            if owner is not None and getattr(owner, entry.name, None) is function:
                function = None
            elif isinstance(function, torch._ops.OpOverload):
                function = _OpName(function.namespace, function._opname, function._overloadname)
            elif isinstance(function, torch._ops.OpOverloadPacket):
                function = _OpName(*function._qualified_op_name.split("::"), None)
            rows.append((entry.namespace, entry.name, function, entry.category))
        return {"rows": rows, "follows_autocast": self._follows_autocast, "exact_sources": self.exact_sources}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._entries = {}
        self._version = 0
        self._follows_autocast = state.get("follows_autocast", False)
        self.exact_sources = state.get("exact_sources", False)
        for namespace, name, function, category in state["rows"]:
            if function is None:
                function = getattr(_NAMESPACES[namespace], name)
            elif isinstance(function, _OpName):
                packet = getattr(getattr(torch.ops, function.namespace), function.name)
                function = packet if function.overload is None else getattr(packet, function.overload)
            self._add(CastEntry(namespace, name, function, category))

    @classmethod
    def autocast_aligned(cls, device_type: str, table: CastTable | None = None) -> CastTable:
        """A copy of ``table`` (default: :meth:`default`) with every row where it differs from ``torch.autocast`` on
        ``device_type`` settled autocast's way (:meth:`autocast_differences`).

        A policy with this table runs on ``torch.autocast`` alone (no torch-function mode, no Python per call): the
        fastest O1, at the price of autocast's choices for the functions listed by
        ``CastTable.default().autocast_differences(device_type)`` (for example, on CUDA, ``std``/``var`` and FFTs in
        the half dtype, and linear algebra raising on half inputs instead of running in FP32). On CUDA that includes
        the cuDNN RNNs (``torch.lstm``, ``gru``, ``rnn_tanh``, ``rnn_relu``), which CUDA autocast runs in float16
        even at bfloat16 (:data:`~lightning_mpx.casting.lists.AUTOCAST_CUDA_FLOAT16_ONLY`); a table that is not
        aligned runs them in the policy's half dtype through the Python policy.
        """
        aligned = (table if table is not None else cls.default()).copy()
        for function, (_, theirs) in aligned.autocast_differences(device_type).items():
            if theirs is None:
                aligned.unregister(function)
            else:
                aligned.register(function, theirs)
        aligned._follows_autocast = True
        return aligned

    def autocast_differences(self, device_type: str, *, allow_banned: bool = False,
                             half_dtype: torch.dtype | str | None = None
                             ) -> dict[Callable[..., Any], tuple[str | None, str | None]]:
        """The functions where this table and ``torch.autocast`` on ``device_type`` do not give the same dtypes.

        Returns ``{function: (this table's category or None, autocast's category or None)}`` (``None``: runs as
        given): what the ``"autocast"`` engine of a cast policy leaves to its Python policy, and why it pushes a
        torch-function mode at all. Autocast's categories are the data of
        :data:`~lightning_mpx.casting.lists.AUTOCAST_ACTIONS`; rows of
        :data:`~lightning_mpx.casting.lists.AUTOCAST_EQUIVALENT` (and ``AUTOCAST_EQUIVALENT_CUDA`` on CUDA) count as
        agreeing. ``allow_banned``: banned rows count as FP32 (what a policy with ``allow_banned=True`` runs).
        ``half_dtype``: the policy's half dtype; at bfloat16 on CUDA the cuDNN RNNs, which CUDA autocast runs in
        float16 whatever its dtype, differ from a ``"half"`` row (autocast's category is then ``"float16"``), except
        in a table from :meth:`autocast_aligned`, which takes autocast's choices.
        """
        if device_type not in _AUTOCAST_CATEGORIES:
            raise ValueError(f"device_type={device_type!r} is not supported; valid choices: "
                             f"{', '.join(map(repr, _AUTOCAST_CATEGORIES))}.")
        autocast = _AUTOCAST_CATEGORIES[device_type]
        if (device_type == "cuda" and half_dtype is not None and not self._follows_autocast
                and parse_half_dtype(half_dtype) is torch.bfloat16):
            autocast = {**autocast, **{f: "float16" for f in _FLOAT16_ONLY if f in autocast}}
        equivalent = _EQUIVALENT[device_type]
        differences: dict[Callable[..., Any], tuple[str | None, str | None]] = {}
        for entry in self:
            mine, theirs = entry.category, autocast.get(entry.function)
            if mine == "banned" and allow_banned:
                mine = "float"
            if mine == "sequence":
                mine = "promote"
            if mine != theirs and entry.function not in equivalent:
                differences[entry.function] = (entry.category, theirs)
        for function, theirs in autocast.items():
            if function not in self._entries and function not in equivalent:
                differences[function] = (None, theirs)
        return differences

    # -- registration -------------------------------------------------------------------------------------------
    def register(self, function: Callable[..., Any], category: str) -> None:
        """Put ``function`` in ``category`` (``"half"``, ``"float"``, ``"promote"``, ``"sequence"`` or
        ``"banned"``), replacing any earlier category."""
        _check_category(category)
        if not callable(function):
            raise TypeError(f"function={function!r} is not callable.")
        if not _takes_part_in_dispatch(function):
            raise TypeError(
                f"function={function!r} does not take part in torch's __torch_function__ protocol, so the cast policy "
                "would never see it being called. Register a torch function, a Tensor method or a torch.ops operator, "
                "or decorate your own function with lightning_mpx.dispatchable."
            )
        name = getattr(function, "__name__", repr(function))
        # Name it after the public namespace that holds it (``torch.Tensor.add``, not ``builtins.add``).
        namespace = next(
            (ns for ns, owner in _NAMESPACES.items() if getattr(owner, name, None) is function),
            getattr(function, "__module__", None) or type(function).__module__,
        )
        self._add(CastEntry(namespace, name, function, category))

    def register_function(self, module: ModuleType | type, name: str, category: str) -> None:
        """Register ``getattr(module, name)``, in the spirit of Apex's ``register_*_function(module, name)``."""
        if not hasattr(module, name):
            raise ValueError(f"name={name!r}: {getattr(module, '__name__', module)!r} has no attribute {name!r}.")
        self.register(getattr(module, name), category)

    def register_half_function(self, module: ModuleType | type, name: str) -> None:
        """Run ``module.name`` with half inputs."""
        self.register_function(module, name, "half")

    def register_float_function(self, module: ModuleType | type, name: str) -> None:
        """Run ``module.name`` with FP32 inputs."""
        self.register_function(module, name, "float")

    def register_promote_function(self, module: ModuleType | type, name: str) -> None:
        """Run ``module.name`` in the widest floating type of its inputs."""
        self.register_function(module, name, "promote")

    def unregister(self, function: Callable[..., Any]) -> None:
        """Remove ``function``: it then runs with its inputs as given."""
        if self._entries.pop(function, None) is None:
            raise KeyError(f"function={function!r} is not in this table.")
        self._version += 1

    # -- queries ------------------------------------------------------------------------------------------------
    def category_of(self, function: Callable[..., Any]) -> str | None:
        """The category of ``function``, or ``None`` when the table does not list it."""
        entry = self._entries.get(function)
        return None if entry is None else entry.category

    def entry(self, function: Callable[..., Any]) -> CastEntry | None:
        return self._entries.get(function)

    def entries(self, category: str | None = None) -> list[CastEntry]:
        """All rows, or those of one category, in registration order."""
        if category is not None:
            _check_category(category)
        return [entry for entry in self._entries.values() if category is None or entry.category == category]

    def banned_advice(self, function: Callable[..., Any]) -> str:
        entry = self._entries.get(function)
        name = entry.name if entry else getattr(function, "__name__", repr(function))
        return BANNED_ADVICE.get(
            name, f"{name} is banned in this cast table; pass allow_banned=True to run it in FP32 instead."
        )

    def __contains__(self, function: object) -> bool:
        return function in self._entries

    def __iter__(self) -> Iterator[CastEntry]:
        return iter(list(self._entries.values()))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        counts = {c: sum(1 for e in self._entries.values() if e.category == c) for c in CATEGORIES}
        return "CastTable(" + ", ".join(f"{c}={n}" for c, n in counts.items()) + ")"

    def _add(self, entry: CastEntry) -> None:
        self._entries[entry.function] = entry
        self._version += 1


def _check_category(category: object) -> None:
    if category not in CATEGORIES:
        raise ValueError(f"category={category!r} is not a cast category; valid choices: {', '.join(CATEGORIES)}.")


def _takes_part_in_dispatch(function: Callable[..., Any]) -> bool:
    if isinstance(function, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return True
    if getattr(function, _DISPATCHABLE_MARK, False):
        return True
    module = getattr(function, "__module__", None) or getattr(getattr(function, "__objclass__", None), "__module__", "")
    return isinstance(module, str) and (module == "torch" or module.startswith(("torch.", "torch._")))


def dispatchable(function: Callable[..., Any]) -> Callable[..., Any]:
    """Make your own function visible to cast policies, so that it can be registered in a :class:`CastTable`.

    The wrapper routes calls through torch's ``__torch_function__`` protocol whenever one of its tensor arguments
    (positional, keyword, or inside a list or tuple) asks for it, as every torch function does. Without an active
    policy it simply calls ``function``.

    Example:
        >>> @dispatchable
        ... def fused_gelu_linear(x, weight): ...
        >>> table.register(fused_gelu_linear, "half")  # doctest: +SKIP
    """
    if not callable(function):
        raise TypeError(f"function={function!r} is not callable; @dispatchable decorates a function.")

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        tensors = tuple(_tensors_in(args)) + tuple(_tensors_in(tuple(kwargs.values())))
        # While torch.compile traces, has_torch_function() answers for tensor subclasses only, not for the active
        # torch-function modes, so the modes are asked for directly: otherwise a policy would see the call in eager
        # and not under compile.
        if tensors and (has_torch_function(tensors) or (torch.compiler.is_compiling() and _mode_active())):
            return handle_torch_function(wrapper, tensors, *args, **kwargs)
        return function(*args, **kwargs)

    setattr(wrapper, _DISPATCHABLE_MARK, True)
    return wrapper


def _mode_active() -> bool:
    return torch._C._is_torch_function_mode_enabled()


def _tensors_in(values: tuple[Any, ...]) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors_in(tuple(value))


# -- what torch.autocast does, per device (read-only, built at import from cast_lists' data) -----------------------
def _resolve(qualified: str) -> Callable[..., Any] | None:
    namespace, _, name = qualified.rpartition(".")
    owner = _NAMESPACES.get(namespace)
    return None if owner is None else getattr(owner, name, None)


#: The dispatch key of each device's autocast kernels.
_AUTOCAST_KEYS = MappingProxyType({"cpu": "AutocastCPU", "cuda": "AutocastCUDA"})
_PREFIXED = (("torch.fft", "fft_"), ("torch.linalg", "linalg_"), ("torch.special", "special_"))


def _base_names(qualified_ops: Iterable[str]) -> frozenset[str]:
    """``{"rms_norm", ...}`` from ``["aten::rms_norm", "aten::add.Tensor", ...]`` (aten operators only)."""
    return frozenset(name.partition("::")[2].split(".")[0] for name in qualified_ops if name.startswith("aten::"))


def _operators_of(qualified: str) -> frozenset[str]:
    """The aten operators through which the public function ``qualified`` reaches autocast (by name)."""
    found = {op for op, names in AUTOCAST_ENTRY_POINTS.items() if qualified in names}
    namespace, _, name = qualified.rpartition(".")
    found.add(next((prefix + name for owner, prefix in _PREFIXED if owner == namespace), name))
    return frozenset(found)


def _autocast_categories(device_type: str, registered: frozenset[str] | None = None,
                         operators: frozenset[str] | None = None) -> Mapping[Callable[..., Any], str]:
    """torch.autocast's category of each function it casts on ``device_type``, on the installed torch.

    The pinned data (:data:`~lightning_mpx.casting.lists.AUTOCAST_ACTIONS`) describes the torch it was derived from; a
    row whose operators all exist in this torch but none has an autocast kernel for the device here (an older torch:
    ``rms_norm`` entered CUDA autocast's FP32 list after torch 2.11) is dropped, so that the ``"autocast"`` engine
    never trusts autocast to cast a function it leaves alone. ``registered``/``operators``: this torch's autocast
    operators for the device and all its aten operators (by base name; read from the dispatcher when ``None``).
    """
    if registered is None:
        registered = _base_names(torch._C._dispatch_get_registrations_for_dispatch_key(_AUTOCAST_KEYS[device_type]))
    if operators is None:
        operators = _base_names(torch._C._dispatch_get_all_op_names())
    found: dict[Callable[..., Any], str] = {}
    for category, names in AUTOCAST_ACTIONS[device_type].items():
        for name in names:
            ops = _operators_of(name)
            function = _resolve(name)
            if function is not None and (ops & registered or not ops <= operators):
                found[function] = category
    rows: list[tuple[str, str | None]] = []
    if device_type == "cuda":
        rows += list(AUTOCAST_CUDA_BUILD_ONLY.items())
    rows += list(AUTOCAST_COMPOSITES.get(device_type, {}).items())
    for name, category in rows:
        function = _resolve(name)
        if function is None:
            continue
        if category is None:
            found.pop(function, None)
        else:
            found[function] = category
    return MappingProxyType(found)


# Read-only, built once at import from the data of cast_lists.
_FLOAT16_ONLY = frozenset(f for f in map(_resolve, AUTOCAST_CUDA_FLOAT16_ONLY) if f is not None)
_AUTOCAST_CATEGORIES = MappingProxyType({device: _autocast_categories(device) for device in AUTOCAST_ACTIONS})
_EQUIVALENT = MappingProxyType({
    device: frozenset(f for f in map(_resolve, names) if f is not None)
    for device, names in (("cpu", AUTOCAST_EQUIVALENT), ("cuda", {**AUTOCAST_EQUIVALENT, **AUTOCAST_EQUIVALENT_CUDA}))
})
