/* LD_PRELOAD fault shim for tests/test_block_io.py: injects the I/O
 * conditions a local filesystem rarely produces, into the C core and the
 * Python fallback alike (both go through libc). Only files and directories
 * whose path starts with $KVT_FAULT_DIR are affected (the interpreter's own
 * imports are not). Controlled by environment variables:
 *
 *   KVT_FAULT_DIO_EINVAL=1   pread/pwrite/preadv/pwritev on an O_DIRECT fd fail
 *                            with EINVAL: a filesystem that accepted O_DIRECT
 *                            at fcntl(F_SETFL) but refuses it at the first I/O.
 *   KVT_FAULT_EINTR=f1,f2..  the first call of each listed function per file
 *                            fails with EINTR (nothing done). Names: open,
 *                            pwrite, pread (pread + preadv), fsetxattr,
 *                            fgetxattr, rename, fsync, close (close really
 *                            closes, then reports EINTR, as Linux can).
 *   KVT_FAULT_SHORT=N        pread/pwrite/preadv transfer at most N bytes.
 *   KVT_FAULT_DIRSYNC_EIO=1  fsync of a directory fails with EIO; with
 *                            KVT_FAULT_PEER_SRC and KVT_FAULT_PEER_DST set, the
 *                            shim first renames SRC onto DST (a peer publishing
 *                            its block right after our rename).
 *                            KVT_FAULT_DIRSYNC_COUNT=N: only the first N such fsyncs
 *                            fail (a transient EIO), then they work.
 *   KVT_FAULT_ERRNO=f:E:N,.. the first N calls (N = -1: every call) of function f
 *                            per file fail with errno E (a number), nothing done.
 *                            Names: open, fstat (fstat, fstat64), pread (pread +
 *                            preadv: E = 0 returns 0 bytes, an early end of file:
 *                            a short read), fgetxattr, fsetxattr, pwrite,
 *                            fdatasync, fsync, rename, close (closes, then reports
 *                            E: an error after a good read), fallocate (fallocate,
 *                            fallocate64: E = 95 is a filesystem without it), mkdir
 *                            (E = 2: a parent another node just made that this
 *                            client's name cache does not show yet), lstat (lstat,
 *                            lstat64: a store's look at its destination). The error policy
 *                            tests (tests/test_policy.py) walk docs/design.md's
 *                            table with it.
 *   (open covers openat relative to a directory fd too, keyed by the whole path.)
 *   KVT_FAULT_HALF_EOF=PCT   each pread/preadv (of a file under the directory) with
 *                            probability PCT percent transfers at most half of what it
 *                            asks, and the next one on that fd returns 0 bytes (EOF):
 *                            a transient short read while fstat says the full size
 *                            (issue #24). KVT_FAULT_SEED=N seeds it (default 1).
 *   KVT_FAULT_LOG=path       one line per injected fault: "<func>\t<kind>\t<path>".
 *
 * glibc's headers may route pread/pwrite/open to their *64 names (and CPython's
 * os.preadv to preadv64v2), so every name is defined. Build: cc -shared -fPIC -o io_fault.so io_fault.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/xattr.h>
#include <unistd.h>

#define REAL(name, type)                                                                                       \
    static type real_##name;                                                                                   \
    if (!real_##name)                                                                                          \
        real_##name = (type)dlsym(RTLD_NEXT, #name);

typedef int (*open_t)(const char *, int, ...);
typedef int (*openat_t)(int, const char *, int, ...);
typedef ssize_t (*pio_t)(int, void *, size_t, off_t);
typedef ssize_t (*pwo_t)(int, const void *, size_t, off_t);
typedef ssize_t (*piov_t)(int, const struct iovec *, int, off_t);
typedef int (*fsetx_t)(int, const char *, const void *, size_t, int);
typedef ssize_t (*fgetx_t)(int, const char *, void *, size_t);
typedef int (*rename_t)(const char *, const char *);
typedef int (*mkdir_t)(const char *, mode_t);
typedef int (*renameat_t)(int, const char *, int, const char *);
typedef int (*fdop_t)(int);

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static int under_dir(const char *path)
{
    const char *d = getenv("KVT_FAULT_DIR");
    return d && *d && path && strncmp(path, d, strlen(d)) == 0;
}

/* Path of an open fd (readlink of /proc/self/fd), "" if unknown. */
static void fd_path(int fd, char *out, size_t n)
{
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t r = readlink(link, out, n - 1);
    out[r > 0 ? r : 0] = '\0';
}

