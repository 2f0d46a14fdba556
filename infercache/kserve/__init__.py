"""Generated gRPC stubs of the KServe v2 protocol (make stubs): grpc_service_pb2, grpc_service_pb2_grpc."""
