"""The ``kvtier`` command line.

    kvtier info            what is built and active: C core, CRC32C backends, ISA-L, CPU, DSA
    kvtier bench           store/load real-model KV blocks through the tier, checksum off vs on
    kvtier scrub ROOT      verify every block of a cache against its CRC32C and size
    kvtier doctor ROOT     check a mount before using it as a cache root (xattrs, O_DIRECT, caches)
    kvtier evict ROOT      one capacity pass: census the root, evict the oldest blocks (docs/capacity.md)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys

import kvtier


def _thp_mode() -> "str | None":
    """The kernel's transparent huge page mode (always / madvise / never), or
    None without THP: the I/O engine asks huge pages for its O_DIRECT load
    slots with madvise (docs/block_io.md "I/O engine")."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            s = f.read()
        return s[s.index("[") + 1:s.index("]")]
    except (OSError, ValueError):
        return None

def _cpu_flags() -> list:
    """CPU features kvtier can use, from /proc/cpuinfo (Linux)."""
    wanted = ("sse4_2", "pclmulqdq", "avx512f", "vpclmulqdq", "movdir64b", "enqcmd", "crc32")
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key = line.split(":", 1)[0].strip().lower()
                if key in ("flags", "features"):
                    have = set(line.split(":", 1)[1].split())
                    return [w for w in wanted if w in have]
    except OSError:
        pass
    return []


def _landing_env_error() -> "str | None":
    """Why ``KVTIER_LOAD_LANDING`` is refused (as every tier of this process would refuse it:
    :func:`kvtier._tier.landing.resolve`), or None when it is unset or one of its words."""
    from kvtier._tier import landing

    env = os.environ.get(landing.ENV, "")
    if not env:
        return None
    try:
        landing.check_mode(env.strip().lower(), landing.ENV)
    except ValueError as e:
        return str(e)
    return None


def info_dict() -> dict:
    """Everything ``kvtier info`` prints, as a dict (for ``--json`` and tests)."""
    c = kvtier._C
    d = {
        "version": kvtier.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "c_core": c is not None,
        "c_core_error": None if c is not None else str(kvtier._C_IMPORT_ERROR),
        "crc32c_backend": kvtier.crc32c_backend,
        "crc32c_backends": [],
        "isal_version": None,
        "cpu_features": _cpu_flags(),
    }
    if c is not None:
        d["crc32c_backends"] = [
            {"name": n, "available": bool(ok), "uses": f} for (n, ok, f) in c.backends()
        ]
        d["isal_version"] = c.isal_version()
    d["crc32c_backends"].append({"name": "numpy", "available": True, "uses": "pure Python + numpy fallback"})
    try:
        from kvtier import io as kio

        d["io_backend"] = {"c": "c (kvtier._C)", "python": "python (pure-Python fallback)"}[kio.backend]
    except ValueError as e:  # a bad KVTIER_IO_BACKEND / KVTIER_IO_URING / KVTIER_CRC_COPY: say so rather than crash
        d["io_backend"] = f"error: {e}"
        if str(e).startswith("KVTIER_IO_URING"):
            d["io_engine_error"] = str(e)
        if str(e).startswith("KVTIER_CRC_COPY"):
            d["crc_copy_error"] = str(e)
    # A refused setting: no status next to the error (the C core would read it leniently).
    d["io_engine"] = c.io_engine_status() if c is not None and "io_engine_error" not in d else None
    if d["io_engine"] is not None:
        d["io_engine"]["thp"] = _thp_mode()
    d["crc_copy"] = c.crc_copy_status() if c is not None and "crc_copy_error" not in d else None
    d["load_landing_error"] = _landing_env_error()
    # every refused KVTIER_* setting, in the order printed (kvtier info exits 2 with them)
    d["setting_errors"] = ([d["io_backend"][len("error: "):]] if str(d["io_backend"]).startswith("error: ") else []) + \
        ([d["load_landing_error"]] if d["load_landing_error"] else [])
    if c is not None:
        from kvtier import dsa

        d["dsa"] = dsa.describe()
        d["dsa_counters"] = dsa.counters()
    else:
        d["dsa"] = "not available: the C core is not importable"
        d["dsa_counters"] = {}
    return d


