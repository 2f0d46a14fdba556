"""The worker's semantic answers: the semantic index and its shadow checks, heads and the calibrated
rule, and the semantic answers of generated text."""
