"""Self-contained shard directories: a sharded index answers exactly like one shard and like an
exact search (ties included), every lookup is routed to the owning shard, a shard directory
opens by itself anywhere, broken shard files are named, and indexes built before shard
directories are refused, naming ``needle index build``."""

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest

from index.build.stage import INFOS_FILE, SHARD_INFOS_FILE, IndexConfig, main
from index.errors import IndexFileError, OldIndexLayoutError, UnknownKeyError
from index.locals import read_token_records
from index.search import load_index
from index.shard import open_shard
from index.shard_files import shard_names, verify_shard
from ingest.descriptors import (
    DescriptorFileError,
    make_row_id,
    write_parquet_atomic,
)
from tests.support.index import clustered_unit_vectors, to_old_layout, token_table

SIZES = {0: 60, 1: 45, 2: 70, 5: 50}  # Parquet shard id -> rows (ids need not be consecutive)
D = 16
CODE_BYTES = 16
IVF = IndexConfig(recall_target=None, kind="ivfpq", nlist=8, pq_bytes=4, points_per_list=20, nprobe=3, refine_factor=2)


@pytest.fixture(scope="module")
def collection(tmp_path_factory):
    """Four Parquet files with local tokens (0-5 per row), duplicated vectors across files (exact
    ties between rows of different shards) and one NaN descriptor (rejected)."""
    directory = tmp_path_factory.mktemp("shards") / "desc"
    rng = np.random.default_rng(7)
    vectors = {s: clustered_unit_vectors(n, D, seed=s) for s, n in SIZES.items()}
    vectors[2][:10] = vectors[0][:10]  # ties across shards
    vectors[5][3] = vectors[1][4]
    vectors[1][5, 0] = np.nan
    rows, xb = [], []
    for s, n in SIZES.items():
        tokens = [int(t) for t in rng.integers(0, 6, n)]
        codes = [rng.integers(0, 256, (t, CODE_BYTES), dtype=np.uint8) for t in tokens]
        table = token_table(s, vectors[s], codes, rng)
        write_parquet_atomic(table, directory / f"{s:06d}.parquet")
        rows += [make_row_id(s, i) for i in range(n)]
        xb.append(vectors[s])
    (directory / "ingest_info.json").write_text(
        json.dumps({"extractors": [{"extractor": "local", "scales": [1.0, 0.5]}]})
    )
    return directory, np.array(rows), np.concatenate(xb).astype(np.float32)


@pytest.fixture(scope="module")
def built(collection, tmp_path_factory):
    """Each configuration built once: flat and IVF-PQ with 1, 2 and 4 shards."""
    desc, _, _ = collection
    work = tmp_path_factory.mktemp("built")
    out = {}
    for kind, conf in (("flat", IndexConfig(kind="flat")), ("ivfpq", IVF)):
        for shards in (1, 2, 4):
            out[kind, shards] = main(replace(conf, shards=shards), desc, work / f"{kind}_{shards}")
    out["ivfpq", "2x4"] = main(replace(IVF, shards=2, parts=4), desc, work / "ivfpq_2x4")
    return out


def queries(xb):
    xq = xb[::7].copy()
    xq[np.isnan(xq)] = 0
    return np.ascontiguousarray(xq, dtype=np.float32)


def test_layout_is_shard_directories_listed_by_the_top_level_infos(built):
    out = built["ivfpq", 4]
    infos = json.loads((out / INFOS_FILE).read_text())
    assert [s["name"] for s in infos["shards"]] == shard_names(infos) == [f"shard_{i:03d}" for i in range(4)]
    assert sum(s["rows"] for s in infos["shards"]) == infos["rows"] == sum(SIZES.values())
    assert sum(s["ntotal"] for s in infos["shards"]) == infos["ntotal"] == sum(SIZES.values()) - 1
    assert [s["parquet_shard_ids"] for s in infos["shards"]] == [[0], [1], [2], [5]]
    assert "shard_offsets" not in infos and "segments" not in infos["locals"]
    assert not any(p.is_file() and p.name != INFOS_FILE for p in out.iterdir())  # nothing shared at the top
    for entry in infos["shards"]:
        shard = json.loads((out / entry["name"] / SHARD_INFOS_FILE).read_text())
        assert shard["rows"] == entry["rows"] and shard["dim"] == D and shard["factory"] == infos["factory"]
        assert [f["offset"] for f in shard["files"]] == [0]  # shard-local positions
        assert entry["bytes"] == sum(c["bytes"] for c in shard["checksums"].values())
        assert sorted(p.name for p in (out / entry["name"]).iterdir()) == sorted(
            [*shard["checksums"], SHARD_INFOS_FILE]
        )
        assert verify_shard(out / entry["name"])["shard"] == int(entry["name"][-3:])


