"""`trajmesh doctor`: checks a Kubernetes cluster for what the Helm chart needs, before and after install.

    chart values (values.yaml + -f files + --set) ──▶ what the release will ask for
    Kubernetes API (the `kubernetes` client)     ──▶ what the cluster has
                                                  └─▶ one Finding per check: ok / warn / block, each with its fix

Checks (read-only API calls; a namespace-scoped reader role suffices except for nodes, storage
classes, CRDs and runtime classes, which are cluster-scoped):

- GPUs: schedulable nodes with allocatable ``nvidia.com/gpu`` matching each GPU component's
  nodeSelector and tolerating its taints, enough for one pod (block) and for all of them (warn).
- Storage: the shared volume's claim (an existing claim: ReadWriteMany and Bound; else the class the
  chart's claim will get, named or the default) on a provisioner that can serve ReadWriteMany, and a
  default class for the chart's ReadWriteOnce claims (store archive, NATS, Redis) when they name none.
  The API does not say which access modes a provisioner supports: known provisioners are listed
  below, an unknown one is a warning.
- CRDs: KEDA's ``scaledobjects.keda.sh`` when KEDA scaling is on for a component; the
  Prometheus operator's ServiceMonitor / PodMonitor / PrometheusRule CRDs when those are enabled.
- RuntimeClass: every ``runtimeClassName`` the values set exists.
- A release (``--release``): each pod's readiness, scheduling failures, waiting reasons and the
  last restart's termination reason; the release's Pending claims.

Exit code 1 when any finding blocks, else 0. No API server runs in the test suite: the tests serve
hand-written API responses through the client's own deserialization (tests/unit/trajmesh/run/test_doctor.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

OK, WARN, BLOCK = "ok", "warn", "block"
GPU = "nvidia.com/gpu"
DEFAULT_CLASS_ANNOTATIONS = ("storageclass.kubernetes.io/is-default-class",
                             "storageclass.beta.kubernetes.io/is-default-class")
RWX_PROVISIONERS = ("nfs", "cephfs", "efs.csi.aws.com", "filestore.csi.storage.gke.io", "file.csi.azure.com",
                    "kubernetes.io/azure-file", "driver.longhorn.io", "csi.juicefs.com", "seaweedfs-csi-driver",
                    "spectrumscale.csi.ibm.com", "csi.weka.io", "lustre.csi.aws.com", "pvc.csi.vast.com")
"""Provisioners (or substrings of their names) that serve ReadWriteMany volumes."""
RWO_ONLY_PROVISIONERS = ("ebs.csi.aws.com", "kubernetes.io/aws-ebs", "pd.csi.storage.gke.io", "kubernetes.io/gce-pd",
                         "disk.csi.azure.com", "kubernetes.io/azure-disk", "rancher.io/local-path",
                         "openebs.io/local", "topolvm.io", "kubernetes.io/no-provisioner", "rbd.csi.ceph.com",
                         "cinder.csi.openstack.org", "hostpath.csi.k8s.io")
"""Provisioners that serve ReadWriteOnce (block) volumes only."""
CRDS = {
    "keda": ("scaledobjects.keda.sh", "install KEDA (helm install keda kedacore/keda -n keda --create-namespace) "
                                      "or set keda.enabled=false"),
    "serviceMonitor": ("servicemonitors.monitoring.coreos.com", "install the Prometheus operator "
                       "(kube-prometheus-stack) or set monitoring.serviceMonitor.enabled=false"),
    "podMonitor": ("podmonitors.monitoring.coreos.com", "install the Prometheus operator (kube-prometheus-stack) "
                   "or set monitoring.podMonitor.enabled=false"),
    "prometheusRule": ("prometheusrules.monitoring.coreos.com", "install the Prometheus operator "
                       "(kube-prometheus-stack) or set monitoring.prometheusRule.enabled=false"),
}
WAITING_FIXES = {
    "CrashLoopBackOff": "read the previous run's log: kubectl logs -n {ns} {pod} -c {container} --previous",
    "ImagePullBackOff": "check the image name and tag in the values and imagePullSecrets "
                        "(kubectl describe pod -n {ns} {pod})",
    "ErrImagePull": "check the image name and tag in the values and imagePullSecrets "
                    "(kubectl describe pod -n {ns} {pod})",
    "InvalidImageName": "set a valid image repository and tag in the values",
    "CreateContainerConfigError": "a Secret or ConfigMap the pod references is missing: "
                                  "kubectl describe pod -n {ns} {pod}",
    "CreateContainerError": "kubectl describe pod -n {ns} {pod} shows the runtime's error",
}
TERMINATED_FIXES = {
    "OOMKilled": "raise resources.limits.memory of this component (it was killed for memory)",
    "Error": "read the log of the run that failed: kubectl logs -n {ns} {pod} -c {container} --previous",
    "ContainerCannotRun": "kubectl describe pod -n {ns} {pod} shows why the runtime could not start it",
}


@dataclass(frozen=True)
class Finding:
    check: str
    """What was checked (gpu, storage, crd, runtimeclass, pod/NAME, claim/NAME)."""
    severity: str
    """ok, warn or block (block: the chart will not work until it is fixed)."""
    message: str
    fix: str = ""

    def render(self) -> str:
        head = f"[{self.severity.upper():5}] {self.check}: {self.message}"
        return head + (f"\n        fix: {self.fix}" if self.fix else "")


# --------------------------------------------------------------------------- values

def chart_dir() -> Path:
    """The chart in this checkout (deploy/helm/trajmesh)."""
    return Path(__file__).resolve().parents[2] / "deploy" / "helm" / "trajmesh"


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_values(files: list[str | Path], sets: dict[str, Any], chart: Path | None = None) -> dict[str, Any]:
    """The chart's values.yaml, then each -f file, then --set key.path=value (Helm's order)."""
    values = yaml.safe_load((chart or chart_dir()).joinpath("values.yaml").read_text()) or {}
    for f in files:
        values = _merge(values, yaml.safe_load(Path(f).read_text()) or {})
    for dotted, value in sets.items():
        node: dict[str, Any] = {}
        cur = node
        *parents, leaf = dotted.split(".")
        for part in parents:
            cur = cur.setdefault(part, {})
        cur[leaf] = value
        values = _merge(values, node)
    return values


def gpu_requests(values: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """{component: (GPUs per pod, pods)} for the components the values give GPUs."""
    out: dict[str, tuple[int, int]] = {}
    ro = values.get("rollout", {})
    engine = ro.get("engine")  # sglang and vllm run a GPU server beside each rollout agent
    if ro.get("enabled", True) and engine in {"sglang", "vllm"} and int(ro.get(engine, {}).get("gpus", 0)) > 0:
        auto = ro.get("autoscaling", {})
        pods = int(auto.get("minReplicas", 1)) if auto.get("enabled") and values.get("keda", {}).get("enabled") \
            else int(ro.get("replicaCount", 1))
        out["rollout"] = (int(ro[engine]["gpus"]), pods)
    ev = values.get("evaluator", {})  # the evaluator pod is a rollout pod: the same engine sidecar and GPUs
    if ev.get("enabled", True) and engine in {"sglang", "vllm"} and int(ro.get(engine, {}).get("gpus", 0)) > 0:
        out["evaluator"] = (int(ro[engine]["gpus"]), int(ev.get("replicaCount", 1)))
    le = values.get("learner", {})
    if le.get("enabled", True) and int(le.get("gpus", 0)) > 0:
        out["learner"] = (int(le["gpus"]), int(le.get("replicaCount", 1)))
    defaults = values.get("teacherDefaults", {})
    for t in values.get("teachers") or []:  # distillation teachers: an SGLang server each
        merged = {**defaults, **t}
        out[f"teacher-{t['name']}"] = (int(merged.get("gpus", 1)), int(merged.get("replicaCount", 1)))
    return out


# --------------------------------------------------------------------------- nodes and GPUs

def _tolerates(tolerations: list[dict[str, Any]], taint: Any) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.effect:
            continue
        if t.get("operator") == "Exists" and (not t.get("key") or t["key"] == taint.key):
            return True
        if t.get("key") == taint.key and str(t.get("value", "")) == str(taint.value or ""):
            return True
    return False


def _node_ready(node: Any) -> bool:
    conds = node.status.conditions or []
    return any(c.type == "Ready" and c.status == "True" for c in conds) and not node.spec.unschedulable


def _gpus(node: Any) -> int:
    raw = (node.status.allocatable or {}).get(GPU, "0")
    return int(raw) if str(raw).isdigit() else 0


def _fits(node: Any, component: dict[str, Any]) -> str:
    """Why a GPU component's pod cannot land on `node` ('' when it can)."""
    labels = node.metadata.labels or {}
    missing = {k: v for k, v in (component.get("nodeSelector") or {}).items() if labels.get(k) != v}
    if missing:
        return f"nodeSelector {missing} does not match"
    hard = [t for t in node.spec.taints or [] if t.effect in ("NoSchedule", "NoExecute")]
    untolerated = [f"{t.key}={t.value or ''}:{t.effect}" for t in hard
                   if not _tolerates(component.get("tolerations") or [], t)]
    return f"taints {untolerated} not tolerated" if untolerated else ""


