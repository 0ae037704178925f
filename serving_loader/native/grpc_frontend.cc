// Python bindings of gRPC's transport for `evstore serve` (the transport
// itself, with no Python in it, is grpc_transport.h).
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "grpc_transport.h"

#include <cmath>

namespace {

using evstore_grpc::Call;
using evstore_grpc::Frontend;
using evstore_grpc::Reply;
using evstore_grpc::StatusMessage;

// ---- Python bindings: a capsule per front end ----
constexpr const char* kCapsule = "evstore.grpc_frontend";

Frontend* Get(PyObject* cap) { return static_cast<Frontend*>(PyCapsule_GetPointer(cap, kCapsule)); }

void DestroyCapsule(PyObject* cap) {
  Frontend* fe = Get(cap);
  if (fe != nullptr) {
    Py_BEGIN_ALLOW_THREADS delete fe;
    Py_END_ALLOW_THREADS
  }
}

PyObject* Start(PyObject*, PyObject* args) {
  const char* host;
  int port;
  Py_ssize_t max_message;
  double idle_timeout_s = 0;
  if (!PyArg_ParseTuple(args, "sin|d", &host, &port, &max_message, &idle_timeout_s)) return nullptr;
  if (!(idle_timeout_s >= 0) || idle_timeout_s > 1e9)
    return PyErr_Format(PyExc_ValueError, "idle_timeout_s must be a number of seconds >= 0 (0: never), got %R",
                        PyTuple_GET_ITEM(args, 3));
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  std::string service = std::to_string(port);
  int rv = getaddrinfo(host, service.c_str(), &hints, &res);
  if (rv != 0) return PyErr_Format(PyExc_OSError, "cannot bind the gRPC port %s:%d: %s", host, port, gai_strerror(rv));
  int fd = -1, err = 0;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      err = errno;
      continue;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 1024) == 0) break;
    err = errno;
    close(fd);
    fd = -1;
  }
  freeaddrinfo(res);
  if (fd < 0) return PyErr_Format(PyExc_OSError, "cannot bind the gRPC port %s:%d: %s", host, port, strerror(err));
  auto fe = std::make_unique<Frontend>(
      fd, static_cast<size_t>(max_message),
      std::chrono::milliseconds(static_cast<int64_t>(std::ceil(idle_timeout_s * 1000))));
  std::string error;
  if (!fe->Start(&error)) return PyErr_Format(PyExc_OSError, "gRPC front end: %s", error.c_str());
  sockaddr_storage ss{};
  socklen_t sl = sizeof(ss);
  getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &sl);
  int bound = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                             : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  PyObject* cap = PyCapsule_New(fe.release(), kCapsule, DestroyCapsule);
  if (cap == nullptr) return nullptr;
  return Py_BuildValue("(Ni)", cap, bound);
}

PyObject* Next(PyObject*, PyObject* args) {
  PyObject* cap;
  Py_ssize_t max_n;
  double timeout_s;
  if (!PyArg_ParseTuple(args, "Ond", &cap, &max_n, &timeout_s)) return nullptr;
  Frontend* fe = Get(cap);
  if (fe == nullptr) return nullptr;
  std::vector<Call> calls;
  bool open;
  Py_BEGIN_ALLOW_THREADS open = fe->Next(static_cast<size_t>(std::max<Py_ssize_t>(1, max_n)), timeout_s, &calls);
  Py_END_ALLOW_THREADS
  if (!open) Py_RETURN_NONE;
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(calls.size()));
  if (list == nullptr) return nullptr;
  const auto now = std::chrono::steady_clock::now();
  for (size_t i = 0; i < calls.size(); ++i) {
    const Call& call = calls[i];
    PyObject* encoding = call.encoding.empty() ? Py_NewRef(Py_None) : PyUnicode_FromString(call.encoding.c_str());
    PyObject* left = call.deadline
                         ? PyFloat_FromDouble(std::chrono::duration<double>(*call.deadline - now).count())
                         : Py_NewRef(Py_None);
    if (encoding == nullptr || left == nullptr) {
      Py_XDECREF(encoding);
      Py_XDECREF(left);
      Py_DECREF(list);
      return nullptr;
    }
    PyObject* t = Py_BuildValue("(Ky#y#NN)", static_cast<unsigned long long>(call.id), call.path.data(),
                                static_cast<Py_ssize_t>(call.path.size()), call.message.data(),
                                static_cast<Py_ssize_t>(call.message.size()), encoding, left);
    if (t == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), t);
  }
  return list;
}

