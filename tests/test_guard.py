"""The registry guards its gate: a live `mlflow server` with the guard's webhook installed reverts an
alias set by a plain MlflowClient call, keeps one set by `promote`, and refuses a forged delivery."""

import json
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import mlflow
import pytest

from registry.ledger import guard
from tests.helpers.guard import SECRET, guarded_server, wait_for
from tests.helpers.promotion import write_profiles
from tests.helpers.steps import run_module
from tests.helpers.trained import drafter_folder


def test_signature_rules():
    body = b'{"entity": "model_version_alias"}'
    stamp = str(int(time.time()))
    import base64
    import hashlib
    import hmac

    sig = base64.b64encode(hmac.new(SECRET.encode(), f"d1.{stamp}.".encode() + body, hashlib.sha256).digest())
    headers = {guard.SIGNATURE_HEADER: "v1," + sig.decode(), guard.TIMESTAMP_HEADER: stamp, guard.DELIVERY_HEADER: "d1"}
    assert guard.signature_ok(SECRET, headers, body)
    assert not guard.signature_ok(SECRET, headers, body + b" ")  # tampered body
    assert not guard.signature_ok("another-secret-0123456789", headers, body)
    assert not guard.signature_ok(SECRET, {**headers, guard.TIMESTAMP_HEADER: str(int(stamp) - 3600)}, body)  # replay
    assert not guard.signature_ok(SECRET, {}, body)
    assert guard.signature_ok(SECRET, {k.lower(): v for k, v in headers.items()}, body)  # header names, any case


@pytest.mark.full
def test_unsanctioned_alias_moves_are_reverted(tiny_targets, trained_tiny, tmp_path):
    _, wrapped = tiny_targets
    for seed in (1, 2):
        shutil.copytree(drafter_folder(trained_tiny, seed), tmp_path / f"d{seed}")
    with guarded_server(tmp_path) as guarded:
        url, port, env = guarded.url, guarded.port, guarded.env

        def run_step(name, args, cwd):  # every step against the tracking server
            return run_module(f"steps.{name}", args, cwd, env, timeout=600)

        for seed in (1, 2):
            res = run_step(
                "import_drafter", ["--source", str(tmp_path / f"d{seed}"), "--target", str(wrapped)], tmp_path
            )
            assert res.returncode == 0, res.stderr[-2000:]
        c = mlflow.MlflowClient(url)
        name = "k25-tiny-eagle3"

        def holder():
            return c.get_registered_model(name).aliases.get("production")

        # 1. the UI's pencil (any API client): reverted, and audited
        c.set_registered_model_alias(name, "production", "1")
        assert wait_for(lambda: holder() is None), "unsanctioned production alias was not removed"

        def reverts():  # the alias is taken off first, then the revert is audited: wait for both
            audit = c.get_experiment_by_name("drafterops-audit")
            decision = "tags.decision = 'guard:revert:production'"
            return c.search_runs([audit.experiment_id], filter_string=decision) if audit else []

        assert wait_for(lambda: bool(reverts())), "the revert was not audited"
        assert reverts()[0].data.tags["attempted"] == "1"
        # 2. promote's move stays
        write_profiles(tmp_path, wrapped)
        uri = f"models:/{name}/2"
        assert run_step("shape_gate", ["--model", uri, "--target", str(wrapped)], tmp_path).returncode == 0
        ev = ["--model", uri, "--target", str(wrapped)]
        ev += ["--profile", str(tmp_path / "lenient.yaml"), "--no-progress"]
        assert run_step("evaluate", ev, tmp_path).returncode == 0
        pr = run_step("promote", ["--model", uri, "--profile", str(tmp_path / "lenient.yaml")], tmp_path)
        assert pr.returncode == 0, pr.stdout + pr.stderr
        time.sleep(3)  # give the webhook time to arrive and be judged
        assert holder() == "2"
        # 3. moving it away by hand brings it back to where promote put it
        c.set_registered_model_alias(name, "production", "1")
        assert wait_for(lambda: holder() == "2"), "production was not restored to the promoted version"
        # 4. a forged delivery is refused, a malformed one too, and the service lives on
        forged = urllib.request.Request(
            f"http://127.0.0.1:{port}/",
            data=json.dumps({"entity": "model_version_alias", "action": "deleted", "data": {}}).encode(),
            headers={guard.SIGNATURE_HEADER: "v1,AAAA", guard.TIMESTAMP_HEADER: str(int(time.time())),
                     guard.DELIVERY_HEADER: "x", "Content-Type": "application/json"},
        )  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(forged, timeout=10)
        assert refused.value.code == 401
        assert guarded.service.poll() is None
        # 5. a genuine delivery whose header names a proxy lower-cased (HTTP/2 does) is accepted
        body = json.dumps({"entity": "model_version_alias", "action": "created",
                           "data": {"name": name, "alias": "production", "version": "2"}}).encode()  # fmt: skip
        lower = {k.lower(): v for k, v in signed_headers(body, "lower-1").items()}
        with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/", data=body,
                                                           headers=lower), timeout=10) as answer:  # fmt: skip
            assert answer.status == 200
        # 6. a client promising more body than it sends is cut off; the guard serves others meanwhile
        import socket

        slow = socket.create_connection(("127.0.0.1", port), timeout=30)
        slow.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n0123456789")
        t_slow = time.time()
        with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/", data=body,
                                                           headers=lower), timeout=10) as answer:  # fmt: skip
            assert answer.status == 200
        assert slow.recv(100) == b"" and time.time() - t_slow < 20  # closed by the guard, not by us
        slow.close()
        # 7. every move by hand is reverted, again and again (its latency: bench/guard_latency.py)
        for _ in range(3):
            c.set_registered_model_alias(name, "production", "1")
            assert wait_for(lambda: holder() == "2"), "a move by hand was not reverted"
        # 8. guard down, production moved, guard back: restored within 20 s of its start
        guarded.stop_service()
        c.set_registered_model_alias(name, "production", "1")
        time.sleep(8)  # MLflow's delivery retries (~7 s) are over: nobody is told any more
        assert holder() == "1"
        guarded.start_service()
        assert wait_for(lambda: holder() == "2", 20.0), "a move made while the guard was down stayed"


