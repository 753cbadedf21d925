"""Pass-by-pass dumps, Partitioned.report() and explain(), checked against numbers derived from the model itself."""

import re
from collections import Counter

import pytest
import torch

from partitioner import partition
from partitioner.testing import TINY_H3, h3_inputs, tiny_h3

PASSES = ["00_export", "01_hoist_host", "02_pad_inputs", "03_gather_scatters", "04_fold_conv_padding",
          "05_pointwise_convs", "06_matmul_as_linear", "07_annotate_heads", "08_plan_sharding", "09_plan_sequence",
          "10_plan_batch", "11_plan_tp_sequence", "12_insert_collectives", "13_collective_kernels", "14_localize",
          "15_chunk_reductions", "16_schedule_collectives"]
TP = 2


@pytest.fixture(scope="module")
def model():
    return tiny_h3()


@pytest.fixture(scope="module")
def dumped(model, tmp_path_factory):
    """A tp=2 partition of tiny H3 and the directory its passes were dumped to."""
    directory = tmp_path_factory.mktemp("dump")
    return partition(model, {"tp": TP}, ((), h3_inputs(TINY_H3)), dump_dir=directory), directory / "rank0"


def _rowwise(partitioned) -> list[str]:
    return [path for path, style in partitioned.linear_styles.items() if style == "rowwise"]


def _expect_files(directory):
    for stem in PASSES:
        suffixes = (".py", ".txt") if stem == PASSES[0] else (".py", ".txt", ".diff")
        for suffix in suffixes:
            assert (directory / f"{stem}{suffix}").is_file(), f"missing {stem}{suffix}"


# --- dumps -----------------------------------------------------------------------------------------------------

def test_dump_files_exist(dumped):
    """Every pass writes its code, summary and (after the first) diff."""
    _expect_files(dumped[1])
    assert not (dumped[1] / "00_export.diff").exists()


