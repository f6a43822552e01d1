"""Two real distributed filesystems on one machine: GlusterFS and MooseFS, two clients each.

As /work/shared/dfs.md describes: the servers (glusterd + 2 bricks; mfsmaster + 2
chunkservers) run in a network namespace of their own, the two FUSE clients ("node A" and
"node B") in a second one; the two are joined by a veth pair carrying a private /24
(``SUBNET``). Every daemon is started here, in the foreground, as a child process
(``nsenter --net=/run/netns/NS``, so the client mounts land in this mount namespace, where
the tests run); teardown stops exactly those PIDs (and the brick PIDs glusterd wrote into
its private run directory), never anything by name, and deletes the two namespaces. No
traffic leaves them. Each work directory records what it started (state.json); a run
killed before its teardown is swept by the next one (:func:`sweep_leftovers`: only what
that record names, once its owner process is gone).

Clients mount with the options docs/shared-filesystems.md recommends
(``--fopen-keep-cache=false`` for GlusterFS, ``mfsxattrcacheto=0`` for MooseFS) unless
``defaults=True`` is asked for (a third mount, for the doctor's staleness probe).

    with cluster("glusterfs", workdir) as c:
        c.mounts       # [mount of node A, mount of node B]
        c.storage_pids # brick / chunkserver PIDs (SIGSTOP them to stall the storage)

Run by hand: ``python tests/dfs.py glusterfs [SECONDS]`` starts one, prints the mounts, and
tears it down on Enter (or after SECONDS, or on SIGTERM).

Missing root, /dev/fuse, ``ip netns`` or the packages (``scripts/bootstrap --test``) calls
``ci.unavailable`` (a skip; a failure under ``CI=true``).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Dict, Iterator, List, Optional

KINDS = ("glusterfs", "moosefs")
#: Mount options the guide recommends, per filesystem (the clients' command-line spelling).
RECOMMENDED = {"glusterfs": ["--fopen-keep-cache=false"], "moosefs": ["-o", "mfsxattrcacheto=0"]}
SUBNET = "10.214.14"  # .1 servers, .2 clients; only inside the two namespaces made here
SERVER_IP = SUBNET + ".1"
CLIENT_IP = SUBNET + ".2"
START_TIMEOUT = 60.0  # s, any one start-up step
GLUSTER_PING_TIMEOUT = 10  # s, network.ping-timeout of the test volume
_PROGRAMS = {
    "glusterfs": ("glusterd", "gluster", "glusterfs"),
    "moosefs": ("mfsmaster", "mfschunkserver", "mfsmount", "mfssettrashtime", "mfscheckfile"),
}


def _unavailable(reason: str) -> None:
    from ci import unavailable

    unavailable(reason)


def missing(kind: str) -> Optional[str]:
    """Why ``kind`` cannot run on this host (None: it can)."""
    if os.geteuid() != 0:
        return "distributed filesystem tests need root (network namespaces, FUSE mounts)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    for prog in ("ip", "nsenter", "umount", *_PROGRAMS[kind]):
        if shutil.which(prog) is None and not os.path.exists(f"/usr/sbin/{prog}"):
            return f"{prog} not installed (scripts/bootstrap --test installs {kind})"
    return None


def _run(cmd: List[str], timeout: float = START_TIMEOUT, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {p.returncode}: {p.stdout.strip()[-2000:]}")
    return p


def _mounted(path: str) -> Optional[str]:
    """fstype of the mount whose mount point is exactly ``path``, or None."""
    real = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            sep = parts.index("-")
            if parts[4] == real:
                return parts[sep + 1]
    return None


def _listening(pid: int, port: int) -> bool:
    """A TCP socket in LISTEN state on ``port`` in the network namespace of process ``pid``."""
    try:
        with open(f"/proc/{pid}/net/tcp") as f:
            rows = f.read().splitlines()[1:]
    except OSError:
        return False
    return any(r.split()[1].endswith(f":{port:04X}") and r.split()[3] == "0A" for r in rows)


def _wait(what: str, cond, timeout: float = START_TIMEOUT, procs=()) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: {p.args[0] if p.args else p} exited with {p.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.1)


STATE = "state.json"  # in a cluster's work directory: what it started, for sweep_leftovers


def _note(work: str, **lists) -> None:
    """Add to the work directory's record of what was started (owner PID, netns, PIDs, mounts)."""
    path = os.path.join(work, STATE)
    try:
        with open(path) as f:
            st = json.load(f)
    except FileNotFoundError:
        st = {"owner": os.getpid(), "netns": [], "pids": [], "mounts": []}
    for k, v in lists.items():
        st[k] += v
    with open(path + ".tmp", "w") as f:
        json.dump(st, f)
    os.replace(path + ".tmp", path)


