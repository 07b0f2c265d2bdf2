"""llama.cpp's HTTP server (``llama-server``) with continuous batching as a leg of bench_generate.py.

A peer, never a dependency of dfllm: the binary is built from the llama.cpp source tree that
the llama-cpp-python sdist vendors (``benchmarks/peers/README.md`` has the commands), and this
module only speaks HTTP to it, with the standard library.

One server per GGUF file, started once (``-np SLOTS -cb``: that many slots, continuous
batching; ``-c`` = slots x the context one slot needs; ``-t``/``-tb`` the benchmark's threads;
``--cache-ram 0``: no host-memory prompt cache, so a timed run never reuses a previous run's
prompts, as dfllm's prefix cache is reset before each) on 127.0.0.1 at a free port, and waited
for until ``/health`` answers 200. A timed run posts every prompt to ``/completion`` from a
pool of SLOTS threads (``prompt`` = the token ids, ``n_predict`` = the row's ``max_tokens``,
greedy: ``temperature`` 0 and ``top_k`` 1, ``cache_prompt`` false, ``ignore_eos`` when forced,
``return_tokens`` so that the generated ids come back), timed from the first post to the last
reply. A row that stopped at an end-of-sequence token (``stop_type`` ``eos``) keeps that token
as its last id (appended when the server left it out), as the other legs count it.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

README = "benchmarks/peers/README.md"


def _die_with_parent() -> None:
    """In the server's process before exec (Linux): SIGTERM when the benchmark dies, even
    killed before its atexit handlers could stop the server."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServerLeg:
    """One ``llama-server`` process on one GGUF file, kept running between timed runs.

    ``leg(prompts, max_tokens, mode)`` returns the seconds from the first post to the last
    reply and each row's generated token ids (with the EOS a row stopped at); ``close()``
    stops the server (also done at interpreter exit)."""

    def __init__(
        self,
        server: str | Path,
        gguf: str | Path,
        threads: int,
        ctx_per_slot: int,
        eos_ids: set[int],
        slots: int = 32,
        startup_timeout: float = 600.0,
    ):
        self.server, self.gguf, self.slots = Path(server), Path(gguf), slots
        self.eos_ids, self.eos = set(eos_ids), min(eos_ids)
        if not self.server.is_file():
            raise FileNotFoundError(f"--llama-server: no file {self.server} (build it: {README})")
        if not self.gguf.is_file():
            raise FileNotFoundError(f"--llama-server-gguf: no file {self.gguf}")
        self.ctx_per_slot = ctx_per_slot
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            str(self.server),
            "-m",
            str(self.gguf),
            "-np",
            str(slots),
            "-cb",
            "-c",
            str(slots * ctx_per_slot),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--cache-ram",
            "0",
            "--no-webui",
        ]
        self.log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = subprocess.Popen(
            self.cmd, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
        )
        atexit.register(self.close)
        try:
            self._wait_ready(startup_timeout)
            props = self._get("/props")
        except BaseException:
            self.close()
            raise
        self.build_info = str(props.get("build_info", "?"))
        self.n_ctx_slot = props.get("default_generation_settings", {}).get("n_ctx")

    # ---- HTTP ----
    def _get(self, path: str, timeout: float = 10.0) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return json.loads(r.read())

    def _post(self, path: str, body: dict, timeout: float = 3600.0) -> dict:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"llama-server {path} answered {e.code}: {e.read()[:500]!r}") from e

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's log (stdout and stderr)."""
        try:
            return Path(self.log.name).read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited ({self.proc.returncode}) before it was ready: "
                    f"{' '.join(self.cmd)}\n{self.log_tail()}"
                )
            try:
                if self._get("/health", timeout=2.0).get("status") == "ok":
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
                pass  # not listening yet (connection refused) or still loading (503)
            time.sleep(0.2)
        raise RuntimeError(f"llama-server not ready after {timeout:.0f} s: {' '.join(self.cmd)}\n{self.log_tail()}")

    # ---- one timed run ----
    def _complete(self, ids: list[int], n: int, forced: bool) -> dict:
        return self._post(
            "/completion",
            {
                "prompt": ids,
                "n_predict": n,
                "temperature": 0.0,
                "top_k": 1,
                "cache_prompt": False,
                "ignore_eos": forced,
                "return_tokens": True,
                "stream": False,
                "response_fields": ["tokens", "stop_type", "tokens_predicted", "tokens_evaluated", "truncated"],
            },
        )

    def __call__(self, prompts: list[list[int]], max_tokens: list[int], mode: str) -> tuple[float, list[list[int]]]:
        """Seconds from the first post to the last reply, and each row's generated ids."""
        forced = mode == "forced"
        for i, (ids, n) in enumerate(zip(prompts, max_tokens)):
            if len(ids) + n + 1 > self.ctx_per_slot:
                raise ValueError(
                    f"row {i}: {len(ids)} prompt tokens + max_tokens {n} do not fit a slot's "
                    f"context of {self.ctx_per_slot} tokens"
                )
        with ThreadPoolExecutor(self.slots) as pool:
            start = time.perf_counter()
            replies = list(pool.map(self._complete, prompts, max_tokens, [forced] * len(prompts)))
            seconds = time.perf_counter() - start
        rows = []
        for i, (reply, n) in enumerate(zip(replies, max_tokens)):
            tokens = [int(t) for t in reply["tokens"]]
            if reply.get("stop_type") == "eos" and not (tokens and tokens[-1] in self.eos_ids):
                tokens.append(self.eos)  # the server stopped at an EOS it left out of the ids
            if reply.get("truncated"):
                raise RuntimeError(f"llama-server truncated row {i} (context {self.n_ctx_slot} a slot)")
            if forced and len(tokens) != n:
                raise RuntimeError(
                    f"llama-server generated {len(tokens)} tokens for row {i}, not its max_tokens {n} "
                    f"(stop_type {reply.get('stop_type')})"
                )
            rows.append(tokens)
        return seconds, rows

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 30 s); idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc is not None:
            self.log.close()
            Path(self.log.name).unlink(missing_ok=True)


