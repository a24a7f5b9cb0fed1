"""The package's layout holds: each package imports only from the packages below it
(docs/architecture.md, "The layout"), and no two modules share a file name."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

CLEW = Path(__file__).resolve().parents[1] / "clew"

# Bottom to top, as docs/architecture.md lists them; a package may import from those before it.
ORDER = [
    "errors",
    "registry",
    "ray_connect",
    "kernels",
    "algorithms",
    "envs",
    "data",
    "models",
    "metrics",
    "inference",
    "rollout",
    "train",
    "config",
    "checkpoint",
    "cluster",
    "trainer",
    "agent",
    "serve",
    "commands",
    "docs",
    "cli",
    "__main__",
]
# Imported inside a function, on purpose: a registry lookup loads the env plugins first,
# so a plugin's estimator or logger is found by name (clew.registry.lookup).
ALLOWED_UPWARD = {("registry", "envs")}


def _unit(path: Path) -> str:
    rel = path.relative_to(CLEW)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported_units(tree: ast.AST) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = (
                [node.module] if node.module != "clew" else [f"clew.{a.name}" for a in node.names]
            )
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out |= {n.split(".")[1] for n in names if n.startswith("clew.")}
    return out


def arrows() -> set[tuple[str, str]]:
    """Every (importer, imported) pair of clew's packages and top-level modules."""
    found = set()
    for path in CLEW.rglob("*.py"):
        unit = _unit(path)
        for target in _imported_units(ast.parse(path.read_text())):
            if target != unit and target != "__version__":
                found.add((unit, target))
    return found


def test_every_package_and_top_level_module_has_its_place_in_the_order() -> None:
    units = {_unit(p) for p in CLEW.rglob("*.py")} - {"__init__"}
    assert units == set(ORDER)


def test_each_package_imports_only_from_the_packages_below_it() -> None:
    rank = {unit: i for i, unit in enumerate(ORDER)}
    upward = sorted(
        (a, b) for a, b in arrows() if rank[b] > rank[a] and (a, b) not in ALLOWED_UPWARD
    )
    assert upward == [], f"imports against the layering (importer, imported): {upward}"


def test_the_policy_worker_imports_no_group_loop_or_engine() -> None:
    from_train = {b for a, b in arrows() if a == "train"}
    assert not from_train & {"cluster", "trainer", "rollout", "inference", "config"}


def test_no_two_modules_share_a_file_name_outside_config_and_commands() -> None:
    names = Counter(
        p.name
        for p in CLEW.rglob("*.py")
        if p.name != "__init__.py" and p.parent.name not in {"config", "commands"}
    )
    assert [name for name, n in names.items() if n > 1] == []
