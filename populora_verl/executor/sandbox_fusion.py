"""Remote backend: SandboxFusion's ``run_code`` HTTP API (the service verl's ``sandbox_fusion`` reward uses).

The program and its input are wrapped into a self-contained script that evaluates ``f(<inputs>)`` (twice for
the determinism check), and prints one JSON line behind a per-request marker; the response's
``run_result`` (status, return_code, stdout, stderr) is mapped onto the executor's result. The banned-module
check runs locally before anything is sent.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
import uuid

logger = logging.getLogger(__name__)

_SCRIPT = '''\
import json as _json, sys as _sys
_SRC = {program!r}
_INP = {inputs!r}

def _short(e):
    try:
        m = str(e)
    except BaseException:
        m = "<unprintable>"
    t = type(e).__name__ + (": " + m if m else "")
    return t if len(t) <= 300 else t[:297] + "..."

def _main():
    ns = {{"__name__": "__main__"}}
    try:
        exec(compile(_SRC, "<program>", "exec"), ns)
        if not callable(ns.get("f")):
            return {{"ok": False, "output": None, "error": "NameError: program defines no function f"}}
        call = compile("f(\\n" + _INP + "\\n)", "<input>", "eval")
        first = eval(call, ns)
        text = repr(first)
        if len(text) > {cap}:
            return {{"ok": False, "output": None, "error": "output too large: %d chars > {cap}" % len(text)}}
        if {det}:
            second = eval(call, ns)
            if bool(first != second) or repr(second) != text:
                return {{"ok": False, "output": None, "error": "nondeterministic: two calls gave different results"}}
        return {{"ok": True, "output": text, "error": None}}
    except MemoryError:
        return {{"ok": False, "output": None, "error": "memory: MemoryError (limit exceeded)"}}
    except BaseException as e:
        return {{"ok": False, "output": None, "error": _short(e)}}

_res = _main()
_sys.stdout.write("\\n{marker}" + _json.dumps(_res) + "\\n")
_sys.stdout.flush()
'''


def build_script(program: str, inputs: str, *, check_determinism: bool, max_output_chars: int, marker: str) -> str:
    """The Python source sent to SandboxFusion for one evaluation."""
    return _SCRIPT.format(program=program, inputs=inputs, cap=int(max_output_chars), det=bool(check_determinism),
                          marker=marker)


def parse_response(resp: dict, marker: str, timeout_s: float) -> dict:
    """Map a SandboxFusion ``run_code`` response onto ``{ok, output, error}``."""
    run = resp.get("run_result") or {}
    stdout = run.get("stdout") or ""
    for line in reversed(stdout.splitlines()):
        if line.startswith(marker):
            try:
                res = json.loads(line[len(marker):])
                return {"ok": bool(res["ok"]), "output": res.get("output"), "error": res.get("error")}
            except (ValueError, KeyError, TypeError):
                return {"ok": False, "output": None, "error": "crashed: malformed result from sandbox_fusion"}
    api_status = resp.get("status")
    run_status = run.get("status")
    if run_status == "TimeLimitExceeded":
        return {"ok": False, "output": None, "error": f"timeout: exceeded {timeout_s:g} s (sandbox_fusion)"}
    if api_status == "SandboxError":
        return {"ok": False, "output": None, "error": f"crashed: sandbox_fusion error: {resp.get('message', '')}"[:300]}
    stderr = (run.get("stderr") or "").strip().splitlines()
    tail = stderr[-1] if stderr else ""
    if "MemoryError" in tail:
        return {"ok": False, "output": None, "error": "memory: MemoryError (limit exceeded)"}
    code = run.get("return_code")
    return {"ok": False, "output": None, "error": f"crashed: exited with code {code} before returning {tail}".strip()[:300]}


class SandboxFusionBackend:
    """Sends each evaluation to ``url`` (e.g. ``http://host:8080/run_code``); retries gateway timeouts."""

    name = "sandbox_fusion"

    def __init__(self, url: str, *, num_workers: int, max_retries: int = 3, retry_delay_s: float = 1.0,
                 request_timeout_s: float = 30.0) -> None:
        if not url:
            raise ValueError("sandbox_fusion backend needs a URL (executor.sandbox_fusion_url)")
        self.url = url
        self.num_workers = num_workers
        self.max_retries, self.retry_delay_s, self.request_timeout_s = max_retries, retry_delay_s, request_timeout_s
        self.protections = {"remote_sandbox": True}
        self.notes = [f"programs run remotely at {url}"]

    def _post(self, payload: dict, timeout: float) -> dict:
        data = json.dumps(payload).encode()
        last = "no attempt"
        for attempt in range(self.max_retries):
            req = urllib.request.Request(self.url, data=data, method="POST",
                                         headers={"Content-Type": "application/json", "Accept": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=timeout) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}"
                if e.code not in (502, 503, 504):
                    break
            except (urllib.error.URLError, OSError, ValueError) as e:
                last = str(e)
            if attempt + 1 < self.max_retries:
                time.sleep(self.retry_delay_s * (attempt + 1))
        raise ConnectionError(last)

    def run(self, req: dict) -> dict:
        start = time.monotonic()
        marker = f"@@populora-{uuid.uuid4().hex}@@"
        code = build_script(req["program"], req["inputs"], check_determinism=req["check_determinism"],
                            max_output_chars=req["max_output_chars"], marker=marker)
        timeout = float(req["timeout_s"])
        payload = {"code": code, "stdin": "", "language": "python", "compile_timeout": 10,
                   "run_timeout": max(1, int(round(timeout))), "memory_limit_MB": int(req["memory_mb"]),
                   "files": {}, "fetch_files": []}
        try:
            resp = self._post(payload, timeout + self.request_timeout_s)
            res = parse_response(resp, marker, timeout)
        except ConnectionError as e:
            res = {"ok": False, "output": None, "error": f"crashed: sandbox_fusion request failed: {e}"[:300]}
        res["duration_s"] = time.monotonic() - start
        return res

    def close(self) -> None:
        pass
