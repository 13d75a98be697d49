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
import os
import threading
from http.server import ThreadingHTTPServer

from cli.spec import Param, Spec
from cli.step import run_step
from common.errors import BadInput
from registry.access.naming import tracking_uri
from registry.ledger.trust import load_trust

SECRET_ENV = "DRAFTEROPS_WEBHOOK_SECRET"


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


def run(args: argparse.Namespace) -> int:
    # deferred: torch comes with these, and --help or refused input needs none of it
    from pipeline.guarding import every, guarded_round, handler_for, install, reconcile_once

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
