"""The package boundaries of DESIGN.md section 2, enforced on the source."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> the imports of sibling packages it may make (prefix match)
ALLOWED = {
    "resilient": [],
    "reshape": ["resilient.layout", "resilient.checkpoint", "resilient.errors"],
    "reference_trainer": ["resilient", "reshape"],
}
PACKAGES = set(ALLOWED)


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


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_boundaries(package):
    assert violations(package) == []


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


def test_no_pickle_in_the_toolkit():
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for _, name in imports_of(path):
                assert name.split(".")[0] not in ("pickle", "dill", "cloudpickle"), (
                    f"{path} imports {name}"
                )
            assert "torch.load(" not in path.read_text(), f"{path} uses torch.load (pickle)"
