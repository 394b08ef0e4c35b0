"""Standalone sandbox worker: one per executor slot; its zygote (this file run with ``--zygote``) forks a
fresh child per program.

This file must stay importable and runnable with the standard library only: it is started as
``python -s -S -P -B _runner.py`` (no site, no torch, no populora_verl) so that a forked child costs a
few MB and a fork takes about a millisecond. The host side (``local.py``) imports the pure policy
functions below (``find_banned``) so the static check is the same code on both sides.

Protocol (both directions): 4-byte big-endian length + UTF-8 JSON.
  host -> worker, once:  {"uid", "gid", "setup_mounts", "expose", "banned", "nproc", "fsize_mb", "tmp_mb",
                          "memory_mb", "cgroup", "user_namespace", "namespace_filter" (optional, default true)}
  worker -> host, once:  {"ready": true, "protections": {...}, "notes": [...]}
  host -> worker:        {"batch": [request, ...]}, a request being
                         {"program", "inputs", "timeout_s", "memory_mb", "check_determinism", "max_output_chars"}
  worker -> host:        {"batch": [{"ok", "output", "error", "duration_s"}, ...], "fatal": null | reason}
                         one reply per request, in order; a "fatal" reason means the slot gave up (the requests
                         after the failing one are answered as not run) and the host restarts it.
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
TRICK_NAMES = frozenset(
    {"__import__", "__builtins__", "__loader__", "__spec__", "importlib", "builtins", "__subclasses__", "__globals__"}
)
# Code objects and frames: rewriting a function's code (``code.replace(co_filename=...)``) or walking frames
# reaches the runner's own state. No honest ``f`` needs them.
INTERNALS_NAMES = frozenset(
    {
        "__code__",
        "f_globals",
        "f_builtins",
        "f_locals",
        "f_back",
        "f_code",
        "tb_frame",
        "gi_frame",
        "gi_code",
        "cr_frame",
        "cr_code",
        "ag_frame",
        "ag_code",
        "_getframe",
    }
)
DYNAMIC_CODE = frozenset({"exec", "eval", "compile"})
_ATTR_FUNCS = frozenset({"getattr", "setattr", "delattr", "hasattr"})
_FOLD_MAX = 4096  # longest string the static check builds while folding constants


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


def _int_const(node: ast.AST | None) -> int | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _int_const(node.operand)
        return None if inner is None else -inner
    return None


def _fold_node(node: ast.AST, folded: dict[int, str]) -> str | None:
    """The string ``node`` builds from constants, given its children's (in ``folded``); never runs code.

    Covers concatenation, small repeats, slices, f-strings, ``''.join([...])``, ``%`` and ``.format`` of
    constants, and case changes: the ways to spell ``'__builtins__'`` without writing it. Results stay
    short (:data:`_FOLD_MAX`): a program cannot make the check build a huge string."""
    get = lambda n: folded.get(id(n))  # noqa: E731
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, str) else None
    if isinstance(node, ast.FormattedValue):
        return get(node.value) if node.format_spec is None and node.conversion in (-1, 115) else None
    if isinstance(node, ast.JoinedStr):
        parts = [get(v) for v in node.values]
        return None if None in parts else "".join(parts)
    if isinstance(node, ast.BinOp):
        left, right = get(node.left), get(node.right)
        if isinstance(node.op, ast.Add):
            return None if left is None or right is None else left + right
        if isinstance(node.op, ast.Mult):
            text, count = (left, _int_const(node.right)) if left is not None else (right, _int_const(node.left))
            if text is not None and count is not None and 0 <= count and len(text) * count <= _FOLD_MAX:
                return text * count
            return None
        if isinstance(node.op, ast.Mod) and left is not None:
            args = node.right.elts if isinstance(node.right, ast.Tuple) else [node.right]
            parts = [get(a) for a in args]
            # No width or precision: the result is never longer than its pieces.
            if None in parts or any(c in left for c in "0123456789*"):
                return None
            try:
                return left % tuple(parts)
            except (TypeError, ValueError):
                return None
        return None
    if isinstance(node, ast.Subscript):
        text, sl = get(node.value), node.slice
        if text is None:
            return None
        if isinstance(sl, ast.Slice):
            bounds = [None if b is None else _int_const(b) for b in (sl.lower, sl.upper, sl.step)]
            if any(b is None and raw is not None for b, raw in zip(bounds, (sl.lower, sl.upper, sl.step))):
                return None
            try:
                return text[slice(*bounds)]
            except ValueError:
                return None
        index = _int_const(sl)
        return text[index] if index is not None and -len(text) <= index < len(text) else None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.keywords:
        base, method = get(node.func.value), node.func.attr
        if base is None:
            return None
        if method == "join" and len(node.args) == 1 and isinstance(node.args[0], (ast.List, ast.Tuple)):
            parts = [get(e) for e in node.args[0].elts]
            if None in parts or len(base) * len(parts) + sum(map(len, parts)) > _FOLD_MAX:
                return None
            return base.join(parts)
        if method == "format":
            parts = [get(a) for a in node.args]
            # Plain "{}"/"{0}" fields only: no format spec (width), no attribute or item lookup (code).
            if (
                None in parts
                or any(c in base for c in ":.[!")
                or len(base) + base.count("{") * max(map(len, parts), default=0) > _FOLD_MAX
            ):
                return None
            try:
                return base.format(*parts)
            except (IndexError, KeyError, ValueError, AttributeError):
                return None
        if method in ("lower", "upper", "strip", "swapcase", "casefold") and not node.args:
            return getattr(base, method)()
    return None


def _fold_strings(nodes: list[ast.AST]) -> dict[int, str]:
    """Fold every constant string expression of a tree, ``nodes`` in ``ast.walk`` order (parents first):
    children are folded before their parents, without recursion, so depth does not matter."""
    folded: dict[int, str] = {}
    for node in reversed(nodes):
        text = _fold_node(node, folded)
        if text is not None and len(text) <= _FOLD_MAX:
            folded[id(node)] = text
    return folded


def _chain_problem(chain: str, banned: list[str], modules: set[str]) -> str | None:
    """Why the dotted use ``chain`` (``sys.modules``, ``os.environ``, ``statistics.random``) is banned, or None."""
    if chain == "sys.modules" or chain.startswith("sys.modules."):
        return "banned import: use of sys.modules"
    for entry in banned:
        if "." in entry and (chain == entry or chain.startswith(entry + ".")):
            return f"banned import: use of {entry}"
    parts = chain.split(".")
    # A banned module reached as an attribute of a module the program imported (statistics.random).
    if len(parts) > 1 and parts[0] in modules and _banned_match(parts[1], banned):
        return f"banned import: use of {parts[0]}.{parts[1]}"
    return None


def _name_problem(name: str) -> str | None:
    if name in TRICK_NAMES:
        return f"use of {name}"
    if name in INTERNALS_NAMES:
        return f"use of {name} (code object or frame internals)"
    return None


def find_banned(program: str, banned: list[str], _depth: int = 0) -> str | None:
    """A short reason if ``program`` uses a banned module or an import trick, else None.

    Walks Import/ImportFrom (banned entry ``a`` covers ``a`` and ``a.*``; dotted entry ``a.b`` also covers
    ``from a import b`` and the attribute chain ``a.b``), and rejects routes around import statements:
    ``__import__``, ``importlib``, ``builtins``/``__builtins__``, ``sys.modules``, a banned module reached as
    an attribute of an imported one (``statistics.random``), code-object and frame internals (``__code__``,
    ``co_*=`` rewrites, ``f_globals``...), and exec/eval/compile of anything but a string literal (a literal
    is checked recursively). Strings built from constants (``'__bui' + 'ltins__'``) are folded first.
    """
    try:
        tree = ast.parse(program, PROGRAM_FILE)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None  # not our job: running it reports the syntax error
    nodes = list(ast.walk(tree))
    folded = _fold_strings(nodes)
    modules = {(a.asname or a.name).split(".")[0] for n in nodes if isinstance(n, ast.Import) for a in n.names}
    for node in nodes:
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
        elif isinstance(node, ast.Name) and _name_problem(node.id):
            return f"banned import: {_name_problem(node.id)}"
        elif isinstance(node, ast.Attribute):
            if _name_problem(node.attr):
                return f"banned import: {_name_problem(node.attr)}"
            chain = _attr_chain(node)
            problem = _chain_problem(chain, banned, modules) if chain else None
            if problem:
                return problem
        elif isinstance(node, ast.keyword) and node.arg and node.arg.startswith("co_"):
            return f"banned import: code object rewrite ({node.arg}=)"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in DYNAMIC_CODE:
            arg = node.args[0] if node.args else None
            if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                return f"banned import: {node.func.id}() of non-literal code"
            if _depth < 3:
                inner = find_banned(arg.value, banned, _depth + 1)
                if inner:
                    return inner
        text = folded.get(id(node))
        if text is not None and _name_problem(text):
            return f"banned import: string {text!r}"  # getattr(x, "__import__"), '__bui' + 'ltins__'
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _ATTR_FUNCS
            and len(node.args) >= 2
        ):
            base, name = _attr_chain(node.args[0]), folded.get(id(node.args[1]))
            problem = _chain_problem(f"{base}.{name}", banned, modules) if base and name else None
            if problem:
                return problem  # getattr(os, 'environ'), getattr(statistics, 'random')
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
_OPT_FLAGS = {
    "nosuid": _MS_NOSUID,
    "nodev": _MS_NODEV,
    "noexec": _MS_NOEXEC,
    "noatime": _MS_NOATIME,
    "nodiratime": _MS_NODIRATIME,
    "relatime": _MS_RELATIME,
}
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


# Never covered: the system's own folders and the mount points the sandbox replaces itself.
_NEVER_HIDDEN = frozenset(
    {
        "/",
        "/usr",
        "/lib",
        "/lib32",
        "/lib64",
        "/bin",
        "/sbin",
        "/etc",
        "/var",
        "/run",
        "/boot",
        "/proc",
        "/sys",
        "/dev",
        "/tmp",
    }
)


def _hide(paths: list[str], expose: list[str], notes: list[str]) -> None:
    """Cover each of ``paths`` with an empty tmpfs (read-only with every other mount later).

    These are the trainer's working directory and home, where run folders and their saved golds live: where a
    program keeps the trainer's uid (the user-namespace mode) their modes do not keep it out. What ``expose``
    needs below one of them (the interpreter's standard library) is bound aside and back."""
    for i, path in enumerate(paths):
        path = os.path.realpath(path)
        if (
            path in _NEVER_HIDDEN
            or not os.path.isdir(path)
            or any(p == path or p.startswith(path + "/") for p in ("/proc", "/sys", "/dev", "/tmp"))
        ):
            continue
        keep = [os.path.realpath(e) for e in expose]
        if path in keep:
            continue
        keep = [e for e in keep if e.startswith(path + "/")]
        stages = []
        for j, kept in enumerate(keep):
            stage = f"/tmp/.populora_keep{i}_{j}"
            os.makedirs(stage, exist_ok=True)
            _mount(kept, stage, None, _MS_BIND | _MS_REC)
            stages.append((stage, kept))
        _mount("tmpfs", path, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,nr_inodes=1024,mode=755")
        for stage, kept in stages:
            os.makedirs(kept, mode=0o755, exist_ok=True)
            _mount(stage, kept, None, _MS_BIND | _MS_REC)
            _umount(stage)
            os.rmdir(stage)
        notes.append(f"hidden {path}")


def _setup_mounts(cfg: dict, notes: list[str]) -> dict[str, bool]:
    """Private /proc and /tmp, interpreter readable, every other mount read-only; the same minimal world in
    every slot: a /dev of harmless nodes, no /sys, fixed views of host-wide /proc files.

    /tmp is a root-owned (0755) tmpfs: the only place a program can write is the slot's work directory
    inside it (its cwd, $TMPDIR, $HOME, the same path in every slot), which is emptied after every call.
    """
    prot = {
        "private_proc": False,
        "private_tmp": False,
        "readonly_fs": False,
        "private_dev": False,
        "no_sys": False,
        "masked_proc": False,
    }
    try:
        _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
        try:  # the runner, the zygote and a run's init are root's: a program (the slot's uid) sees none of them
            _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "hidepid=2")
        except OSError:
            _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
        prot["private_proc"] = True
    except OSError as e:
        notes.append(f"proc: {e}")
    try:
        _mount(
            "tmpfs",
            "/tmp",
            "tmpfs",
            _MS_NOSUID | _MS_NODEV,
            f"size={int(cfg['tmp_mb'])}m,nr_inodes={_TMP_INODES},mode=755",
        )
        prot["private_tmp"] = True
    except OSError as e:
        notes.append(f"tmp: {e}")
    prot["hidden_paths"] = False
    if prot["private_tmp"]:
        try:
            _hide(cfg.get("hide", []), cfg.get("expose", []), notes)
            prot["hidden_paths"] = True
        except OSError as e:
            notes.append(f"hide: {e}")
    try:
        _expose(cfg.get("expose", []), notes)
    except OSError as e:
        notes.append(f"expose: {e}")
    for key, setup, needs in (
        ("private_dev", _private_dev, "private_tmp"),
        ("no_sys", _hide_sys, None),
        ("masked_proc", lambda: _mask_proc(int(cfg["memory_mb"])), "private_proc"),
    ):
        if needs and not prot[needs]:
            notes.append(f"{key}: needs {needs}")
            continue
        try:
            setup()
            prot[key] = True
        except OSError as e:
            notes.append(f"{key}: {e}")
    root_ok, failed = False, 0
    for point, flags in _mountinfo():
        if point == "/proc" or point.startswith("/proc/") or point == "/tmp":
            continue
        if (prot["no_sys"] and point.startswith("/sys/")) or (
            prot["private_dev"] and point.startswith("/dev/") and point[5:] not in _DEV_NODES
        ):
            continue  # covered by the empty /sys or the private /dev: out of reach
        try:
            _mount(None, point, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | flags)
            root_ok = root_ok or point == "/"
        except OSError:
            failed += 1  # hidden or unusual mounts; "/" is the one that matters
    prot["readonly_fs"] = root_ok
    if failed:
        notes.append(f"{failed} mounts could not be made read-only")
    return prot


# A program sees only these devices (host nodes bound into a private /dev): no terminal, no GPU, no
# /dev/shm to leave files in. The links are what programs and libc expect.
_DEV_NODES = ("null", "zero", "full", "random", "urandom")
_DEV_LINKS = {
    "fd": "/proc/self/fd",
    "stdin": "/proc/self/fd/0",
    "stdout": "/proc/self/fd/1",
    "stderr": "/proc/self/fd/2",
}


def _private_dev() -> None:
    """A fresh tmpfs on /dev holding only :data:`_DEV_NODES`, bound from the host's /dev."""
    stage = "/tmp/.populora_dev"
    os.mkdir(stage, 0o700)
    nodes = [n for n in _DEV_NODES if os.path.exists(f"/dev/{n}")]
    for name in nodes:
        os.close(os.open(f"{stage}/{name}", os.O_CREAT | os.O_WRONLY, 0o600))
        _mount(f"/dev/{name}", f"{stage}/{name}", None, _MS_BIND)
    # Covers the host's /dev and what is mounted under it (pts, shm, mqueue): out of reach, and if this
    # fails the host's /dev is still there for the runner and its children.
    _mount("tmpfs", "/dev", "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "size=64k,nr_inodes=64,mode=755")
    for name in nodes:
        os.close(os.open(f"/dev/{name}", os.O_CREAT | os.O_WRONLY, 0o666))
        _mount(f"{stage}/{name}", f"/dev/{name}", None, _MS_BIND)
        _umount(f"{stage}/{name}")
        os.unlink(f"{stage}/{name}")
    for name, target in _DEV_LINKS.items():
        os.symlink(target, f"/dev/{name}")
    os.rmdir(stage)


def _hide_sys() -> None:
    """No /sys: an empty, read-only tmpfs in its place (cgroup counters, network interfaces, PCI devices,
    GPU details all live there)."""
    try:
        _umount("/sys")
    except OSError:
        pass
    _mount("tmpfs", "/sys", "tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "size=4k,nr_inodes=1,mode=555")


def proc_views(memory_mb: int) -> dict[str, str]:
    """Fixed contents for host-wide /proc files (load, memory, CPU, boot and lock tables, counters): the same
    in every slot and every run, and nothing about the host. Memory reads as the call's own limit."""
    kb = int(memory_mb) * 1024
    meminfo = "".join(
        f"{k + ':':<16}{v:>8} kB\n"
        for k, v in (
            ("MemTotal", kb),
            ("MemFree", kb),
            ("MemAvailable", kb),
            ("Buffers", 0),
            ("Cached", 0),
            ("SwapCached", 0),
            ("Active", 0),
            ("Inactive", 0),
            ("SwapTotal", 0),
            ("SwapFree", 0),
            ("Dirty", 0),
            ("Shmem", 0),
        )
    )
    views = {
        "loadavg": "0.00 0.00 0.00 1/1 1\n",
        "meminfo": meminfo,
        "stat": (
            "cpu  0 0 0 0 0 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\nintr 0\nctxt 0\nbtime 0\nprocesses 0\n"
            "procs_running 1\nprocs_blocked 0\nsoftirq 0 0 0 0 0 0 0 0 0 0 0\n"
        ),
        "cpuinfo": "processor\t: 0\n\n",
        "swaps": "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n",
        "sys/kernel/random/boot_id": "00000000-0000-0000-0000-000000000000\n",
        "sys/kernel/random/entropy_avail": "256\n",
        "sys/fs/file-nr": "0\t0\t0\n",
        "sys/fs/inode-nr": "0\t0\n",
        "sys/fs/inode-state": "0\t0\t0\t0\t0\t0\t0\n",
        "sys/fs/dentry-state": "0\t0\t0\t0\t0\t0\n",
    }
    for name in (
        "vmstat",
        "zoneinfo",
        "buddyinfo",
        "pagetypeinfo",
        "diskstats",
        "interrupts",
        "softirqs",
        "schedstat",
        "locks",
        "key-users",
        "cgroups",
        "slabinfo",
        "vmallocinfo",
        "timer_list",
        "sched_debug",
        "partitions",
        "iomem",
        "ioports",
        "kallsyms",
        "modules",
    ):
        views[name] = ""
    return views


_PROC_HIDDEN_DIRS = ("pressure", "driver", "irq", "bus")


def _mask_proc(memory_mb: int) -> None:
    """Bind :func:`proc_views` over the host-wide /proc files and empty read-only tmpfs over whole host-wide
    directories (pressure stall counters, driver details such as GPU UUIDs, IRQ and bus tables)."""
    stage = "/tmp/.populora_proc"
    os.mkdir(stage, 0o755)
    _mount("tmpfs", stage, "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "size=1m,nr_inodes=128,mode=755")
    ro = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    try:
        for rel, text in proc_views(memory_mb).items():
            target = f"/proc/{rel}"
            if not os.path.isfile(target):
                continue
            src = f"{stage}/{rel.replace('/', '_')}"
            with open(src, "w") as fh:
                fh.write(text)
            os.chmod(src, 0o444)
            _mount(src, target, None, _MS_BIND)
            _mount(None, target, None, ro)
        for rel in _PROC_HIDDEN_DIRS:
            if os.path.isdir(f"/proc/{rel}"):
                _mount(
                    "tmpfs",
                    f"/proc/{rel}",
                    "tmpfs",
                    _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC,
                    "size=4k,nr_inodes=1,mode=555",
                )
    finally:
        _umount(stage)  # the bound files stay reachable through their mounts only
        os.rmdir(stage)


# ----------------------------------------------------------------------------- kernel helpers
_CLONE_NEWTIME = 0x00000080
_SYS_KEYCTL = {"x86_64": 250, "aarch64": 219}.get(os.uname().machine)
_KEYCTL_JOIN_SESSION, _KEYCTL_SETPERM, _KEYCTL_CLEAR = 1, 5, 7
_KEY_POS_VIEW, _KEY_POS_SEARCH = 0x01000000, 0x08000000
_KEY_SPEC_USER, _KEY_SPEC_USER_SESSION = -4, -5


def _keyctl(op: int, *args: int) -> None:
    if _SYS_KEYCTL is None:
        raise OSError(38, "keyctl: unknown syscall number on this architecture")
    _libc_call("syscall", _SYS_KEYCTL, op, *args)


def _keyctl_ret(op: int, *args: int) -> int:
    """keyctl returning its value (a key serial)."""
    if _SYS_KEYCTL is None:
        raise OSError(38, "keyctl: unknown syscall number on this architecture")
    _load_libc()
    import ctypes

    ret = _libc.syscall(_SYS_KEYCTL, op, *args)
    if ret == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"keyctl{(op, *args)!r}: {os.strerror(err)}")
    return ret


def _load_libc() -> None:
    global _libc
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)


_CLONE_NEWCGROUP, _CLONE_NEWUSER = 0x02000000, 0x10000000
SANDBOX_HOSTNAME = "sandbox"
SANDBOX_UID = 1000  # uid and gid of a program in every slot (the slot's own uid outside its user namespace)
SANDBOX_WORKDIR = "/tmp/work"


def _fixed_names() -> None:
    """The same host and domain name in every slot (the UTS namespace starts with the host's)."""
    for fn, name in (("sethostname", SANDBOX_HOSTNAME), ("setdomainname", "(none)")):
        _libc_call(fn, name.encode(), len(name))


def _make_user_namespace(uid: int, gid: int) -> int:
    """An fd of a new user namespace for the slot's programs, in which no namespace can be created.

    Inside, :data:`SANDBOX_UID` is the slot's uid (so every slot and executor shows the same uid) and root
    is root: a child that enters it as root and drops to :data:`SANDBOX_UID` loses every capability (with
    root unmapped the kernel would not see that drop). Its namespace limits (``user.max_*_namespaces``,
    kept per user namespace) are set to 0 from inside by a helper, so that a program cannot create a user
    namespace (and with it the capabilities behind most unprivileged kernel exploits) even where the
    seccomp filter is unavailable.
    """
    r_up, w_up = os.pipe()
    r_down, w_down = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r_up)
            os.close(w_down)
            _libc_call("unshare", _CLONE_NEWUSER)
            os.write(w_up, b"u")
            if os.read(r_down, 1) == b"m":
                for name in os.listdir("/proc/sys/user"):
                    if name.startswith("max_") and name.endswith("_namespaces"):
                        with open(f"/proc/sys/user/{name}", "w") as fh:
                            fh.write("0")
                os.write(w_up, b"l")
                os.read(r_down, 1)  # EOF: the runner holds the namespace now
                code = 0
        finally:
            os._exit(code)
    os.close(w_up)
    os.close(r_down)
    try:
        if os.read(r_up, 1) != b"u":
            raise OSError("user namespace helper failed")
        for name, outside in (("uid_map", uid), ("gid_map", gid)):
            with open(f"/proc/{pid}/{name}", "w") as fh:
                fh.write(f"0 0 1\n{SANDBOX_UID} {outside} 1\n")
        os.write(w_down, b"m")
        if os.read(r_up, 1) != b"l":
            raise OSError("cannot set the namespace limits of the sandbox's user namespace")
        return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(w_down)
        os.close(r_up)
        os.waitpid(pid, 0)


def process_descendants():
    # Every process below this one, setsid or not (orphans come back to a subreaper). No annotations:
    # SandboxFusion's supervisor script carries this source to whatever Python the service runs.
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open("/proc/" + name + "/stat") as fh:
                    parents[int(name)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    mine, grew = {os.getpid()}, True
    while grew:
        more = {p for p, pp in parents.items() if pp in mine and p not in mine}
        mine |= more
        grew = bool(more)
    return mine - {os.getpid()}


def install_namespace_filter() -> str | None:
    """Refuse, for this process and everything it starts, the creation of namespaces and the use of keyrings:
    a seccomp filter that fails ``unshare``/``clone`` with any ``CLONE_NEW*`` flag (EPERM), ``clone3``
    (ENOSYS: its flags are out of the filter's reach; libc falls back to ``clone``), ``keyctl``, ``add_key``
    and ``request_key`` (EPERM) and any syscall of a foreign ABI (x32, i386).
    None when installed, else why not. Needs ``no_new_privs`` (set here) or root; self-contained, the
    SandboxFusion script embeds this function's source.
    """
    import ctypes
    import os

    table = {"x86_64": (0xC000003E, 272, 56, 435, 248, 249, 250), "aarch64": (0xC00000B7, 97, 220, 435, 217, 218, 219)}
    machine = os.uname().machine
    if machine not in table:
        return f"seccomp filter: no syscall table for {machine}"
    arch, nr_unshare, nr_clone, nr_clone3, nr_add_key, nr_request_key, nr_keyctl = table[machine]
    new_ns = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    # seccomp_data: nr at 0, arch at 4, args[0] at 16 (its low 32 bits on these little-endian ABIs).
    # Keyrings outlive processes (the persistent keyring even outlives every process of the uid): a channel
    # between runs and calls that no cleanup reaches, and nothing an honest program needs.
    prog = [
        (ld, 0, 0, 4),
        (jeq, 0, 15, arch),  # 0-1: foreign ABI -> 17
        (ld, 0, 0, 0),
        (jge, 13, 0, 0x40000000),  # 2-3: x32 syscall numbers -> 17
        (jeq, 13, 0, nr_clone3),  # 4: -> 18
        (jeq, 5, 0, nr_unshare),
        (jeq, 7, 0, nr_clone),  # 5-6: -> 11, -> 14
        (jeq, 9, 0, nr_add_key),
        (jeq, 8, 0, nr_request_key),
        (jeq, 7, 0, nr_keyctl),  # 7-9: -> 17
        (ret, 0, 0, allow),  # 10
        (ld, 0, 0, 16),
        (jset, 4, 0, new_ns | 0x80),  # 11-12: unshare, CLONE_NEWTIME too -> 17
        (ret, 0, 0, allow),  # 13
        (ld, 0, 0, 16),
        (jset, 1, 0, new_ns),  # 14-15: clone (its low byte is the exit signal) -> 17
        (ret, 0, 0, allow),  # 16
        (ret, 0, 0, eperm),  # 17
        (ret, 0, 0, enosys),  # 18
    ]

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    insns = (SockFilter * len(prog))(*[SockFilter(*i) for i in prog])
    fprog = SockFprog(len(prog), insns)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError as e:
        return f"seccomp filter: no libc: {e}"
    ulong = ctypes.c_ulong
    if libc.prctl(38, ulong(1), ulong(0), ulong(0), ulong(0)) != 0:  # PR_SET_NO_NEW_PRIVS
        return f"no_new_privs: {os.strerror(ctypes.get_errno())}"
    if libc.prctl(22, ulong(2), ctypes.byref(fprog), ulong(0), ulong(0)) != 0:  # PR_SET_SECCOMP, FILTER
        return f"seccomp filter: {os.strerror(ctypes.get_errno())}"
    return None


# ----------------------------------------------------------------------------- the child
_BANNED: list[str] = []
_BANNED_PATHS: list[str] = []
WARM_MODULES = (
    "collections",
    "collections.abc",
    "itertools",
    "functools",
    "math",
    "cmath",
    "re",
    "string",
    "heapq",
    "bisect",
    "copy",
    "operator",
    "typing",
    "dataclasses",
    "fractions",
    "decimal",
    "json",
    "pickle",
    "enum",
    "abc",
    "numbers",
    "textwrap",
    "unicodedata",
    "array",
    "struct",
    "base64",
    "binascii",
    "pprint",
    "contextlib",
)
# Stdlib modules that import a banned module themselves (statistics: random, queue: threading). Once the
# guard is in place nobody can import a banned module, so they are imported before it: honest programs
# keep them, and the static check refuses reaching the banned module through them.
IMPORT_BEFORE_GUARD = ("statistics", "queue")


def banned_module_paths(banned: list[str]) -> tuple[str, ...]:
    """Source files (and package directories, ending in a separator) of the banned top-level modules, found
    without importing them. Dotted entries (``os.path``) name attributes, not modules of their own."""
    import importlib.machinery

    out: list[str] = []
    for entry in banned:
        if "." in entry:
            continue
        try:
            spec = importlib.machinery.PathFinder.find_spec(entry)
        except (ImportError, ValueError, OSError):
            continue
        if spec is None:
            continue
        if spec.submodule_search_locations:
            out.extend(os.path.join(p, "") for p in spec.submodule_search_locations)
        elif spec.origin and os.path.isabs(spec.origin):
            out.append(spec.origin)
    return tuple(out)


def purge_banned_modules(banned: list[str]) -> None:
    """Drop banned modules from ``sys.modules`` (cached modules bypass finders; their stdlib users keep their
    own references). Done once in the runner, so that no child pays for the scan."""
    for mod in [m for m in sys.modules if _banned_match(m, banned) and m != "os.path"]:
        del sys.modules[mod]


def install_import_guard(banned: list[str], banned_paths: tuple[str, ...]) -> None:
    """The run-time half of the banned-module policy, for the process that is about to run a program.

    An audit hook (``sys.addaudithook``: it cannot be removed or replaced from Python) refuses, whoever asks
    (the program, code it compiled under any file name, or a module importing on its behalf):
    - every import of a banned module through ``import``/``__import__`` (the ``import`` event);
    - executing a banned module's code, the route of ``importlib`` loaders (the ``exec`` event);
    - building or swapping code objects (``code.replace(co_filename=...)``, ``f.__code__ = ...``).
    A ``sys.meta_path`` finder (and, for modules built into the interpreter, a ``None`` entry in
    ``sys.modules``) also stops the ``importlib`` route.
    The hook keeps its state in default arguments of immutable builtin types (rewriting a function's
    ``__defaults__`` or ``__code__`` is itself refused), looks up no global and calls nothing the program
    defined. Self-contained: the SandboxFusion script embeds this function's source.
    """
    import sys

    def hook(
        event,
        args,
        _names=tuple(banned),
        _paths=tuple(banned_paths),
        _str=str,
        _type=type,
        _getattr=getattr,
        _err=ImportError,
        _code_attrs=frozenset({"__code__", "__defaults__", "__kwdefaults__"}),
        _watched=frozenset({"import", "exec", "code.__new__", "object.__setattr__"}),
    ):
        if event not in _watched:
            return
        if event == "import":
            name = args[0]
            if _type(name) is not _str:
                raise _err("banned import: module name is not a str")
            for entry in _names:
                if name == entry or name.startswith(entry + "."):
                    raise _err("banned import: " + name)
        elif event == "exec":
            filename = _getattr(args[0], "co_filename", None)
            if _type(filename) is _str:
                for path in _paths:
                    if filename == path or (path.endswith("/") and filename.startswith(path)):
                        raise _err("banned import: code of " + filename)
        elif event == "code.__new__":
            raise _err("banned import: code object rewrite")
        elif _type(args[1]) is _str and args[1] in _code_attrs:  # object.__setattr__ of a function's code
            raise _err("banned import: code object rewrite (" + args[1] + ")")

    class BannedFinder:
        def find_spec(self, name, path=None, target=None, _names=tuple(banned)):
            for entry in _names:
                if name == entry or name.startswith(entry + "."):
                    raise ImportError("banned import: " + name)
            return None

    sys.addaudithook(hook)
    sys.meta_path.insert(0, BannedFinder())
    for entry in banned:
        if entry in sys.builtin_module_names:  # no file to refuse on the importlib route: mark it missing
            sys.modules[entry] = None  # type: ignore[assignment]


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


def prepare_program(program: str) -> tuple[bool, object]:
    """``(True, code object)`` or ``(False, reason)``: the static check and the compilation of a program.

    Done in the program's own process, under its limits and deadline, before anything of the program runs:
    a program that makes the parser or compiler explode costs its own call only, and no compiled program
    outlives the process that will run it.
    """
    reason = find_banned(program, _BANNED)
    if reason:
        return False, reason
    try:
        return True, compile(program, PROGRAM_FILE, "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as e:
        return False, _short(e)


def _evaluate(req: dict, first_run: bool) -> dict:
    """Check, compile and evaluate ``f(inputs)`` in this process. The first run also does AZR's in-process
    double call (global counters, mutated defaults); the second run (another process) calls once."""
    ok, code = prepare_program(req["program"])
    if not ok:
        return {"ok": False, "output": None, "error": code}
    inputs = req["inputs"]
    try:
        call = compile(f"f(\n{inputs}\n)", INPUT_FILE, "eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        return {"ok": False, "output": None, "error": _short(e)}
    install_import_guard(_BANNED, tuple(_BANNED_PATHS))
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


_PR_CAPBSET_DROP, _PR_SET_SECUREBITS, _PR_CAP_AMBIENT = 24, 28, 47
# NOROOT and NO_CAP_AMBIENT_RAISE, both locked: an exec as uid 0 gains nothing back.
_SECUREBITS = 0x01 | 0x02 | 0x40 | 0x80


def drop_capabilities(last_cap: int) -> None:
    """Give up every capability for good: bounding set, ambient set, securebits, then the effective,
    permitted and inheritable sets. Where the program keeps the runner's uid (a user namespace of one uid, or
    no namespaces and no root), this is what keeps it from the runner's pipes and memory, from mounting
    and from renaming the host."""
    for cap in range(last_cap + 1):
        try:
            _libc_call("prctl", _PR_CAPBSET_DROP, cap, 0, 0, 0)
        except OSError:
            break  # no CAP_SETPCAP: nothing left to drop there
    for call in ((_PR_CAP_AMBIENT, 4, 0, 0, 0), (_PR_SET_SECUREBITS, _SECUREBITS, 0, 0, 0)):
        try:
            _libc_call("prctl", *call)
        except OSError:
            pass
    import ctypes

    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    _libc_call("capset", header, (ctypes.c_uint32 * 6)())


def _read_request(fd: int) -> dict:
    chunks = []
    offset = 0
    while chunk := os.pread(fd, 1 << 20, offset):
        chunks.append(chunk)
        offset += len(chunk)
    os.close(fd)
    return json.loads(b"".join(chunks))


def _child(request_fd: int, wfd: int, cfg: dict) -> None:
    """Runs in a process forked from the zygote: read the request, confine, then check, compile and evaluate.

    The zygote has never held a program, an input or a result, so this process holds its own request only.
    Its parent has set up the namespaces it is born in (the run's own pid and time namespaces); the rest of
    the confinement is done here, before the program text is parsed."""
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        userns = cfg.get("userns_fd")
        keep = sorted({wfd, request_fd} | ({userns} if userns is not None else set()))
        start = 3
        for fd in keep:
            os.closerange(start, fd)
            start = fd + 1
        os.closerange(start, 1 << 16)
        req = _read_request(request_fd)
        role = req["role"]
        workdir = cfg["workdirs"][role]
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
            uid, gid = cfg["uid"], cfg["gid"]
            os.setgroups([])
            if userns is not None:
                # Root enters the slot's user namespace, then drops to the uid every slot shows there.
                _libc_call("setns", userns, _CLONE_NEWUSER)
                os.close(userns)
                uid = gid = SANDBOX_UID
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            if userns is not None and cfg.get("keyrings"):
                # Without the filter below, the user keyrings of (user namespace, uid) outlive the call:
                # empty them before the program can read what an earlier call left there.
                for spec in (_KEY_SPEC_USER, _KEY_SPEC_USER_SESSION):
                    _keyctl(_KEYCTL_CLEAR, spec)
        else:
            drop_capabilities(int(cfg.get("last_cap", 63)))
        if cfg.get("namespace_filter"):
            why = install_namespace_filter()
            if why:
                raise OSError(why)
        os.environ.clear()
        os.environ.update({"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"})
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        sys.setrecursionlimit(1000)
        pad = None
        if role == "B":
            # Shift this process's heap against the first run's (before the program is compiled), so that
            # results depending on the address of anything the program builds differ between the runs.
            pad = [bytearray(n) for n in range(1, 520, 4)]  # one more block in each small-object size class
        result = _evaluate(req, role == "A")
        del pad
    except BaseException as e:  # noqa: BLE001
        result = {"ok": False, "output": None, "error": f"crashed: sandbox setup failed: {_short(e)}"}
    try:
        _write_msg(wfd, result)
    finally:
        os._exit(0)


def _complete(buf: bytearray) -> bool:
    return len(buf) >= _HDR.size and len(buf) >= _HDR.size + _HDR.unpack(buf[: _HDR.size])[0]


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


# ----------------------------------------------------------------------------- the zygote
ZYGOTE_SOCKET_FD = 3
_ADDR_NO_RANDOMIZE = 0x0040000
_PR_SET_DUMPABLE = 4
_CLONE_NEWPID = 0x20000000
# World-writable directories of the host that both runs share when there is no private /tmp.
SHARED_DIRS = ("/tmp", "/var/tmp", "/dev/shm")


def _random_clocks() -> None:
    """Random offsets for the monotonic and boot clocks of the next child's time namespace: a run's clocks
    (``/proc/uptime``, ``/proc/self/timens_offsets``) say nothing about which run it is, and differ between
    the two runs of a call."""
    shift = [86400 + int.from_bytes(os.urandom(4), "big") % (86400 * 3650) for _ in range(2)]
    nanos = [int.from_bytes(os.urandom(4), "big") % 1_000_000_000 for _ in range(2)]
    with open("/proc/self/timens_offsets", "w") as fh:
        fh.write(f"monotonic {shift[0]} {nanos[0]}\nboottime {shift[1]} {nanos[1]}\n")


def _launch(fds: list[int], cfg: dict, own_pid_ns: bool) -> None:
    """In a process just forked by the zygote. In a run's own pid namespace this process is its init: it
    forks the program's process and, when that one ends, passes its status on and exits, which kills
    everything the program left in the namespace."""
    request_fd, wfd = fds
    if not own_pid_ns:
        _child(request_fd, wfd, cfg)
    code = 255
    try:
        pid = os.fork()
        if pid == 0:
            _child(request_fd, wfd, cfg)
        os.closerange(0, 1 << 16)
        while True:
            reaped, status = os.waitpid(-1, 0)
            if reaped == pid:
                break
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
    finally:
        os._exit(code)


def zygote_main() -> None:
    """The process every program of a slot is forked from. Started by an exec before the slot's first
    request, it imports the warm modules, purges the banned ones and then only forks: it never receives a
    program, an input or a result, so a program's process holds its own request and nothing else."""
    import gc
    import socket

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=ZYGOTE_SOCKET_FD)
    sock.send(b"up")
    msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 1)
    cfg = json.loads(msg)
    cfg["userns_fd"] = fds[0] if fds else None
    _load_libc()
    for mod in WARM_MODULES + IMPORT_BEFORE_GUARD:
        try:
            __import__(mod)  # children import from memory, not from disk
        except ImportError:
            pass
    _BANNED[:] = cfg.get("banned") or []
    _BANNED_PATHS[:] = banned_module_paths(_BANNED)
    purge_banned_modules(_BANNED)
    try:
        with open("/proc/sys/kernel/cap_last_cap") as fh:
            cfg["last_cap"] = int(fh.read())
    except (OSError, ValueError):
        cfg["last_cap"] = 63
    prot: dict[str, bool] = {}
    notes: list[str] = []
    try:
        _libc_call("prctl", _PR_SET_DUMPABLE, 0, 0, 0, 0)
    except OSError as e:
        notes.append(f"zygote dumpable: {e}")
    pid_ns = None
    time_ns = False
    if cfg.get("fresh_namespaces"):
        try:  # started before the runner's own cgroup namespace: /proc/self/cgroup reads "/" here too
            _libc_call("unshare", _CLONE_NEWCGROUP)
        except OSError as e:
            notes.append(f"cgroup namespace: {e}")
        try:
            pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
            _libc_call("unshare", _CLONE_NEWPID)
            _libc_call("setns", pid_ns, _CLONE_NEWPID)
        except OSError as e:
            notes.append(f"pid namespace per run: {e}")
            pid_ns = None
        try:
            _libc_call("unshare", _CLONE_NEWTIME)
            _random_clocks()
            time_ns = True
        except OSError as e:
            notes.append(f"time namespace per run: {e}")
    prot["pid_namespace_per_run"] = pid_ns is not None
    prot["time_namespace_second_run"] = time_ns
    why = "namespace filter disabled"
    if cfg.get("namespace_filter", True):
        probe = os.fork()
        if probe == 0:
            os._exit(0 if install_namespace_filter() is None else 1)
        _, status = os.waitpid(probe, 0)
        why = None if status == 0 else install_namespace_filter.__name__ + ": cannot be installed here"
    prot["namespace_filter"] = why is None
    if why:
        notes.append(why)
    cfg["namespace_filter"] = why is None
    # Keyrings outlive processes; the filter refuses the keyctl family (otherwise the user keyrings are
    # emptied around every run, and the persistent keyring stays reachable).
    prot["keyring_isolation"] = why is None or bool(cfg.get("keyrings"))
    gc.collect()
    gc.freeze()  # the collector in a child never walks (and so never copies) the zygote's objects
    sock.send(json.dumps({"protections": prot, "notes": notes}).encode())
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 16, 2)
        except OSError:
            return
        if msg != b"run" or len(fds) != 2:
            return  # the runner is gone (or confused): it starts a new zygote
        if pid_ns is not None:
            _libc_call("setns", pid_ns, _CLONE_NEWPID)
            _libc_call("unshare", _CLONE_NEWPID)
        if time_ns:
            _libc_call("unshare", _CLONE_NEWTIME)
            _random_clocks()
        pid = os.fork()
        if pid == 0:
            _launch(fds, cfg, pid_ns is not None)
        for fd in fds:
            os.close(fd)
        sock.send(str(pid).encode())
        sock.recv(16)  # "reap" (or the runner's end): the pid stays ours until the runner has killed it
        _, status = os.waitpid(pid, 0)
        sock.send(str(status).encode())


class Runner:
    """The slot's supervisor: sets up the slot's world once, starts the zygote, and for every run hands the
    zygote a request descriptor and a result pipe, enforces the deadline and cleans up after the run. It
    reads requests and results but never runs, parses or compiles a program, and no program is forked from it.
    """

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
        self._spawn_zygote()
        own_world = bool(cfg.get("setup_mounts"))
        self.protections.update(
            dict.fromkeys(
                ("private_proc", "private_tmp", "readonly_fs", "private_dev", "no_sys", "masked_proc", "hidden_paths"),
                False,
            )
        )
        if own_world:
            self.protections.update(_setup_mounts(cfg, self.notes))
        # After joining the slot's cgroup: /proc/self/cgroup then reads "/" in every slot.
        for key, setup in (
            ("fixed_hostname", _fixed_names),
            ("cgroup_namespace", lambda: _libc_call("unshare", _CLONE_NEWCGROUP)),
        ):
            self.protections[key] = False
            if own_world:
                try:
                    setup()
                    self.protections[key] = True
                except OSError as e:
                    self.notes.append(f"{key}: {e}")
        if self.protections.get("private_tmp"):
            os.mkdir(SANDBOX_WORKDIR, 0o700)
            self.workdirs = {"A": SANDBOX_WORKDIR, "B": SANDBOX_WORKDIR}
        else:
            # The host's /tmp: a directory of our own, and another one for the second run, so that a result
            # that depends on the path fails the determinism check instead of differing between slots.
            import tempfile

            self.workdirs = {role: tempfile.mkdtemp(prefix="populora_exec_") for role in "AB"}
        for path in set(self.workdirs.values()):
            self._fresh_workdir(path, create=False)
        # The programs' user namespace (root runner with a pid namespace and its own /proc to address the helper).
        self.userns_fd = None
        if cfg.get("uid") is not None and self.is_init and self.protections.get("private_proc"):
            try:
                self.userns_fd = _make_user_namespace(cfg["uid"], cfg["gid"])
            except OSError as e:
                self.notes.append(f"user namespace: {e}")
        self.cfg["userns_fd"] = self.userns_fd
        self.protections["user_namespace_limit"] = self.userns_fd is not None
        self.protections["fixed_identity"] = bool(
            self.protections.get("private_tmp") and (self.userns_fd is not None or cfg.get("user_namespace"))
        )
        try:
            _libc_call("prctl", 36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come back to us
        except OSError:
            pass
        self.protections.update(
            {
                "uid_drop": cfg.get("uid") is not None,
                "fork_limit": cfg.get("uid") is not None,
            }
        )
        self._setup_per_call_confinement()
        try:  # a program that keeps our uid can neither read our memory nor borrow our descriptors
            _libc_call("prctl", _PR_SET_DUMPABLE, 0, 0, 0, 0)
            self.protections["runner_not_dumpable"] = True
        except OSError as e:
            self.protections["runner_not_dumpable"] = False
            self.notes.append(f"not dumpable: {e}")
        self._greet_zygote()
        self.unix_sockets = self._count_unix_sockets()

    def _setup_per_call_confinement(self) -> None:
        """What every run inherits or gets after it, set up once here: IPC cleanup, keyrings, no_new_privs.
        Each is reported in ``protections``."""
        # SysV IPC objects a run leaves are removed after it: all of them in our own IPC namespace, the slot
        # uid's otherwise. Without either we cannot tell them from the host's: left alone (reported).
        own_ipc = bool(self.cfg.get("setup_mounts"))
        self.ipc_owner = None if own_ipc else self.cfg.get("uid")
        self.protections["ipc_cleanup_per_call"] = own_ipc or self.ipc_owner is not None
        # Keyrings: our own session keyring, which children inherit, is made read-only to its possessors; the
        # user keyrings of the slot uid are cleared after every run. Without our own uid (or user namespace)
        # the user keyring would be the host user's: left alone (reported).
        own_keyrings = self.cfg.get("uid") is not None or bool(self.cfg.get("user_namespace"))
        self.cfg["keyrings"] = False
        if own_keyrings:
            try:
                serial = _keyctl_ret(_KEYCTL_JOIN_SESSION, 0)
                _keyctl(_KEYCTL_SETPERM, serial, _KEY_POS_VIEW | _KEY_POS_SEARCH)
                self.cfg["keyrings"] = True
            except OSError as e:
                self.notes.append(f"keyrings: {e.strerror or e}")
        self.protections["keyring_isolation"] = self.cfg["keyrings"]
        try:
            _libc_call("prctl", 38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS, inherited: no setuid binary regains root
        except OSError:
            pass

    def _remove_ipc(self) -> None:
        """Remove the SysV shared memory, semaphores and message queues a run left behind."""
        if not self.protections.get("ipc_cleanup_per_call"):
            return
        for kind, id_col, fn in (("shm", "shmid", "shmctl"), ("sem", "semid", "semctl"), ("msg", "msqid", "msgctl")):
            try:
                with open(f"/proc/sysvipc/{kind}") as fh:
                    lines = fh.read().splitlines()
            except OSError:
                continue
            if len(lines) < 2:
                continue
            head = lines[0].split()
            i_id, i_uid = head.index(id_col), head.index("uid")
            for line in lines[1:]:
                cols = line.split()
                if self.ipc_owner is not None and int(cols[i_uid]) != self.ipc_owner:
                    continue
                ident = int(cols[i_id])
                try:  # IPC_RMID = 0; semctl takes a semaphore number first
                    _libc_call(fn, ident, 0, 0) if kind != "sem" else _libc_call(fn, ident, 0, 0, 0)
                except OSError:
                    pass

    def _fresh_workdir(self, path: str, create: bool = True) -> None:
        """A new, empty work directory at the same path: no file, mode or xattr survives a call."""
        if create:
            wipe_dir(path)
            os.rmdir(path)
            os.mkdir(path, 0o700)
        if self.cfg.get("uid") is not None:
            os.chown(path, self.cfg["uid"], self.cfg["gid"])
        os.chmod(path, 0o700)

    def _spawn_zygote(self) -> None:
        """Start the process every program is forked from: a fresh interpreter (an exec, not a fork of this
        runner), with address randomisation off so that it is laid out the same in every slot, executor and
        restart. Started before this runner covers the interpreter's folders (the exec needs them); it waits
        for :meth:`_greet_zygote`, and is told only what is the same for every call: it never sees a request."""
        import socket

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            try:
                os.dup2(theirs.fileno(), ZYGOTE_SOCKET_FD)
                os.closerange(ZYGOTE_SOCKET_FD + 1, 1 << 16)
                os.set_inheritable(ZYGOTE_SOCKET_FD, True)  # dup2 onto itself keeps close-on-exec
                try:
                    _libc.personality(_libc.personality(0xFFFFFFFF) | _ADDR_NO_RANDOMIZE)
                except Exception:  # noqa: BLE001 - the layout is then random, as any process's
                    pass
                os.execve(
                    sys.executable,
                    [sys.executable, "-s", "-S", "-P", "-B", os.path.abspath(__file__), "--zygote"],
                    dict(os.environ),
                )
            finally:
                os._exit(127)
        theirs.close()
        self.zygote, self.zygote_pid = ours, pid
        if ours.recv(16) != b"up":  # loaded before the folders it was loaded from are covered
            raise RuntimeError("the zygote did not start")

    def _greet_zygote(self) -> None:
        import socket

        keys = ("banned", "nproc", "fsize_mb", "uid", "gid", "keyrings")
        setup = {k: self.cfg.get(k) for k in keys}
        setup.update(
            workdirs=self.workdirs,
            namespace_filter=self.cfg.get("namespace_filter", True),
            fresh_namespaces=bool(self.cfg.get("setup_mounts")),
        )
        socket.send_fds(self.zygote, [json.dumps(setup).encode()], [] if self.userns_fd is None else [self.userns_fd])
        hello = self.zygote.recv(1 << 16)
        if not hello:
            raise RuntimeError("the zygote did not start")
        hello = json.loads(hello)
        self.protections.update(hello["protections"])
        self.notes.extend(n for n in hello["notes"] if n not in self.notes)
        self.fresh_pid_ns = bool(hello["protections"].get("pid_namespace_per_run"))

    def _zygote_say(self, msg: bytes, fds: list[int] | None = None) -> bytes:
        """One exchange with the zygote; its silence or death fails the slot (the host restarts it)."""
        import socket

        if fds is None:
            self.zygote.send(msg)
        else:
            socket.send_fds(self.zygote, [msg], fds)
        reply = self.zygote.recv(64)
        if not reply:
            raise RuntimeError("the zygote died")
        return reply

    def _kill_all(self, child: int, pidfd: int) -> int:
        """Kill every process the run left behind; the zygote reaps ``child`` and tells its status."""
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)  # in a run's own pid namespace: all of it
        except ProcessLookupError:
            pass
        if not self.fresh_pid_ns and self.cfg.get("uid") is not None:
            helper = os.fork()
            if helper == 0:  # an unprivileged kill(-1) reaches exactly the processes of the slot uid
                try:
                    os.setresuid(self.cfg["uid"], self.cfg["uid"], self.cfg["uid"])
                    os.kill(-1, signal.SIGKILL)
                finally:
                    os._exit(0)
            os.waitpid(helper, 0)
        elif not self.fresh_pid_ns:
            # Neither a pid namespace nor a uid of the slot's own: by descent. Orphans come back to us (we are a
            # subreaper), so a program that calls setsid stays below us; repeated until a pass finds none.
            for _ in range(100):
                left = process_descendants() - {self.zygote_pid}
                for pid in left:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                if not left:
                    break
                self._reap_orphans()
        status = int(self._zygote_say(b"reap"))
        self._reap_orphans()
        return status

    def _reap_orphans(self) -> None:
        while True:  # orphans of runs without their own pid namespace come back to us (subreaper)
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid == self.zygote_pid:
                raise RuntimeError("the zygote died")

    def _clear_keyrings(self) -> None:
        uid = self.cfg.get("uid")
        if not self.cfg.get("keyrings") or self.userns_fd is not None:
            return  # in the slot's user namespace each child empties its own keyrings first
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
        """One confined process, forked by the zygote, evaluating the request; everything it left behind is
        gone afterwards."""
        request = os.memfd_create("request", os.MFD_CLOEXEC)
        data = json.dumps(dict(req, role=role)).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(request, view) :]
        rfd, wfd = os.pipe()
        try:
            child = int(self._zygote_say(b"run", [request, wfd]))
        finally:
            os.close(request)
            os.close(wfd)
        limit = 8 * int(req["max_output_chars"]) + (1 << 16)
        buf, timed_out, exited = bytearray(), False, False
        pidfd = os.pidfd_open(child)  # the zygote reaps it only when told: the pid cannot be reused before
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
                        watch.remove(rfd)  # all writers gone; wait for the exit
                    buf += chunk
                    if len(buf) > limit or _complete(buf):
                        break  # a lingering grandchild may hold the pipe open: don't wait for EOF
                if pidfd in ready:
                    exited = True
                    os.set_blocking(rfd, False)
                    try:  # whatever the child wrote before exiting
                        while len(buf) <= limit and (chunk := os.read(rfd, 1 << 16)):
                            buf += chunk
                    except BlockingIOError:
                        pass
                    break
            status = self._kill_all(child, pidfd)
        finally:
            os.close(rfd)
            os.close(pidfd)
        if self.fresh_pid_ns and os.WIFEXITED(status) and os.WEXITSTATUS(status) > 128:
            status = os.WEXITSTATUS(status) - 128  # the run's init passes on the program's fatal signal
        self._remove_ipc()
        self._clear_keyrings()
        self._remove_left_in_shared_dirs()
        self._fresh_workdir(self.workdirs[role])
        if self.cfg.get("setup_mounts") and self._count_unix_sockets() != self.unix_sockets:
            # Sockets kept alive by passing each other (no process holds them) outlive every kill: their names
            # would tell the second run what the first chose, and their buffers stay charged to the slot. A
            # fresh slot has none; checked after each run, not each call, so the second run never sees them.
            raise RuntimeError("unix sockets outlived the run")
        return self._interpret(
            buf, timed_out, status if exited else None, deadline, limit, int(req["max_output_chars"])
        )

    def _remove_left_in_shared_dirs(self) -> None:
        """Without a private /tmp the host's world-writable directories are shared by both runs of a call and
        by every call: what the slot's uid left there is removed after each run (a random value written by
        the first run must not reach the second)."""
        uid = self.cfg.get("uid")
        if self.protections.get("private_tmp") or uid is None:
            return
        own = set(self.workdirs.values())
        for top in SHARED_DIRS:
            try:
                entries = list(os.scandir(top))
            except OSError:
                continue
            for entry in entries:
                try:
                    if entry.path in own or entry.stat(follow_symlinks=False).st_uid != uid:
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        wipe_dir(entry.path)
                        os.rmdir(entry.path)
                    else:
                        os.unlink(entry.path)
                except FileNotFoundError:
                    continue

    @staticmethod
    def _count_unix_sockets() -> int | None:
        try:
            with open("/proc/net/unix") as fh:
                return sum(1 for _ in fh)
        except OSError:
            return None

    def run(self, req: dict) -> dict:
        """Both runs of a request: the first (with AZR's in-process double call), then, when it succeeded and
        determinism is checked, a second independent process (shifted heap, other clocks) whose repr must match."""
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
                    first = {
                        "ok": False,
                        "output": None,
                        "error": f"nondeterministic: a second process failed: {second['error']}"[:300],
                    }
            elif second["output"] != first["output"]:
                first = {"ok": False, "output": None, "error": "nondeterministic: two processes gave different results"}
        first["duration_s"] = _now() - start
        return first

    @staticmethod
    def _interpret(buf: bytearray, timed_out: bool, status: int | None, deadline: float, limit: int, cap: int) -> dict:
        """The child's message, treated as untrusted bytes: shape, types and size are checked here."""
        if len(buf) >= _HDR.size:
            n = _HDR.unpack(buf[: _HDR.size])[0]
            if len(buf) >= _HDR.size + n:
                try:
                    res = json.loads(bytes(buf[_HDR.size : _HDR.size + n]))
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
            return {
                "ok": False,
                "output": None,
                "error": f"crashed: exited with code {os.WEXITSTATUS(status)} before returning",
            }
        return {"ok": False, "output": None, "error": "crashed: no result"}

    def serve(self) -> None:
        _write_msg(
            self.ctl_out,
            {
                "ready": True,
                "protections": self.protections,
                "notes": self.notes,
                "workdirs": [] if self.protections.get("private_tmp") else sorted(set(self.workdirs.values())),
            },
        )
        while True:
            msg = _read_msg(self.ctl_in)
            if msg is None:
                return  # host closed the pipe (or died): leave, and the namespace dies with us
            replies, fatal = [], None
            for req in msg["batch"]:
                if fatal is not None:
                    replies.append(
                        {
                            "ok": False,
                            "output": None,
                            "duration_s": 0.0,
                            "error": "crashed: sandbox slot restarted before this request ran",
                        }
                    )
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
    if sys.argv[1:] == ["--zygote"]:
        zygote_main()
        return
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
