"""The EC (encoder cache) store: its byte quantities and budget (pure), the janitor sidecar
that keeps each unit's store under that budget, and the operator's scrape of the janitors.
docs/ec-storage.md explains the design."""