@pytest.mark.parametrize("kind", ["flat", "ivfpq"])
def test_sharded_answers_equal_one_shard_exactly_ties_included(built, collection, kind):
    _, _, xb = collection
    xq = queries(xb)
    one = load_index(built[kind, 1])
    others = [load_index(built[kind, 2]), load_index(built[kind, 4])]
    if kind == "ivfpq":
        others.append(load_index(built[kind, "2x4"]))
    for nprobe, factor in ((None, None), (1, 1), (8, 4)):
        D1, I1 = one.search(xq, 25, nprobe, refine_factor=factor)
        for other in others:
            D2, I2 = other.search(xq, 25, nprobe, refine_factor=factor)
            np.testing.assert_array_equal(I1, I2)
            # re-scored in other blocks per shard: to the bit all the same (float16_inner_products)
            np.testing.assert_array_equal(D1, D2)
    # Ties: the duplicated rows come out together, the lower row id first.
    D, I = others[1].search(xb[:1], 3)
    assert I[0, 0] == make_row_id(0, 0) and I[0, 1] == make_row_id(2, 0) and D[0, 0] == D[0, 1]


def test_flat_shards_equal_an_exact_search(built, collection):
    _, rows, xb = collection
    valid = np.isfinite(xb).all(1)
    xq = queries(xb)
    D, I = load_index(built["flat", 4]).search(xq, 30)
    scores = xq @ np.where(valid[:, None], xb, 0).T
    scores[:, ~valid] = -np.inf
    for q in range(len(xq)):
        order = np.lexsort((rows, -scores[q]))[:30]
        np.testing.assert_allclose(D[q], scores[q, order], rtol=1e-5, atol=1e-5)
        assert set(I[q][D[q] > scores[q, order][-1] + 1e-5]) <= set(rows[order])
        tied = np.abs(np.diff(D[q])) < 1e-6  # within a tie, the lower row id first
        assert (np.diff(I[q])[tied & (np.abs(np.diff(scores[q, order])) < 1e-6)] > 0).all()


