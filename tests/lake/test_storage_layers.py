"""The storage stack runs one way (docs/architecture.md, "Storage: one way up"):
no module below the ``Lake`` facade reaches it, and ``pipeline.lake`` holds no
import circle at any depth, imports under ``TYPE_CHECKING`` included."""

from __future__ import annotations

import grimp
import pytest

from pipeline.lake.uri import split_uri

# bottom to top; every one of them is below the facade (pipeline/lake/delta/store.py)
BELOW_FACADE = [
    "pipeline.lake.uri", "pipeline.lake.liveness", "pipeline.lake.objects", "pipeline.lake.staging",
    "pipeline.lake.delta.common", "pipeline.lake.delta.root", "pipeline.lake.delta.keyindex",
    "pipeline.lake.delta.writes", "pipeline.lake.delta.compact", "pipeline.lake.delta.damaged",
    "pipeline.lake.delta.group",
]


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("pipeline", exclude_type_checking_imports=False)


def test_no_storage_module_below_the_facade_reaches_it(graph):
    for module in BELOW_FACADE:
        for facade in ("pipeline.lake.delta.store", "pipeline.lake.delta"):
            chain = graph.find_shortest_chain(importer=module, imported=facade)
            assert chain is None, f"{module} reaches the facade: {' -> '.join(chain)}"


def test_the_lake_package_has_no_import_circle_at_any_depth(graph):
    lake = sorted(m for m in graph.modules if m == "pipeline.lake" or m.startswith("pipeline.lake."))
    assert "pipeline.lake.delta.root" in lake and len(lake) > 20
    circles = []
    for a in lake:
        for b in graph.find_modules_directly_imported_by(a):
            if b in lake:
                back = graph.find_shortest_chain(importer=b, imported=a)
                if back is not None:
                    circles.append(" -> ".join([a, *back]))
    assert circles == []


def test_the_old_private_names_of_the_delta_package_still_resolve_with_a_warning():
    from pipeline.lake import delta

    with pytest.warns(DeprecationWarning, match="KEY_CACHE"):
        assert delta._KEY_CACHE is delta.KEY_CACHE
    with pytest.warns(DeprecationWarning, match="plan_compaction"):
        assert delta._compaction_plan is delta.plan_compaction
    with pytest.raises(AttributeError):
        delta._no_such_name  # noqa: B018


@pytest.mark.parametrize("uri, parts", [
    ("s3://bucket/lake", ("s3", "bucket/lake")),
    ("s3://bucket", ("s3", "bucket")),
    ("gs://b/a://b", ("gs", "b/a://b")),        # only the first separator splits
    ("/data/lake", ("", "/data/lake")),
    ("bucket/prefix", ("", "bucket/prefix")),
])
def test_split_uri(uri, parts):
    assert split_uri(uri) == parts
