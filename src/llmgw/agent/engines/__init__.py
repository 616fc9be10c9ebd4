"""A node's engines: the CPU and GPU builds of llama.cpp, and the prebuilt one."""
