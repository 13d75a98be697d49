"""The guard as a service: its webhook receiver on loopback (the body bounded and read with a timeout, the
signature checked, each delivery one model's reconciliation), the webhook's installation on the tracking
server, and the rounds that reconcile the whole registry on a timer. The rule it keeps is registry/ledger/guard.py."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler

from common.errors import BadInput
from registry.access import naming, store
from registry.access.naming import tracking_uri
from registry.ledger import guard
from registry.ledger.reconcile import reconcile, reconcile_model

WEBHOOK_NAME = "drafterops-guard"
MAX_BODY = 1 << 20
READ_TIMEOUT_S = 10  # a client that promises more body than it sends is cut off after this


def install(port: int, secret: str) -> str:
    """Create (or update) the guard's webhook on the tracking server; returns its id."""
    if not naming.tracking_uri().startswith(("http://", "https://")):
        raise BadInput("webhooks need a tracking server: set MLFLOW_TRACKING_URI=http://host:port")
    c = store.client()
    url = f"http://127.0.0.1:{port}/"
    for hook in c.list_webhooks():
        if hook.name == WEBHOOK_NAME:
            c.update_webhook(hook.webhook_id, url=url, events=list(guard.EVENTS), secret=secret, status="ACTIVE")
            return hook.webhook_id
    return c.create_webhook(
        WEBHOOK_NAME, url, list(guard.EVENTS), description="drafterops guard", secret=secret
    ).webhook_id


def handler_for(secret: str):
    class Handler(BaseHTTPRequestHandler):
        timeout = READ_TIMEOUT_S  # applied to the connection's socket: no thread waits forever on a body

        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            try:
                size = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                size = -1
            if not 0 < size <= MAX_BODY:
                return self._answer(400, "bad length")
            try:
                body = self.rfile.read(size)
            except TimeoutError:
                self.close_connection = True
                return None
            if len(body) != size:
                return self._answer(400, "short body")
            if not guard.signature_ok(secret, self.headers.items(), body):
                return self._answer(401, "bad signature")
            try:
                move = guard.parse_event(json.loads(body))
            except (ValueError, BadInput) as exc:
                return self._answer(400, f"bad payload: {exc}")
            if move is None:
                return self._answer(200, "not a serving alias")
            delivery = guard.header(self.headers.items(), guard.DELIVERY_HEADER)
            try:
                done = reconcile_model(store.client(), move.name, f"webhook delivery {delivery}")
            except Exception as exc:  # the registry was unreachable: say so, keep serving
                print(f"guard: could not check {move}: {exc.__class__.__name__}: {exc}", file=sys.stderr, flush=True)
                return self._answer(503, "registry unavailable")
            for line in done:
                print(f"guard: {line}", flush=True)
            return self._answer(200, "; ".join(done) or "sanctioned")

        def _answer(self, code: int, text: str) -> None:
            data = text.encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:  # the decisions are printed and audited; no access log
            return

    return Handler


def reconcile_once(why: str) -> int:
    done = reconcile(store.client(), why)
    for line in done:
        print(f"guard: {line}", flush=True)
    print(f"guard: reconciled {tracking_uri()} ({len(done)} action{'s' if len(done) != 1 else ''})", flush=True)
    return len(done)


def guarded_round(why: str) -> None:
    """One reconciliation while serving; a registry that does not answer is said, and tried next round."""
    try:
        reconcile_once(why)
    except Exception as exc:  # keep guarding: the next round may reach it
        print(f"guard: reconciliation failed: {exc.__class__.__name__}: {exc}", file=sys.stderr, flush=True)


def every(seconds: float, stop: threading.Event) -> None:
    while not stop.wait(seconds):
        guarded_round("the guard's timer")
