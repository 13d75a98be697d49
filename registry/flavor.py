"""The pyfunc loader path of versions registered before registry/ had its two rooms: MLflow keeps
`loader_module: registry.flavor` in their MLmodel files, and `mlflow.pyfunc.load_model` imports it by that
name. The flavor itself is registry/access/flavor.py."""

from registry.access.flavor import _load_pyfunc  # noqa: F401
