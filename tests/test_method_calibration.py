"""Each draft method priced by its own timed cycles (calibrate --method_drafters): a profile carries every other
method's cycles by width at each operating point, a drafter of that method is priced by them (timed at its width,
the fit of its widths elsewhere), a method not timed keeps its shape's price, and the figures are part of the
profile's identity."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from common.errors import BadInput
from engines.calibration import Timing
from reports import calibration as report
from serving.profile import load_profile
from tests.helpers.checks import one_line_exit_2
from tests.helpers.steps import run_step

ROOT = Path(__file__).resolve().parents[1]
TIMED = {1: {"dflash": {2: 24.0, 4: 28.0}}, 4: {"dflash": {2: 30.0, 4: 36.0}, "peagle": {2: 27.0}}}


def method_profile(tmp: Path, timed: dict = TIMED) -> Path:
    """host-vllm (a real calibration) with other methods' cycles written into its operating points."""
    raw = yaml.safe_load((ROOT / "configs/profiles/host-vllm.yaml").read_text())
    raw.pop("signed", None)
    for key in ("target", "eval_prompts"):
        raw[key] = str((ROOT / "configs/profiles" / raw[key]).resolve())
    for op in raw["operating_points"]:
        if op["concurrency"] in timed:
            op["method_cycle_ms_measured"] = timed[op["concurrency"]]
    path = tmp / "methods.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_a_timed_method_is_priced_by_its_own_cycles_at_every_point(tmp_path):
    profile = load_profile(str(method_profile(tmp_path)))
    dflash = profile.shaped("block", "dflash")
    assert dflash.method_timed()
    assert dflash.with_draft_steps(2).cycle_ms == 24.0  # the primary point's (concurrency 1: shares tie, lowest)
    assert dflash.with_draft_steps(3).cycle_ms == pytest.approx(26.0)  # between its widths: their line
    by_c = {v.concurrency: v for v in dflash.with_draft_steps(4).serving_points()}
    assert by_c[1].cycle_ms == 28.0 and by_c[4].cycle_ms == 36.0
    assert by_c[4].baseline_tps * 36.0 / 1000 == pytest.approx(by_c[4].baseline_tps * by_c[4].cycle_ms / 1000)
    # P-EAGLE was timed at concurrency 4 only: there its own cycle, at concurrency 1 its shape's price
    peagle = {v.concurrency: v for v in profile.shaped("block", "peagle").with_draft_steps(2).serving_points()}
    assert peagle[4].cycle_ms == 27.0
    assert peagle[1].cycle_ms == pytest.approx(peagle[1].verify_ms + peagle[1].draft_step_ms)
    # the chain (EAGLE-3) keeps its own timed cycles
    chain = profile.shaped("chain", "eagle3").with_draft_steps(2)
    assert chain.cycle_ms == dict(chain.cycle_points)[2] and not chain.method_timed()


def test_method_cycles_are_part_of_the_profiles_identity(tmp_path):
    with_methods = load_profile(str(method_profile(tmp_path)))
    (tmp_path / "none").mkdir()
    without = load_profile(str(method_profile(tmp_path / "none", {})))
    assert with_methods.digest != without.digest
    other = load_profile(str(method_profile(tmp_path, {1: {"dflash": {2: 24.0, 4: 28.5}}})))
    assert other.digest != with_methods.digest
    assert with_methods.shaped("block", "dflash").digest == with_methods.digest  # the view is not a new profile


@pytest.mark.parametrize(("timed", "said"), [
    ({1: {"DFlash!": {2: 20.0}}}, "is not a draft method's name"),
    ({1: {"dflash": {}}}, "times no width"),
    ({1: {"eagle3": {2: 5.0}}}, "eagle3's cycles are the point's own cycle_ms_measured"),
    ({1: {"dflash": {0: 20.0}}}, "whole number in [1, 4096]"),
    ({1: {"dflash": {2: -3.0}}}, "must be > 0 ms"),
    ({1: {"dflash": [20.0]}}, "must map draft depth to cycle ms"),
    ({1: ["dflash"]}, "must map a draft method's name"),
    ({1: {"dflash": {2: 10.0, 4: 30.0}}}, "costs -10.000 ms before the first draft"),
])  # fmt: skip
def test_a_malformed_method_cycle_is_refused_in_one_line(tmp_path, timed, said):
    with pytest.raises(BadInput, match=said.replace("[", r"\[").replace("]", r"\]")) as caught:
        load_profile(str(method_profile(tmp_path, timed)))
    assert "\n" not in str(caught.value) and "method_cycle_ms_measured" in str(caught.value)


def test_the_chain_methods_name_is_the_one_drafter_methods_gives_it():
    from drafter.methods import DEFAULT
    from serving.cycle_model import CHAIN_METHOD

    assert DEFAULT.NAME == CHAIN_METHOD


def test_a_methods_cycles_are_carried_onto_the_main_plain_servers_clock():
    """Timed beside a plain server of its own: break-even (plain tok/s x cycle ms) is that group's ratio."""
    main_plain = {1: Timing(1, 4, 100, 1.0)}  # 100 tok/s
    own_plain = {1: Timing(1, 4, 80, 1.0)}  # the host ran 20% slower while the method was timed
    spec = {2: {1: Timing(1, 4, 60, 0.6, cycles=20)}, 4: {1: Timing(1, 4, 70, 0.7, cycles=20)}}  # 30 and 35 ms
    cycles = report.method_cycles(own_plain, spec, main_plain)
    assert cycles == {1: ((2, 24.0), (4, 28.0))}
    assert pytest.approx(80 * 30.0 / 1000) == 100 * 24.0 / 1000  # the ratio timed side by side


