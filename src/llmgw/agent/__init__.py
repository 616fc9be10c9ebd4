"""The node agent: GPU discovery, the llama.cpp engine, heartbeats to the control plane."""
