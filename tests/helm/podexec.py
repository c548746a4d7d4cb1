"""Starts one container's process as its pod's user, the way a container runtime would: run as root
by ``local_kubelet.py`` (``python podexec.py SPEC_JSON -- ARGV...``), it

1. gives the process a private mount namespace in which every path it must reach is reachable by
   an unprivileged uid: a directory on the way that only root may traverse (``/root`` holding this
   machine's interpreter, pytest's ``/tmp/pytest-of-root``) is covered by a tmpfs (0755) into which
   just the needed paths are bind-mounted back (a container has its own root filesystem instead);
2. moves itself into the pod's cgroup (``cgroup_dirs``: the kubelet delegated them to the pod's
   user), as a container runtime starts a container in its pod's cgroup;
3. drops privileges the way the pod's securityContext asks: supplementary groups (fsGroup and
   supplementalGroups), runAsGroup, the whole capability bounding set and ambient set
   (``capabilities.drop: [ALL]``), ``PR_SET_NO_NEW_PRIVS`` when ``allowPrivilegeEscalation: false``,
   then runAsUser (which clears the permitted and effective sets);
4. execs the container's command (same pid, so ``/proc/PID/status`` shows the result).

Not a test module. Linux only; needs root (the caller checks).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

CLONE_NEWNS = 0x00020000
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 38, 47, 4

libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(libc.mount(src.encode() if src else None, dst.encode(), fstype.encode() if fstype else None,
                      ctypes.c_ulong(flags), data.encode() if data else None), f"mount {src} -> {dst}")


def _blocked(path: str) -> str | None:
    """The outermost directory on the way to `path` that others may not traverse (None: none)."""
    parts = os.path.realpath(path).split("/")[1:]
    for i in range(1, len(parts) + 1):
        d = "/" + "/".join(parts[:i])
        if os.path.isdir(d) and not os.stat(d).st_mode & 0o001:
            return d
    return None


def make_reachable(paths: list[str]) -> None:
    """Private mount namespace; each blocked directory covered by a tmpfs holding only `paths`."""
    _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    by_cover: dict[str, list[str]] = {}
    for p in sorted({os.path.realpath(p) for p in paths}):
        cover = _blocked(p)
        if cover is not None:
            by_cover.setdefault(cover, []).append(p)
    for cover, targets in sorted(by_cover.items()):
        # keep what must stay reachable open, cover the directory, put those paths back
        fds = {t: os.open(t, os.O_PATH | os.O_DIRECTORY if os.path.isdir(t) else os.O_PATH) for t in targets}
        _mount("tmpfs", cover, "tmpfs", 0, "mode=0755")
        for target, fd in fds.items():
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.makedirs(target, mode=0o755, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
                open(target, "a").close()
            _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
            os.close(fd)


def drop_privileges(uid: int, gid: int, groups: list[int], no_new_privs: bool) -> None:
    os.setgroups(groups)
    os.setresgid(gid, gid, gid)
    last_cap = int(open("/proc/sys/kernel/cap_last_cap").read())
    for cap in range(last_cap + 1):
        _check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"PR_CAPBSET_DROP {cap}")
    _check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "PR_CAP_AMBIENT_CLEAR_ALL")
    if no_new_privs:
        _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
    os.setresuid(uid, uid, uid)  # from root to another uid: permitted and effective sets cleared


def main() -> None:
    sep = sys.argv.index("--")
    spec, argv = json.loads(sys.argv[1]), sys.argv[sep + 1:]
    cwd = os.getcwd()
    make_reachable(spec["reach"] + [cwd])
    for d in spec.get("cgroup_dirs", []):
        with open(f"{d}/cgroup.procs", "w") as f:
            f.write("0")
    drop_privileges(spec["uid"], spec["gid"], spec["groups"], spec["no_new_privs"])
    os.chdir(cwd)  # through the bind mounts, as the pod's user
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
