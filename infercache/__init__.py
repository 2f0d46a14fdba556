"""infercache client package: generated `infercache.v1` stubs and a small Python client (client.py)."""
