"""The one conversion of a lake argument.

Every public function that takes a lake (``ingest_table``, ``snapshots.open``,
``admit``, ... : docs/architecture.md "The lake argument") accepts a
:class:`~pipeline.lake.delta.Lake` or its URI, like deltalake's own
``write_deltalake(table_or_uri, ...)``: a local path (``str`` or any
``os.PathLike``, ``file://`` included) or an object-store URI (``s3://bucket/lake``;
credentials from the ``AWS_*`` environment). It calls :func:`as_lake` first and
works with the :class:`Lake` from then on.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake


def as_lake(lake: Lake | str | os.PathLike[str]) -> Lake:
    """``lake`` itself when it is a :class:`Lake`, else ``Lake(lake)`` for a path or URI."""
    from pipeline.lake.delta import Lake

    if isinstance(lake, Lake):
        return lake
    if isinstance(lake, (str, os.PathLike)):
        return Lake(lake)
    raise TypeError(f"a lake is a pipeline.lake.Lake, a path or a URI such as 's3://bucket/lake', "
                    f"not {type(lake).__name__}")
