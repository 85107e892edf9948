"""Fuzz: a valid checkpoint, mutated field by field (manifest) and byte by byte (rank file), must
load correctly or fail with a ResilientError: never another exception type, a hang, or a large
allocation."""

import copy
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient import Checkpointer, Layout, Shard, sharded
from resilient.checkpoint.format import MANIFEST_NAME
from resilient.checkpoint.reader import verify_step
from resilient.checkpoint.storage import Storage
from resilient.errors import ResilientError
from tests.peak import peak_kib, reset_peak

pytestmark = pytest.mark.slow

STEP = "step_00000003"


def original() -> dict:
    torch.manual_seed(0)
    return {
        "w": torch.randn(40, 33),
        "b": torch.arange(70).to(torch.bfloat16),
        "i": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "s": sharded(torch.randn(9, 5), {"dp": Shard(0)}, global_shape=(9, 5)),
        "v": {"step": 3, "names": ["a", "b"], "x": 1.5},
    }


def blank() -> dict:
    return {
        "w": torch.zeros(40, 33),
        "b": torch.zeros(70, dtype=torch.bfloat16),
        "i": torch.zeros(3, 4, dtype=torch.int64),
        "s": sharded(torch.zeros(9, 5), {"dp": Shard(0)}, global_shape=(9, 5)),
        "v": {"step": 0, "names": [], "x": 0.0},
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for codec in (None, "zstd"):
        root = tmp_path_factory.mktemp(f"fuzz-{codec}")
        with Checkpointer(
            str(root), layout=Layout(dp=1), block_bytes=4096, compression=codec
        ) as ck:
            ck.save(3, original()).wait()
        (root / "LEASE.json").unlink(missing_ok=True)
        out[codec] = root
    return out


def leaves(obj, path=()):
    """Every position in a JSON document: (path, value), containers included."""
    yield path, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from leaves(v, (*path, i))


json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.integers(min_value=-(10**500), max_value=10**500),
        st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64, 10**30, 4096, 3, 9]),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=20),
        st.sampled_from(["rank_00000.safetensors", "../x", "/etc/passwd", "zstd", "float8_e4m3fn"]),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=8,
)


@st.composite
def manifest_mutation(draw, doc):
    positions = [p for p, _ in leaves(doc) if p]
    path = draw(st.sampled_from(positions))
    kind = draw(st.sampled_from(["replace", "delete", "add", "nest"]))
    value = draw(json_values)
    return path, kind, value


def apply(doc, path, kind, value):
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    last = path[-1]
    if kind == "replace":
        parent[last] = value
    elif kind == "delete":
        if isinstance(parent, dict):
            del parent[last]
        else:
            parent.pop(last)
    elif kind == "add":
        if isinstance(parent, dict):
            parent[f"{last}_extra"] = value
        else:
            parent.append(value)
    else:  # nest: wrap the value deeply
        v = parent[last]
        for _ in range(80):
            v = [v]
        parent[last] = v


def attempt(root: Path, seconds: float = 30.0) -> tuple[str, dict | None]:
    """Load the (mutated) checkpoint and verify it, on a watchdog thread: ("ok", state),
    ("error", None) for a ResilientError; anything else (another exception, a hang) fails."""
    box: dict = {}

    def work() -> None:
        state = blank()
        try:
            with Checkpointer(str(root)) as ck:
                ck.load(state, step=3)
        except ResilientError:
            box["out"] = ("error", None)
            return
        except BaseException as e:  # reported below: not a ResilientError
            box["exc"] = e
            return
        try:
            verify_step(Storage(str(root)), 3)
        except ResilientError:
            pass
        except BaseException as e:
            box["exc"] = e
            return
        box["out"] = ("ok", state)

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"hung for over {seconds:.0f}s"
    if "exc" in box:
        raise AssertionError(f"not a ResilientError: {type(box['exc']).__name__}: {box['exc']}")
    return box["out"]


def check_same(state, touched_values: bool) -> None:
    ref = original()
    for k in ("w", "b", "i", "s"):
        assert torch.equal(state[k], ref[k]), f"tensor {k} loaded wrong data without an error"
    if not touched_values:
        assert state["v"] == ref["v"]


class Peak:
    """How far the peak RSS rose since construction (VmHWM reset: see tests/peak.py)."""

    def __init__(self):
        self.base = reset_peak()

    def grown_mib(self) -> float:
        return (peak_kib() - self.base) / 1024