def sweep_leftovers(workdir: Optional[str] = None) -> List[str]:
    """Tear down clusters left by a killed run (its owner process is gone): by its own
    record only (state.json and glusterd's brick PID files in its work directory): unmount
    its mounts, stop its PIDs whose command line names the work directory, delete its
    namespaces, remove the directory. Returns the directories swept."""
    base = workdir or tempfile.gettempdir()
    swept = []
    for d in sorted(os.listdir(base)):
        work = os.path.join(base, d)
        if not d.startswith(("kvtier-glusterfs-", "kvtier-moosefs-")) or not os.path.isfile(os.path.join(work, STATE)):
            continue
        with open(os.path.join(work, STATE)) as f:
            st = json.load(f)
        if os.path.exists(f"/proc/{st['owner']}"):
            continue  # its owner still runs (another session's cluster)
        for mnt in st["mounts"]:
            if _mounted(mnt):
                subprocess.run(["umount", "-l", mnt], stderr=subprocess.DEVNULL)
        vols = os.path.join(work, "run", "vols", "kvt")
        bricks = [int(open(os.path.join(vols, f)).read().strip() or 0) for f in os.listdir(vols)
                  if f.endswith(".pid")] if os.path.isdir(vols) else []
        leftovers = []  # a brick's socket and log outside the work directory
        for pid in [*st["pids"], *bricks]:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().decode(errors="replace").split("\0")
                if any(work in a for a in argv):
                    leftovers += [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("-S", "-l")]
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)
            except (OSError, ValueError):
                pass
        for f in leftovers:
            with contextlib.suppress(OSError):
                os.unlink(f)
        for ns in st["netns"]:
            subprocess.run(["ip", "netns", "delete", ns], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(work, ignore_errors=True)
        swept.append(work)
    return swept


class Network:
    """Two network namespaces (servers, clients) joined by a veth pair on ``SUBNET``.0/24."""

    def __init__(self, tag: str):
        self.server = f"kvt{tag}s"
        self.client = f"kvt{tag}c"
        self._made: List[str] = []
        try:
            for ns in (self.server, self.client):
                _run(["ip", "netns", "add", ns])
                self._made.append(ns)
            _run(["ip", "link", "add", f"kvt{tag}a", "netns", self.server, "type", "veth",
                  "peer", "name", f"kvt{tag}b", "netns", self.client])
            for ns, dev, ip in ((self.server, f"kvt{tag}a", SERVER_IP), (self.client, f"kvt{tag}b", CLIENT_IP)):
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
                _run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev])
                _run(["ip", "-n", ns, "link", "set", dev, "up"])
        except BaseException:
            self.close()
            raise

    def cmd(self, ns: str, argv: List[str]) -> List[str]:
        """``argv`` run in netns ``ns`` but this mount namespace (mounts stay visible here)."""
        return ["nsenter", f"--net=/run/netns/{ns}", *argv]

    def close(self) -> None:
        for ns in reversed(self._made):  # deleting a namespace deletes its veth end and the pair
            subprocess.run(["ip", "netns", "delete", ns], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._made.clear()


class Cluster:
    """One running filesystem: servers, two client mounts (node A, node B)."""

    def __init__(self, kind: str, net: Network, workdir: str):
        self.kind = kind
        self.fstype = ""  # as /proc/self/mountinfo names it, once mounted
        self.net = net
        self.work = workdir
        self.mounts: List[str] = []
        self._procs: Dict[str, subprocess.Popen] = {}  # name -> daemon we started
        self._logs: List = []
        self._extra_mounts: List[str] = []

    # -------------------------------------------------------------- processes
    def _spawn(self, name: str, ns: str, argv: List[str]) -> subprocess.Popen:
        log = open(os.path.join(self.work, f"{name}.log"), "ab")
        self._logs.append(log)
        p = subprocess.Popen(self.net.cmd(ns, argv), stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        self._procs[name] = p
        _note(self.work, pids=[p.pid])
        return p

    def log_tail(self, n: int = 4000) -> str:
        out = []
        for f in sorted(os.listdir(self.work)):
            if f.endswith(".log"):
                with open(os.path.join(self.work, f), "rb") as fh:
                    out.append(f"--- {f}\n" + fh.read()[-n:].decode(errors="replace"))
        return "\n".join(out)

    @property
    def pids(self) -> List[int]:
        """Every daemon started for this filesystem (glusterd's bricks included)."""
        bricks = self.storage_pids if self.kind == "glusterfs" else []
        return sorted({p.pid for p in self._procs.values()} | set(bricks))

    @property
    def storage_pids(self) -> List[int]:
        """PIDs of the processes holding the data (GlusterFS bricks, MooseFS chunkservers)."""
        if self.kind == "moosefs":
            return [p.pid for n, p in self._procs.items() if n.startswith("chunkserver")]
        pids = []
        vols = os.path.join(self.work, "run", "vols", "kvt")  # glusterd writes one PID file per brick
        for f in sorted(os.listdir(vols)) if os.path.isdir(vols) else ():
            if f.endswith(".pid"):
                with open(os.path.join(vols, f)) as fh:
                    txt = fh.read().strip()
                if txt:
                    pids.append(int(txt))
        return pids

    def client_tool(self, *argv: str) -> str:
        """Run a client-side tool (mfssetgoal, mfsfileinfo...) in the clients' namespace."""
        return _run(self.net.cmd(self.net.client, list(argv))).stdout

    def storage_of(self, path: str) -> List[int]:
        """Indices (into :attr:`storage_pids`) of the storage servers holding the data of
        ``path`` (a file under one of :attr:`mounts`)."""
        mnt = next(m for m in self.mounts if path.startswith(m + "/"))
        if self.kind == "glusterfs":  # the brick holding the data file (not a DHT link file)
            rel = os.path.relpath(path, mnt)
            size = os.path.getsize(path)
            return [i for i in (0, 1) if os.path.isfile(p := os.path.join(self.work, f"brick{i + 1}", rel))
                    and os.path.getsize(p) == size and size > 0]
        info = self.client_tool("mfsfileinfo", path)  # "copy 1: 10.214.14.1:9422 ..."
        return sorted({int(port) - 9422 for port in
                       (w.split(":")[-1] for w in info.split() if w.startswith(SERVER_IP + ":")) if port.isdigit()})

    # -------------------------------------------------------------- start
    def start(self) -> None:
        (self._start_gluster if self.kind == "glusterfs" else self._start_moosefs)()
        for node in ("a", "b"):
            self.mounts.append(self.mount(node))

    def mount(self, node: str, defaults: bool = False) -> str:
        """A new client mount (``defaults``: without the recommended options)."""
        mnt = os.path.join(self.work, f"mnt-{node}")
        os.makedirs(mnt)
        _note(self.work, mounts=[mnt])
        opts = [] if defaults else RECOMMENDED[self.kind]
        if self.kind == "glusterfs":
            argv = ["/usr/sbin/glusterfs", "-N", f"--volfile-server={SERVER_IP}", "--volfile-id=/kvt",
                    f"--log-file={self.work}/client-{node}.glusterfs.log", *opts, mnt]
        else:
            argv = ["mfsmount", "-f", "-H", SERVER_IP, "-P", "9421", *opts, mnt]
        p = self._spawn(f"client-{node}", self.net.client, argv)
        _wait(f"{self.kind} client {node} mount", lambda: (_mounted(mnt) or "").startswith("fuse"), procs=[p])
        if self.kind == "moosefs":  # a fresh client reports size 0 until the master sends the chunkservers' space:
            # kvtier doctor then warns "no size reported (ramfs-like)" (test_dfs_recommended_mounts_pass, 1 in 3)
            _wait(f"moosefs client {node} reports the volume's size", lambda: os.statvfs(mnt).f_blocks > 0,
                  procs=[p])
        self.fstype = _mounted(mnt)
        if node not in ("a", "b"):
            self._extra_mounts.append(mnt)
        return mnt

    def _start_gluster(self) -> None:
        wd = os.path.join(self.work, "glusterd")
        run = os.path.join(self.work, "run")
        os.makedirs(wd)
        os.makedirs(run)
        vol = os.path.join(self.work, "glusterd.vol")
        with open(vol, "w") as f:
            f.write("volume management\n    type mgmt/glusterd\n"
                    f"    option working-directory {wd}\n    option run-directory {run}\n"
                    "    option transport-type socket\n    option transport.socket.listen-port 24007\n"
                    f"    option transport.socket.bind-address {SERVER_IP}\n"
                    f"    option glusterd-sockfile {run}/cli.socket\n"
                    "    option ping-timeout 0\n    option event-threads 1\nend-volume\n")
        sock = os.path.join(run, "cli.socket")
        self._gsock = sock
        p = self._spawn("glusterd", self.net.server,
                        ["/usr/sbin/glusterd", "-N", "-f", vol, "-S", os.path.join(run, "glusterd.socket"), "-p", os.path.join(run, "glusterd.pid"),
                         f"--log-file={self.work}/glusterd.glusterfs.log"])
        _wait("glusterd socket", lambda: os.path.exists(sock), procs=[p])
        bricks = []
        for i in (1, 2):
            b = os.path.join(self.work, f"brick{i}")
            os.makedirs(b)
            bricks.append(f"{SERVER_IP}:{b}")
        self.gluster("volume", "create", "kvt", "transport", "tcp", *bricks, "force")
        # a client declares a silent brick gone after this (default 42 s); until then a
        # directory lookup, which asks every brick, waits for it (the stopped-brick test)
        self.gluster("volume", "set", "kvt", "network.ping-timeout", str(GLUSTER_PING_TIMEOUT))
        self.gluster("volume", "start", "kvt")
        _wait("gluster bricks", lambda: len(self.storage_pids) == 2, procs=[p])

    def gluster(self, *args: str) -> str:
        return _run(self.net.cmd(self.net.server, ["gluster", f"--glusterd-sock={self._gsock}", "--mode=script",
                                                   f"--log-file={self.work}/cli.glusterfs.log", *args])).stdout

    def _start_moosefs(self) -> None:
        m = os.path.join(self.work, "master")
        os.makedirs(m)
        shutil.copy("/var/lib/mfs/metadata.mfs.empty", os.path.join(m, "metadata.mfs"))
        with open(os.path.join(self.work, "mfsexports.cfg"), "w") as f:
            f.write("* / rw,alldirs,maproot=0\n")
        with open(os.path.join(self.work, "mfsmaster.cfg"), "w") as f:
            f.write(f"WORKING_USER = root\nWORKING_GROUP = root\nDATA_PATH = {m}\n"
                    f"EXPORTS_FILENAME = {self.work}/mfsexports.cfg\n"
                    f"MATOML_LISTEN_HOST = {SERVER_IP}\nMATOCS_LISTEN_HOST = {SERVER_IP}\n"
                    f"MATOCL_LISTEN_HOST = {SERVER_IP}\n")
        master = self._spawn("master", self.net.server,
                             ["mfsmaster", "-f", "-c", f"{self.work}/mfsmaster.cfg", "start"])
        _wait("mfsmaster listening", lambda: _listening(master.pid, 9421), procs=[master])
        css = []
        for i in (1, 2):
            d = os.path.join(self.work, f"cs{i}")
            os.makedirs(os.path.join(d, "chunks"))
            with open(os.path.join(d, "mfshdd.cfg"), "w") as f:
                f.write(os.path.join(d, "chunks") + "\n")
            with open(os.path.join(d, "mfschunkserver.cfg"), "w") as f:
                f.write(f"WORKING_USER = root\nWORKING_GROUP = root\nDATA_PATH = {d}\n"
                        f"HDD_CONF_FILENAME = {d}/mfshdd.cfg\nMASTER_HOST = {SERVER_IP}\n"
                        f"BIND_HOST = {SERVER_IP}\nCSSERV_LISTEN_HOST = {SERVER_IP}\n"
                        f"CSSERV_LISTEN_PORT = {9421 + i}\nHDD_TEST_FREQ = 0\n")
            css.append(self._spawn(f"chunkserver{i}", self.net.server,
                                   ["mfschunkserver", "-f", "-c", f"{d}/mfschunkserver.cfg", "start"]))
        self._mfs_procs = [master, *css]

    def after_mount(self) -> None:
        """MooseFS: trash time 0 (deleted files free their chunks now, not in 24 h) and wait
        until both chunkservers hold a copy of a test file (goal 2 = both registered)."""
        if self.kind != "moosefs":
            return
        a = self.mounts[0]
        cmd = self.net.cmd
        _run(cmd(self.net.client, ["mfssettrashtime", "-r", "0", a]))
        probe = os.path.join(a, ".kvt-cs-probe")
        with open(probe, "wb") as f:
            f.write(b"x" * 4096)
        try:
            _wait("both MooseFS chunkservers registered",
                  lambda: "with 2 copies" in _run(cmd(self.net.client, ["mfscheckfile", probe]), check=False).stdout,
                  procs=self._mfs_procs)
        finally:
            os.unlink(probe)

    # -------------------------------------------------------------- stop
    def _stop(self, name: str, p: subprocess.Popen, timeout: float = 20.0) -> None:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)  # a test may have left it stopped
                p.terminate()
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)

    def close(self) -> None:
        for mnt in [*self._extra_mounts, *self.mounts]:
            if _mounted(mnt):
                if subprocess.run(["umount", mnt], stderr=subprocess.DEVNULL).returncode != 0:
                    subprocess.run(["umount", "-l", mnt], stderr=subprocess.DEVNULL)
        for name in [n for n in self._procs if n.startswith("client")]:
            self._stop(name, self._procs.pop(name))
        bricks = self.storage_pids if self.kind == "glusterfs" else []
        leftovers = []  # a brick's socket (/var/run/gluster) and log (/var/log/glusterfs/bricks)
        for pid in bricks:
            with contextlib.suppress(OSError):
                argv = open(f"/proc/{pid}/cmdline", "rb").read().decode().split("\0")
                leftovers += [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("-S", "-l")]
        for pid in bricks:  # glusterd's children: their PID files in our run directory
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGTERM)
        for name in list(self._procs):  # chunkservers before the master, glusterd last
            self._stop(name, self._procs.pop(name))
        deadline = time.monotonic() + 20
        for pid in bricks:
            while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}") and \
                    not open(f"/proc/{pid}/stat").read().split(") ")[1].startswith("Z"):
                time.sleep(0.05)
            with contextlib.suppress(ProcessLookupError):
                if time.monotonic() >= deadline:
                    os.kill(pid, signal.SIGKILL)
        for f in leftovers:
            with contextlib.suppress(OSError):
                os.unlink(f)
        for log in self._logs:
            log.close()


