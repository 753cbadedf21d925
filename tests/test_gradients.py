"""Backward through a partition is exact: LoRA fine-tuning of a DiT (peft adapters on the attention projections, the
base frozen) at every layout, against the single-device model's gradients of the input and of every adapter weight;
three optimizer steps keep the replicas bitwise equal and the next output as on one device. Negative controls: the
gradient sums ``passes.differentiate`` inserts dropped, or torch's own all_reduce backward (a second sum), and the
test fails. Where backward cannot be exact it is refused by name."""

from __future__ import annotations

import copy

import pytest
import torch

from partitioner import partition
from partitioner.backends import Backend, eager, register
from partitioner.passes import differentiate
from partitioner.placement import is_sharded
from partitioner.runtime import differentiable, kernel_gradients
from partitioner.runtime.weights import shard_tensor
from partitioner.testing import (RankPool, ViewHeads, attempt, flux_cfg_inputs, flux_inputs, run_ranks, tiny_flux,
                                 with_lora)

# float32: sharding reorders the sums of the forward and of the backward (every gradient here is O(1); the errors
# seen are 1e-7), and Adam's update divides by sqrt(v): a step moves each weight by about lr whatever the gradient.
TOLERANCE = 2e-5
STEPS, LR = 3, 1e-2
LAYOUTS = {"tp": (2,), "ulysses": (2,), "ring": (2,), "dp": (2,)}