PyObject* Respond(PyObject*, PyObject* args) {
  PyObject* cap;
  unsigned long long id;
  int status;
  const char* message;
  Py_ssize_t message_len;
  Py_buffer body{};
  if (!PyArg_ParseTuple(args, "OKis#y*", &cap, &id, &status, &message, &message_len, &body)) return nullptr;
  Frontend* fe = Get(cap);
  if (fe == nullptr) {
    PyBuffer_Release(&body);
    return nullptr;
  }
  Reply r{id, status, StatusMessage(std::string_view(message, static_cast<size_t>(message_len))),
          std::string(static_cast<const char*>(body.buf), static_cast<size_t>(body.len))};
  PyBuffer_Release(&body);
  fe->Respond(std::move(r));
  Py_RETURN_NONE;
}

PyObject* Alive(PyObject*, PyObject* args) {
  PyObject* cap;
  unsigned long long id;
  if (!PyArg_ParseTuple(args, "OK", &cap, &id)) return nullptr;
  Frontend* fe = Get(cap);
  if (fe == nullptr) return nullptr;
  return PyBool_FromLong(fe->Alive(id));
}

PyObject* Cancelled(PyObject*, PyObject* args) {
  PyObject* cap;
  if (!PyArg_ParseTuple(args, "O", &cap)) return nullptr;
  Frontend* fe = Get(cap);
  if (fe == nullptr) return nullptr;
  return PyLong_FromUnsignedLongLong(fe->Cancelled());
}

PyObject* StopFrontend(PyObject*, PyObject* args) {
  PyObject* cap;
  if (!PyArg_ParseTuple(args, "O", &cap)) return nullptr;
  Frontend* fe = Get(cap);
  if (fe == nullptr) return nullptr;
  Py_BEGIN_ALLOW_THREADS fe->Stop();
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"start", Start, METH_VARARGS,
     "start(host, port, max_message, idle_timeout_s=0) -> (handle, bound port): listens and starts the network "
     "thread; a connection with no call at the model that sends nothing for idle_timeout_s is closed (0: never)."},
    {"next", Next, METH_VARARGS,
     "next(handle, max_n, timeout_s) -> [(call id, path, message, encoding: 'gzip' | 'deflate' | None, seconds "
     "left before the call's grpc-timeout deadline or None)], [] on timeout, None once stopped."},
    {"respond", Respond, METH_VARARGS,
     "respond(handle, call id, grpc status, message, body): answers a call (body: the serialized answer; "
     "b'' with a non-zero status). Any thread."},
    {"alive", Alive, METH_VARARGS,
     "alive(handle, call id) -> False once the call is answered or its client has reset it or gone."},
    {"cancelled", Cancelled, METH_VARARGS,
     "cancelled(handle) -> calls reset by their client before next() took them (never handed to Python)."},
    {"stop", StopFrontend, METH_VARARGS, "stop(handle): GOAWAY, closes every connection, ends next()."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_grpc_frontend",
                       "gRPC's HTTP/2 transport in a C++ thread (serving_loader/native/grpc_frontend.cc).", -1,
                       kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__grpc_frontend() {
  PyObject* m = PyModule_Create(&kModule);
  if (m != nullptr && PyModule_AddIntConstant(m, "MAX_STATUS_MESSAGE", evstore_grpc::kMaxStatusMessage) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