def test_dump_index_lists_the_passes_in_order(dumped):
    lines = (dumped[1] / "index.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in lines] == PASSES
    assert "collectives: none" in lines[0] and "all_reduce[tp]" in lines[-1]


def test_dumps_are_one_folder_per_rank_and_stable_between_runs(model, tmp_path):
    """Two runs of one rank dump identical text (no addresses, times or counters that move: ``diff -r`` is empty);
    two ranks of an uneven split dump into their own folders, whose programs differ where their shards do."""
    inputs = ((), h3_inputs(TINY_H3))
    for run in ("a", "b"):
        partition(model, {"tp": 3}, inputs, dump_dir=tmp_path / run)
    partition(model, {"tp": 3}, inputs, dump_dir=tmp_path / "a", rank=2)
    first, second = tmp_path / "a" / "rank0", tmp_path / "b" / "rank0"
    files = sorted(path.name for path in first.iterdir())
    assert files == sorted(path.name for path in second.iterdir()) and "plan.html" in files
    changed = [name for name in files if (first / name).read_bytes() != (second / name).read_bytes()]
    assert changed == []
    assert re.search(r"0x[0-9a-f]{6,}", "".join((first / name).read_text() for name in files)) is None
    last = "16_schedule_collectives.py"
    assert (first / last).read_text() != (tmp_path / "a" / "rank2" / last).read_text()  # 4 heads: 2 + 1 + 1


def test_plan_sharding_dump_has_placements(dumped):
    """The plan_sharding dump annotates values with `# tp=S(` placements; the export dump has none."""
    assert "# tp=S(" in (dumped[1] / "08_plan_sharding.py").read_text()
    assert "# tp=" not in (dumped[1] / "00_export.py").read_text()


def test_insert_collectives_diff_adds_all_reduces(dumped):
    """The insert_collectives diff adds one all_reduce per row-wise Linear, and removes none."""
    diff = (dumped[1] / "12_insert_collectives.diff").read_text().splitlines()
    added = [line for line in diff if line.startswith("+") and "_c10d_functional.all_reduce.default(" in line]
    removed = [line for line in diff if line.startswith("-") and "all_reduce" in line]
    assert len(added) == len(_rowwise(dumped[0])) > 0
    assert not removed


def test_summary_txt(dumped):
    """The summary has node count, collectives and per-rank parameter bytes, and agrees with the report."""
    partitioned, directory = dumped
    report = partitioned.report()
    final = (directory / "16_schedule_collectives.txt").read_text()
    assert f"nodes: {len(partitioned.graph_module.graph.nodes)}\n" in final
    assert f"collectives: all_reduce[tp] x{len(_rowwise(partitioned))}\n" in final
    assert f"parameter bytes per rank: {report.total_parameter_bytes} (float32=" in final
    export = (directory / "00_export.txt").read_text()
    full_bytes = sum(p.numel() * p.element_size() for p in tiny_h3().parameters())
    assert "collectives: none" in export and f"parameter bytes per rank: {full_bytes} " in export


def test_localize_dump_shows_per_rank_shapes(dumped, model):
    """After localize a q projection weight has rank shapes ([32, 48] of [64, 48] at tp=2); before, global ones."""
    out_features, in_features = model.transformer_blocks[0].attn.to_q.weight.shape
    name = "p_transformer_blocks_0_attn_to_q_weight"
    local = (dumped[1] / "14_localize.py").read_text()
    planned = (dumped[1] / "08_plan_sharding.py").read_text()
    assert f'{name}: "f32[{out_features // TP}, {in_features}]"' in local
    assert f'{name}: "f32[{out_features}, {in_features}]"' in planned


def test_partitioner_dump_environment_variable(model, tmp_path, monkeypatch):
    """$PARTITIONER_DUMP dumps like dump_dir."""
    monkeypatch.setenv("PARTITIONER_DUMP", str(tmp_path / "env"))
    partition(model, {"tp": TP}, ((), h3_inputs(TINY_H3)))
    _expect_files(tmp_path / "env" / "rank0")


def test_no_dump_without_dump_dir(model, tmp_path, monkeypatch):
    """Without dump_dir or $PARTITIONER_DUMP nothing is written."""
    monkeypatch.delenv("PARTITIONER_DUMP", raising=False)
    monkeypatch.chdir(tmp_path)
    partition(model, {"tp": TP}, ((), h3_inputs(TINY_H3)))
    assert not list(tmp_path.iterdir())


# --- report ----------------------------------------------------------------------------------------------------

def test_report_parameters(dumped, model):
    """Per-rank parameters: 1/tp of each sliced tensor, all of the others; those others are the replicated share."""
    partitioned = dumped[0]
    report = partitioned.report()
    params = dict(model.named_parameters())
    sliced = {name for name in partitioned.slice_specs if name in params}
    assert sliced, "tp=2 on tiny H3 slices some parameters"
    per_rank = sum(p.numel() // TP if name in sliced else p.numel() for name, p in params.items())
    replicated = sum(p.numel() * p.element_size() for name, p in params.items() if name not in sliced)
    assert report.parameters == per_rank
    assert report.parameter_bytes == {"float32": per_rank * 4}
    assert report.replicated_bytes == replicated
    assert report.replicated_share == pytest.approx(replicated / (per_rank * 4))
    assert report.buffer_bytes == sum(b.numel() * b.element_size() for b in model.buffers())


def test_report_parameters_match_rank_shards(dumped, model):
    """The report's parameter count is what this rank's shards actually hold."""
    partitioned = dumped[0]
    names = dict(model.named_parameters())
    assert partitioned.report().parameters == sum(t.numel() for n, t in partitioned.state.items() if n in names)


def test_report_all_reduce_count(dumped, model):
    """One all_reduce per row-wise Linear: 3 per transformer block, 2 per refiner block, plus the global ones."""
    partitioned = dumped[0]
    rowwise = _rowwise(partitioned)
    per_block = Counter(re.match(r"((?:token_refiner\.refiner_blocks|transformer_blocks)\.\d+)\.", path).group(1)
                        for path in rowwise if "blocks." in path)
    assert set(per_block) == {f"transformer_blocks.{i}" for i in range(len(model.transformer_blocks))} | {
        f"token_refiner.refiner_blocks.{i}" for i in range(len(model.token_refiner.refiner_blocks))}
    assert all(n == (3 if k.startswith("transformer") else 2) for k, n in per_block.items())
    report = partitioned.report()
    assert report.count("all_reduce") == len(rowwise)
    assert {(c.kind, c.axis) for c in report.collectives} == {("all_reduce", "tp")}


def test_report_bytes_per_call(dumped, model):
    """Each all_reduce moves the output of a row-wise Linear, as measured by hooks on the eager model."""
    partitioned = dumped[0]
    measured = Counter()
    hooks = [model.get_submodule(path).register_forward_hook(
        lambda module, args, out: measured.update([out.numel() * out.element_size()]))
        for path in _rowwise(partitioned)]
    try:
        with torch.no_grad():
            model(**h3_inputs(TINY_H3))
    finally:
        for hook in hooks:
            hook.remove()
    reported = Counter()
    for c in partitioned.report().collectives:
        reported[c.bytes_per_call] += c.count
    assert reported == measured


def _parse_size(text: str) -> float:
    number, unit = text.split()
    return float(number) * {"B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20}[unit]


def test_report_str_is_a_table(dumped):
    """str(report) has a collective/axis/count/bytes-per-call table with one row per collective stat."""
    report = dumped[0].report()
    text = str(report)
    assert re.search(r"collective\s+axis\s+count\s+bytes/call", text)
    rows = re.findall(r"^\s+(all_reduce)\s+(tp)\s+(\d+)\s+([\d.]+ [KM]?i?B)\s", text, re.MULTILINE)
    assert len(rows) == len(report.collectives)
    for (kind, axis, count, size), stat in zip(rows, report.collectives):
        assert (kind, axis, int(count)) == (stat.kind, stat.axis, stat.count)
        assert _parse_size(size) == pytest.approx(stat.bytes_per_call, rel=0.01)
    assert f"parameters per rank: {report.parameters:,}" in text
    assert f"{len(_rowwise(dumped[0]))} rowwise" in text


# --- explain ---------------------------------------------------------------------------------------------------

def test_explain_replicated_linear(dumped):
    """explain() says why proj_in stayed replicated: where its column sharding stopped."""
    partitioned = dumped[0]
    assert partitioned.linear_styles["proj_in"] == "replicate"
    answer = partitioned.explain("proj_in")
    assert answer.startswith("proj_in: replicate")
    assert re.search(r"column sharding stopped at \w+: .*sharded dim", answer)


def test_explain_sharded_and_unknown(dumped):
    """explain() states the style of a sharded Linear and raises KeyError naming an unknown path."""
    partitioned = dumped[0]
    assert partitioned.explain("transformer_blocks.0.attn.to_q") == "transformer_blocks.0.attn.to_q: colwise"
    with pytest.raises(KeyError, match="transformer_blocks.0.attn'"):
        partitioned.explain("transformer_blocks.0.attn")
