"""Bad input must fail early with a clear error naming the offending module, dimension, argument or degree."""

import pytest
import torch

from partitioner import InputError, MeshError, PartitionError, PartitionWarning, TraceError, partition
from partitioner.testing import TINY_H3, h3_inputs, run_ranks, tiny_h3


@pytest.fixture(scope="module")
def h3():
    return tiny_h3(), h3_inputs(TINY_H3)


class Scaled(torch.nn.Module):
    """A Linear whose forward takes a non-tensor argument (export specialises on it)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, scale: float = 1.0):
        return self.lin(x) * scale


class DataDependent(Scaled):
    def forward(self, x, scale: float = 1.0):
        if self.lin(x).sum() > 0:  # a branch on an activation (a branch on an input alone is a guard)
            return self.lin(x)
        return x


class MutatesBuffer(Scaled):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x, scale: float = 1.0):
        self.calls.add_(1)
        return self.lin(x)


# --- the mesh --------------------------------------------------------------------------------------------------

def test_unknown_mesh_dim_name(h3):
    """An unknown dim name is a MeshError naming it and the allowed names."""
    with pytest.raises(MeshError, match=r"'pp'.*\['tp', 'ring', 'ulysses', 'dp', 'cfg'\]"):
        partition(h3[0], {"pp": 2}, ((), h3[1]))


@pytest.mark.parametrize("size", [0, -1])
def test_mesh_axis_size_below_one(h3, size):
    """Axis sizes below 1 are refused, showing the mesh given."""
    with pytest.raises(MeshError, match=rf">= 1.*'tp': {size}"):
        partition(h3[0], {"tp": size}, ((), h3[1]))


@pytest.mark.parametrize("size", [2.5, "two"])
def test_mesh_axis_size_not_an_integer(h3, size):
    """A non-integer axis size is a MeshError naming the axis."""
    with pytest.raises(MeshError, match="'tp'"):
        partition(h3[0], {"tp": size}, ((), h3[1]))


@pytest.mark.parametrize("rank", [2, -1])
def test_rank_outside_mesh(h3, rank):
    """A rank outside the planning mesh is a MeshError naming the rank and the mesh size."""
    with pytest.raises(MeshError, match=rf"rank {rank} is outside .* 2 ranks"):
        partition(h3[0], {"tp": 2}, ((), h3[1]), rank=rank)


def test_strided_ulysses_groups_rejected(h3):
    """Ulysses outside the innermost axis makes strided all-to-all groups: refused, naming them and the order."""
    with pytest.raises(MeshError, match=r"strided all-to-all groups \[\[0, 2, 4, 6\], \[1, 3, 5, 7\]\].*"
                                        r"\('tp', 'ulysses'\)"):
        partition(h3[0], {"ulysses": 4, "tp": 2}, ((), h3[1]))


def test_ulysses_degree_above_head_count(h3):
    """A Ulysses degree above every attention's head count leaves the attentions whole (exact), warns that the
    axis is wasted, and explain() names the module and both sizes."""
    with pytest.warns(PartitionWarning, match=r"ulysses=8 shards none of the 3 attentions.* 4 attention heads.*smaller degree"):
        partitioned = partition(h3[0], {"ulysses": 8}, ((), h3[1]))
    assert "4 attention heads cannot be spread over a ulysses degree of 8 (at most 4)" in \
        partitioned.explain("token_refiner.refiner_blocks.0.attn")
    assert partitioned.collective_counts()[("all_to_all", "ulysses")] == 0


def test_ulysses_degree_above_sequence_length():
    """A Ulysses degree above the packed length leaves the attention whole, and the warning names the length."""
    model = tiny_h3(num_attention_heads=8)
    inputs = h3_inputs(TINY_H3, text=1, video=2, audio=1)
    with pytest.warns(PartitionWarning, match=r"sequence of 4 rows cannot be spread over a ulysses degree of 8"):
        partition(model, {"ulysses": 8}, ((), inputs))


def test_mesh_of_wrong_type(h3):
    """A mesh that is neither a DeviceMesh nor a mapping is a MeshError naming the type."""
    with pytest.raises(MeshError, match="DeviceMesh.*got list"):
        partition(h3[0], [2], ((), h3[1]))


# --- the model and its heads -----------------------------------------------------------------------------------

def test_tp_degree_above_heads(h3):
    """tp=6 on 4 heads is a PartitionError naming the attention, 4 heads, degree 6, the largest degree (4) and
    meshes that use the other devices (tp=3 divides 6)."""
    with pytest.raises(PartitionError) as error:
        partition(h3[0], {"tp": 6}, ((), h3[1]))
    message = str(error.value)
    assert ".attn:" in message
    assert "4 attention heads" in message and "degree of 6" in message and "largest tp degree is 4" in message
    assert all(f"{{'tp': 3, '{axis}': 2}}" in message for axis in ("ulysses", "ring", "dp"))


def test_tp_degree_error_names_attention_module_exactly(h3):
    """The head-count error names the attention module itself (the first the planner meets)."""
    with pytest.raises(PartitionError, match=r"^[\w.]+\.attn: 4 attention heads") as error:
        partition(h3[0], {"tp": 5}, ((), h3[1]))
    module = str(error.value).split(":")[0]
    assert isinstance(h3[0].get_submodule(module), torch.nn.Module)


def test_untraceable_model():
    """Data-dependent control flow is a TraceError naming the model class, chained to export's error."""
    with pytest.raises(TraceError, match="could not trace DataDependent") as error:
        partition(DataDependent(), {"tp": 2}, ((torch.randn(2, 8),), {}))
    assert error.value.__cause__ is not None


