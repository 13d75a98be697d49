"""A serving engine's metrics endpoint of the tests' own: vLLM's speculative counters in the exposition
format (written by prometheus_client, as vLLM writes them), /v1/models and /version, on loopback.

Each read of /metrics first adds one interval of traffic: `drafts` verify cycles, each accepting position
i with probability acceptance[i] once it reached it (a seeded binomial chain). A script of events says
what happens at which read: the acceptance drops, the server restarts (its counters begin again), it
goes down, it serves another model, a metric goes missing; and the faults an exporter, a proxy or a liar
produces, one read at a time (`faults`): a counter glitched to a value, a family left out, a label that is no
number, a body cut short, a model list of another shape, counts labelled for a model the server does not
serve, an answer dripped byte by byte, a restart at another depth, a version that flaps.
"""

from __future__ import annotations

import json
import random
import threading
import time
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
    faults: dict = field(default_factory=dict)  # read -> what this read does wrong (see `_faulty`)
    depth_at: tuple[int, int] | None = None  # (read, depth): from that read on, a server restarted at that depth
    flap_versions: tuple[str, ...] = ()  # /version answers these in turn, one per read (a rolling upgrade)
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
                drip = outer.script.faults.get(outer.script.reads, {}).get("drip")
                if drip and self.path.startswith("/metrics"):  # one byte at a time, `drip` seconds apart
                    for i in range(len(body)):
                        try:
                            self.wfile.write(body[i : i + 1])
                            self.wfile.flush()
                        except OSError:
                            return
                        time.sleep(drip)
                    return
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
                if s.reads in s.restart_at or (s.depth_at and s.reads == s.depth_at[0]):
                    self._fresh()
                self._traffic()
                return 200, self._faulty(self._text()), "text/plain; version=0.0.4"
            if s.reads in s.down:
                return 503, b"unavailable", "text/plain"
            if path.startswith("/v1/models"):
                names = ("some-other-model",) if s.other_at is not None and s.reads >= s.other_at else s.served
                data = s.faults.get(s.reads, {}).get("models", [{"id": n} for n in names])
                return 200, json.dumps({"object": "list", "data": data}).encode(), "application/json"
            if path.startswith("/version"):
                later = s.version_at is not None and s.reads >= s.version_at
                version = "0.33.0" if later else s.version
                if s.flap_versions:
                    version = s.flap_versions[s.reads % len(s.flap_versions)]
                return 200, json.dumps({"version": version}).encode(), "application/json"
            return 404, b"not found", "text/plain"

    def _traffic(self) -> None:
        s = self.script
        factor = 1 - s.drop if s.drop_at is not None and s.reads >= s.drop_at else 1.0
        labels = {"engine": "0", "model_name": s.faults.get(s.reads, {}).get("label", s.served[0])}
        acceptance = s.acceptance
        if s.depth_at and s.reads >= s.depth_at[0]:
            acceptance = (acceptance * 4)[: s.depth_at[1]]
        accepted = [0] * len(acceptance)
        for _ in range(s.drafts):
            for i, p in enumerate(acceptance):
                if self.rng.random() >= p * factor:
                    break
                accepted[i] += 1
        self.c_drafts.labels(**labels).inc(s.drafts)
        self.c_tokens.labels(**labels).inc(s.drafts * len(acceptance))
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

    def _faulty(self, text: bytes) -> bytes:
        """This read's exposition as the script's fault for it has it: `value` {metric: v} replaces a counter's
        value on every line of that family ("-1", "1e15", "NaN", "+Inf"), `jump` {metric: x} adds x to it,
        `leave_out` drops a family, `position` relabels position 0, `cut` keeps that many bytes."""
        fault = self.script.faults.get(self.script.reads, {})
        lines = text.decode().splitlines()
        out = []
        for line in lines:
            name = line.split("{", 1)[0].split(" ", 1)[0]
            base = name.removesuffix("_total")
            if not line.startswith("#"):
                for metric, value in fault.get("value", {}).items():
                    if base == metric:
                        line = f"{line.rsplit(' ', 1)[0]} {value}"
                for metric, add in fault.get("jump", {}).items():
                    if base == metric:
                        head, value = line.rsplit(" ", 1)
                        line = f"{head} {float(value) + add!r}"
                if "position" in fault:
                    line = line.replace('position="0"', f'position="{fault["position"]}"')
            if fault.get("leave_out") and fault["leave_out"] in line:
                continue
            out.append(line)
        body = ("\n".join(out) + "\n").encode()
        return body[: fault["cut"]] if "cut" in fault else body

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
