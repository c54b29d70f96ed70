"""Local directories copied to S3 (moto) for the tests of an ``s3://`` index or prefix."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def upload_tree(client: Any, bucket: str, prefix: str, directory: Path) -> str:
    """Every file under ``directory`` as ``s3://bucket/prefix/<its relative path>``; that URL."""
    for path in Path(directory).rglob("*"):
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(directory)}")
    return f"s3://{bucket}/{prefix}"
