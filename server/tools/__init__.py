"""Offline tools of the `infercache` command line: training a head, evaluating semantic matching,
exporting the default model, the engine store and cache CLIs. Serving never imports them."""