def signed_headers(body: bytes, delivery: str) -> dict[str, str]:
    """What MLflow's server sends with a delivery, signed with the test's secret."""
    import base64
    import hashlib
    import hmac

    stamp = str(int(time.time()))
    sig = base64.b64encode(hmac.new(SECRET.encode(), f"{delivery}.{stamp}.".encode() + body, hashlib.sha256).digest())
    return {guard.SIGNATURE_HEADER: "v1," + sig.decode(), guard.TIMESTAMP_HEADER: stamp,
            guard.DELIVERY_HEADER: delivery, "Content-Type": "application/json"}  # fmt: skip


NAME = "k25-tiny-eagle3"


@pytest.fixture
def promoted(tiny_targets, trained_tiny, tmp_path):
    """A SQLite store (no server, no guard): v1 then v2 promoted to production by `promote`, each on its
    honest evaluation on the pinned prompts; v3 imported, never evaluated."""
    from tests.helpers.steps import run_step

    _, wrapped = tiny_targets
    write_profiles(tmp_path, wrapped)
    for seed in (1, 2, 3):
        shutil.copytree(drafter_folder(trained_tiny, seed), tmp_path / f"d{seed}")
        assert run_step("import_drafter", ["--source", str(tmp_path / f"d{seed}"), "--target", str(wrapped)],
                        tmp_path, here=True).returncode == 0  # fmt: skip
    for v in ("1", "2"):
        uri = f"models:/{NAME}/{v}"
        for step, args in (
            ("shape_gate", ["--model", uri, "--target", str(wrapped)]),
            ("evaluate", ["--model", uri, "--target", str(wrapped), "--profile", str(tmp_path / "lenient.yaml")]),
            ("promote", ["--model", uri, "--profile", str(tmp_path / "lenient.yaml")]),
        ):
            res = run_step(step, args, tmp_path, here=True)
            assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return tmp_path, wrapped


