"""The sandboxed interpreter's first code, as a program: passed on its command line (``-c``) before
the model-written program runs; it reports attempted violations through an audit hook (the
kernel blocks them regardless; this only names them), sets what `site` would, and runs
/tmp/work/main.py as __main__.

Only the text below the mark runs (trajmesh/sandbox/__init__.py `_program`): the text is on the
sandboxed process's command line, so it stays exactly what it was. It is never imported.
"""
# ruff: noqa: E401, E702, I001, UP031

if __name__ == "trajmesh.sandbox.boot_program":  # imported: a program must not run in the importer
    raise ImportError("trajmesh.sandbox.boot_program is a program the sandbox runs, not a module to import")

# ---- the program: what runs is every line below this one ----

import builtins, os, sys
_fd = int(sys.argv[1]); _seen = set()
_PY = tuple(p + "/" for p in sys.argv[5:])
# Started with -S (the site module costs ~50 ms per call): what site would set (venv prefix,
# site-packages, exit() and quit()).
sys.path.extend(p for p in sys.argv[2].split(os.pathsep) if p)
sys.prefix, sys.exec_prefix = sys.argv[3], sys.argv[4]
builtins.exit = builtins.quit = sys.exit
def _flag(kind):
    if kind not in _seen:
        _seen.add(kind)
        try:
            os.write(_fd, (kind + "\n").encode())
        except OSError:
            pass
_W = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_SECRET_DIRS = ("/root", "/home", "/run/secrets", "/var/run/secrets", "/etc/trajmesh")
def _secret(p):  # no `re`: every import costs each call
    parts = p.split("/")
    return ((len(parts) == 4 and parts[1] == "proc" and parts[3] in ("environ", "mem"))
            or any(p == d or p.startswith(d + "/") for d in _SECRET_DIRS)
            or p.startswith(("/etc/shadow", "/etc/gshadow", "/etc/sudoers")))
_OKW = ("/tmp/", "/dev/shm/", "/dev/null", "/dev/stdout", "/dev/stderr", "/proc/self/fd/")
def _path(p):
    if isinstance(p, int):
        return None
    p = os.fsdecode(p)
    return p if p.startswith("/") else os.path.join("/tmp/work", p)
def _hook(event, args):
    if event in ("socket.connect", "socket.sendto", "socket.sendmsg", "socket.bind"):
        _flag("network")
    elif event == "open":
        p = _path(args[0])
        if p is None:
            return
        mode, flags = args[1], args[2] or 0
        write = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(flags & _W)
        p = os.path.normpath(p)
        if _secret(p) and not p.startswith(_PY):
            _flag("secret_access")
        elif write and not (p + "/").startswith(_OKW) and not p.startswith(_OKW):
            _flag("fs_write")
    elif event in ("os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.chmod", "os.chown", "os.symlink",
                   "os.link", "os.truncate", "os.utime"):
        p = _path(args[0])
        if p is not None and not os.path.normpath(p).startswith("/tmp"):
            _flag("fs_write")
    elif event in ("os.kill", "os.killpg"):
        pid = args[0]
        if pid <= 1 or not os.path.exists("/proc/%d" % pid):
            _flag("signal")
    elif event == "os.getenv" or event == "os.environ":
        pass
sys.addaudithook(_hook)
del _hook
sys.argv = ["main.py"]
_main = type(sys)("__main__")
_main.__file__, _main.__builtins__ = "/tmp/work/main.py", builtins
sys.modules["__main__"] = _main
with open("/tmp/work/main.py", "rb") as _fh:
    _code = compile(_fh.read(), "/tmp/work/main.py", "exec")
del _fh
exec(_code, _main.__dict__)
