"""The control plane: catalog, nodes and replicas in SQLite, the admin and agent APIs."""
