"""Casts at a half model's boundary keep every container's type: Hugging Face ``ModelOutput`` (an ``OrderedDict``
and a dataclass), ``defaultdict``, other mappings and dataclasses, in the core, the Lightning plugin and the
Accelerate adapter."""

from __future__ import annotations

import collections
import dataclasses
import types
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

from lightning_mpx import Amp

HALF, f32 = torch.bfloat16, torch.float32  # the half dtype: not the point here (bfloat16 is fast on a CPU)


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    extra: Any = None
    count: int = 3
    derived: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        self.derived = self.count * 2


@dataclasses.dataclass(frozen=True)
class Frozen:
    hidden: torch.Tensor


class Pair(NamedTuple):
    first: torch.Tensor
    second: torch.Tensor


class Keyword(dict):
    """A dict subclass whose constructor takes no mapping."""

    def __init__(self, *, tag: str) -> None:
        super().__init__()
        self.tag = tag


def _model_output(**values: Any) -> Any:
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs")
    return modeling_outputs.SequenceClassifierOutput(**values)


def _cast(data: Any) -> Any:
    return Amp("O2", half_dtype=HALF).cast_outputs(data)  # half tensors to FP32


def _h(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(HALF)


def test_model_output_keeps_its_type_keys_and_attributes():
    out = _model_output(loss=_h(1)[0], logits=_h(2, 3), hidden_states=(_h(2, 4), _h(2, 4)))
    cast = _cast(out)
    assert type(cast) is type(out)
    assert list(cast.keys()) == ["loss", "logits", "hidden_states"]
    assert cast.logits.dtype == f32 and cast["loss"].dtype == f32 and cast[0].dtype == f32
    assert type(cast.hidden_states) is tuple and {t.dtype for t in cast.hidden_states} == {f32}
    assert cast.attentions is None
    torch.testing.assert_close(cast.logits, out.logits.float(), rtol=0, atol=0)


def test_model_output_without_its_first_field():
    cast = _cast(_model_output(logits=_h(2, 3)))
    assert list(cast.keys()) == ["logits"] and cast.loss is None and cast.logits.dtype == f32


def test_defaultdict_keeps_its_default_factory():
    data = collections.defaultdict(list, {"x": _h(2), "y": [_h(1)]})
    cast = _cast(data)
    assert type(cast) is collections.defaultdict and cast.default_factory is list
    assert cast["x"].dtype == f32 and cast["y"][0].dtype == f32
    assert cast["missing"] == []


@pytest.mark.parametrize(
    "mapping",
    [collections.OrderedDict, types.MappingProxyType, lambda d: collections.Counter(d)],
    ids=["OrderedDict", "MappingProxyType", "Counter"],
)
def test_other_mappings_keep_their_type(mapping):
    data = mapping({"a": _h(2), "b": 1})
    cast = _cast(data)
    assert type(cast) is type(data) and cast["a"].dtype == f32 and cast["b"] == 1


def test_a_dict_subclass_with_its_own_constructor_is_copied_and_filled():
    data = Keyword(tag="t")
    data["a"] = _h(2)
    cast = _cast(data)
    assert type(cast) is Keyword and cast.tag == "t" and cast["a"].dtype == f32 and data["a"].dtype == HALF


def test_dataclasses_keep_their_type_and_nested_values_are_cast():
    out = Output(_h(2), extra={"pair": Pair(_h(1), _h(1))}, count=5)
    cast = _cast(out)
    assert type(cast) is Output and cast.count == 5 and cast.derived == 10
    assert cast.logits.dtype == f32
    assert type(cast.extra["pair"]) is Pair and {t.dtype for t in cast.extra["pair"]} == {f32}
    frozen = _cast(Frozen(_h(3)))
    assert type(frozen) is Frozen and frozen.hidden.dtype == f32


def test_inputs_are_cast_to_half_in_the_same_containers():
    amp = Amp("O2", half_dtype=HALF)
    data = {"batch": Output(torch.randn(2)), "masks": collections.defaultdict(int, {"m": torch.ones(2)})}
    cast = amp.cast_inputs(data)
    assert cast["batch"].logits.dtype == HALF and type(cast["masks"]) is collections.defaultdict
    assert cast["masks"]["m"].dtype == HALF and cast["masks"].default_factory is int


def test_dataclass_types_are_left_alone():
    assert _cast(Output) is Output


# --- through the adapters -------------------------------------------------------------------------------------------
class _Net(nn.Module):
    """Returns its logits in the container that ``kind`` names."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> Any:
        logits = self.linear(x)
        if self.kind == "model_output":
            return _model_output(logits=logits)
        if self.kind == "defaultdict":
            return collections.defaultdict(list, logits=logits)
        return Output(logits)


KINDS = ["model_output", "defaultdict", "dataclass"]


def _check(out: Any, kind: str) -> None:
    expected = {"model_output": "SequenceClassifierOutput", "defaultdict": "defaultdict", "dataclass": "Output"}
    assert type(out).__name__ == expected[kind]
    logits = out["logits"] if kind == "defaultdict" else out.logits
    assert logits.dtype == f32


@pytest.mark.parametrize("kind", KINDS)
def test_lightning_o2_boundary_keeps_the_output_type(kind):
    pl = pytest.importorskip("lightning.pytorch")
    from lightning_mpx import MixedPrecisionPlugin

    from .lightning_helpers import make_trainer

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _Net(kind)
            self.outputs: list[Any] = []

        def forward(self, x: torch.Tensor) -> Any:
            return self.net(x)

        def predict_step(self, batch: Any, batch_idx: int) -> Any:
            out = self(batch[0])
            self.outputs.append(out)
            self.weight_dtype = self.net.linear.weight.dtype
            return out

    module = Module()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(2, 4)), batch_size=2)
    make_trainer(MixedPrecisionPlugin("O2", half_dtype=HALF)).predict(module, data)
    assert module.weight_dtype == HALF  # (the stage gives the FP32 model back when it ends)
    _check(module.outputs[0], kind)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_accelerate_outputs_keep_their_type(kind):
    from lightning_mpx.integrations.accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="O2")
    model = accelerator.prepare(_Net(kind))
    _check(model(torch.randn(2, 4)), kind)


# --- the exact-type fast paths against a reference walk ---------------------------------------------------------------
def _reference_cast(data: Any, dtype: torch.dtype, castable: tuple[torch.dtype, ...]) -> Any:
    """torch's own pytree walk (tuples, lists, dicts), casting the tensors of a ``castable`` dtype."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in castable else t, data)


def _same(got: Any, want: Any, given: Any) -> None:
    assert type(got) is type(want)
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got.float(), want.float())
        assert (got is given) == (want is given)  # a tensor left as it is stays the same object
        return
    if isinstance(want, (tuple, list, dict)):
        assert got is not given or got == ()  # a fresh container, as the general path builds (() is one object)
        keys = list(want) if isinstance(want, dict) else range(len(want))
        assert (list(got) if isinstance(got, dict) else len(got)) == (keys if isinstance(want, dict) else len(want))
        for key in keys:
            _same(got[key], want[key], given[key])
        return
    assert got is given


