"""The server side of ``_shared.ForkServer``: an interpreter that has run a prelude once (``import verl``: seconds on
one core) and forks a child per program that begins with that prelude; the child runs the rest of the program.

Not a test module, and it imports nothing that a fresh ``python -c`` has not imported before its first line (os, sys
and marshal are loaded at every interpreter's start), so that what the prelude leaves is what a fresh interpreter's
run of it leaves. The child of a program ``prelude + rest`` is where ``python -c "prelude + rest"`` in the same folder
and environment would be once the prelude has run:

* ``__main__`` holds what the prelude defined and nothing of the server's; ``sys.argv`` is ``['-c']``; the server's
  folder is neither on ``sys.path`` nor in ``sys.path_importer_cache``, this module is not in ``sys.modules``;
* the rest of the program is compiled as ``<string>`` after as many blank lines as the prelude has, so a traceback
  names the lines a fresh run would name;
* its environment is the program's (the client forks only where it equals the server's, but for pytest's
  PYTEST_CURRENT_TEST); ``random`` (and numpy's global generator), where imported, are seeded afresh, as each fresh
  interpreter seeds its own;
* stdin is ``/dev/null``; stdout and stderr are files the client reads, to which it prepends what the prelude wrote
  to them (captured once, in files of its own; what ``sys.stdout`` and ``sys.stderr`` had not written yet when the
  prelude ended, the child writes or loses with its own output);
* it ends as ``python -c`` ends: an uncaught exception is printed by ``sys.excepthook`` from the program's frame on
  and exits 1, ``SystemExit`` as the interpreter handles it, then the non-daemon threads are joined, the ``atexit``
  functions run and the streams are flushed.

What it shares with its siblings is what a fork cannot renew: the seed of ``str`` hashing (each fresh interpreter
draws its own unless PYTHONHASHSEED is set; no check may rest on the order of a set of strings either way).

A prelude that leaves a second Python thread running is not forked from: a fork has only the thread that forked. The
server then says it is not ready, and the client runs fresh interpreters. Threads below Python are not counted: those
there are after ``import verl`` are OpenBLAS's pool, started when numpy is imported, which OpenBLAS shuts down
before a fork and starts again when the child next needs it (its ``pthread_atfork`` handlers), as in any fork of
``multiprocessing``.

Protocol (on the server's stdin and stdout, which no child and no prelude ever sees): a message is 8 bytes of length
and that many bytes of ``marshal``. The server sends ``{"ready": True}`` once the prelude has run (or ``{"ready":
False, "why": ...}`` and ends); for each request ``{"code": rest, "env": {...}, "stdout": path, "stderr": path}`` it
forks, waits for the child and sends ``{"rc": n}`` (the returncode as ``subprocess`` gives it). One program at a time;
the server ends on ``{"quit": True}`` or at the end of its stdin.
"""

import marshal
import os
import sys

_KEEP_IN_MAIN = {"__name__", "__doc__", "__package__", "__loader__", "__spec__", "__annotations__", "__builtins__"}


def send(fd: int, obj) -> None:
    data = marshal.dumps(obj)
    data = len(data).to_bytes(8, "little") + data
    while data:
        data = data[os.write(fd, data) :]


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def receive(fd: int):
    """The next message on ``fd``; None at its end."""
    head = _read_exact(fd, 8)
    if head is None:
        return None
    body = _read_exact(fd, int.from_bytes(head, "little"))
    return None if body is None else marshal.loads(body)


def _redirect(fd: int, path: str) -> None:
    f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(f, fd)
    os.close(f)


def _exit_code(exc: SystemExit) -> int:
    """What the interpreter makes of ``SystemExit(code)`` (a code that is no integer is printed, and exits 1)."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _run_child(req: dict, main_ns: dict, offset: int) -> None:
    """In the forked child: the program's streams and environment, the rest of the program, and the end of
    ``python -c``. Never returns."""
    rc = 1
    try:
        _redirect(1, req["stdout"])
        _redirect(2, req["stderr"])
        os.environ.clear()
        os.environ.update(req["env"])
        for name in ("random", "numpy.random"):  # each fresh interpreter seeds its own from the OS
            module = sys.modules.get(name)
            if module is not None:
                module.seed()
        try:
            exec(compile("\n" * offset + req["code"], "<string>", "exec"), main_ns)
            rc = 0
        except SystemExit as e:
            rc = _exit_code(e)
        except BaseException:
            etype, value, tb = sys.exc_info()
            # from the program's frame on, this function's left out (what is printed is the exception's own)
            sys.excepthook(etype, value.with_traceback(tb.tb_next), tb.tb_next)
            rc = 1
        threading = sys.modules.get("threading")
        if threading is not None:
            threading._shutdown()  # the interpreter's end: wait for the non-daemon threads
        import atexit  # built in, and imported at start-up by every interpreter that registered a function

        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
    finally:
        os._exit(rc)


def serve(prelude: str, own_dir: str, prelude_stdout: str, prelude_stderr: str) -> None:
    """Run ``prelude`` in ``__main__`` with its output in ``prelude_stdout`` and ``prelude_stderr``, then fork a child
    for each request."""
    main = sys.modules["__main__"]
    for name in [n for n in vars(main) if n not in _KEEP_IN_MAIN]:
        delattr(main, name)
    while own_dir in sys.path:
        sys.path.remove(own_dir)
    sys.path_importer_cache.pop(own_dir, None)
    sys.modules.pop(__name__, None)

    # the protocol keeps the original stdin and stdout; the prelude and the children get /dev/null and files
    requests, replies, log = os.dup(0), os.dup(1), os.dup(2)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    _redirect(1, prelude_stdout)
    _redirect(2, prelude_stderr)
    main_ns = vars(main)
    try:
        exec(compile(prelude, "<string>", "exec"), main_ns)
    except BaseException as e:
        send(replies, {"ready": False, "why": f"the prelude raised {type(e).__name__}: {e}"})
        return
    finally:
        # What the prelude wrote is in the files, but for what sys.stdout and sys.stderr still buffer: that stays
        # in their buffers, for each child to write where it writes (or lose, where it is killed), as a fresh
        # interpreter would. The server writes nothing of its own there.
        os.dup2(null, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
    threading = sys.modules.get("threading")
    threads = threading.active_count() if threading is not None else 1
    if threads != 1:
        send(replies, {"ready": False, "why": f"{threads} Python threads after the prelude"})
        return
    offset = prelude.count("\n")
    send(replies, {"ready": True})
    while (req := receive(requests)) is not None and "code" in req:
        pid = os.fork()
        if pid == 0:
            os.close(requests)
            os.close(replies)
            _run_child(req, main_ns, offset)
        _, status = os.waitpid(pid, 0)
        send(replies, {"rc": os.waitstatus_to_exitcode(status)})
