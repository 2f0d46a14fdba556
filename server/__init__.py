"""infercache server: supervisor, frontends and the inference worker."""
