"""`guard`: keeps `staging` and `production` (aliases and legacy stages) where a signed `promote`
decision put them. As a service, MLflow's registry webhooks call it; it also reconciles the whole
registry on start and every --interval seconds, so nothing done while it was down, and no move that
raises no event, stays.

    python -m steps.guard --port 8765              # serve on 127.0.0.1:8765
    python -m steps.guard --install --port 8765    # register the webhook on $MLFLOW_TRACKING_URI
    python -m steps.guard --reconcile              # reconcile once and exit (cron, CI; any store)

The service and --install read the shared webhook secret from DRAFTEROPS_WEBHOOK_SECRET. Payloads are
verified (HMAC, freshness; header names in any case) before anything is read from them; a bad one is
answered 401/400, a slow or oversized one cut off, and the service carries on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from common.errors import BadInput
from registry.access.naming import tracking_uri
from steps._cli import run_step
from steps._params import Param, Spec

SECRET_ENV = "DRAFTEROPS_WEBHOOK_SECRET"
WEBHOOK_NAME = "drafterops-guard"
MAX_BODY = 1 << 20
READ_TIMEOUT_S = 10  # a client that promises more body than it sends is cut off after this


SPEC = Spec(
    "guard",
    __doc__,
    (
        Param("port", default="8765", help="loopback port the guard listens on"),
        Param("install", help="register the webhook on the tracking server, then exit", flag=True, cli=True),
        Param("reconcile", help="reconcile the registry once, then exit (no server)", flag=True, cli=True),
        Param("interval", default="60", help="seconds between reconciliations while serving", cli=True),
    ),
)


def build() -> argparse.ArgumentParser:
    return SPEC.parser()


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
    from registry.access import naming, store
    from registry.ledger import guard

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
    from registry.access import store
    from registry.ledger import guard
    from registry.ledger.reconcile import reconcile_model

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
    from registry.access import store
    from registry.ledger.reconcile import reconcile

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


def run(args: argparse.Namespace) -> int:
    if args.reconcile:
        reconcile_once("guard --reconcile")
        return 0
    try:
        interval = float(args.interval)
    except ValueError:
        raise BadInput(f"--interval must be a number of seconds, got {args.interval!r}") from None
    if not 1 <= interval <= 86400:
        raise BadInput(f"--interval must be between 1 and 86400 seconds, got {args.interval}")
    port, secret = _port(args.port), _secret()
    if args.install:
        hook = install(port, secret)
        print(f"guard: webhook {hook} on {tracking_uri()} -> http://127.0.0.1:{port}/")
        return 0
    from registry.ledger.trust import load_trust

    load_trust()  # a guard that can verify no sanction would clear every serving alias: refused at start
    try:
        server = ThreadingHTTPServer(("127.0.0.1", port), handler_for(secret))
    except OSError as exc:
        raise BadInput(f"--port {port}: cannot listen on 127.0.0.1 ({exc.strerror})") from None
    guarded_round("guard start")  # whatever happened while no guard was running; a failure does not stop it
    stop = threading.Event()
    threading.Thread(target=every, args=(interval, stop), daemon=True).start()
    print(
        f"guard: serving on http://127.0.0.1:{port}/ for {tracking_uri()}, reconciling every {interval:g} s", flush=True
    )
    try:
        server.serve_forever()
    finally:
        stop.set()
        server.server_close()
    return 0


def main(argv: list[str] | None = None) -> None:
    run_step("guard", build, run, argv)


if __name__ == "__main__":
    main()
