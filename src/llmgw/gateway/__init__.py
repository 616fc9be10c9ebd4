"""The gateway process: the OpenAI-compatible data plane in front of the replicas."""
