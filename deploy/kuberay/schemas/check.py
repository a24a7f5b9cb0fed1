"""Check KubeRay manifests offline against the vendored CRD schemas, as the API server would.

JSON Schema alone is not enough: Kubernetes silently prunes the fields a structural schema
does not declare, so a misspelt key (``volumeMount`` for ``volumeMounts``) would be accepted
and then do nothing. ``problems`` therefore also refuses undeclared fields and applies the
``x-kubernetes-*`` extensions that carry meaning (see ``k8s_problems``). A
PersistentVolumeClaim, which has no CRD, is checked against the PersistentVolumeClaimSpec that
Kubernetes' PodSpec embeds in ephemeral volumes. Run it on manifests before applying them::

    python deploy/kuberay/schemas/check.py deploy/kuberay/*.yaml
"""

from __future__ import annotations

import copy
import functools
import json
import sys
from pathlib import Path
from typing import Any

import jsonschema
import yaml

SCHEMAS = Path(__file__).resolve().parent


def _as_json_schema(node: Any) -> Any:
    """OpenAPI's ``nullable: true`` and Kubernetes' int-or-string in plain JSON Schema."""
    if isinstance(node, list):
        return [_as_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _as_json_schema(value) for key, value in node.items()}
    if out.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


@functools.cache
def _crd(name: str) -> dict[str, Any]:
    return _as_json_schema(json.loads((SCHEMAS / f"{name}.json").read_text()))


def _field(schema: dict[str, Any], dotted: str) -> dict[str, Any]:
    """The schema of the field at ``dotted`` (``[]`` steps into a list's items)."""
    for step in dotted.split("."):
        name, items = step.removesuffix("[]"), step.endswith("[]")
        schema = schema["properties"][name]
        schema = schema["items"] if items else schema
    return schema


def _object_meta() -> dict[str, Any]:
    # The CRD leaves the root ``metadata`` to the API server (``type: object``); the ObjectMeta
    # that controller-gen embeds in pod templates lists the fields a manifest may write.
    return _field(_crd("raycluster"), "spec.headGroupSpec.template.metadata")


@functools.cache
def schema_for(api_version: str, kind: str) -> dict[str, Any]:
    """The schema a document of ``api_version``/``kind`` is checked against.

    A PersistentVolumeClaim has no CRD: its spec is checked against the
    PersistentVolumeClaimSpec that Kubernetes' PodSpec embeds in ephemeral volumes.
    """
    crds = {
        ("ray.io/v1", "RayCluster"): "raycluster",
        ("ray.io/v1", "RayJob"): "rayjob",
        ("ray.io/v1", "RayService"): "rayservice",
    }
    if (api_version, kind) == ("v1", "PersistentVolumeClaim"):
        claim = "spec.headGroupSpec.template.spec.volumes[].ephemeral.volumeClaimTemplate.spec"
        schema = {"type": "object", "properties": {"spec": _field(_crd("raycluster"), claim)}}
    elif (api_version, kind) in crds:
        schema = copy.deepcopy(_crd(crds[api_version, kind]))
    else:
        raise ValueError(f"no schema for {api_version} {kind}: accepted {sorted(crds)}")
    schema["properties"].update(
        apiVersion={"type": "string"}, kind={"type": "string"}, metadata=_object_meta()
    )
    schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    return schema


FORMATS = jsonschema.FormatChecker()


@FORMATS.checks("int32")
def _int32(value: object) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@FORMATS.checks("int64")
def _int64(value: object) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


def k8s_problems(doc: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """What the API server would prune or refuse in ``doc`` beyond plain JSON Schema.

    Fields the schema does not declare (unless ``x-kubernetes-preserve-unknown-fields``);
    duplicate keys in ``x-kubernetes-list-type: map`` lists (defaults filled in first) and
    duplicate items in ``set`` lists; and fields under an ``x-kubernetes-validations`` CEL
    rule, which is not evaluated here and so is reported rather than passed unseen.
    """
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    out = [
        f"{path or '<root>'}: CEL rule not checked offline: {rule['rule']}"
        for rule in schema.get("x-kubernetes-validations", [])
    ]
    if isinstance(doc, dict):
        props = dict(schema.get("properties", {}))
        if schema.get("x-kubernetes-embedded-resource"):
            props = {"apiVersion": {}, "kind": {}, "metadata": _object_meta(), **props}
        extra = schema.get("additionalProperties")
        for key, value in doc.items():
            where = f"{path}.{key}"
            if key in props:
                out += k8s_problems(value, props[key], where)
            elif isinstance(extra, dict):
                out += k8s_problems(value, extra, where)
            elif extra is not True:
                out.append(f"{where}: unknown field (known: {', '.join(sorted(props))})")
    elif isinstance(doc, list) and isinstance(item_schema := schema.get("items"), dict):
        kind, seen = schema.get("x-kubernetes-list-type"), set()
        keys = schema.get("x-kubernetes-list-map-keys", [])
        item_props = item_schema.get("properties", {})
        for i, item in enumerate(doc):
            if kind == "map" and isinstance(item, dict):
                ident = tuple(item.get(k, item_props.get(k, {}).get("default")) for k in keys)
            elif kind == "set":
                ident = json.dumps(item, sort_keys=True)
            else:
                ident = None
            if ident is not None and ident in seen:
                out.append(f"{path}[{i}]: duplicate {' '.join(keys) or 'item'} {ident}")
            seen.add(ident)
            out += k8s_problems(item, item_schema, f"{path}[{i}]")
    return out


def problems(doc: dict[str, Any]) -> list[str]:
    """Everything wrong with one manifest document: schema errors, then Kubernetes' own."""
    schema = schema_for(doc.get("apiVersion", ""), doc.get("kind", ""))
    validator = jsonschema.Draft4Validator(schema, format_checker=FORMATS)
    errors = [
        "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in e.absolute_path)
        + f": {e.message}"
        for e in validator.iter_errors(doc)
    ]
    return sorted(errors) + k8s_problems(doc, schema)


def main(paths: list[str]) -> int:
    """Print every problem of every document in ``paths``; 1 if there was any."""
    found = 0
    for path in paths:
        for doc in yaml.safe_load_all(Path(path).read_text()):
            if doc is None:
                continue
            for problem in problems(doc):
                found += 1
                print(f"{path}: {doc.get('kind')} {doc.get('metadata', {}).get('name')}: {problem}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
