"""Lake URIs as text: the one place a URI is split into its scheme and the rest.

The lowest module of the storage layer (it imports nothing), so every module
of the lake, and every layer above, can use it.
"""

from __future__ import annotations


def split_uri(uri: str) -> tuple[str, str]:
    """``(scheme, rest)`` of ``uri``: ``"s3://bucket/lake"`` -> ``("s3", "bucket/lake")``. A plain
    path has no scheme: ``"/data/lake"`` -> ``("", "/data/lake")``."""
    scheme, sep, rest = uri.partition("://")
    return (scheme, rest) if sep else ("", uri)