def context_per_slot(prompts: list[list[int]], max_tokens: list[int], margin: int = 16, multiple: int = 256) -> int:
    """A slot's context for the longest prompt + max_tokens of a workload, rounded up."""
    longest = max(len(ids) + n for ids, n in zip(prompts, max_tokens)) + margin
    return -(-longest // multiple) * multiple


def start_legs(
    server: str | None,
    ggufs: list[str],
    weights,
    threads: int,
    prompts: list[list[int]],
    max_tokens: list[int],
    eos_ids: set[int],
    slots: int = 32,
) -> tuple[list[tuple[str, LlamaServerLeg]], str]:
    """One started server per GGUF as ``(name, leg)`` pairs (``llama-server (F16)``; numbered,
    ``llama-server (Q4_1 #2)``, where files give the same weight format), or none, and a note to print.
    ``weights(path)`` names a file's weight format; ``prompts``/``max_tokens`` size the slots."""
    if not server or not ggufs:
        return [], (
            f"llama-server legs skipped: pass --llama-server PATH and --llama-server-gguf PATH... "
            f"(build llama-server and make the GGUFs: {README})"
        )
    formats = [weights(g) for g in ggufs]
    names = [
        f"llama-server ({f})" if formats.count(f) == 1 else f"llama-server ({f} #{formats[: i + 1].count(f)})"
        for i, f in enumerate(formats)
    ]
    ctx = context_per_slot(prompts, max_tokens)
    legs: list[tuple[str, LlamaServerLeg]] = []
    try:
        for name, gguf in zip(names, ggufs):
            legs.append((name, LlamaServerLeg(server, gguf, threads, ctx, eos_ids, slots)))
    except BaseException:
        for _, leg in legs:
            leg.close()
        raise
    build = legs[0][1].build_info
    files = ", ".join(f"{name[len('llama-server ') :]} {g}" for name, g in zip(names, ggufs))
    return legs, (
        f"llama-server {build}, -np {slots} -cb, {ctx} tokens a slot, {threads} threads, one server per GGUF: {files}"
    )
