"""vLLM 0.33's own filesystem-tier I/O, loaded as a measurement peer.

``kvtier bench`` and ``benchmarks/vs_vllm.py`` time kvtier against the I/O of
vLLM's ``"fs"`` tier (``vllm.v1.kv_offload.tiering.fs.io``: ``batch_store_block``
/ ``batch_load_block(paths, view, offsets, block_size, use_o_direct)``, which
call vLLM's C++ ``vllm/fs_io_C.abi3.so``; no checksums). That library names
libtorch_cuda, libc10_cuda and libnvrtc.so.13 without calling into them: on a
CPU-only host it loads once torch's CPU libraries and three empty stub
libraries (built here with the C compiler) are loaded first
(../shared/vllm.md, "Running vLLM's real tiering code").
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import subprocess
import tempfile

STUB_LIBS = ("libtorch_cuda.so", "libc10_cuda.so", "libnvrtc.so.13")

_cache: list = []


def load_vllm_io(workdir: "str | None" = None):
    """``(module, note)``: vLLM's fs tier io module with its C core loaded (its
    ``_HAS_FSIO_C`` set, so vLLM's fs tier uses ``fs_io_C``) and a one-line
    description, or ``(None, reason)`` when torch or vLLM is not installed, there
    is no C compiler for the stubs, or the import fails. Cached per process (the
    stub libraries stay loaded); ``vllm.fs_io_C`` is then importable."""
    if _cache:
        return _cache[0]
    _cache.append(_load(workdir))
    return _cache[0]


def _load(workdir):
    ts, vs = importlib.util.find_spec("torch"), importlib.util.find_spec("vllm")
    if ts is None or vs is None:
        return None, "torch or vLLM not installed"
    vdir = vs.submodule_search_locations[0]
    if not os.path.exists(os.path.join(vdir, "fs_io_C.abi3.so")):
        return None, f"{vdir}/fs_io_C.abi3.so missing"
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None, "no C compiler to build the stub libraries"
    try:
        tlib = os.path.join(ts.submodule_search_locations[0], "lib")
        for name in ("libc10.so", "libtorch_cpu.so", "libtorch.so"):
            ctypes.CDLL(os.path.join(tlib, name), mode=ctypes.RTLD_GLOBAL)
        d = workdir or tempfile.mkdtemp(prefix="kvtier-vllm-stubs-")
        for name in STUB_LIBS:
            out = os.path.join(d, name)
            subprocess.run([cc, "-shared", "-fPIC", f"-Wl,-soname,{name}", "-o", out, "-x", "c", "-"],
                           input=b"", check=True, capture_output=True)
            ctypes.CDLL(out, mode=ctypes.RTLD_GLOBAL)
        import vllm
        import vllm.fs_io_C as C
        import vllm.v1.kv_offload.tiering.fs.io as vio
    except (OSError, ImportError, subprocess.CalledProcessError) as e:
        return None, f"vLLM's fs tier io did not load: {e}"
    if not getattr(vio, "_HAS_FSIO_C", False):  # imported before the stubs: point it at C now
        vio.batch_load_block_C, vio.batch_store_block_C = C.batch_load_block, C.batch_store_block
        vio._HAS_FSIO_C = True
    return vio, (f"vLLM {vllm.__version__} fs tier io + fs_io_C (stub {', '.join(STUB_LIBS)} built at run "
                 "time, torch CPU libraries preloaded)")
