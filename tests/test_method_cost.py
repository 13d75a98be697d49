"""What a cycle costs by draft method (serving/cost.method_cycle_ms, drafter/methods): a chain pays a drafter
pass per draft, a block one pass whatever its width; a chain's break-even is the profile's own (timed where its
depth was timed); a DFlash pass is priced by what it reads, the target's head included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from drafter.analysis.step_cost import folder_step_cost
from drafter.methods import DEFAULT, dflash, eagle3, folder_method_or_default
from engines.vllm import Settings, server_command
from serving.cost import break_even_accept_len, method_break_even, method_cycle_ms
from serving.profile import load_profile

ROOT = Path(__file__).resolve().parents[1]


def test_a_chain_pays_a_pass_per_draft_and_a_block_one_pass_at_any_width():
    host = load_profile("host")  # verify 7.831 ms, a draft step 0.511 ms
    for k in (1, 3, 7):
        chain = method_cycle_ms(host, k, eagle3.drafter_passes(k))
        assert chain == pytest.approx(host.with_draft_steps(k).cycle_ms)
        assert method_break_even(host, k, k) == pytest.approx(break_even_accept_len(host.with_draft_steps(k)))
        assert method_cycle_ms(host, k, dflash.drafter_passes(k)) == pytest.approx(host.verify_ms + host.draft_step_ms)
    wide = method_break_even(host, 7, 1)
    assert wide < method_break_even(host, 7, 7) and wide == pytest.approx(175.46 * (7.831 + 0.511) / 1000)
    # the seed deployment's 30 ms sits wholly in verify_ms: drafting is free to every method alike
    seed = load_profile("kimi-k2.5-8xrtxpro6000")
    assert method_break_even(seed, 7, 1) == method_break_even(seed, 2, 2) == pytest.approx(82 * 30 / 1000)


def test_a_dflash_pass_reads_its_layers_and_the_targets_head():
    raw = json.loads((ROOT / "configs/reference/kimi-k2.5-dflash.config.json").read_text())
    per_pass, per_cycle = dflash.pass_parameters(dflash.read_config(raw))
    assert per_cycle == 6 * 7168 * 7168 + 7168  # fc and hidden_norm, with the context states
    assert per_pass > 163840 * 7168  # the borrowed head alone is 1.17 B
    mini = folder_step_cost(ROOT / "miniworld/zl-mini-dflash")
    layers = sum(v for k, v in _sizes(ROOT / "miniworld/zl-mini-dflash").items() if k.startswith("layers."))
    assert mini.per_step == layers + 128 + 4096 * 128 and mini.per_cycle == 3 * 128 * 128 + 128


def _sizes(folder: Path) -> dict[str, int]:
    from math import prod

    from drafter.formats.checkpoint import read_header

    return {name: prod(info.shape) for name, info in read_header(folder).items()}


def test_each_method_is_served_by_its_own_vllm_method(tmp_path):
    assert folder_method_or_default(ROOT / "miniworld/zl-mini-dflash") is dflash
    assert folder_method_or_default(ROOT / "miniworld/aq-mini-eagle3") is DEFAULT is eagle3
    s = Settings(k=3, max_new_tokens=8)
    for folder, method in (("zl-mini-dflash", "dflash"), ("aq-mini-eagle3", "eagle3"), ("pe-mini-peagle", "eagle3")):
        cmd = server_command(Path("python"), tmp_path, 8000, s, ROOT / "miniworld" / folder)
        spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
        assert spec["method"] == method and spec["num_speculative_tokens"] == 3
        assert spec.get("parallel_drafting", False) is (folder == "pe-mini-peagle")  # P-EAGLE: all k in one pass


def test_p_eagle_exports_for_vllm_under_its_eagle3_name_and_is_refused_by_sglang_by_name(tmp_path):
    from common.errors import BadInput
    from drafter.methods import folder_method_or_default, peagle
    from engines.sglang import speculative_flags

    mini = ROOT / "miniworld/pe-mini-peagle"
    with pytest.raises(BadInput, match="SGLang has not merged P-EAGLE"):
        peagle.export_for(mini, tmp_path / "s", "sglang", 3)
    with pytest.raises(BadInput, match="SGLang has not merged P-EAGLE"):
        speculative_flags(mini, 3)
    aux = peagle.export_for(mini, tmp_path / "v", "vllm", 7)
    raw = json.loads((tmp_path / "v" / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"]  # vLLM 0.32 would rename PEagleDraftModel
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == aux["handed_ids"] == [2, 4, 5]
    assert aux["target_layer_outputs_fed"] == [1, 3, 4] and raw["mask_token_id"] == raw["ptd_token_id"] == 0
    assert folder_method_or_default(tmp_path / "v") is peagle  # the exported folder still says what it is
    assert peagle.folder_config(tmp_path / "v").aux_layer_ids == [1, 3, 4]  # read back in the project's reading
    assert (tmp_path / "v" / "model.safetensors").read_bytes() == (mini / "model.safetensors").read_bytes()


def test_the_dflash_export_writes_the_yarn_factor_and_refuses_what_it_cannot_serve(tmp_path):
    from common.errors import BadInput

    mini = ROOT / "miniworld/zl-mini-dflash"
    with pytest.raises(BadInput, match="exported for vllm and sglang .speculators has no DFlash reader"):
        dflash.export_for(mini, tmp_path / "s", "speculators", 3)
    with pytest.raises(BadInput, match="drafts 1..7"):
        dflash.export_for(mini, tmp_path / "w", "vllm", 8)
    aux = dflash.export_for(mini, tmp_path / "v", "vllm", 7)
    assert aux["handed_ids"] == aux["target_layer_outputs_fed"] == [1, 3, 4]
    assert (tmp_path / "v" / "model.safetensors").read_bytes() == (mini / "model.safetensors").read_bytes()
    real = tmp_path / "k25"  # the public K2.5 DFlash config: its YaRN factor, resolved as z-lab does, written out
    real.mkdir()
    (real / "config.json").write_text((ROOT / "configs/reference/kimi-k2.5-dflash.config.json").read_text())
    dflash.export_for(real, tmp_path / "out", "vllm", 7)
    scaling = json.loads((tmp_path / "out" / "config.json").read_text())["rope_scaling"]
    assert scaling["attention_factor"] == pytest.approx(0.1 * __import__("math").log(64) + 1)


def test_a_shaped_profile_prices_a_block_at_every_operating_point_and_keeps_its_digest():
    host = load_profile("host")
    block = host.shaped("block")
    assert block.digest == host.digest  # the drafter's shape is a view, not the deployment's terms
    assert block.with_draft_steps(7).cycle_ms == pytest.approx(host.verify_ms + host.draft_step_ms)
    calibrated = load_profile("host-vllm")  # operating points whose chain cycles were timed
    shaped = calibrated.shaped("block")
    for op in shaped.operating_points:
        assert op.cycle_ms(5) == pytest.approx(op.verify_ms + op.draft_step_ms)
    assert shaped.binding().draft_shape == "block"
    assert method_break_even(calibrated, 3, 1) == pytest.approx(break_even_accept_len(shaped.binding()))
    with pytest.raises(ValueError, match="unknown cycle shape"):
        host.shaped("tree")


def test_a_hand_written_profiles_one_point_keeps_the_drafters_shape():
    from reports.operating import depth_choices, points_of

    block = load_profile("host").shaped("block")
    assert points_of(block)[0].draft_shape == "block"
    # a block's acceptance is measured at one width and says nothing of another's: only that width is offered
    assert [c.k for c in depth_choices(block, [0.9, 0.1, 0.1], 3)] == [3]
    assert [c.k for c in depth_choices(load_profile("host"), [0.9, 0.1, 0.1], 3)] == [1]  # a chain chooses


def test_serve_sh_serves_a_dflash_export_with_its_own_method_wherever_the_folder_ends_up(tmp_path):
    from engines import export

    mini = ROOT / "miniworld"
    exported = export.write(mini / "zl-mini-dflash", tmp_path / "staging", "vllm", 3, mini / "k2.5-mini")
    exported.folder = tmp_path / "not-yet-there"  # as export's serve.sh names the folder it is renamed to
    script = export.serve_script(exported, Settings(k=3, max_new_tokens=1))
    assert '"method": "dflash"' in script and '"num_speculative_tokens": 3' in script


def test_sglang_serves_a_dflash_export_with_its_flags_and_an_eagle3_one_as_a_chain(tmp_path):
    """SGLang (which needs a GPU: the command is what is checked here) is handed DFLASH and the verify width for
    a block drafter, and EAGLE3 with k steps of top-1 for a chain one; serve.sh says the same wherever the
    exported folder ends up."""
    from engines import export
    from engines.sglang import server_command as sglang_command

    mini = ROOT / "miniworld"
    exported = export.write(mini / "zl-mini-dflash", tmp_path / "staging", "sglang", 3, mini / "k2.5-mini")
    assert exported.method == "dflash" and exported.aux["handed_ids"] == [1, 3, 4]
    assert json.loads((tmp_path / "staging" / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [
        1, 3, 4]  # fmt: skip
    exported.folder = tmp_path / "not-yet-there"
    script = export.serve_script(exported, Settings(k=3, max_new_tokens=1))
    assert "--speculative-algorithm DFLASH" in script and "--speculative-num-draft-tokens 4" in script
    assert "--speculative-num-steps" not in script and "--speculative-eagle-topk" not in script
    s = Settings(k=3, max_new_tokens=8)
    chain = sglang_command(Path("python"), tmp_path, 30000, s, mini / "aq-mini-eagle3")
    assert chain[chain.index("--speculative-algorithm") + 1] == "EAGLE3"
    assert chain[chain.index("--speculative-num-steps") + 1] == "3" and "--speculative-eagle-topk" in chain
    block = sglang_command(Path("python"), tmp_path, 30000, s, mini / "zl-mini-dflash")
    at = block.index("--speculative-algorithm")
    assert block[at + 1] == "DFLASH" and block[block.index("--speculative-num-draft-tokens") + 1] == "4"


def test_each_method_says_which_target_layers_it_reads():
    """What make_data captures for a drafter (the union, for several) comes from each method's own config."""
    for folder in ("zl-mini-dflash", "rh-mini-eagle3"):
        raw = json.loads((ROOT / "miniworld" / folder / "config.json").read_text())
        layers, hidden = folder_method_or_default(ROOT / "miniworld" / folder).reads(ROOT / "miniworld" / folder)
        assert layers == [1, 3, 4] and hidden == raw.get("hidden_size", raw.get("target_hidden_size")), (folder, raw)


