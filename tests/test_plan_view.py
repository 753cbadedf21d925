"""The plan's HTML page: parsed back with the stdlib parser, every block has its row, every Linear its cell, the
embedded numbers are plan_summary's, and the blocks' collective bytes add up to the report's."""

import json
from collections import Counter
from html.parser import HTMLParser

import pytest
import torch

from partitioner import partition
from partitioner.errors import InputError
from partitioner.planning.plan_view import UNGROUPED, _owning_block, block_of, plan_summary, render_html, write_html
from partitioner.testing import TINY_H3, flux_inputs, h3_inputs, tiny_flux, tiny_h3

MESH = {"tp": 2, "ulysses": 2}
TIMES = {"compute_s": 0.8, "comm_s": 0.3, "exposed_comm_s": 0.1}


class PlanPage(HTMLParser):
    """What a tool reading the page sees: block rows in order, linear cells (class, title), rank bars, the JSON."""

    def __init__(self, text: str):
        super().__init__()
        self.rows, self.linears, self.rank_bars, self.data = [], [], [], None
        self._in_data = False
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = (attrs.get("class") or "").split()
        if tag == "tr" and "data-block" in attrs:
            self.rows.append(attrs["data-block"])
        elif tag == "td" and "linear" in classes:
            self.linears.append((self.rows[-1], classes, attrs["title"]))
        elif tag == "div" and "data-rank" in attrs:
            self.rank_bars.append(int(attrs["data-rank"]))
        self._in_data = tag == "script" and attrs.get("id") == "plan-data"

    def handle_data(self, data):
        if self._in_data:
            self.data = json.loads(data)

    def handle_endtag(self, tag):
        self._in_data = False


@pytest.fixture(scope="module")
def h3(tmp_path_factory):
    """Tiny H3 on tp=2 x ulysses=2 (all_reduces and all_to_alls), rank 0, dumped; and its dump directory."""
    directory = tmp_path_factory.mktemp("dump")
    return partition(tiny_h3(), MESH, ((), h3_inputs(TINY_H3)), dump_dir=directory), directory / "rank0"


@pytest.fixture(scope="module")
def page(h3):
    summary = plan_summary(h3[0], TIMES)
    return summary, PlanPage(render_html(summary))


def _report_bytes(partitioned) -> int:
    return sum(c.count * c.bytes_per_call for c in partitioned.report().collectives)


def test_block_of():
    assert block_of("transformer_blocks.3.attn.to_q") == "transformer_blocks.3"
    assert block_of("token_refiner.refiner_blocks.0.ff.net.2") == "token_refiner.refiner_blocks.0"
    assert block_of("time_embedder.linear_1") == "time_embedder"
    assert block_of("proj_out") == "proj_out"


def test_collective_without_module_takes_its_producers_block():
    """A node with no module stack of its own belongs to the nearest input that has one, else to "(graph)"."""
    gm = torch.fx.symbolic_trace(lambda x, y: (x.relu() + 1).neg() + y)
    nodes = {node.name: node for node in gm.graph.nodes}
    nodes["relu"].meta["nn_module_stack"] = {"a": ("", object), "b": ("blocks.2.attn", object)}
    nodes["add"].meta["nn_module_stack"] = {"a": ("", object)}  # the root alone says nothing
    assert _owning_block(nodes["neg"]) == _owning_block(nodes["add_1"]) == "blocks.2"
    assert _owning_block(nodes["y"]) == UNGROUPED


def test_every_block_has_a_row(h3, page):
    """One row per block, in the summary's order; every Linear's block is among them."""
    summary, parsed = page
    assert parsed.rows == [block["name"] for block in summary["blocks"]]
    assert {block_of(path) for path in h3[0].linear_styles} <= set(parsed.rows)
    assert {"transformer_blocks.0", "transformer_blocks.1", "time_embedder", "proj_out"} <= set(parsed.rows)