def _mesh(shape, names):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _loss(out: torch.Tensor) -> torch.Tensor:
    """Every output element weighted differently: a sum's gradient (all ones) would hide rows swapped or dropped."""
    return (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum()


def _fine_tune(rank, world, shape, names, backend="eager", make=None):
    """STEPS AdamW steps of the partition and of the model, side by side: the worst gradient error of each step (of
    the input and of this rank's part of every adapter weight), the next output's error, this rank's weights after
    the steps, and which of them are replicated."""
    model, inputs = make() if make else (with_lora(tiny_flux()), flux_cfg_inputs() if "dp" in names else flux_inputs())
    reference = copy.deepcopy(model)
    compiled = partition(model, _mesh(shape, names), ((), inputs), timeout=30).compile(backend)
    trained = dict(compiled.named_parameters())
    assert sorted(trained) == sorted(n for n, w in model.named_parameters() if w.requires_grad)
    assert all(w.requires_grad for w in trained.values())
    specs, mesh = compiled.partitioned.slice_specs, compiled.partitioned.mesh
    optimizer = torch.optim.AdamW(trained.values(), lr=LR)
    reference_optimizer = torch.optim.AdamW([w for w in reference.parameters() if w.requires_grad], lr=LR)
    first = next(iter(inputs))  # the input whose gradient is compared too
    errors = []
    for _ in range(STEPS):
        optimizer.zero_grad(), reference_optimizer.zero_grad()
        x, x_reference = (inputs[first].clone().requires_grad_() for _ in range(2))
        out = compiled(**dict(inputs, **{first: x}))
        _loss(out.sample if hasattr(out, "sample") else out).backward()
        out = reference(**dict(inputs, **{first: x_reference}))
        _loss(out.sample if hasattr(out, "sample") else out).backward()
        grads = dict(reference.named_parameters())
        errors.append(max([(x.grad - x_reference.grad).abs().max().item()] + [
            (weight.grad - shard_tensor(grads[name].grad, specs.get(name, {}), mesh)).abs().max().item()
            for name, weight in trained.items()]))
        optimizer.step(), reference_optimizer.step()
    with torch.no_grad():
        out, expected = compiled(**inputs), reference(**inputs)
        out, expected = (getattr(o, "sample", o) for o in (out, expected))
    replicated = {name for name in trained if not any(map(is_sharded, specs.get(name, {}).values()))}
    return errors, (out - expected).abs().max().item(), {n: w.detach().clone() for n, w in trained.items()}, replicated


def _check(results) -> None:
    for rank, (errors, output_error, _, _) in enumerate(results):
        assert max(errors) <= TOLERANCE and output_error <= TOLERANCE, (rank, errors, output_error)
    _, _, weights, replicated = results[0]
    assert replicated  # (every layout keeps some adapter weight whole: its replicas must agree bit for bit)
    for name in replicated:
        assert all(torch.equal(result[2][name], weights[name]) for result in results), f"{name} drifted"


@pytest.fixture(scope="module")
def two():
    with RankPool(2) as pool:
        yield pool


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_lora_fine_tuning_is_exact_and_replicas_stay_equal(two, layout):
    _check(two.run(_fine_tune, LAYOUTS[layout], (layout,)))


def test_lora_fine_tuning_is_exact_over_tp_and_ulysses():
    _check(run_ranks(4, _fine_tune, (2, 2), ("tp", "ulysses")))


def _lora_attention():
    torch.manual_seed(0)
    return with_lora(ViewHeads(heads=4, dim=32), targets=("q", "v", "o")), {"x": torch.randn(1, 6, 32)}


def test_lora_fine_tuning_is_exact_under_inductor(two):
    _check(two.run(_fine_tune, (2,), ("tp",), "inductor", _lora_attention))


def test_a_lora_adapter_beside_a_column_shard_adds_no_collective():
    """A whole, B split by columns like its base projection: the adapters of q/k/v cost no collective (the output
    projection's adapter, whose A reads sharded features, one small all_reduce of rank-r rows)."""
    counts = [partition(model, {"tp": 2}, ((), flux_inputs())).collective_counts()[("all_reduce", "tp")]
              for model in (tiny_flux(), with_lora(tiny_flux(), targets=("to_q", "to_k", "to_v")))]
    assert counts[0] == counts[1], counts


def _controls(rank, world):
    """The TP=2 gradient error with each pairing broken in turn (no gradient sums; the all_reduce's gradient summed
    again, as torch's own all_reduce backward does), and the refusals."""
    model, inputs = with_lora(tiny_flux()), flux_inputs()
    found = {}
    for broken, patch in (("no gradient sums", (differentiate, "_sum_shared_gradients", lambda *a: None)),
                          ("summed twice", (differentiable, "summed", kernel_gradients.sum_over_ranks)),
                          ("no patch", None)):
        saved = getattr(*patch[:2]) if patch else None
        if patch:
            setattr(*patch)
        try:
            reference = copy.deepcopy(model)
            compiled = partition(model, _mesh((2,), ("tp",)), ((), inputs), timeout=30).compile()
            _loss(compiled(**inputs).sample).backward()
            _loss(reference(**inputs).sample).backward()
            grads = dict(reference.named_parameters())
            specs, mesh = compiled.partitioned.slice_specs, compiled.partitioned.mesh
            found[broken] = max((w.grad - shard_tensor(grads[n].grad, specs.get(n, {}), mesh)).abs().max().item()
                                for n, w in compiled.named_parameters())
        finally:
            if patch:
                setattr(patch[0], patch[1], saved)
    # a backend that runs inference only refuses backward by name
    register(Backend("inference-only", "rank", eager.lower))
    compiled = partition(model, _mesh((2,), ("tp",)), ((), inputs), timeout=30).compile("inference-only")
    found["inference-only"] = attempt(lambda: compiled(**inputs).sample.sum().backward())
    # a model left in training mode with every weight requiring grad: no weight is marked to train, none is trained
    whole, x = _lora_attention()[0].requires_grad_(True).train(), torch.randn(1, 6, 32, requires_grad=True)
    compiled = partition(whole, _mesh((2,), ("tp",)), ((), {"x": x}), timeout=30).compile()
    found["all trainable"] = attempt(lambda: compiled(x=x).sum().backward())
    return found


def test_negative_controls_break_the_gradients_and_refusals_name_the_backend():
    for rank, found in enumerate(run_ranks(2, _controls)):
        assert found["no patch"] <= TOLERANCE, (rank, found)
        assert found["no gradient sums"] > 100 * TOLERANCE, (rank, found)
        assert found["summed twice"] > 100 * TOLERANCE, (rank, found)
        kind, message, _ = found["inference-only"]
        assert kind == "BackwardUnsupported" and "'inference-only' runs inference only" in message, (rank, message)
        kind, message, _ = found["all trainable"]
        assert kind == "BackwardUnsupported" and "every weight requiring grad" in message, (rank, message)


class _CopiesInPlace(torch.nn.Module):
    """A rotary table written with ``copy_`` (aten.copy once functional, which has no derivative)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        rotated = torch.empty_like(x)
        rotated.copy_(torch.cat([-x[..., 4:], x[..., :4]], -1))
        return self.down(torch.relu(self.up(x + rotated)))


def _copy_gradient(rank, world):
    torch.manual_seed(0)
    model, x = _CopiesInPlace().eval(), torch.randn(2, 5, 8)
    compiled = partition(model, _mesh((2,), ("tp",)), ((x,), {}), timeout=30).compile()
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    _loss(compiled(ours)).backward()
    _loss(model(theirs)).backward()
    return (ours.grad - theirs.grad).abs().max().item()


def test_an_in_place_copy_is_differentiated_as_its_value(two):
    assert max(two.run(_copy_gradient)) <= TOLERANCE


def _load_into_parameters(rank, world, path):
    model, inputs = _lora_attention()
    compiled = partition(model, _mesh((2,), ("tp",)), ((), inputs), timeout=30).compile()
    before = dict(compiled.named_parameters())
    compiled.partitioned.load_weights(path)
    after = dict(compiled.named_parameters())
    saved, specs, mesh = _saved(path), compiled.partitioned.slice_specs, compiled.partitioned.mesh
    program = set(map(id, compiled.partitioned.rank_tensors()))  # what the next call reads
    return (all(after[name] is weight and id(weight) in program for name, weight in before.items()),
            all(torch.equal(weight, shard_tensor(saved[name], specs.get(name, {}), mesh)) for name, weight in
                after.items()))


def _saved(path):
    from safetensors.torch import load_file

    return load_file(path)


def test_load_weights_writes_into_the_parameters_an_optimizer_holds(two, tmp_path):
    from safetensors.torch import save_file

    model, _ = _lora_attention()
    save_file({name: (tensor + 1).contiguous() for name, tensor in model.state_dict().items()},
              tmp_path / "model.safetensors")
    for rank, (same_objects, loaded) in enumerate(two.run(_load_into_parameters, str(tmp_path / "model.safetensors"))):
        assert same_objects and loaded, rank


def test_ring_blocks_merged_where_a_row_sees_no_key_of_a_block_have_exact_gradients():
    """Ring attention's differentiable path, one process: a query row whose keys in one block are all masked out
    (padded text on the last rank) has log-sum-exp -inf there, whose softmax and merge gave NaN gradients; the
    blocks merged as the ring does match one attention over every key, values and gradients."""
    from partitioner.runtime.collectives import _attention_block, _merge_weights

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    k2, v2 = (torch.randn(1, 2, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = torch.zeros(1, 1, 4, 6, dtype=torch.float64)
    mask[..., 1, :4] = float("-inf")  # row 1 sees no key of the first block
    mask[..., 2, 4:] = float("-inf")  # row 2 none of the second
    out, lse = _attention_block(q, k, v, None, fused=False, mask=mask[..., :4])
    block_out, block_lse = _attention_block(q, k2, v2, None, fused=False, mask=mask[..., 4:])
    _, kept, added = _merge_weights(lse, block_lse)
    ring = out * kept + block_out * added
    whole = torch.nn.functional.scaled_dot_product_attention(q, torch.cat([k, k2], 2), torch.cat([v, v2], 2),
                                                             attn_mask=mask)
    weights = torch.randn(ring.shape, dtype=torch.float64)
    ours = torch.autograd.grad((ring * weights).sum(), (q, k, v, k2, v2))
    theirs = torch.autograd.grad((whole * weights).sum(), (q, k, v, k2, v2))
    torch.testing.assert_close(ring, whole)
    for mine, expected in zip(ours, theirs):
        torch.testing.assert_close(mine, expected)


class _GatedMLP(torch.nn.Module):
    """An ordinary gated MLP whose row-parallel sum meets a column shard of another input: no low-rank branch."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)
        self.gate, self.out = torch.nn.Linear(16, 64), torch.nn.Linear(64, 64)

    def forward(self, x, e):
        return self.out(self.gate(e) * self.down(torch.nn.functional.gelu(self.up(x))))


def test_only_a_branch_beside_a_column_shard_of_its_own_input_is_kept_whole():
    styles = partition(_GatedMLP(), {"tp": 2}, ((torch.randn(3, 64), torch.randn(3, 16)), {})).linear_styles
    assert styles["up"] == "colwise" and styles["down"] == "rowwise", styles
