"""The one compiled piece: a few loops of the hot paths (kvstore/_native/, one extension
built from one file per owner). It is optional: where it cannot be built, kvstore runs
the same steps in numpy and Python."""

from setuptools import Extension, setup

NATIVE = "kvstore/_native/"

setup(ext_modules=[Extension("kvstore._native",
                             [NATIVE + f for f in ("module.c", "table.c", "rows.c", "pack.c", "xxh.c", "units.c")],
                             depends=[NATIVE + "native.h"], optional=True, extra_compile_args=["-O2"])])
