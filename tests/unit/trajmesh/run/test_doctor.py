"""`trajmesh doctor` (trajmesh/run/doctor.py) against recorded API responses.

No API server can run here. The responses are JSON files written by hand in the shape of the
Kubernetes API's list objects (tests/doctor_fixtures/<cluster>/*.json: a healthy GPU cluster and a
broken one). They are served below the real `kubernetes` client: a stand-in for its REST layer
(`ApiClient.rest_client`) answers each GET by URL path, so the doctor's calls go through the
client's typed APIs, `ApiClient.call_api` and its deserialization into `V1Node`, `V1Pod`, ... as
they would against a cluster. Anything but a GET fails the test (the doctor only reads).
Expected findings are written by hand from the fixtures.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

import pytest

pytest.importorskip("kubernetes")

from kubernetes.client import ApiClient, Configuration  # noqa: E402
from kubernetes.client.exceptions import ApiException  # noqa: E402
from repo_paths import TESTS

from trajmesh.run import doctor  # noqa: E402
from trajmesh.run.cli import main  # noqa: E402

FIXTURES = TESTS / "doctor_fixtures"
NS, RELEASE = "trajmesh", "rl"
ROUTES = {
    "/api/v1/nodes": "nodes.json",
    "/apis/storage.k8s.io/v1/storageclasses": "storageclasses.json",
    "/apis/apiextensions.k8s.io/v1/customresourcedefinitions": "customresourcedefinitions.json",
    "/apis/node.k8s.io/v1/runtimeclasses": "runtimeclasses.json",
    f"/api/v1/namespaces/{NS}/pods": "pods.json",
    f"/api/v1/namespaces/{NS}/persistentvolumeclaims": "persistentvolumeclaims.json",
}
PVC_PREFIX = f"/api/v1/namespaces/{NS}/persistentvolumeclaims/"
# The healthy cluster's GPU node is tainted nvidia.com/gpu=present:NoSchedule, as GPU pools usually are.
GPU_TOLERATION = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


class _Response:
    """What the client's REST layer returns (status, reason, data, headers)."""

    def __init__(self, status: int, data: bytes) -> None:
        self.status, self.reason, self.data = status, "OK", data

    def getheaders(self) -> dict[str, str]:
        return {"content-type": "application/json"}

    def getheader(self, name: str, default: str | None = None) -> str | None:
        return self.getheaders().get(name.lower(), default)


class RecordedRest:
    """Stands in for kubernetes.client.rest.RESTClientObject: GETs answered from one cluster's files."""

    def __init__(self, cluster: str) -> None:
        self.folder = FIXTURES / cluster
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def GET(self, url: str, headers: Any = None, query_params: Any = None,  # noqa: N802
            _preload_content: bool = True, _request_timeout: Any = None) -> _Response:
        path = urlsplit(url).path
        self.calls.append((path, dict(query_params or [])))
        if path.startswith(PVC_PREFIX):  # read one claim: the item of that name in the recorded list
            items = json.loads((self.folder / ROUTES[PVC_PREFIX[:-1]]).read_text())["items"]
            found = [i for i in items if i["metadata"]["name"] == path[len(PVC_PREFIX):]]
            if not found:
                raise ApiException(status=404, reason="Not Found")
            return _Response(200, json.dumps({"kind": "PersistentVolumeClaim", "apiVersion": "v1", **found[0]}).encode())
        return _Response(200, (self.folder / ROUTES[path]).read_bytes())

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the doctor must only read the cluster; it called {name}")


def _client(cluster: str) -> tuple[ApiClient, RecordedRest]:
    api = ApiClient(Configuration(host="https://recorded.invalid"))
    rest = RecordedRest(cluster)
    api.rest_client = rest
    return api, rest


def _run(cluster: str, sets: dict[str, Any], release: str | None = RELEASE) -> tuple[list[doctor.Finding], RecordedRest]:
    api, rest = _client(cluster)
    return doctor.run_checks(api, doctor.load_values([], sets), NS, release), rest


