"""Registers the provisioning runner (provision/, checks/): its one place in a checkout."""

pytest_plugins = ["llmgw_harness.runner"]