ADVERSARIAL = [
    ("replace", None),
    ("replace", True),
    ("replace", -1),
    ("replace", 0),
    ("replace", 2**63),
    ("replace", 2**64 + 1),
    ("replace", 10**400),
    ("replace", -(10**400)),
    ("replace", 10**9),
    ("replace", 1.5),
    ("replace", "²"),
    ("replace", "../rank_00000.safetensors"),
    ("replace", []),
    ("replace", {}),
    ("replace", [[["dp", 2**62]]]),
    ("delete", None),
    ("add", 1),
    ("nest", None),
]


def mutated_copy(base: Path, doc: dict, tmp: str) -> Path:
    root = Path(tmp) / "ckpt"
    shutil.copytree(base, root)
    (root / STEP / MANIFEST_NAME).write_text(json.dumps(doc))
    return root


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_every_manifest_field_mutated(checkpoints, codec):
    """Field by field: every position of the manifest, every adversarial value (with zstd, the
    positions in the chunk tables: the rest of a manifest reads alike whatever the codec, and
    the uncompressed run covers it)."""
    base = checkpoints[codec]
    doc0 = json.loads((base / STEP / MANIFEST_NAME).read_text())
    positions = [p for p, _ in leaves(doc0) if p and (codec is None or "chunks" in p)]
    assert len(positions) > 40
    peak = Peak()
    outcomes = {"ok": 0, "error": 0}
    for path in positions:
        for kind, value in ADVERSARIAL:
            doc = copy.deepcopy(doc0)
            apply(doc, path, kind, value)
            with tempfile.TemporaryDirectory() as d:
                outcome, state = attempt(mutated_copy(base, doc, d))
            outcomes[outcome] += 1
            if outcome == "ok":
                touched = path[0] in ("extras", "rank_extras") or kind == "add"
                check_same(state, touched)
    assert outcomes["error"] > len(positions)  # the mutations do bite
    assert peak.grown_mib() < 500, f"peak memory grew by {peak.grown_mib():.0f} MiB"


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_fuzz_manifest_fields(checkpoints, codec):
    base = checkpoints[codec]
    doc0 = json.loads((base / STEP / MANIFEST_NAME).read_text())
    peak = Peak()

    @settings(
        max_examples=int(os.environ.get("FUZZ_EXAMPLES", "150")),
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=os.environ.get("FUZZ_RANDOM") is None,
    )
    @given(data=st.data())
    def run(data):
        path, kind, value = data.draw(manifest_mutation(doc0))
        doc = copy.deepcopy(doc0)
        apply(doc, path, kind, value)
        with tempfile.TemporaryDirectory() as d:
            outcome, state = attempt(mutated_copy(base, doc, d))
            if outcome == "ok":
                touched = path[0] in ("extras", "rank_extras") or kind == "add"
                check_same(state, touched)

    run()
    assert peak.grown_mib() < 500, f"peak memory grew by {peak.grown_mib():.0f} MiB"


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_fuzz_rank_file_bytes(checkpoints, codec):
    base = checkpoints[codec]
    name = next(p.name for p in (base / STEP).iterdir() if p.name.startswith("rank_"))
    data0 = (base / STEP / name).read_bytes()
    peak = Peak()

    @settings(
        max_examples=int(os.environ.get("FUZZ_EXAMPLES", "150")),
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=os.environ.get("FUZZ_RANDOM") is None,
    )
    @given(
        offset=st.integers(min_value=0, max_value=len(data0) - 1),
        kind=st.sampled_from(["flip", "set", "truncate", "extend", "header_len"]),
        byte=st.integers(min_value=0, max_value=255),
        big=st.sampled_from([0, 7, 2**31, 2**62, 2**64 - 1, len(data0)]),
    )
    def run(offset, kind, byte, big):
        data = bytearray(data0)
        if kind == "flip":
            data[offset] ^= 1 << (byte % 8)
        elif kind == "set":
            data[offset] = byte
        elif kind == "truncate":
            data = data[:offset]
        elif kind == "extend":
            data += bytes([byte]) * (offset % 64 + 1)
        else:
            data[:8] = big.to_bytes(8, "little")
        with tempfile.TemporaryDirectory() as d:
            root = Path(d) / "ckpt"
            shutil.copytree(base, root)
            (root / STEP / name).write_bytes(bytes(data))
            outcome, state = attempt(root)
            if outcome == "ok":
                check_same(state, touched_values=False)

    run()
    assert peak.grown_mib() < 500, f"peak memory grew by {peak.grown_mib():.0f} MiB"