@contextlib.contextmanager
def cluster(kind: str, workdir: Optional[str] = None, net: Optional[Network] = None) -> Iterator[Cluster]:
    """Start ``kind`` ("glusterfs" or "moosefs"); yields the running :class:`Cluster`;
    stops what it started and removes its files on exit."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    why = missing(kind)
    if why:
        _unavailable(why)
    own_net = net is None
    sweep_leftovers(workdir)
    work = tempfile.mkdtemp(prefix=f"kvtier-{kind}-", dir=workdir)
    c = None
    try:
        if own_net:
            tag = f"{os.getpid() % 100000}{kind[0]}"
            _note(work, netns=[f"kvt{tag}s", f"kvt{tag}c"])  # before they exist: a crash leaves a record
            try:
                net = Network(tag)
            except RuntimeError as e:
                _unavailable(f"cannot create network namespaces: {e}")
        c = Cluster(kind, net, work)
        try:
            c.start()
            c.after_mount()
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(f"{kind} did not start: {e}\n{c.log_tail()}") from None
        yield c
    finally:
        if c is not None:
            c.close()
        if own_net and net is not None:
            net.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    t0 = time.monotonic()
    with cluster(sys.argv[1]) as c:
        print(f"{c.kind} ({c.fstype}) up in {time.monotonic() - t0:.1f} s: mounts {c.mounts}, storage PIDs "
              f"{c.storage_pids}, namespaces {c.net.server} {c.net.client}, PIDs {c.pids}", flush=True)
        if len(sys.argv) > 2:  # hold for that many seconds (or until SIGINT/SIGTERM)
            signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
            try:
                time.sleep(float(sys.argv[2]))
            except (KeyboardInterrupt, SystemExit):
                pass
        elif sys.stdin.isatty():
            input("Enter to tear down ")
        t0 = time.monotonic()
    print(f"down in {time.monotonic() - t0:.1f} s")
