"""deploy/kuberay applied together in one namespace: the Services KubeRay derives from the
training RayCluster, its RayJob and the serving RayService have distinct names and select
the pods of their own cluster only; docs/kubernetes.md reaches each by those names; and the Ray the
manifests and pyproject ask for has token authentication.

KubeRay's naming (v1.7, ray-operator/controllers/ray/utils/util.go and common/service.go):
a RayCluster ``C`` gets the head Service ``C-head-svc`` selecting its head pod by the pod
labels ``ray.io/cluster: C`` and ``ray.io/node-type: head``. A RayService ``S`` creates a
RayCluster named ``S-`` plus 5 random characters (which gets its own head Service as
above) and keeps two Services of its own that follow its active cluster: ``S-head-svc``
(its head pod) and ``S-serve-svc`` (pods labelled ``ray.io/serve: "true"``). The random
characters are taken here as any 5 of ``[a-z0-9]``, more than KubeRay draws from.
"""

from __future__ import annotations

import itertools
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
KUBERAY = ROOT / "deploy" / "kuberay"
GUIDE = (ROOT / "docs" / "kubernetes.md").read_text()  # the KubeRay guide
GENERATED = None  # stands for KubeRay's 5 random characters in a name
RANDOM_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"

Name = tuple[str | None, ...]  # literal parts and GENERATED, joined in order


def manifests() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(KUBERAY.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def only(kind: str) -> dict[str, Any]:
    found = [d for d in manifests() if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def chars(name: Name) -> list[str | None]:
    """``name`` one character a position; None where KubeRay draws a random one."""
    out: list[str | None] = []
    for part in name:
        out += [None] * 5 if part is GENERATED else list(part)
    return out


def may_equal(a: Name, b: Name) -> bool:
    """Whether some draw of KubeRay's random characters makes ``a`` and ``b`` the same."""
    ca, cb = chars(a), chars(b)
    return len(ca) == len(cb) and all(
        x == y
        or (x is None and (y is None or y in RANDOM_CHARS))
        or (y is None and x in RANDOM_CHARS)
        for x, y in zip(ca, cb, strict=True)
    )


@dataclass(frozen=True)
class Service:
    owner: str  # the manifest object that makes it, as "Kind/name"
    name: Name
    selector: tuple[tuple[str, Name], ...]  # pod label -> value


def cluster_label(doc: dict[str, Any]) -> Name:
    """The ``ray.io/cluster`` label of the pods of the cluster ``doc`` makes."""
    name = doc["metadata"]["name"]
    return (name,) if doc["kind"] == "RayCluster" else (f"{name}-", GENERATED)


def services(doc: dict[str, Any]) -> list[Service]:
    """The Services KubeRay makes for ``doc`` (none for kinds that make no cluster)."""
    owner, name = f"{doc['kind']}/{doc['metadata']['name']}", doc["metadata"]["name"]
    if doc["kind"] not in ("RayCluster", "RayService"):
        return []
    cluster = cluster_label(doc)
    head = (("ray.io/cluster", cluster), ("ray.io/node-type", ("head",)))
    made = [Service(owner, (*cluster, "-head-svc"), head)]  # the cluster's own
    if doc["kind"] == "RayService":
        serve = (("ray.io/cluster", cluster), ("ray.io/serve", ("true",)))
        made += [
            Service(owner, (f"{name}-head-svc",), head),
            Service(owner, (f"{name}-serve-svc",), serve),
        ]
    return made


def may_select_the_same_pod(a: Service, b: Service) -> bool:
    """Whether one pod may carry labels both selectors match: on every label both name,
    their values may be equal."""
    sa, sb = dict(a.selector), dict(b.selector)
    return all(may_equal(sa[k], sb[k]) for k in sa.keys() & sb.keys())


def all_services() -> list[Service]:
    return [s for doc in manifests() for s in services(doc)]


def text(name: Name) -> str:
    return "".join("?????" if p is GENERATED else p for p in name)


def test_the_manifests_go_into_one_namespace_with_a_name_for_each_cluster() -> None:
    docs = manifests()
    assert {d["metadata"].get("namespace") for d in docs} == {None}  # the namespace applied to
    clusters = [d for d in docs if d["kind"] in ("RayCluster", "RayService")]
    assert {d["kind"] for d in clusters} == {"RayCluster", "RayService"}
    for a, b in itertools.combinations(clusters, 2):
        assert not may_equal(cluster_label(a), cluster_label(b)), (
            f"{a['metadata']['name']} and {b['metadata']['name']} may share cluster labels"
        )


def test_no_two_services_kuberay_makes_for_the_set_may_share_a_name() -> None:
    made = all_services()
    assert {text(s.name) for s in made} == {
        "clew-training-head-svc",
        "clew-head-svc",
        "clew-serve-svc",
        "clew-?????-head-svc",
    }
    for a, b in itertools.combinations(made, 2):
        assert not may_equal(a.name, b.name), (
            f"{text(a.name)} ({a.owner}), {text(b.name)} ({b.owner})"
        )


def test_each_service_selects_the_pods_of_its_own_cluster_only() -> None:
    for a, b in itertools.combinations(all_services(), 2):
        if a.owner != b.owner:
            assert not may_select_the_same_pod(a, b), f"{text(a.name)} and {text(b.name)}"


def test_the_job_runs_on_the_training_cluster_and_no_other() -> None:
    job, cluster, service = only("RayJob"), only("RayCluster"), only("RayService")
    selector = job["spec"]["clusterSelector"]
    assert selector == {"ray.io/cluster": cluster["metadata"]["name"]}
    assert not may_equal((selector["ray.io/cluster"],), cluster_label(service))


def test_the_kubernetes_guide_reaches_the_training_and_serving_clusters_by_their_names() -> None:
    cluster, service = only("RayCluster")["metadata"]["name"], only("RayService")
    found = re.findall(r"kubectl port-forward svc/(\S+) (\d+):\d+", GUIDE)
    forwards = {int(port): svc for svc, port in found}
    assert forwards[8265] == f"{cluster}-head-svc"  # the training cluster's job API
    assert forwards[8000] == f"{service['metadata']['name']}-serve-svc"
    assert set(re.findall(r"-l ray\.io/cluster=([\w-]+)", GUIDE)) == {cluster}
    # KubeRay keeps a cluster's token in a Secret named after the cluster.
    assert set(re.findall(r"kubectl get secret ([\w-]+) -o", GUIDE)) == {cluster}
    assert f"RayCluster `{cluster}`" in GUIDE


def test_the_ray_extra_asks_for_a_ray_with_token_authentication() -> None:
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    ray = next(
        r for r in map(Requirement, listed["optional-dependencies"]["ray"]) if r.name == "ray"
    )
    assert Version("2.52.0") in ray.specifier  # token authentication came in 2.52
    assert not any(Version(v) in ray.specifier for v in ("2.50.0", "2.51.1"))
