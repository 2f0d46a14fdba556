"""Host-local cache storage: one LMDB environment shared by every process on the host.

Frontends only read; the inference worker is the single writer (see writer.py).
"""
