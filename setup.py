"""Build of kvtier._C, the C core.

libisal is found through pkg-config (Debian: libisal-dev). Without it the
extension is built without the ISA-L backend and says so. liburing likewise
(Debian: liburing-dev): without it block I/O uses plain pread/pwrite only
(csrc/block/uring.h). Switches (environment variables read at build time):

  KVTIER_NO_ISAL=1     build without ISA-L even if it is installed
  KVTIER_REQUIRE_ISAL=1  fail the build if ISA-L is not found
  KVTIER_NO_LIBURING=1 build without liburing even if it is installed
  KVTIER_SANITIZE=1    build with -fsanitize=address,undefined (tests only)
  KVTIER_DEBUG=1       -O0 -g

A compiler error is a build error: there is no silent pure-Python install.
"""
import glob
import os
import platform
import shutil
import subprocess
import sys

from setuptools import Extension, setup


def _flag(name):
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _pkg_config(*args):
    exe = shutil.which("pkg-config")
    if exe is None:
        return None
    try:
        return subprocess.check_output([exe, *args], stderr=subprocess.DEVNULL, text=True).strip()
    except subprocess.CalledProcessError:
        return None


def _isal():
    if _flag("KVTIER_NO_ISAL"):
        print("kvtier: building WITHOUT ISA-L (KVTIER_NO_ISAL=1)", file=sys.stderr)
        return None
    version = _pkg_config("--modversion", "libisal")
    if version is None:
        msg = "kvtier: libisal not found by pkg-config; building WITHOUT the ISA-L backend (apt-get install libisal-dev)"
        if _flag("KVTIER_REQUIRE_ISAL"):
            raise SystemExit(msg + " and KVTIER_REQUIRE_ISAL=1 is set")
        print(msg, file=sys.stderr)
        return None
    cflags = (_pkg_config("--cflags", "libisal") or "").split()
    libs = (_pkg_config("--libs", "libisal") or "-lisal").split()
    print(f"kvtier: building with ISA-L {version}", file=sys.stderr)
    return version, cflags, libs


def _liburing():
    if _flag("KVTIER_NO_LIBURING"):
        print("kvtier: building WITHOUT liburing (KVTIER_NO_LIBURING=1): plain pread/pwrite only", file=sys.stderr)
        return None
    version = _pkg_config("--modversion", "liburing")
    if version is None:
        print("kvtier: liburing not found by pkg-config; building WITHOUT io_uring, plain pread/pwrite only "
              "(apt-get install liburing-dev)", file=sys.stderr)
        return None
    cflags = (_pkg_config("--cflags", "liburing") or "").split()
    libs = (_pkg_config("--libs", "liburing") or "-luring").split()
    print(f"kvtier: building with liburing {version}", file=sys.stderr)
    return version, cflags, libs


sources = sorted(glob.glob("csrc/*.c") + glob.glob("csrc/*/*.c"))
define_macros = []
extra_compile_args = ["-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-fvisibility=hidden"]
extra_link_args = []
libraries = []

isal = _isal()
if isal is not None:
    version, cflags, libs = isal
    define_macros += [("KVTIER_HAVE_ISAL", "1"), ("KVTIER_ISAL_VERSION", f'"{version}"')]
    extra_compile_args += cflags
    extra_link_args += libs

uring = _liburing()
if uring is not None:
    version, cflags, libs = uring
    define_macros += [("KVTIER_HAVE_LIBURING", "1"), ("KVTIER_LIBURING_VERSION", f'"{version}"')]
    extra_compile_args += cflags
    extra_link_args += libs

if _flag("KVTIER_DEBUG") or _flag("KVTIER_SANITIZE"):
    extra_compile_args += ["-O0", "-g", "-fno-omit-frame-pointer"]
else:
    extra_compile_args += ["-O3"]
if _flag("KVTIER_SANITIZE"):
    san = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
    extra_compile_args += san
    extra_link_args += san
    define_macros.append(("KVTIER_SANITIZE", "1"))

libraries.append("pthread")

setup(
    ext_modules=[
        Extension(
            "kvtier._C",
            sources=sources,
            include_dirs=["csrc", "csrc/block", "csrc/crc32c", "csrc/dsa", "csrc/py"],
            define_macros=define_macros,
            extra_compile_args=extra_compile_args,
            extra_link_args=extra_link_args,
            libraries=libraries,
        )
    ],
)
