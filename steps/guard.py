"""`guard`: a small service that MLflow's registry webhooks call; it reverts any move of `staging` or
`production` that no `promote` decision accounts for (the UI's alias pencil, a plain API client).

    python -m steps.guard --port 8765              # serve on 127.0.0.1:8765
    python -m steps.guard --install --port 8765    # register the webhook on $MLFLOW_TRACKING_URI

Both read the shared secret from DRAFTEROPS_WEBHOOK_SECRET. Payloads are verified (HMAC, freshness)
before anything is read from them; a bad one is answered 401/400 and the service carries on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from drafter.errors import BadInput
from steps._cli import parser, run_step

SECRET_ENV = "DRAFTEROPS_WEBHOOK_SECRET"
WEBHOOK_NAME = "drafterops-guard"
MAX_BODY = 1 << 20


def build() -> argparse.ArgumentParser:
    p = parser("guard", __doc__)
    p.add_argument("--port", default="8765", help="loopback port the guard listens on")
    p.add_argument("--install", action="store_true", help="register the webhook on the tracking server, then exit")
    return p


def _secret() -> str:
    secret = os.environ.get(SECRET_ENV, "")
    if len(secret) < 16:
        raise BadInput(f"{SECRET_ENV} must hold a shared secret of at least 16 characters")
    return secret


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise BadInput(f"--port must be an integer, got {value!r}") from None
    if not 1 <= port <= 65535:
        raise BadInput(f"--port must be in 1..65535, got {port}")
    return port


def install(port: int, secret: str) -> str:
    """Create (or update) the guard's webhook on the tracking server; returns its id."""
    from registry import guard, naming, store

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
    from registry import guard, store

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            size = int(self.headers.get("Content-Length") or 0)
            if not 0 < size <= MAX_BODY:
                return self._answer(400, "bad length")
            body = self.rfile.read(size)
            if not guard.signature_ok(secret, dict(self.headers.items()), body):
                return self._answer(401, "bad signature")
            try:
                move = guard.parse_event(json.loads(body))
            except (ValueError, BadInput) as exc:
                return self._answer(400, f"bad payload: {exc}")
            if move is None:
                return self._answer(200, "not a serving alias")
            try:
                done = guard.enforce(store.client(), move, self.headers.get(guard.DELIVERY_HEADER, ""))
            except Exception as exc:  # the registry was unreachable: say so, keep serving
                print(f"guard: could not check {move}: {exc.__class__.__name__}: {exc}", file=sys.stderr, flush=True)
                return self._answer(503, "registry unavailable")
            if done:
                print(f"guard: {move.name}: {done}", flush=True)
            return self._answer(200, done or "sanctioned")

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


def run(args: argparse.Namespace) -> int:
    port, secret = _port(args.port), _secret()
    if args.install:
        hook = install(port, secret)
        print(f"guard: webhook {hook} on {os.environ['MLFLOW_TRACKING_URI']} -> http://127.0.0.1:{port}/")
        return 0
    try:
        server = ThreadingHTTPServer(("127.0.0.1", port), handler_for(secret))
    except OSError as exc:
        raise BadInput(f"--port {port}: cannot listen on 127.0.0.1 ({exc.strerror})") from None
    print(f"guard: serving on http://127.0.0.1:{port}/ for {os.environ['MLFLOW_TRACKING_URI']}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


def main(argv: list[str] | None = None) -> None:
    run_step("guard", build, run, argv)


if __name__ == "__main__":
    main()