def _print_info(d: dict) -> None:
    print(f"kvtier {d['version']} (Python {d['python']}, {d['machine']})")
    if d["c_core"]:
        print("C core:         built (kvtier._C)")
    else:
        print(f"C core:         NOT importable, using the pure-Python fallback ({d['c_core_error']})")
    print(f"Block I/O:      {d['io_backend']}")
    print(f"CRC32C active:  {d['crc32c_backend']}")
    for b in d["crc32c_backends"]:
        if b["available"]:
            state = "available"
        elif b["name"] == "dsa-model":  # the model is not enabled, the host has nothing to do with it
            state = "not enabled (explicit only: KVTIER_DSA=model or KVTIER_CRC32C_BACKEND=dsa-model)"
        else:
            state = "not available on this host"
        print(f"  {b['name']:<10} {state:<28} {b['uses']}")
    isal = d["isal_version"]
    if not d["c_core"]:  # nothing is known of how the missing C core was built
        isal = f"unknown: the C core is not importable ({d['c_core_error']})"
    print(f"ISA-L:          {isal if isal else 'not built in (libisal not found at build time, or KVTIER_NO_ISAL=1)'}")
    print(f"CPU features:   {' '.join(d['cpu_features']) or 'none of interest'}")
    eng, cp = d["io_engine"], d["crc_copy"]
    fallback = str(d["io_backend"]).startswith("python ")
    not_c = " [not used: the block I/O backend is the pure-Python fallback]" if fallback else ""
    if d.get("io_engine_error"):
        print(f"I/O engine:     error: {d['io_engine_error']}")
    elif eng is None:
        print("I/O engine:     not available: the C core is not importable")
    else:
        if eng["engine"] == "io_uring":
            how = ("io_uring (liburing): bounce-landing O_DIRECT loads in pieces, the next read in flight while one is moved; "
                   "stores: one pwrite straight from the caller's buffer, never the ring")
        elif not eng["liburing"]:
            how = "plain pread/pwrite (built without liburing: apt-get install liburing-dev and rebuild)"
        elif eng["setting"] == "0":
            how = "plain pread/pwrite (KVTIER_IO_URING=0)"
        else:
            how = f"plain pread/pwrite (the kernel refused io_uring: {os.strerror(eng['setup_errno'])})"
        print(f"I/O engine:     {how}; {eng['uring_ops']} io_uring ops, {eng['plain_blocks']} plain O_DIRECT "
              f"blocks{not_c}")
        thp = eng.get("thp")
        if thp in ("always", "madvise"):
            print(f"                O_DIRECT slots (loads): 2 x 2 MiB per I/O thread on transparent "
                  f"huge pages (THP {thp})")
        else:
            print(f"                O_DIRECT slots (loads): 2 x 2 MiB per I/O thread on 4 KiB pages (THP "
                  f"{thp or 'not in this kernel'}): loads lose the speed of one segment per piece")
    env_landing, bad_landing = os.environ.get("KVTIER_LOAD_LANDING", ""), d.get("load_landing_error")
    head = f"error: {bad_landing} (every tier of this process refuses it); " if bad_landing else ""
    env_part = f"; KVTIER_LOAD_LANDING={env_landing}" if env_landing and not bad_landing else ""
    print(f"Load landing:   {head}tier key load_landing (auto, direct, bounce){env_part}; "
          "auto: direct on ext4/xfs/btrfs/f2fs/tmpfs/ramfs, else bounce")
    print("                bounce: read into private memory, copied into the row (one more copy of every byte); "
          "a hung read never writes the row")
    print("                direct: read straight into the row (no copy); an expiry is reported only once the "
          "read returned (kernel-bounded I/O only)")
    if d.get("crc_copy_error"):
        print(f"CRC copy:       error: {d['crc_copy_error']}")
    elif cp is None:
        print("CRC copy:       not available: the C core is not importable")
    elif cp["enabled"]:
        print(f"CRC copy:       on ({cp['kernel']}); C-core checksummed loads: private memory, then one pass "
              f"of copy (non-temporal stores) + CRC32C: {cp['blocks']} blocks, {cp['bytes']} bytes"
              + (" (the pure-Python fallback uses it too; blocks and bytes count C-core loads only)" if fallback else ""))
    else:
        if os.environ.get("KVTIER_CRC_COPY", "").lower() in ("0", "false", "no", "off"):
            why = "KVTIER_CRC_COPY"
        elif cp["kernel"] == "generic":
            why = "no fused kernel for this CPU (x86-64 with PCLMULQDQ + SSE4.2 needed)"
        elif d["crc32c_backend"] in ("dsa", "dsa-model"):
            why = (f"the CRC32C backend is {d['crc32c_backend']}: checksummed loads copy each piece at or above the "
                   "DSA min size into the buffer with one COPY_CRC op, counted below")
        else:
            why = f"the CRC32C backend is forced to {d['crc32c_backend']}"
        print(f"CRC copy:       off ({why}); kernel {cp['kernel']}")
    for i, line in enumerate(d["dsa"].splitlines()):
        print(("DSA:            " if i == 0 else "                ") + line)


