// The floor of a native gRPC server for the benchmarks (bench/peers_hits.py builds and runs it through
// bench/native_load.py): every call of any method answered with fixed bytes, no parsing, no cache work.
// It measures what gRPC's C++ server costs per call on this machine, the bound of a hit path written in
// C++ (Triton's response cache answers from such a server), beside the grpc.aio floor in Python.
//
// usage: floor PORT ANSWER_FILE   (prints "ready" once it listens on 127.0.0.1:PORT; serves until killed)

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/byte_buffer.h>

#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <string>

namespace {

// One call: the request read (one message, then the client's half-close), the fixed answer written.
class Answer : public grpc::ServerGenericBidiReactor {
 public:
  explicit Answer(const grpc::ByteBuffer& answer) : answer_(answer) { StartRead(&request_); }

  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no request"));
      return;
    }
    StartWriteAndFinish(&answer_, grpc::WriteOptions(), grpc::Status::OK);
  }

  void OnDone() override { delete this; }

 private:
  grpc::ByteBuffer request_;
  grpc::ByteBuffer answer_;
};

class Floor : public grpc::CallbackGenericService {
 public:
  explicit Floor(std::string answer) : bytes_(std::move(answer)) {
    grpc::Slice slice(bytes_);
    answer_ = grpc::ByteBuffer(&slice, 1);
  }

  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    return new Answer(answer_);
  }

 private:
  std::string bytes_;
  grpc::ByteBuffer answer_;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: floor PORT ANSWER_FILE\n";
    return 2;
  }
  std::ifstream in(argv[2], std::ios::binary);
  if (!in) {
    std::cerr << "cannot read " << argv[2] << "\n";
    return 2;
  }
  std::string answer((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  Floor service(std::move(answer));
  grpc::ServerBuilder builder;
  builder.AddListeningPort(std::string("127.0.0.1:") + argv[1], grpc::InsecureServerCredentials());
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server) {
    std::cerr << "cannot listen on 127.0.0.1:" << argv[1] << "\n";
    return 3;
  }
  std::cout << "ready" << std::endl;
  server->Wait();
  return 0;
}