static void log_fault(const char *func, const char *kind, const char *path)
{
    const char *log = getenv("KVT_FAULT_LOG");
    if (!log)
        return;
    REAL(open, open_t)
    int saved = errno;
    int fd = real_open(log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd >= 0) {
        char line[4400];
        int k = snprintf(line, sizeof line, "%s\t%s\t%s\n", func, kind, path);
        if (k > 0)
            (void)!write(fd, line, (size_t)k < sizeof line ? (size_t)k : sizeof line - 1);
        REAL(close, fdop_t)
        real_close(fd);
    }
    errno = saved;
}

/* 1 if `func` is listed in KVT_FAULT_EINTR and this is its first call for
 * `path` (then remembered). */
static int eintr_once(const char *func, const char *path)
{
    const char *list = getenv("KVT_FAULT_EINTR");
    if (!list || !under_dir(path))
        return 0;
    size_t fl = strlen(func);
    const char *p = list;
    int listed = 0;
    while (*p) {
        const char *e = strchr(p, ',');
        size_t l = e ? (size_t)(e - p) : strlen(p);
        if (l == fl && strncmp(p, func, l) == 0)
            listed = 1;
        p += l + (e != NULL);
    }
    if (!listed)
        return 0;
    uint64_t h = 1469598103934665603ull; /* FNV-1a of func '\0' path */
    for (const char *s = func; *s; s++)
        h = (h ^ (uint8_t)*s) * 1099511628211ull;
    h *= 1099511628211ull;
    for (const char *s = path; *s; s++)
        h = (h ^ (uint8_t)*s) * 1099511628211ull;
    static uint64_t seen[4096];
    static size_t nseen;
    int first = 1;
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < nseen; i++)
        if (seen[i] == h)
            first = 0;
    if (first && nseen < sizeof seen / sizeof seen[0])
        seen[nseen++] = h;
    else if (first)
        first = 0; /* table full: stop injecting */
    pthread_mutex_unlock(&mu);
    if (first)
        log_fault(func, "EINTR", path);
    return first;
}

/* KVT_FAULT_ERRNO: 1 with *err set if this call of `func` on `path` is to
 * fail (then counted and logged as "E<err>"). */
static int errno_fault(const char *func, const char *path, int *err)
{
    const char *list = getenv("KVT_FAULT_ERRNO");
    if (!list || !under_dir(path))
        return 0;
    size_t fl = strlen(func);
    long want = 0;
    int e = 0, listed = 0;
    for (const char *p = list; *p;) {
        const char *end = strchr(p, ',');
        size_t l = end ? (size_t)(end - p) : strlen(p);
        const char *c1 = memchr(p, ':', l);
        if (c1 && (size_t)(c1 - p) == fl && strncmp(p, func, fl) == 0) {
            char *c2;
            e = (int)strtol(c1 + 1, &c2, 10);
            want = *c2 == ':' ? strtol(c2 + 1, NULL, 10) : 1;
            listed = 1;
        }
        p += l + (end != NULL);
    }
    if (!listed)
        return 0;
    uint64_t h = 14695981039346656037ull; /* FNV-1a of func '\0' path */
    for (const char *s = func; *s; s++)
        h = (h ^ (uint8_t)*s) * 1099511628211ull;
    h *= 1099511628211ull;
    for (const char *s = path; *s; s++)
        h = (h ^ (uint8_t)*s) * 1099511628211ull;
    static uint64_t keys[4096];
    static long counts[4096];
    static size_t nkeys;
    int fire = 0;
    pthread_mutex_lock(&mu);
    size_t i = 0;
    while (i < nkeys && keys[i] != h)
        i++;
    if (i == nkeys && nkeys < sizeof keys / sizeof keys[0]) {
        keys[nkeys] = h;
        counts[nkeys++] = 0;
    }
    if (i < nkeys && (want < 0 || counts[i] < want)) {
        counts[i]++;
        fire = 1;
    }
    pthread_mutex_unlock(&mu);
    if (fire) {
        char kind[16];
        snprintf(kind, sizeof kind, "E%d", e);
        log_fault(func, kind, path);
        *err = e;
    }
    return fire;
}

