"""Reading what the steps logged to a tracking store."""

from __future__ import annotations


def project_runs(c, filter_string: str = "", **kwargs) -> list:
    """The runs the steps logged to the project's experiment (`drafterops`); none when it does not exist."""
    exp = c.get_experiment_by_name("drafterops")
    return c.search_runs([exp.experiment_id], filter_string=filter_string, **kwargs) if exp else []


def all_runs(c) -> list:
    """Every run in every experiment of a store (to check that nothing was written)."""
    return c.search_runs([e.experiment_id for e in c.search_experiments()])
