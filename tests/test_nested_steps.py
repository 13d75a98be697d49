"""Pipeline.steps (pipeline/nested.py), the main job's steps two at a time, on stand-in launches (the launcher is
`mlflow.projects.run`; the real one runs in the main job's tests): results in the given order whatever ends first,
a finished step with the same inputs reused, the worst failure raised (a crash over bad input, whatever order they
end in), and no child left running when a launch raises."""

from __future__ import annotations

import types

import mlflow.projects
import pytest

from pipeline.nested import Pipeline, StepFailed


class Launched:
    """A child that runs for `polls` status reads, then ends with `code`."""

    def __init__(self, run_id: str, polls: int, code: int) -> None:
        self.run_id, self.polls, self.code, self.cancelled = run_id, polls, code, False

    def get_status(self) -> str:
        if self.polls > 0 and not self.cancelled:
            self.polls -= 1
            return "RUNNING"
        return "FINISHED" if self.code == 0 else "FAILED"

    def wait(self) -> bool:
        return True

    def cancel(self) -> None:
        self.cancelled = True


class Store:
    def __init__(self, finished: dict[str, str] | None = None) -> None:
        self.children: dict[str, Launched] = {}
        self.finished_runs = finished or {}  # cache key -> run id of a finished run
        self.tags: dict[str, dict[str, str]] = {}

    def search_runs(self, _experiments, filter_string: str, **_kw):
        key = filter_string.split("'")[1]
        if key not in self.finished_runs:
            return []
        tags = {"drafterops.exit_code": "0"}
        return [types.SimpleNamespace(info=types.SimpleNamespace(run_id=self.finished_runs[key], status="FINISHED"),
                                      data=types.SimpleNamespace(tags=tags))]  # fmt: skip

    def get_run(self, run_id: str):
        return types.SimpleNamespace(data=types.SimpleNamespace(tags={"drafterops.exit_code": str(self.children[
            run_id].code)}))  # fmt: skip

    def set_tag(self, run_id: str, key: str, value: str) -> None:
        self.tags.setdefault(run_id, {})[key] = value

    def set_terminated(self, *_args) -> None:
        pass


def launching(monkeypatch, store: Store, plan: dict[str, tuple[int, int]], fail_on: str = ""):
    def run(_uri, entry_point, parameters, **_kw):
        name = parameters["model"]
        if name == fail_on:
            raise RuntimeError("the launcher broke")
        polls, code = plan[name]
        store.children[name] = Launched(name, polls, code)
        return store.children[name]

    monkeypatch.setattr(mlflow.projects, "run", run)


def calls(*names: str):
    return [("evaluate", {"model": n}, (0,)) for n in names]


def test_results_come_in_the_given_order_and_a_finished_step_is_reused(monkeypatch):
    p = Pipeline(None, "0")
    store = Store({p.key("evaluate", {"model": "b"}): "old-b"})
    p.client = store
    launching(monkeypatch, store, {"a": (5, 0), "c": (0, 0), "d": (1, 0)})
    assert p.steps(calls("a", "b", "c", "d")) == [("a", 0), ("old-b", 0), ("c", 0), ("d", 0)]
    assert "b" not in store.children and all(store.tags[n]["drafterops.cache_key"] for n in ("a", "c", "d"))


@pytest.mark.parametrize("order", [("bad", "crash"), ("crash", "bad")])
def test_the_worst_failure_is_raised_whatever_ends_first(monkeypatch, order):
    store = Store()
    p = Pipeline(store, "0")
    launching(monkeypatch, store, {"bad": (1, 2), "crash": (1, 3), "later": (0, 0)})
    with pytest.raises(StepFailed) as err:
        p.steps(calls(*order, "later"))
    assert err.value.exit_code == 3 and "later" not in store.children  # nothing starts after a failure


def test_no_child_outlives_a_launch_that_raises(monkeypatch):
    store = Store()
    p = Pipeline(store, "0")
    launching(monkeypatch, store, {"a": (10**6, 0)}, fail_on="b")
    with pytest.raises(RuntimeError, match="the launcher broke"):
        p.steps(calls("a", "b"))
    assert store.children["a"].cancelled