def test_one_coloured_cell_per_linear(h3, page):
    """As many linear cells as Linears, each titled with its full path and style, coloured by the style's family."""
    summary, parsed = page
    styles = h3[0].linear_styles
    assert len(parsed.linears) == len(styles) == summary["totals"]["linears"]
    titles = {title: classes for _, classes, title in parsed.linears}
    assert set(titles) == {f"{path}: {style}" for path, style in styles.items()}
    decided = h3[0].linear_decisions
    for path, style in styles.items():
        assert decided[path].style.value in titles[f"{path}: {style}"]
    assert {d.style.value for d in decided.values()} >= {"colwise", "rowwise", "replicate"}


def test_embedded_json_is_the_summary(page):
    summary, parsed = page
    assert parsed.data == summary
    assert parsed.data["times"] == TIMES


def test_block_collective_bytes_sum_to_the_report(h3, page):
    """Per block, then summed: the report's bytes per step and its calls of each (kind, axis)."""
    summary, _ = page
    blocks = summary["blocks"]
    assert sum(block["collective_bytes"] for block in blocks) == _report_bytes(h3[0]) == \
        summary["totals"]["collective_bytes"] > 0
    calls = Counter()
    for block in blocks:
        for c in block["collectives"]:
            calls[(c["kind"], c["axis"])] += c["count"]
    assert calls == h3[0].collective_counts()
    # the all_to_alls sit in the attentions of the two transformer blocks and the text refiner, none in the glue
    with_exchanges = {block["name"] for block in blocks if any(c["kind"] == "all_to_all" for c in block["collectives"])}
    assert {name.split(".")[0] for name in with_exchanges} == {"transformer_blocks", "token_refiner"}


def test_ranks_and_totals(h3, page):
    """Every rank has a memory bar; rank 0's parameter bytes are the report's."""
    summary, parsed = page
    report = h3[0].report()
    assert parsed.rank_bars == list(range(4)) == [r["rank"] for r in summary["ranks"]]
    assert summary["ranks"][0]["parameter_bytes"] == summary["totals"]["parameter_bytes"] == \
        report.total_parameter_bytes
    assert all(r["activation_bytes"] == report.activation_peak_bytes for r in summary["ranks"])


def test_step_time_bar_only_with_times(h3):
    with_times, without = render_html(plan_summary(h3[0], TIMES)), render_html(plan_summary(h3[0]))
    assert 'class="overlapped"' in with_times and "Step time" in with_times
    assert "Step time" not in without and PlanPage(without).data["times"] is None
    with pytest.raises(InputError, match="exposed_comm_s"):
        plan_summary(h3[0], {"compute_s": 1.0, "comm_s": 0.5})


def test_text_is_escaped(page):
    """Names that look like markup stay text, and the embedded JSON cannot be ended early."""
    summary = json.loads(json.dumps(page[0]))
    summary["model"] = "</script><b>&"
    summary["blocks"][0]["name"] = "<tr data-block=x>"
    text = render_html(summary)
    assert "<b>" not in text and "<tr data-block=x>" not in text
    parsed = PlanPage(text)
    assert parsed.data == summary and parsed.rows[0] == "<tr data-block=x>"


def test_dump_dir_writes_plan_html(h3):
    """partition(..., dump_dir) writes plan.html beside the pass dumps: the summary without times."""
    partitioned, directory = h3
    parsed = PlanPage((directory / "plan.html").read_text(encoding="utf-8"))
    assert parsed.data == plan_summary(partitioned)


def test_flux_blocks_and_write_html(tmp_path):
    """Flux's double- and single-stream blocks each get a row; write_html writes the page with its times."""
    partitioned = partition(tiny_flux(), {"tp": 2}, ((), flux_inputs()))
    parsed = PlanPage(write_html(partitioned, tmp_path / "flux.html", TIMES).read_text(encoding="utf-8"))
    assert {"transformer_blocks.0", "single_transformer_blocks.0"} <= set(parsed.rows)
    assert len(parsed.linears) == len(partitioned.linear_styles)
    assert sum(block["collective_bytes"] for block in parsed.data["blocks"]) == _report_bytes(partitioned)
    assert parsed.data["times"] == TIMES and parsed.rank_bars == [0, 1]
