"""``needle locals train-itq``: learn the ITQ projection of local descriptors from Parquet files
written with ``--keep-local-desc`` (schema v2 ``local_desc``), and save it as ``.npz`` (``proj``,
``mean``) with a JSON beside it recording how it was made.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from tqdm import tqdm

from core.atomic import write_json_atomic
from embed import TrainITQConfig
from embed.itq import BITS, quantization_loss, save_itq, train_itq
from ingest.descriptors import DescriptorFileError, list_descriptor_files, list_values

log = logging.getLogger(__name__)


def read_local_desc(path: Path) -> np.ndarray:
    """Every token descriptor of one Parquet file, (tokens, d) float32."""
    schema = pq.read_schema(path)
    if "local_desc" not in schema.names:
        raise DescriptorFileError(f"{path} has no 'local_desc' column: ingest with --locals ... --keep-local-desc")
    _, desc = list_values(pq.read_table(path, columns=["local_desc"])["local_desc"])
    return desc.astype(np.float32)


def sample_local_desc(files: list[Path], sample: int, seed: int) -> np.ndarray:
    """About ``sample`` descriptors drawn uniformly, one file in memory at a time."""
    counts = [pq.ParquetFile(f).metadata.num_rows for f in files]
    rng = np.random.default_rng(seed)
    blocks = []
    keep = None
    for path in tqdm(files, desc="sample local descriptors", unit="file"):
        desc = read_local_desc(path)
        if keep is None:  # tokens per row are about constant: estimate the rate from the first file
            tokens_per_row = len(desc) / max(1, counts[0])
            keep = min(1.0, 1.1 * sample / max(1.0, tokens_per_row * sum(counts)))
        blocks.append(desc[rng.random(len(desc)) < keep])
    x = np.concatenate(blocks)
    finite = np.isfinite(x).all(1) & (np.abs(x).sum(1) > 0)
    x = x[finite]
    return x[rng.permutation(len(x))[:sample]]


def main(conf: TrainITQConfig, descriptors: Path | str, output: Path | str) -> Path:
    """Learn the projection from the descriptor directory (or file) ``descriptors``; write ``output``
    (.npz) and ``output`` + ``.json``."""
    start = time.perf_counter()
    source = Path(descriptors)
    files = [source] if source.is_file() else list_descriptor_files(source)
    x = sample_local_desc(files, conf.sample, conf.seed)
    if len(x) < BITS:  # fewer points than bits: the PCA basis would be rank-deficient
        raise DescriptorFileError(f"{source}: only {len(x)} local descriptors to learn ITQ from (need >= {BITS})")
    itq = train_itq(x, iterations=conf.iterations, seed=conf.seed)
    output = save_itq(itq, Path(output))
    write_json_atomic(
        {
            "config": asdict(conf),
            "descriptors": str(source),
            "files": len(files),
            "trained_on": len(x),
            "dim": itq.dim,
            "bits": int(itq.proj.shape[1]),
            "quantization_loss": quantization_loss(itq, x),
            "seconds": round(time.perf_counter() - start, 3),
        },
        output.with_name(output.name + ".json"),
    )
    log.info("ITQ projection %s learned from %d descriptors of %d files", output, len(x), len(files))
    return output
