"""One module a revision, named NNNN_what.py; each frozen once released."""