def test_model_mutating_a_buffer():
    """A forward that mutates a buffer is a TraceError naming the buffer."""
    with pytest.raises(TraceError, match="mutates.*calls"):
        partition(MutatesBuffer(), {"tp": 2}, ((torch.randn(2, 8),), {}))


# --- example inputs --------------------------------------------------------------------------------------------

def test_unknown_keyword(h3):
    """An unknown kwarg is a TraceError showing forward's signature and the kwarg."""
    with pytest.raises(TraceError, match=r"MiniMaxH3Transformer3DModel\.forward\(hidden_states.*'bogus'"):
        partition(h3[0], {"tp": 2}, ((), {**h3[1], "bogus": 1}))


def test_missing_required_argument(h3):
    """A missing required argument is a TraceError naming it."""
    inputs = {k: v for k, v in h3[1].items() if k != "hidden_states"}
    with pytest.raises(TraceError, match=r"forward\(.*missing a required argument: 'hidden_states'"):
        partition(h3[0], {"tp": 2}, ((), inputs))


@pytest.mark.parametrize("bad", ["kwargs-only", "one-tuple", "kwargs-list"])
def test_example_inputs_not_a_pair(h3, bad):
    """example_inputs that are not an (args, kwargs) pair are a TraceError saying so."""
    example = {"kwargs-only": h3[1], "one-tuple": (h3[1],), "kwargs-list": ((), list(h3[1].values()))}[bad]
    with pytest.raises(TraceError, match=r"pair \(args, kwargs\)"):
        partition(h3[0], {"tp": 2}, example)


def test_example_args_a_tensor_not_a_tuple():
    """A tensor given where the args tuple belongs is a TraceError, not a silent unbinding of its rows."""
    with pytest.raises(TraceError, match=r"example_inputs\[0\] must be a tuple or list of positional arguments"):
        partition(Scaled(), {"tp": 1}, (torch.randn(1, 8), {}))


def test_forward_raising_keeps_model_message(h3):
    """A forward that raises on the inputs is a TraceError carrying the model's own message."""
    inputs = dict(h3[1], position_ids=h3[1]["position_ids"][:, :2])
    with pytest.raises(TraceError, match=r"MiniMaxH3Transformer3DModel.*ValueError.*`position_ids` must be a "
                                         r"`\(seq_len, 3\)` tensor, got \[23, 2\]"):
        partition(h3[0], {"tp": 2}, ((), inputs))


