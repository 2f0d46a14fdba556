"""Decoder prefix key/value blocks reused across requests: in memory (device, host) and on disk."""
