"""drafterops' domain library: EAGLE-3 drafters in plain PyTorch (no MLflow here)."""
