// gRPC's transport for `evstore serve`, outside Python (no Python in this
// header: grpc_frontend.cc binds it, tests/native build it under sanitizers).
//
// Layout: one network thread owns every connection. It accepts, speaks HTTP/2
// through nghttp2 (Debian's libnghttp2: framing, HPACK, flow control, PING,
// SETTINGS) and gRPC's message framing (a 1-byte compressed flag and a 4-byte
// big-endian length before each message, the status in trailers). A request
// whose stream has ended becomes a Call {id, :path, message bytes, encoding} in
// a queue (a compressed message, grpc-encoding gzip or deflate, is passed on as
// it came: Python inflates it, bounded by the same size cap; a grpc-timeout
// becomes the seconds left when Python takes the call);
// Python takes whole batches of Calls with next() (the GIL is released while it
// waits) and answers each with respond(id, status, message, body) from any
// thread, which queues a Reply and wakes the network thread through an eventfd.
//
// Invariants:
//  * Only the network thread touches sockets and nghttp2 sessions; `mu_` guards
//    the two queues, `live_` and `closed_`, and Respond writes the eventfd under it, so a
//    reply after Stop is dropped instead of written to a closed (or reused) fd.
//  * A call id is (connection serial << 32) | stream id; serials are never reused,
//    so a Reply for a connection or stream that has gone is dropped, never
//    delivered to a newer one.
//  * A stream is answered at most once: the first Reply submits the response and
//    marks it; a stream closed by the client before its Reply is forgotten.
//  * Per call, Python sees each message once, whole, after END_STREAM; a message
//    over `max_message` bytes is not buffered past the limit and is answered
//    RESOURCE_EXHAUSTED here.
//  * Every grpc-message is at most kMaxStatusMessage bytes before percent-encoding
//    (StatusMessage cuts longer ones), so an error that echoes a 70,000-byte
//    client field still fits nghttp2's header block and is delivered; a response
//    whose headers cannot be sent anyway is reset (RST_STREAM INTERNAL_ERROR),
//    never left for the client to wait on.
//  * A call whose stream the client resets (or whose connection closes) before
//    Python takes it is never handed to Python; one taken but not answered is
//    reported gone by Alive(id), so the model does not run it (`live_`, under mu_).
//  * A connection whose socket refuses output is not read until it takes it again
//    (WantOut), so output per connection is bounded by what its client reads.
//  * A connection with no call at the model that has received nothing for
//    `idle_timeout` is told GOAWAY and closed (idle_timeout zero: never).
//  * A connection buffers at most kConnectionBudget * `max_message` bytes of
//    unfinished requests (Conn::buffered, the sum of its streams' `data`): the
//    stream whose DATA would cross it is dropped and answered RESOURCE_EXHAUSTED,
//    so a client cannot hold 1,000 streams of `max_message` bytes each.
#pragma once

#include <nghttp2/nghttp2.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace evstore_grpc {

constexpr uint64_t kListenTag = 0;
constexpr uint64_t kWakeTag = 1;
constexpr int kResourceExhausted = 8;
constexpr int kUnimplemented = 12;
constexpr int kInternal = 13;
constexpr size_t kConnectionBudget = 4;   // unfinished request bytes per connection, in max messages
// Longest grpc-message, in bytes before percent-encoding (at most 3x that after):
// far below nghttp2's 64 KiB header block, with room for every other field.
constexpr size_t kMaxStatusMessage = 1024;
constexpr std::string_view kCut = "...";   // ends a message that was cut

// A header field; nghttp2 copies name and value when the frame is submitted.
inline nghttp2_nv Nv(std::string_view name, std::string_view value) {
  return {reinterpret_cast<uint8_t*>(const_cast<char*>(name.data())),
          reinterpret_cast<uint8_t*>(const_cast<char*>(value.data())), name.size(), value.size(),
          NGHTTP2_NV_FLAG_NONE};
}

struct Call {
  uint64_t id;
  std::string path;
  std::string message;
  std::string encoding;   // "gzip" or "deflate" for a compressed message, else empty
  std::optional<std::chrono::steady_clock::time_point> deadline;   // from grpc-timeout
};

