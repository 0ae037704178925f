"""The gRPC front end of `evstore serve`: `_grpc_frontend`, gRPC's HTTP/2
transport in C++ on libnghttp2 (grpc_frontend.cc). The build leaves it out
when libnghttp2 is not found; the server then answers REST only."""
import importlib.util

GRPC_FRONTEND_MISSING = ("this evstore was built without its gRPC front end (libnghttp2 was not found at build "
                         "time; install libnghttp2-dev and pkg-config, then run `make clean install`)")


def grpc_frontend_built():
    """Whether the gRPC front end's library is present."""
    return importlib.util.find_spec("serving_loader.native._grpc_frontend") is not None
