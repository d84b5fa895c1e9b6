"""The unit lifecycle (``fullshard.core.unit``, ``fullshard.core.group``) on plain objects: a fake runtime records every framework
operation the rules ask for, in order, so each rule is checked without a framework or a process."""
import threading

import pytest

from fullshard.core.group import GATHER_TRANSITIONS, GatherState, Group
from fullshard.core.unit import TRANSITIONS, UNIT_ATTR, Root, TrainingPhase, Unit, distinct_units
from fullshard.plan.group import AfterBackward, Strategy

_active = threading.local()


class FakeGroup(Group):
    def __init__(self, name: str, log: list, after_backward=AfterBackward.RESHARD) -> None:
        super().__init__(after_backward)
        self.name, self.log = name, log
        self.grads = 0  # gradients arrived since the last reduction
        self.changed = False

    def _record(self, what: str) -> None:
        self.log.append(f"{what} {self.name}")

    def _start_gather(self):
        self._record("gather")

    def _finish_gather(self):
        self._record("wait")

    def _free(self, keep_post_forward_chunks):
        self._record("free-keeping-chunks" if keep_post_forward_chunks else "free")

    def _keep(self):
        self._record("keep")

    def _keep_for_backward(self):
        self._record("hold-for-backward")

    def _shards_changed(self):
        return self.changed

    def _drop_post_forward_chunks(self):
        pass

    def _abandon_gathers(self):
        self._record("abandon-gathers")

    def has_pending_grads(self):
        return self.grads > 0

    def _start_reduce(self):
        self._record("reduce")
        self.grads = 0
        group = self

        class Pending:
            def finish(self):
                group._record("reduced")

            def abandon(self):
                group._record("reduction-dropped")

        return [Pending()]

    def _abandon_grads(self):
        self.grads = 0
        self._record("drop-grads")

    def rename(self, name):
        pass


class FakeRoot(Root):
    def __init__(self, root) -> None:
        super().__init__(root)
        self.callbacks = []

    def _queue_end_of_backward(self):
        self.callbacks.append(self.end_of_backward)

    def check_ranks_agree(self, units):
        pass


class Module:
    """A module that fully_shard made a unit of; children are modules below it."""

    def __init__(self, *children) -> None:
        self.children = children


class FakeUnit(Unit):
    root_class, active = FakeRoot, _active

    def __init__(self, module, groups, strategy=Strategy.OPTIM_GRADS_PARAMS, reshard_after_forward=None):
        super().__init__(groups, strategy, reshard_after_forward, module_count=1)
        self.module = module
        setattr(module, UNIT_ATTR, self)

    @property
    def name(self):
        return self.groups[0].name if self.groups else "empty"

    def _named_submodules(self):
        def walk(module, path):
            yield path, module
            for index, child in enumerate(module.children):
                yield from walk(child, f"{path}.{index}" if path else str(index))
        return walk(self.module, "")


def _recorded(attr: str, moves: list):
    """A property standing in for ``attr`` that records every (from, to) move that changes it."""
    key = f"_recorded_{attr}"

    def set_value(obj, value):
        old = obj.__dict__.get(key)
        if old is not None and old is not value:
            moves.append((old, value))
        obj.__dict__[key] = value
    return property(lambda obj: obj.__dict__[key], set_value)


@pytest.fixture(autouse=True)
def every_move_is_a_listed_transition(monkeypatch):
    """Every test here records each change of a unit's phase and a group's gather state; after the test, each
    one must be a row of TRANSITIONS / GATHER_TRANSITIONS (what docs/design.md draws)."""
    phase_moves, gather_moves = [], []
    monkeypatch.setattr(FakeUnit, "phase", _recorded("phase", phase_moves), raising=False)
    monkeypatch.setattr(FakeGroup, "state", _recorded("state", gather_moves), raising=False)
    yield phase_moves, gather_moves
    assert set(phase_moves) <= {(a, b) for a, _, b in TRANSITIONS}, phase_moves
    assert set(gather_moves) <= {(a, b) for a, _, b in GATHER_TRANSITIONS}, gather_moves


def model(log, strategy=Strategy.OPTIM_GRADS_PARAMS, after=AfterBackward.RESHARD, **kwargs):
    """A root with two blocks, each a unit of one group."""
    blocks = [Module(), Module()]
    root_module = Module(*blocks)
    units = [FakeUnit(b, [FakeGroup(f"block{i}", log, after)], strategy, **kwargs) for i, b in enumerate(blocks)]
    root = FakeUnit(root_module, [FakeGroup("root", log, after)], strategy, **kwargs)
    return root, units


