"""A node's replicas: the engine processes it runs, supervised, probed, given up on."""
