"""The framework-free checks every checkpoint reader relies on, one mechanism at a time.

Canonical JSON, plain file names and the symlink policy, the manifest, the
pickle opcode scan, the layout checks (chunks tiling a shape, byte ranges
filling a file, key paths building one bounded nesting), and the safetensors
file reader (safetensors' parser, and what fullshard checks on top of it).
"""
import collections
import hashlib
import io
import os
import pickle
import struct
import tracemalloc

import numpy as np
import pytest

from fullshard.checkpoint import manifest
from fullshard.checkpoint.formats.safetensors_file import Array, TensorFile, TensorFileError, save_file
from fullshard.checkpoint.files import plain_file_name, read_whole, regular_file
from fullshard.checkpoint.manifest import dumps_canonical, loads_canonical
from fullshard.checkpoint.untrusted import CheckpointError, check_key_paths, check_pickle, check_ranges, check_tiling

CKPT = "/ckpt/step_1"


# ---------------------------------------------------------------------- the error
def test_checkpoint_error_is_a_value_error_naming_checkpoint_and_file():
    error = CheckpointError.at(CKPT, "is cut short", "rank_1.safetensors")
    assert isinstance(error, ValueError)
    assert str(error) == f"checkpoint {CKPT}, file rank_1.safetensors: is cut short"
    assert (error.checkpoint, error.file) == (CKPT, "rank_1.safetensors")
    again = pickle.loads(pickle.dumps(error))  # DCP sends a rank's failure to the others pickled
    assert str(again) == str(error) and again.file == error.file


# ---------------------------------------------------------------------- canonical JSON
def test_canonical_json_round_trips_and_refuses_every_other_spelling():
    document = {"b": [1, None, True], "a": {"y": "z"}}
    data = dumps_canonical(document)
    assert data == b'{"a":{"y":"z"},"b":[1,null,true]}'
    assert loads_canonical(data, CKPT, "f.json") == document
    for other in (b'{"a": {"y":"z"},"b":[1,null,true]}',  # a space
                  b'{"b":[1,null,true],"a":{"y":"z"}}',  # key order
                  b'{"a":{"y":"z"},"a":{"y":"z"},"b":[1,null,true]}',  # a duplicated key
                  data + b"\n", b'{"a":NaN}', b'{"a":1e0}', '{"a":"\u00e9"}'.encode(),
                  b"[" * 100_000 + b"]" * 100_000, b"\xff", b""):
        with pytest.raises(CheckpointError, match="f.json") as caught:
            loads_canonical(other, CKPT, "f.json")
        assert CKPT in str(caught.value)


# ---------------------------------------------------------------------- names and files
@pytest.mark.parametrize("name", ["", ".", "..", "/etc/passwd", "../step_2/__0_0.distcp", "a/b", "a\\b", "C:x",
                                  "x\0y", "x" * 256, 7, None, b"__0_0.distcp"])
def test_names_that_are_not_plain_file_names_are_refused(name):
    with pytest.raises(CheckpointError, match="not a plain file name inside the checkpoint directory"):
        plain_file_name(name, CKPT, "storage file")


def test_plain_file_names_pass():
    for name in ("__0_0.distcp", ".metadata", "rank_3.safetensors", "a..b"):
        assert plain_file_name(name, CKPT, "storage file") == name


def test_symlinks_inside_a_checkpoint_are_refused_wherever_they_point(tmp_path):
    (tmp_path / "data").write_bytes(b"1234")
    (tmp_path / "inside").symlink_to(tmp_path / "data")
    (tmp_path / "sub").mkdir()
    assert regular_file(tmp_path, "data", CKPT).st_size == 4
    with pytest.raises(CheckpointError, match="file inside: is a symlink"):
        regular_file(tmp_path, "inside", CKPT)
    with pytest.raises(CheckpointError, match="is not a regular file"):
        regular_file(tmp_path, "sub", CKPT)
    with pytest.raises(CheckpointError, match="file absent: is missing"):
        regular_file(tmp_path, "absent", CKPT)
    with pytest.raises(CheckpointError, match="more than the 3"):
        read_whole(tmp_path, "data", CKPT, 3)


# ---------------------------------------------------------------------- the manifest
@pytest.fixture
def listed(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"alpha" * 100)
    (tmp_path / "b.bin").write_bytes(b"")
    manifest.write(tmp_path, "torch", "save-1")
    return tmp_path


