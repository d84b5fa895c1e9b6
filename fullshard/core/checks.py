"""What ``fully_shard`` checks, written once for both runtimes: its arguments and the parameters it takes over,
before it changes anything; and, at the root's first forward, that every rank set it up alike.

Each argument check raises with a message that names the module (or cell) and the parameter, what is wrong
and the fix. A runtime passes its own exception type where its users' code expects one (torch's FSDP2 raises
``AssertionError`` subclasses in some places), and the words of its framework ("forward" or "construct").

Do all ranks hold the same model, set up the same way? A fixed-size check both runtimes run alike, with sums
only. Each rank describes what it wrapped as :class:`Row` s, one per setting that changes what or how the
ranks communicate (:func:`describe_model`: a unit's strategy and dtypes, a group's mesh, exchange and fusion,
a parameter's shape, shard dim, dtypes and trainability, ...), and hashes them (SHA-256). The ranks then sum,
per piece of the hash, the piece and its square, and a 1 (which counts them). All ranks hold the same piece
``p`` exactly when the sum of ``(x - p) ** 2`` over them, ``sum(x*x) - 2*p*sum(x) + n*p*p``, is zero; every
rank sees the same sums, so every rank sees a disagreement, whichever rank differs.

Nothing is unpickled and nothing but a float sum travels, so the check runs on every backend and group
(MindSpore's CPU backend sums float32 only, and gathers on the world group only). Pieces are small enough
that every sum is an integer a float32 carries exactly (below 2**24). The size of every vector follows from
the world size and from what earlier sums told every rank alike, never from a rank's own settings, so ranks
that disagree still exchange vectors of one size and end the check together. Only when the hashes differ,
three more sums find and name the first setting that differs: the number of rows of every rank (each rank
writes its own slot), the first row whose CRC32 differs, and that row's text from every rank, so every rank
raises one error naming the setting and each rank's value. (:class:`Ranks` and :func:`gather_texts` serve the
checkpoint's shared failures too.)
"""
from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence, Union

from fullshard.core.unit import UNIT_ATTR, Named
from fullshard.plan.group import Strategy

# A sum of float32 values over every rank that holds the model: what each runtime supplies.
SumOverRanks = Callable[[list[float]], list[float]]
_EXACT = 1 << 24  # integers up to this are exact in float32
_TEXT_BYTES = 256  # how much of each rank's differing row travels to the others
_SEPARATOR = "\x1f"  # between a row's fields in its text (in no name or value)


class RanksDisagree(RuntimeError):
    """Ranks wrapped different models, or set up fully_shard differently."""


class Row(NamedTuple):
    """One setting every rank must hold alike: ``setting`` of ``subject`` (e.g. "module 'layers.0'") is ``value``."""

    subject: str
    setting: str
    value: str

    @classmethod
    def of(cls, subject: str, setting: str, value: Any) -> "Row":
        return cls(subject, setting, str(value))

    def text(self) -> str:
        return _SEPARATOR.join(self)

    def __str__(self) -> str:
        return f"{self.setting} of {self.subject} = {self.value}"


@dataclass(frozen=True)
class Ranks:
    """How a runtime reaches the ranks that hold the model.

    ``sum`` adds a vector over all of them (one all-reduce on a group that spans them, or one per mesh dim);
    ``slot`` is this rank's place among ``slots``, an upper bound on their number that does not depend on
    any setting (the world rank and size), so every rank can write its own entries into one shared vector.
    """

    sum: SumOverRanks
    slot: int
    slots: int


def _piece_bits(slots: int) -> int:
    """The widest pieces (8, 4, 2 or 1 bits) whose squares summed over ``slots`` ranks stay exact in float32."""
    for bits in (8, 4, 2, 1):
        if slots * ((1 << bits) - 1) ** 2 < _EXACT:
            return bits
    raise ValueError(f"{slots} ranks are too many to compare in float32 sums")


def _pieces(data: bytes, bits: int) -> list[int]:
    per_byte, mask = 8 // bits, (1 << bits) - 1
    return [(byte >> (bits * i)) & mask for byte in data for i in range(per_byte)]


def _same(ranks: Ranks, pieces: Sequence[int]) -> list[bool]:
    """Per piece: does every rank hold this rank's value? (One sum over the ranks.)"""
    count = len(pieces)
    total = [int(x) for x in ranks.sum([1.0] + [float(p) for p in pieces] + [float(p * p) for p in pieces])]
    n = total[0]
    return [total[1 + count + i] - 2 * p * total[1 + i] + n * p * p == 0 for i, p in enumerate(pieces)]


