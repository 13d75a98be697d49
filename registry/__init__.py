"""MLflow Model Registry policy: names, tags, aliases, lineage, promotion (steps -> registry -> drafter)."""
