"""Builds evstore's native op library against the installed TensorFlow.

Two extensions. The op library (evstore/native/_evstore_ops*.so) holds the core table
(evstore/native/core, header-only, no TensorFlow) and the TensorFlow op
registrations and kernels (evstore/native/tf). Compile and link flags come from
tf.sysconfig, so `pip install .` needs no hand steps. The gRPC front end
(serving_loader/native/_grpc_frontend*.so) is plain C++ on libnghttp2.
"""
import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


class TFBuildExt(build_ext):
    def build_extension(self, ext):
        # The library built in place (`python setup.py build_ext --inplace`, the
        # Makefile's visible build step) is reused when it is newer than every
        # source, header and setup.py: `pip install -e .` then compiles nothing.
        built = os.path.join(HERE, *ext.name.split(".")) + sysconfig.get_config_var("EXT_SUFFIX")
        target = self.get_ext_fullpath(ext.name)
        inputs = [os.path.join(HERE, f) for f in list(ext.sources) + list(ext.depends or [])] + [__file__]
        if (os.path.exists(built) and os.path.abspath(built) != os.path.abspath(target)
                and all(os.path.getmtime(built) >= os.path.getmtime(f) for f in inputs)):
            print(f"evstore native build: {os.path.basename(built)} is up to date", file=sys.stderr, flush=True)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(built, target)
            return
        super().build_extension(ext)

    def build_extensions(self):
        cflags, lflags = _tf_flags()
        for ext in self.extensions:
            if ext.name == GRPC_FRONTEND:   # plain C++ and nghttp2, no TensorFlow
                ext.extra_compile_args = ["-std=c++17", "-O2", "-fPIC", "-Wall"]
                continue
            ext.extra_compile_args = cflags + ["-O3", "-fPIC", "-Wno-deprecated-declarations",
                                               "-Wno-sign-compare", "-Wno-unused-function",
                                               "-Wno-interference-size"]  # TF's Eigen headers, every file
            ext.extra_link_args = lflags
        # setuptools compiles with the C compiler driver; make it g++-compatible.
        if self.compiler.compiler_so and "-std=c++17" not in " ".join(self.compiler.compiler_so):
            self.compiler.compiler_so = [a for a in self.compiler.compiler_so if a != "-Wstrict-prototypes"]
        # Compile the translation units side by side (distutils compiles one
        # after another), printing one progress line per file; use ccache when
        # it is installed (EVSTORE_CCACHE=0 turns it off).
        if shutil.which("ccache") and os.environ.get("EVSTORE_CCACHE", "1") != "0":
            for attr in ("compiler_so", "compiler_so_cxx"):  # C and (setuptools >= 72) C++ drivers
                if getattr(self.compiler, attr, None):
                    setattr(self.compiler, attr, ["ccache"] + getattr(self.compiler, attr))
            # Paths under the checkout (its .venv's TensorFlow headers included)
            # hash the same in every checkout, so worktrees share cache hits.
            os.environ.setdefault("CCACHE_BASEDIR", HERE)
            os.environ.setdefault("CCACHE_NOHASHDIR", "1")
        _compile_in_parallel(self.compiler, int(os.environ.get("EVSTORE_BUILD_JOBS", os.cpu_count() or 1)))
        super().build_extensions()


def _tf_flags():
    """(compile flags, link flags) of the installed TensorFlow, asked in a child
    process: its start-up log lines (oneDNN, CUDA probing) stay out of the build
    output unless the import fails."""
    code = "import json, tensorflow as tf; print(json.dumps([tf.sysconfig.get_compile_flags(), " \
           "tf.sysconfig.get_link_flags()]))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        raise RuntimeError("the native build needs TensorFlow 2.21 installed in this Python (make install does it)")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _compile_in_parallel(compiler, jobs):
    """Replaces compiler.compile with one that runs `jobs` compilations at once."""

    def compile(sources, output_dir=None, macros=None, include_dirs=None, debug=0,
                extra_preargs=None, extra_postargs=None, depends=None):
        macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
            output_dir, macros, include_dirs, sources, depends, extra_postargs)
        cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)
        todo = [obj for obj in objects if obj in build]
        done = [0]

        def one(obj):
            src, ext = build[obj]
            compiler._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)
            done[0] += 1
            print(f"evstore native build: [{done[0]}/{len(todo)}] {os.path.basename(src)}",
                  file=sys.stderr, flush=True)

        with ThreadPoolExecutor(max(1, jobs)) as pool:
            list(pool.map(one, todo))
        return objects

    compiler.compile = compile


sources = sorted(glob.glob(os.path.join("evstore", "native", "tf", "*.cc")))
depends = sorted(glob.glob(os.path.join("evstore", "native", "core", "*.h"))
                 + glob.glob(os.path.join("evstore", "native", "tf", "*.h")))

# gRPC's transport for `evstore serve` (serving_loader/grpc_service.py): HTTP/2 from Debian's libnghttp2
# (`make install` installs libnghttp2-dev when its header is missing).
GRPC_FRONTEND = "serving_loader.native._grpc_frontend"

setup(
    ext_modules=[Extension("evstore.native._evstore_ops", sources=sources, depends=depends, language="c++"),
                 Extension(GRPC_FRONTEND, sources=[os.path.join("serving_loader", "native", "grpc_frontend.cc")],
                           depends=[os.path.join("serving_loader", "native", "grpc_transport.h")],
                           libraries=["nghttp2"], language="c++")],
    cmdclass={"build_ext": TFBuildExt},
)
