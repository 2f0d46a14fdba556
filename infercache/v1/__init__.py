"""Generated gRPC stubs (make stubs): infercache_pb2, infercache_pb2_grpc, worker_pb2, worker_pb2_grpc."""
