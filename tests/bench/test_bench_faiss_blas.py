"""bench/faiss_blas.py at tiny sizes (``--dry-run``): it runs, and says which way each threshold takes."""

from tests.support.bench import dry_run


def test_faiss_blas_bench_dry_run():
    record = dry_run("faiss_blas.py", timeout=300)[-1]
    assert record["threads"] == 1 and record["thresholds"] == {"default": 128_000, "needle": 1024}
    cases = {(c["d"], c["nq"]): c for c in record["cases"]}
    assert set(cases) == {(64, 1), (64, 8), (256, 1), (256, 8)}
    assert cases[(64, 1)]["needle_takes"] == "loop" and cases[(256, 8)]["needle_takes"] == "product"
    assert all(c["faiss_default_takes"] == "loop" for c in cases.values())
    for c in cases.values():
        assert c["loop_ms_per_query"] > 0 and c["product_ms_per_query"] > 0 and c["needle_vs_best"] >= 1.0
