import json
from pathlib import Path

import pytest

from bench.sparse import k2_vocab_maps, write_sparse_safetensors
from common.errors import BadInput
from drafter.analysis.compat import check_compat, compare_drafters, drafter_facts, passed, target_facts, verdict
from tests.helpers.drafters import REFERENCE, k2_drafter_tensors
from tests.helpers.steps import run_step
from tests.helpers.stores import project_runs


def k25_target(tmp_path: Path, vocab: int = 163840, config: str = "kimi-k2.5.config.json", weights=True) -> Path:
    """The real K2.5 config, with a sparse shard holding its embedding and head under language_model."""
    folder = tmp_path / f"target-{vocab}-{weights}"
    folder.mkdir()
    cfg = json.loads((REFERENCE / config).read_text())
    text = cfg.get("text_config", cfg)
    text["vocab_size"] = vocab
    (folder / "config.json").write_text(json.dumps(cfg))
    if weights:
        prefix = "language_model." if "text_config" in cfg else ""
        shard = "model-00001-of-00064.safetensors"
        write_sparse_safetensors(
            folder / shard,
            {
                f"{prefix}model.embed_tokens.weight": ("BF16", [vocab, 7168]),
                f"{prefix}lm_head.weight": ("BF16", [vocab, 7168]),
            },
        )
        (folder / "model.safetensors.index.json").write_text(
            json.dumps(
                {
                    "weight_map": {
                        f"{prefix}model.embed_tokens.weight": shard,
                        f"{prefix}lm_head.weight": shard,
                        f"{prefix}model.layers.60.mlp.gate.weight": "model-00064-of-00064.safetensors",
                    }
                }
            )
        )
    return folder


def failing(checks):
    return sorted(c.name for c in checks if c.ok is False)


def test_real_k2_drafter_fits_real_k25(k2_sparse_drafter, tmp_path):
    checks = check_compat(drafter_facts(k2_sparse_drafter), target_facts(k25_target(tmp_path)))
    assert failing(checks) == [] and passed(checks) and verdict(checks) == "passed"
    emb = next(c for c in checks if c.name == "embed_tokens (from target)")
    assert emb.ok is True and "language_model.model.embed_tokens.weight" in emb.note
    assert next(c for c in checks if c.name == "d2t/t2d consistent").ok is True


@pytest.mark.parametrize("family", range(3), ids=["k2-llama", "k25-mla-torchspec", "k25-mla-modelopt"])
def test_each_public_family_fits_real_k25_from_headers_alone(tmp_path, family):
    """The real shapes of each public family's drafter, in the layout it ships in, gate against Kimi-K2.5
    from headers and the small vocab maps: passed, with the family's own tensors checked."""
    from bench._common import bytes_read
    from bench.gate import FAMILIES, k25_target, sparse_drafter

    name, config, layout = FAMILIES[family]
    sparse_drafter(tmp_path / "d", config, layout)
    target = k25_target(tmp_path / "t")
    before = bytes_read()
    checks = check_compat(drafter_facts(tmp_path / "d"), target_facts(target))
    assert bytes_read() - before < 2**20
    assert verdict(checks) == "passed", [c for c in checks if c.ok is False]
    kind = next(c for c in checks if c.name == "draft layer family")
    assert kind.expected == ("llama" if family == 0 else "mla")
    if family:
        assert any(c.name == "midlayer.self_attn.kv_b_proj.weight" and c.ok for c in checks)


def test_config_only_target_leaves_weight_checks_unchecked(k2_sparse_drafter, tmp_path):
    checks = check_compat(drafter_facts(k2_sparse_drafter), target_facts(k25_target(tmp_path, weights=False)))
    assert passed(checks) and verdict(checks) == "passed-config-only"  # "not checked" is never a pass
    assert next(c for c in checks if c.name == "embed_tokens (from target)").ok is None


@pytest.mark.parametrize(
    "embedding, why",
    [
        (None, "MISSING"),  # the weights are known, the embedding is not under the expected name
        (("F32", [163840, 7168]), "F32"),
        (("BF16", [163840, 4096]), "4096"),
    ],
)
def test_a_known_target_whose_embedding_is_missing_or_wrong_fails(k2_sparse_drafter, tmp_path, embedding, why):
    folder = tmp_path / "target"
    folder.mkdir()
    (folder / "config.json").write_text((REFERENCE / "kimi-k2.5.config.json").read_text())
    tensors = {"language_model.lm_head.weight": ("BF16", [163840, 7168])}
    if embedding is None:
        tensors["language_model.model.embed_tokens_renamed.weight"] = ("BF16", [163840, 7168])
    else:
        tensors["language_model.model.embed_tokens.weight"] = embedding
    write_sparse_safetensors(folder / "model.safetensors", tensors)
    checks = check_compat(drafter_facts(k2_sparse_drafter), target_facts(folder))
    emb = next(c for c in checks if c.name == "embed_tokens (from target)")
    assert emb.ok is False and why in emb.actual and verdict(checks) == "failed"


def test_deepseek_v3_vocab_fails_on_t2d_and_vocab(k2_sparse_drafter, tmp_path):
    checks = check_compat(drafter_facts(k2_sparse_drafter), target_facts(k25_target(tmp_path, vocab=129280)))
    assert failing(checks) == ["t2d", "vocab_size"]


