"""The one compiled piece: a few loops of the lookup path (kvstore/_native.c). It is
optional: where it cannot be built, kvstore runs the same steps in numpy and Python."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvstore._native", ["kvstore/_native.c"], optional=True,
                             extra_compile_args=["-O2"])])