def alone() -> Ranks:
    """This process by itself (no process group): nothing to compare or tell."""
    return Ranks(lambda values: values, 0, 1)


def _gather(ranks: Ranks, mine: Sequence[int], width: int) -> list[list[int]]:
    """Every slot's ``width`` small integers (this rank writes its own slot, the sum fills the rest; a slot no
    rank holds stays zeros)."""
    vector = [0.0] * (ranks.slots * width)
    vector[ranks.slot * width:ranks.slot * width + len(mine)] = [float(v) for v in mine]
    total = [int(x) for x in ranks.sum(vector)]
    return [total[slot * width:(slot + 1) * width] for slot in range(ranks.slots)]


def gather_texts(ranks: Ranks, text: str, width: int) -> list[str]:
    """Every slot's ``text``, its first ``width`` UTF-8 bytes (cut short: marked "...", and on a whole
    character); an empty string for a slot no rank holds. Every rank must call it."""
    mine = list(text.encode()[:width])
    return [_decoded(codes, width) for codes in _gather(ranks, mine, width)]


def _decoded(codes: Sequence[int], width: int) -> str:
    raw = bytes(codes).rstrip(b"\0")
    return raw.decode(errors="ignore") + ("..." if len(raw) == width else "")


def _ranks_text(slots: Sequence[int]) -> str:
    """[0, 2, 3, 4] -> "ranks 0, 2-4"."""
    spans: list[list[int]] = []
    for slot in slots:
        if spans and spans[-1][1] == slot - 1:
            spans[-1][1] = slot
        else:
            spans.append([slot, slot])
    joined = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank{'s' if len(slots) > 1 else ''} {joined}"


class Fingerprint:
    """What one rank wrapped, as rows, and the sums that compare it with the other ranks'."""

    def __init__(self, rows: Sequence[Row]) -> None:
        self.rows = list(rows)
        self._texts = [row.text() for row in self.rows]
        header = f"{len(self.rows)} rows\n".encode()
        self.digest = hashlib.sha256(header + "\n".join(self._texts).encode()).digest()

    def agrees(self, ranks: Ranks) -> bool:
        return all(_same(ranks, _pieces(self.digest, _piece_bits(ranks.slots))))

    def difference(self, ranks: Ranks) -> str:
        """The first row some rank holds differently, with every rank's version of it. Every rank must call
        it (it sums three more times), and every rank gets the same answer."""
        held = {slot: count[0] - 1 for slot, count in enumerate(_gather(ranks, [len(self.rows) + 1], 1)) if count[0]}
        index = self._first_differing_row(ranks, min(held.values()))
        mine = self._texts[index] if index < len(self.rows) else ""
        texts = {slot: text for slot, text in enumerate(gather_texts(ranks, mine, _TEXT_BYTES)) if slot in held}
        if len(set(texts.values())) == 1:
            if not mine:
                return "their descriptions hash differently, though no single entry's checksum does"
            return f"ranks disagree on {self.rows[index]}, past its first {_TEXT_BYTES} bytes"
        return _describe_difference(index, texts, held)

    def _first_differing_row(self, ranks: Ranks, shared: int) -> int:
        """The first of the ``shared`` rows every rank holds whose checksum differs somewhere; ``shared`` if none."""
        bits = _piece_bits(ranks.slots)
        per_row = 32 // bits
        checksums = [zlib.crc32(text.encode()).to_bytes(4, "little") for text in self._texts[:shared]]
        same = _same(ranks, [p for checksum in checksums for p in _pieces(checksum, bits)])
        for index in range(shared):
            if not all(same[index * per_row:(index + 1) * per_row]):
                return index
        return shared


def _describe_difference(index: int, texts: dict[int, str], held: dict[int, int]) -> str:
    """Each distinct version of entry ``index`` with the ranks that hold it; the setting named once when every
    rank holds the same setting of the same subject."""
    versions: dict[str, list[int]] = {}
    for slot, text in texts.items():
        versions.setdefault(text, []).append(slot)
    fields = {text: text.split(_SEPARATOR, 2) for text in versions}
    if all(len(f) == 3 for f in fields.values()) and len({tuple(f[:2]) for f in fields.values()}) == 1:
        subject, setting, _ = next(iter(fields.values()))
        values = "; ".join(f"{fields[text][2]} on {_ranks_text(slots)}" for text, slots in versions.items())
        return f"ranks disagree on {setting} of {subject}: {values}"

    def shown(text: str, slot: int) -> str:
        if not text:
            return f"nothing (its description ends after {held[slot]} entries)"
        return str(Row(*fields[text])) if len(fields[text]) == 3 else text.replace(_SEPARATOR, " ")

    described = "; ".join(f"{shown(text, slots[0])} on {_ranks_text(slots)}" for text, slots in versions.items())
    return f"ranks describe different models from entry {index} on: {described}"