def test_reconcile_restores_every_kind_of_move_on_a_store_without_a_guard(promoted):
    """One row per way a serving alias or stage was moved behind promote's back, each put back by one
    reconciliation (`python -m steps.guard --reconcile` where it says so) and audited; promote's own
    moves are the positive control."""
    from registry.ledger.reconcile import disagreements, reconcile
    from registry.ledger.sanction import holder
    from tests.helpers.steps import run_step

    tmp, wrapped = promoted
    c = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")

    def state():
        versions = c.search_model_versions(f"name='{NAME}'")
        held = c.get_registered_model(NAME).aliases.get("production")
        return (str(held) if held is not None else None), {
            str(v.version) for v in versions if v.current_stage == "Production"
        }

    # positive control: promote's own moves stand, nothing to do
    assert state() == ("2", {"2"}) and reconcile(c) == [] and disagreements(c, NAME) == []
    # the alias set by hand (no guard running): the CLI puts it back and says so
    c.set_registered_model_alias(NAME, "production", "3")
    warned = run_step("shape_gate", ["--model", f"models:/{NAME}/3", "--target", str(wrapped)], tmp)
    assert "shape_gate: warning: k25-tiny-eagle3: `production` points at v3, the last sanctioned decision put it " \
           "at v2" in warned.stderr  # fmt: skip
    res = run_step("guard", ["--reconcile"], tmp)
    assert res.returncode == 0 and "`production` back from v3 to v2, where promote put it" in res.stdout, res.stdout
    assert state() == ("2", {"2"})
    # audit runs made by hand with the genuine tags sanction nothing
    audit = c.get_experiment_by_name("drafterops-audit").experiment_id
    for decision in ("promote:production:yes", "alias:production"):
        run = c.create_run(audit, tags={"model": NAME, "version": "3", "decision": decision})
        c.set_terminated(run.info.run_id)
    assert holder(c, NAME, "production").version == "2"
    # v1's genuine signed sanction copied into a new run: no newer than it was (no rollback to v1)
    from registry.ledger.sanction import SANCTION_FILE

    first = c.search_runs([audit], filter_string="tags.decision = 'alias:production' and tags.version = '1'")[-1]
    old = c.download_artifacts(first.info.run_id, SANCTION_FILE, str(tmp))
    replay = c.create_run(audit, tags={"model": NAME, "version": "1", "decision": "alias:production"})
    c.log_artifact(replay.info.run_id, old)
    c.set_terminated(replay.info.run_id)
    assert holder(c, NAME, "production").version == "2"
    c.set_registered_model_alias(NAME, "production", "3")
    assert any("back from v3 to v2" in a for a in reconcile(c)) and state() == ("2", {"2"})
    # a legacy stage moved by hand (no alias event at all), and the holder's stage lost (promote killed)
    c.transition_model_version_stage(NAME, "3", "Production", archive_existing_versions=True)
    done = reconcile(c)
    assert any("Production taken off v3" in a for a in done) and any("Production restored on v2" in a for a in done)
    assert state() == ("2", {"2"})
    # the version holding production deleted: production goes back to the previous sanctioned holder
    c.delete_model_version(NAME, "2")
    done = reconcile(c)
    assert any("to v1, where promote put it (sanctioned v2 no longer exists)" in a for a in done), done
    assert state() == ("1", {"1"})
    # the files of the version holding production replaced after its promotion: it no longer holds it
    mv = c.get_model_version(NAME, "1")
    folder = Path(c.get_model_version_download_uri(NAME, "1").removeprefix("file://"))
    config = json.loads((folder / "config.json").read_text())
    (tmp / "swap").mkdir()
    (tmp / "swap" / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 10.0}))
    c.log_model_artifact(mv.model_id or mv.source.removeprefix("models:/"), str(tmp / "swap" / "config.json"))
    done = reconcile(c)
    assert any("cleared `production` (was v1): no sanctioned version" in a and "(the files of sanctioned v1 changed "
               "since their promotion)" in a for a in done), done  # fmt: skip
    assert state() == (None, set())
    # renamed, and a new model under the old name given production by hand: never sanctioned
    c.rename_registered_model(NAME, "renamed-eagle3")
    c.create_registered_model(NAME)
    c.create_model_version(NAME, c.get_model_version_download_uri("renamed-eagle3", "3"))
    c.set_registered_model_alias(NAME, "production", "1")
    assert holder(c, NAME, "production").version is None
    done = reconcile(c)
    assert any(a.startswith(f"{NAME}: cleared `production` (was v1)") for a in done), done
    assert "production" not in c.get_registered_model(NAME).aliases
    reverts = c.search_runs([audit], filter_string="tags.decision = 'guard:revert:production'")
    assert len(reverts) >= 6 and all(r.data.tags["reason"] for r in reverts)


