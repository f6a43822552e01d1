/* System calls of block I/O (sys.h): EINTR retried in one place
 * (kvt_eintr_again), mkdir -p, the directory fsync, full reads and writes. */
#define _GNU_SOURCE
#include "sys.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h> /* rename */
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include "policy.h"

int kvt_eintr_again(unsigned *in_a_row)
{
    if (errno != EINTR || *in_a_row >= KVT_RETRY_EINTR_MAX)
        return 0;
    ++*in_a_row;
    kvt_count(KVT_C_RETRY_EINTR);
    return 1;
}

/* EINTR_LOOP runs `call` again while it fails (`failed`) with EINTR, as
 * kvt_eintr_again says. */
#define EINTR_LOOP(call, failed)                                                                               \
    for (unsigned eintr_n_ = 0;;) {                                                                            \
        call;                                                                                                  \
        if (!(failed) || !kvt_eintr_again(&eintr_n_))                                                         \
            break;                                                                                             \
    }

int kvt_open_r(const char *path, int flags, mode_t mode)
{
    int fd;
    EINTR_LOOP(fd = open(path, flags, mode), fd < 0)
    return fd;
}

int kvt_fsetxattr_r(int fd, const char *name, const void *val, size_t n)
{
    int r;
    EINTR_LOOP(r = fsetxattr(fd, name, val, n, 0), r != 0)
    return r;
}

/* The largest value an xattr can have (linux/limits.h XATTR_SIZE_MAX). */
#define KVT_XATTR_SIZE_MAX 65536

/* fgetxattr, EINTR retried; ERANGE (the value is longer than `n`) asked once
 * more with the largest buffer an xattr can need, as CPython's os.getxattr
 * (the fallback) does: a spurious ERANGE (a FUSE filesystem's) then reads the
 * record, a value really longer than `n` stays ERANGE (a malformed record). */
ssize_t kvt_fgetxattr_r(int fd, const char *name, void *val, size_t n)
{
    ssize_t r;
    EINTR_LOOP(r = fgetxattr(fd, name, val, n), r < 0)
    if (r < 0 && errno == ERANGE) {
        uint8_t *big = malloc(KVT_XATTR_SIZE_MAX);
        if (!big) {
            errno = ERANGE;
            return -1;
        }
        EINTR_LOOP(r = fgetxattr(fd, name, big, KVT_XATTR_SIZE_MAX), r < 0)
        int e = r < 0 ? errno : ERANGE;
        if (r >= 0 && (size_t)r <= n)
            memcpy(val, big, (size_t)r);
        else
            r = -1;
        free(big);
        errno = e;
    }
    return r;
}

ssize_t kvt_lgetxattr_r(const char *path, const char *name, void *val, size_t n)
{
    ssize_t r;
    EINTR_LOOP(r = lgetxattr(path, name, val, n), r < 0)
    return r;
}

int kvt_rename_r(const char *from, const char *to)
{
    int r;
    EINTR_LOOP(r = rename(from, to), r != 0)
    return r;
}

int kvt_fstat_r(int fd, struct stat *st)
{
    int r;
    EINTR_LOOP(r = fstat(fd, st), r != 0)
    return r;
}

int kvt_lstat_r(const char *path, struct stat *st)
{
    int r;
    EINTR_LOOP(r = lstat(path, st), r != 0)
    return r;
}

int kvt_fsync_r(int fd, int data_only)
{
    int r;
    EINTR_LOOP(r = data_only ? fdatasync(fd) : fsync(fd), r != 0)
    return r;
}

/* close(2) is never retried: on Linux the descriptor is released even when
 * close returns EINTR (close(2) NOTES), and a retry could close a descriptor
 * another thread just got. EINTR therefore counts as success. Returns 0 or
 * -1 with errno (EIO, ENOSPC, EDQUOT: deferred write errors of NFS/FUSE). */
int kvt_close_r(int fd)
{
    if (close(fd) == 0 || errno == EINTR)
        return 0;
    return -1;
}

int kvt_openat_r(int at, const char *path, int flags)
{
    int fd;
    EINTR_LOOP(fd = openat(at, path, flags), fd < 0)
    return fd;
}

