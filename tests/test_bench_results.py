"""A benchmark's figures are written once, with when, on which commit and by which command they were measured,
and the page that shows them is written again from the result files."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import types

import bench._common as common
import bench.report as report


def test_a_result_records_its_date_commit_and_command_and_the_page_follows(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(report, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(report, "PAGE", tmp_path / "benchmarks.md")
    monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace(__spec__=None))
    monkeypatch.setattr(sys, "argv", [str(common.ROOT / "bench" / "gate.py"), "--moves", "3"])

    common.write_results("gate", [{"method": "shape gate", "time": "1.3 ms"}], "Headers only.")

    meta = json.loads((tmp_path / "results" / "gate.json").read_text())["meta"]
    assert meta["measured"] == datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=common.ROOT, capture_output=True, text=True)
    assert meta["commit"].split("+")[0] == head.stdout.strip()
    assert meta["command"] == "python -m bench.gate --moves 3"
    page = (tmp_path / "benchmarks.md").read_text()
    section = page.split("## gate\n", 1)[1]
    assert section.lstrip().startswith(report.provenance_line(meta))
    assert "| shape gate | 1.3 ms |" in section and "Headers only." in section
    assert "The whole shape gate" in section  # what the bench measures, from its module's docstring


def test_a_data_file_beside_the_results_is_not_a_result(tmp_path, monkeypatch):
    results = tmp_path / "results"
    results.mkdir()
    (results / "trace.json").write_text(json.dumps([{"cycles": 3}]))
    monkeypatch.setattr(report, "RESULTS", results)
    assert "## trace" not in report.render()
