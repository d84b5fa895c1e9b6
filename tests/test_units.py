"""fullshard.core.units: what both runtimes' units share, on plain Python objects (no framework)."""
import threading
from types import SimpleNamespace

import pytest

from fullshard.core.units import (
    STATE_ATTR, BucketNames, RootedUnit, configure, distinct_states, named_under, owners_of_params,
)


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


def test_distinct_states_once_each_in_order_and_configure_reaches_every_group():
    group = SimpleNamespace(reducer=SimpleNamespace(reduce_grads=True))
    shared = SimpleNamespace(groups=[group])
    other = SimpleNamespace(groups=[])
    modules = [SimpleNamespace(**{STATE_ATTR: shared}), SimpleNamespace(), SimpleNamespace(**{STATE_ATTR: shared}),
               SimpleNamespace(**{STATE_ATTR: other})]
    states = distinct_states(modules)
    assert states == [shared, other]
    configure(states, "reducer", {"reduce_grads": False})
    assert group.reducer.reduce_grads is False
    configure(states, "group", {"flag": 1})
    assert group.flag == 1


class Context:
    agree = True

    def __init__(self, root):
        self.states = [root]

    def adopt(self, name, state):
        state.context, state.is_root, state.adopted_as = self, False, name
        self.states.append(state)

    def check_ranks_agree(self):
        if not self.agree:
            raise RuntimeError("ranks disagree")


class Unit(RootedUnit):
    root_context, active = Context, threading.local()

    def __init__(self, *subunits):
        super().__init__(mp_policy=None, strategy=None, reshard_after_forward=None)
        self.subunits = subunits

    def _named_submodules(self):
        yield "", SimpleNamespace(**{STATE_ATTR: self})
        for index, sub in enumerate(self.subunits):
            yield f"layers.{index}", SimpleNamespace(**{STATE_ATTR: sub})


def test_the_root_adopts_the_units_below_it_by_path_and_a_late_unit_joins_the_active_root():
    layer0, layer1 = Unit(), Unit()
    root = Unit(layer0, layer1)
    context = root._lazy_init_as_root()
    assert root.is_root and context.states == [root, layer0, layer1]
    assert (layer0.adopted_as, layer1.adopted_as, layer1.is_root) == ("layers.0", "layers.1", False)
    assert root._lazy_init_as_root() is context  # once
    outside = Unit()
    Unit.active.root = root
    try:
        assert outside._ensure_context() is context and outside.adopted_as == ""
    finally:
        Unit.active.root = None
    alone = Unit()
    assert alone._ensure_context() is not context and alone.is_root  # no root running: its own root


def test_a_failed_rank_agreement_undoes_the_adoption():
    layer = Unit()
    root = Unit(layer)

    class Disagreeing(Context):
        agree = False

    root.root_context = Disagreeing
    with pytest.raises(RuntimeError, match="disagree"):
        root._lazy_init_as_root()
    assert (root.context, root.is_root, layer.context, layer.is_root) == (None, None, None, None)


class Plan(BucketNames):
    owner_kind = "cell"

    def __init__(self, names, buckets):
        self.params = [SimpleNamespace(fqn=n, local_fqn=n) for n in names]
        self.buckets = [SimpleNamespace(members=m) for m in buckets]
        self.module_name = ""
        self._name_buckets()


def test_bucket_names_follow_the_root_paths():
    plan = Plan(["a.weight", "a.bias", "b.weight", "b.bias", "c.weight"], [(0, 1, 2, 3, 4), (2,)])
    assert plan.members(1) == [plan.params[2]]
    plan.rename("layers.3")
    assert plan.params[0].fqn == "layers.3.a.weight"
    assert plan.labels[0] == "[layers.3.a.weight, layers.3.a.bias, layers.3.b.weight and 2 more] of cell 'layers.3'"
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