def cmd_info(args: argparse.Namespace) -> int:
    """``kvtier info [ROOT]``: print :func:`info_dict` (and with ``args.root`` the root's
    section, :func:`kvtier.cli.root_info.root_info`) as text, or as JSON with ``args.json``.
    Returns 0; 2 when a KVTIER_* setting is refused (``KVTIER_IO_BACKEND``, ``KVTIER_IO_URING``,
    ``KVTIER_CRC_COPY``, ``KVTIER_LOAD_LANDING``: shown as an error where it acts, and on
    stderr naming the variable and its valid values, everything else still printed), when
    ROOT does not exist or is no directory (as every subcommand:
    :func:`kvtier.cli._text.dir_error`) or cannot be read (EACCES: the OSError's errno and
    path, as ``kvtier scrub`` and ``kvtier evict``); a missing C core or DSA is reported, not
    an error. (A refused ``KVTIER_CRC32C_BACKEND`` or ``KVTIER_DSA*`` fails ``import kvtier``
    itself, before this command runs: the package says it, one line and exit 2, when it is
    imported by this command: ``kvtier._said_by_the_command``.)"""
    from kvtier.cli._text import EXIT_USAGE, dir_error

    if getattr(args, "root", None) is not None:
        err = dir_error(args.root)
        if err is not None:
            print(f"kvtier info: {err}", file=sys.stderr)
            return EXIT_USAGE
    d = info_dict()
    if getattr(args, "root", None) is not None:
        from kvtier.cli.root_info import print_root_info, root_info

        try:
            d["root"] = root_info(args.root)
        except OSError as e:
            print(f"kvtier info: {e}", file=sys.stderr)
            return EXIT_USAGE
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        _print_info(d)
        if "root" in d:
            print_root_info(d["root"])
    for msg in d["setting_errors"]:
        print(f"kvtier info: {msg}", file=sys.stderr)
    return EXIT_USAGE if d["setting_errors"] else 0


def build_parser() -> argparse.ArgumentParser:
    """The ``kvtier`` argument parser with its subcommands ``info``, ``bench``, ``scrub``, ``doctor`` and ``evict``;
    each sets ``func``, the handler that takes the parsed Namespace and returns an exit status."""
    p = argparse.ArgumentParser(prog="kvtier", description="Checksummed storage tier for LLM KV-cache blocks.",
                                epilog="Exit status of every command but doctor: 0 done (clean); 1 a check failed "
                                       "or found something (each command's --help says what); 2 bad arguments. "
                                       "doctor: 0 every check passed, 1 a warning, 2 a failed check (kvtier cannot "
                                       "run there) or bad arguments. Bad arguments include a ROOT (or bench --root, "
                                       "doctor --peer) that does not exist or is no directory: the message on "
                                       "stderr names the path and the errno text.")
    p.add_argument("--version", action="version", version=f"kvtier {kvtier.__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    pi = sub.add_parser("info", help="what is built and active: C core, CRC32C backends, ISA-L, CPU, DSA")
    pi.add_argument("root", nargs="?", metavar="ROOT",
                    help="also a cache root: its filesystem, rank directories and capacity (the latest census, "
                         "the writers, the evictor lock), read without a scan")
    pi.add_argument("--json", action="store_true", help="print a JSON object")
    pi.set_defaults(func=cmd_info)
    # --- tier helper: bench, scrub, doctor, evict (kvtier/cli/bench.py, scrub.py, doctor.py, evict.py) ---
    from kvtier.cli import bench as _bench, doctor as _doctor, evict as _evict, scrub as _scrub

    _bench.add_parser(sub)
    _scrub.add_parser(sub)
    _doctor.add_parser(sub)
    _evict.add_parser(sub)
    # --- end tier helper ---
    return p


def main(argv=None) -> int:
    """Entry point of the ``kvtier`` command.  ``argv``: list of str arguments without the
    program name (None: ``sys.argv[1:]``).  Returns the subcommand's exit status (int: 0 ok,
    1 check failed, 2 bad arguments, a ROOT that does not exist or is no directory among
    them: :data:`kvtier.cli._text.EXIT_USAGE`; ``doctor``: 1 a warning, 2 a failed check too).  argparse raises SystemExit (code 2) for an unknown
    command or option and (code 0) for ``--help`` / ``--version``."""
    args = build_parser().parse_args(argv)
    try:
        rc = args.func(args)
        sys.stdout.flush()  # inside the try: a reader gone by the exit flush is the same case
    except BrokenPipeError:  # `kvtier scrub ROOT | head`: the reader left; stop quietly, as ls does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit flush finds a sink
        return 128 + signal.SIGPIPE  # what a shell reports for a command ended by SIGPIPE
    return rc


if __name__ == "__main__":
    sys.exit(main())
