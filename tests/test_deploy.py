"""Tests for deploy/: the KubeRay manifests against KubeRay's CRD schemas, and the image.

The manifests are checked offline by deploy/kuberay/schemas/check.py against the vendored
OpenAPI v3 schemas of KubeRay's CRDs, undeclared fields included; the broken copies below show
the check refuses what it should. The RayService's serveConfigV2, a string to its CRD, is
checked against Ray Serve's config schema and clew.serve:build_app's args. The image is checked by reading its Dockerfile (no docker
here): base, install, user, command and build context.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import shlex
import tomllib
import typing
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from clew.config import ClewConfig, IgnoredKeyWarning, load_config

ROOT = Path(__file__).resolve().parents[1]
KUBERAY = ROOT / "deploy" / "kuberay"
SCHEMAS = KUBERAY / "schemas"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

_spec = importlib.util.spec_from_file_location("kuberay_check", SCHEMAS / "check.py")
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)
problems = check.problems


def requirement(name: str, extra: str | None = None) -> Requirement:
    """pyproject's requirement on ``name`` (in ``extra``'s list, or the main dependencies)."""
    project = PYPROJECT["project"]
    listed = project["optional-dependencies"][extra] if extra else project["dependencies"]
    return next(r for r in map(Requirement, listed) if r.name == name)


# ---------------------------------------------------------------- the manifests


def documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((KUBERAY / name).read_text()) if d is not None]


def only(name: str, kind: str) -> dict[str, Any]:
    found = [d for d in documents(name) if d["kind"] == kind]
    assert len(found) == 1, f"{name}: expected one {kind}, found {len(found)}"
    return found[0]


MANIFESTS = sorted(p.name for p in KUBERAY.glob("*.yaml"))
CLUSTER = only("raycluster.yaml", "RayCluster")
JOB = only("rayjob.yaml", "RayJob")
PVC = only("shared-pvc.yaml", "PersistentVolumeClaim")
SERVICE = only("rayservice.yaml", "RayService")
# Each cluster spec with its pods: the RayCluster the job runs on, the RayService's own.
CLUSTERS = {
    "raycluster.yaml": CLUSTER,
    "rayservice.yaml": {"spec": SERVICE["spec"]["rayClusterConfig"]},
}


def pod_templates(cluster: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spec = cluster["spec"]
    groups = {"head": spec["headGroupSpec"]}
    groups.update({g["groupName"]: g for g in spec.get("workerGroupSpecs", [])})
    return {name: group["template"]["spec"] for name, group in groups.items()}


def gpu_limit(container: dict[str, Any]) -> int:
    return int(container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))


def job_argv() -> list[str]:
    # KubeRay pastes the entrypoint into the submitter's shell command line, so a shell's
    # word splitting is how it is read; `ray job submit` quotes the words again for the head.
    return shlex.split(JOB["spec"]["entrypoint"])


def job_config() -> ClewConfig:
    argv = job_argv()
    assert argv[:3] == ["clew", "train", "--config"], argv
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IgnoredKeyWarning)  # the recipe's SkyRL-only keys
        return load_config(ROOT / argv[3], argv[4:])


# ---------------------------------------------------------------- tests: the check is real


def test_the_manifest_folder_holds_the_cluster_the_job_the_service_and_the_volume() -> None:
    assert {"raycluster.yaml", "rayjob.yaml", "rayservice.yaml", "shared-pvc.yaml"} <= set(
        MANIFESTS
    )


@pytest.mark.parametrize("name", MANIFESTS)
def test_every_manifest_validates_against_its_crd_schema(name: str) -> None:
    for doc in documents(name):
        assert problems(doc) == [], f"{name}: {doc['kind']} {doc['metadata'].get('name')}"


def _worker(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["workerGroupSpecs"][0]


def _container(doc: dict[str, Any]) -> dict[str, Any]:
    return _worker(doc)["template"]["spec"]["containers"][0]


def _rename(node: dict[str, Any], old: str, new: str) -> None:
    node[new] = node.pop(old)


WORKER = ".spec.workerGroupSpecs[0]"
CONTAINER = f"{WORKER}.template.spec.containers[0]"
BROKEN = {  # what is broken: (manifest, the edit, the one problem it must give)
    "wrong type": (
        "raycluster.yaml",
        lambda d: _worker(d).update(replicas="3"),
        f"{WORKER}.replicas: '3' is not of type 'integer'",
    ),
    "misspelt key": (
        "raycluster.yaml",
        lambda d: _rename(_container(d), "volumeMounts", "volumeMount"),
        f"{CONTAINER}.volumeMount: unknown field (known: ",
    ),
    "value outside an enum": (
        "raycluster.yaml",
        lambda d: d["spec"]["authOptions"].update(mode="tokens"),
        ".spec.authOptions.mode: 'tokens' is not one of ['disabled', 'token']",
    ),
    "two volumes of one name": (
        "raycluster.yaml",
        lambda d: _worker(d)["template"]["spec"]["volumes"].append({"name": "shared"}),
        f"{WORKER}.template.spec.volumes[2]: duplicate name ('shared',)",
    ),
    "malformed quantity": (
        "raycluster.yaml",
        lambda d: _container(d)["resources"]["limits"].update(memory="128 GB"),
        f"{CONTAINER}.resources.limits.memory: '128 GB' does not match",
    ),
    "misspelt metadata": (
        "raycluster.yaml",
        lambda d: _rename(d["metadata"], "labels", "label"),
        ".metadata.label: unknown field",
    ),
    "misspelt job key": (
        "rayjob.yaml",
        lambda d: _rename(d["spec"], "entrypoint", "entryPoint"),
        ".spec.entryPoint: unknown field",
    ),
    "misspelt service key": (
        "rayservice.yaml",
        lambda d: _rename(d["spec"], "serveConfigV2", "serveConfig"),
        ".spec.serveConfig: unknown field",
    ),
    "wrong type in the service's cluster": (
        "rayservice.yaml",
        lambda d: _worker({"spec": d["spec"]["rayClusterConfig"]}).update(maxReplicas="3"),
        ".spec.rayClusterConfig.workerGroupSpecs[0].maxReplicas: '3' is not of type 'integer'",
    ),
    "misspelt claim key": (
        "shared-pvc.yaml",
        lambda d: _rename(d["spec"], "accessModes", "accessMode"),
        ".spec.accessMode: unknown field",
    ),
}


@pytest.mark.parametrize("what", sorted(BROKEN))
def test_a_broken_copy_of_a_manifest_fails_naming_what_is_wrong(what: str) -> None:
    name, edit, expected = BROKEN[what]
    doc = copy.deepcopy(documents(name)[0])
    edit(doc)
    [problem] = problems(doc)
    assert problem.startswith(expected)


def test_a_kind_without_a_vendored_schema_is_refused() -> None:
    with pytest.raises(ValueError, match="no schema for ray.io/v1alpha1 RayCluster"):
        problems({**CLUSTER, "apiVersion": "ray.io/v1alpha1"})


def test_a_cel_rule_the_check_cannot_evaluate_is_reported_not_passed() -> None:
    doc = copy.deepcopy(CLUSTER)
    doc["spec"]["managedBy"] = "ray.io/kuberay-operator"
    assert any("CEL rule not checked" in p for p in problems(doc))


def test_the_vendored_schemas_are_the_named_release_without_descriptions() -> None:
    readme = (SCHEMAS / "README.md").read_text()
    assert "v1.7.0" in readme
    for name, crd in (
        ("raycluster", "rayclusters"),
        ("rayjob", "rayjobs"),
        ("rayservice", "rayservices"),
    ):
        assert (
            f"https://github.com/ray-project/kuberay/blob/v1.7.0/ray-operator/config/crd/"
            f"bases/ray.io_{crd}.yaml"
        ) in readme
        text = (SCHEMAS / f"{name}.json").read_text()
        assert '"description": "' not in text
        assert set(json.loads(text)["properties"]) >= {"apiVersion", "kind", "metadata", "spec"}


# ---------------------------------------------------------------- tests: what the files say


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_every_pod_mounts_the_read_write_many_volume_at_shared(name: str) -> None:
    assert PVC["spec"]["accessModes"] == ["ReadWriteMany"]
    claim = PVC["metadata"]["name"]
    for group, pod in pod_templates(CLUSTERS[name]).items():
        shared = [v["name"] for v in pod["volumes"] if v.get("persistentVolumeClaim")]
        claims = [
            v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if v["name"] in shared
        ]
        assert claims == [claim], group
        for container in pod["containers"]:
            mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
            assert mounts.get("/shared") == shared[0], f"{group}/{container['name']}"


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_gpu_workers_have_shared_memory_for_the_object_store_and_nccl(name: str) -> None:
    for group, pod in pod_templates(CLUSTERS[name]).items():
        if not any(gpu_limit(c) for c in pod["containers"]):
            continue
        memory = {
            v["name"] for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"
        }
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
        assert mounts.get("/dev/shm") in memory, group


def test_the_cluster_has_the_gpus_the_job_places_its_workers_on() -> None:
    placement = job_config().trainer.placement
    assert JOB["spec"]["clusterSelector"] == {"ray.io/cluster": CLUSTER["metadata"]["name"]}
    head = CLUSTER["spec"]["headGroupSpec"]
    assert all(gpu_limit(c) == 0 for c in head["template"]["spec"]["containers"])
    assert head["rayStartParams"]["num-cpus"] == "0"  # the driver's node takes no workers
    gpu_groups = [
        g
        for g in CLUSTER["spec"]["workerGroupSpecs"]
        if any(gpu_limit(c) for c in g["template"]["spec"]["containers"])
    ]
    assert len(gpu_groups) == 1
    group = gpu_groups[0]
    # The placement group asks for every GPU at once: a fixed group of exactly that size.
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"]
    assert group["replicas"] == placement.policy_num_nodes == 3
    ray_container = group["template"]["spec"]["containers"][0]
    assert gpu_limit(ray_container) == placement.policy_num_gpus_per_node == 2
    resources = ray_container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"]
    # Each worker's bundle is {GPU: 1, CPU: 1}: a node needs a CPU per GPU at least.
    assert int(resources["limits"]["cpu"]) >= placement.policy_num_gpus_per_node


def test_the_job_runs_the_seed_recipe_with_keys_clew_knows_and_paths_on_shared() -> None:
    argv = job_argv()
    assert argv[:4] == ["clew", "train", "--config", "recipes/seed-qwen3vl-8b.yaml"]
    # An `&&` or `;` would end the entrypoint inside the submitter's shell, not on the head.
    assert not {"&&", "||", ";", "|", "&"} & set(argv)
    cfg = job_config()
    t = cfg.trainer
    assert (t.placement.policy_num_nodes, t.placement.policy_num_gpus_per_node) == (3, 2)
    run_dir = Path(t.log_path) / t.run_name
    paths = [
        t.policy.model.path,
        *cfg.data.train_data,
        *cfg.data.val_data,
        t.log_path,
        t.ckpt_path or str(run_dir / "ckpts"),
        t.export_path or str(run_dir / "exports"),
    ]
    assert all(p and p.startswith("/shared/") for p in paths), paths
    assert t.resume_mode == "latest"  # a resubmitted job goes on from /shared's checkpoints


def test_the_job_gives_a_stop_time_for_the_checkpoint_and_export() -> None:
    runtime_env = yaml.safe_load(JOB["spec"]["runtimeEnvYAML"])
    assert int(runtime_env["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"]) >= 60


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_token_authentication_is_on_with_the_images_ray(name: str) -> None:
    spec = CLUSTERS[name]["spec"]
    assert spec["authOptions"]["mode"] == "token"
    ray_version = Version(spec["rayVersion"])
    assert ray_version >= Version("2.52.0")  # KubeRay refuses token auth below
    assert ray_version == Version(base_image_ray())
    assert ray_version in requirement("ray", extra="ray").specifier


def test_the_manifests_run_the_image_the_dockerfile_builds() -> None:
    tags = re.findall(r"docker build -f deploy/Dockerfile -t (\S+) \.", DOCKERFILE.read_text())
    assert len(tags) == 1, "the Dockerfile documents one build command with its tag"
    image = tags[0]
    assert image.rsplit(":", 1)[1] == PYPROJECT["project"]["version"]
    images = [
        c["image"]
        for cluster in CLUSTERS.values()
        for pod in pod_templates(cluster).values()
        for c in pod["containers"]
    ]
    assert images and set(images) == {image}
    assert "submitterPodTemplate" not in JOB["spec"]  # the submitter runs the head's image


# ---------------------------------------------------------------- tests: the Serve config


def serve_config() -> dict[str, Any]:
    return yaml.safe_load(SERVICE["spec"]["serveConfigV2"])


def clew_app(config: dict[str, Any]) -> dict[str, Any]:
    [app] = [a for a in config["applications"] if a["import_path"] == "clew.serve:build_app"]
    return app


def _models(annotation: Any) -> list[type]:
    """The pydantic models a field's annotation names (through Optional, Union, List)."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def unknown_serve_keys(model: type, data: Any, path: str = "") -> list[str]:
    """Keys of ``data`` that ``model`` (a Ray Serve schema) does not declare, at any depth.

    Ray Serve's schemas ignore unknown keys, so a misspelt option (``num_replica``) would be
    accepted and do nothing, as Kubernetes would prune a misspelt manifest field.
    """
    if not isinstance(data, dict):
        return []
    fields = {f.alias or name: f for name, f in model.model_fields.items()}
    out = []
    for key, value in data.items():
        where = f"{path}.{key}"
        if key not in fields:
            out.append(f"{where}: not a field of {model.__name__}")
            continue
        for sub in _models(fields[key].annotation)[:1]:
            items = enumerate(value) if isinstance(value, list) else [(None, value)]
            for i, item in items:
                out += unknown_serve_keys(sub, item, where if i is None else f"{where}[{i}]")
    return out


