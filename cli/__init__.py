"""The steps' shared command line: each parameter declared once (spec), and the contract every step keeps (step):
exit codes, one-line errors, tracebacks to a log, and the MLflow run a step opens."""