// gRPC's Timeout header: 1 to 8 ASCII digits and a unit (H M S m u n).
// False (no deadline) for anything else, as a malformed header is ignored.
inline bool ParseTimeout(std::string_view v, std::chrono::nanoseconds* out) {
  if (v.size() < 2 || v.size() > 9) return false;
  int64_t n = 0;
  for (char ch : v.substr(0, v.size() - 1)) {
    if (ch < '0' || ch > '9') return false;
    n = n * 10 + (ch - '0');
  }
  int64_t unit_ns;
  switch (v.back()) {
    case 'H': unit_ns = 3600LL * 1000000000LL; break;
    case 'M': unit_ns = 60LL * 1000000000LL; break;
    case 'S': unit_ns = 1000000000LL; break;
    case 'm': unit_ns = 1000000LL; break;
    case 'u': unit_ns = 1000LL; break;
    case 'n': unit_ns = 1LL; break;
    default: return false;
  }
  constexpr int64_t kMaxNs = 100LL * 365 * 24 * 3600 * 1000000000LL;   // 99,999,999 H overflows int64 ns
  *out = std::chrono::nanoseconds(n > kMaxNs / unit_ns ? kMaxNs : n * unit_ns);
  return true;
}

// Request encodings this server reads (compressed messages are inflated in
// Python); every response advertises them, as gRPC's compression spec asks.
constexpr std::string_view kAcceptEncoding = "identity,deflate,gzip";

struct Reply {
  uint64_t id;
  int status;
  std::string message;   // grpc-message, already percent-encoded
  std::string body;      // the serialized answer (status 0 only)
};

struct Stream {
  std::string path, method, content_type, encoding;
  std::optional<std::chrono::steady_clock::time_point> deadline;
  std::string data;      // received bytes, gRPC prefix included
  // Why `data` was dropped: the message is over the cap, or the connection over its budget.
  enum class Dropped { kNo, kTooLarge, kOverBudget } dropped = Dropped::kNo;
  bool at_model = false;   // handed to Python as a Call
  bool answered = false;
  std::string out;       // prefix + answer
  size_t out_pos = 0;
  std::string status, message;   // trailers

  // grpc-status and grpc-message (when there is one), after `head` fields.
  std::vector<nghttp2_nv> Trailers(std::vector<nghttp2_nv> head = {}) const {
    head.push_back(Nv("grpc-status", status));
    if (!message.empty()) head.push_back(Nv("grpc-message", message));
    return head;
  }
};

class Frontend;

struct Conn {
  Frontend* fe = nullptr;
  int fd = -1;
  uint64_t serial = 0;
  nghttp2_session* session = nullptr;
  std::unordered_map<int32_t, std::unique_ptr<Stream>> streams;
  size_t buffered = 0;   // bytes in the streams' `data`
  std::string outbuf;
  size_t outpos = 0;
  bool epollout = false;
  std::chrono::steady_clock::time_point last_read;   // when bytes last came in (or the connection opened)
};

inline std::string PercentEncode(std::string_view s) {   // gRPC's grpc-message encoding
  static const char* hex = "0123456789ABCDEF";
  std::string out;
  out.reserve(s.size());
  for (unsigned char c : s) {
    if (c >= 0x20 && c <= 0x7E && c != '%') {
      out.push_back(static_cast<char>(c));
    } else {
      out.push_back('%');
      out.push_back(hex[c >> 4]);
      out.push_back(hex[c & 15]);
    }
  }
  return out;
}

// The grpc-message of `s`: its first kMaxStatusMessage bytes (cut back to a
// UTF-8 character boundary, then "..." when anything was cut), percent-encoded.
inline std::string StatusMessage(std::string_view s) {
  if (s.size() > kMaxStatusMessage) {
    size_t n = kMaxStatusMessage - kCut.size();
    while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;   // s[n] continues a character
    return PercentEncode(std::string(s.substr(0, n)) + std::string(kCut));
  }
  return PercentEncode(s);
}

