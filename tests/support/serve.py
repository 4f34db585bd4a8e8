"""``vllm serve`` on loopback for the tests: start, wait until healthy, ask, stop.

The server is vLLM's own command (the ``vllm`` entry point of this environment, or
``python -m vllm.entrypoints.cli.main``), with its default multi-process engine core, so
the plugin loads through its entry point in the front end and in the engine process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.engine import environment
from vllm_recoverssm.harness.run_engine import engine_environment

STARTUP_SECONDS = 300


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """A running ``vllm serve`` and where its log goes."""

    url: str
    model: str
    log: Path
    process: subprocess.Popen[bytes]

    def log_text(self) -> str:
        """Everything the server printed so far."""
        return self.log.read_text(errors="replace")

    def complete(self, prompt: Sequence[int], max_tokens: int) -> list[int]:
        """Greedy ``/v1/completions`` from token ids; returns the generated token ids."""
        body = {"model": self.model, "prompt": list(prompt), "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        reply = _post(f"{self.url}/v1/completions", body)
        return [int(t) for t in reply["choices"][0]["token_ids"]]

    def complete_all(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
        """All prompts at once (so the engine batches them), results in prompt order."""
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            return list(pool.map(lambda p: self.complete(p, max_tokens), prompts))

    def metrics(self) -> str:
        """The Prometheus text of ``/metrics``."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            return r.read().decode()


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def metric_value(text: str, name: str) -> float:
    """The value of an unlabelled Prometheus sample ``name`` (labels ignored, summed)."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    if not seen:
        raise KeyError(f"no metric {name} in /metrics")
    return total


def metric_label(text: str, name: str, label: str) -> str:
    """A label's value on the first sample of ``name``."""
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels = line[len(name) + 1: line.index("}")]
            for part in labels.split(","):
                key, _, value = part.partition("=")
                if key == label:
                    return value.strip('"')
    raise KeyError(f"no label {label} on {name}")


@contextmanager
def vllm_serve(model: str, args: Sequence[str], log: Path,
               env_overrides: dict[str, str] | None = None,
               module: str = "vllm.entrypoints.cli.main") -> Iterator[Server]:
    """Run ``vllm serve model *args`` on a free loopback port until the block ends
    (``env_overrides``: more environment for the server, e.g. the core OpenMP binds to;
    ``module``: what ``python -m`` runs, vLLM's command line unless a launcher wraps it)."""
    port = free_port()
    env = engine_environment({**environment(), **(env_overrides or {})})
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vllm serve's own engine process
    # vLLM keeps its Prometheus samples in files under this directory and /metrics sums
    # every file there: inherited from a process that ran vLLM before (vLLM sets it in
    # its own environment), it would mix other servers' counters into this one's.
    env["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="prometheus-", dir=log.parent)
    command = [sys.executable, "-m", module, "serve", model,
               "--host", "127.0.0.1", "--port", str(port), *args]
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    server = Server(url=f"http://127.0.0.1:{port}", model=model, log=log, process=proc)
    try:
        _wait_healthy(server)
        yield server
    finally:
        _stop(proc)


def _wait_healthy(server: Server) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"vllm serve exited ({server.process.returncode}):\n"
                               + "\n".join(server.log_text().splitlines()[-40:]))
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise RuntimeError("vllm serve was not healthy in time:\n"
                       + "\n".join(server.log_text().splitlines()[-40:]))


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