def test_the_chain_holds_against_a_flood_an_edited_tag_an_overwrite_and_deletions(promoted):
    """The holder is the head of the signed chain: 520 junk audit runs claiming sanctions and a tag edited on
    the newest sanction move nothing; a hand-deleted alias does not make promote forget production; the holder's
    sanction overwritten or deleted is a lost link: the guard holds the newest sanction it can still verify, a
    move by hand is still reverted, and the loss is audited; a deleted holder is audited once."""
    import hashlib

    from registry.ledger.reconcile import reconcile
    from registry.ledger.sanction import DIGEST_PARAM, PARAM, SANCTION_FILE, holder
    from tests.helpers.steps import run_step

    tmp, _ = promoted
    c = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    audit = c.get_experiment_by_name("drafterops-audit").experiment_id
    sanctions = c.search_runs([audit], filter_string="tags.decision = 'alias:production'",
                              order_by=["attributes.start_time DESC"])  # fmt: skip
    newest, first = sanctions[0].info.run_id, sanctions[-1].info.run_id
    (tmp / "old").mkdir()
    old = c.download_artifacts(first, SANCTION_FILE, str(tmp / "old"))
    # a tag edited on the newest sanction, and 520 junk runs (the old window was 500), 20 replaying v1's
    c.set_tag(newest, "version", "1")
    c.set_tag(newest, "decision", "junk")
    for i in range(520):
        run = c.create_run(audit, tags={"model": NAME, "version": "1", "decision": "alias:production"})
        c.log_param(run.info.run_id, PARAM, f"{NAME}@production")
        if i < 20:  # a replayed copy of v1's sanction, with the digest param a real one has: the same link again
            c.log_artifact(run.info.run_id, old)
            c.log_param(run.info.run_id, DIGEST_PARAM, hashlib.sha256(Path(old).read_bytes()).hexdigest())
        else:
            c.log_text(run.info.run_id, '{"kind": "sanction", "version": "3"}', SANCTION_FILE)
    held = holder(c, NAME, "production")
    assert held.version == "2" and any("500 audit run(s) claim a sanction" in f for f in held.findings), held
    done = reconcile(c)
    assert [a for a in done if "back from" in a or "cleared" in a] == [] and len(done) == 1, done
    assert reconcile(c) == []  # the finding is said once
    assert str(c.get_model_version_by_alias(NAME, "production").version) == "2"
    # the alias deleted by hand: promote still compares against the chain's holder
    c.delete_registered_model_alias(NAME, "production")
    res = run_step("promote", ["--model", f"models:/{NAME}/1", "--profile", str(tmp / "lenient.yaml")], tmp, here=True)
    assert "vs production v2" in res.stdout and "the sanctioned holder is v2" in res.stdout, res.stdout
    if res.returncode == 0:  # v1 measured no worse than v2: promoted, and the chain goes on from v2's sanction
        assert holder(c, NAME, "production").version == "1" and reconcile(c) == []
        c.delete_model_version(NAME, "1")  # v1 deleted: the chain falls back to v2, and says so
        assert any("back from nothing to v2" in a for a in reconcile(c))
    else:
        assert res.returncode == 1 and any("back from nothing to v2" in a for a in reconcile(c))
    # the holder's sanction overwritten with an old one: the link is read from the signed copy its run keeps as
    # a param (which nobody can change), said as a finding; the holder stays, and a move by hand is reverted
    head = holder(c, NAME, "production").run_id
    (tmp / "saved").mkdir()
    saved = c.download_artifacts(head, SANCTION_FILE, str(tmp / "saved"))
    c.log_artifact(head, old)
    c.set_registered_model_alias(NAME, "production", "3")
    kept = holder(c, NAME, "production")
    assert kept.version == "2" and kept.run_id == head and not kept.damaged, kept
    assert any("was overwritten after it was written; the link is read from the signed copy" in f
               for f in kept.findings), kept.findings  # fmt: skip
    assert any("v3" in a for a in reconcile(c)) and live(c) == "2"
    sanction_file = Path(c.get_run(head).info.artifact_uri.removeprefix("file://")) / SANCTION_FILE
    sanction_file.unlink()  # deleted outright (the artifact store's DELETE): the same, the link holds
    c.set_registered_model_alias(NAME, "production", "3")
    kept = holder(c, NAME, "production")
    assert kept.version == "2" and any("is missing" in f for f in kept.findings), kept
    assert any("v3" in a for a in reconcile(c)) and live(c) == "2"
    # a sanction written before its run kept the signed copy (its param gone, as on such a run): a lost link;
    # the guard holds the newest sanction it can still verify (a finding says a newer link may be lost)
    from registry.ledger import sanction as sanction_module

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sanction_module, "RECORD_PARAM", "drafterops.no-such-param")
        damaged = holder(c, NAME, "production")
        assert damaged.damaged and damaged.version != "3" and damaged.run_id != head, damaged
        done = reconcile(c)
        assert any("is missing" in a for a in done) and any("a newer link may be lost" in a for a in done), done
        assert live(c) == damaged.version
    c.log_artifact(head, saved)  # put back as it was: the chain reads whole again
    assert hashlib.sha256(Path(saved).read_bytes()).hexdigest() == c.get_run(head).data.params[DIGEST_PARAM]
    assert holder(c, NAME, "production").version == "2"
    assert any("to v2, where promote put it" in a for a in reconcile(c))
    # a guard with neither a trust file nor a key of its own verifies nothing: it says so, and moves nothing
    from tests.helpers.steps import run_module, step_env

    alone = run_module("steps.guard", ["--reconcile"], tmp, step_env(tmp, DRAFTEROPS_HOME=str(tmp / "nobody")))
    assert alone.returncode == 2 and "no trust file" in alone.stderr, alone.stderr
    assert str(c.get_registered_model(NAME).aliases["production"]) == "2"
    # every sanctioned version deleted: production is cleared and the loss audited, once
    c.delete_model_version(NAME, "2")
    last = "2"  # the last sanctioned version deleted (v1 when it was never promoted over v2 above)
    if "1" in {str(v.version) for v in c.search_model_versions(f"name='{NAME}'")}:
        assert any("back from nothing to v1" in a for a in reconcile(c))
        c.delete_model_version(NAME, "1")
        last = "1"
    done = reconcile(c)
    assert any(f"sanctioned v{last} of `production` no longer exists" in a for a in done), done
    assert "production" not in c.get_registered_model(NAME).aliases
    assert reconcile(c) == []
    lines = c.search_runs([audit], filter_string="tags.decision = 'guard:finding:production'")
    assert any(f"v{last} of `production` no longer exists" in r.data.tags["reason"] for r in lines)