def _summary(findings: list[doctor.Finding]) -> list[tuple[str, str]]:
    return [(f.check, f.severity) for f in findings]


HEALTHY_VALUES = {
    "sharedVolume.storageClass": "efs-sc", "keda.enabled": True, "rollout.autoscaling.enabled": True,
    "monitoring.serviceMonitor.enabled": True, "rollout.runtimeClassName": "nvidia",
    "rollout.tolerations": GPU_TOLERATION, "learner.tolerations": GPU_TOLERATION,
}


def test_healthy_cluster_passes_every_check() -> None:
    findings, rest = _run("healthy", HEALTHY_VALUES)
    assert _summary(findings) == [
        ("gpu", "ok"), ("gpu", "ok"), ("gpu", "ok"), ("storage", "ok"), ("crd", "ok"), ("crd", "ok"),
        ("runtimeclass", "ok"), ("pod/rl-trajmesh-learner-0", "ok"), ("pod/rl-trajmesh-nats-provision-x7k2p", "ok")]
    assert [f.message for f in findings[:4]] == [
        "rollout: 1 pods x 1 GPUs fit on ['gpu-pool-1']",
        "evaluator: 1 pods x 1 GPUs fit on ['gpu-pool-1']",  # a rollout pod (on by default), its tolerations
        "learner: 1 pods x 1 GPUs fit on ['gpu-pool-1']",
        "shared volume: class 'efs-sc' (efs.csi.aws.com) serves ReadWriteMany"]
    assert findings[4].message == "keda: scaledobjects.keda.sh installed"
    assert findings[6].message == "rollout: RuntimeClass 'nvidia' exists (handler 'nvidia')"
    assert doctor.report(findings)[1] == 0
    selectors = {path: q.get("labelSelector") for path, q in rest.calls}
    assert selectors[f"/api/v1/namespaces/{NS}/pods"] == "app.kubernetes.io/instance=rl"
    assert selectors[f"/api/v1/namespaces/{NS}/persistentvolumeclaims"] == "app.kubernetes.io/instance=rl"


def test_untolerated_gpu_taint_blocks_with_the_fix() -> None:
    sets = {k: v for k, v in HEALTHY_VALUES.items() if not k.endswith("tolerations")}
    findings, _ = _run("healthy", sets, release=None)
    gpu = [f for f in findings if f.check == "gpu"]
    assert _summary(gpu) == [("gpu", "block"), ("gpu", "block"), ("gpu", "block")]  # rollout, evaluator, learner
    assert gpu[0].message == "rollout needs 1 nvidia.com/gpu per pod; no usable node has that (usable: none)"
    assert gpu[1].message == "evaluator needs 1 nvidia.com/gpu per pod; no usable node has that (usable: none)"
    assert gpu[0].fix == ("add rollout.tolerations / rollout.nodeSelector matching the GPU nodes "
                          "(gpu-pool-1: taints ['nvidia.com/gpu=present:NoSchedule'] not tolerated)")


