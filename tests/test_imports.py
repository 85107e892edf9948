"""The package boundaries of DESIGN.md sections 2 and 10, and "no pickle anywhere", enforced on the
source."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> the imports of sibling packages it may make (prefix match)
ALLOWED = {
    "resilient": [],
    "reshape": [
        "resilient.layout",
        "resilient.checkpoint",
        "resilient.errors",
        "resilient.progress",
    ],
    "reference_trainer": ["resilient", "reshape"],
}
PACKAGES = set(ALLOWED)

# Inside resilient, imports flow one way (DESIGN.md section 10): a module may import its own layer
# and the layers below.  The chaos harness sits on top: nothing below it may import it, so a stray
# setting can never turn fault injection on in a real job.
LAYERS = {
    "resilient.errors": 0,
    "resilient.layout": 0,
    "resilient._lazy": 0,
    "resilient.__version__": 0,
    "resilient.progress": 0,  # the command lines' progress bar (rich only)
    "resilient.checkpoint": 1,
    "resilient.memory": 2,
    "resilient.health": 3,
    "resilient.launch": 3,
    "resilient.loop": 3,
    "resilient.hooks": 3,
    "resilient.data": 3,
    "resilient": 3,  # the package's public names (its __init__ imports them when first used)
    "resilient.chaos": 4,
    "resilient.preflight": 3,  # Run(preflight=True) runs its quick subset
    "resilient.demo": 4,
    "resilient.cli": 4,
}


def imports_of(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from resilient import checkpoint` is resilient.checkpoint; `from resilient.layout
            # import Layout` is resilient.layout.Layout: both are judged by prefix.
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def violations(package: str, root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted((root / package).rglob("*.py")):
        for lineno, name in imports_of(path):
            top = name.split(".")[0]
            if top not in PACKAGES or top == package:
                continue
            if not any(name == a or name.startswith(a + ".") for a in ALLOWED[package]):
                bad.append(f"{path.relative_to(root)}:{lineno} imports {name}")
    return bad


def layer_of(name: str) -> int:
    """The layer of a dotted name inside resilient: its longest prefix in LAYERS."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in LAYERS:
            return LAYERS[prefix]
    raise KeyError(name)


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer_violations(root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted((root / "resilient").rglob("*.py")):
        mod = module_name(path, root)
        if mod == "resilient":
            continue  # the package's front door re-exports every layer
        mine = layer_of(mod)
        for lineno, name in imports_of(path):
            if name.split(".")[0] != "resilient":
                continue
            if layer_of(name) > mine:
                bad.append(f"{path.relative_to(root)}:{lineno} imports {name} (a higher layer)")
    return bad


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_boundaries(package):
    assert violations(package) == []


def test_layers_inside_resilient():
    assert layer_violations() == []


def test_the_checker_catches_a_crossing(tmp_path):
    fake = tmp_path / "resilient"
    fake.mkdir()
    (fake / "bad.py").write_text("import reshape.plan\nfrom reference_trainer import model\n")
    (tmp_path / "reshape").mkdir()
    (tmp_path / "reshape" / "bad.py").write_text(
        "from resilient.loop import Run\nfrom resilient.layout import Layout\n"
    )
    assert violations("resilient", tmp_path) == [
        "resilient/bad.py:1 imports reshape.plan",
        "resilient/bad.py:2 imports reference_trainer.model",
    ]
    assert violations("reshape", tmp_path) == ["reshape/bad.py:1 imports resilient.loop.Run"]


def test_the_checker_catches_a_layer_crossing(tmp_path):
    (tmp_path / "resilient" / "health").mkdir(parents=True)
    (tmp_path / "resilient" / "checkpoint").mkdir()
    (tmp_path / "resilient" / "loop.py").write_text(
        "from resilient.chaos.faults import ChaosHook\nfrom resilient.health import Monitor\n"
    )
    (tmp_path / "resilient" / "checkpoint" / "writer.py").write_text(
        "from resilient.health.events import EventLog\nfrom resilient import __version__\n"
        "from resilient.errors import StorageError\n"
    )
    (tmp_path / "resilient" / "health" / "x.py").write_text("import resilient.chaos\n")
    (tmp_path / "resilient" / "cli.py").write_text("from resilient.chaos.runner import run_suite\n")
    assert layer_violations(tmp_path) == [
        "resilient/checkpoint/writer.py:1 imports resilient.health.events.EventLog (a higher layer)",
        "resilient/health/x.py:1 imports resilient.chaos (a higher layer)",
        "resilient/loop.py:1 imports resilient.chaos.faults.ChaosHook (a higher layer)",
    ]


# --- no pickle anywhere (DESIGN.md section 4): nothing that can execute code from data ----------

UNSAFE_MODULES = {
    "pickle",
    "_pickle",
    "cPickle",
    "dill",
    "cloudpickle",
    "marshal",
    "shelve",
    "joblib",
}
UNSAFE_CALLS = {
    "torch.load": "torch.load unpickles",
    "torch.serialization.load": "torch.load unpickles",
    "eval": "eval runs code",
    "exec": "exec runs code",
    "yaml.unsafe_load": "yaml.unsafe_load builds arbitrary objects",
    "yaml.full_load": "yaml.full_load builds Python objects",
    "yaml.load_all": "yaml.load_all without a safe Loader builds arbitrary objects",
}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader"}
# (path relative to the root, what) for audited exceptions, with the reason next to each
AUDITED: set[tuple[str, str]] = {
    # The DCP import (issue 16) reads torch.distributed.checkpoint directories, whose .metadata is
    # a pickle: torch's FileSystemReader unpickles it, only after an explicit --trust-pickle.  The
    # module's own torch.load call decodes DCP's non-tensor entries with weights_only=True (torch's
    # restricted unpickler: plain containers and numbers, never code) instead of DCP's own
    # weights_only=False, so it unpickles less than dcp.load would.
    ("reshape/formats/dcp.py", "calls torch.load: torch.load unpickles"),
}


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> what it was imported as (``np`` -> ``numpy``, ``load`` -> ``torch.load``)."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _resolve(name: str, aliases: dict[str, str]) -> str:
    head, _, rest = name.partition(".")
    full = aliases.get(head, head)
    return f"{full}.{rest}" if rest else full


def _truthy_or_unknown(node: ast.AST) -> bool:
    return not (isinstance(node, ast.Constant) and not node.value)


def unsafe_uses(path: Path, root: Path) -> list[str]:
    rel = str(path.relative_to(root))
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases = _aliases(tree)
    found = []
    for lineno, name in imports_of(path):
        if name.split(".")[0] in UNSAFE_MODULES:
            found.append((lineno, f"imports {name} (it can execute code from data)"))
        elif name in UNSAFE_CALLS:
            found.append((lineno, f"imports {name}: {UNSAFE_CALLS[name]}"))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name is None:
            continue
        full = _resolve(name, aliases)
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        if full in UNSAFE_CALLS:
            found.append((node.lineno, f"calls {full}: {UNSAFE_CALLS[full]}"))
        elif (
            full == "numpy.load" and "allow_pickle" in kw and _truthy_or_unknown(kw["allow_pickle"])
        ):
            found.append((node.lineno, "calls numpy.load with allow_pickle: it unpickles"))
        elif full == "yaml.load":
            loader = kw.get("Loader", node.args[1] if len(node.args) > 1 else None)
            loader_name = None if loader is None else (_dotted(loader) or "").split(".")[-1]
            if loader_name not in SAFE_YAML_LOADERS:
                found.append((node.lineno, "calls yaml.load without a safe Loader"))
        elif full in ("importlib.import_module", "__import__") and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and str(arg.value).split(".")[0] in UNSAFE_MODULES:
                found.append((node.lineno, f"imports {arg.value} (it can execute code from data)"))
    return [f"{rel}:{n} {what}" for n, what in sorted(found) if (rel, what) not in AUDITED]


def pickle_violations(root: Path = ROOT) -> list[str]:
    out = []
    for package in sorted(PACKAGES):
        for path in sorted((root / package).rglob("*.py")):
            out += unsafe_uses(path, root)
    return out


def test_no_pickle_in_the_toolkit():
    assert pickle_violations() == []


def test_the_pickle_checker_catches_each_way_in(tmp_path):
    pkg = tmp_path / "reshape"
    pkg.mkdir()
    (tmp_path / "resilient").mkdir()
    (tmp_path / "reference_trainer").mkdir()
    (pkg / "bad.py").write_text(
        "import pickle\n"  # 1
        "import dill as d\n"  # 2
        "from cloudpickle import loads\n"  # 3
        "import marshal, shelve\n"  # 4
        "import torch\n"
        "from torch import load as tload\n"  # 6
        "import numpy as np\n"
        "import yaml\n"
        "torch.load('x.pt')\n"  # 9
        "tload('x.pt')\n"  # 10
        "np.load('x.npy', allow_pickle=True)\n"  # 11
        "np.load('x.npy', allow_pickle=False)\n"  # 12: fine
        "eval('1 + 1')\n"  # 13
        "exec('x = 1')\n"  # 14
        "yaml.load(open('c.yaml'))\n"  # 15
        "yaml.load(open('c.yaml'), Loader=yaml.SafeLoader)\n"  # 16: fine
        "yaml.unsafe_load('a: 1')\n"  # 17
        "pickle.loads(b'')\n"  # 18: the import already counts; the call is pickle's own
        "__import__('pickle')\n"  # 19
        "torch.serialization.load('x')\n"  # 20
    )
    got = pickle_violations(tmp_path)
    lines = sorted({int(v.split(":")[1].split()[0]) for v in got})
    assert lines == [1, 2, 3, 4, 6, 9, 10, 11, 13, 14, 15, 17, 19, 20], got
    assert "reshape/bad.py:9 calls torch.load: torch.load unpickles" in got
    assert "reshape/bad.py:11 calls numpy.load with allow_pickle: it unpickles" in got
    assert "reshape/bad.py:15 calls yaml.load without a safe Loader" in got


def test_the_persister_and_the_package_import_without_torch():
    """The memory tier's persister process reads, checks and commits files: it imports neither
    torch nor what needs it (the package's names are imported when first used)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import resilient\n"
        "from resilient.checkpoint.persister import main\n"
        "from resilient.checkpoint import seal, storage, catalog, retention, lease\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
        "from resilient import Checkpointer, Run\n"  # and the names still come when asked
        "print(Checkpointer.__name__, Run.__name__, 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[]", "Checkpointer Run True"]


def test_threads_first_touching_lazy_names_at_once_do_not_crash():
    """Four threads each take a different lazy name at the same moment; torch is imported once,
    under the package's import lock (importing parts of torch from several threads at once can
    abort the process)."""
    import subprocess
    import sys

    code = (
        "import threading, resilient\n"
        "names = ['Checkpointer', 'ResumableSampler', 'Hook', 'Run']\n"
        "go = threading.Barrier(len(names))\n"
        "got = {}\n"
        "def take(n):\n"
        "    go.wait()\n"
        "    got[n] = getattr(resilient, n).__name__\n"
        "ts = [threading.Thread(target=take, args=(n,)) for n in names]\n"
        "[t.start() for t in ts]\n"
        "[t.join() for t in ts]\n"
        "print(sorted(got.values()))\n"
        "print(hasattr(resilient, 'x.'), hasattr(resilient, 'cli'), hasattr(resilient, 'nope'))\n"
    )
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.splitlines() == [
            "['Checkpointer', 'Hook', 'ResumableSampler', 'Run']",
            "False False False",
        ]
