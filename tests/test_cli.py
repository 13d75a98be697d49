"""The shared CLI rules that need no step to show them."""

from steps._cli import _no_secrets, none_if_empty


def test_a_storage_password_never_reaches_a_run():
    assert _no_secrets("postgresql://optuna:s3cret@db:5432/optuna") == "postgresql://optuna:***@db:5432/optuna"
    for plain in ("sqlite:////tmp/optuna.db", "models:/k2.5-mini-eagle3@imported", "http://127.0.0.1:5000"):
        assert _no_secrets(plain) == plain


def test_auto_and_none_mean_not_given():
    assert [none_if_empty(v) for v in ("", "auto", "none", "x")] == [None, None, None, "x"]
