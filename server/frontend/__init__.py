"""What only the frontend processes run: the public gRPC API, request planning, L1 and fleet reads,
tokenization, admission, FEATURE answers from stored features, and the frontends' /metrics figures.
Nothing here imports a worker-only module (tests/test_rooms.py checks it in a real frontend)."""
