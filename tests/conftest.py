import contextlib
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest


def pytest_configure(config):
    """Under pytest-xdist, the controller writes pytest's cache of the rewritten test modules
    before its workers start: every worker collects every test file, and where nothing writes
    bytecode (PYTHONDONTWRITEBYTECODE) each rewrote all of them, 10 s of CPU a worker."""
    if getattr(config, "workerinput", None) is None and config.getoption("numprocesses", None):
        if config.getoption("assertmode", "rewrite") == "rewrite":
            _cache_rewritten_tests(config, Path(__file__).parent)


def _cache_rewritten_tests(config, tests: Path) -> None:
    """pytest's own pyc of each test module (``_pytest.assertion.rewrite``, which reads it even
    where it writes none), written as pytest writes it: a checked hash of the source, so a stale
    one is never used.  The cache is a saving only: anything unexpected skips it."""
    try:
        from _pytest.assertion.rewrite import (
            PYC_TAIL,
            _read_pyc,
            _rewrite_test,
            _write_pyc_fp,
            get_cache_dir,
        )
    except ImportError:  # (another pytest)
        return
    for fn in sorted([*tests.rglob("test_*.py"), *tests.rglob("conftest.py")]):
        part = None
        try:
            pyc = get_cache_dir(fn) / (fn.name[:-3] + PYC_TAIL)
            part = pyc.with_name(f"{pyc.name}.{os.getpid()}")
            if _read_pyc(fn, pyc) is not None:
                continue
            source_hash, co = _rewrite_test(fn, config)  # (as pytest rewrites it, ini included)
            pyc.parent.mkdir(exist_ok=True)
            with open(part, "wb") as fp:
                _write_pyc_fp(fp, source_hash, co)
            os.replace(part, pyc)
        except Exception:  # (a file that does not parse fails where pytest imports it)
            with contextlib.suppress(OSError):
                if part is not None:
                    part.unlink(missing_ok=True)


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