def live(c) -> str | None:
    """Where the production alias points now (None: nowhere)."""
    held = c.get_registered_model(NAME).aliases.get("production")
    return None if held is None else str(held)


def test_one_overwritten_old_sanction_never_disables_the_guard(promoted):
    """The oldest sanction's file overwritten with `{}` through the API, then production set by hand to a version
    never promoted: the guard reverts it to the newest sanction it can verify and says the link is lost; after a
    new signed promotion the next hand move is reverted to it too. Then the attack round's: the audit experiment
    renamed or deleted, and claims planted for the chain's head, move nothing."""
    from registry.ledger.reconcile import reconcile
    from registry.ledger.sanction import SANCTION_FILE, holder, links
    from registry.ledger.succession import claim_name
    from tests.helpers.steps import run_module, run_step, step_env

    tmp, _ = promoted
    c = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    audit = c.get_experiment_by_name("drafterops-audit").experiment_id
    oldest = c.search_runs([audit], filter_string="tags.decision = 'alias:production'",
                           order_by=["attributes.start_time ASC"])[0]  # fmt: skip
    c.log_text(oldest.info.run_id, "{}", SANCTION_FILE)
    c.set_registered_model_alias(NAME, "production", "3")
    done = reconcile(c)
    assert any("back from v3 to v2, where promote put it" in a for a in done), done
    assert any(f"audit run {oldest.info.run_id}: its sanction.json was overwritten" in a for a in done), done
    assert live(c) == "2" and not holder(c, NAME, "production").damaged  # read from its signed param copy
    res = run_step("promote", ["--model", f"models:/{NAME}/1", "--profile", str(tmp / "lenient.yaml"), "--margin",
                               "1"], tmp, here=True)  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:]
    c.set_registered_model_alias(NAME, "production", "3")
    assert any("back from v3 to v1, where promote put it" in a for a in reconcile(c)) and live(c) == "1"
    # tried with store access alone: the audit experiment renamed, then deleted (the sanctions are still read from
    # every experiment: a move by hand is reverted, never taken for an empty chain that clears production); claims
    # planted by hand for the chain's head (unsigned: promote neither waits on them nor forks around them)
    audit = c.get_experiment_by_name("drafterops-audit").experiment_id
    c.rename_experiment(audit, "nothing-to-see")
    for hide in (lambda: None, lambda: c.delete_experiment(audit)):
        hide()
        c.set_registered_model_alias(NAME, "production", "3")
        assert any("back from v3 to v1, where promote put it" in a for a in reconcile(c)) and live(c) == "1"
    head = holder(c, NAME, "production").head
    for attempt in range(3):
        c.create_experiment(claim_name(c.get_registered_model(NAME), "production", head, attempt))
    res = run_module("steps.promote", ["--model", f"models:/{NAME}/2", "--profile", str(tmp / "lenient.yaml"),
                                       "--margin", "1"], tmp, step_env(tmp), timeout=300)  # fmt: skip
    assert res.returncode == 0 and live(c) == "2", res.stdout[-2000:] + res.stderr[-2000:]
    follows = [record["previous"] for _, record in links(c, NAME, "production").values()]
    assert len(follows) == len(set(follows)) and head in follows  # one line, the new link after the old head


