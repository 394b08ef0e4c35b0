"""Standalone sandbox worker: one per executor slot, forks a fresh child per program.

This file must stay importable and runnable with the standard library only: it is started as
``python -s -S -P -B _runner.py`` (no site, no torch, no populora_verl) so that a forked child costs a
few MB and a fork takes about a millisecond. The host side (``local.py``) imports the pure policy
functions below (``find_banned``) so the static check is the same code on both sides.

Protocol (both directions): 4-byte big-endian length + UTF-8 JSON.
  host -> worker, once:  {"uid", "gid", "setup_mounts", "expose", "banned", "nproc", "fsize_mb", "tmp_mb"}
  worker -> host, once:  {"ready": true, "protections": {...}, "notes": [...]}
  host -> worker:        {"program", "inputs", "timeout_s", "memory_mb", "check_determinism", "max_output_chars"}
  worker -> host:        {"ok", "output", "error", "duration_s"}
"""

from __future__ import annotations

import ast
import json
import os
import resource
import select
import signal
import struct
import sys

_HDR = struct.Struct(">I")
PROGRAM_FILE = "<program>"
INPUT_FILE = "<input>"

# Names through which a program can reach the import machinery or builtins without an import
# statement. Rejected statically in addition to the configured banned modules.
TRICK_NAMES = frozenset({"__import__", "__builtins__", "__loader__", "__spec__", "importlib", "builtins",
                         "__subclasses__", "__globals__"})
DYNAMIC_CODE = frozenset({"exec", "eval", "compile"})


# ----------------------------------------------------------------------------- static policy
def _banned_match(module: str, banned: list[str]) -> str | None:
    """The banned entry that ``module`` (a dotted import name) falls under, if any."""
    for entry in banned:
        if module == entry or module.startswith(entry + "."):
            return entry
    return None


