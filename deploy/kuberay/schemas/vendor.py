"""Cut a KubeRay CRD down to the OpenAPI v3 schema of one served version, without descriptions.

Kubernetes only needs ``spec.versions[].schema.openAPIV3Schema`` to validate a custom
resource; the printer columns, the other versions and the prose are dead weight in a repo.
Read the CRD from stdin, write the schema as JSON to stdout::

    git -C kuberay show v1.7.0:ray-operator/config/crd/bases/ray.io_rayclusters.yaml \\
        | python deploy/kuberay/schemas/vendor.py v1 > deploy/kuberay/schemas/raycluster.json
"""

from __future__ import annotations

import json
import sys
from typing import Any

import yaml

# Keys whose values are maps of field names to schemas: a field may be called "description".
_FIELD_MAPS = ("properties", "patternProperties", "definitions")


def strip_descriptions(node: Any) -> Any:
    """``node`` without any schema's ``description``; field names are kept whatever they are."""
    if isinstance(node, list):
        return [strip_descriptions(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "description" and isinstance(value, str):
            continue
        if key in _FIELD_MAPS and isinstance(value, dict):
            out[key] = {name: strip_descriptions(sub) for name, sub in value.items()}
        else:
            out[key] = strip_descriptions(value)
    return out


def served_schema(crd: dict[str, Any], version: str) -> dict[str, Any]:
    """The ``openAPIV3Schema`` of ``version``, which must be served."""
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            if not entry.get("served"):
                raise SystemExit(f"version {version} of {crd['metadata']['name']} is not served")
            return entry["schema"]["openAPIV3Schema"]
    names = [entry["name"] for entry in crd["spec"]["versions"]]
    raise SystemExit(f"{crd['metadata']['name']} has no version {version}; it has {names}")


def main() -> None:
    version = sys.argv[1] if len(sys.argv) > 1 else "v1"
    crd = yaml.safe_load(sys.stdin)
    schema = strip_descriptions(served_schema(crd, version))
    json.dump(schema, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