def test_aux_layer_ids_beyond_the_target_fail(k2_sparse_drafter, tmp_path):
    cfg = json.loads((k2_sparse_drafter / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 30, 61]
    (k2_sparse_drafter / "config.json").write_text(json.dumps(cfg))
    checks = check_compat(drafter_facts(k2_sparse_drafter), target_facts(k25_target(tmp_path)))
    assert failing(checks) == ["aux layer ids"]


@pytest.mark.parametrize("tensor", sorted(k2_drafter_tensors()))
def test_each_mutated_tensor_fails_its_own_check_only(tmp_path, tensor):
    tensors = k2_drafter_tensors()
    dtype, shape = tensors[tensor]
    tensors[tensor] = (dtype, [shape[0] + 8, *shape[1:]])
    folder = tmp_path / "mutant"
    folder.mkdir()
    (folder / "config.json").write_text((REFERENCE / "kimi-k2-eagle3.config.json").read_text())
    data = {k: v for k, v in k2_vocab_maps().items() if k != tensor}
    write_sparse_safetensors(folder / "model.safetensors", tensors, data=data)
    checks = check_compat(drafter_facts(folder), target_facts(k25_target(tmp_path)))
    assert failing(checks) == [tensor]


def test_config_disagreeing_with_its_tensors_reports_both(k2_sparse_drafter, tmp_path):
    cfg = json.loads((k2_sparse_drafter / "config.json").read_text())
    cfg["hidden_size"] = 4096
    (k2_sparse_drafter / "config.json").write_text(json.dumps(cfg))
    checks = {c.name: c for c in check_compat(drafter_facts(k2_sparse_drafter), target_facts(k25_target(tmp_path)))}
    assert checks["fc.weight"].ok is False
    assert checks["fc.weight"].expected.startswith("[4096, 21504]") and checks["fc.weight"].actual.startswith(
        "[7168, 21504]"
    )


def test_two_drafter_comparison_has_the_seed_layout(k2_sparse_drafter, tmp_path):
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "config.json").write_text((REFERENCE / "kimi-k2-eagle3.config.json").read_text())
    tensors = k2_drafter_tensors() | {"embed_tokens.weight": ("BF16", [163840, 7168])}
    write_sparse_safetensors(ours / "model.safetensors", tensors)
    rows = {r[0]: r for r in compare_drafters(drafter_facts(k2_sparse_drafter).header, drafter_facts(ours).header)}
    assert rows["fc.weight"] == ("fc.weight", "[7168, 21504] BF16", "[7168, 21504] BF16", "YES")
    assert rows["lm_head.weight"][3] == "YES"
    assert rows["embed_tokens.weight"] == ("embed_tokens.weight", "MISSING", "[163840, 7168] BF16", "MISSING")


def test_target_config_without_required_fields(tmp_path):
    folder = tmp_path / "t"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"text_config": {"hidden_size": 7168, "vocab_size": 10}}))
    with pytest.raises(BadInput, match=r"\(text_config\): missing required field 'num_hidden_layers'"):
        target_facts(folder)


def gate(*args, cwd):
    return run_step("shape_gate", list(args), cwd)


def test_gate_step_on_registry_versions(tiny_targets, drafter_factory, tmp_path):
    import mlflow

    from drafter.formats.checkpoint import save_drafter

    flat, wrapped = tiny_targets
    vocab = json.loads((flat / "config.json").read_text())["vocab_size"]
    save_drafter(
        drafter_factory(vocab_size=vocab, draft_vocab_size=64, aux_layer_ids=[0, 2, 3]),
        tmp_path / "d",
        include_embedding=False,
    )
    imp = run_step("import_drafter", ["--source", str(tmp_path / "d"), "--target", str(wrapped)], tmp_path)
    assert imp.returncode == 0, imp.stderr[-2000:]
    good = gate(
        "--model",
        "models:/k25-tiny-eagle3@imported",
        "--target",
        str(wrapped),
        "--reference",
        str(tmp_path / "d"),
        cwd=tmp_path,
    )
    assert good.returncode == 0, good.stdout + good.stderr[-2000:]
    assert "| fc.weight | [32, 96] BF16 | [32, 96] BF16 | PASS |" in good.stdout
    assert "| fc.weight | [32, 96] BF16 | [32, 96] BF16 | YES |" in good.stdout
    assert "| embed_tokens (from target) |" in good.stdout and "shape_gate: PASSED" in good.stdout
    c = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    mv = c.get_model_version("k25-tiny-eagle3", "1")
    assert mv.tags["shape_gate"] == "passed" and "Shape gate vs" in mv.description
    run = project_runs(c, filter_string="tags.`drafterops.step` = 'shape_gate'")[0]
    assert "shape_gate.json" in {a.path for a in c.list_artifacts(run.info.run_id)}
    other = tmp_path / "other-target"
    other.mkdir()
    cfg = json.loads((wrapped / "config.json").read_text())
    cfg["text_config"]["vocab_size"] = 512
    (other / "config.json").write_text(json.dumps(cfg))
    bad = gate("--model", "models:/k25-tiny-eagle3/1", "--target", str(other), cwd=tmp_path)
    assert bad.returncode == 1 and "shape_gate: FAILED (vocab_size, t2d)" in bad.stdout, bad.stdout + bad.stderr
    mv = c.get_model_version("k25-tiny-eagle3", "1")
    assert mv.tags["shape_gate"] == "failed" and mv.description.count("## Shape gate") == 2
    assert str(c.get_model_version_by_alias("k25-tiny-eagle3", "imported").version) == "1"
    missing = gate("--model", "models:/k25-tiny-eagle3/7", "--target", str(wrapped), cwd=tmp_path)
    assert missing.returncode == 2 and "no such registered model version" in missing.stderr