# --- plan overrides and compile --------------------------------------------------------------------------------

def test_plan_unknown_style(h3):
    """An unknown style is a PartitionError naming the entry, the style and the valid ones."""
    with pytest.raises(PartitionError, match=r"'proj_in'.*'diagonal'.*colwise.*rowwise.*replicate"):
        partition(h3[0], {"tp": 2}, ((), h3[1]), plan={"proj_in": "diagonal"})


def test_plan_pattern_matching_no_linear(h3):
    """A pattern matching no Linear (here an attention module) is a PartitionError naming the pattern."""
    with pytest.raises(PartitionError, match=r"'transformer_blocks\.\*\.attn' matches no Linear"):
        partition(h3[0], {"tp": 2}, ((), h3[1]), plan={"transformer_blocks.*.attn": "colwise"})


def test_compile_planning_partition(h3):
    """A partition planned on axis sizes cannot compile: it needs a DeviceMesh."""
    planned = partition(h3[0], {"tp": 2}, ((), h3[1]))
    with pytest.raises(RuntimeError, match="axis sizes.*DeviceMesh"):
        planned.compile()


# --- calling a compiled partition (one gloo rank) --------------------------------------------------------------

def _caught(call):
    try:
        call()
    except Exception as error:  # noqa: BLE001 - reported to the parent by type name and message
        return type(error).__name__, str(error)
    return None, "no error"


