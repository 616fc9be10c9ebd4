"""What every process knows of a model: GGUF metadata, KV sizing, engine arguments."""