class Frontend {
 public:
  // idle_timeout: a connection with no call at the model that has received
  // nothing for this long is closed (zero: never).
  Frontend(int listen_fd, size_t max_message, std::chrono::milliseconds idle_timeout = {})
      : listen_fd_(listen_fd), max_message_(max_message), idle_timeout_(idle_timeout) {}

  ~Frontend() { Stop(); }

  bool Start(std::string* error) {
    spare_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
    epfd_ = epoll_create1(EPOLL_CLOEXEC);
    wakefd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (epfd_ < 0 || wakefd_ < 0) {
      *error = std::string("epoll/eventfd: ") + strerror(errno);
      return false;
    }
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = kListenTag;
    epoll_ctl(epfd_, EPOLL_CTL_ADD, listen_fd_, &ev);
    ev.data.u64 = kWakeTag;
    epoll_ctl(epfd_, EPOLL_CTL_ADD, wakefd_, &ev);
    thread_ = std::thread([this] { Run(); });
    return true;
  }

  void Stop() {
    if (!thread_.joinable()) return;
    stopping_.store(true);
    Wake();
    thread_.join();
    {
      std::lock_guard<std::mutex> lk(mu_);
      closed_ = true;   // from here on Respond drops its reply and never touches wakefd_
    }
    cv_.notify_all();
    close(listen_fd_);
    close(epfd_);
    close(wakefd_);
    if (spare_fd_ >= 0) close(spare_fd_);
  }

