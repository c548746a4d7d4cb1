"""The sandbox's init, as a program: started by the service through `_BOOTSTRAP` (a few lines on
its command line that read the payload from a memfd and exec this text with the payload as `P`),
it builds the call's root, namespaces and limits, runs the program, reports and reaps.

Only the text below the mark runs (trajmesh/sandbox/__init__.py `_program`); what is above it
is for the linters and readers. It is never imported.
"""
# ruff: noqa: E401, E402, E702, I001, UP031

P: dict = {}  # the payload ({"init", "code", "cfg"}): at run time a global of the bootstrap that execs the text below

if __name__ == "trajmesh.sandbox.init_program":  # imported: a program must not run in the importer
    raise ImportError("trajmesh.sandbox.init_program is a program the sandbox runs, not a module to import")

# ---- the program: what runs is every line below this one ----

import ctypes, json, os, signal, struct
signal.signal(signal.SIGINT, signal.SIG_DFL)  # pid 1 ignores default-action signals from inside
cfg = P["cfg"]
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(1, 9)  # PR_SET_PDEATHSIG SIGKILL: a service killed mid-call takes its call with it
if os.getppid() != cfg["service_pid"]:
    os._exit(114)
libc.prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: a killed call's zombies come back here, reaped at once
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
NS = cfg["ns"]
U, G = cfg["inner_id"], cfg["inner_id"]

def check(ret, what):
    if ret != 0:
        raise OSError(ctypes.get_errno(), what)

def mount(src, dst, fstype, flags, data=None):
    check(libc.mount(src and src.encode(), dst.encode(), fstype and fstype.encode(), flags,
                     data and data.encode()), "mount " + dst)

def bind_ro(fd, dst):
    mount("/proc/self/fd/%d" % fd, dst, None, MS_BIND)
    st = os.fstatvfs(fd)  # flags locked on the source mount must be kept (user namespace rule)
    keep = sum(ms for st_flag, ms in ((8, MS_NOEXEC), (1024, 1024), (2048, 2048), (4096, 1 << 21)) if st.f_flag & st_flag)
    mount(None, dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | keep)

def place(src, kind, target, root):
    dst = root + src
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    if kind == "link":
        os.symlink(target, dst)
    elif kind == "dir":
        os.makedirs(dst, exist_ok=True)
        bind_ro(FDS[src], dst)
    elif kind == "file":
        open(dst, "w").close()
        bind_ro(FDS[src], dst)
    else:  # a device: a plain bind (its mount's nodev, if any, is the host's)
        open(dst, "w").close()
        mount("/proc/self/fd/%d" % FDS[src], dst, None, MS_BIND)