def forward(root, blocks, needs_grad=True):
    """The hooks a runtime calls around a forward of root(block0(...), block1(...))."""
    assert root.enter_root_forward()
    root.pre_forward(prefetch=True)
    for block in blocks:
        block.ensure_root()
        block.pre_forward(prefetch=True)
        block.post_forward(block.module, needs_grad, in_backward=False)
    root.post_forward(root.module, needs_grad, in_backward=False)
    root.leave_root_forward()


def backward(root, blocks, grads=True, end=True):
    """Autograd reaches the root's outputs first, then the last block, ..., then the end-of-backward callback."""
    for unit in [root, *reversed(blocks)]:
        unit.pre_backward()
        if grads:
            for group in unit.groups:
                group.grads += 1
        unit.post_backward()
    if end:
        end_backward(root)


def end_backward(root):
    for callback in root.root.callbacks:
        callback()
    root.root.callbacks.clear()


def test_zero3_step_gathers_twice_reduces_per_unit_and_reshards_everything():
    log = []
    root, blocks = model(log)
    forward(root, blocks)
    assert log[:8] == ["gather root", "wait root", "gather block0", "wait block0", "free-keeping-chunks block0",
                       "gather block1", "wait block1", "free-keeping-chunks block1"]
    assert all(g.state is GatherState.SHARDED for b in blocks for g in b.groups)
    assert root.groups[0].state is GatherState.UNSHARDED  # the root does not reshard after forward
    log.clear()
    backward(root, blocks)
    # the root's backward prefetches block1's gather, block1's prefetches block0's; each unit reduces after its
    # backward, keeping one unit's reductions in flight
    assert log == ["gather block1", "reduce root", "free root", "gather block0", "wait block1", "reduced root",
                   "reduce block1", "free block1", "wait block0", "reduced block1", "reduce block0", "free block0",
                   "reduced block0"]
    assert all(u.phase is TrainingPhase.IDLE and u.groups[0].state is GatherState.SHARDED for u in [root, *blocks])


def test_the_second_forward_prefetches_the_next_unit():
    log = []
    root, blocks = model(log)
    forward(root, blocks)
    backward(root, blocks)
    log.clear()
    forward(root, blocks)
    assert log == ["gather root", "gather block0", "wait root", "gather block1", "wait block0",
                   "free-keeping-chunks block0", "wait block1", "free-keeping-chunks block1", "hold-for-backward root"]


def test_zero2_keeps_the_storage_and_gathers_again_after_the_optimizer():
    log = []
    root, blocks = model(log, Strategy.OPTIM_GRADS, AfterBackward.KEEP_STORAGE)
    forward(root, blocks)
    assert "free block0" not in log and all(b.groups[0].state is GatherState.UNSHARDED for b in blocks)
    backward(root, blocks)
    assert log[-3:] == ["keep root", "keep block0", "keep block1"]
    log.clear()
    forward(root, blocks)
    assert log.count("gather block0") == 1  # the shards changed: gathered again into the kept storage


def test_zero1_reduces_every_unit_once_at_the_end_of_backward_in_reverse_order():
    log = []
    root, blocks = model(log, Strategy.OPTIM, AfterBackward.KEEP_STORAGE)
    forward(root, blocks)
    log.clear()
    backward(root, blocks, end=False)
    assert not [entry for entry in log if entry.startswith("reduce")]  # nothing while backward runs
    end_backward(root)
    assert [entry for entry in log if entry.startswith("reduce ")] == ["reduce block1", "reduce block0", "reduce root"]


def test_a_forward_without_grad_reshards_and_no_backward_is_expected():
    log = []
    root, blocks = model(log)
    forward(root, blocks, needs_grad=False)
    assert "free block0" in log and "keep root" in log  # the root, too, shows its shards again (storage kept)
    assert root.forwards_with_grad == 0 and root.root.end_of_backward_queued is False


def test_accumulating_without_sync_keeps_gathered_copies_across_forwards():
    log = []
    root, blocks = model(log, Strategy.OPTIM_GRADS, AfterBackward.KEEP_STORAGE)
    for unit in [root, *blocks]:
        for group in unit.groups:
            group.reduce_grads = False
    forward(root, blocks)
    backward(root, blocks)
    assert not [e for e in log if e.startswith("reduce")]
    log.clear()
    forward(root, blocks)
    assert not [e for e in log if e.startswith("gather")], "copies kept while gradients accumulate"


def test_shards_written_since_the_gather_are_gathered_again_even_when_kept():
    log = []
    root, blocks = model(log, Strategy.OPTIM_GRADS, AfterBackward.KEEP_STORAGE)
    root.groups[0].unshard_now()
    root.groups[0].changed = True
    root.groups[0].unshard()
    assert log[-2:] == ["keep root", "gather root"]