def test_lookups_are_routed_to_the_owning_shard(built, collection):
    desc, rows, _ = collection
    one, four = load_index(built["ivfpq", 1]), load_index(built["ivfpq", 4])
    I = np.concatenate([rows, [-1]]).reshape(2, -1)
    assert four.keys_of(I) == one.keys_of(I)
    assert four.keys_of(I)[0][:2] == ["000000/00000", "000000/00001"] and four.keys_of(I)[1][-1] is None
    np.testing.assert_array_equal(four.positions_of_rows(I), one.positions_of_rows(I))
    for key in ["000000/00000", "000002/00069", "000005/00003", "000001/00044"]:
        assert four.position_of(key) == one.position_of(key)
        np.testing.assert_array_equal(four.vector_of(key), one.vector_of(key))
    for index in (one, four):
        with pytest.raises(UnknownKeyError, match="no valid descriptor"):
            index.vector_of("000001/00005")
        with pytest.raises(UnknownKeyError, match="not in the index"):
            index.position_of("000003/00000")
    # Vectors by position, array of positions and slice: the same values as one shard's file.
    np.testing.assert_array_equal(four.vectors[::13], one.vectors[::13])
    positions = np.array([[0, 200, 59], [60, 224, 104]])
    np.testing.assert_array_equal(four.vectors[positions], one.vectors[positions])
    np.testing.assert_array_equal(four.vectors[175], one.vectors[175])
    assert four.vectors.shape == one.vectors.shape and four.d == D
    # Local tokens: equal to the Parquet files' records, through every shard.
    expected = []
    for path in sorted(desc.glob("*.parquet")):
        offsets, records = read_token_records(path)
        expected += [records[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
    store = four.local_store
    assert len(store.segments) == 4
    for position in range(len(expected)):
        assert store.records(position).tobytes() == expected[position].tobytes()
    picks = np.array([3, -1, 70, 120, 224, 0])
    a, b = four.local_store.batch(picks, length=4), one.local_store.batch(picks, length=4)
    for field in ("codes", "xy", "scale", "weight", "mask"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))


def test_a_shard_directory_opens_by_itself_elsewhere(built, collection, tmp_path):
    _, rows, xb = collection
    out = built["ivfpq", 4]
    index = load_index(out)
    shutil.copytree(out / "shard_002", tmp_path / "elsewhere" / "shard_002")
    alone = open_shard(tmp_path / "elsewhere", "shard_002")
    assert alone.ntotal == index.shards[2].ntotal == SIZES[2]
    xq = queries(xb)
    for got, want in zip(alone.search(xq, 12), index.shards[2].search(xq, 12)):
        np.testing.assert_array_equal(got, want)
    its_rows = rows[(rows >> 32) == 2]
    assert alone.keys_of(its_rows[None, :5]) == [[f"000002/{i:05d}" for i in range(5)]]
    np.testing.assert_array_equal(alone.positions_of_rows(its_rows), np.arange(SIZES[2]))
    whole = index.local_store.batch(index.positions_of_rows(its_rows), length=6)
    own = alone.local_store.batch(alone.positions_of_rows(its_rows), length=6)
    np.testing.assert_array_equal(whole.codes, own.codes)
    np.testing.assert_array_equal(alone.vectors, index.vectors[index.positions_of_rows(its_rows)])


@pytest.mark.parametrize(
    ("name", "damage", "message"),
    [
        ("key_order.npy", "delete", "key_order.npy is missing"),
        ("vectors.f16.npy", "truncate", "vectors.f16.npy has .* bytes"),
        ("locals_001.tokens.bin", "truncate", "locals_001.tokens.bin has .* bytes"),
        ("index.faiss", "garbage", "index.faiss"),
        (SHARD_INFOS_FILE, "delete", f"no {SHARD_INFOS_FILE}"),
        (SHARD_INFOS_FILE, "garbage", f"cannot read {SHARD_INFOS_FILE}"),
        ("", "delete", "directory is missing"),
    ],
)
def test_broken_shard_files_are_named(built, tmp_path, name, damage, message):
    out = tmp_path / "index"
    shutil.copytree(built["ivfpq", 2], out)
    path = out / "shard_001" / name
    if damage == "delete":
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:-7])
    else:
        size = path.stat().st_size
        path.write_bytes(b"x" * size)  # same size: caught when it is read
    with pytest.raises(IndexFileError, match=rf"shard_001.*{message}"):
        load_index(out)


def test_verify_shard_checks_every_byte(built, tmp_path):
    shard = tmp_path / "shard_000"
    shutil.copytree(built["flat", 2] / "shard_000", shard)
    data = bytearray((shard / "keys.bin").read_bytes())
    data[0] ^= 1  # same size: only the SHA-256 sees it
    (shard / "keys.bin").write_bytes(bytes(data))
    with pytest.raises(IndexFileError, match=r"shard_000.*keys\.bin does not match its SHA-256"):
        verify_shard(shard)


