"""A serving engine's metrics endpoint of the tests' own: vLLM's speculative counters in the exposition
format (written by prometheus_client, as vLLM writes them), /v1/models and /version, on loopback.

Each read of /metrics first adds one interval of traffic: `drafts` verify cycles, each accepting position
i with probability acceptance[i] once it reached it (a seeded binomial chain). A script of events says
what happens at which read: the acceptance drops, the server restarts (its counters begin again), it
goes down, it serves another model, a metric goes missing.
"""

from __future__ import annotations

import json
import random
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


@dataclass
class Script:
    served: tuple[str, ...]  # the names /v1/models lists
    acceptance: tuple[float, ...] = (0.8, 0.7, 0.6)
    drafts: int = 5000
    version: str = "0.32.0"
    drop_at: int | None = None  # from this read on, every position's acceptance times (1 - drop)
    drop: float = 0.0
    restart_at: tuple[int, ...] = ()  # reads at which the counters begin again
    down: tuple[int, ...] = ()  # reads answered 503
    other_at: int | None = None  # from this read on, another model is served
    missing_at: int | None = None  # from this read on, no per-position counter
    version_at: int | None = None  # from this read on, another engine version
    running: float = 2.0
    seed: int = 0
    reads: int = 0
    totals: dict = field(default_factory=dict)


class EngineMetrics:
    """The endpoint, serving `script` until closed."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.rng = random.Random(script.seed)
        self.lock = threading.Lock()
        self._fresh()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # noqa: ANN002
                pass

            def do_GET(self) -> None:  # noqa: N802
                status, body, kind = outer.answer(self.path)
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _fresh(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["engine", "model_name"]
        self.c_drafts = Counter("vllm:spec_decode_num_drafts", "drafts", labels, registry=self.registry)
        self.c_tokens = Counter("vllm:spec_decode_num_draft_tokens", "draft tokens", labels, registry=self.registry)
        self.c_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "accepted", labels, registry=self.registry)
        self.c_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "accepted at a position",
                             [*labels, "position"], registry=self.registry)  # fmt: skip
        self.g_running = Gauge("vllm:num_requests_running", "running", labels, registry=self.registry)

    def answer(self, path: str) -> tuple[int, bytes, str]:
        s = self.script
        with self.lock:
            if path.startswith("/metrics"):
                s.reads += 1
                if s.reads in s.down:
                    return 503, b"unavailable", "text/plain"
                if s.reads in s.restart_at:
                    self._fresh()
                self._traffic()
                return 200, self._text(), "text/plain; version=0.0.4"
            if s.reads in s.down:
                return 503, b"unavailable", "text/plain"
            if path.startswith("/v1/models"):
                names = ("some-other-model",) if s.other_at is not None and s.reads >= s.other_at else s.served
                return (
                    200,
                    json.dumps({"object": "list", "data": [{"id": n} for n in names]}).encode(),
                    "application/json",
                )
            if path.startswith("/version"):
                later = s.version_at is not None and s.reads >= s.version_at
                return 200, json.dumps({"version": "0.33.0" if later else s.version}).encode(), "application/json"
            return 404, b"not found", "text/plain"

    def _traffic(self) -> None:
        s = self.script
        factor = 1 - s.drop if s.drop_at is not None and s.reads >= s.drop_at else 1.0
        labels = {"engine": "0", "model_name": s.served[0]}
        accepted = [0] * len(s.acceptance)
        for _ in range(s.drafts):
            for i, p in enumerate(s.acceptance):
                if self.rng.random() >= p * factor:
                    break
                accepted[i] += 1
        self.c_drafts.labels(**labels).inc(s.drafts)
        self.c_tokens.labels(**labels).inc(s.drafts * len(s.acceptance))
        self.c_accepted.labels(**labels).inc(sum(accepted))
        if s.missing_at is None or s.reads < s.missing_at:
            for i, a in enumerate(accepted):
                self.c_pos.labels(**labels, position=str(i)).inc(a)
        self.g_running.labels(**labels).set(s.running)

    def _text(self) -> bytes:
        text = generate_latest(self.registry).decode()
        s = self.script
        if s.missing_at is not None and s.reads >= s.missing_at:
            text = "\n".join(line for line in text.splitlines() if "per_pos" not in line) + "\n"
        return text.encode()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