def test_explicit_unshard_serves_the_next_forward_only():
    log = []
    root, blocks = model(log)
    forward(root, blocks)
    backward(root, blocks)
    group = blocks[0].groups[0]
    group.unshard()
    group.keep_for_next_forward()
    assert group.state is GatherState.KEPT
    log.clear()
    forward(root, blocks)
    assert "gather block0" not in log and "free-keeping-chunks block0" in log  # used, then resharded by policy
    assert group.state is GatherState.SHARDED


def test_a_kept_copy_whose_shards_changed_is_gathered_again():
    log = []
    root, blocks = model(log, strategy=Strategy.OPTIM_GRADS, after=AfterBackward.KEEP_STORAGE)
    forward(root, blocks)
    backward(root, blocks)
    group = blocks[1].groups[0]
    assert group.state is GatherState.STALE  # ZeRO-2 after a synced backward: the storage kept, the shards shown
    group.unshard()
    group.keep_for_next_forward()
    group.changed = True  # an optimizer step, after unshard()
    log.clear()
    forward(root, blocks)
    assert log.count("gather block1") == 1 and "keep block1" in log


def test_reshard_after_backward_false_keeps_parameters_gathered_for_the_next_forward():
    log = []
    root, blocks = model(log, after=AfterBackward.KEEP_GATHERED)
    forward(root, blocks)
    backward(root, blocks)
    assert all(u.groups[0].state is GatherState.KEPT for u in [root, *blocks])


def test_reduce_unused_params_units_reduce_at_the_end_of_backward_in_module_order():
    log = []
    root, blocks = model(log)
    for unit in [root, *blocks]:
        unit.groups[0].reduce_unused_params = True
    forward(root, blocks)
    log.clear()
    backward(root, blocks, grads=False)  # this rank's branch gave no gradients
    assert [e for e in log if e.startswith("reduce ")] == ["reduce root", "reduce block0", "reduce block1"]


def test_reduce_unused_params_units_keep_their_parameters_from_forward_to_the_end_of_backward():
    """A unit whose backward may run on some ranks only must not gather in backward (a collective the others
    never join): under ZeRO-3 it keeps its parameters gathered until the end of backward, then reshards."""
    log = []
    root, blocks = model(log)
    blocks[1].groups[0].reduce_unused_params = True
    forward(root, blocks)
    assert "free-keeping-chunks block1" not in log and blocks[1].groups[0].state is GatherState.UNSHARDED
    assert "free-keeping-chunks block0" in log  # the other block follows ZeRO-3
    log.clear()
    backward(root, blocks)
    assert "gather block1" not in log and "gather block0" in log
    assert blocks[1].groups[0].state is GatherState.SHARDED and "free block1" in log


def test_gradients_that_came_late_are_reduced_at_the_end_of_backward():
    log = []
    root, blocks = model(log)
    forward(root, blocks)
    backward(root, blocks, grads=False)
    assert not [e for e in log if e.startswith("reduce")]
    forward(root, blocks)
    for unit in [root, *reversed(blocks)]:
        unit.pre_backward()
        unit.post_backward()  # nothing pending yet
    blocks[0].groups[0].grads = 1  # e.g. a unit whose inputs need no gradient
    root.root.callbacks[0]()
    assert "reduce block0" in log and "reduced block0" in log


def test_abandoning_a_step_drops_reductions_and_shows_the_shards():
    log = []
    root, blocks = model(log)
    forward(root, blocks)
    root.pre_backward()
    root.groups[0].grads = 1
    root.post_backward()
    blocks[1].pre_backward()
    root.reset_step()
    assert "reduction-dropped root" in log and "drop-grads block1" in log
    assert all(u.phase is TrainingPhase.IDLE and u.groups[0].state is GatherState.SHARDED for u in [root, *blocks])
    assert root.root.end_of_backward_queued is False


def test_moves_outside_the_usual_step_are_listed_too(every_move_is_a_listed_transition):
    """A pipeline schedule reduces accumulated gradients outside a backward (IDLE -> POST_BACKWARD), and a
    gather that raises abandons the step from PRE_FORWARD; both are rows of TRANSITIONS."""
    phase_moves, _ = every_move_is_a_listed_transition
    log = []
    root, blocks = model(log)
    forward(root, blocks)
    backward(root, blocks)
    blocks[0].groups[0].grads = 1
    blocks[0].reduce_accumulated_grads()
    assert (TrainingPhase.IDLE, TrainingPhase.POST_BACKWARD) in phase_moves and "reduce block0" in log

    def failing_gather():
        raise RuntimeError("the transfer failed")
    blocks[1].groups[0]._start_gather = failing_gather
    assert root.enter_root_forward()
    root.pre_forward(prefetch=False)
    with pytest.raises(RuntimeError, match="transfer failed"):
        blocks[1].pre_forward(prefetch=False)
    root.reset_step()
    assert (TrainingPhase.PRE_FORWARD, TrainingPhase.IDLE) in phase_moves
    assert all(u.phase is TrainingPhase.IDLE and u.groups[0].state is GatherState.SHARDED for u in [root, *blocks])