def serve_problems(config: dict[str, Any]) -> list[str]:
    from ray.serve.schema import ServeDeploySchema

    try:
        ServeDeploySchema.model_validate(config)
    except ValueError as err:
        return [str(err)]
    return unknown_serve_keys(ServeDeploySchema, config)


def test_the_serve_config_is_valid_for_ray_serve_with_no_key_it_would_ignore() -> None:
    pytest.importorskip("ray.serve")
    assert serve_problems(serve_config()) == []


def test_a_broken_serve_config_is_refused_naming_what_is_wrong() -> None:
    pytest.importorskip("ray.serve")
    config = serve_config()
    deployment = clew_app(config)["deployments"][0]
    _rename(deployment["autoscaling_config"], "max_replicas", "max_replica")
    [problem] = serve_problems(config)
    assert problem.startswith(".applications[0].deployments[0].autoscaling_config.max_replica:")
    config = serve_config()
    clew_app(config)["deployments"][0]["num_replicas"] = 2  # beside autoscaling_config
    [problem] = serve_problems(config)
    assert "num_replicas is not allowed when autoscaling_config is provided" in problem


def test_the_serve_app_is_clew_build_app_with_args_it_accepts() -> None:
    pytest.importorskip("ray.serve")
    from ray._common.utils import import_attr

    from clew.errors import ConfigError
    from clew.serve.ray_serve import build_app

    app = clew_app(serve_config())
    assert import_attr(app["import_path"]) is build_app
    built = build_app(app["args"])  # BuildArgs: every key known, every value valid
    # Serve applies a `deployments` entry to the deployment of that name in the built app.
    assert [d["name"] for d in app["deployments"]] == [built._bound_deployment.name]
    with pytest.raises(ConfigError, match="max_adaptors: Extra inputs are not permitted"):
        build_app({**app["args"], "max_adaptors": 8})


