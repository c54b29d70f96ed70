"""The query side's ``--device``: resolving it (never a silent CPU), the CPU path unchanged by the
device plumbing (AMES logits, Hamming matches, spatial verification's inliers), and, on a CUDA GPU
(``-m gpu``), the GPU path against the CPU: matches and inliers identical, AMES logits within a
stated tolerance and the same order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core.errors import NeedleInputError
from core.tokens import LocalTokens, TokenBatch, unpack_signs
from rerank.ames import AMES, AMESConfig, AMESInputError, score_shortlist, signs_of_codes
from rerank.device import DeviceUnavailableError, resolve_device
from rerank.matching import MatchConfig, asymmetric_weights, match_tokens, matches_from_nearest, nearest_tokens
from rerank.rerank import RerankConfig, Reranker
from rerank.spatial import SpatialConfig, verify, verify_pair
from tests.support.rerank_tokens import realish

CUDA = torch.cuda.is_available()
# AMES in float16 autocast on CUDA against float32 on the CPU: measured on an H100 (published shape,
# scaled random weights, 1,000 candidates) within 1.2e-3, Spearman 0.9993; allowed: this.
AMES_FP16_ATOL = 1e-2


@pytest.fixture(autouse=True)
def one_thread():
    """Small tensors: threads only add overhead (and spin when the CPUs are busy)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def random_ames(seed: int = 0) -> AMES:
    """The published shape with random weights of 0.05 (LayerNorm gains around 1): logits that
    differ from candidate to candidate (the default init's are all ~0), as tests/rerank/test_ames.py does."""
    model = AMES(AMESConfig())
    g = torch.Generator().manual_seed(seed)
    state = {}
    for key, value in model.state_dict().items():
        w = torch.randn(value.shape, generator=g) * 0.05
        gain = ".norm" in key or (key.startswith("remap_local") and value.ndim == 1 and key.endswith("weight"))
        state[key] = 1 + w if gain else w
    model.load_state_dict(state)
    return model.eval()


# --- resolving --device ----------------------------------------------------------------------------


def test_cpu_and_auto_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


def test_cuda_without_a_gpu_is_an_error_naming_the_flag(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceUnavailableError, match="--device cuda"):
        resolve_device("cuda")
    with pytest.raises(NeedleInputError, match="--device"):
        resolve_device("tpu")
    with pytest.raises(DeviceUnavailableError, match="--device"):
        Reranker(RerankConfig(), device="cuda")
    assert Reranker(RerankConfig()).device == torch.device("cpu")  # default: the CPU, as before


def test_query_cli_refuses_cuda_without_a_gpu(monkeypatch, caplog, tmp_path):
    from cli.main import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["query", "--index", str(tmp_path / "none"), "--key", "a/1", "--rerank", "sp"]
    assert main([*argv, "--device", "cuda"]) == 2
    assert "--device cuda" in caplog.text
    caplog.clear()
    assert (
        main(
            ["eval", "map", "--index", str(tmp_path), "--ground-truth", "x.json", "--out", "o.json", "--device", "cuda"]
        )
        == 2
    )
    assert "--device" in caplog.text
    caplog.clear()
    assert main([*argv, "--device", "cpu"]) == 2  # gets past the device: the missing index is the error
    assert "--device" not in caplog.text and "none" in caplog.text


def test_ray_shards_refuse_cuda(caplog, tmp_path):
    from cli.main import main

    argv = ["query", "--index", str(tmp_path), "--key", "a/1", "--rerank", "sp", "--ray-shards", "--device", "cuda"]
    assert main(argv) == 2
    assert "--ray-shards" in caplog.text


# --- the CPU path is unchanged ---------------------------------------------------------------------


def test_signs_of_codes_equal_unpack_signs():
    codes = np.random.default_rng(0).integers(0, 256, (3, 5, 16), dtype=np.uint8)
    np.testing.assert_array_equal(signs_of_codes(torch.from_numpy(codes)).numpy(), unpack_signs(codes))


def old_score_shortlist(model: AMES, query: LocalTokens, batch: TokenBatch, batch_size: int = 64) -> np.ndarray:
    """score_shortlist as it was before the device work: host-unpacked signs, one upload per batch."""
    out = np.empty(len(batch), np.float32)
    with torch.inference_mode():
        q = torch.from_numpy(unpack_signs(query.codes))
        qs, q_pads = q.expand(batch_size, -1, -1), torch.zeros(batch_size, len(query), dtype=torch.bool)
        for start in range(0, len(batch), batch_size):
            stop = min(start + batch_size, len(batch))
            rows = np.r_[np.arange(start, stop), np.full(batch_size - (stop - start), start)]
            tgt = torch.from_numpy(unpack_signs(batch.codes[rows]))
            out[start:stop] = model.forward_codes(qs, q_pads, tgt, torch.from_numpy(~batch.mask[rows]))[: stop - start]
    return out


