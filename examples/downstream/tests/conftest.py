"""llmgw's fixtures (llmgw_host, llmgw_endpoint, llmgw_openai, llmgw_admin), registered once."""

pytest_plugins = ["llmgw_harness.plugin"]
