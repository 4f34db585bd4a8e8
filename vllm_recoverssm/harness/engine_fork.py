"""Engine processes forked from a server that has already imported torch and vLLM.

Every engine of ``recoverssm demo --engine vllm`` and of the engine tests runs in a process
of its own: vLLM's CPU platform holds one engine per process. Started with ``python -m``,
such a process spends most of its start-up importing torch and vLLM, then more in the full
garbage collections vLLM asks for while it sizes memory, each of which walks every object
those imports made. Here one server process imports them once
(:data:`PRELOAD`, :data:`.vllm_engine.ENGINE_PRELOAD`) and forks a process per request,
which calls the function the request names (``"module:function"``). The fork
freezes the inherited objects out of the collector's reach, takes the request's
environment and working directory, and writes its stdout and stderr to a log file. The
server is single-threaded and never builds an engine, so each fork starts from the state
a fresh process reaches after the same imports.

``python -m vllm_recoverssm.harness.engine_fork`` is the server: it reads one JSON
request per line on stdin and answers on stdout with ``{"id", "pid"}`` when it forks and
``{"id", "code"}`` when the fork exits; it exits when stdin closes.

``RECOVERSSM_ENGINE_FORK=0`` starts each engine with ``python -m`` instead; so does a run
whose environment differs from the server's in a variable read at import time
(:data:`IMPORT_TIME_ENV`).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

DISABLE_ENV = "RECOVERSSM_ENGINE_FORK"
"""Set to ``0`` to start every engine with ``python -m`` (a fresh interpreter)."""
IMPORT_TIME_ENV = ("PYTHONPATH", "TRITON_INTERPRET", "VLLM_CONFIGURE_LOGGING",
                   "VLLM_LOGGING_LEVEL", "VLLM_LOGGING_CONFIG_PATH", "VLLM_LOGGING_PREFIX",
                   "VLLM_BATCH_INVARIANT", "VLLM_USE_MODELSCOPE", "PYTHONHASHSEED")
"""Variables read once, at import (or interpreter start): the server's values hold in
every fork, so a request must agree with them."""
MODULE = "vllm_recoverssm.harness.engine_fork"
PRELOAD = ("vllm_recoverssm.harness.run_engine", "vllm_recoverssm.vllm_plugin.models")
"""This package's modules the server imports, besides vLLM's
(:data:`.vllm_engine.ENGINE_PRELOAD`)."""
_NOT_FORKED = -(1 << 30)


class _Client:
    """The parent's side: one server, the requests in flight, a thread reading answers."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = {k: env.get(k) for k in IMPORT_TIME_ENV}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", MODULE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, env=env, text=True, bufsize=1)
        self.lock = threading.Lock()
        self.next_id = 0
        self.pids: dict[int, int] = {}
        self.codes: dict[int, int] = {}
        self.events: dict[int, threading.Event] = {}
        self.alive = True
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.lock:
                if "pid" in msg:
                    self.pids[msg["id"]] = msg["pid"]
                else:
                    self.codes[msg["id"]] = msg["code"]
                    self.events[msg["id"]].set()
        with self.lock:  # the server is gone: nothing in flight will answer
            self.alive = False
            for rid, event in self.events.items():
                # a request it forked: that fork's fate is unknown; one it did not fork:
                # none (the caller starts a fresh process, which shows the real error)
                self.codes.setdefault(rid, -1 if rid in self.pids else _NOT_FORKED)
                event.set()

    def run(self, target: str, argv: list[str], env: dict[str, str], log_path: Path,
            timeout: float) -> int | None:
        with self.lock:
            if not self.alive:
                return None
            rid = self.next_id
            self.next_id += 1
            event = self.events[rid] = threading.Event()
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write(json.dumps({"id": rid, "target": target, "argv": argv,
                                                  "env": env,
                                                  "log": str(log_path),
                                                  "cwd": os.getcwd()}) + "\n")
                self.proc.stdin.flush()
            except OSError:  # the server exited since the last answer
                self.alive = False
                del self.events[rid]
                return None
        try:
            if not event.wait(timeout):
                with self.lock:
                    pid = self.pids.get(rid)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                if not event.wait(60):
                    raise RuntimeError(f"engine fork {argv}: still running after SIGKILL")
                raise subprocess.TimeoutExpired(f"engine fork {argv}", timeout)
            with self.lock:
                code = self.codes[rid]
            return None if code == _NOT_FORKED else code
        finally:
            with self.lock:
                del self.events[rid]
                self.codes.pop(rid, None)
                self.pids.pop(rid, None)


_lock = threading.Lock()
_clients: list[_Client] = []


def _client(env: dict[str, str]) -> _Client | None:
    """The server for ``env``'s import-time variables (started on first use), or None."""
    if os.environ.get(DISABLE_ENV) == "0" or env.get(DISABLE_ENV) == "0":
        return None
    if not hasattr(os, "fork"):
        return None
    with _lock:
        if not _clients or not _clients[0].alive:
            _clients[:] = [_Client(env)]
        client = _clients[0]
    if any(env.get(k) != v for k, v in client.env.items()):
        return None
    return client


def run_forked(target: str, argv: list[str], env: dict[str, str], log_path: Path,
               timeout: float) -> int | None:
    """Run ``target`` (``"module:function"``, called with ``argv``) in a fork of the
    server, with environment ``env`` and its stdout and stderr in ``log_path``; returns
    its exit code, or None where no fork applies or the server exited before forking it
    (the caller then starts a fresh process).

    Raises ``subprocess.TimeoutExpired`` (after killing the fork) past ``timeout`` seconds.
    """
    client = _client(env)
    if client is None:
        return None
    return client.run(target, argv, env, log_path, timeout)


# -- the server ------------------------------------------------------------------------

def _fork_engine(request: dict[str, Any], answers_fd: int) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.close(answers_fd)  # the parent sees the server's end only
        gc.freeze()  # the imports' objects live as long as the process
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.close(null)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        module, _, function = request["target"].partition(":")
        code = getattr(importlib.import_module(module), function)(request["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported in the log, like an uncaught error
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _answer(out: IO[str], msg: dict[str, int]) -> None:
    out.write(json.dumps(msg) + "\n")
    out.flush()


def serve(preload: tuple[str, ...]) -> None:
    """Import ``preload``, then fork one engine per request line until stdin closes."""
    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError:  # a module this vLLM version lacks
            pass
    answers = os.fdopen(os.dup(1), "w")
    running: dict[int, int] = {}  # pid -> request id
    stdin_open = True
    buffer = ""
    while stdin_open or running:
        ready = select.select([0], [], [], 0.1)[0] if stdin_open else []
        if ready:
            chunk = os.read(0, 1 << 16).decode()
            if not chunk:
                stdin_open = False
            buffer += chunk
            while "\n" in buffer:
                line, buffer = buffer.split("\n", 1)
                request = json.loads(line)
                pid = _fork_engine(request, answers.fileno())
                running[pid] = request["id"]
                _answer(answers, {"id": request["id"], "pid": pid})
        elif not stdin_open:
            select.select([], [], [], 0.1)
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            _answer(answers, {"id": running.pop(pid), "code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    from .vllm_engine import ENGINE_PRELOAD

    serve(PRELOAD + ENGINE_PRELOAD)