def test_broken_cluster_reports_every_blocking_finding_and_exits_1() -> None:
    findings, _ = _run("broken", {"keda.enabled": True, "rollout.autoscaling.enabled": True,
                                  "rollout.runtimeClassName": "nvidia"})
    assert _summary(findings) == [
        ("gpu", "block"), ("gpu", "block"), ("gpu", "block"),  # gpu-b tainted, gpu-c cordoned
        ("gpu", "warn"),  # rollout + evaluator + learner ask for more GPUs than the cluster has
        ("storage", "block"),  # the default class is a GCE persistent disk: ReadWriteOnce only
        ("crd", "block"),  # KEDA scaling on, KEDA not installed
        ("runtimeclass", "block"),
        ("pod/rl-trajmesh-environment-7b5d8f9c4-m4n8p", "warn"), ("pod/rl-trajmesh-environment-7b5d8f9c4-m4n8p", "warn"),
        ("pod/rl-trajmesh-grader-6d9f7c5b8-qx2lm", "block"),
        ("pod/rl-trajmesh-learner-0", "block"),
        ("pod/rl-trajmesh-store-0", "block"), ("pod/rl-trajmesh-store-0", "warn"),
        ("claim/rl-trajmesh-shared", "block"),
    ]
    by_check = {(f.check, f.severity): f for f in findings}
    storage = by_check[("storage", "block")]
    assert storage.message == ("shared volume: class 'standard' (the default) (pd.csi.storage.gke.io) serves "
                               "ReadWriteOnce only; learner and rollout pods on different nodes cannot share it")
    assert storage.fix.endswith("(RWX-capable here: none: install one (NFS subdir provisioner, CephFS, EFS, "
                                "Filestore, Azure Files))")
    crd = by_check[("crd", "block")]
    assert crd.message == "keda is on but the CRD scaledobjects.keda.sh is not installed"
    assert by_check[("runtimeclass", "block")].message == "rollout.runtimeClassName 'nvidia' does not exist (cluster has none)"
    learner = by_check[("pod/rl-trajmesh-learner-0", "block")]
    assert learner.message.startswith("not scheduled: Unschedulable: 0/3 nodes are available: 1 Insufficient nvidia.com/gpu")
    store = [f for f in findings if f.check == "pod/rl-trajmesh-store-0"]
    assert store[0].message.startswith("container store: CrashLoopBackOff (back-off 5m0s")
    assert store[0].fix == "read the previous run's log: kubectl logs -n trajmesh rl-trajmesh-store-0 -c store --previous"
    assert store[1].message == "container store: 7 restarts, last ended OOMKilled (exit code 137)"
    assert store[1].fix == "raise resources.limits.memory of this component (it was killed for memory)"
    grader = by_check[("pod/rl-trajmesh-grader-6d9f7c5b8-qx2lm", "block")]
    assert grader.message.startswith("container grader: ImagePullBackOff")
    env = [f for f in findings if f.check.startswith("pod/rl-trajmesh-environment")]
    assert env[0].message == "container environment: 1 restarts, last ended Error (exit code 1)"
    assert env[1].message == "Running, not ready (ContainersNotReady)"
    text, code = doctor.report(findings)
    assert code == 1 and text.endswith("14 checks: 10 blocking, 4 warnings")
    assert "[BLOCK] claim/rl-trajmesh-shared: Pending (class standard, modes ['ReadWriteMany'])\n        fix: " in text


def test_existing_claim_is_read_and_checked() -> None:
    ok, _ = _run("healthy", {**HEALTHY_VALUES, "sharedVolume.existingClaim": "rl-trajmesh-shared"}, release=None)
    assert [f.message for f in ok if f.check == "storage"] == [
        "shared volume: claim 'rl-trajmesh-shared' is ReadWriteMany and Bound"]
    pending, _ = _run("broken", {"sharedVolume.existingClaim": "rl-trajmesh-shared"}, release=None)
    assert _summary([f for f in pending if f.check == "storage"]) == [("storage", "warn")]
    rwo, _ = _run("broken", {"sharedVolume.existingClaim": "archive-rl-trajmesh-store-0"}, release=None)
    assert [f.message for f in rwo if f.check == "storage"] == [
        "claim 'archive-rl-trajmesh-store-0' has access modes ['ReadWriteOnce'], not ReadWriteMany"]
    missing, _ = _run("healthy", {"sharedVolume.existingClaim": "nope"}, release=None)
    assert [f.message for f in missing if f.check == "storage"] == [
        "sharedVolume.existingClaim 'nope' does not exist in 'trajmesh'"]


