"""The original image of a database key, read again from where ingestion read it: its tar (a
local path or ``s3://``), or a directory of image files; and a JPEG thumbnail of it.

A key is ``<shard name>/<__key__>``. The shard's tar URL is what ingestion recorded
(``ingest_info.json``/``manifest.json`` beside the descriptors; an index shard keeps it per
Parquet file, ``files[].tar`` of its ``shard_infos.json``), else ``<shard name>.tar`` in one of
``SourceImagesConfig.tar_dirs``.

A tar is never read whole per image: the first image asked of a tar lists its members' offsets
(the headers of a local tar, seeking past the data; one streamed pass over an S3 object), and
every image is then one read of its bytes (a seek, or one ranged GET). The offsets of the
``max_tars`` most recently used tars are kept in memory, nothing is written to disk.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import ImageDecodeError
from core.quoting import short_repr
from core.storage import local_directory, may_exist, open_url, read_range, tar_headers
from ingest.shards import shard_name

WDS_KEY = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")  # webdataset: key = path up to the basename's first dot
RECORD_FILES = ("ingest_info.json", "manifest.json")  # what ingestion writes beside its Parquet files


def image_suffixes() -> tuple[str, ...]:
    # ingest.reader imports webdataset, which imports torch: not at import time (a coordinator
    # imports this module and must stay small)
    from ingest.reader import IMAGE_SUFFIXES

    return IMAGE_SUFFIXES


@dataclass(frozen=True)
class SourceImagesConfig:
    tar_dirs: tuple[str, ...] = ()  # directories searched for `<shard>.tar` where no recorded URL is readable here
    endpoint_url: str | None = None  # S3-compatible endpoint for s3:// tars (None: the one ingestion recorded)
    max_tars: int = 64  # tars whose member offsets are kept in memory (the least recently used are dropped)


def tar_urls_of_record(info: Any) -> tuple[dict[str, str], str | None]:
    """(shard name -> tar URL, the S3 endpoint) from an ``ingest_info.json`` or ``manifest.json``."""
    urls: dict[str, str] = {}
    if not isinstance(info, dict):
        return urls, None
    endpoint = (info.get("config") or {}).get("s3_endpoint_url")
    for result in info.get("results", []) or []:
        if isinstance(result, dict) and result.get("url"):
            urls.setdefault(result.get("shard") or shard_name(result["url"]), result["url"])
    shards = info.get("shards")
    if isinstance(shards, dict):
        for shard, entry in shards.items():
            if isinstance(entry, dict) and entry.get("url"):
                urls.setdefault(shard, entry["url"])
    return urls, endpoint


def recorded_tar_urls(location: str | Path, endpoint_url: str | None = None) -> tuple[dict[str, str], str | None]:
    """What ingestion recorded beside the descriptors at ``location`` (a directory, or an
    ``s3://`` prefix): (shard name -> tar URL, the S3 endpoint); empty where nothing is readable."""
    urls: dict[str, str] = {}
    endpoint = None
    base = str(location).rstrip("/")
    for name in RECORD_FILES:
        try:
            with open_url(f"{base}/{name}", endpoint_url) as stream:
                info = json.loads(stream.read())
        except (OSError, ValueError):
            continue
        found, recorded = tar_urls_of_record(info)
        for shard, url in found.items():
            urls.setdefault(shard, url)
        endpoint = endpoint or recorded
    return urls, endpoint


def tar_urls_of_files(files: list[dict[str, Any]], endpoint_url: str | None = None) -> dict[str, str]:
    """Shard name -> tar URL from an index shard's ``files`` entries (its ``shard_infos.json``):
    each Parquet file's recorded ``tar``; for files of indexes built before it was recorded, the
    ingestion record beside the file's recorded ``path`` (read once per directory, where readable)."""
    urls: dict[str, str] = {}
    records: dict[str, dict[str, str]] = {}
    for entry in files:
        path = str(entry.get("path") or "")
        directory, _, name = path.rpartition("/")
        shard = name.removesuffix(".parquet")
        if entry.get("tar"):
            urls.setdefault(shard, entry["tar"])
        elif directory:
            if directory not in records:
                records[directory] = recorded_tar_urls(directory, endpoint_url)[0]
            if shard in records[directory]:
                urls.setdefault(shard, records[directory][shard])
    return urls


class SourceImages:
    """Image bytes of keys from their source tars; ``urls`` maps shard names to tar URLs (or to
    directories of image files)."""

    def __init__(self, urls: Mapping[str, str], conf: SourceImagesConfig = SourceImagesConfig(), endpoint=None):
        self.urls = dict(urls)
        self.conf = conf
        self.endpoint_url = conf.endpoint_url or endpoint  # the serving flag first, else what ingestion used
        self._members: OrderedDict[str, dict[str, tuple[int, int]]] = OrderedDict()  # tar -> {key: (offset, size)}
        self._lock = threading.Lock()

    def url_of(self, shard: str) -> str | None:
        """The readable source of ``shard``: its recorded URL where it can be read here (s3://, or
        a path that exists), else ``<shard>.tar`` in a tar dir, else the recorded URL (the read
        then names it), else None."""
        url = self.urls.get(shard)
        if url and may_exist(url):
            return url
        for directory in self.conf.tar_dirs:
            for candidate in (Path(directory) / f"{shard}.tar", Path(directory) / shard):
                if candidate.exists():
                    return str(candidate)
        return url

    def image_bytes(self, key: str) -> bytes:
        """The bytes of ``key``'s image member (FileNotFoundError naming the key and the tar
        where either cannot be found)."""
        shard, _, member_key = key.partition("/")
        url = self.url_of(shard)
        if url is None:
            raise FileNotFoundError(
                f"no source recorded for shard {short_repr(shard)} (key {short_repr(key)}): "
                "give the directory of its tar (--shard-dir)"
            )
        directory = local_directory(url)
        if directory is not None:  # a directory of image files
            for suffix in image_suffixes():
                path = directory / f"{member_key}.{suffix}"
                if path.is_file():
                    return path.read_bytes()
            raise FileNotFoundError(f"no image file for {short_repr(member_key)} in {url}")
        members = self.members(url)
        if member_key not in members:
            raise FileNotFoundError(f"{url} holds no image member for {member_key!r} (key {key!r})")
        offset, size = members[member_key]
        return read_range(url, offset, size, self.endpoint_url)

    def members(self, url: str) -> dict[str, tuple[int, int]]:
        """{WebDataset key: (offset, size) of its first image member} of the tar at ``url``."""
        with self._lock:
            if url in self._members:
                self._members.move_to_end(url)
                return self._members[url]
        members: dict[str, tuple[int, int]] = {}
        for info in tar_headers(url, self.endpoint_url):  # S3: one streamed pass; local: seeks past the data
            add_member(members, info)
        with self._lock:
            self._members[url] = members
            while len(self._members) > max(1, self.conf.max_tars):
                self._members.popitem(last=False)
        return members


def add_member(members: dict[str, tuple[int, int]], info: tarfile.TarInfo) -> None:
    """Record ``info`` when it is a sample's first image member."""
    match = WDS_KEY.match(info.name) if info.isfile() else None
    if match and match.group(2).lower() in image_suffixes():
        members.setdefault(match.group(1), (info.offset_data, info.size))


# Pixels of a source image a thumbnail decodes (a JPEG at a reduced scale; a PNG whole): an index's
# own images may be larger than a query (--max-image-pixels), but not unbounded.
THUMBNAIL_MAX_PIXELS = 100_000_000


def thumbnail_jpeg(data: bytes, px: int, key: str = "?", max_pixels: int = THUMBNAIL_MAX_PIXELS) -> bytes:
    """A JPEG of the image ``data``, upright (EXIF), its longer side at most ``px``: opened as a
    server opens images (ingest.images.open_image: SERVE_FORMATS, the scan cap), of at most
    ``max_pixels`` (ImageDecodeError naming ``key`` otherwise), a JPEG decoded at a reduced scale."""
    from PIL import ImageOps

    from ingest.images import SERVE_FORMATS, open_image

    with open_image(data, key, SERVE_FORMATS) as source:
        if source.width * source.height > max_pixels:
            raise ImageDecodeError(key, f"an image of {source.width}x{source.height}, over {max_pixels} pixels")
        if source.format == "JPEG":
            source.draft("RGB", (px, px))  # libjpeg scales by 1/2..1/8 while decoding
        image = ImageOps.exif_transpose(source).convert("RGB")
        image.thumbnail((px, px))
        out = io.BytesIO()
        image.save(out, format="JPEG", quality=85)
    return out.getvalue()