def check_gpus(core: Any, values: dict[str, Any]) -> list[Finding]:
    wanted = gpu_requests(values)
    if not wanted:
        return [Finding("gpu", OK, "no component asks for GPUs (rollout.engine is not sglang, learner.gpus 0)")]
    nodes = [n for n in core.list_node().items if _node_ready(n)]
    gpu_nodes = [n for n in nodes if _gpus(n) > 0]
    if not gpu_nodes:
        return [Finding("gpu", BLOCK, f"no Ready schedulable node has allocatable {GPU}",
                        "install the NVIDIA GPU Operator or the NVIDIA device plugin on the GPU nodes "
                        f"(kubectl describe node shows {GPU} under Allocatable when it works)")]
    out = []
    for name, (per_pod, pods) in wanted.items():
        # the evaluator pod schedules as a rollout pod unless its own keys say otherwise
        comp = {**values.get("rollout", {}), **values.get("evaluator", {})} if name == "evaluator" else values.get(name, {})
        usable = {n.metadata.name: _gpus(n) for n in gpu_nodes if not _fits(n, comp)}
        reasons = sorted({f"{n.metadata.name}: {_fits(n, comp)}" for n in gpu_nodes if _fits(n, comp)})
        pods_fit = sum(g // per_pod for g in usable.values())
        if pods_fit == 0:
            fix = (f"add {name}.tolerations / {name}.nodeSelector matching the GPU nodes ({'; '.join(reasons)})"
                   if reasons else f"lower {name} GPUs per pod or add nodes with {per_pod} GPUs")
            out.append(Finding("gpu", BLOCK, f"{name} needs {per_pod} {GPU} per pod; no usable node has that "
                                             f"(usable: {usable or 'none'})", fix))
        elif pods_fit < pods:
            out.append(Finding("gpu", WARN, f"{name}: {pods} pods x {per_pod} GPUs, the usable nodes hold "
                                            f"{pods_fit} such pods; the rest stay Pending",
                               f"add GPU nodes or lower {name}.replicaCount"))
        else:
            out.append(Finding("gpu", OK, f"{name}: {pods} pods x {per_pod} GPUs fit on {sorted(usable)}"))
    total = sum(p * n for p, n in wanted.values())
    if total > sum(_gpus(n) for n in gpu_nodes):
        out.append(Finding("gpu", WARN, f"the release asks for {total} GPUs, the cluster has "
                                        f"{sum(_gpus(n) for n in gpu_nodes)} allocatable",
                           "add GPU nodes or lower rollout.replicaCount / sglang.gpus"))
    return out


# --------------------------------------------------------------------------- storage

def rwx_support(provisioner: str) -> bool | None:
    """True / False for a known provisioner, None when the name says nothing."""
    if any(p in provisioner for p in RWX_PROVISIONERS):
        return True
    if any(p == provisioner or provisioner.endswith(p) for p in RWO_ONLY_PROVISIONERS):
        return False
    return None


def _is_default(sc: Any) -> bool:
    ann = sc.metadata.annotations or {}
    return any(ann.get(a) == "true" for a in DEFAULT_CLASS_ANNOTATIONS)


def _rwx_names(classes: list[Any]) -> str:
    names = [sc.metadata.name for sc in classes if rwx_support(sc.provisioner)]
    return ", ".join(names) if names else "none: install one (NFS subdir provisioner, CephFS, EFS, Filestore, Azure Files)"


def _shared_class(values: dict[str, Any], classes: list[Any], core: Any = None) -> Finding:
    """The class the chart's shared ReadWriteMany claim gets, and whether it can serve it. A claim
    without ReadWriteMany (``sharedVolume.accessModes``) blocks unless ``sharedVolume.singleNode``
    says every pod runs on one node (the chart refuses to render it otherwise, too)."""
    shared = values.get("sharedVolume", {})
    modes = list(shared.get("accessModes") or ["ReadWriteMany"])
    if "ReadWriteMany" not in modes and not shared.get("singleNode"):
        return Finding("storage", BLOCK, f"sharedVolume.accessModes {modes} has no ReadWriteMany: learner, rollout "
                                         "and store pods on different nodes cannot share the claim (the chart "
                                         "refuses to render it)",
                       "set sharedVolume.accessModes [ReadWriteMany] with a ReadWriteMany class, or "
                       "sharedVolume.singleNode: true on a one-node cluster")
    wanted = shared.get("storageClass") or ""
    by_name = {sc.metadata.name: sc for sc in classes}
    default = next((sc for sc in classes if _is_default(sc)), None)
    sc = by_name.get(wanted) if wanted else default
    if sc is None:
        what = f"storage class {wanted!r} does not exist" if wanted else "no default storage class"
        return Finding("storage", BLOCK, f"shared volume: {what}; the claim would stay Pending",
                       f"set sharedVolume.storageClass to a ReadWriteMany class (RWX-capable here: {_rwx_names(classes)}) "
                       "or sharedVolume.existingClaim")
    label = f"shared volume: class {sc.metadata.name!r}{'' if wanted else ' (the default)'} ({sc.provisioner})"
    if "ReadWriteMany" not in modes:  # sharedVolume.singleNode: one node mounts it, RWO is enough
        nodes = [n.metadata.name for n in core.list_node().items if _node_ready(n)] if core is not None else []
        if len(nodes) > 1:
            return Finding("storage", WARN, f"{label}, {modes[0]} (sharedVolume.singleNode), but the cluster has "
                                            f"{len(nodes)} Ready nodes: pods scheduled on another node than the "
                                            "claim's cannot mount it",
                           "pin the learner, rollout and store pods to one node (nodeSelector), or use a "
                           "ReadWriteMany class and drop sharedVolume.singleNode")
        return Finding("storage", OK, f"{label}, {modes[0]} on a one-node cluster (sharedVolume.singleNode)")
    rwx = rwx_support(sc.provisioner)
    if rwx is False:
        return Finding("storage", BLOCK, f"{label} serves ReadWriteOnce only; learner and rollout pods on "
                                         "different nodes cannot share it",
                       f"set sharedVolume.storageClass to a ReadWriteMany class (RWX-capable here: {_rwx_names(classes)})")
    if rwx is None:
        return Finding("storage", WARN, f"{label}: cannot tell from the API whether it serves ReadWriteMany",
                       "check the provisioner's documentation; if the claim stays Pending, set "
                       "sharedVolume.storageClass to an RWX class")
    return Finding("storage", OK, f"{label} serves ReadWriteMany")


def _existing_claim(core: Any, namespace: str, name: str) -> Finding:
    from kubernetes.client.exceptions import ApiException

    try:
        pvc = core.read_namespaced_persistent_volume_claim(name, namespace)
    except ApiException as exc:
        if exc.status != 404:
            raise
        return Finding("storage", BLOCK, f"sharedVolume.existingClaim {name!r} does not exist in {namespace!r}",
                       "create the ReadWriteMany claim first or clear sharedVolume.existingClaim")
    modes = set(pvc.spec.access_modes or [])
    if "ReadWriteMany" not in modes:
        return Finding("storage", BLOCK, f"claim {name!r} has access modes {sorted(modes)}, not ReadWriteMany",
                       "use a ReadWriteMany claim (learner and rollout pods mount it on different nodes)")
    if (pvc.status.phase if pvc.status else None) != "Bound":
        return Finding("storage", WARN, f"claim {name!r} is {pvc.status.phase if pvc.status else 'unknown'}, not Bound",
                       f"kubectl describe pvc -n {namespace} {name}")
    return Finding("storage", OK, f"shared volume: claim {name!r} is ReadWriteMany and Bound")


def _rwo_claims_need_default(values: dict[str, Any]) -> list[str]:
    """The chart's ReadWriteOnce claims that name no class (they get the default)."""
    out = []
    for key, sub in (("store", ("persistence",)), ("redis", ("persistence",)), ("nats", ("jetstream", "storage"))):
        comp = values.get(key, {})
        node = comp
        for part in sub:
            node = node.get(part, {})
        if comp.get("enabled", True) and node.get("enabled", True) and not node.get("storageClass"):
            out.append(f"{key}.{'.'.join(sub)}")
    return out


def check_storage(core: Any, storage: Any, values: dict[str, Any], namespace: str) -> list[Finding]:
    classes = storage.list_storage_class().items
    existing = values.get("sharedVolume", {}).get("existingClaim") or ""
    out = [_existing_claim(core, namespace, existing) if existing else _shared_class(values, classes, core)]
    rwo = _rwo_claims_need_default(values)
    if rwo and not any(_is_default(sc) for sc in classes):
        out.append(Finding("storage", BLOCK, f"{', '.join(rwo)} name no storage class and the cluster has no default",
                           "mark a class default (kubectl annotate storageclass NAME "
                           "storageclass.kubernetes.io/is-default-class=true) or set their storageClass"))
    return out


# --------------------------------------------------------------------------- CRDs and runtime classes

def required_crds(values: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """{feature: (CRD name, fix)} for the chart features the values turn on."""
    out = {}
    if values.get("keda", {}).get("enabled") and any(
            values.get(c, {}).get("enabled", True) and values.get(c, {}).get("autoscaling", {}).get("enabled")
            for c in ("rollout", "environment", "grader")):
        out["keda"] = CRDS["keda"]
    for feature in ("serviceMonitor", "podMonitor", "prometheusRule"):
        if values.get("monitoring", {}).get(feature, {}).get("enabled"):
            out[feature] = CRDS[feature]
    return out


def check_crds(ext: Any, values: dict[str, Any]) -> list[Finding]:
    wanted = required_crds(values)
    if not wanted:
        return [Finding("crd", OK, "no chart feature on that needs a CRD (KEDA scaling, ServiceMonitor, "
                                   "PodMonitor, PrometheusRule all off)")]
    have = {c.metadata.name for c in ext.list_custom_resource_definition().items}
    return [Finding("crd", OK, f"{feature}: {crd} installed") if crd in have
            else Finding("crd", BLOCK, f"{feature} is on but the CRD {crd} is not installed", fix)
            for feature, (crd, fix) in wanted.items()]


def check_runtime_classes(node_api: Any, values: dict[str, Any]) -> list[Finding]:
    wanted = {c: values[c]["runtimeClassName"] for c in ("rollout", "learner")
              if values.get(c, {}).get("enabled", True) and values.get(c, {}).get("runtimeClassName")}
    if not wanted:
        return [Finding("runtimeclass", OK, "no runtimeClassName set")]
    have = {rc.metadata.name: rc.handler for rc in node_api.list_runtime_class().items}
    return [Finding("runtimeclass", OK, f"{comp}: RuntimeClass {name!r} exists (handler {have[name]!r})")
            if name in have else
            Finding("runtimeclass", BLOCK, f"{comp}.runtimeClassName {name!r} does not exist "
                                           f"(cluster has {sorted(have) or 'none'})",
                    "install the NVIDIA container toolkit's RuntimeClass (the GPU Operator creates 'nvidia') "
                    f"or clear {comp}.runtimeClassName")
            for comp, name in wanted.items()]


# --------------------------------------------------------------------------- a release's pods and claims

def _container_findings(pod: Any, cs: Any, namespace: str) -> list[Finding]:
    """A container's waiting reason (blocks) and its last restart's termination reason."""
    name, fmt = pod.metadata.name, {"ns": namespace, "pod": pod.metadata.name, "container": cs.name}
    out = []
    waiting = cs.state.waiting if cs.state else None
    if waiting is not None and waiting.reason in WAITING_FIXES:
        out.append(Finding(f"pod/{name}", BLOCK, f"container {cs.name}: {waiting.reason}"
                           + (f" ({waiting.message})" if waiting.message else ""),
                           WAITING_FIXES[waiting.reason].format(**fmt)))
    last = cs.last_state.terminated if cs.last_state else None
    if cs.restart_count and last is not None:
        fix = TERMINATED_FIXES.get(last.reason or "", TERMINATED_FIXES["Error"]).format(**fmt)
        out.append(Finding(f"pod/{name}", WARN, f"container {cs.name}: {cs.restart_count} restarts, last ended "
                                                f"{last.reason or 'unknown'} (exit code {last.exit_code})", fix))
    return out


def _pod_findings(pod: Any, namespace: str) -> list[Finding]:
    name, status = pod.metadata.name, pod.status
    conds = {c.type: c for c in status.conditions or []}
    sched = conds.get("PodScheduled")
    if status.phase == "Pending" and sched is not None and sched.status == "False":
        return [Finding(f"pod/{name}", BLOCK, f"not scheduled: {sched.reason}: {sched.message}",
                        "the message names the missing resource (GPUs, a claim, a taint to tolerate); "
                        "see the gpu and storage findings")]
    out: list[Finding] = []
    for cs in [*(status.init_container_statuses or []), *(status.container_statuses or [])]:
        out += _container_findings(pod, cs, namespace)
    ready = conds.get("Ready")
    if status.phase == "Succeeded":
        out.append(Finding(f"pod/{name}", OK, "completed"))
    elif ready is not None and ready.status == "True":
        out.append(Finding(f"pod/{name}", OK, "ready"))
    elif not any(f.severity == BLOCK for f in out):
        out.append(Finding(f"pod/{name}", WARN, f"{status.phase}, not ready"
                           + (f" ({ready.reason})" if ready is not None and ready.reason else ""),
                           f"kubectl describe pod -n {namespace} {name} (probe failures are listed under Events)"))
    return out


def check_release(core: Any, namespace: str, release: str) -> list[Finding]:
    selector = f"app.kubernetes.io/instance={release}"
    pods = core.list_namespaced_pod(namespace, label_selector=selector).items
    out: list[Finding] = []
    if not pods:
        out.append(Finding("release", WARN, f"no pods with {selector} in namespace {namespace!r}",
                           f"helm status -n {namespace} {release}"))
    for pod in sorted(pods, key=lambda p: p.metadata.name):
        out += _pod_findings(pod, namespace)
    for pvc in core.list_namespaced_persistent_volume_claim(namespace, label_selector=selector).items:
        if pvc.status is not None and pvc.status.phase == "Pending":
            out.append(Finding(f"claim/{pvc.metadata.name}", BLOCK,
                               f"Pending (class {pvc.spec.storage_class_name or 'default'}, "
                               f"modes {pvc.spec.access_modes})",
                               f"kubectl describe pvc -n {namespace} {pvc.metadata.name}; see the storage findings"))
    return out


# --------------------------------------------------------------------------- entry point

def run_checks(api_client: Any, values: dict[str, Any], namespace: str, release: str | None) -> list[Finding]:
    """Every check, through the `kubernetes` client's typed APIs on `api_client`."""
    from kubernetes import client

    core = client.CoreV1Api(api_client)
    findings = check_gpus(core, values)
    findings += check_storage(core, client.StorageV1Api(api_client), values, namespace)
    findings += check_crds(client.ApiextensionsV1Api(api_client), values)
    findings += check_runtime_classes(client.NodeV1Api(api_client), values)
    if release:
        findings += check_release(core, namespace, release)
    return findings


def api_client_from(kubeconfig: str | None, context: str | None) -> Any:
    """The kubeconfig's client (or the in-cluster service account's when there is none)."""
    from kubernetes import client, config

    try:
        config.load_kube_config(config_file=kubeconfig, context=context)
    except config.ConfigException:
        if kubeconfig or context:
            raise
        config.load_incluster_config()
    return client.ApiClient()


def report(findings: list[Finding]) -> tuple[str, int]:
    """(the printed report, the exit code: 1 when a finding blocks)."""
    blocking = sum(f.severity == BLOCK for f in findings)
    warns = sum(f.severity == WARN for f in findings)
    lines = [f.render() for f in findings]
    lines.append(f"{len(findings)} checks: {blocking} blocking, {warns} warnings")
    return "\n".join(lines), 1 if blocking else 0
