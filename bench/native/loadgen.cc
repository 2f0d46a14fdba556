// Closed-loop gRPC load generator in C++ for the benchmarks (bench/native_load.py builds and runs it).
//
// Each of CALLERS callers sends its next pre-serialized request once its last call returns, until every
// request has been sent once. On the 2-core machine the Python generator (grpc.aio on uvloop) took about
// 0.8 ms of CPU per call, as much as the server's frontends, from the same two cores the server runs on;
// this one takes a small fraction of that, so a run measures the server rather than its callers.
//
// usage: loadgen ADDRESS METHOD CALLERS CHANNELS TIMEOUT_S IN OUT
//   IN:  the requests, each as [u32 length][bytes] (little-endian)
//   OUT: [f64 first send][f64 last answer] (CLOCK_MONOTONIC seconds, as Python's time.monotonic), then
//        per request, in IN's order: [i32 status code][f64 latency ms][u32 length][response bytes]
// Exit status: 0 when every request was sent (errors are in OUT), 2 on bad usage or input, 3 when the
// channels do not connect within TIMEOUT_S.

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

struct Result {
  int32_t code = -1;
  double latency_ms = 0.0;
  std::string response;
};

struct Run {
  std::string method;
  std::chrono::milliseconds timeout;
  std::vector<std::string> requests;
  std::vector<Result> results;
  std::atomic<size_t> next{0};
  std::mutex mu;
  std::condition_variable done;
  int active = 0;
  Clock::time_point ended;
};

struct Call {
  size_t index;
  grpc::ClientContext context;
  grpc::ByteBuffer request;
  grpc::ByteBuffer response;
  Clock::time_point sent;
};

std::string bytes_of(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!buffer.Dump(&slices).ok()) return out;
  out.reserve(buffer.Length());
  for (const auto& slice : slices) out.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  return out;
}

// Sends the next request on `stub`; when none is left, this caller is done.
void send_next(Run* run, grpc::GenericStub* stub) {
  size_t index = run->next.fetch_add(1);
  if (index >= run->requests.size()) {
    std::lock_guard<std::mutex> lock(run->mu);
    run->ended = Clock::now();
    if (--run->active == 0) run->done.notify_all();
    return;
  }
  auto* call = new Call{index};
  const std::string& payload = run->requests[index];
  grpc::Slice slice(payload.data(), payload.size());
  call->request = grpc::ByteBuffer(&slice, 1);
  call->sent = Clock::now();
  call->context.set_deadline(std::chrono::system_clock::now() + run->timeout);
  stub->UnaryCall(&call->context, run->method, grpc::StubOptions(), &call->request, &call->response,
                  [run, stub, call](grpc::Status status) {
                    Result& result = run->results[call->index];
                    result.latency_ms = std::chrono::duration<double, std::milli>(Clock::now() - call->sent).count();
                    result.code = status.error_code();
                    if (status.ok()) result.response = bytes_of(call->response);
                    delete call;
                    send_next(run, stub);
                  });
}

bool read_requests(const char* path, std::vector<std::string>* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  uint32_t length;
  while (in.read(reinterpret_cast<char*>(&length), sizeof length)) {
    std::string payload(length, '\0');
    if (!in.read(payload.data(), length)) return false;
    out->push_back(std::move(payload));
  }
  return in.eof() && in.gcount() == 0;  // not a length cut short
}

double monotonic_s(Clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 8) {
    std::cerr << "usage: loadgen ADDRESS METHOD CALLERS CHANNELS TIMEOUT_S IN OUT\n";
    return 2;
  }
  const std::string address = argv[1];
  Run run;
  run.method = argv[2];
  const int callers = std::atoi(argv[3]);
  const int channel_count = std::atoi(argv[4]);
  run.timeout = std::chrono::milliseconds(static_cast<int64_t>(std::atof(argv[5]) * 1000));
  if (callers < 1 || channel_count < 1 || run.timeout.count() <= 0 || !read_requests(argv[6], &run.requests)) {
    std::cerr << "loadgen: bad arguments or unreadable requests file " << argv[6] << "\n";
    return 2;
  }
  run.results.resize(run.requests.size());

  // One connection per channel (a local subchannel pool each): SO_REUSEPORT spreads connections, not
  // channels, over the server's frontends.
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs;
  const auto connect_by = std::chrono::system_clock::now() + run.timeout;
  for (int i = 0; i < std::min(channel_count, callers); ++i) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    auto channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
    if (!channel->WaitForConnected(connect_by)) {
      std::cerr << "loadgen: could not connect to " << address << "\n";
      return 3;
    }
    stubs.push_back(std::make_unique<grpc::GenericStub>(channel));
    channels.push_back(std::move(channel));
  }

  const Clock::time_point began = Clock::now();
  run.active = callers;
  for (int i = 0; i < callers; ++i) send_next(&run, stubs[i % stubs.size()].get());
  {
    std::unique_lock<std::mutex> lock(run.mu);
    run.done.wait(lock, [&run] { return run.active == 0; });
  }

  std::ofstream out(argv[7], std::ios::binary);
  const double times[2] = {monotonic_s(began), monotonic_s(run.ended)};
  out.write(reinterpret_cast<const char*>(times), sizeof times);
  for (const Result& result : run.results) {
    const uint32_t length = static_cast<uint32_t>(result.response.size());
    out.write(reinterpret_cast<const char*>(&result.code), sizeof result.code);
    out.write(reinterpret_cast<const char*>(&result.latency_ms), sizeof result.latency_ms);
    out.write(reinterpret_cast<const char*>(&length), sizeof length);
    out.write(result.response.data(), length);
  }
  out.close();
  return out ? 0 : 2;
}
