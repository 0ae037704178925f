// The gRPC transport (serving_loader/native/grpc_transport.h) as a process of
// its own, without Python, for running it under sanitizers: it listens on
// 127.0.0.1 (a free port, printed as "port N"), idle timeout 500 ms, messages
// up to 1 MiB, and answers every call from a responder thread:
//   .../Echo   status 0, the request message as the answer;
//   .../Slow   waits 200 ms, then answers as Echo if the call is still alive
//              (its client has not reset it), else counts it as skipped;
//   else       status 3 (INVALID_ARGUMENT) with ":path: message" as the
//              grpc-message (as long as the client made them).
// It stops when stdin closes, then prints "cancelled N skipped M" and exits 0.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "grpc_transport.h"

using evstore_grpc::Call;
using evstore_grpc::Frontend;
using evstore_grpc::Reply;
using evstore_grpc::StatusMessage;

namespace {

bool EndsWith(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

int main() {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(fd, 1024) != 0) {
    perror("listen");
    return 2;
  }
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  Frontend fe(fd, 1 << 20, std::chrono::milliseconds(500));
  std::string error;
  if (!fe.Start(&error)) {
    fprintf(stderr, "start: %s\n", error.c_str());
    return 2;
  }
  printf("port %d\n", ntohs(addr.sin_port));
  fflush(stdout);

  size_t skipped = 0;
  std::thread responder([&] {
    std::vector<Call> calls;
    while (true) {
      calls.clear();
      if (!fe.Next(64, 0.1, &calls)) return;
      for (Call& c : calls) {
        if (EndsWith(c.path, "/Slow")) {
          std::this_thread::sleep_for(std::chrono::milliseconds(200));
          if (!fe.Alive(c.id)) {
            ++skipped;
            continue;
          }
        }
        if (EndsWith(c.path, "/Echo") || EndsWith(c.path, "/Slow"))
          fe.Respond(Reply{c.id, 0, "", std::move(c.message)});
        else
          fe.Respond(Reply{c.id, 3, StatusMessage(c.path + ": " + c.message), ""});
      }
    }
  });

  char buf[256];
  while (fgets(buf, sizeof(buf), stdin) != nullptr) {
  }
  fe.Stop();
  responder.join();
  printf("cancelled %llu skipped %zu\n", static_cast<unsigned long long>(fe.Cancelled()), skipped);
  return 0;
}
