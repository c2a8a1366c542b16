"""End-to-end tests: Prefect deployment runs, export and evaluation of published versions."""