def test_a_calibration_with_methods_writes_a_profile_that_loads_and_says_each_width(tmp_path):
    from serving.cycle_model import OperatingPoint

    ops = (
        OperatingPoint(
            1, 1.0, 80.0, 20.0, 1.0, ((1, 21.0), (2, 22.0)), method_cycles=(("dflash", ((2, 24.0), (4, 28.0))),)
        ),
    )
    text = report.profile_text("m", "test", ops, 2, {}, {})
    path = tmp_path / "m.yaml"
    path.write_text(text)
    loaded = load_profile(str(path))
    assert loaded.operating_points[0].method_cycles == (("dflash", ((2, 24.0), (4, 28.0))),)
    rows = report.table(ops, [1, 2])
    assert any("| dflash | 1 | 2: 24.00 / 1.920, 4: 28.00 / 2.240 | 20.00 + width x 2.000 |" in r for r in rows)
    metrics = report.operating_metrics(ops, [1, 2])
    assert metrics["dflash_break_even_k4_c1"] == pytest.approx(2.24)
    ops_cheap = (OperatingPoint(1, 1.0, 80.0, 20.0, 1.0, ((1, 21.0),), method_cycles=(("peagle", ((2, 12.0),)),)),)
    (warning,) = report.method_inversions(ops_cheap)
    assert "peagle cycle of width 2 timed 12.00 ms, no dearer than a plain step (12.50 ms)" in warning


def test_timings_too_uneven_to_price_another_width_are_a_failed_measurement():
    from common.errors import InternalError

    plain = {1: Timing(1, 4, 100, 1.0)}
    steep = {2: {1: Timing(1, 4, 60, 0.2, cycles=20)}, 4: {1: Timing(1, 4, 70, 0.6, cycles=20)}}  # 10 and 30 ms
    with pytest.raises(InternalError, match="fit a cost of -10.00 ms <= 0 before the first draft"):
        report.method_cycles(plain, steep, plain)


def test_a_timed_method_is_not_priced_by_the_chains_step_size_and_says_so(tmp_path):
    """priced_for scales a chain's draft steps by what a step reads; a method's own timed cycles were another drafter
    of its method's, so they are left as timed, and the sentence says so instead of claiming a scaling."""
    from serving.cost import priced_for

    raw = yaml.safe_load(method_profile(tmp_path).read_text())
    raw["draft_step_params"] = 344576
    (tmp_path / "sized.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    dflash = load_profile(str(tmp_path / "sized.yaml")).shaped("block", "dflash")
    same, note = priced_for(dflash, 10 * 344576)
    assert same is dflash and "not priced by drafter size: its dflash cycles" in note
    chain, said = priced_for(load_profile(str(tmp_path / "sized.yaml")).shaped("chain", "eagle3"), 2 * 344576)
    assert chain.draft_step_ms == pytest.approx(2 * raw["draft_step_ms"]) and "priced at 2.00x" in said


def test_a_profile_naming_an_unknown_method_is_refused_where_a_drafter_is_priced(tmp_path):
    from drafter.analysis.step_cost import priced_for_folder

    profile = load_profile(str(method_profile(tmp_path, {1: {"dfash": {2: 24.0}}})))  # loads: serving knows no names
    with pytest.raises(BadInput, match="method_cycle_ms_measured names dfash, not a draft method other than eagle3"):
        priced_for_folder(profile, ROOT / "miniworld/zl-mini-dflash")


@pytest.mark.parametrize(("extra", "said"), [
    (["--method_drafters", "miniworld/aq-mini-eagle3"], "is an EAGLE-3 drafter: its cycles are --drafter's"),
    (["--method_drafters", "miniworld/zl-mini-dflash,miniworld/zl-mini-dflash"], "names two DFlash drafters"),
    (["--method_drafters", "miniworld/zl-mini-dflash", "--method_widths", "0"], "--method_widths must be whole"),
    (["--method_widths", "abc"], "--method_widths must be comma-separated whole numbers"),
    (["--method_drafters", ","], "--method_drafters ',' names no drafter"),
    (["--method_drafters", "miniworld/zl-mini-dflash", "--method_widths", "2,8"],
     "--method_widths 8: a DFlash drafter"),
    (["--method_drafters", "miniworld/zl-mini-dflash", "--endpoint", "http://127.0.0.1:9",
      "--plain_endpoint", "http://127.0.0.1:9"], "timed on servers launched here, not with --endpoint"),
])  # fmt: skip
def test_calibrate_refuses_method_drafters_it_cannot_time_in_one_line(tmp_path, extra, said):
    args = ["--out", str(tmp_path / "p.yaml"), "--no-progress", *extra]
    rooted = [",".join(str(ROOT / x) for x in a.split(",")) if a.startswith("miniworld/") else a for a in args]
    res = run_step("calibrate", rooted, tmp_path, here=True)
    one_line_exit_2(res, said)
    assert not (tmp_path / "p.yaml").exists()