def test_the_service_serves_the_base_the_job_trains_and_adapters_from_shared() -> None:
    args = clew_app(serve_config())["args"]
    assert args["model"] == job_config().trainer.policy.model.path
    assert args["adapters"].startswith("/shared/")


def test_serve_replicas_fit_on_the_gpu_nodes_the_service_can_grow_to() -> None:
    [deployment] = clew_app(serve_config())["deployments"]
    per_replica = deployment["ray_actor_options"]
    scaling = deployment["autoscaling_config"]
    spec = SERVICE["spec"]["rayClusterConfig"]
    assert spec["enableInTreeAutoscaling"] is True  # nodes follow replicas
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert per_replica["num_gpus"] == 1
    for bound, nodes in (("min_replicas", "minReplicas"), ("max_replicas", "maxReplicas")):
        gpus = sum(
            g[nodes] * gpu_limit(g["template"]["spec"]["containers"][0])
            for g in spec["workerGroupSpecs"]
        )
        assert scaling[bound] * per_replica["num_gpus"] <= gpus, bound
    for group in spec["workerGroupSpecs"]:
        container = group["template"]["spec"]["containers"][0]
        replicas_here = gpu_limit(container) // per_replica["num_gpus"]
        assert replicas_here * per_replica["num_cpus"] <= int(
            container["resources"]["limits"]["cpu"]
        )
    # A replica batches what it holds: let it hold more than Serve's default of 5.
    assert scaling["target_ongoing_requests"] <= deployment["max_ongoing_requests"]
    assert deployment["max_ongoing_requests"] >= clew_app(serve_config())["args"]["max_batch_size"]


