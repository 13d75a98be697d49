"""From registry to server: the speculators format both ways (the same tensors, every key vLLM needs, what
the project's drafter is not refused by name), and `export` of a promoted version: the folder, serve.sh,
EXPORT.md, the record of it, and bad input (exit 2, nothing written). Served by vLLM in test_engine_vllm.py."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
from safetensors.torch import load_file, save_file

from common.errors import BadInput
from drafter.formats.checkpoint import load_config, save_drafter
from drafter.formats.speculators import from_speculators, is_speculators, to_speculators
from tests.helpers.drafters import tiny_drafter
from tests.helpers.promotion import evaluate, register_gated, write_profiles
from tests.helpers.steps import run_step

ROOT = Path(__file__).resolve().parents[1]
MINI = ROOT / "miniworld" / "aq-mini-eagle3"


def test_project_to_speculators_and_back_is_the_same_drafter(tmp_path):
    spec = to_speculators(MINI, tmp_path / "spec", "some/verifier", ["DeepseekV3ForCausalLM"], 3)
    raw = json.loads((spec / "config.json").read_text())
    assert raw["speculators_model_type"] == "eagle3" and is_speculators(spec)
    assert {k: raw[k] for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")} == dict.fromkeys(
        ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"), False
    )
    assert raw["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM reads id i as layer i's input
    assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert raw["speculators_config"]["verifier"]["name_or_path"] == "some/verifier"
    assert raw["transformer_layer_config"]["num_hidden_layers"] == 1 and raw["draft_vocab_size"] == 1024
    names = set(load_file(str(spec / "model.safetensors")))
    assert "layers.0.self_attn.q_proj.weight" in names and not any(n.startswith("midlayer.") for n in names)
    back = from_speculators(spec, tmp_path / "back")
    a, b = load_file(str(MINI / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert set(a) == set(b) and all(a[k].dtype == b[k].dtype and a[k].equal(b[k]) for k in a)
    assert load_config(back).to_dict() == load_config(MINI).to_dict()


def hand_written_speculators(folder: Path, vocab: int, **flags) -> Path:
    """A tiny EAGLE-3 drafter in the speculators format as vLLM's docs describe it, written here by hand
    (not by the project's converter): decoder settings under transformer_layer_config, `layers.0.` names."""
    project = folder.parent / f"{folder.name}-project"
    save_drafter(tiny_drafter(seed=3, vocab_size=vocab, draft_vocab_size=128, aux_layer_ids=[0, 1, 2]), project,
                 include_embedding=False)  # fmt: skip
    tensors = load_file(str(project / "model.safetensors"))
    folder.mkdir(parents=True)
    save_file({k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}, str(folder / "model.safetensors"))
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        "transformer_layer_config": {
            "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 1, "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256, "vocab_size": vocab,
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
        },
        "draft_vocab_size": 128,
        "target_hidden_size": 32,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 2}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "tiny/verifier", "architectures": ["DeepseekV3ForCausalLM"]},
        },
        **flags,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "README.md").write_text("---\nlicense: apache-2.0\n---\nA tiny speculator, 1k training samples.\n")
    return folder


