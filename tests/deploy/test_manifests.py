"""deploy/kuberay/*.yaml: every manifest parses, uses only fields KubeRay's ray.io/v1 CRDs define (with the
types and enums they give, required fields present: tests/deploy/kuberay_fields.py), and says what a run
needs: separate roller and trainer groups with GPUs and the Ray resources the entrypoint asks for, token
auth, the metrics port, and an entrypoint the CLI accepts."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import ray
import yaml

from controller.config import load_config
from tests.deploy.kuberay_fields import FIELDS

KUBERAY = Path(__file__).resolve().parents[2] / "deploy" / "kuberay"
MANIFESTS = sorted(KUBERAY.glob("*.yaml"))
_TYPES = {"string": str, "integer": int, "boolean": bool, "object": dict, "array": list, "int-or-string": (int, str)}


def _schema_path(path: str) -> str:
    """The FIELDS key of an object's path (RayJob's rayClusterSpec is RayCluster's spec; a group's template
    is a PodTemplateSpec)."""
    path = re.sub(r"^RayJob\.spec\.rayClusterSpec", "RayCluster.spec", path)
    return re.sub(r"^RayCluster\.spec\.(headGroupSpec|workerGroupSpecs\[\])\.template", "PodTemplateSpec", path)


def _type_ok(value, type_name: str) -> bool:
    if type_name == "any":
        return True
    if isinstance(value, bool) and type_name != "boolean":
        return False
    return isinstance(value, _TYPES[type_name])


def crd_problems(node, path: str) -> list[str]:
    """One line per field of ``node`` (at ``path``, e.g. ``RayCluster``) that the CRD does not define, has
    another type or enum value than it gives, or per required field missing."""
    if isinstance(node, list):
        return [p for item in node for p in crd_problems(item, path + "[]")]
    if not isinstance(node, dict):
        return []
    schema = FIELDS.get(_schema_path(path))
    if schema is None:
        return [f"{path}: no CRD field list for this object (tests/deploy/kuberay_fields.py)"]
    if "map" in schema:
        return [f"{path}.{k}: {v!r} is not a {schema['map']}" for k, v in node.items() if not _type_ok(v, schema["map"])]
    allowed, problems = schema["fields"].split(), []
    problems += [f"{path}: required field {r!r} missing" for r in schema.get("required", "").split() if r not in node]
    for key, value in node.items():
        if key not in allowed:
            problems.append(f"{path}.{key}: unknown field; ray.io/v1 accepts {allowed}")
        elif key not in schema["types"]:
            problems.append(f"{path}.{key}: a field no field list covers yet (tests/deploy/kuberay_fields.py)")
        elif not _type_ok(value, schema["types"][key]):
            problems.append(f"{path}.{key}: {value!r} is not a {schema['types'][key]}")
        elif key in schema.get("enums", {}) and value not in schema["enums"][key]:
            problems.append(f"{path}.{key}: {value!r} is not one of {schema['enums'][key]}")
        else:
            problems += crd_problems(value, f"{path}.{key}")
    return problems


def _load(path: Path) -> dict:
    doc = yaml.safe_load(path.read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] in ("RayCluster", "RayJob"), path.name
    return doc


def _cluster_spec(doc: dict) -> dict:
    return doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]


def test_the_manifests_are_a_raycluster_and_a_rayjob():
    assert sorted(_load(p)["kind"] for p in MANIFESTS) == ["RayCluster", "RayJob"]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_uses_only_fields_of_the_kuberay_crds(path):
    doc = _load(path)
    assert crd_problems(doc, doc["kind"]) == []
    assert doc["metadata"]["name"]


def test_unknown_fields_wrong_types_and_missing_required_fields_fail():
    doc = _load(KUBERAY / "raycluster.yaml")
    group = doc["spec"]["workerGroupSpecs"][0]
    group["replica"] = 2                   # a typo of replicas
    group["maxReplicas"] = "8"             # a string where the CRD has an integer
    del group["groupName"]                 # required
    doc["spec"]["authOptions"]["mode"] = "password"
    doc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["gpus"] = 1
    problems = crd_problems(doc, "RayCluster")
    assert len(problems) == 5, problems
    for needle in ("workerGroupSpecs[]: required field 'groupName' missing", "workerGroupSpecs[].replica: unknown",
                   "maxReplicas: '8' is not a integer", "mode: 'password' is not one of", "containers[].gpus: unknown"):
        assert any(needle in p for p in problems), (needle, problems)


def _entrypoint_config(doc: dict):
    """The RayJob entrypoint's hflow-async command line, resolved by the CLI's own config loader."""
    argv = shlex.split(doc["spec"]["entrypoint"])
    assert argv[0] == "hflow-async"
    flags = {argv[i]: argv[i + 1] for i in range(1, len(argv) - 1) if argv[i].startswith("--")}
    overrides = [a for a in argv[1:] if "=" in a and not a.startswith("--")]
    return load_config(mode=flags["--mode"], preset=flags["--preset"], overrides=overrides)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_each_pool_has_its_own_gpu_group_and_the_head_exposes_the_metrics_port(path):
    spec = _cluster_spec(_load(path))
    assert spec["authOptions"]["mode"] == "token"  # Ray token auth stays on
    assert spec["rayVersion"] == ray.__version__    # the image carries the Ray this project is tested with
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert sorted(groups) == ["rollers", "trainers"]
    for g in groups.values():
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        [container] = g["template"]["spec"]["containers"]
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
        assert container["resources"]["limits"] == container["resources"]["requests"]
    assert groups["rollers"]["maxReplicas"] > groups["rollers"]["minReplicas"]  # the roller group scales
    assert set(groups["rollers"]["resources"]) == {"hflow_roller"}
    assert set(groups["trainers"]["resources"]) == {"hflow_trainer"}
    [head] = spec["headGroupSpec"]["template"]["spec"]["containers"]
    assert {"name": "hflow-metrics", "containerPort": 9400} in head["ports"]


def test_the_rayjob_entrypoint_is_a_valid_run_that_fits_the_groups():
    doc = _load(KUBERAY / "rayjob.yaml")
    cfg = _entrypoint_config(doc)
    groups = {g["groupName"]: g for g in doc["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    assert doc["spec"]["submissionMode"] == "K8sJobMode" and cfg.ray.address == "auto"
    assert (cfg.metrics.host, cfg.metrics.port) == ("0.0.0.0", 9400)  # the head's hflow-metrics port
    assert cfg.rollers.resources == {"hflow_roller": 1.0} and cfg.trainer.resources == {"hflow_trainer": 1.0}
    rollers_per_pod = float(groups["rollers"]["resources"]["hflow_roller"]) / cfg.rollers.resources["hflow_roller"]
    assert cfg.rollers.num_replicas <= rollers_per_pod * groups["rollers"]["replicas"]
    ranks_per_pod = float(groups["trainers"]["resources"]["hflow_trainer"]) / cfg.trainer.resources["hflow_trainer"]
    gpus_per_pod = int(groups["trainers"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    assert ranks_per_pod == gpus_per_pod and cfg.trainer.num_ranks <= ranks_per_pod * groups["trainers"]["replicas"]


def test_the_rayjob_binds_its_cross_pod_sockets_on_the_pod_that_opens_them():
    """No fixed address can name the pod that gets trainer rank 0: every cross-pod socket binds ``node`` (the
    binding process's Ray node address, its pod IP); the data plane and the weight plane's control socket are
    CURVE-keyed; weights cross pods (the rollers have their own pods), so not through shared memory."""
    cfg = _entrypoint_config(_load(KUBERAY / "rayjob.yaml"))
    assert cfg.transferqueue.host == cfg.checkpointengine.host == cfg.trainer.host == "node"
    assert cfg.transferqueue.curve and cfg.checkpointengine.curve
    assert cfg.checkpointengine.backend == "broadcast"