@pytest.mark.parametrize("shards", [1, 2])
def test_an_index_built_before_shard_directories_is_refused_naming_the_rebuild(built, collection, tmp_path, shards):
    """No reader opens the layout built before shard directories: one typed error naming the
    directory and the command that rebuilds it from the descriptors it records."""
    desc = collection[0]
    old = to_old_layout(built["ivfpq", shards], tmp_path / "old")
    assert json.loads((old / INFOS_FILE).read_text())["descriptors"] == [str(desc)]
    with pytest.raises(OldIndexLayoutError) as refused:
        load_index(old)
    assert str(refused.value) == (
        f'index {old} was built before shard directories (its {INFOS_FILE} has no "layout": '
        f'"shard-directories"), a layout needle no longer reads: rebuild it with '
        f"`needle index build --descriptors {desc} --out {old}`"
    )
    with pytest.raises(OldIndexLayoutError, match=f"--out {old}"):
        load_index(old, with_shards=False)
    top = "index.faiss" if shards == 1 else "shard_001.faiss"  # a shard is a directory, never a top-level file
    with pytest.raises(IndexFileError, match=f"{top}.*no {SHARD_INFOS_FILE}"):
        open_shard(old, top)


def test_the_rebuild_named_without_recorded_descriptors_and_a_directory_that_is_no_index(built, tmp_path):
    old = to_old_layout(built["ivfpq", 1], tmp_path / "old")
    infos = json.loads((old / INFOS_FILE).read_text())
    (old / INFOS_FILE).write_text(json.dumps({k: v for k, v in infos.items() if k != "descriptors"}))
    with pytest.raises(OldIndexLayoutError, match=f"--descriptors <its descriptor directories> --out {old}`"):
        load_index(old)
    (old / INFOS_FILE).unlink()  # ids.arrow, vectors and FAISS files, but no index_infos.json
    with pytest.raises(IndexFileError) as refused:
        load_index(old)
    assert not isinstance(refused.value, OldIndexLayoutError)
    assert str(refused.value) == f"{old} is not an index (no {INFOS_FILE}): build one with `needle index build`"
    with pytest.raises(IndexFileError, match="is not an index"):
        load_index(tmp_path / "nothing here")


@pytest.mark.parametrize("seed", range(6))
def test_trimmed_shortlists_merge_to_the_same_answer(seed):
    """Shards searched together re-score only their members of their joint shortlist: the merge
    of the trimmed parts, re-scored, equals the merge of every part re-scored in full (coarse
    scores: many ties; padding)."""
    from index.build.merge import merge_shortlists, trim_to_shortlist

    rng = np.random.default_rng(seed)
    nq, kk, k = 4, 12, 5
    exact_of = {}  # a row's exact score: whatever re-scores it, wherever

    def rescored(D, rows):
        return np.array([[exact_of.get(i, -np.inf) for i in row] for row in rows.tolist()], np.float32)

    parts = []
    for shard in range(int(rng.integers(2, 5))):
        width = int(rng.integers(1, 2 * kk))
        D = rng.integers(0, 6, (nq, width)).astype(np.float32)  # few values: ties across shards
        rows = (np.int64(shard) << 32) + rng.permutation(10 * kk)[: width * nq].reshape(nq, width)
        rows[rng.random((nq, width)) < 0.15] = -1  # padding of short lists
        D[rows < 0] = -np.inf
        for i, d in zip(rows.ravel().tolist(), D.ravel().tolist()):
            exact_of.setdefault(i, round(d + float(rng.normal(0, 1)), 1)) if i >= 0 else None
        parts.append((D, rows))
    trimmed = trim_to_shortlist(parts, kk)
    full = merge_shortlists([(D, rows, rescored(D, rows)) for D, rows in parts], kk, k)
    short = merge_shortlists([(D, rows, rescored(D, rows)) for D, rows in trimmed], kk, k)
    np.testing.assert_array_equal(full[1], short[1])
    np.testing.assert_array_equal(full[0], short[0])
    assert all((p[1] >= 0).sum(1).max() <= kk for p in trimmed)  # what is re-scored: kk rows per query
    assert ((np.concatenate([p[1] for p in trimmed], 1) >= 0).sum(1) <= kk).all()
    assert all(np.isneginf(D[rows < 0]).all() for D, rows in trimmed)