def test_exact_containers_cast_as_a_reference_walk():
    from lightning_mpx.common.containers import _cast_collection

    param = nn.Parameter(torch.randn(2))
    data = (
        (torch.randn(2), torch.randn(2).double(), _h(2)),
        {"x": torch.arange(3), "nested": [torch.randn(2), {"deep": (torch.randn(1),)}, 4, None], "p": param},
        {},
        [],
        (),
        "text",
    )
    for dtype, castable in ((HALF, (f32, torch.float64)), (f32, (HALF,))):
        _same(_cast_collection(data, dtype, castable), _reference_cast(data, dtype, castable), data)
        assert type(_cast_collection(data, dtype, castable)[1]["p"]) is (nn.Parameter if castable == (HALF,) else
                                                                         torch.Tensor)


def test_boundary_hooks_fast_paths_cast_as_the_general_path():
    from lightning_mpx.casting.boundary import BoundaryCast

    module = nn.Linear(2, 2).to(HALF)
    (hook,) = BoundaryCast.for_model([module], HALF)
    for given in (torch.randn(2), torch.randn(2).double(), _h(2), torch.arange(2), nn.Parameter(torch.randn(2))):
        args, kwargs = hook.pre(module, (given,), {})
        assert kwargs == {} and len(args) == 1
        _same(args[0], _reference_cast(given, HALF, (f32, torch.float64)), given)
        out = hook.post(module, args, args[0])
        _same(out, _reference_cast(args[0], f32, (HALF,)), args[0])
    args, _ = hook.pre(module, (torch.randn(2), torch.randn(2)), {"y": torch.randn(2)})
    assert [a.dtype for a in args] == [HALF, HALF]
    hook.post(module, args, None)
