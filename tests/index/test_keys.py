"""The key lookup files against plain Python: positions -> keys and key -> position."""

import numpy as np
import pyarrow as pa
import pytest

from index.build.stage import IndexConfig, main
from index.errors import UnknownKeyError
from index.keys import KEY_FILES, KEY_OFFSETS_FILE, KEYS_FILE, SLICED_MAX, KeyFileError, KeyStore, write_key_files
from index.search import load_index
from tests.support.index import clustered_unit_vectors, write_descriptor_file


def _random_keys(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    alphabet = list("ab/_-0123456789é猫")  # shared prefixes, '/' and multi-byte characters
    keys = {"".join(rng.choice(alphabet, int(rng.integers(0, 12)))) for _ in range(3 * n)}
    keys = sorted(keys)
    rng.shuffle(keys)
    return keys[:n]


def _store(tmp_path, keys, chunk_size=7):
    chunks = [pa.array(keys[i : i + chunk_size]) for i in range(0, len(keys), chunk_size)]
    assert write_key_files(chunks, tmp_path) == len(keys)
    return KeyStore(tmp_path)


@pytest.mark.parametrize("n", [0, 1, 50, 500])
def test_keys_at_and_position_of_equal_plain_python(tmp_path, n):
    keys = _random_keys(n, seed=n)
    store = _store(tmp_path, keys)
    assert len(store) == n
    rng = np.random.default_rng(1)
    positions = rng.integers(-1, max(n, 1), (4, 9)) if n else -np.ones((2, 3), np.int64)
    expected = [keys[p] if p >= 0 else None for p in positions.reshape(-1)]
    assert store.keys_at(positions) == expected
    where = {key: i for i, key in enumerate(keys)}
    for key in keys:
        assert store.position_of(key) == where[key]
    for absent in ["zzz", "", "a" * 20, "猫猫猫猫猫猫猫猫猫猫猫猫猫"]:
        assert store.position_of(absent) == where.get(absent, -1)


def test_keys_holding_nul_and_the_last_key_come_back_whole(tmp_path):
    """keys_at gathers every key's bytes in one pass, NUL-separated: a key holding a NUL itself (or
    empty keys, or the last key of the file) must still come back as it was written."""
    keys = ["a\0b", "", "\0", "z" * 40, "猫\0é", "last"]
    store = _store(tmp_path, keys, chunk_size=4)
    positions = np.array([5, 0, -1, 1, 2, 4, 3, 5, -1])
    assert store.keys_at(positions) == [keys[p] if p >= 0 else None for p in positions]
    plain = _store(tmp_path / "plain", ["x", "", "yy"])
    assert plain.keys_at(np.array([2, 1, -1, 0, 2])) == ["yy", "", None, "x", "yy"]
    assert plain.keys_at(np.array([1, 1])) == ["", ""] and plain.keys_at(np.array([-1])) == [None]


@pytest.mark.parametrize("count", [1, 7, SLICED_MAX, SLICED_MAX + 1, 3 * SLICED_MAX])
@pytest.mark.parametrize("padding", [False, True])
def test_joined_keys_sliced_and_gathered_equal_plain_python(tmp_path, count, padding):
    """Both ways of joining a shard's keys (sliced one by one without padding up to SLICED_MAX,
    else one numpy gather) give the same buffer and the same keys; a key holding a NUL gives
    None (the caller makes them one by one) and keys_at still answers it whole."""
    keys = [*_random_keys(600, seed=count), "", "x" * 300, "猫"]
    store = _store(tmp_path, keys)
    rng = np.random.default_rng(count)
    positions = rng.integers(0, len(keys), count)
    if padding:
        positions[rng.random(count) < 0.2] = -1
    expected = [keys[p] if p >= 0 else None for p in positions]
    joined = store.joined_keys_at(positions)
    assert joined.split() == expected and joined.count == count
    assert joined.data == b"\0".join(keys[p].encode() if p >= 0 else b"" for p in positions)
    assert store.keys_at(positions) == expected
    with_nul = _store(tmp_path / "nul", ["a\0b", "c"])
    for at in (np.array([1, 0, 1]), np.array([0, -1]), np.zeros(SLICED_MAX + 1, np.int64)):
        assert with_nul.joined_keys_at(at) is None
        assert with_nul.keys_at(at) == [["a\0b", "c"][p] if p >= 0 else None for p in at]
    with pytest.raises(KeyFileError, match="past the"):
        store.joined_keys_at(np.array([0, len(keys)]))


def test_sort_column_given_by_the_caller_gives_the_same_files(tmp_path):
    keys = _random_keys(300, seed=3)
    chunks = [pa.array(keys[i : i + 40]) for i in range(0, len(keys), 40)]
    write_key_files(chunks, tmp_path / "a")
    write_key_files(chunks, tmp_path / "b", sort_keys=pa.chunked_array(chunks))
    for name in KEY_FILES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_sliced_chunks_are_written_from_their_own_offsets(tmp_path):
    keys = _random_keys(60, seed=4)
    whole = pa.array(keys)
    write_key_files([whole.slice(0, 25), whole.slice(25, 35)], tmp_path)
    store = KeyStore(tmp_path)
    assert store.keys_at(np.arange(60)) == keys


def test_null_keys_and_disagreeing_files_are_refused(tmp_path):
    with pytest.raises(KeyFileError, match="null keys"):
        write_key_files([pa.array(["a", None])], tmp_path / "nulls")
    _store(tmp_path / "ok", ["a", "b", "c"])
    (tmp_path / "ok" / KEYS_FILE).write_bytes(b"ab")  # truncated
    with pytest.raises(KeyFileError, match="disagree"):
        KeyStore(tmp_path / "ok")
    (tmp_path / "ok" / KEY_OFFSETS_FILE).unlink()
    with pytest.raises(KeyFileError, match="cannot read"):
        KeyStore(tmp_path / "ok")
    store = _store(tmp_path / "past", ["a", "b"])
    with pytest.raises(KeyFileError, match="past the 2 keys"):
        store.keys_at(np.array([2]))


def test_index_answers_keys_from_its_key_files_like_the_id_table(tmp_path):
    parts = [clustered_unit_vectors(120, 16, seed=s) for s in range(3)]
    for s, xb in enumerate(parts):
        write_descriptor_file(tmp_path / "desc", f"{s:06d}", s, xb)
    out = main(IndexConfig(), tmp_path / "desc", tmp_path / "index")
    index = load_index(out)
    assert index.infos["key_files"] == list(KEY_FILES)
    xq = np.concatenate(parts)[::17]
    _, I = index.search(xq, 30)
    I[:, -3:] = -1  # FAISS's padding
    all_keys = index.ids["key"].to_pylist()
    positions = index.positions_of_rows(I)
    assert index.keys_of(I) == [[all_keys[p] if p >= 0 else None for p in row] for row in positions]
    for key in all_keys[::29]:
        assert index.position_of(key) == all_keys.index(key)
    with pytest.raises(UnknownKeyError):
        index.position_of("not/a-key")
