"""Every cutlass-dsl version shim lives here (pinned: nvidia-cutlass-dsl 4.8.1)."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def compile_target(arch: str):
    """Compile for `arch` whatever GPU (if any) this machine has.

    In 4.8.1, `cute.compile(..., options="--gpu-arch sm_90a")` builds a function whose
    `export_to_c` fails ("Failed to dump object file with PIC relocation"), while the same
    target taken from CUTE_DSL_ARCH exports fine. So we set the DSL's arch (what CUTE_DSL_ARCH
    feeds) for the duration of one compile and restore it after.
    """
    from cutlass.base_dsl.dsl import BaseDSL

    envar = BaseDSL._get_dsl().envar
    saved = envar._arch
    envar.arch = arch
    try:
        yield
    finally:
        envar._arch = saved