/* mkdir -p of the directory part of `path`. Returns 0 or -1 with errno. */
int kvt_make_parents(const char *path)
{
    size_t n = strlen(path);
    char *p = malloc(n + 1);
    if (!p) {
        errno = ENOMEM;
        return -1;
    }
    memcpy(p, path, n + 1);
    char *slash = strrchr(p, '/');
    if (!slash || slash == p) {
        free(p);
        return 0;
    }
    *slash = '\0';
    /* Fast path: the parent usually exists except for its last component(s). */
    for (char *s = p + 1; *s; s++) {
        if (*s != '/')
            continue;
        *s = '\0';
        if (mkdir(p, 0755) != 0 && errno != EEXIST) {
            int e = errno;
            free(p);
            errno = e;
            return -1;
        }
        *s = '/';
    }
    if (mkdir(p, 0755) != 0 && errno != EEXIST) {
        int e = errno;
        free(p);
        errno = e;
        return -1;
    }
    free(p);
    return 0;
}

/* fsync the directory holding `path` (makes a rename durable).
 * Returns 0 or an errno value; EINVAL (directory fsync not supported, e.g.
 * some FUSE filesystems) counts as done. */
int kvt_fsync_parent(const char *path)
{
    const char *slash = strrchr(path, '/');
    char *dir;
    if (!slash)
        dir = strdup(".");
    else if (slash == path)
        dir = strdup("/");
    else
        dir = strndup(path, (size_t)(slash - path));
    if (!dir)
        return ENOMEM;
    int fd = kvt_open_r(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
    free(dir);
    if (fd < 0)
        return errno;
    int err = 0;
    if (kvt_fsync_r(fd, 0) != 0 && errno != EINVAL)
        err = errno;
    kvt_close_r(fd);
    return err;
}

int kvt_set_direct(int fd, int on)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0)
        return -1;
    fl = on ? (fl | O_DIRECT) : (fl & ~O_DIRECT);
    return fcntl(fd, F_SETFL, fl);
}

/* After a failed pread/pwrite (errno set): 1 to retry it, 0 to fail. EINTR is
 * retried (counted: retry_eintr, policy.h); EINVAL under O_DIRECT drops
 * O_DIRECT for the rest of the file (a filesystem refusing it at the first
 * I/O, or an unaligned tail) and retries. */
static int retry_io(int fd, int *direct, unsigned *eintr)
{
    if (errno == EINTR)
        return kvt_eintr_again(eintr); /* policy.h: past the last, a miss (or a failed store) with EINTR */
    if (errno == EINVAL && *direct) {
        if (kvt_set_direct(fd, 0) != 0)
            return 0;
        *direct = 0;
        return 1;
    }
    return 0;
}

int kvt_write_full(int fd, const uint8_t *p, size_t len, uint64_t off, int *direct)
{
    unsigned eintr = 0; /* in a row */
    while (len > 0) {
        ssize_t w = pwrite(fd, p, len, (off_t)off);
        if (w < 0) {
            if (retry_io(fd, direct, &eintr))
                continue;
            return -1;
        }
        if (w == 0) {
            errno = EIO;
            return -1;
        }
        eintr = 0;
        p += w;
        off += (uint64_t)w;
        len -= (size_t)w;
    }
    return 0;
}

/* pread at least `min` and at most `max` bytes at `off` (fewer only at the end
 * of the file): one call when the first read brings `min`. Returns the bytes
 * read or -1 with errno. */
ssize_t kvt_read_at_least(int fd, uint8_t *p, size_t min, size_t max, uint64_t off, int *direct)
{
    size_t got = 0;
    unsigned eintr = 0; /* in a row */
    while (got < min) {
        ssize_t r = pread(fd, p + got, max - got, (off_t)(off + got));
        if (r < 0) {
            if (retry_io(fd, direct, &eintr))
                continue;
            return -1;
        }
        if (r == 0)
            break;
        eintr = 0;
        got += (size_t)r;
    }
    return (ssize_t)got;
}

ssize_t kvt_read_full(int fd, uint8_t *p, size_t len, uint64_t off, int *direct)
{
    return kvt_read_at_least(fd, p, len, len, off, direct);
}