def test_manifest_lists_size_and_sha256_of_every_file(listed):
    written = manifest.verify(listed, "torch")
    assert written.files == {"a.bin": (500, hashlib.sha256(b"alpha" * 100).hexdigest()),
                             "b.bin": (0, hashlib.sha256(b"").hexdigest())}
    assert written.save_id == "save-1"


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "a.bin").write_bytes(b"alphA" + b"alpha" * 99), "file a.bin: does not match the SHA-256"),
    (lambda d: (d / "a.bin").write_bytes(b"alpha" * 99), "file a.bin: is 495 bytes, the manifest says 500"),
    (lambda d: (d / "b.bin").unlink(), "file b.bin: is missing"),
    (lambda d: (d / "c.bin").write_bytes(b"x"), "file c.bin: is not listed in the manifest"),
    (lambda d: (d / manifest.MANIFEST_FILE).unlink(), "is missing"),
], ids=["flipped", "truncated", "deleted", "added", "no manifest"])
def test_a_changed_directory_fails_verification(listed, damage, message):
    damage(listed)
    with pytest.raises(CheckpointError, match=message):
        manifest.verify(listed, "torch")


def test_a_symlink_to_an_identical_copy_is_refused(listed, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside") / "a.bin"
    outside.write_bytes((listed / "a.bin").read_bytes())
    (listed / "a.bin").unlink()
    (listed / "a.bin").symlink_to(outside)  # same bytes, same digest: refused for being a link
    with pytest.raises(CheckpointError, match="file a.bin: is a symlink"):
        manifest.verify(listed, "torch")


def test_the_manifest_checks_its_own_digest_and_framework(listed):
    path = listed / manifest.MANIFEST_FILE
    document = loads_canonical(path.read_bytes(), CKPT, "m")
    document["save_id"] = "save-2"  # any field changed: the digest no longer matches
    path.write_bytes(dumps_canonical(document))
    with pytest.raises(CheckpointError, match="does not match its own digest"):
        manifest.verify(listed)
    manifest.write(listed, "torch", "save-1")
    with pytest.raises(CheckpointError, match="is a torch checkpoint, not a mindspore one"):
        manifest.verify(listed, "mindspore")


# ---------------------------------------------------------------------- safetensors files
BF16_BITS = np.array([[0x3F80, 0x4000, 0xC040], [0x0000, 0x7F80, 0x0001]], np.uint16)  # 1, 2, -3, 0, inf, tiny


def _tensors():
    return {"w": Array(np.arange(12, dtype=np.float32).reshape(3, 4), "float32"), "b": Array(BF16_BITS, "bfloat16"),
            "step": Array(np.array(7, np.int64), "int64"), "empty": Array(np.zeros((0, 4), np.float16), "float16")}


def _with_header(path, change):
    """``path`` rewritten with its header changed by ``change`` (canonical and padded, as fullshard writes one)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = loads_canonical(raw[8:8 + length].rstrip(b" "), CKPT, "h")
    change(header)
    encoded = dumps_canonical(header)
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + raw[8 + length:])


def test_a_safetensors_file_round_trips_bf16_scalars_empties_and_slices(tmp_path):
    save_file(_tensors(), tmp_path / "f.safetensors", {"slices": "{}"})
    read = TensorFile(tmp_path / "f.safetensors")
    assert read.names() == ["b", "empty", "step", "w"] and read.metadata == {"slices": "{}"}
    for name, array in _tensors().items():
        got = read.read(name)
        assert got.dtype == array.dtype and got.data.shape == array.data.shape and np.array_equal(got.data, array.data)
    assert np.array_equal(read.read("w", [(0, 3), (1, 3)]).data, np.arange(12).reshape(3, 4)[:, 1:3])
    assert np.array_equal(read.read("b", [(1, 2), (0, 3)]).data, BF16_BITS[1:2])  # bfloat16: its bits, sliced
    assert read.read("empty", [(0, 0), (0, 4)]).data.shape == (0, 4)


@pytest.mark.parametrize("change, message", [
    (lambda h: h["w"].update(data_offsets=[0, 44]), "is refused by the safetensors parser: .*invalid"),
    (lambda h: h["w"].update(shape=[4, 4]), "is refused by the safetensors parser: .*invalid"),
    (lambda h: h["w"].update(dtype="Q9"), "is refused by the safetensors parser: .*unknown variant"),
    (lambda h: h["w"].pop("shape"), "is refused by the safetensors parser: .*missing field"),
    (lambda h: h["__metadata__"].update(slices=1), "is refused by the safetensors parser: .*expected a string"),
    # what safetensors takes and fullshard does not write
    (lambda h: h["w"].update(extra=1), "tensor 'w': its entry must hold exactly dtype, shape and data_offsets"),
    (lambda h: h["w"].update(dtype="U32"), "tensor 'w': dtype 'U32' is not one fullshard writes"),
], ids=["offsets", "shape", "unknown dtype", "missing field", "metadata type", "extra field", "other dtype"])
def test_a_bad_header_is_a_checkpoint_error_naming_the_file(tmp_path, change, message):
    save_file(_tensors(), tmp_path / "f.safetensors", {"slices": "{}"})
    _with_header(tmp_path / "f.safetensors", change)
    with pytest.raises(TensorFileError, match=f"checkpoint {tmp_path}, file f.safetensors: {message}"):
        TensorFile(tmp_path / "f.safetensors")


def test_a_safetensors_file_that_safetensors_takes_but_fullshard_did_not_write_is_refused(tmp_path):
    """safetensors' own writer: not canonical JSON (its keys in its own order); a cut file: safetensors refuses."""
    from safetensors.numpy import save_file as their_save_file

    their_save_file({"w": np.zeros(3, np.float32)}, str(tmp_path / "theirs.safetensors"))
    with pytest.raises(CheckpointError, match="file theirs.safetensors: is not in the canonical JSON form"):
        TensorFile(tmp_path / "theirs.safetensors")
    save_file(_tensors(), tmp_path / "cut.safetensors")
    (tmp_path / "cut.safetensors").write_bytes((tmp_path / "cut.safetensors").read_bytes()[:-1])
    with pytest.raises(TensorFileError, match="file cut.safetensors: is refused by the safetensors parser"):
        TensorFile(tmp_path / "cut.safetensors")


def test_a_safetensors_file_is_read_without_following_a_symlink(tmp_path):
    save_file(_tensors(), tmp_path / "f.safetensors")
    (tmp_path / "link.safetensors").symlink_to(tmp_path / "f.safetensors")
    with pytest.raises(CheckpointError, match="file link.safetensors: is a symlink"):
        TensorFile(tmp_path / "link.safetensors")


# ---------------------------------------------------------------------- the pickle scan
def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def test_plain_pickles_pass_the_scan():
    value = {"a": (1, 2.5, "x" * 300, None, True, [b"y" * 300]), "b": 10**30, "c": collections.OrderedDict}
    for protocol in range(0, pickle.HIGHEST_PROTOCOL + 1):
        check_pickle(pickle.dumps(value, protocol=protocol), CKPT, ".metadata")


@pytest.mark.parametrize("data, message", [
    (pickle.PROTO + b"\x04" + pickle.BINBYTES8 + struct.pack("<Q", 1 << 40) + b"xx" + pickle.STOP,
     "announces 1099511627776 bytes for BINBYTES8 at byte 2, but only 3 remain"),
    (pickle.PROTO + b"\x04" + pickle.BINUNICODE + struct.pack("<I", 1 << 31) + pickle.STOP,
     "announces 2147483648 bytes for BINUNICODE"),
    (pickle.PROTO + b"\x04" + pickle.NONE + pickle.LONG_BINPUT + struct.pack("<I", 0xFFFFFFFF) + pickle.STOP,
     "memo entry 4294967295"),
    (pickle.PROTO + b"\x04" + pickle.FRAME + struct.pack("<Q", 1 << 40) + pickle.NONE + pickle.STOP, "frame of"),
    (pickle.PROTO + b"\x04" + pickle.BINPERSID + pickle.STOP, "BINPERSID"),
    (pickle.PROTO + b"\x04" + pickle.EXT1 + b"\x01" + pickle.STOP, "EXT1"),
    (pickle.dumps(None) + b"junk", "there are bytes after it"),
    (pickle.dumps({"a": 1})[:-3], "frame of 10 bytes at byte 2, past the end"),
    (pickle.dumps({"a": 1}, protocol=2)[:-1], "ends without STOP"),
    (pickle.PROTO + b"\x04" + b"\xff" + pickle.STOP, "uses byte 0xff"),
    (pickle.PROTO + b"\x04" + pickle.GLOBAL + b"os\nsystem", "cut short"),
], ids=["bytes8 length", "unicode length", "memo index", "frame", "persid", "ext", "trailing", "truncated",
        "truncated protocol 2", "unknown opcode", "global cut short"])
def test_counts_past_the_data_and_foreign_opcodes_are_refused_without_allocating(data, message):
    def scan():
        with pytest.raises(CheckpointError, match=message):
            check_pickle(data, CKPT, ".metadata")

    assert _peak(scan) < 1 << 20


def test_the_unpickler_alone_would_allocate_what_the_scan_refuses():
    """The reason for the scan: CPython allocates a counted string before reading it."""
    data = pickle.PROTO + b"\x04" + pickle.BINBYTES8 + struct.pack("<Q", 64 << 20) + pickle.STOP

    def unpickle():
        with pytest.raises(pickle.UnpicklingError):
            pickle.Unpickler(io.BytesIO(data)).load()

    assert _peak(unpickle) >= 64 << 20


# ---------------------------------------------------------------------- layout checks
def test_chunks_that_tile_a_shape_pass():
    grid = [((r, c), (2, 3)) for r in (0, 2) for c in (0, 3)]
    check_tiling((4, 6), grid, CKPT, "w")
    check_tiling((67, 36), [((0, 0), (34, 36)), ((34, 0), (33, 36))], CKPT, "w")
    check_tiling((0, 5), [], CKPT, "empty")
    check_tiling((), [((), ())], CKPT, "scalar")


@pytest.mark.parametrize("chunks, message", [
    ([((0, 0), (2, 6)), ((1, 0), (3, 6))], "hold 30 elements"),
    ([((0, 0), (2, 6)), ((1, 0), (2, 6))], "overlap"),  # right count, overlapping: a gap elsewhere
    ([((0, 0), (2, 6)), ((3, 0), (2, 6))], "not inside"),
    ([((0, 0), (2, 6)), ((2, -1), (2, 6))], "not inside"),
    ([((0,), (4,))], "not inside"),
    ([((0, 0), (4, 6)), ((0, 0), (4, 6))], "hold 48 elements"),
    ([((0, 0), (10**12, 6))], "not inside"),
], ids=["count", "overlap", "outside", "negative", "dims", "twice", "huge"])
def test_chunks_that_do_not_tile_are_refused(chunks, message):
    with pytest.raises(CheckpointError, match=message):
        check_tiling((4, 6), chunks, CKPT, "w")


def test_byte_ranges_must_fill_their_file_in_order():
    check_ranges("f", 10, [(4, 6, "b"), (0, 4, "a")], CKPT)
    for ranges, message in (([(0, 4, "a"), (5, 5, "b")], "a gap or an overlap"),
                            ([(0, 5, "a"), (4, 6, "b")], "a gap or an overlap"),
                            ([(0, 4, "a")], "end at byte 4, the file has 10"),
                            ([(0, 4, "a"), (4, 7, "b")], "not inside"),
                            ([(-1, 4, "a")], "not inside"),
                            ([(0, 10**12, "a")], "not inside"),
                            ([(0, True, "a")], "not inside")):
        with pytest.raises(CheckpointError, match=message):
            check_ranges("f", 10, ranges, CKPT)


def test_key_paths_build_one_bounded_nesting():
    good = {"m.w": ("model", "w"), "o.0.lr": ("optim", "param_groups", 0, "lr"),
            "o.1.lr": ("optim", "param_groups", 1, "lr")}
    check_key_paths(good, CKPT, ".metadata")
    for bad, message in (
        ({**good, "x": ("optim", "param_groups", 10**12, "lr")}, "indices below 4"),
        ({**good, "x": ("optim", "param_groups", -1, "lr")}, "indices below 4"),
        ({**good, "x": ("optim", "param_groups", "lr")}, "other kind"),
        ({**good, "x": ("model", "w", "again")}, "collides"),
        ({**good, "x": ("model",)}, "collides"),
        ({**good, "x": ("model", "w")}, "collides"),
        ({**good, "x": ("deep",) * 65}, "up to 64"),
        ({**good, "x": ()}, "not a tuple"),
        ({**good, "x": ["model", "v"]}, "not a tuple"),
        ({**good, "x": (0, "v")}, "not a tuple"),
        ({**good, "x": ("model", 1.5)}, "not a tuple"),
        ({**good, "x": ("model", True)}, "not a tuple"),
    ):
        with pytest.raises(CheckpointError, match=message):
            check_key_paths(bad, CKPT, ".metadata")


def test_read_whole_refuses_a_symlink(tmp_path):
    """It opens with O_NOFOLLOW too, so a link swapped in after the check is not followed either."""
    (tmp_path / "real").write_bytes(b"data")
    assert read_whole(tmp_path, "real", CKPT, 100) == b"data"
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(CheckpointError, match="symlink"):
        read_whole(tmp_path, "link", CKPT, 100)