def _attr_chain(node: ast.AST) -> str | None:
    """'a.b.c' for an Attribute chain rooted at a Name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def find_banned(program: str, banned: list[str], _depth: int = 0) -> str | None:
    """A short reason if ``program`` uses a banned module or an import trick, else None.

    Walks Import/ImportFrom (banned entry ``a`` covers ``a`` and ``a.*``; dotted entry ``a.b`` also covers
    ``from a import b`` and the attribute chain ``a.b``), and rejects routes around import statements:
    ``__import__``, ``importlib``, ``builtins``/``__builtins__``, ``sys.modules`` and exec/eval/compile of
    anything but a string literal (a literal is checked recursively).
    """
    try:
        tree = ast.parse(program, PROGRAM_FILE)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None  # not our job: running it reports the syntax error
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                hit = _banned_match(alias.name, banned)
                if hit:
                    return f"banned import: {alias.name}"
                if alias.name.split(".")[0] in ("importlib", "builtins"):
                    return f"banned import: {alias.name} (import machinery)"
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if _banned_match(mod, banned):
                return f"banned import: {mod}"
            if mod.split(".")[0] in ("importlib", "builtins"):
                return f"banned import: {mod} (import machinery)"
            for alias in node.names:
                full = f"{mod}.{alias.name}" if mod else alias.name
                if _banned_match(full, banned):
                    return f"banned import: {full}"
        elif isinstance(node, ast.Name) and node.id in TRICK_NAMES:
            return f"banned import: use of {node.id}"
        elif isinstance(node, ast.Attribute):
            if node.attr in TRICK_NAMES:
                return f"banned import: use of .{node.attr}"
            chain = _attr_chain(node)
            if chain:
                if chain == "sys.modules" or chain.startswith("sys.modules."):
                    return "banned import: use of sys.modules"
                for entry in banned:
                    if "." in entry and (chain == entry or chain.startswith(entry + ".")):
                        return f"banned import: use of {entry}"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in DYNAMIC_CODE:
            arg = node.args[0] if node.args else None
            if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                return f"banned import: {node.func.id}() of non-literal code"
            if _depth < 3:
                inner = find_banned(arg.value, banned, _depth + 1)
                if inner:
                    return inner
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in TRICK_NAMES:
            return f"banned import: string {node.value!r}"  # getattr(x, "__import__") and friends
    return None


# ----------------------------------------------------------------------------- framing
def _read_exact(fd: int, n: int, deadline: float | None = None) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - _now()
            if left <= 0:
                return None
            r, _, _ = select.select([fd], [], [], left)
            if not r:
                return None
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _write_msg(fd: int, obj: dict) -> None:
    data = json.dumps(obj).encode()
    data = _HDR.pack(len(data)) + data
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _read_msg(fd: int) -> dict | None:
    hdr = _read_exact(fd, _HDR.size)
    if hdr is None:
        return None
    body = _read_exact(fd, _HDR.unpack(hdr)[0])
    return None if body is None else json.loads(body)


from time import monotonic as _now  # noqa: E402  (children purge "time" from sys.modules)


# ----------------------------------------------------------------------------- sandbox setup (once)
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME = 1024, 2048, 1 << 21
_MNT_DETACH = 2
_TMP_INODES = 32768  # files + dirs a program may leave behind: bounds the wipe after each call
_OPT_FLAGS = {"nosuid": _MS_NOSUID, "nodev": _MS_NODEV, "noexec": _MS_NOEXEC, "noatime": _MS_NOATIME,
              "nodiratime": _MS_NODIRATIME, "relatime": _MS_RELATIME}
_libc = None


def _libc_call(name: str, *args) -> None:
    global _libc
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(_libc, name)
    if fn(*args) == -1:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"{name}{args!r}: {os.strerror(err)}")


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _libc_call("mount", enc(src), enc(target), enc(fstype), flags, enc(data))


def _umount(target: str) -> None:
    _libc_call("umount2", target.encode(), _MNT_DETACH)


def _mountinfo() -> list[tuple[str, int]]:
    """(mount point, per-mount flags) for every mount, in mount order."""
    out = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            f = line.split()
            point = f[4].encode().decode("unicode_escape")  # \040 etc.
            flags = 0
            for opt in f[5].split(","):
                flags |= _OPT_FLAGS.get(opt, 0)
            out.append((point, flags))
    return out


def _expose(paths: list[str], notes: list[str]) -> None:
    """Make ``paths`` readable to an unprivileged uid although an ancestor is mode 700 (e.g. /root).

    Bind each path aside, cover the closed ancestor with a small tmpfs (which also hides everything
    else in it), recreate the path inside and bind it back.
    """
    for i, path in enumerate(paths):
        path = os.path.realpath(path)
        closed = None
        anc = "/"
        for part in path.strip("/").split("/"):
            anc = os.path.join(anc, part)
            if os.stat(anc).st_mode & 0o005 != 0o005:
                closed = anc
                break
        if closed is None or closed == path:
            continue
        stage = f"/tmp/.populora_stage{i}"
        os.makedirs(stage, exist_ok=True)
        _mount(path, stage, None, _MS_BIND | _MS_REC)
        _mount("tmpfs", closed, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=755")
        os.makedirs(path, mode=0o755, exist_ok=True)
        _mount(stage, path, None, _MS_BIND | _MS_REC)
        _umount(stage)
        os.rmdir(stage)
        notes.append(f"exposed {path} over a tmpfs on {closed}")


def _setup_mounts(cfg: dict, notes: list[str]) -> dict[str, bool]:
    """Private /proc and /tmp, interpreter readable, every other mount read-only.

    /tmp is a root-owned (0755) tmpfs: the only place a program can write is the per-slot work directory
    inside it (its cwd, $TMPDIR, $HOME), which is emptied after every call.
    """
    prot = {"private_proc": False, "private_tmp": False, "readonly_fs": False}
    try:
        _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
        _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
        prot["private_proc"] = True
    except OSError as e:
        notes.append(f"proc: {e}")
    try:
        _mount("tmpfs", "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={int(cfg['tmp_mb'])}m,nr_inodes={_TMP_INODES},mode=755")
        prot["private_tmp"] = True
    except OSError as e:
        notes.append(f"tmp: {e}")
    try:
        _expose(cfg.get("expose", []), notes)
    except OSError as e:
        notes.append(f"expose: {e}")
    root_ok, failed = False, 0
    for point, flags in _mountinfo():
        if point == "/proc" or point.startswith("/proc/") or point == "/tmp":
            continue
        try:
            _mount(None, point, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | flags)
            root_ok = root_ok or point == "/"
        except OSError:
            failed += 1  # hidden or unusual mounts; "/" is the one that matters
    prot["readonly_fs"] = root_ok
    if failed:
        notes.append(f"{failed} mounts could not be made read-only")
    # Fresh tmpfs on /tmp again: the read-only pass must not have touched it, and stage dirs are gone.
    return prot


# ----------------------------------------------------------------------------- kernel helpers
_CLONE_NEWIPC, _CLONE_NEWTIME = 0x08000000, 0x00000080
_SYS_KEYCTL = {"x86_64": 250, "aarch64": 219}.get(os.uname().machine)
_KEYCTL_JOIN_SESSION, _KEYCTL_CLEAR = 1, 7
_KEY_SPEC_USER, _KEY_SPEC_USER_SESSION = -4, -5


def _keyctl(op: int, *args: int) -> None:
    if _SYS_KEYCTL is None:
        raise OSError(38, "keyctl: unknown syscall number on this architecture")
    _libc_call("syscall", _SYS_KEYCTL, op, *args)


def _load_libc() -> None:
    global _libc
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)


# ----------------------------------------------------------------------------- the child
_BANNED: list[str] = []
_ORIG_IMPORT = None


def _from_program() -> bool:
    """True if the code asking for an import is the program (or code it exec'd), not the stdlib."""
    frame = sys._getframe(2)
    while frame is not None:
        fn = frame.f_code.co_filename
        if fn.startswith("<frozen importlib") or fn.endswith(os.sep + "importlib" + os.sep + "__init__.py"):
            frame = frame.f_back
            continue
        return not os.path.isabs(fn)  # "<program>", "<input>", "<string>": code the program compiled
    return True


def _guarded_import(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A002
    if level == 0 and _from_program():
        hit = _banned_match(name, _BANNED)
        for sub in fromlist or ():
            hit = hit or _banned_match(f"{name}.{sub}", _BANNED)
        if hit:
            raise ImportError(f"banned import: {hit}")
    return _ORIG_IMPORT(name, globals, locals, fromlist, level)


class _ImportGuard:
    """meta_path finder: catches importlib.import_module and other routes that skip __import__."""

    def find_spec(self, name, path=None, target=None):
        if _banned_match(name, _BANNED) and _from_program():
            raise ImportError(f"banned import: {name}")
        return None


def _install_import_guard() -> None:
    global _ORIG_IMPORT
    import builtins

    for mod in [m for m in sys.modules if _banned_match(m, _BANNED) and m not in ("os.path",)]:
        del sys.modules[mod]  # cached modules bypass finders; stdlib users keep their own references
    _ORIG_IMPORT = builtins.__import__
    builtins.__import__ = _guarded_import
    sys.meta_path.insert(0, _ImportGuard())


def _short(exc: BaseException) -> str:
    try:
        msg = str(exc)
    except BaseException:  # noqa: BLE001 - hostile __str__
        msg = "<unprintable>"
    name = type(exc).__name__
    text = f"{name}: {msg}" if msg else name
    return text if len(text) <= 300 else text[:297] + "..."


# Plain data: exactly these types (no subclasses), so the repr is a literal that ``ast.literal_eval`` reads
# back and ``==`` is the builtin one. Floats must be finite: ``inf``/``nan`` are no literals.
_PLAIN_ATOMS = (int, bool, str, bytes, type(None))
_PLAIN_CONTAINERS = (tuple, list, set, dict)
PLAIN_MAX_DEPTH = 100


def plain_data_problem(value: object, max_items: int) -> str | None:
    """Why ``value`` is not plain data (builtin literals only, bounded depth and size), or None. Iterative."""
    import math

    stack = [(value, 0)]
    seen = 0
    while stack:
        v, depth = stack.pop()
        seen += 1
        if seen > max_items:
            return f"more than {max_items} elements"
        t = type(v)
        if t in _PLAIN_ATOMS:
            continue
        if t is float:
            if not math.isfinite(v):
                return "non-finite float"
            continue
        if t is complex:
            if not (math.isfinite(v.real) and math.isfinite(v.imag)):
                return "non-finite complex"
            continue
        if t not in _PLAIN_CONTAINERS:
            return f"object of type {t.__name__}"
        if depth >= PLAIN_MAX_DEPTH:
            return f"nested deeper than {PLAIN_MAX_DEPTH}"
        if t is dict:
            for k, x in v.items():
                stack.append((k, depth + 1))
                stack.append((x, depth + 1))
        else:
            for x in v:
                stack.append((x, depth + 1))
    return None


def _evaluate(req: dict, first_run: bool) -> dict:
    """Evaluate ``f(inputs)`` in this process. The first run does the static check and AZR's in-process double
    call (global counters, mutated defaults); the second run (another process) calls once."""
    program, inputs = req["program"], req["inputs"]
    if first_run:
        reason = find_banned(program, _BANNED)
        if reason:
            return {"ok": False, "output": None, "error": reason}
    try:
        code = compile(program, PROGRAM_FILE, "exec")
        call = compile(f"f(\n{inputs}\n)", INPUT_FILE, "eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        return {"ok": False, "output": None, "error": _short(e)}
    _install_import_guard()
    env: dict = {"__name__": "__main__"}
    cap = int(req["max_output_chars"])
    try:
        exec(code, env)
        if not callable(env.get("f")):
            return {"ok": False, "output": None, "error": "NameError: program defines no function f"}
        first = eval(call, env)
        if req.get("plain_data", True):
            problem = plain_data_problem(first, cap)
            if problem:
                return {"ok": False, "output": None, "error": f"not plain data: {problem}"}
        text = repr(first)
        if len(text) > cap:  # before the second call: a huge value must not be built twice
            return {"ok": False, "output": None, "error": f"output too large: {len(text)} chars > {cap}"}
        if req["check_determinism"] and first_run:
            pad = [[i] for i in range(97)]  # shift the heap: id()-dependent results differ between the calls
            second = eval(call, env)
            del pad
            if type(second) is not type(first) or repr(second) != text:
                return {"ok": False, "output": None, "error": "nondeterministic: two calls gave different results"}
        if not req.get("plain_data", True):
            str(first)
            import pickle

            pickle.dumps(first)
    except MemoryError:
        return {"ok": False, "output": None, "error": "memory: MemoryError (limit exceeded)"}
    except BaseException as e:  # noqa: BLE001 - SystemExit, KeyboardInterrupt... from the program
        return {"ok": False, "output": None, "error": _short(e)}
    return {"ok": True, "output": text, "error": None}


def _child(req: dict, wfd: int, cfg: dict, workdir: str, role: str, time_fd: int | None) -> None:
    """Runs in the forked process: confine it, then evaluate once (``role`` A) or as the second run (B)."""
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        if time_fd is not None:
            try:
                _libc_call("setns", time_fd, _CLONE_NEWTIME)  # boot/monotonic clocks shifted: /proc/uptime
            except OSError:
                pass
        os.closerange(3, wfd)
        os.closerange(wfd + 1, 1 << 16)
        if cfg.get("ipc_per_call"):
            _libc_call("unshare", _CLONE_NEWIPC)  # SysV shm / message queues die with this call
        try:  # an out-of-memory kill in the slot's cgroup picks the program, never the runner
            fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
            os.write(fd, b"1000")
            os.close(fd)
        except OSError:
            pass
        os.chdir(workdir)
        mem = int(req["memory_mb"]) << 20
        cpu = int(float(req["timeout_s"])) + 1
        limits = [
            (resource.RLIMIT_AS, mem, mem),
            (resource.RLIMIT_CPU, cpu, cpu + 1),
            (resource.RLIMIT_FSIZE, int(cfg["fsize_mb"]) << 20, int(cfg["fsize_mb"]) << 20),
            (resource.RLIMIT_NOFILE, 64, 64),
            (resource.RLIMIT_CORE, 0, 0),
            (resource.RLIMIT_MEMLOCK, 0, 0),
            (resource.RLIMIT_MSGQUEUE, 0, 0),
        ]
        if cfg.get("uid") is not None:
            limits.append((resource.RLIMIT_NPROC, int(cfg["nproc"]), int(cfg["nproc"])))
        for lim, soft, hard in limits:
            resource.setrlimit(lim, (soft, hard))
        if cfg.get("uid") is not None:
            os.setgroups([])
            os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
            os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
        try:
            _libc_call("prctl", 38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: no setuid binaries regain root
        except OSError:
            pass
        if cfg.get("keyrings"):
            # A fresh anonymous session keyring: the runner's (inherited) one is not reachable from here.
            _keyctl(_KEYCTL_JOIN_SESSION, 0)
        os.environ.clear()
        os.environ.update({"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"})
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        sys.setrecursionlimit(1000)
        _BANNED[:] = cfg.get("banned", [])
        pad = None
        if role == "B":
            # Shift this process's heap against the first run's, so that id()/address-based results differ.
            pad = [bytearray(n) for n in range(1, 520, 4)]  # one more block in each small-object size class
        result = _evaluate(req, first_run=role == "A")
        del pad
    except BaseException as e:  # noqa: BLE001
        result = {"ok": False, "output": None, "error": f"crashed: sandbox setup failed: {_short(e)}"}
    try:
        _write_msg(wfd, result)
    finally:
        os._exit(0)


def _complete(buf: bytearray) -> bool:
    return len(buf) >= _HDR.size and len(buf) >= _HDR.size + _HDR.unpack(buf[:_HDR.size])[0]


_SIGNAMES = {getattr(signal, n): n for n in dir(signal) if n.startswith("SIG") and not n.startswith("SIG_")}


class WipeError(RuntimeError):
    """The work directory could not be emptied: the slot must be restarted."""


def wipe_dir(path: str, max_passes: int = 1_000_000) -> None:
    """Empty ``path`` without recursion: nested directories are moved up to the top level and removed there.

    Works at any depth (a chain deeper than PATH_MAX or than Python's recursion limit) with two open file
    descriptors. Raises :class:`WipeError` when an entry cannot be removed.
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    top = os.open(path, flags)
    counter = 0
    try:
        for _ in range(max_passes):
            names = os.listdir(top)
            if not names:
                return
            progress = False
            for name in names:
                try:
                    os.unlink(name, dir_fd=top)
                    progress = True
                    continue
                except FileNotFoundError:
                    continue
                except (IsADirectoryError, PermissionError):
                    pass
                try:
                    os.rmdir(name, dir_fd=top)
                    progress = True
                    continue
                except OSError:
                    pass
                try:
                    sub = os.open(name, flags, dir_fd=top)
                except PermissionError:
                    os.chmod(name, 0o700, dir_fd=top)  # a non-root runner: the program made it unreadable
                    sub = os.open(name, flags, dir_fd=top)
                try:
                    os.fchmod(sub, 0o700)
                    for child in os.listdir(sub):
                        try:
                            os.unlink(child, dir_fd=sub)
                        except (IsADirectoryError, PermissionError):
                            counter += 1
                            os.rename(child, f".populora_wipe_{counter}", src_dir_fd=sub, dst_dir_fd=top)
                        progress = True
                finally:
                    os.close(sub)
            if not progress:
                raise WipeError(f"cannot empty {path}: {names[:3]!r} stay")
        raise WipeError(f"cannot empty {path}: too many passes")
    except OSError as e:
        raise WipeError(f"cannot empty {path}: {e}") from None
    finally:
        os.close(top)


class Runner:
    def __init__(self, cfg: dict, ctl_in: int, ctl_out: int) -> None:
        self.cfg, self.ctl_in, self.ctl_out = cfg, ctl_in, ctl_out
        self.is_init = os.getpid() == 1
        self.notes: list[str] = []
        self.protections = {"pid_namespace": self.is_init}
        _load_libc()
        # Join the slot's memory cgroup (created by the host) before the filesystem turns read-only; the
        # children inherit it. The host sets its limit once it knows our own footprint.
        self.protections["memory_cgroup"] = False
        if cfg.get("cgroup"):
            try:
                with open(os.path.join(cfg["cgroup"], "cgroup.procs"), "w") as fh:
                    fh.write("0")
                self.protections["memory_cgroup"] = True
            except OSError as e:
                self.notes.append(f"memory cgroup: {e}")
        try:  # best effort (some hosts pin it); the children raise theirs to the maximum anyway
            with open("/proc/self/oom_score_adj", "w") as fh:
                fh.write("-1000")
        except OSError:
            pass
        if cfg.get("setup_mounts"):
            self.protections.update(_setup_mounts(cfg, self.notes))
        base = "/tmp" if self.protections.get("private_tmp") else None
        import tempfile

        self.workdir = tempfile.mkdtemp(prefix="populora_exec_", dir=base)
        self._fresh_workdir(create=False)
        try:
            _libc_call("prctl", 36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come back to us
        except OSError:
            pass
        self.protections.update({
            "uid_drop": cfg.get("uid") is not None,
            "fork_limit": cfg.get("uid") is not None,
        })
        self._probe_per_call_namespaces()
        for mod in ("collections", "collections.abc", "itertools", "functools", "math", "cmath", "re",
                    "string", "heapq", "bisect", "copy", "operator", "typing", "dataclasses", "fractions",
                    "decimal", "statistics", "json", "pickle", "enum", "abc", "numbers", "textwrap",
                    "unicodedata", "array", "struct", "base64", "binascii", "pprint", "contextlib"):
            try:
                __import__(mod)  # warm the fork parent: children import from memory, not from disk
            except ImportError:
                pass
        import gc

        gc.collect()
        gc.freeze()  # the collector in a child never walks (and so never copies) the runner's objects

    def _probe_per_call_namespaces(self) -> None:
        """Which per-call confinements this kernel and our privileges allow (tried in a throwaway child)."""
        def works(fn) -> bool:
            pid = os.fork()
            if pid == 0:
                try:
                    fn()
                    os._exit(0)
                except BaseException:  # noqa: BLE001
                    os._exit(1)
            return os.waitpid(pid, 0)[1] == 0

        self.cfg["ipc_per_call"] = works(lambda: _libc_call("unshare", _CLONE_NEWIPC))
        self.protections["ipc_namespace_per_call"] = self.cfg["ipc_per_call"]
        # Keyrings: each call joins a fresh session keyring; the slot uid's user keyrings are cleared after
        # it. Without our own uid (or user namespace) the user keyring would be the host user's: left alone.
        own_keyrings = self.cfg.get("uid") is not None or bool(self.cfg.get("user_namespace"))
        self.cfg["keyrings"] = own_keyrings and works(lambda: _keyctl(_KEYCTL_JOIN_SESSION, 0))
        self.protections["keyring_isolation"] = self.cfg["keyrings"]
        self.time_fd = None
        try:
            orig = os.open("/proc/self/ns/time", os.O_RDONLY | os.O_CLOEXEC)
            _libc_call("unshare", _CLONE_NEWTIME)
            shift = 86400 * (1 + os.getpid() % 97) + 12345
            with open("/proc/self/timens_offsets", "w") as fh:
                fh.write(f"monotonic {shift} 0\nboottime {shift} 0\n")
            self.time_fd = os.open("/proc/self/ns/time_for_children", os.O_RDONLY)
            _libc_call("setns", orig, _CLONE_NEWTIME)  # our own children start in the original one again
            os.close(orig)
        except OSError as e:
            self.notes.append(f"time namespace: {e.strerror or e}")
            self.time_fd = None
        self.protections["time_namespace_second_run"] = self.time_fd is not None

    def _fresh_workdir(self, create: bool = True) -> None:
        """A new, empty work directory at the same path: no file, mode or xattr survives a call."""
        if create:
            wipe_dir(self.workdir)
            os.rmdir(self.workdir)
            os.mkdir(self.workdir, 0o700)
        if self.cfg.get("uid") is not None:
            os.chown(self.workdir, self.cfg["uid"], self.cfg["gid"])
        os.chmod(self.workdir, 0o700)

    def _kill_all(self, child: int, reaped: bool) -> None:
        """Kill every process the call left behind and reap them."""
        if self.is_init:
            try:
                os.kill(-1, signal.SIGKILL)  # PID 1 of our own namespace: every descendant, never us
            except ProcessLookupError:
                pass
        elif self.cfg.get("uid") is not None:
            helper = os.fork()
            if helper == 0:  # an unprivileged kill(-1) reaches exactly the processes of the slot uid
                try:
                    os.setresuid(self.cfg["uid"], self.cfg["uid"], self.cfg["uid"])
                    os.kill(-1, signal.SIGKILL)
                finally:
                    os._exit(0)
            os.waitpid(helper, 0)
        else:
            try:
                os.killpg(child, signal.SIGKILL)  # best effort: a program can setsid away
            except (ProcessLookupError, PermissionError):
                pass
        if not reaped and not self.is_init:
            try:
                os.waitpid(child, 0)  # SIGKILLed above: returns promptly
            except ChildProcessError:
                pass
        while True:
            try:
                pid, _ = os.waitpid(-1, 0 if self.is_init else os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break

    def _clear_keyrings(self) -> None:
        uid = self.cfg.get("uid")
        if not self.cfg.get("keyrings"):
            return
        if uid is None:  # our own user namespace: its keyrings are ours alone
            for spec in (_KEY_SPEC_USER, _KEY_SPEC_USER_SESSION):
                try:
                    _keyctl(_KEYCTL_CLEAR, spec)
                except OSError:
                    pass
            return
        os.setresuid(uid, uid, 0)  # the user keyrings belong to the real uid; saved uid 0 brings us back
        try:
            for spec in (_KEY_SPEC_USER, _KEY_SPEC_USER_SESSION):
                try:
                    _keyctl(_KEYCTL_CLEAR, spec)
                except OSError:
                    pass
        finally:
            os.setresuid(0, 0, 0)

    def _once(self, req: dict, role: str, deadline: float) -> dict:
        """One confined process evaluating the request; everything it left behind is gone afterwards."""
        rfd, wfd = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(rfd)
            _child(req, wfd, self.cfg, self.workdir, role, self.time_fd if role == "B" else None)
        os.close(wfd)
        limit = 8 * int(req["max_output_chars"]) + (1 << 16)
        buf, timed_out, status = bytearray(), False, None
        pidfd = os.pidfd_open(child)
        watch = [rfd, pidfd]
        try:
            while True:
                left = deadline - _now()
                if left <= 0:
                    timed_out = True
                    break
                ready, _, _ = select.select(watch, [], [], left)
                if rfd in ready:
                    chunk = os.read(rfd, 1 << 16)
                    if not chunk:
                        watch.remove(rfd)  # all writers gone; wait for the exit status
                    buf += chunk
                    if len(buf) > limit or _complete(buf):
                        break  # a lingering grandchild may hold the pipe open: don't wait for EOF
                if pidfd in ready:
                    _, status = os.waitpid(child, 0)
                    os.set_blocking(rfd, False)
                    try:  # whatever the child wrote before exiting
                        while len(buf) <= limit and (chunk := os.read(rfd, 1 << 16)):
                            buf += chunk
                    except BlockingIOError:
                        pass
                    break
        finally:
            os.close(rfd)
            os.close(pidfd)
        self._kill_all(child, reaped=status is not None)
        self._clear_keyrings()
        self._fresh_workdir()
        return self._interpret(buf, timed_out, status, deadline, limit, int(req["max_output_chars"]))

    def run(self, req: dict) -> dict:
        """Both runs of a request: the first (with AZR's in-process double call), then, when it succeeded and
        determinism is checked, a second independent process (shifted heap and clocks) whose repr must match."""
        start = _now()
        deadline = start + float(req["timeout_s"])
        first = self._once(req, "A", deadline)
        if first["ok"] and req["check_determinism"]:
            second = self._once(req, "B", deadline)
            if not second["ok"]:
                kind = str(second["error"]).split(":", 1)[0]
                if kind in ("timeout", "memory"):
                    first = second
                else:
                    first = {"ok": False, "output": None,
                             "error": f"nondeterministic: a second process failed: {second['error']}"[:300]}
            elif second["output"] != first["output"]:
                first = {"ok": False, "output": None,
                         "error": "nondeterministic: two processes gave different results"}
        first["duration_s"] = _now() - start
        return first

    @staticmethod
    def _interpret(buf: bytearray, timed_out: bool, status: int | None, deadline: float, limit: int,
                   cap: int) -> dict:
        """The child's message, treated as untrusted bytes: shape, types and size are checked here."""
        if len(buf) >= _HDR.size:
            n = _HDR.unpack(buf[:_HDR.size])[0]
            if len(buf) >= _HDR.size + n:
                try:
                    res = json.loads(bytes(buf[_HDR.size:_HDR.size + n]))
                    ok, output, error = res["ok"], res["output"], res["error"]
                except (ValueError, KeyError, TypeError):
                    return {"ok": False, "output": None, "error": "crashed: malformed result"}
                if ok is True and isinstance(output, str):
                    if len(output) > cap:
                        return {"ok": False, "output": None, "error": f"output too large: {len(output)} chars > {cap}"}
                    return {"ok": True, "output": output, "error": None}
                if ok is False and isinstance(error, str):
                    return {"ok": False, "output": None, "error": error[:300]}
                return {"ok": False, "output": None, "error": "crashed: malformed result"}
            if len(buf) > limit:
                return {"ok": False, "output": None, "error": "output too large"}
        if timed_out:
            return {"ok": False, "output": None, "error": "timeout: time limit exceeded"}
        if status is not None and os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            if sig == signal.SIGXCPU:
                return {"ok": False, "output": None, "error": "timeout: CPU time limit"}
            if sig == signal.SIGKILL:
                return {"ok": False, "output": None, "error": "memory: killed (SIGKILL, likely out of memory)"}
            return {"ok": False, "output": None, "error": f"crashed: killed by {_SIGNAMES.get(sig, sig)}"}
        if status is not None and os.WIFEXITED(status):
            return {"ok": False, "output": None,
                    "error": f"crashed: exited with code {os.WEXITSTATUS(status)} before returning"}
        return {"ok": False, "output": None, "error": "crashed: no result"}

    def serve(self) -> None:
        _write_msg(self.ctl_out, {"ready": True, "protections": self.protections, "notes": self.notes})
        while True:
            msg = _read_msg(self.ctl_in)
            if msg is None:
                return  # host closed the pipe (or died): leave, and the namespace dies with us
            replies, fatal = [], None
            for req in msg["batch"]:
                if fatal is not None:
                    replies.append({"ok": False, "output": None, "duration_s": 0.0,
                                    "error": "crashed: sandbox slot restarted before this request ran"})
                    continue
                try:
                    replies.append(self.run(req))
                except BaseException as e:  # noqa: BLE001 - this slot's state is unknown now: give it up
                    fatal = f"crashed: sandbox slot failed and is restarted: {_short(e)}"
                    replies.append({"ok": False, "output": None, "error": fatal, "duration_s": 0.0})
            _write_msg(self.ctl_out, {"batch": replies, "fatal": fatal})
            if fatal is not None:
                return  # the host restarts the slot: a fresh namespace, tmpfs and work directory


def main() -> None:
    # Move the control pipe off fds 0/1 so children can't inherit it by accident, then detach stdio.
    ctl_in, ctl_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the host; it closes our pipe
    cfg = _read_msg(ctl_in)
    if cfg is None:
        return
    try:
        runner = Runner(cfg, ctl_in, ctl_out)
    except BaseException as e:  # noqa: BLE001
        _write_msg(ctl_out, {"ready": False, "error": _short(e)})
        raise
    runner.serve()


if __name__ == "__main__":
    main()