/* KVT_FAULT_HALF_EOF: 1 if this read of fd is to be cut (*len halved, or 0:
 * the EOF after a halved one). */
static int half_eof(const char *func, int fd, size_t *len)
{
    const char *pct = getenv("KVT_FAULT_HALF_EOF");
    if (!pct || strcmp(func, "pread") != 0 || fd < 0 || fd >= 65536)
        return 0;
    static unsigned char eof_next[65536];
    static unsigned seed;
    static int seeded;
    int cut = 0;
    pthread_mutex_lock(&mu);
    if (!seeded) {
        const char *sd = getenv("KVT_FAULT_SEED");
        seed = sd ? (unsigned)strtoul(sd, NULL, 10) : 1u;
        seeded = 1;
    }
    if (eof_next[fd]) {
        eof_next[fd] = 0;
        *len = 0;
        cut = 1;
    } else if ((unsigned)(rand_r(&seed) % 10000) < (unsigned)(atof(pct) * 100) && *len > 1) {
        *len /= 2;
        eof_next[fd] = 1;
        cut = 2;
    }
    pthread_mutex_unlock(&mu);
    return cut;
}

static size_t short_limit(void)
{
    const char *s = getenv("KVT_FAULT_SHORT");
    return s ? (size_t)strtoull(s, NULL, 10) : 0;
}

/* Common pre-checks of a positional transfer on fd. Returns -1 (errno set)
 * to fail the call, else 0 with *len possibly reduced. */
static int rw_fault(const char *func, int fd, size_t *len)
{
    char path[4096];
    fd_path(fd, path, sizeof path);
    if (!under_dir(path))
        return 0;
    if (eintr_once(func, path)) {
        errno = EINTR;
        return -1;
    }
    int e;
    if (errno_fault(func, path, &e)) {
        if (e == 0) { /* early end of file */
            *len = 0;
            return 0;
        }
        errno = e;
        return -1;
    }
    const char *dio = getenv("KVT_FAULT_DIO_EINVAL");
    if (dio && dio[0] == '1') {
        int fl = fcntl(fd, F_GETFL);
        if (fl >= 0 && (fl & O_DIRECT)) {
            log_fault(func, "DIO_EINVAL", path);
            errno = EINVAL;
            return -1;
        }
    }
    int h = half_eof(func, fd, len);
    if (h)
        log_fault(func, h == 1 ? "EOF" : "HALF", path);
    size_t lim = short_limit();
    if (lim && *len > lim) {
        *len = lim;
        log_fault(func, "SHORT", path);
    }
    return 0;
}

/* ---------------------------------------------------------------- open */

/* The faults of a call of `func` on `path` (KVT_FAULT_EINTR when `eintr`, then
 * KVT_FAULT_ERRNO): 0, or -1 with errno set. */
static int fault_at(const char *func, const char *path, int eintr)
{
    int e;
    if (eintr && eintr_once(func, path)) {
        errno = EINTR;
        return -1;
    }
    if (errno_fault(func, path, &e)) {
        errno = e;
        return -1;
    }
    return 0;
}