def test_every_replica_reads_the_api_key_from_a_secret_and_requires_it() -> None:
    args = clew_app(serve_config())["args"]
    assert args["require_api_key"] is True
    spec = SERVICE["spec"]["rayClusterConfig"]
    for group in spec["workerGroupSpecs"]:  # replicas need a GPU: they run on these nodes
        [env] = [
            e
            for e in group["template"]["spec"]["containers"][0]["env"]
            if e["name"] == args["api_key_env"]
        ]
        assert set(env) == {"name", "valueFrom"}  # from a Secret, never a literal value
        assert env["valueFrom"]["secretKeyRef"]["name"]


def test_the_serve_port_is_the_heads_serve_port() -> None:
    port = serve_config()["http_options"]["port"]
    head = SERVICE["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    ports = {p["name"]: p["containerPort"] for p in head["containers"][0]["ports"]}
    assert ports["serve"] == port  # KubeRay's serve Service targets the port named serve


# ---------------------------------------------------------------- tests: the image


def instructions() -> list[tuple[str, str]]:
    """The Dockerfile as (INSTRUCTION, arguments), continuation lines joined."""
    out, pending = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        word, _, args = (pending + line).partition(" ")
        out.append((word.upper(), " ".join(args.split())))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def base_image_ray() -> str:
    froms = [args for word, args in instructions() if word == "FROM"]
    assert len(froms) == 1
    match = re.fullmatch(r"rayproject/ray:(\d+\.\d+\.\d+)-py311-gpu", froms[0])
    assert match, f"base image {froms[0]!r} is not a pinned rayproject/ray X.Y.Z-py311-gpu tag"
    return match.group(1)


def test_the_image_installs_clew_with_its_ray_extras_from_the_build_context() -> None:
    steps = instructions()
    assert Version(base_image_ray()) in requirement("ray", extra="ray").specifier
    assert Version("3.11") in SpecifierSet(PYPROJECT["project"]["requires-python"])
    copied = set()
    for word, args in steps:
        if word == "COPY":  # flags, sources, then the destination
            sources = [t for t in args.split() if not t.startswith("--")][:-1]
            copied |= {Path(source).name for source in sources}
    assert {"pyproject.toml", "README.md", "clew", "recipes"} <= copied
    installs = [a for w, a in steps if w == "RUN" and "pip install" in a]
    extras = [set(e.split(",")) for a in installs for e in re.findall(r'"\.\[([a-z0-9_,]+)\]"', a)]
    assert extras == [{"ray", "serve", "s3"}]  # installed from the context, with these extras
    assert extras[0] <= set(PYPROJECT["project"]["optional-dependencies"])
    assert any("clew --help" in a for a in installs)  # the build fails if clew is not on PATH
    torch_arg = next(a for w, a in steps if w == "ARG" and a.startswith("TORCH_VERSION="))
    assert Version(torch_arg.split("=", 1)[1]) in requirement("torch").specifier
    workdir = [a for w, a in steps if w == "WORKDIR"][-1]
    assert workdir.startswith("/home/ray/")  # where the job's `recipes/...` resolves


def test_the_image_runs_as_a_non_root_user_and_starts_sanely() -> None:
    steps = instructions()
    users = [a for w, a in steps if w == "USER"]
    assert users and users[-1] not in {"root", "0"}
    assert not [a for w, a in steps if w == "ENTRYPOINT"]  # KubeRay's command must run as given
    cmds = [a for w, a in steps if w == "CMD"]
    assert len(cmds) == 1 and json.loads(cmds[0])[0] == "clew"


def test_the_image_bakes_in_no_model_weights() -> None:
    text = " ".join(a for _, a in instructions())
    for needle in (
        "hf download",
        "snapshot_download",
        "huggingface-cli",
        ".safetensors",
        "/models",
    ):
        assert needle not in text


GLOB = {"**": ".*", "*": "[^/]*", "?": "[^/]"}  # Go's filepath.Match, with Docker's `**`


def dockerignored(path: str) -> bool:
    """Docker's rule: the last pattern matching the path or a folder above it decides."""
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    parts = path.split("/")
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern.removeprefix("!").strip("/")
        regex = "".join(
            GLOB.get(token, re.escape(token)) for token in re.findall(r"\*\*|\*|\?|[^*?]+", body)
        ).replace(".*/", "(?:.*/)?")  # `**/` also matches no folder at all
        if any(re.fullmatch(regex, "/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            ignored = not negate
    return ignored


def test_the_build_context_keeps_out_the_venv_runs_and_caches() -> None:
    for path in (
        ".venv/bin/python",
        "runs/demo/config.yaml",
        ".pytest_cache/v/cache",
        ".ruff_cache/x",
        ".hypothesis/examples/x",
        ".git/HEAD",
        "clew/__pycache__/cli.cpython-311.pyc",
        "clew.egg-info/PKG-INFO",
        "tests/test_deploy.py",
    ):
        assert dockerignored(path), path
    for path in ("pyproject.toml", "README.md", "clew/cli.py", "recipes/seed-qwen3vl-8b.yaml"):
        assert not dockerignored(path), path
