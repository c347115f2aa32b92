"""The compiled extensions (docs/design.md, "Compiled extensions"); everything else is in
pyproject.toml.

Each extension is optional: without a C compiler, Python's headers or OpenSSL's (Debian's
``build-essential``, ``python3-dev``, ``libssl-dev``) the build skips it with a warning and the
package runs its pure-Python code (``aio_mclookup._native``).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "aio_mclookup._hashing._chain_c",
            ["src/aio_mclookup/_hashing/_chain_c.c"],
            depends=["src/aio_mclookup/_native_job.h"],
            libraries=["crypto"],
            extra_compile_args=["-O3", "-Wno-deprecated-declarations"],
            optional=True,
        ),
        Extension(
            "aio_mclookup._coordinator._worker_c",
            ["src/aio_mclookup/_coordinator/_worker_c.c"],
            depends=["src/aio_mclookup/_native_job.h"],
            extra_compile_args=["-O3", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
        Extension(
            "aio_mclookup._plan._repeats_c",
            ["src/aio_mclookup/_plan/_repeats_c.c"],
            depends=["src/aio_mclookup/_native_job.h"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "aio_mclookup._coordinator._table_c",
            ["src/aio_mclookup/_coordinator/_table_c.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "aio_mclookup._coordinator._prefixes_c",
            ["src/aio_mclookup/_coordinator/_prefixes_c.c"],
            depends=["src/aio_mclookup/_hash_rows.h"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "aio_mclookup._plan._keys_c",
            ["src/aio_mclookup/_plan/_keys_c.c"],
            depends=["src/aio_mclookup/_hash_rows.h"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "aio_mclookup._plan._probing_c",
            ["src/aio_mclookup/_plan/_probing_c.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "aio_mclookup._plan._prefix_probe_c",
            ["src/aio_mclookup/_plan/_prefix_probe_c.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "aio_mclookup._resolve._search_c",
            ["src/aio_mclookup/_resolve/_search_c.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "aio_mclookup._rows_c",
            ["src/aio_mclookup/_rows_c.c"],
            depends=["src/aio_mclookup/_hash_rows.h"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ]
)