@pytest.mark.parametrize("d", [3, 24, 128, 768])
def test_a_rows_exact_score_does_not_depend_on_the_rows_beside_it(d):
    """Re-scoring: a row's float16 inner product is the same to the bit whichever rows share its
    block (how the index is sharded and served decides that), and equals a float64 reference."""
    from index.build.merge import float16_inner_products

    rng = np.random.default_rng(d)
    block = rng.normal(size=(600, d)).astype(np.float16)
    x = rng.normal(size=d).astype(np.float32)
    whole = float16_inner_products(block, x)
    np.testing.assert_allclose(whole, block.astype(np.float64) @ x.astype(np.float64), rtol=1e-5, atol=1e-5)
    for size in (1, 2, 5, 8, 9, 31, 200):
        picks = rng.choice(len(block), size, replace=False)
        np.testing.assert_array_equal(float16_inner_products(block[picks], x), whole[picks])


def test_long_shortlists_are_re_scored_in_chunks_with_the_same_scores(monkeypatch):
    """inner_products_at reads a query's rows in chunks of RESCORE_CHUNK (memory bounded however
    long the shortlist a request asks): every score as in one block, padding still -inf."""
    import index.build.merge as merge

    rng = np.random.default_rng(3)
    vectors = rng.normal(size=(500, 16)).astype(np.float16)
    xq = rng.normal(size=(3, 16)).astype(np.float32)
    positions = rng.integers(0, 500, size=(3, 250))
    positions[:, ::7] = -1
    whole = merge.inner_products_at(vectors, positions, xq)
    monkeypatch.setattr(merge, "RESCORE_CHUNK", 33)
    np.testing.assert_array_equal(merge.inner_products_at(vectors, positions, xq), whole)
    assert np.isneginf(whole[:, ::7]).all() and np.isfinite(whole[positions >= 0]).all()


def test_a_one_part_shard_adopts_its_parts_files_as_a_merge_would_write_them(tmp_path):
    """A shard made of one part (every ``needle index add`` segment) renames the part's index and
    vectors into place: the same vectors and the same answers as merging them through copies; a
    part whose vectors have the wrong shape is refused, naming it."""
    import faiss

    from index.build.shard import adopt_part, concatenate_vectors, merge_parts
    from index.layout import INDEX_FILE, VECTORS_FILE

    xb = clustered_unit_vectors(600, 16, seed=4).astype(np.float32)
    index = faiss.index_factory(16, "IVF8,PQ4x4fsr", faiss.METRIC_INNER_PRODUCT)
    index.train(xb)
    index.add_with_ids(xb, np.arange(600, dtype=np.int64) * 3)
    answers = {}
    for name in ("adopted", "merged"):
        directory = tmp_path / name
        directory.mkdir()
        faiss.write_index(index, str(directory / "part_000.faiss"))
        np.save(directory / "part_000.vectors.f16.npy", xb.astype(np.float16))
        if name == "adopted":
            assert adopt_part(directory / "part_000.faiss", directory / "part_000.vectors.f16.npy", directory, 16) == (
                600,
                600,
            )
            assert sorted(p.name for p in directory.iterdir()) == sorted([INDEX_FILE, VECTORS_FILE])
        else:
            assert merge_parts([str(directory / "part_000.faiss")], directory / INDEX_FILE) == 600
            assert concatenate_vectors([directory / "part_000.vectors.f16.npy"], directory / VECTORS_FILE, 16) == 600
        answers[name] = faiss.read_index(str(directory / INDEX_FILE)).search(xb[:20], 10)
        np.testing.assert_array_equal(np.load(directory / VECTORS_FILE), xb.astype(np.float16))
    np.testing.assert_array_equal(answers["adopted"][1], answers["merged"][1])
    np.testing.assert_array_equal(answers["adopted"][0], answers["merged"][0])

    wrong = tmp_path / "wrong"
    wrong.mkdir()
    faiss.write_index(index, str(wrong / "part_000.faiss"))
    np.save(wrong / "part_000.vectors.f16.npy", xb[:, :8].astype(np.float16))
    with pytest.raises(DescriptorFileError, match=r"shape \(600, 8\)"):
        adopt_part(wrong / "part_000.faiss", wrong / "part_000.vectors.f16.npy", wrong, 16)
    assert not (wrong / INDEX_FILE).exists()  # nothing renamed into place
