"""The sweep both planners run: every node's ``Decision`` from its rule, in graph order, given what each input's
consumers see.

A planner offers some values sharded ("seeds": column-wise Linears for tp, sequence-long values for ulysses). The
sweep follows each seed's sharding through the values that carry it, so that when a rule refuses a sharded input
(``Unshardable``, or ``NeedsPacking`` / ``NeedsUnit`` for a split that needs a producer laid out otherwise) the failure names the seeds that led
there; the refusing node falls back to replicating its inputs. The planner then drops (or packs, or gathers) those
seeds and sweeps again, until no failure is left: a fixpoint, since every round only removes shardings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch.fx import GraphModule, Node

from ..placement import Partial, Replicate, any_sharded
from . import Decision, NeedsPacking, NeedsUnit, Unshardable, replicate_all

R = Replicate()


@dataclass(frozen=True)
class Failure:
    node: Node  # where a rule refused
    problem: Exception  # Unshardable, NeedsPacking or NeedsUnit
    seeds: frozenset  # the seeds whose sharding reached it


@dataclass
class Sweep:
    decisions: dict[Node, Decision] = field(default_factory=dict)
    visible: dict[Node, object] = field(default_factory=dict)  # what each node's consumers see
    failures: list[Failure] = field(default_factory=list)
    provenance: dict[Node, frozenset] = field(default_factory=dict)  # sharded value -> the seeds it carries


def sweep(gm: GraphModule, rule_of: Callable[[Node], Callable], degree: int, *,
          adjust: Callable[[Node, Decision], Decision] = lambda node, decision: decision,
          is_seed: Callable[[Node, Decision], bool]) -> Sweep:
    """One pass over ``gm``. ``rule_of(node)`` gives the rule; ``adjust`` lets the planner change what consumers see
    (a gathered Linear, a sliced seed) through ``Decision.visible``; ``is_seed`` says which values start a sharding."""
    result = Sweep()
    provenance = result.provenance
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            decision = Decision(R)
        else:
            try:
                decision = rule_of(node)(node, result.visible, degree)
            except (Unshardable, NeedsPacking, NeedsUnit) as problem:
                seeds = frozenset().union(*(provenance.get(n, frozenset()) for n in node.all_input_nodes))
                result.failures.append(Failure(node, problem, seeds))
                decision = replicate_all(node, result.visible)
        decision = adjust(node, decision)
        result.decisions[node] = decision
        result.visible[node] = decision.seen
        if is_seed(node, decision):
            provenance[node] = frozenset({node})
        elif not isinstance(decision.output, Partial):
            carried = [provenance[n] for n in node.all_input_nodes if n in provenance
                       and any_sharded(result.visible[n]) and any_sharded(decision.inputs.get(n, R))]
            if carried:
                provenance[node] = frozenset().union(*carried)
    return result
