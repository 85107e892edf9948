import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest


def pytest_collection_modifyitems(config, items):
    """Files with tests marked ``slow`` first, the integration files (real jobs) first of those;
    the rest keep their order.  pytest-xdist (``make test``: ``--dist loadfile
    --no-loadscope-reorder``) hands files to its workers in this order, so the long files start
    first and the short ones fill the workers' ends.  By default it hands out the files with the
    most tests first, which put the integration files (a few real jobs each) last, and one
    worker ran its last long file alone while the others had finished."""
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}

    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::")[0]
        if path not in slow:
            return 2
        return 0 if path.startswith("tests/integration/") else 1

    items.sort(key=rank)  # (stable: a file's tests keep their order)


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
