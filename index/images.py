"""The source images of an index searched in this process: a key is ``<shard name>/<__key__>``;
its image is read again from the tar ingestion read it from (ingest/source_images.py: the URL
each index shard recorded for its Parquet files, else the one ingestion recorded beside the
descriptors, else ``<shard name>.tar`` in one of ``tar_dirs``), and
made into a JPEG thumbnail. Nothing is written to disk. (An index whose shards live elsewhere has
the shard that owns a key make its thumbnail: shards/shard_actor.py.)
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Protocol

from ingest.source_images import (
    SourceImages,
    SourceImagesConfig,
    recorded_tar_urls,
    tar_urls_of_files,
    thumbnail_jpeg,
)


class KeyedIndex(Protocol):
    """What ``ImageSource`` reads of an index: its infos (where the descriptors were read from) and
    its keys."""

    @property
    def infos(self) -> dict[str, Any]: ...

    def position_of(self, key: str) -> int: ...

    def source_files(self) -> list[dict[str, Any]]: ...


class ImageSource:
    """Image bytes and thumbnails of an index's keys; the tars' URLs from the descriptors'
    ingestion records (read on first use), the tars' member offsets kept by ``SourceImages``."""

    def __init__(self, index: KeyedIndex, shard_dirs: tuple[str, ...] = ()):
        self.index = index
        self.conf = SourceImagesConfig(tar_dirs=tuple(shard_dirs))
        self._images: SourceImages | None = None
        self._lock = threading.Lock()

    def images(self) -> SourceImages:
        with self._lock:
            if self._images is None:
                self._images = self._open()
            return self._images

    def _open(self) -> SourceImages:
        """Each Parquet file's tar as its shard recorded it (``shard_infos.json``: what a shard
        actor reads too), else the ingestion record beside the descriptors the index was built from."""
        urls = tar_urls_of_files(self.index.source_files())
        endpoint = None
        for source in self.index.infos.get("descriptors", []) or []:
            directory = Path(source)
            recorded, recorded_endpoint = recorded_tar_urls(directory.parent if directory.is_file() else directory)
            for shard, url in recorded.items():
                urls.setdefault(shard, url)
            endpoint = endpoint or recorded_endpoint
        return SourceImages(urls, self.conf, endpoint)

    def image_bytes(self, key: str) -> bytes:
        self.index.position_of(key)  # UnknownKeyError (a NeedleInputError) for keys not in the index
        return self.images().image_bytes(key)

    def thumbnail(self, key: str, px: int) -> bytes:
        """A JPEG of ``key``'s image, longer side ``px``."""
        return thumbnail_jpeg(self.image_bytes(key), px, key)
