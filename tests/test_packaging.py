"""The package is light to import, ships its declarative resources, and the
docs site's generated tables page (docs/reference/tables.md) is current."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_pipeline_and_cli_stays_light():
    code = ("import sys, pipeline, pipeline.cli; pipeline.cli.build_parser(); "
            "heavy = [m for m in ('torch', 'deltalake', 'duckdb', 'deepspeed', 'vllm', 'great_expectations', "
            "'dask', 'transformers') if m in sys.modules]; print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"importing the CLI pulled in heavy modules: {out.stdout}"


def test_tables_page_is_generated_from_schemas(tmp_path):
    from pipeline.schema import DOCS_PAGE, update_readme

    copy = tmp_path / "tables.md"
    copy.write_text((ROOT / DOCS_PAGE).read_text())
    assert not update_readme(copy), f"{DOCS_PAGE} is stale: run python -m pipeline.schema --update-docs"


def test_readme_schema_tables_render_as_one_table_each():
    """Each table's column list is one markdown table: header, separator and one row per column with no
    blank line between (a blank line ends a markdown table, and the rest renders as loose text)."""
    from pipeline.schema import TABLES, markdown, table_spec

    text = markdown()
    for name in TABLES:
        section = text.split(f"### {name}\n", 1)[1].split("\n### ", 1)[0]
        lines = section.splitlines()
        start = lines.index("| column | type | required | rules | description |")
        block = []
        for line in lines[start:]:
            if not line.startswith("|"):
                break
            block.append(line)
        columns = table_spec(name).columns
        assert len(block) == 2 + len(columns), f"{name}: the table stops after {len(block) - 2} of {len(columns)} rows"
        assert all(row.count(" | ") - row.count("\\|") == 4 for row in block[2:]), f"{name}: a cell holds a bare |"


def test_every_schema_file_parses_and_has_descriptions():
    from pipeline.resources import resource_dir
    from pipeline.schema import table_spec

    for f in sorted(resource_dir("schemas").glob("*.yaml")):
        spec = table_spec(f.stem)
        assert spec.description
        assert all(c.description for c in spec.columns), f.stem
        spec.arrow_schema()


@pytest.mark.slow
def test_wheel_ships_schemas_sql_and_jobs(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True)
    if out.returncode != 0 and "hatchling" in out.stderr:
        out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path),
                              str(ROOT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    wheel = next(tmp_path.glob("*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "pipeline/_resources/schemas/trajectories.yaml" in names
    assert any(n.startswith("pipeline/_resources/sql/") for n in names)
    assert any(n.startswith("pipeline/_resources/jobs/") for n in names)
    # the installed layout resolves resources from inside the package
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    code = "from pipeline.resources import resource_dir; print(resource_dir('schemas'))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(target / "pipeline" / "_resources" / "schemas")