def test_ames_cpu_logits_are_exactly_the_old_ones():
    model = random_ames(1)
    query, batch = realish(3, C=70, Q=20, T=12)
    np.testing.assert_array_equal(score_shortlist(model, query, batch), old_score_shortlist(model, query, batch))
    np.testing.assert_array_equal(
        score_shortlist(model, query, batch, batch_size=16), old_score_shortlist(model, query, batch, 16)
    )
    with pytest.raises(AMESInputError, match="CUDA"):
        score_shortlist(model, query, batch, precision="fp16")
    with pytest.raises(AMESInputError, match="precision"):
        score_shortlist(model, query, batch, precision="int8")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_verify_on_the_cpu_equals_the_per_pair_reference(seed):
    """Real-ish sets, candidates without tokens, too few matches, duplicated tokens (ties)."""
    query, batch = realish(seed, empty=(0, 7))
    config = MatchConfig(max_distance=32)
    matches = match_tokens(query, batch, config)
    for spatial in (SpatialConfig(), SpatialConfig(pair_seeds=0), SpatialConfig(min_inliers=3, lo_iterations=1)):
        result = verify(query, batch, matches, spatial, device="cpu")
        default = verify(query, batch, matches, spatial)
        for field in ("inliers", "affine", "inlier_mask", "refined", "verified"):
            np.testing.assert_array_equal(getattr(result, field), getattr(default, field))
        for c in range(len(batch)):
            n = int(batch.mask[c].sum())
            cand = LocalTokens(batch.codes[c, :n], batch.xy[c, :n], batch.scale[c, :n], batch.weight[c, :n])
            m = matches.mask[c]
            ref = verify_pair(query, cand, matches.pairs(c), spatial, matches.distance[c, m])
            assert result.inliers[c] == ref.inliers and result.verified[c] == ref.verified, c
            np.testing.assert_array_equal(result.inlier_mask[c, : m.sum()], ref.inlier_mask)
            # LO's affine: batched normal equations against lstsq, equal up to float64 rounding
            np.testing.assert_allclose(result.affine[c], ref.affine, rtol=1e-9, atol=1e-9)
    assert matches.counts()[[0, 7]].tolist() == [0, 0] and (result.inliers[[0, 7]] == 0).all()


def test_empty_inputs_on_a_device_argument():
    query, batch = realish(4, C=3)
    none = LocalTokens(
        np.zeros((0, 16), np.uint8), np.zeros((0, 2), np.float32), np.zeros(0, np.float32), np.zeros(0, np.float32)
    )
    assert (Reranker(RerankConfig(), device="cpu").local_scores(none, batch).raw == 0).all()
    empty = TokenBatch.padding(0, 0)
    matches = match_tokens(query, empty)
    assert verify(query, empty, matches, device="cpu").inliers.shape == (0,)
    assert nearest_tokens(query.codes, empty, device="cpu").distance.shape == (0, len(query))


# --- on a GPU --------------------------------------------------------------------------------------


def assert_same_nearest(a, b) -> None:
    for field in ("distance", "has_tokens", "candidate", "query", "token", "mutual"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("asymmetric", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_matches_and_inliers_equal_the_cpu(seed, asymmetric):
    query, batch = realish(seed, C=200, Q=300, T=100, empty=(5,))
    weights = asymmetric_weights(query.proj) if asymmetric else None
    cpu = nearest_tokens(query.codes, batch, within=32, query_weights=weights)
    cuda = nearest_tokens(query.codes, batch, within=32, query_weights=weights, device="cuda")
    assert_same_nearest(cpu, cuda)
    assert_same_nearest(
        nearest_tokens(query.codes, batch, within=-1, mutual=False, device="cpu"),
        nearest_tokens(query.codes, batch, within=-1, mutual=False, device="cuda"),
    )
    matches = matches_from_nearest(cpu, MatchConfig(max_distance=32))
    a, b = verify(query, batch, matches), verify(query, batch, matches, device="cuda")
    for field in ("inliers", "affine", "inlier_mask", "refined", "verified"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
    assert a.verified.sum() > 10  # the sets do verify: the comparison is not vacuous
    sp_cpu = Reranker(RerankConfig()).local_scores(query, batch)
    sp_cuda = Reranker(RerankConfig(), device="cuda").local_scores(query, batch)
    np.testing.assert_array_equal(sp_cpu.raw, sp_cuda.raw)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_ames_logits_are_the_cpu_ones_within_tolerance():
    model = random_ames(2)
    query, batch = realish(5, C=300, Q=300, T=100)
    cpu = score_shortlist(model, query, batch)
    on_gpu = model.to("cuda")
    fp32 = score_shortlist(on_gpu, query, batch, precision="fp32")
    fp16 = score_shortlist(on_gpu, query, batch)  # auto: float16 autocast
    np.testing.assert_allclose(fp32, cpu, atol=1e-4, rtol=0)  # TF32 off by default: float32 rounding only
    np.testing.assert_allclose(fp16, cpu, atol=AMES_FP16_ATOL, rtol=0)
    # the order agrees (these logits lie within ~0.1 of each other: a hard case for any rounding)
    rank = lambda x: np.argsort(np.argsort(-x))  # noqa: E731
    assert np.corrcoef(rank(fp32), rank(cpu))[0, 1] > 0.99999
    assert np.corrcoef(rank(fp16), rank(cpu))[0, 1] > 0.99
    assert len(set(np.argsort(-fp16)[:10]) & set(np.argsort(-cpu)[:10])) >= 8
    # a logit depends on its candidate only, on a GPU too: a shortlist split scores as a whole
    part = np.arange(0, 300, 3)
    fields = (batch.codes, batch.xy, batch.scale, batch.weight, batch.mask)
    np.testing.assert_array_equal(score_shortlist(on_gpu, query, TokenBatch(*(x[part] for x in fields))), fp16[part])
