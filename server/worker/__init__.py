"""What only the inference worker processes run: flights and coalescing, the batcher, the engines'
runtimes, the semantic index and its checks, the feature tier (L2) and the store writer."""
