import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest


@pytest.fixture(autouse=True)
def memory_root(tmp_path, monkeypatch):
    """Every test's memory tier lives in its own directory (never the machine's /dev/shm/resilient);
    processes a test starts inherit it."""
    root = tmp_path / "memory-root"
    monkeypatch.setenv("RESILIENT_MEMORY_ROOT", str(root))
    return root


@pytest.fixture(scope="session")
def s3():
    from tests.s3server import LocalS3

    server = LocalS3()
    yield server
    server.stop()


@pytest.fixture(params=["local", "memory", "s3"])
def storage_url(request, tmp_path):
    """(url, storage_options) for every backend the storage contract must hold on."""
    import uuid

    if request.param == "local":
        return str(tmp_path / "ckpt"), None
    if request.param == "memory":
        return f"memory://ckpt-{uuid.uuid4().hex[:8]}", None
    s3 = request.getfixturevalue("s3")
    return f"s3://{s3.new_bucket()}/run1", s3.options
