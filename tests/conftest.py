"""Shared pytest configuration: the real local control plane is a session fixture."""

pytest_plugins = ["tests.controlplane.fixtures"]