def test_a_named_class_that_does_not_exist_blocks() -> None:
    findings, _ = _run("healthy", {"sharedVolume.storageClass": "nfs-client"}, release=None)
    storage = [f for f in findings if f.check == "storage"]
    assert _summary(storage) == [("storage", "block")]
    assert storage[0].message == "shared volume: storage class 'nfs-client' does not exist; the claim would stay Pending"
    assert "RWX-capable here: efs-sc" in storage[0].fix


def test_cpu_only_values_ask_for_no_gpu_and_no_crd() -> None:
    findings, rest = _run("broken", {"rollout.engine": "torch", "learner.gpus": 0,
                                     "sharedVolume.storageClass": "standard"}, release=None)
    assert findings[0] == doctor.Finding(
        "gpu", "ok", "no component asks for GPUs (rollout.engine is not sglang, learner.gpus 0)")
    assert [f.severity for f in findings if f.check in ("crd", "runtimeclass")] == ["ok", "ok"]
    assert "/api/v1/nodes" not in [p for p, _ in rest.calls]  # nothing to look for, nothing asked


def test_cli_prints_findings_with_fixes_and_exits_nonzero(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    api, _ = _client("broken")
    monkeypatch.setattr(doctor, "api_client_from", lambda kubeconfig, context: api)
    code = main(["doctor", "-n", NS, "--release", RELEASE, "--set", "rollout.runtimeClassName=nvidia"])
    out = capsys.readouterr().out
    assert code == 1
    assert ("[BLOCK] runtimeclass: rollout.runtimeClassName 'nvidia' does not exist (cluster has none)\n"
            "        fix: install the NVIDIA container toolkit's RuntimeClass") in out
    healthy, _ = _client("healthy")
    monkeypatch.setattr(doctor, "api_client_from", lambda kubeconfig, context: healthy)
    sets = [f"--set={k}={json.dumps(v)}" for k, v in HEALTHY_VALUES.items()]
    assert main(["doctor", "-n", NS, "--release", RELEASE, *sets]) == 0
    assert capsys.readouterr().out.endswith("9 checks: 0 blocking, 0 warnings\n")


def test_a_shared_claim_without_read_write_many_blocks_unless_single_node() -> None:
    """sharedVolume.accessModes without ReadWriteMany: the chart refuses to render it
    (test_helm_chart.py), the doctor blocks; sharedVolume.singleNode allows ReadWriteOnce on a one-node
    cluster (recorded: one Ready node, a local-path default class) and warns where there are more."""
    rwo = {"sharedVolume.accessModes": ["ReadWriteOnce"]}
    blocked, _ = _run("healthy", {**HEALTHY_VALUES, **rwo}, release=None)
    storage = [f for f in blocked if f.check == "storage"]
    assert _summary(storage) == [("storage", "block")]
    assert storage[0].message.startswith("sharedVolume.accessModes ['ReadWriteOnce'] has no ReadWriteMany")
    assert "sharedVolume.singleNode: true" in storage[0].fix
    one, rest = _run("single-node", {**rwo, "sharedVolume.singleNode": True}, release=None)
    assert [(f.severity, f.message) for f in one if f.check == "storage"] == [
        ("ok", "shared volume: class 'local-path' (the default) (rancher.io/local-path), ReadWriteOnce on a "
               "one-node cluster (sharedVolume.singleNode)")]
    assert "/api/v1/nodes" in [p for p, _ in rest.calls]
    many, _ = _run("healthy", {**HEALTHY_VALUES, **rwo, "sharedVolume.singleNode": True}, release=None)
    warned = [f for f in many if f.check == "storage"]
    assert _summary(warned) == [("storage", "warn")] and "the cluster has 2 Ready nodes" in warned[0].message
    # ReadWriteMany asked of a class that serves ReadWriteOnce only still blocks on one node
    rwx_on_local, _ = _run("single-node", {}, release=None)
    assert _summary([f for f in rwx_on_local if f.check == "storage"]) == [("storage", "block")]
