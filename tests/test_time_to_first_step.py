"""What partitioning, loading and compiling cost before the first step (issue 36), and that every shortcut taken for
it is exact: a repeated block's values and schedule are taken from an identical block's only when they are the
ones it would get itself.

The timing test is a regression guard with a generous bound (this machine's noise is tens of percent under load);
the targets themselves are measured side by side by benchmarks/partition_time.py and benchmarks/first_step.py.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import partitioner
from partitioner.frontend.trace import copy_graph_module, trace
from partitioner.passes import regions
from partitioner.runtime.module import first_step_line
from partitioner.testing import TINY_H3, fake_mesh, h3_inputs, tiny_h3


def _shapes(gm):
    return {node.name: (tuple(node.meta["val"].shape), node.meta["val"].stride(), node.meta["val"].dtype)
            for node in gm.graph.nodes if isinstance(node.meta.get("val"), torch.Tensor)}


def _propagate(gm, propagate):
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        inputs = [torch.empty_strided(n.meta["val"].shape, n.meta["val"].stride(), dtype=n.meta["val"].dtype)
                  if isinstance(n.meta.get("val"), torch.Tensor) else n.meta.get("val")
                  for n in gm.graph.nodes if n.op == "placeholder"]
    propagate(gm, mode, inputs)
    return _shapes(gm)


def test_repeated_blocks_take_an_identical_blocks_values(monkeypatch):
    """Every node's fake value equals whole-graph FakeTensorProp's, node for node; all blocks but the first of
    each kind are copied, not propagated."""
    gm = trace(tiny_h3(num_layers=5), ((), h3_inputs(TINY_H3))).graph_module
    expected = _propagate(copy_graph_module(gm), lambda g, m, i: FakeTensorProp(g, m).propagate_dont_convert_inputs(*i))
    copied = []
    run_node = regions._RepeatedBlockProp.run_node

    def recording(self, n):
        if n in self.copy_from:
            copied.append(n)
        return run_node(self, n)

    monkeypatch.setattr(regions._RepeatedBlockProp, "run_node", recording)
    assert _propagate(gm, regions.propagate_fake_values) == expected
    blocks = {regions.repeated_block(n) for n in copied}
    assert "transformer_blocks.0" not in blocks and {f"transformer_blocks.{i}" for i in range(1, 5)} <= blocks


def test_a_block_with_other_input_strides_is_propagated_on_its_own(monkeypatch):
    """Negative control: the copy is keyed on its inputs' metadata. Block 1 fed its input laid out in another
    order (same shape, other strides) gets its own values, not block 0's, and they are FakeTensorProp's."""
    gm = trace(tiny_h3(num_layers=3), ((), h3_inputs(TINY_H3))).graph_module
    run = next(run for run in regions.runs_of_blocks(gm.graph.nodes)
               if regions.repeated_block(run[0]) == "transformer_blocks.1")
    _, external = regions.code_of(run)
    source = max((n for n in external if isinstance(n.meta.get("val"), torch.Tensor)),
                 key=lambda n: (n.meta["val"].dim(), n.meta["val"].numel()))
    aten = torch.ops.aten
    with gm.graph.inserting_after(source):  # x.mT.contiguous().mT: the same values, column-major
        flipped = gm.graph.call_function(aten.transpose.int, (source, -1, -2))
    with gm.graph.inserting_after(flipped):
        copied = gm.graph.call_function(aten.clone.default, (flipped,), {"memory_format": torch.contiguous_format})
    with gm.graph.inserting_after(copied):
        back = gm.graph.call_function(aten.transpose.int, (copied, -1, -2))
    for user in [u for u in source.users if u in set(run)]:
        user.replace_input_with(source, back)
    expected = _propagate(copy_graph_module(gm), lambda g, m, i: FakeTensorProp(g, m).propagate_dont_convert_inputs(*i))
    copied_blocks = {}
    match = regions._RepeatedBlockProp._match

    def recording(self, run_):
        match(self, run_)
        copied_blocks[regions.repeated_block(run_[0])] = any(n in self.copy_from for n in run_)

    monkeypatch.setattr(regions._RepeatedBlockProp, "_match", recording)
    assert _propagate(gm, regions.propagate_fake_values) == expected
    assert copied_blocks["transformer_blocks.1"] is False and copied_blocks["transformer_blocks.2"] is True


def test_schedule_of_identical_blocks_is_the_schedule_each_would_get():
    """schedule_collectives schedules one block of each kind and gives its order to the identical ones: the same
    order as scheduling every block on its own (checked on a profile where collectives do move)."""
    from partitioner.passes import schedule_collectives

    model, inputs = tiny_h3(num_layers=4), h3_inputs(TINY_H3)
    orders = {}
    for memo in (True, False):
        key = schedule_collectives.schedule_key
        if not memo:  # every run its own key: scheduled on its own
            schedule_collectives.schedule_key = lambda run, *_: id(run[0])
        try:
            with fake_mesh((2, 2), ("tp", "ulysses"), 0) as mesh:
                partitioned = partitioner.partition(model, mesh, ((), inputs), overlap={"profile": "h100-nvlink"})
        finally:
            schedule_collectives.schedule_key = key
        orders[memo] = [node.name for node in partitioned.graph_module.graph.nodes]
    assert orders[True] == orders[False]
    original = [n.name for n in trace(model, ((), inputs)).graph_module.graph.nodes]
    assert orders[True] != sorted(orders[True], key=lambda name: original.index(name) if name in original else -1)


def test_partition_stays_near_export_time():
    """Regression guard: partitioning a 12-block model at TP=2 x Ulysses=2 costs at most 2.5x torch.export of it
    (measured 1.3-1.6x on this machine; issue 36's target is 1.5x at full size, see benchmarks/partition_time.py)."""
    model, inputs = tiny_h3(num_layers=12), h3_inputs(TINY_H3)
    trace(model, ((), inputs))  # warm

    def export():
        with torch.no_grad():
            torch.export.export(model, (), kwargs=inputs)

    def partition():
        with fake_mesh((2, 2), ("tp", "ulysses"), 0) as mesh:
            partitioner.partition(model, mesh, ((), inputs))

    times = {}
    for name, fn in (("export", export), ("partition", partition)) * 2:
        start = time.perf_counter()
        fn()
        times[name] = min(times.get(name, float("inf")), time.perf_counter() - start)
    print(f"partition / export: {times['partition'] / times['export']:.2f}")
    assert times["partition"] <= 2.5 * times["export"], times


def test_first_step_line_is_logged_with_its_parts(tmp_path):
    """The drop-in module's first call logs the time to first step with partition (trace, passes), load_weights,
    compile and the first call; later calls log nothing."""
    from partitioner.testing import run_ranks

    [result] = run_ranks(1, _first_step, str(tmp_path))
    line = result["line"]
    for part in ("time to first step", "partition", "trace", "passes", "load_weights", "compile", "first call"):
        assert part in line, line
    total = float(line.split("time to first step ")[1].split(" s")[0])
    assert total == pytest.approx(sum(result["seconds"][k] for k in ("partition", "load_weights", "compile",
                                                                        "first call")), abs=0.1)
    assert result["logged"] == [line]


def _first_step(rank: int, world: int, folder: str) -> dict:
    from accelerate import init_empty_weights
    from torch.distributed.device_mesh import init_device_mesh

    model, inputs = tiny_h3(), h3_inputs(TINY_H3)
    model.save_pretrained(folder)
    with init_empty_weights():  # parameters on meta, buffers real: read shard by shard from the folder
        empty = type(model).from_config(model.config)
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage().split(": ", 1)[1])
    logging.getLogger("partitioner").addHandler(handler)
    logging.getLogger("partitioner").setLevel(logging.INFO)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    partitioned = partitioner.partition(empty, mesh, ((), inputs)).load_weights(folder)
    module = partitioned.compile("eager")
    with torch.no_grad():
        out = module(**inputs, return_dict=False)
        module(**inputs, return_dict=False)
        expected = model(**inputs, return_dict=False)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    logged = [m for m in logged if m.startswith("time to first step")]
    return dict(line=module.first_step, seconds=dict(partitioned.seconds), logged=logged)


def test_first_step_line_leaves_out_missing_parts():
    line = first_step_line({"partition": 2.0, "trace": 1.5, "first call": 0.25})
    assert line == "time to first step 2.2 s = partition 2.0 s (trace 1.5 s) + first call 0.2 s"
