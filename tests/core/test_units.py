"""What both runtimes' units and modules share (``fullshard.core.unit``, ``core.module``, ``plan.group``'s names),
on plain Python objects (no framework)."""
from types import SimpleNamespace

from fullshard.core.checks import owners_of_params
from fullshard.core.module import FSDPModuleMethods
from fullshard.core.unit import UNIT_ATTR as STATE_ATTR, distinct_units, named_under
from fullshard.plan.exchange import TORCH, Collectives, Exchange
from fullshard.plan.group import GroupPlan, ParamFacts, ShardLayout


class Node:
    """A module: named parameters and children, like nn.Module's _parameters/_modules."""

    def __init__(self, params=None, children=None):
        self.params = dict(params or {})
        self.children = dict(children or {})


def owners(tops, ignored=frozenset()):
    return owners_of_params(tops, lambda n: n.params.items(), lambda n: n.children.items(), ignored)


def test_owners_skip_units_below_the_top_and_ignored_params_and_list_tied_holders():
    tied, own, inner, skipped = object(), object(), object(), object()
    sharded_child = Node({"w": inner})
    setattr(sharded_child, STATE_ATTR, object())  # fully_shard already ran on it
    top = Node({"w": own, "gone": None}, {"a": Node({"w": tied}), "b": Node({"w": tied, "x": skipped}),
                                          "unit": sharded_child})
    setattr(top, STATE_ATTR, object())  # the top itself may be a unit (fully_shard re-planning it)
    found, params = owners([top], ignored=frozenset({id(skipped)}))
    assert set(params) == {id(own), id(tied)}
    assert [path for _, _, path in found[id(tied)]] == ["a.w", "b.w"]
    assert [path for _, _, path in found[id(own)]] == ["w"]


def test_owners_of_several_tops_are_prefixed_by_index():
    a, b = object(), object()
    found, _ = owners([Node({"w": a}), Node({"w": b})])
    assert found[id(a)][0][2] == "[0].w" and found[id(b)][0][2] == "[1].w"


def test_distinct_units_once_each_in_order_and_configure_reaches_every_group():
    group = SimpleNamespace(reduce_grads=True)
    shared = SimpleNamespace(groups=[group])
    other = SimpleNamespace(groups=[])
    modules = [SimpleNamespace(**{STATE_ATTR: shared}), SimpleNamespace(), SimpleNamespace(**{STATE_ATTR: shared}),
               SimpleNamespace(**{STATE_ATTR: other})]
    units = distinct_units(modules)
    assert units == [shared, other]

    class Module(FSDPModuleMethods):
        def _modules_in_reach(self, recurse):
            return modules

    Module()._configure(True, reduce_grads=False, flag=1)
    assert group.reduce_grads is False and group.flag == 1


def plan_named(names, alone):
    """Parameters that share a bucket but the ``alone`` ones (an extension gathers by itself)."""
    params = [SimpleNamespace(fqn=n, local_fqn=n) for n in names]
    facts = [ParamFacts(ShardLayout((4,), 0, 2), "float32", "float32", True, False, False, n in alone) for n in names]
    return GroupPlan(params, facts, "", "cell", None, 1 << 20, Collectives(Exchange.PAIRWISE, Exchange.PAIRWISE), TORCH)


def test_bucket_names_follow_the_root_paths():
    plan = plan_named(["a.weight", "a.bias", "b.weight", "b.bias", "c.weight"], {"b.weight"})
    assert [b.members for b in plan.buckets] == [(0, 1, 3, 4), (2,)]
    assert plan.members(1) == [plan.params[2]]
    plan.rename("layers.3")
    assert plan.params[0].fqn == "layers.3.a.weight"
    assert plan.labels[0] == "[layers.3.a.weight, layers.3.a.bias, layers.3.b.bias and 1 more] of cell 'layers.3'"
    assert plan.labels[1] == "[layers.3.b.weight] of cell 'layers.3'"
    plan.rename("")  # the root itself: names stay
    assert plan.module_name == "layers.3"


def test_named_under_prefixes_several_tops_as_parameter_paths_are():
    def named(top):
        yield "", top
        yield "child", f"{top}.child"

    assert list(named_under(["a"], named)) == [("", "a"), ("child", "a.child")]
    assert list(named_under(["a", "b"], named)) == [("[0]", "a"), ("[0].child", "a.child"),
                                                   ("[1]", "b"), ("[1].child", "b.child")]