def check_ranks_agree(rows: Sequence[Row], ranks: Ranks, hint: str) -> None:
    """Raise :class:`RanksDisagree` on every rank if any rank holds different ``rows``. ``hint`` says what the
    ranks must do alike."""
    if ranks.slots < 2:
        return
    fingerprint = Fingerprint(rows)
    if not fingerprint.agrees(ranks):
        raise RanksDisagree(f"fully_shard: {fingerprint.difference(ranks)}; {hint}")


# Per subject, (setting, value) pairs a runtime adds to the shared ones.
Values = Callable[[Any], dict[str, Any]]


def describe_model(units: Sequence[Any], unit_values: Values, group_values: Values, param_values: Values
                   ) -> list[Row]:
    """The rows of ``units`` (``fullshard.core.unit`` units), in an order where the first
    difference is the cause: a unit's settings, then each group's, then its parameters' layouts (a different
    strategy or fusion changes what follows it).

    The settings both runtimes have are read here: a unit's strategy, resharding, prefetch targets and
    ``mp_policy`` dtypes; a group's lifecycle flags; a parameter's shard dim, dtypes and trainability. The
    ``*_values`` give what only a runtime knows (the mesh, the exchange, fusion, global shapes, placements).
    Units without parameters issue no collective and are left out.
    """
    rows: list[Row] = []
    for unit in units:
        if unit.groups:
            rows += _unit_rows(unit, unit_values(unit))
        for group in unit.groups:
            subject = f"module '{group.module_name}'" + (" (replicated parameters)" if group.replicated else "")
            rows += [Row.of(subject, setting, value) for setting, value in group_values(group).items()]
            rows += [Row.of(subject, setting, value) for setting, value in _group_settings(group).items()]
            for param in group.params:
                settings = {**_param_settings(param), **param_values(param)}
                rows += [Row.of(f"parameter '{param.fqn}'", setting, value) for setting, value in settings.items()]
    return rows


def _unit_rows(unit: Any, runtime_values: dict[str, Any]) -> list[Row]:
    # output_dtype and cast_forward_inputs are left out: they cast activations, never what travels.
    settings = {
        "strategy": unit.strategy.value,
        "reshard_after_forward": unit.reshard_after_forward,
        "param_dtype": unit.mp_policy.param_dtype,
        "reduce_dtype": unit.mp_policy.reduce_dtype,
        **runtime_values,
        # the order of gathers (collective exchanges match by order)
        "forward prefetch": [other.name for other in unit.forward_prefetch],
        "backward prefetch": [other.name for other in unit.backward_prefetch],
    }
    return [Row.of(f"module '{unit.name}'", setting, value) for setting, value in settings.items()]


def _group_settings(group: Any) -> dict[str, Any]:
    """The lifecycle flags a group's methods set (``FSDPModule.set_*``): each decides whether a collective runs."""
    return {
        "reshard_after_backward": group.after_backward.value,
        "unshard_in_backward": group.unshard_in_backward,
        "requires_gradient_sync": group.reduce_grads,
        "requires_all_reduce": group.all_reduce_grads,
        "reduce_scatter_unused_params": group.reduce_unused_params,
    }


def _param_settings(param: Any) -> dict[str, Any]:
    return {
        "shard dim": param.layout.dim,
        "dtype": param.stored_dtype,
        "compute dtype": param.compute_dtype,
        "requires_grad": param.requires_grad,
    }


# ---------------------------------------------------------------------------------------------- arguments
def check_modules(modules: Sequence[Any], name: str, *, is_module: Callable[[Any], bool], kind: str,
                  is_container: Callable[[Any], bool], forward: str, word: str = "module",
                  applied_twice: type = ValueError) -> None:
    """Every module is a module of the framework (``kind``), not a container that is never called, and not
    sharded yet. ``word``: what the framework calls a module ("module", "cell")."""
    for module in modules:
        if not is_module(module):
            raise TypeError(f"fully_shard expects {kind}, got {type(module).__name__}")
        if is_container(module):
            raise ValueError(
                f"fully_shard does not support containers that do not implement {forward}: "
                f"{type(module).__name__} is never called, so its parameters would never be gathered; shard the "
                f"{word}s it holds, or pass them as a list to form one group: fully_shard(list(container), ...)"
            )
        if hasattr(module, UNIT_ATTR):
            raise applied_twice(
                f"Each distinct composable distributed API can only be applied to a module once. fully_shard was "
                f"already applied to {name}; apply it once per {word} (children first, then parents)"
            )


