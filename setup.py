"""Builds evstore's native op library against the installed TensorFlow.

The library (evstore/native/_evstore_ops*.so) holds the core table
(evstore/native/core, header-only, no TensorFlow) and the TensorFlow op
registrations and kernels (evstore/native/tf). Compile and link flags come from
tf.sysconfig, so `pip install .` needs no hand steps.
"""
import glob
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


class TFBuildExt(build_ext):
    def build_extensions(self):
        import tensorflow as tf  # noqa: imported at build time only

        cflags = tf.sysconfig.get_compile_flags()
        lflags = tf.sysconfig.get_link_flags()
        for ext in self.extensions:
            ext.extra_compile_args = cflags + ["-O3", "-fPIC", "-Wno-deprecated-declarations",
                                               "-Wno-sign-compare", "-Wno-unused-function"]
            ext.extra_link_args = lflags
        # setuptools compiles with the C compiler driver; make it g++-compatible.
        if self.compiler.compiler_so and "-std=c++17" not in " ".join(self.compiler.compiler_so):
            self.compiler.compiler_so = [a for a in self.compiler.compiler_so if a != "-Wstrict-prototypes"]
        super().build_extensions()


sources = sorted(glob.glob(os.path.join("evstore", "native", "tf", "*.cc")))
depends = sorted(glob.glob(os.path.join("evstore", "native", "core", "*.h"))
                 + glob.glob(os.path.join("evstore", "native", "tf", "*.h")))

setup(
    ext_modules=[Extension("evstore.native._evstore_ops", sources=sources, depends=depends, language="c++")],
    cmdclass={"build_ext": TFBuildExt},
)