@pytest.mark.parametrize(
    "flags,words",
    [
        ({"norm_before_fc": "yes"}, "'norm_before_fc' is 'yes'; it must be true or false"),
        ({"speculators_model_type": "dflash"}, "speculators_model_type is 'dflash'"),
        ({"eagle_aux_hidden_state_layer_ids": None}, "no 'eagle_aux_hidden_state_layer_ids'"),
        ({"drafterops_aux_layer_convention": "sglang"}, "vLLM reads these ids as 'vllm'"),
        ({"drafterops_eagle_config": [1]}, "'drafterops_eagle_config' must be a mapping"),
        ({"drafterops_eagle_config": {"use_aux_hidden_state": False}}, "keeps use_aux_hidden_state true"),
    ],
)
def test_what_the_project_drafter_is_not_is_refused_by_name(tmp_path, flags, words):
    folder = hand_written_speculators(tmp_path / "spec", 300, **flags)
    with pytest.raises(BadInput) as err:
        from_speculators(folder, tmp_path / "out")
    assert words in str(err.value) and "config.json" in str(err.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags", [{"norm_output": True}, {}])
def test_eagle31_flags_are_read_as_vllm_reads_them(tmp_path, flags):
    """norm_output (no tensors of its own) is imported as the drafter's; a folder without
    norm_before_residual is the network vLLM builds from it: norm_before_residual true."""
    folder = hand_written_speculators(tmp_path / "spec", 300, **flags)
    raw = json.loads((folder / "config.json").read_text())
    if not flags:
        del raw["norm_before_residual"]
        (folder / "config.json").write_text(json.dumps(raw))
    cfg = load_config(from_speculators(folder, tmp_path / "out"))
    assert cfg.norm_output is bool(flags) and cfg.norm_before_residual is not bool(flags)


def test_project_names_inside_a_speculators_folder_are_refused(tmp_path):
    """A `midlayer.` tensor beside `layers.0.` would be overwritten by the renamed one: refused, not merged."""
    folder = hand_written_speculators(tmp_path / "spec", 300)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["midlayer.input_layernorm.weight"] = tensors["layers.0.input_layernorm.weight"] * 0
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(BadInput, match="has the project's name inside a speculators folder"):
        from_speculators(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------ the registry side (steps)
@pytest.fixture(scope="module")
def promoted(tiny_targets, trained_tiny, tmp_path_factory):
    """v1 evaluated on a lenient profile and promoted to staging; v2 gated but holding no serving alias."""
    tmp = tmp_path_factory.mktemp("export")
    _, wrapped = tiny_targets
    write_profiles(tmp, wrapped)
    register_gated(tmp, wrapped, trained_tiny, (1, 2))
    evaluate(tmp, "models:/k25-tiny-eagle3/1", wrapped, tmp / "lenient.yaml")
    done = run_step("promote", ["--model", "models:/k25-tiny-eagle3/1", "--profile", str(tmp / "lenient.yaml"),
                                "--stage", "staging"], tmp)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return tmp


def test_a_hand_written_speculators_drafter_imports_gates_and_evaluates(promoted, tiny_targets):
    tmp = promoted
    _, wrapped = tiny_targets
    vocab = json.loads((wrapped / "config.json").read_text())["text_config"]["vocab_size"]
    folder = hand_written_speculators(tmp / "speculator", vocab)
    done = run_step("import_drafter", ["--source", str(folder), "--target", str(wrapped), "--name", "spec-tiny"], tmp)
    assert done.returncode == 0, done.stderr
    c = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    mv = c.get_model_version("spec-tiny", "1")
    assert mv.tags["converted_from"] == "speculators" and mv.tags["speculators.verifier"] == "tiny/verifier"
    assert mv.tags["card.license"] == "apache-2.0"
    gate = run_step("shape_gate", ["--model", "models:/spec-tiny/1", "--target", str(wrapped)], tmp)
    assert gate.returncode == 0, gate.stdout + gate.stderr
    evaluate(tmp, "models:/spec-tiny/1", wrapped, tmp / "lenient.yaml", "--limit", "4")
    refused = hand_written_speculators(tmp / "speculator-fc", vocab, norm_before_fc=True)
    no = run_step("import_drafter", ["--source", str(refused), "--target", str(wrapped), "--name", "spec-fc"], tmp)
    assert no.returncode == 2 and "missing tensors: input_norm.weight" in no.stderr and len(no.stderr.splitlines()) == 1
    assert "spec-fc" not in [m.name for m in c.search_registered_models()]


@pytest.mark.parametrize("engine", ["vllm", "speculators", "sglang"])
def test_export_writes_what_the_engine_loads_and_the_command_that_serves_it(promoted, engine):
    tmp = promoted
    out = tmp / f"export-{engine}"
    done = run_step(
        "export", ["--model", "models:/k25-tiny-eagle3@staging", "--engine", engine, "--out", str(out)], tmp
    )
    assert done.returncode == 0, done.stdout + done.stderr
    config = json.loads((out / "config.json").read_text())
    script = (out / "serve.sh").read_text()
    story = (out / "EXPORT.md").read_text()
    assert (out / "serve.sh").stat().st_mode & 0o111
    assert "embed_tokens.weight" not in load_file(str(out / "model.safetensors"))
    assert config["norm_before_residual"] is False and config["norm_before_fc"] is False
    if engine == "vllm":
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
        assert '"num_speculative_tokens": 2' in script and '"model": "\'"$DRAFTER"\'"' in script
    elif engine == "speculators":
        assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
        assert '--model "$DRAFTER"' in script and "--speculative-config" not in script
    else:
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
        assert "--speculative-algorithm EAGLE3" in script and "--speculative-num-draft-tokens 3" in script
    c = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    evidence_run = c.search_runs(
        [c.get_experiment_by_name("drafterops-audit").experiment_id], "tags.decision = 'promote:staging:yes'"
    )[0].data.tags["evidence_run"]
    assert "models:/k25-tiny-eagle3/1` (staging)" in story and evidence_run in story and "k=2" in story
    assert c.get_model_version("k25-tiny-eagle3", "1").tags[f"exported.{engine}"].startswith("run ")
    # speculation_profile.json beside the weights: the decided record's own figures, passing its own checks
    from registry.ledger.evidence.verify import read_record
    from serving.speculation_profile import read_external

    saved = Path(c.download_artifacts(evidence_run, "evidence.json", str(tmp / f"ev-{engine}")))
    record = read_record(saved.read_text(), evidence_run)
    profile = read_external(out / "speculation_profile.json")
    assert profile.k == 2 and profile.accept_len == pytest.approx(record.histograms().accept_len, abs=1e-6)
    assert json.loads((out / "speculation_profile.json").read_text())["measurement_conditions"]["evidence_run"] == (
        evidence_run
    )


def test_export_bad_input_is_one_line_and_writes_nothing(promoted):
    tmp = promoted
    c = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    before = len(
        c.search_runs([e.experiment_id for e in c.search_experiments()], "tags.`mlflow.runName` LIKE 'export%'")
    )
    taken = tmp / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("keep")
    (tmp / "empty").mkdir(exist_ok=True)
    link = tmp / "link"
    link.symlink_to(tmp / "empty")
    mini = str(ROOT / "miniworld" / "k2.5-mini")
    cases = [
        (["--engine", "trt", "--out", str(tmp / "x1")], "--engine must be one of sglang, vllm, speculators"),
        (["--out", str(taken)], "exists and is not an empty folder"),
        (["--model", "models:/k25-tiny-eagle3/2", "--out", str(tmp / "x2")], "holds no serving alias"),
        (["--target", mini, "--out", str(tmp / "x3")], "has no shape-gate pass against"),
        (["--model", str(tmp / "d1"), "--out", str(tmp / "x4")], "--model must be a registry URI"),
        (["--out", str(tmp / "x5'$(reboot)")], "cannot be served safely"),
        (["--out", str(tmp / "x6"), "--draft_steps", "2.7"], "--draft_steps must be a whole number from 1 to 64"),
        (["--out", str(tmp / "x7"), "--draft_steps", "inf"], "--draft_steps must be a whole number"),
        (["--out", str(tmp / "x8"), "--draft_steps", "1e9"], "--draft_steps must be a whole number"),
        (["--out", str(taken / "mine.txt" / "sub")], "under a file"),
        (["--out", str(link)], "a link"),
    ]
    for args, words in cases:
        args = ["--model", "models:/k25-tiny-eagle3@staging", *args] if "--model" not in args else args
        done = run_step("export", args, tmp)
        assert done.returncode == 2 and words in done.stderr, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1
    assert (
        not any((tmp / f"x{i}").exists() for i in range(1, 5))
        and not (tmp / "x5'$(reboot)").exists()
        and (taken / "mine.txt").read_text() == "keep"
    )
    assert [p.name for p in taken.iterdir()] == ["mine.txt"]
    assert not [p for p in tmp.iterdir() if p.name.startswith(".x")]  # no half-written staging folder left
    after = len(
        c.search_runs([e.experiment_id for e in c.search_experiments()], "tags.`mlflow.runName` LIKE 'export%'")
    )
    assert after == before