/* open, or openat relative to a directory fd (the C core's loads of a batch
 * under one directory): the faults of "open", keyed by the whole path; then the
 * real `name` (open/open64 when dirfd is AT_FDCWD and name is not an openat). */
static int do_openat(const char *name, int dirfd, const char *path, int flags, va_list ap)
{
    char full[8200];
    if (dirfd != AT_FDCWD && path[0] != '/') {
        char dir[4096];
        fd_path(dirfd, dir, sizeof dir);
        snprintf(full, sizeof full, "%s/%s", dir, path);
    } else {
        snprintf(full, sizeof full, "%s", path);
    }
    mode_t mode = 0;
    if (flags & (O_CREAT | O_TMPFILE))
        mode = (mode_t)va_arg(ap, int);
    if (fault_at("open", full, 1) != 0)
        return -1;
    if (strncmp(name, "openat", 6) != 0)
        return ((open_t)dlsym(RTLD_NEXT, name))(path, flags, mode);
    openat_t real = (openat_t)dlsym(RTLD_NEXT, name);
    return real(dirfd, path, flags, mode);
}

/* The variadic entry points (open, open64, openat, openat64): `fn` with `params`
 * calls do_openat with its name, the directory fd, path, flags and the va_list. */
#define OPEN_ENTRY(fn, params, ...)                                                                           \
    int fn params                                                                                                    \
    {                                                                                                                \
        va_list ap;                                                                                                  \
        va_start(ap, flags);                                                                                         \
        int r = do_openat(#fn, __VA_ARGS__, ap);                                                                      \
        va_end(ap);                                                                                                  \
        return r;                                                                                                    \
    }
OPEN_ENTRY(open, (const char *path, int flags, ...), AT_FDCWD, path, flags)
OPEN_ENTRY(open64, (const char *path, int flags, ...), AT_FDCWD, path, flags)
OPEN_ENTRY(openat, (int dirfd, const char *path, int flags, ...), dirfd, path, flags)
OPEN_ENTRY(openat64, (int dirfd, const char *path, int flags, ...), dirfd, path, flags)

/* ---------------------------------------------------------------- mkdir */

int mkdir(const char *path, mode_t mode)
{
    if (fault_at("mkdir", path, 0) != 0)
        return -1;
    mkdir_t real = (mkdir_t)dlsym(RTLD_NEXT, "mkdir");
    return real(path, mode);
}

/* ---------------------------------------------------------------- pwrite / pread */

static ssize_t do_pwrite(const char *name, int fd, const void *buf, size_t len, off_t off)
{
    if (rw_fault("pwrite", fd, &len) != 0)
        return -1;
    pwo_t real = (pwo_t)dlsym(RTLD_NEXT, name);
    return real(fd, buf, len, off);
}

static ssize_t do_pread(const char *name, int fd, void *buf, size_t len, off_t off)
{
    if (rw_fault("pread", fd, &len) != 0)
        return -1;
    pio_t real = (pio_t)dlsym(RTLD_NEXT, name);
    return real(fd, buf, len, off);
}

ssize_t pwrite(int fd, const void *buf, size_t len, off_t off) { return do_pwrite("pwrite", fd, buf, len, off); }
ssize_t pwrite64(int fd, const void *buf, size_t len, off_t off) { return do_pwrite("pwrite64", fd, buf, len, off); }
ssize_t pread(int fd, void *buf, size_t len, off_t off) { return do_pread("pread", fd, buf, len, off); }
ssize_t pread64(int fd, void *buf, size_t len, off_t off) { return do_pread("pread64", fd, buf, len, off); }

/* Vectored forms (the Python fallback reads with os.preadv, which CPython
 * built against glibc >= 2.26 issues as preadv64v2 with flags 0). */
typedef ssize_t (*piov2_t)(int, const struct iovec *, int, off_t, int);
static ssize_t do_iov2(const char *func, const char *name, int fd, const struct iovec *iov, int cnt, off_t off,
                       int flags, int v2)
{
    size_t total = 0;
    for (int i = 0; i < cnt; i++)
        total += iov[i].iov_len;
    size_t len = total;
    if (rw_fault(func, fd, &len) != 0)
        return -1;
    void *real = dlsym(RTLD_NEXT, name);
#define CALL(v, c) (v2 ? ((piov2_t)real)(fd, v, c, off, flags) : ((piov_t)real)(fd, v, c, off))
    if (len == total)
        return CALL(iov, cnt);
    struct iovec cut[64];
    int n = 0;
    for (int i = 0; i < cnt && n < 64 && len > 0; i++, n++) {
        cut[n].iov_base = iov[i].iov_base;
        cut[n].iov_len = iov[i].iov_len < len ? iov[i].iov_len : len;
        len -= cut[n].iov_len;
    }
    return CALL(cut, n);
#undef CALL
}

static ssize_t do_iov(const char *func, const char *name, int fd, const struct iovec *iov, int cnt, off_t off)
{
    return do_iov2(func, name, fd, iov, cnt, off, 0, 0);
}

ssize_t preadv(int fd, const struct iovec *iov, int cnt, off_t off) { return do_iov("pread", "preadv", fd, iov, cnt, off); }
ssize_t preadv64(int fd, const struct iovec *iov, int cnt, off_t off) { return do_iov("pread", "preadv64", fd, iov, cnt, off); }
ssize_t pwritev(int fd, const struct iovec *iov, int cnt, off_t off) { return do_iov("pwrite", "pwritev", fd, iov, cnt, off); }
ssize_t pwritev64(int fd, const struct iovec *iov, int cnt, off_t off) { return do_iov("pwrite", "pwritev64", fd, iov, cnt, off); }

ssize_t preadv2(int fd, const struct iovec *iov, int cnt, off_t off, int flags)
{
    return do_iov2("pread", "preadv2", fd, iov, cnt, off, flags, 1);
}
ssize_t preadv64v2(int fd, const struct iovec *iov, int cnt, off_t off, int flags)
{
    return do_iov2("pread", "preadv64v2", fd, iov, cnt, off, flags, 1);
}
ssize_t pwritev2(int fd, const struct iovec *iov, int cnt, off_t off, int flags)
{
    return do_iov2("pwrite", "pwritev2", fd, iov, cnt, off, flags, 1);
}
ssize_t pwritev64v2(int fd, const struct iovec *iov, int cnt, off_t off, int flags)
{
    return do_iov2("pwrite", "pwritev64v2", fd, iov, cnt, off, flags, 1);
}

/* ---------------------------------------------------------------- xattr */

int fsetxattr(int fd, const char *name, const void *val, size_t n, int flags)
{
    REAL(fsetxattr, fsetx_t)
    char path[4096];
    fd_path(fd, path, sizeof path);
    if (fault_at("fsetxattr", path, 1) != 0)
        return -1;
    return real_fsetxattr(fd, name, val, n, flags);
}

ssize_t fgetxattr(int fd, const char *name, void *val, size_t n)
{
    REAL(fgetxattr, fgetx_t)
    char path[4096];
    fd_path(fd, path, sizeof path);
    if (fault_at("fgetxattr", path, 1) != 0)
        return -1;
    return real_fgetxattr(fd, name, val, n);
}

/* ---------------------------------------------------------------- fallocate */

typedef int (*falloc_t)(int, int, off_t, off_t);

static int do_fallocate(const char *name, int fd, int mode, off_t off, off_t len)
{
    static falloc_t real;
    if (!real)
        real = (falloc_t)dlsym(RTLD_NEXT, name);
    char path[4096];
    fd_path(fd, path, sizeof path);
    if (fault_at("fallocate", path, 0) != 0)
        return -1;
    return real(fd, mode, off, len);
}

int fallocate(int fd, int mode, off_t off, off_t len) { return do_fallocate("fallocate", fd, mode, off, len); }
int fallocate64(int fd, int mode, off_t off, off_t len) { return do_fallocate("fallocate64", fd, mode, off, len); }

/* ---------------------------------------------------------------- rename */

int rename(const char *from, const char *to)
{
    REAL(rename, rename_t)
    if (eintr_once("rename", from)) {
        errno = EINTR;
        return -1;
    }
    int e;
    if (errno_fault("rename", from, &e)) {
        errno = e;
        return -1;
    }
    return real_rename(from, to);
}

int renameat(int fromfd, const char *from, int tofd, const char *to)
{
    REAL(renameat, renameat_t)
    if (fromfd == AT_FDCWD && eintr_once("rename", from)) {
        errno = EINTR;
        return -1;
    }
    return real_renameat(fromfd, from, tofd, to);
}

/* ---------------------------------------------------------------- fsync / close */

int fsync(int fd)
{
    REAL(fsync, fdop_t)
    char path[4096];
    fd_path(fd, path, sizeof path);
    if (fault_at("fsync", path, 1) != 0)
        return -1;
    const char *eio = getenv("KVT_FAULT_DIRSYNC_EIO");
    const char *lim = getenv("KVT_FAULT_DIRSYNC_COUNT");
    static long dirsyncs_failed;
    struct stat st;
    if (eio && eio[0] == '1' && under_dir(path) && fstat(fd, &st) == 0 && S_ISDIR(st.st_mode) &&
        (!lim || __atomic_fetch_add(&dirsyncs_failed, 1, __ATOMIC_RELAXED) < strtol(lim, NULL, 10))) {
        const char *src = getenv("KVT_FAULT_PEER_SRC"), *dst = getenv("KVT_FAULT_PEER_DST");
        if (src && dst) {
            REAL(rename, rename_t)
            if (real_rename(src, dst) == 0)
                log_fault("fsync", "PEER_PUBLISHED", dst);
        }
        log_fault("fsync", "EIO", path);
        errno = EIO;
        return -1;
    }
    return real_fsync(fd);
}

int close(int fd)
{
    REAL(close, fdop_t)
    char path[4096];
    fd_path(fd, path, sizeof path);
    int r = real_close(fd);
    if (r == 0 && eintr_once("close", path)) {
        errno = EINTR; /* Linux: the fd is gone, yet close reports EINTR */
        return -1;
    }
    int e;
    if (r == 0 && errno_fault("close", path, &e)) {
        errno = e; /* the fd is gone, yet close reports an error (NFS/FUSE deferred errors) */
        return -1;
    }
    return r;
}

/* ---------------------------------------------------------------- fstat / fdatasync */

typedef int (*fstat_t)(int, struct stat *);

static int do_fstat(const char *name, int fd, struct stat *st)
{
    char path[4096];
    fd_path(fd, path, sizeof path);
    if (fault_at("fstat", path, 0) != 0)
        return -1;
    fstat_t real = (fstat_t)dlsym(RTLD_NEXT, name);
    return real(fd, st);
}

int fstat(int fd, struct stat *st) { return do_fstat("fstat", fd, st); }
int fstat64(int fd, struct stat64 *st) { return do_fstat("fstat64", fd, (struct stat *)st); }

/* lstat (a store's look at its destination): the faults of "lstat", keyed by the path. */
typedef int (*lstat_t)(const char *, struct stat *);

static int do_lstat(const char *name, const char *path, struct stat *st)
{
    if (fault_at("lstat", path, 1) != 0)
        return -1;
    lstat_t real = (lstat_t)dlsym(RTLD_NEXT, name);
    return real(path, st);
}

int lstat(const char *path, struct stat *st) { return do_lstat("lstat", path, st); }
int lstat64(const char *path, struct stat64 *st) { return do_lstat("lstat64", path, (struct stat *)st); }

int fdatasync(int fd)
{
    REAL(fdatasync, fdop_t)
    char path[4096];
    fd_path(fd, path, sizeof path);
    if (fault_at("fdatasync", path, 0) != 0)
        return -1;
    return real_fdatasync(fd);
}
