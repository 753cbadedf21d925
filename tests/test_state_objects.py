"""A key/value cache object as a forward argument (GlmImage, SanaWM-LTX2's refiner, WanAnimate 2): its tensors are
graph inputs, its mode a constant every call is compared with, and what the forward writes into it (WanAnimate 2's
"extract" pass fills it) reaches the caller's object after the call, as eagerly: every rank against the model."""

import copy

import pytest
import torch
from torch import nn

import partitioner
from partitioner.errors import TraceError
from partitioner.testing import run_ranks


class LayerCache:
    """One layer's cache: "write" stores this call's keys and values, "read" attends to them before its own."""

    def __init__(self, mode=None):
        self.mode, self.keys, self.values = mode, [], []


class Cache:
    def __init__(self, layers: int, mode=None):
        self.layers = [LayerCache(mode) for _ in range(layers)]

    def set_mode(self, mode):
        for layer in self.layers:
            layer.mode = mode


class CachedAttention(nn.Module):
    def __init__(self, heads: int = 4, head_dim: int = 8, layers: int = 2):
        super().__init__()
        self.heads, width = heads, heads * head_dim
        self.qkv = nn.ModuleList(nn.Linear(width, 3 * width) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x, cache=None):
        b, n, width = x.shape
        for i, (qkv, out) in enumerate(zip(self.qkv, self.out)):
            q, k, v = qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            layer = cache.layers[i] if cache is not None else None
            if layer is not None and layer.mode == "write":
                layer.keys.append(k)
                layer.values.append(v)
            elif layer is not None and layer.mode == "read":
                k, v = torch.cat(layer.keys + [k], 2), torch.cat(layer.values + [v], 2)
            y = nn.functional.scaled_dot_product_attention(q, k, v)
            x = x + out(y.transpose(1, 2).reshape(b, n, width))
        return x


def _ranks(rank, world, axis: str, write_back: bool):
    from torch.distributed.device_mesh import init_device_mesh

    from partitioner.frontend import state_objects
    from partitioner.runtime import program

    if not write_back:  # the negative control: the forward's writes never reach the caller's cache
        program.write_back = lambda named, writes, written: None
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(axis,))
    torch.manual_seed(0)
    model, x, later = CachedAttention().eval(), torch.randn(1, 10, 32), torch.randn(1, 6, 32)
    with torch.no_grad():
        expected_cache = Cache(2, "write")
        written = model(x, expected_cache)
        expected_cache.set_mode("read")
        expected = model(later, expected_cache)

        cache = Cache(2, "write")
        module = partitioner.partition(model, mesh, ((x, copy.deepcopy(cache)), {})).compile()
        first = module(x, cache)
        filled = [len(layer.keys) for layer in cache.layers]
        if filled != [1, 1]:
            return dict(filled=filled)
        cache.set_mode("read")  # another mode, other constants: the module traces again, as for a new shape
        second = module(later, cache)
        reading = partitioner.partition(model, mesh, ((later, cache), {}))
        # layer caches held in a tuple: written in place (the caller's references into it stay valid)
        x, in_tuple, eager = torch.randn(2, 3), _TupleCache(), _TupleCache()
        layers = in_tuple.layers
        _Scaled()(x, cache=eager)
        partitioner.partition(_Scaled(), mesh, ((x,), dict(cache=copy.deepcopy(in_tuple)))).compile()(x, cache=in_tuple)
        tuple_written = in_tuple.layers is layers and all(
            len(a.keys) == 1 and torch.equal(a.keys[0], b.keys[0]) for a, b in zip(layers, eager.layers))
    keys = max((a - b).abs().max().item() for a, b in zip(
        [t for layer in cache.layers for t in layer.keys + layer.values],
        [t for layer in expected_cache.layers for t in layer.keys + layer.values]))
    return dict(filled=filled, written=(first - written).abs().max().item(), keys=keys,
                read=(second - expected).abs().max().item(), styles=dict(reading.linear_styles),
                counts=dict(reading.collective_counts()), tuple_written=tuple_written,
                registered=LayerCache in state_objects._OURS)


@pytest.mark.slow
def test_a_cache_the_forward_fills_then_reads_is_exact_on_every_rank():
    """tp=2 and ulysses=2: the "write" call stores every layer's keys and values (gathered back whole into the
    caller's cache), the "read" call (the same module: it traces again for the other mode) attends over the stored
    rows and its own: both exact (float32 sums in another order: 1e-5), its projections split. Layer caches held in
    a tuple are written in place. Without the write-back the caller's cache stays empty (the control): the next call
    would read nothing."""
    for axes in ("tp", "ulysses"):
        for outcome in run_ranks(2, _ranks, axes, True):
            assert outcome["filled"] == [1, 1] and outcome["registered"] and outcome["tuple_written"], outcome
            assert max(outcome["written"], outcome["keys"], outcome["read"]) < 1e-5, (axes, outcome)
            if axes == "tp":
                assert all(style.startswith(("colwise", "rowwise")) for style in outcome["styles"].values())
            else:
                assert outcome["counts"].get(("all_to_all", "ulysses"), 0) >= 4, outcome["counts"]
    assert all(outcome["filled"] == [0, 0] for outcome in run_ranks(2, _ranks, "tp", False))


class _Options(dict):
    """A dict subclass: its items are not in its attribute dict (taken apart as an object, it would look empty)."""


class _Scaled(nn.Module):
    def forward(self, x, options=None, cache=None):
        scale = options.get("scale", 1.0) if options is not None else 1.0
        if cache is not None:
            for layer in cache.layers:
                if layer.mode == "write":
                    layer.keys.append(x * 2)
        return x * scale


def test_what_a_traced_call_cannot_rebuild_is_refused_by_name():
    """A dict subclass (its items outside its attribute dict: taken apart it would trace as empty, the scale lost),
    an object reached twice (rebuilt as two: a write into one lost to the other), a cycle, an attribute export
    cannot take (a lock): each a TraceError naming the argument, and nothing registered for the refused object."""
    import threading

    from partitioner.frontend import state_objects

    x = torch.randn(2, 3)
    with pytest.raises(TraceError, match=r"argument 'options' is a .*_Options"):
        partitioner.partition(_Scaled(), {"tp": 2}, ((x,), dict(options=_Options(scale=3.0))))
    shared = LayerCache("write")
    cache = Cache(0)
    cache.layers = [shared, shared]
    with pytest.raises(TraceError, match=r"argument cache.layers\[1\] is an object the call reaches twice"):
        partitioner.partition(_Scaled(), {"tp": 2}, ((x,), dict(cache=cache)))
    cache = Cache(1)
    cache.layers[0].owner = cache
    with pytest.raises(TraceError, match=r"argument cache.layers\[0\].owner refers back .* \(a cycle\)"):
        partitioner.partition(_Scaled(), {"tp": 2}, ((x,), dict(cache=cache)))

    class Locked:
        def __init__(self):
            self.layers, self.lock = [], threading.Lock()

    with pytest.raises(TraceError, match=r"argument cache \(a .*Locked\) holds at cache.lock a _thread.lock"):
        partitioner.partition(_Scaled(), {"tp": 2}, ((x,), dict(cache=Locked())))
    assert Locked not in state_objects._OURS


class _TupleCache:
    def __init__(self):
        self.layers = (LayerCache("write"), LayerCache("write"))