  // Up to `max_n` calls, waiting up to `timeout_s` for the first; false once stopped and drained.
  bool Next(size_t max_n, double timeout_s, std::vector<Call>* out) {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), [&] { return !calls_.empty() || closed_; });
    while (!calls_.empty() && out->size() < max_n) {
      if (live_.count(calls_.front().id) != 0) out->push_back(std::move(calls_.front()));
      else ++cancelled_;   // reset by its client while queued: never reaches the model
      calls_.pop_front();
    }
    return !(out->empty() && closed_);
  }

  // False once call `id` is answered or its client has reset it (or gone):
  // a call still waiting for the model is then not run. Any thread.
  bool Alive(uint64_t id) {
    std::lock_guard<std::mutex> lk(mu_);
    return live_.count(id) != 0;
  }

  // Calls reset by their client before Python took them.
  uint64_t Cancelled() {
    std::lock_guard<std::mutex> lk(mu_);
    return cancelled_;
  }

  // Any thread. After Stop the reply is dropped: its connection is closed.
  void Respond(Reply r) {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return;
    live_.erase(r.id);
    replies_.push_back(std::move(r));
    Wake();   // under mu_, so Stop cannot close wakefd_ in between
  }

 private:
  void Wake() {
    uint64_t one = 1;
    ssize_t ignored = write(wakefd_, &one, sizeof(one));
    (void)ignored;
  }

  void Run() {
    std::vector<epoll_event> events(128);
    // Idle connections are looked for about 4 times per timeout (at most once a second).
    const int sweep_ms = idle_timeout_.count() > 0
                             ? static_cast<int>(std::clamp<int64_t>(idle_timeout_.count() / 4, 1, 1000))
                             : -1;
    auto next_sweep = std::chrono::steady_clock::now();
    while (!stopping_.load()) {
      int n = epoll_wait(epfd_, events.data(), static_cast<int>(events.size()), sweep_ms);
      if (n < 0) {
        if (errno == EINTR) continue;
        break;
      }
      if (sweep_ms > 0 && std::chrono::steady_clock::now() >= next_sweep) {   // not on every wake-up: O(connections)
        CloseIdle();
        next_sweep = std::chrono::steady_clock::now() + std::chrono::milliseconds(sweep_ms);
      }
      for (int i = 0; i < n; ++i) {
        uint64_t tag = events[i].data.u64;
        if (tag == kListenTag) {
          Accept();
        } else if (tag == kWakeTag) {
          uint64_t v;
          while (read(wakefd_, &v, sizeof(v)) > 0) {
          }
          DeliverReplies();
        } else {
          auto it = conns_.find(tag);
          if (it == conns_.end()) continue;
          Conn* c = it->second.get();
          bool ok = true;
          if (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) ok = Read(c);
          if (ok) ok = Flush(c);
          if (!ok) Close(c);
        }
      }
    }
    for (auto& kv : conns_) {   // stopping: say GOAWAY where the socket takes it, then close
      Conn* c = kv.second.get();
      nghttp2_session_terminate_session(c->session, NGHTTP2_NO_ERROR);
      Flush(c);
      nghttp2_session_del(c->session);
      close(c->fd);
    }
    conns_.clear();
  }

  void Accept() {
    while (true) {
      int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0 && (errno == EMFILE || errno == ENFILE) && spare_fd_ >= 0) {
        // Out of descriptors: the pending connection would keep the listener readable and
        // this loop spinning. Take it with the spare descriptor and close it at once.
        close(spare_fd_);
        fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd >= 0) close(fd);
        spare_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
        continue;
      }
      if (fd < 0) return;   // EAGAIN, or an error the next accept reports again
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      auto c = std::make_unique<Conn>();
      c->fe = this;
      c->fd = fd;
      c->serial = next_serial_++;
      c->last_read = std::chrono::steady_clock::now();
      nghttp2_session_server_new(&c->session, callbacks_.get(), c.get());
      nghttp2_settings_entry iv[] = {{NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS, 1000},
                                     {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, 1 << 20}};
      nghttp2_submit_settings(c->session, NGHTTP2_FLAG_NONE, iv, 2);
      nghttp2_session_set_local_window_size(c->session, NGHTTP2_FLAG_NONE, 0, 16 << 20);
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.u64 = c->serial;
      epoll_ctl(epfd_, EPOLL_CTL_ADD, fd, &ev);
      Conn* raw = c.get();
      conns_[c->serial] = std::move(c);
      if (!Flush(raw)) Close(raw);
    }
  }

  bool Read(Conn* c) {
    uint8_t buf[65536];
    while (true) {
      ssize_t n = recv(c->fd, buf, sizeof(buf), 0);
      if (n > 0) {
        c->last_read = std::chrono::steady_clock::now();
        if (nghttp2_session_mem_recv(c->session, buf, static_cast<size_t>(n)) < 0) return false;
        continue;
      }
      if (n == 0) return false;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
      if (errno == EINTR) continue;
      return false;
    }
  }

  // Writes what nghttp2 has to send; false when the connection is done or broken.
  bool Flush(Conn* c) {
    while (true) {
      if (c->outpos < c->outbuf.size()) {
        ssize_t w = send(c->fd, c->outbuf.data() + c->outpos, c->outbuf.size() - c->outpos, MSG_NOSIGNAL);
        if (w < 0) {
          if (errno == EINTR) continue;
          if (errno == EAGAIN || errno == EWOULDBLOCK) return WantOut(c, true);
          return false;
        }
        c->outpos += static_cast<size_t>(w);
        continue;
      }
      c->outbuf.clear();
      c->outpos = 0;
      while (c->outbuf.size() < (256 << 10)) {   // coalesce frames into one send
        const uint8_t* data;
        ssize_t n = nghttp2_session_mem_send(c->session, &data);
        if (n < 0) return false;
        if (n == 0) break;
        c->outbuf.append(reinterpret_cast<const char*>(data), static_cast<size_t>(n));
      }
      if (c->outbuf.empty()) break;
    }
    if (!WantOut(c, false)) return false;
    return nghttp2_session_want_read(c->session) || nghttp2_session_want_write(c->session);
  }

  // Waits for the socket to take output (on) or for input (off): never both, so
  // a client that does not read its answers is not read either (TCP pushes back
  // on it) and cannot pile up answers here faster than it takes them.
  bool WantOut(Conn* c, bool on) {
    if (c->epollout == on) return true;
    epoll_event ev{};
    ev.events = on ? EPOLLOUT : EPOLLIN;
    ev.data.u64 = c->serial;
    c->epollout = on;
    return epoll_ctl(epfd_, EPOLL_CTL_MOD, c->fd, &ev) == 0;
  }

  // GOAWAY and close every connection idle for idle_timeout_: nothing received
  // for that long and no call at the model (one whose answer is still to come).
  void CloseIdle() {
    const auto now = std::chrono::steady_clock::now();
    std::vector<Conn*> idle;
    for (auto& kv : conns_) {
      Conn* c = kv.second.get();
      if (now - c->last_read < idle_timeout_) continue;
      bool waiting = false;
      for (auto& st : c->streams) waiting = waiting || (st.second->at_model && !st.second->answered);
      if (!waiting) idle.push_back(c);
    }
    for (Conn* c : idle) {
      nghttp2_session_terminate_session(c->session, NGHTTP2_NO_ERROR);
      Flush(c);   // the GOAWAY, where the socket takes it
      Close(c);
    }
  }

  // Forgets the calls of `c` at the model (the client has gone: they are not run).
  void Forget(Conn* c, int32_t sid) {
    std::lock_guard<std::mutex> lk(mu_);
    live_.erase((c->serial << 32) | static_cast<uint32_t>(sid));
  }

  void Close(Conn* c) {
    for (auto& st : c->streams)
      if (st.second->at_model && !st.second->answered) Forget(c, st.first);
    epoll_ctl(epfd_, EPOLL_CTL_DEL, c->fd, nullptr);
    close(c->fd);
    nghttp2_session_del(c->session);
    conns_.erase(c->serial);
  }

  void DeliverReplies() {
    std::vector<Reply> todo;
    {
      std::lock_guard<std::mutex> lk(mu_);
      todo.swap(replies_);
    }
    std::vector<Conn*> touched;
    for (Reply& r : todo) {
      auto it = conns_.find(r.id >> 32);
      if (it == conns_.end()) continue;   // the client has gone
      Conn* c = it->second.get();
      if (Answer(c, static_cast<int32_t>(r.id & 0xffffffffu), r.status, r.message, &r.body)) touched.push_back(c);
    }
    std::sort(touched.begin(), touched.end());
    touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
    for (Conn* c : touched)
      if (!Flush(c)) Close(c);
  }

  // Submits the answer of a stream: a message then trailers (status 0 with a
  // body), or trailers only. False when the stream is gone or was answered.
  static bool Answer(Conn* c, int32_t sid, int status, const std::string& message, std::string* body) {
    auto it = c->streams.find(sid);
    if (it == c->streams.end() || it->second->answered) return false;
    Stream* s = it->second.get();
    s->answered = true;
    s->status = std::to_string(status);
    s->message = message;
    if (body != nullptr && status == 0) {
      uint32_t len = static_cast<uint32_t>(body->size());
      s->out.reserve(body->size() + 5);
      s->out.push_back('\0');
      for (int shift = 24; shift >= 0; shift -= 8) s->out.push_back(static_cast<char>((len >> shift) & 0xff));
      s->out.append(*body);
      nghttp2_nv nva[] = {Nv(":status", "200"), Nv("content-type", "application/grpc"),
                          Nv("grpc-accept-encoding", kAcceptEncoding)};
      nghttp2_data_provider prd;
      prd.source.ptr = s;
      prd.read_callback = ReadBody;
      return nghttp2_submit_response(c->session, sid, nva, 3, &prd) == 0;
    }
    const auto nva = s->Trailers({Nv(":status", "200"), Nv("content-type", "application/grpc"),   // trailers only
                                  Nv("grpc-accept-encoding", kAcceptEncoding)});
    return nghttp2_submit_response(c->session, sid, nva.data(), nva.size(), nullptr) == 0;
  }

  static ssize_t ReadBody(nghttp2_session* session, int32_t sid, uint8_t* buf, size_t length, uint32_t* flags,
                          nghttp2_data_source* source, void*) {
    Stream* s = static_cast<Stream*>(source->ptr);
    size_t n = std::min(length, s->out.size() - s->out_pos);
    memcpy(buf, s->out.data() + s->out_pos, n);
    s->out_pos += n;
    if (s->out_pos == s->out.size()) {
      *flags |= NGHTTP2_DATA_FLAG_EOF | NGHTTP2_DATA_FLAG_NO_END_STREAM;
      const auto tr = s->Trailers();
      if (nghttp2_submit_trailer(session, sid, tr.data(), tr.size()) != 0) return NGHTTP2_ERR_CALLBACK_FAILURE;
    }
    return static_cast<ssize_t>(n);
  }

  // ---- nghttp2 callbacks (network thread) ----
  static int OnBeginHeaders(nghttp2_session*, const nghttp2_frame* frame, void* user) {
    Conn* c = static_cast<Conn*>(user);
    if (frame->hd.type == NGHTTP2_HEADERS && frame->headers.cat == NGHTTP2_HCAT_REQUEST)
      c->streams[frame->hd.stream_id] = std::make_unique<Stream>();
    return 0;
  }

  static int OnHeader(nghttp2_session*, const nghttp2_frame* frame, const uint8_t* name, size_t namelen,
                      const uint8_t* value, size_t valuelen, uint8_t, void* user) {
    Conn* c = static_cast<Conn*>(user);
    auto it = c->streams.find(frame->hd.stream_id);
    if (it == c->streams.end()) return 0;
    std::string n(reinterpret_cast<const char*>(name), namelen);
    std::string v(reinterpret_cast<const char*>(value), valuelen);
    if (n == ":path") it->second->path = std::move(v);
    else if (n == ":method") it->second->method = std::move(v);
    else if (n == "content-type") it->second->content_type = std::move(v);
    else if (n == "grpc-encoding") it->second->encoding = std::move(v);
    else if (n == "grpc-timeout") {
      std::chrono::nanoseconds t;
      if (ParseTimeout(v, &t)) it->second->deadline = std::chrono::steady_clock::now() + t;
    }
    return 0;
  }

  static int OnData(nghttp2_session*, uint8_t, int32_t sid, const uint8_t* data, size_t len, void* user) {
    Conn* c = static_cast<Conn*>(user);
    auto it = c->streams.find(sid);
    if (it == c->streams.end()) return 0;
    Stream* s = it->second.get();
    if (s->dropped != Stream::Dropped::kNo) return 0;
    const size_t cap = c->fe->max_message_ + 5;
    if (s->data.size() + len > cap) s->dropped = Stream::Dropped::kTooLarge;
    else if (c->buffered + len > kConnectionBudget * cap) s->dropped = Stream::Dropped::kOverBudget;
    if (s->dropped != Stream::Dropped::kNo) {
      c->buffered -= s->data.size();
      std::string().swap(s->data);
      return 0;
    }
    s->data.append(reinterpret_cast<const char*>(data), len);
    c->buffered += len;
    return 0;
  }

  static int OnFrame(nghttp2_session*, const nghttp2_frame* frame, void* user) {
    Conn* c = static_cast<Conn*>(user);
    if ((frame->hd.type == NGHTTP2_DATA || frame->hd.type == NGHTTP2_HEADERS) &&
        (frame->hd.flags & NGHTTP2_FLAG_END_STREAM))
      c->fe->Received(c, frame->hd.stream_id);
    return 0;
  }

  static int OnClose(nghttp2_session*, int32_t sid, uint32_t, void* user) {
    Conn* c = static_cast<Conn*>(user);
    auto it = c->streams.find(sid);
    if (it != c->streams.end()) {
      if (it->second->at_model && !it->second->answered) c->fe->Forget(c, sid);   // reset by its client
      c->buffered -= it->second->data.size();
      c->streams.erase(it);
    }
    return 0;
  }

  // A frame nghttp2 could not send (a response whose header block is too large):
  // reset the stream, so that its client learns at once instead of waiting.
  static int OnNotSent(nghttp2_session* session, const nghttp2_frame* frame, int, void*) {
    if (frame->hd.type == NGHTTP2_HEADERS)
      nghttp2_submit_rst_stream(session, NGHTTP2_FLAG_NONE, frame->hd.stream_id, NGHTTP2_INTERNAL_ERROR);
    return 0;
  }

  // A request stream has ended: hand its message to Python, or answer a bad one here.
  void Received(Conn* c, int32_t sid) {
    auto it = c->streams.find(sid);
    if (it == c->streams.end()) return;
    Stream* s = it->second.get();
    std::string d;   // the request, out of the connection's budget
    d.swap(s->data);
    c->buffered -= d.size();
    if (s->method != "POST" || s->content_type.compare(0, 16, "application/grpc") != 0) {
      nghttp2_nv nva[] = {Nv(":status", "415")};
      s->answered = true;
      nghttp2_submit_response(c->session, sid, nva, 1, nullptr);
      return;
    }
    if (s->dropped == Stream::Dropped::kTooLarge) {
      Answer(c, sid, kResourceExhausted,
             StatusMessage("Received message larger than max (over " + std::to_string(max_message_) +
                           " bytes; --max_request_bytes)"), nullptr);
      return;
    }
    if (s->dropped == Stream::Dropped::kOverBudget) {
      Answer(c, sid, kResourceExhausted,
             StatusMessage("this connection holds over " + std::to_string(kConnectionBudget * max_message_) +
                           " bytes of unfinished requests (" + std::to_string(kConnectionBudget) +
                           "x --max_request_bytes): send fewer at once"),
             nullptr);
      return;
    }
    uint32_t len = 0;
    if (d.size() >= 5)
      len = (uint32_t(uint8_t(d[1])) << 24) | (uint32_t(uint8_t(d[2])) << 16) | (uint32_t(uint8_t(d[3])) << 8) |
            uint32_t(uint8_t(d[4]));
    if (d.size() < 5 || d.size() - 5 != len) {
      Answer(c, sid, kInternal, StatusMessage("the request is not one length-prefixed gRPC message"), nullptr);
      return;
    }
    std::string encoding;
    if (d[0] != 0) {   // gRPC's compression spec: an encoding the server lacks is UNIMPLEMENTED
      if (s->encoding.empty() || s->encoding == "identity") {
        Answer(c, sid, kInternal, StatusMessage("a compressed message without a grpc-encoding"), nullptr);
        return;
      }
      if (s->encoding != "gzip" && s->encoding != "deflate") {
        Answer(c, sid, kUnimplemented,
               StatusMessage("Compression algorithm '" + s->encoding + "' is not supported (this server reads " +
                             std::string(kAcceptEncoding) + ")"),
               nullptr);
        return;
      }
      encoding = s->encoding;
    }
    d.erase(0, 5);
    Call call{(c->serial << 32) | static_cast<uint32_t>(sid), s->path, std::move(d), std::move(encoding),
              s->deadline};
    s->at_model = true;
    {
      std::lock_guard<std::mutex> lk(mu_);
      live_.insert(call.id);
      calls_.push_back(std::move(call));
    }
    cv_.notify_one();
  }

  struct CallbacksDeleter {
    void operator()(nghttp2_session_callbacks* cb) const { nghttp2_session_callbacks_del(cb); }
  };
  static nghttp2_session_callbacks* MakeCallbacks() {
    nghttp2_session_callbacks* cb;
    nghttp2_session_callbacks_new(&cb);
    nghttp2_session_callbacks_set_on_begin_headers_callback(cb, OnBeginHeaders);
    nghttp2_session_callbacks_set_on_header_callback(cb, OnHeader);
    nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cb, OnData);
    nghttp2_session_callbacks_set_on_frame_recv_callback(cb, OnFrame);
    nghttp2_session_callbacks_set_on_stream_close_callback(cb, OnClose);
    nghttp2_session_callbacks_set_on_frame_not_send_callback(cb, OnNotSent);
    return cb;
  }

  int listen_fd_;
  size_t max_message_;
  std::chrono::milliseconds idle_timeout_;
  int epfd_ = -1, wakefd_ = -1;
  int spare_fd_ = -1;   // held for accepting (and closing) a connection when out of descriptors
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  std::unique_ptr<nghttp2_session_callbacks, CallbacksDeleter> callbacks_{MakeCallbacks()};
  std::unordered_map<uint64_t, std::unique_ptr<Conn>> conns_;   // network thread only
  uint64_t next_serial_ = 2;                                      // 0 and 1 tag the listener and the wake fd
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Call> calls_;
  std::vector<Reply> replies_;
  std::unordered_set<uint64_t> live_;   // calls handed on (queued or taken by Python), not answered or reset
  uint64_t cancelled_ = 0;
  bool closed_ = false;
};

}  // namespace evstore_grpc