def build_root():
    # Only the interpreter prefixes, system libraries and a few devices, read-only; /tmp writable.
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    r = cfg["root"]
    mount("tmpfs", r, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=1024,mode=755")
    for d in ("tmp", "dev", "proc", "etc"):
        os.mkdir(r + "/" + d, 0o755)
    mount("tmpfs", r + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
          "size=%d,nr_inodes=%d,mode=1777" % (cfg["tmpfs_bytes"], cfg["tmpfs_inodes"]))
    for src, kind, target in cfg["binds"]:
        place(src, kind, target, r)
    os.mkdir(r + "/dev/shm")
    mount(r + "/tmp", r + "/dev/shm", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, r + "/dev/" + name)
    try:  # before pivot_root: the kernel allows a new proc only beside a fully visible one
        mount("proc", r + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        have_proc = True
        for name in cfg["hidden_proc"]:
            if os.path.exists(r + "/proc/" + name):
                mount(r + "/dev/null", r + "/proc/" + name, None, MS_BIND)
    except OSError:  # masked host /proc (a pod without procMount: Unmasked): run without /proc
        have_proc = False
    os.makedirs(r + "/tmp/work", 0o755)
    with open(r + "/tmp/work/main.py", "wb") as fh:
        fh.write(P["code"].encode("utf-8", "surrogatepass"))
    os.chown(r + "/tmp/work", U, G)
    os.chown(r + "/tmp/work/main.py", U, G)
    os.chdir(r)
    check(libc.syscall(cfg["nr"]["pivot_root"], b".", b"."), "pivot_root")
    check(libc.umount2(b".", 2), "umount old root")  # MNT_DETACH
    os.chdir("/")
    mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    check(libc.sethostname(b"sandbox", 7), "sethostname")
    return have_proc

def seccomp_filter():
    nr, deny = cfg["nr"], cfg["deny"]
    ins = [(0x20, 0, 0, 4), (0x15, 1, 0, cfg["arch"]), (0x06, 0, 0, 0x80000000), (0x20, 0, 0, 0)]
    if cfg["arch"] == 0xC000003E:
        ins += [(0x35, 0, 1, 0x40000000), (0x06, 0, 0, 0x80000000)]  # x32 ABI: kill
    for name in deny:
        ins += [(0x15, 0, 1, nr[name]), (0x06, 0, 0, 0x50000 | 1)]  # EPERM
    ins += [(0x15, 0, 1, nr["clone3"]), (0x06, 0, 0, 0x50000 | 38)]  # ENOSYS: libc falls back to clone
    ins += [(0x15, 0, 3, nr["clone"]), (0x20, 0, 0, 16), (0x45, 0, 1, NS), (0x06, 0, 0, 0x50000 | 1)]
    ins += [(0x06, 0, 0, 0x7FFF0000)]
    return b"".join(struct.pack("=HBBI", *i) for i in ins), len(ins)

def drop_privileges():
    os.setresgid(G, G, G)
    os.setresuid(U, U, U)
    libc.syscall(cfg["nr"]["keyctl"], 1, None)  # KEYCTL_JOIN_SESSION_KEYRING: a new anonymous one
    for cap in range(64):
        libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP (EINVAL past the last cap)
    libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL
    check(libc.capset(struct.pack("=Ii", 0x20080522, 0), bytes(24)), "capset")
    check(libc.prctl(38, 1, 0, 0, 0), "no_new_privs")
    libc.prctl(1, 9)  # PR_SET_PDEATHSIG SIGKILL (after the uid change, which clears it)

def run_program():
    # The program's process: any failure before exec is the sandbox's (a setup error), not the program's.
    try:
        prepare_program()
    except BaseException as exc:
        os.write(cfg["report_fd"], (json.dumps({"setup_error": "%s: %s" % (type(exc).__name__, exc)}) + "\n").encode())
        os._exit(111)

def prepare_program():
    import resource
    L = cfg["limits"]
    for what, val in ((resource.RLIMIT_CPU, (L["cpu_s"], L["cpu_s"] + 1)),
                      (resource.RLIMIT_AS, (L["memory_bytes"],) * 2),
                      (resource.RLIMIT_NPROC, (L["nproc"],) * 2),
                      (resource.RLIMIT_FSIZE, (L["file_size_bytes"],) * 2),
                      (resource.RLIMIT_NOFILE, (L["open_files"],) * 2),
                      (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(what, val)
    audit_fd, report_fd = cfg["audit_fd"], cfg["report_fd"]
    keep = sorted((audit_fd, report_fd))
    os.closerange(3, keep[0])
    os.closerange(keep[0] + 1, keep[1])
    os.closerange(keep[1] + 1, 1 << 16)
    os.set_inheritable(report_fd, False)  # open until exec, for a setup error
    drop_privileges()
    os.chdir("/tmp/work")
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp/work", "LANG": "C.UTF-8",
           "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MPLCONFIGDIR": "/tmp"}
    prog, n = seccomp_filter()
    buf = ctypes.create_string_buffer(prog)
    fprog = struct.pack("=HxxxxxxQ", n, ctypes.addressof(buf))
    check(libc.prctl(22, 2, fprog, 0, 0), "seccomp")  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
    os.execve(cfg["python"], [cfg["python"], "-I", "-S", "-c", cfg["boot"], str(audit_fd), cfg["site"],
                              cfg["prefix"], cfg["exec_prefix"]] + cfg["prefixes"], env)

def count_orphans():
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit() and name != "1":
            try:
                n += open("/proc/%s/stat" % name).read().rsplit(")", 1)[1].split()[0] != "Z"
            except OSError:
                continue
    return n

def pid1():
    libc.prctl(1, 9)  # PR_SET_PDEATHSIG: the service's kill of the init reaches the namespace
    have_proc = build_root()
    pid = os.fork()
    if pid == 0:
        run_program()
    os.close(cfg["audit_fd"])
    _, status, usage = os.wait4(pid, 0)
    rep = {"exited": os.WIFEXITED(status), "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
           "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
           "cpu_s": usage.ru_utime + usage.ru_stime, "orphans": count_orphans() if have_proc else 0}
    os.write(cfg["report_fd"], (json.dumps(rep) + "\n").encode())

def namespaced():
    # Runs in the new namespaces once the parent has written the id maps.
    global FDS  # bind sources, opened with the caller's access (the program's uid may not reach /root/...)
    libc.prctl(1, 9)  # PR_SET_PDEATHSIG: the service's kill of the init reaches the namespace
    libc.prctl(4, 0)  # PR_SET_DUMPABLE 0: the program (same uid) cannot write its inits' /proc files
    for name, value in cfg["user_max"].items():  # this namespace's quotas (charged to the caller's uid)
        try:
            with open("/proc/sys/user/" + name, "w") as fh:
                fh.write(str(value))
        except FileNotFoundError:  # a kernel without this quota
            pass
    FDS = {src: os.open(src, os.O_PATH) for src, kind, _ in cfg["binds"] if kind != "link"}
    if cfg["root_mode"]:  # host uid 0 is unmapped here: take the mapped id (capabilities in the namespace stay)
        os.setgroups([])
        os.setresgid(G, G, G)
        os.setresuid(U, U, U)
    child = os.fork()
    if child == 0:
        try:
            pid1()
        except BaseException as exc:
            os.write(2, ("sandbox init: %s: %s\n" % (type(exc).__name__, exc)).encode())
            os._exit(111)
        os._exit(0)
    os.write(cfg["report_fd"], b"pid %d\n" % child)
    os.close(cfg["audit_fd"])
    _, status = os.waitpid(child, 0)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 112)

def write_id_maps(pid):
    # From the parent namespace: root may map the leased uid; rootless maps only its own uid.
    if not cfg["root_mode"]:
        with open("/proc/%d/setgroups" % pid, "w") as fh:
            fh.write("deny")
    for name, outer in (("uid_map", cfg["outer_uid"]), ("gid_map", cfg["outer_gid"])):
        with open("/proc/%d/%s" % (pid, name), "w") as fh:
            fh.write("%d %d 1" % (U, outer))

ready_r, ready_w = os.pipe()
go_r, go_w = os.pipe()
inner = os.fork()
if inner == 0:
    try:
        for procs in cfg["cgroup_procs"]:  # first: every later process of the call is born in its cgroup
            with open(procs, "w") as fh:  # (this init stays outside, out of reach of its OOM kills)
                fh.write("0")
        check(libc.unshare(NS), "unshare")
        os.write(ready_w, b"u")
        if os.read(go_r, 1) != b"m":
            os._exit(113)
        namespaced()
    except BaseException as exc:
        os.write(2, ("sandbox init: %s: %s\n" % (type(exc).__name__, exc)).encode())
        os._exit(111)
os.close(cfg["audit_fd"])
os.close(ready_w)
if os.read(ready_r, 1) == b"u":
    write_id_maps(inner)
    os.write(go_w, b"m")
_, status = os.waitpid(inner, 0)
while True:  # pid 1, when its parent was killed first
    try:
        os.wait()
    except ChildProcessError:
        break
os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 112)
