"""Runtimes behind one interface (base.Engine); one module per runtime."""
