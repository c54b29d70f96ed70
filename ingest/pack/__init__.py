"""``needle pack``: a folder of images as WebDataset tars (stage.py), appended to on a rerun from
the record of what it packed (record.py)."""

from ingest.pack.stage import INFO_NAME, PackConfig, main, member_suffix, sample_key, unique_keys

__all__ = ["INFO_NAME", "PackConfig", "main", "member_suffix", "sample_key", "unique_keys"]