def test_a_forward_from_another_thread_during_backward_is_refused_and_the_same_thread_starts_clean():
    log = []
    root, blocks = model(log)
    forward(root, blocks)
    root.pre_backward()
    errors = []
    thread = threading.Thread(target=lambda: _catch(errors, root.root.check_not_in_backward, "Model"))
    thread.start()
    thread.join()
    assert errors and "another thread" in errors[0]
    root.root.check_not_in_backward("Model")  # the forward's own thread: the backward raised; start clean
    assert root.root.end_of_backward_queued is False and root.phase is TrainingPhase.IDLE


def _catch(errors, fn, *args):
    try:
        fn(*args)
    except RuntimeError as error:
        errors.append(str(error))


def test_a_root_adopts_the_units_below_it_once_and_a_disagreement_undoes_it():
    log = []
    root, blocks = model(log)

    class Disagreeing(FakeRoot):
        def check_ranks_agree(self, units):
            raise RuntimeError("ranks differ")

    root.root_class = Disagreeing
    with pytest.raises(RuntimeError, match="ranks differ"):
        root.lazy_init_as_root()
    assert all(u.root is None for u in [root, *blocks])
    root.root_class = FakeRoot
    root_state = root.lazy_init_as_root()
    assert root_state.units == [root, *blocks] and all(b.is_root is False for b in blocks)
    assert distinct_units([root.module, blocks[0].module, blocks[0].module]) == [root, blocks[0]]


def test_every_transition_is_a_move_between_named_phases():
    assert {phase for move in TRANSITIONS for phase in (move[0], move[2])} == set(TrainingPhase)
    assert {state for move in GATHER_TRANSITIONS for state in (move[0], move[2])} == set(GatherState)


def test_the_recorder_sees_the_moves_of_a_step(every_move_is_a_listed_transition):
    """The fixture's recorder is live: one ZeRO-3 step goes through every phase of a unit and every gather
    state."""
    phase_moves, gather_moves = every_move_is_a_listed_transition
    log = []
    root, blocks = model(log)
    forward(root, blocks)
    backward(root, blocks)
    assert {(TrainingPhase.IDLE, TrainingPhase.PRE_FORWARD), (TrainingPhase.FORWARD, TrainingPhase.IDLE),
            (TrainingPhase.PRE_BACKWARD, TrainingPhase.POST_BACKWARD),
            (TrainingPhase.POST_BACKWARD, TrainingPhase.IDLE)} <= set(phase_moves)
    assert {(GatherState.SHARDED, GatherState.UNSHARDING), (GatherState.UNSHARDING, GatherState.UNSHARDED),
            (GatherState.UNSHARDED, GatherState.SHARDED)} == set(gather_moves)


def test_a_unit_outside_the_roots_modules_joins_the_active_root_and_one_alone_is_its_own_root():
    log = []
    root, blocks = model(log)
    context = root.lazy_init_as_root()
    outside = FakeUnit(Module(), [FakeGroup("outside", log)])
    FakeUnit.active.unit = root
    try:
        assert outside.ensure_root() is context and outside in context.units and outside.is_root is False
    finally:
        FakeUnit.active.unit = None
    alone = FakeUnit(Module(), [FakeGroup("alone", log)])
    assert alone.ensure_root() is not context and alone.is_root


def test_a_unit_that_joins_later_is_compared_before_its_first_gather_and_leaves_if_ranks_differ():
    log, checked = [], []

    class Checking(FakeRoot):
        def check_ranks_agree(self, units):
            checked.append([u.name for u in units])
            if units[0].name == "outside":
                raise RuntimeError("ranks differ")

    root, blocks = model(log)
    root.root_class = Checking
    context = root.lazy_init_as_root()
    outside = FakeUnit(Module(), [FakeGroup("outside", log)])
    FakeUnit.active.unit = root
    try:
        with pytest.raises(RuntimeError, match="ranks differ"):
            outside.pre_forward(prefetch=False)
    finally:
        FakeUnit.active.unit = None
    assert checked == [["root", "block0", "block1"], ["outside"]]
    assert outside not in context.units and outside.root is None and outside.phase is TrainingPhase.IDLE
    assert not any("outside" in entry for entry in log), log  # nothing gathered