@pytest.mark.full
def test_two_promotes_at_once_on_a_shared_server_keep_the_chain_linear(tiny_targets, trained_tiny, tmp_path):
    """A live `mlflow server` (the multi-user setup the docs recommend), 20 rounds: production is set to junk v2 by a
    signed sanction, then v1 (better) and v3 (junk) are promoted by two processes at once, both having judged
    against v2 before either writes (a failpoint makes them meet there). Every round exactly one decision is taken
    again, against what the other installed, and the chain of sanctions stays one line: no two sanctions follow
    the same one, one head."""
    from registry.ledger import audit, succession
    from registry.ledger.sanction import holder, links
    from tests.helpers.evidence import forge_record
    from tests.helpers.promotion import register_gated
    from tests.helpers.servers import mlflow_server
    from tests.helpers.steps import run_modules_together, step_env

    _, wrapped = tiny_targets
    write_profiles(tmp_path, wrapped)
    profile = str(tmp_path / "lenient.yaml")
    backend, artifacts = f"sqlite:///{tmp_path}/server.db", str(tmp_path / "art")
    with mlflow_server(tmp_path, backend, "--default-artifact-root", artifacts) as url:
        env = step_env(tmp_path, MLFLOW_TRACKING_URI=url)
        register_gated(tmp_path, wrapped, trained_tiny, (1, 2, 3), url)
        c = mlflow.MlflowClient(url)
        for version, tokens in (("1", 3), ("2", 2), ("3", 2)):  # v1 better than v2 and v3 (trusted records)
            forge_record(c, NAME, version, tmp_path / "lenient.yaml", lambda _c, k, n=tokens: [(n, 1)] * len(k))

        def promote(version: str, *extra: str) -> list[str]:
            return ["--model", f"models:/{NAME}/{version}", "--profile", profile, *extra]

        def reset() -> None:  # production back to junk v2 by a signed sanction, as promote writes one
            head = holder(c, NAME, "production").head
            with succession.next_link(c, NAME, "production", head, lambda: holder(c, NAME, "production").head) as claim:
                audit.move_alias(c, NAME, "production", "2", "reset for the next round", by_promote=True, claim=claim)

        for i in range(20):
            reset()
            assert holder(c, NAME, "production").version == "2"
            race = {**env, "DRAFTEROPS_FAILPOINT": "promote:judged:meet",
                    "DRAFTEROPS_FAILPOINT_MEET": f"{tmp_path / f'meet-{i}'}:2"}  # fmt: skip
            good, junk = run_modules_together("steps.promote", [promote("1"), promote("3")], tmp_path, race)
            again = [res for res in (good, junk) if "decided again against its new head" in res.stdout]
            assert len(again) == 1, (good.stdout[-2000:], junk.stdout[-2000:])
            first, second = (junk, good) if again[0] is good else (good, junk)
            won = "1" if first is good else "3"
            assert first.returncode == 0 and "vs production v2 2.000" in first.stdout, first.stdout[-2000:]
            assert f"vs production v{won} " in second.stdout, second.stdout[-2000:]  # the second saw the first's result
            assert second.returncode == (1 if won == "1" else 0), second.stdout[-2000:]
            chain = [record for _, record in links(c, NAME, "production").values()]
            follows = [record["previous"] for record in chain]
            assert len(follows) == len(set(follows)), f"round {i}: two sanctions follow the same one"
            assert sum(1 for r in chain if signing_digest(r) not in set(follows)) == 1, f"round {i}: not one head"
            assert holder(c, NAME, "production").version == "1"  # v1 won, or came second and beat junk v3


def signing_digest(record: dict) -> str:
    from registry.ledger import signing

    return signing.digest(record)
