/* System calls of block I/O, safe against signals: a signal handler
 * installed without SA_RESTART (Python installs its own that way) makes a
 * slow call on NFS/FUSE fail with EINTR before it did anything. Every
 * wrapper here retries EINTR through kvt_eintr_again (at once, in place, up
 * to KVT_RETRY_EINTR_MAX times in a row, each counted retry_eintr: policy.h),
 * the one EINTR mechanism of csrc/block. Each returns what its call returns
 * (-1 with errno on failure). Plain C11 + POSIX/Linux, no Python. */
#ifndef KVTIER_SYS_H
#define KVTIER_SYS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>

/* After a call failed (errno set): 1 to run it again at once (EINTR, fewer
 * than KVT_RETRY_EINTR_MAX retries so far; *in_a_row counts them, counted
 * retry_eintr), else 0. */
int kvt_eintr_again(unsigned *in_a_row);

int kvt_open_r(const char *path, int flags, mode_t mode);
int kvt_openat_r(int at, const char *path, int flags);
int kvt_fsetxattr_r(int fd, const char *name, const void *val, size_t n);
/* fgetxattr; ERANGE (the value is longer than `n`) is asked once more with
 * the largest buffer an xattr can need, as CPython's os.getxattr does: a
 * spurious ERANGE (a FUSE filesystem's) then reads the record, a value really
 * longer than `n` stays ERANGE. */
ssize_t kvt_fgetxattr_r(int fd, const char *name, void *val, size_t n);
ssize_t kvt_lgetxattr_r(const char *path, const char *name, void *val, size_t n);
int kvt_rename_r(const char *from, const char *to);
int kvt_fstat_r(int fd, struct stat *st);
int kvt_lstat_r(const char *path, struct stat *st);
int kvt_fsync_r(int fd, int data_only);
/* close(2), never retried (the descriptor is released even on EINTR, which
 * counts as success). 0 or -1 with errno (deferred write errors of NFS/FUSE). */
int kvt_close_r(int fd);

/* mkdir -p of the directory part of `path`. 0 or -1 with errno. */
int kvt_make_parents(const char *path);
/* fsync the directory holding `path` (makes a rename durable). 0 or an errno
 * value; EINVAL (directory fsync not supported) counts as done. */
int kvt_fsync_parent(const char *path);

/* pread/pwrite that finish short transfers, retry EINTR and, under O_DIRECT
 * (*direct), drop O_DIRECT for the rest of the file on EINVAL (a filesystem
 * refusing it at the first I/O, an unaligned tail). kvt_read_at_least reads
 * at least `min` and at most `max` bytes at `off` (fewer only at the end of
 * the file; one call when the first read brings `min`): the bytes read, or
 * -1 with errno. */
ssize_t kvt_read_at_least(int fd, uint8_t *p, size_t min, size_t max, uint64_t off, int *direct);
ssize_t kvt_read_full(int fd, uint8_t *p, size_t len, uint64_t off, int *direct);
int kvt_write_full(int fd, const uint8_t *p, size_t len, uint64_t off, int *direct);
/* Switch O_DIRECT on/off on an open fd: 0 or -1 with errno. */
int kvt_set_direct(int fd, int on);

#endif