def _call_compiled(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    inputs = h3_inputs(TINY_H3)
    compiled = partition(tiny_h3(), mesh, ((), inputs)).compile()
    as_dict = compiled(**inputs)
    as_tuple = compiled(**inputs, return_dict=False)
    scaled_model = Scaled()
    scaled = partition(scaled_model, mesh, ((torch.randn(2, 8),), {"scale": 2.0})).compile()
    unnamed = init_device_mesh("cpu", (1,))
    x = torch.randn(2, 8)
    return {
        "shape": _caught(lambda: compiled.program(**dict(inputs, hidden_states=torch.randn(1, 10, 16)))),
        "constant": _caught(lambda: scaled.program(x, scale=3.0)),
        "structure": _caught(lambda: compiled.program(**inputs, attention_kwargs={"scale": 1.0})),
        # the drop-in module serves other constants and structures with a specialisation; a call the model cannot
        # run is still a named error
        "served_constant": torch.allclose(scaled(x, scale=3.0), scaled_model(x, scale=3.0), rtol=1e-6, atol=1e-6),
        "unservable": _caught(lambda: compiled(**dict(inputs, hidden_states=torch.randn(1, 12, 8)))),
        "missing": _caught(lambda: compiled(**{k: v for k, v in inputs.items() if k != "timestep"})),
        "unnamed_mesh": _caught(lambda: partition(Scaled(), unnamed, ((torch.randn(2, 8),), {}))),
        "tuple_type": type(as_tuple).__name__,
        "tuple_equal": len(as_tuple) == len(as_dict.to_tuple())
        and all(torch.equal(a, b) for a, b in zip(as_tuple, as_dict.to_tuple())),
        "fields_equal": [torch.equal(as_tuple[0], as_dict.sample), torch.equal(as_tuple[1], as_dict.audio_sample)],
    }


@pytest.fixture(scope="module")
def called():
    return run_ranks(1, _call_compiled)[0]


def test_call_with_wrong_shape(called):
    """A hidden_states of another length is an InputError naming the argument and both shapes."""
    kind, message = called["shape"]
    assert kind == InputError.__name__
    assert "hidden_states" in message and "[1, 10, 16]" in message and "[1, 12, 16]" in message


def test_the_drop_in_serves_other_constants_and_names_calls_it_cannot_serve(called):
    """The module compile() returns traces again for another constant; a call the model itself cannot run (8 patch
    channels where proj_in takes 16) is an InputError naming the argument, both shapes and the trace's reason."""
    assert called["served_constant"]
    kind, message = called["unservable"]
    assert kind == InputError.__name__
    assert "hidden_states[1, 12, 8]" in message and "hidden_states[1, 12, 16]" in message and "traced" in message


def test_call_with_changed_constant(called):
    """A non-tensor argument differing from the traced one is an InputError naming it and both values."""
    kind, message = called["constant"]
    assert kind == InputError.__name__
    assert "scale" in message and "3.0" in message and "2.0" in message


def test_return_dict_false(called):
    """return_dict=False returns a tuple equal to the return_dict=True output's fields."""
    assert called["tuple_type"] == "tuple" and called["tuple_equal"] and called["fields_equal"] == [True, True]


def test_device_mesh_without_dim_names(called):
    """A DeviceMesh without mesh_dim_names is a MeshError showing how to name its dims."""
    kind, message = called["unnamed_mesh"]
    assert kind == MeshError.__name__ and "mesh_dim_names" in message and "'tp'" in message


def test_call_with_changed_structure_names_argument(called):
    """attention_kwargs given where None was traced is an InputError naming attention_kwargs."""
    kind, message = called["structure"]
    assert kind == InputError.__name__ and "attention_kwargs" in message and "TreeSpec" not in message


def test_call_missing_argument(called):
    """A call missing a required argument is an InputError naming it."""
    kind, message = called["missing"]
    assert kind == InputError.__name__ and "'timestep'" in message


def test_a_failure_inside_a_pass_names_the_pass_the_node_and_the_model_line(monkeypatch):
    """A raw exception raised deep inside a pass (a bug of ours) reaches the user as an InvariantError naming the
    pass, the node it was working on, the node's op and the model's source line, never as a bare builtin."""
    from partitioner.errors import InvariantError
    from partitioner.passes import localize

    def broken(node, mesh):
        if node.target is torch.ops.aten.linear.default:
            raise RuntimeError("Attempting to broadcast a dimension of length 32")

    monkeypatch.setattr(localize, "_localize_sizes", broken)
    with pytest.raises(InvariantError, match=r"pass localize failed at linear\w* \(linear\.default, from "
                                             r"\w+\.py:\d+ in \w+.*\): RuntimeError: Attempting to broadcast"):
        partition(tiny_h3(), {"tp": 2}, ((), h3_inputs(TINY_H3)))


class _LayerCache:
    """A key/value cache object, as GlmImage, SanaWM-LTX2's refiner and WanAnimate 2 take: its tensors are inputs."""

    def __init__(self):
        self.keys = [torch.zeros(1, 2, 4)]


class _SlottedCache:
    """One with no attribute dict to flatten (``__slots__``)."""
    __slots__ = ("keys",)

    def __init__(self):
        self.keys = [torch.zeros(1, 2, 4)]


class _CachedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x, kv_cache=None):
        keys = x if kv_cache is None else torch.cat([kv_cache.keys[0], x], 1)
        return self.proj(keys)


def test_a_state_object_argument_is_named_with_what_to_do():
    """Was: export's "Unsupported input type" with no argument named. A plain object's tensors are inputs
    (tests/test_state_objects.py); one that cannot be flattened is named; the uncached call partitions."""

    x = torch.randn(1, 3, 4)
    with pytest.raises(TraceError, match=r"argument 'kv_cache' is a .*_SlottedCache, which torch.export cannot "
                                         r"take.*kv_cache=None"):
        partition(_CachedModel(), {"tp": 2}, ((), dict(x=x, kv_cache=_SlottedCache())))
    partition(_CachedModel(), {"tp": 2}, ((), dict(x=x, kv_cache=_LayerCache())))
    partition(_CachedModel(), {"tp": 2}, ((), dict(x=x)))
