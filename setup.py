"""The one compiled piece: the block table's chain probe (kvstore/_probe.c). It is
optional: where it cannot be built, kvstore uses its numpy probe instead."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvstore._probe", ["kvstore/_probe.c"], optional=True,
                             extra_compile_args=["-O2"])])