def parse_strategy(strategy: Union[str, Strategy, None], name: str) -> Strategy:
    try:
        return Strategy.parse(strategy if strategy is not None else Strategy.OPTIM_GRADS_PARAMS)
    except ValueError as error:
        raise ValueError(f"fully_shard({name}): {error}") from None


def check_reshard_after_forward(value: Any, name: str, allow_int: bool) -> None:
    allowed = (bool, int) if allow_int else (bool,)
    if value is not None and not isinstance(value, allowed):
        choices = "True, False, None or an int (the size of the group to reshard to after forward)" if allow_int \
            else "True, False or None"
        raise ValueError(f"fully_shard({name}): reshard_after_forward={value!r} must be {choices}")


def check_not_managed(managed: bool, sharded_by_parent: bool, fqn: str, name: str) -> None:
    """A parameter some fully_shard call took over already would be sharded twice and silently untied."""
    if managed and sharded_by_parent:
        raise ValueError(
            f"fully_shard({name}): parameter '{fqn}' is already sharded by fully_shard on a parent module; apply "
            "fully_shard to children first, then to their parents"
        )
    if managed:
        raise ValueError(
            f"fully_shard({name}): parameter '{fqn}' is already managed by another fully_shard unit (it is shared "
            "with a module fully_shard was applied to); tied parameters must belong to one unit: apply fully_shard "
            "to their common parent only, or to both modules as one group: fully_shard([module_a, module_b])"
        )


def shard_dim(placement: Any, shard_type: type, shape: Sequence[int], fqn: str, name: str,
              out_of_range: type = ValueError) -> int:
    """The tensor dim ``shard_placement_fn``'s answer (``Shard(dim)`` or None: dim 0) cuts, negative dims
    counted from the end; a scalar cannot be cut on any dim."""
    if not shape:
        raise ValueError(
            f"fully_shard({name}): parameter '{fqn}' is a scalar and cannot be sharded. Change "
            f"{fqn.rpartition('.')[2]} to a 1D tensor with numel equal to 1, or pass it in ignored_params"
        )
    if placement is None:
        return 0
    if not isinstance(placement, shard_type):
        raise ValueError(
            f"fully_shard({name}): shard_placement_fn returned {placement!r} for '{fqn}'; it must return "
            "Shard(dim) or None"
        )
    ndim = len(shape)
    dim = placement.dim + ndim if placement.dim < 0 else placement.dim
    if not 0 <= dim < ndim:
        raise out_of_range(
            f"Shard dim {placement.dim} is invalid for {ndim}D tensor: fully_shard({name}): shard_placement_fn "
            f"returned Shard({placement.dim}) for '{fqn}' of shape {tuple(shape)}; the dim must be in "
            f"[-{ndim}, {ndim - 1}]"
        )
    return dim


def owners_of_params(
    tops: list[Any],
    own_params: Callable[[Any], Named],
    children: Callable[[Any], Named],
    ignored: frozenset[int] = frozenset(),
) -> tuple[dict[int, list[tuple[Any, str, str]]], dict[int, Any]]:
    """Every (module, attribute name, path) holding each parameter under ``tops``, by ``id``.

    Modules that are units already (their own ``fully_shard`` ran) are skipped with everything below them, and
    so are the parameters in ``ignored``. A parameter held by several modules (tied weights) lists each holder.
    With several tops (one group of several modules), paths start with ``[i].``.
    """
    owners: dict[int, list[tuple[Any, str, str]]] = {}
    params: dict[int, Any] = {}

    def visit(module: Any, prefix: str, is_top: bool) -> None:
        if not is_top and hasattr(module, UNIT_ATTR):
            return
        for name, param in own_params(module):
            if param is None or id(param) in ignored:
                continue
            params[id(param)] = param
            owners.setdefault(id(param), []).append((module, name, prefix + name))
        for child_name, child in children(module):
            if child is not None:
                visit(child, f"{prefix}{child_name}.", False)

    for index, top in enumerate(tops):
        visit(top, f"[{index}]." if len(tops) > 1 else "", True)
    return owners, params