def test_the_watch_prices_production_by_its_holders_own_cycle(tmp_path, monkeypatch):
    """A DFlash holder's break-even at each load is one drafter pass, as promote priced it, never a chain's k
    passes (which would read a paying block drafter as below break-even and demote it); an import without a name
    goes to the target's model for its method."""
    from pipeline.watching import priced_for_holder
    from registry.access import store
    from serving import drift
    from tests.helpers.steps import run_step

    k25 = ROOT / "miniworld/k2.5-mini"
    res = run_step("import_drafter", ["--source", str(ROOT / "miniworld/zl-mini-dflash"), "--target", str(k25)],
                   tmp_path, here=True)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    calibrated = load_profile("host-vllm")
    priced = priced_for_holder(store.client(), "k2.5-mini-dflash", "1", calibrated)
    assert priced.draft_shape == "block" and priced.digest == calibrated.digest
    for op in calibrated.operating_points:
        chain, block = (drift.break_even_at(p.operating_points, 3, op.concurrency) for p in (calibrated, priced))
        assert block < chain  # one pass, at what a DFlash pass reads (priced up from the timed step, never down)
        one = next(p for p in priced.operating_points if p.concurrency == op.concurrency)
        assert block == pytest.approx(one.plain_tps * (one.verify_ms + one.draft_step_ms) / 1000)
