"""Registers the llmgw fixtures plugin: the one place it is loaded."""

pytest_plugins = ["llmgw_harness.plugin"]
