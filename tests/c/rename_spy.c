/* LD_PRELOAD shim for tests/test_block_io.py: observes the store protocol at
 * rename time. Every rename/renameat/renameat2 of a path ending in ".tmp"
 * appends one line to $KVT_RENAME_SPY_LOG before doing the real rename:
 *     <old>\t<new>\t<xattr hex | -errno>\t<1 if new exists else 0>
 * where the xattr is user.vllm.kv_crc32c read from <old> at that instant.
 * Build: cc -shared -fPIC -o rename_spy.so rename_spy.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

static void spy(int olddirfd, const char *oldpath, int newdirfd, const char *newpath)
{
    const char *log = getenv("KVT_RENAME_SPY_LOG");
    size_t n = strlen(oldpath);
    if (!log || n < 4 || strcmp(oldpath + n - 4, ".tmp") != 0)
        return;
    int saved = errno;
    char val[64];
    char field[160];
    int fd = openat(olddirfd, oldpath, O_RDONLY | O_CLOEXEC);
    ssize_t r = fd >= 0 ? fgetxattr(fd, "user.vllm.kv_crc32c", val, sizeof val) : -1;
    if (r < 0) {
        snprintf(field, sizeof field, "-%d", errno);
    } else {
        for (ssize_t i = 0; i < r; i++)
            snprintf(field + 2 * i, sizeof field - 2 * (size_t)i, "%02x", (unsigned char)val[i]);
        field[2 * r] = '\0';
    }
    if (fd >= 0)
        close(fd);
    struct stat st;
    int exists = fstatat(newdirfd, newpath, &st, 0) == 0;
    FILE *f = fopen(log, "a");
    if (f) {
        fprintf(f, "%s\t%s\t%s\t%d\n", oldpath, newpath, field, exists);
        fclose(f);
    }
    errno = saved;
}

int rename(const char *oldpath, const char *newpath)
{
    static int (*real)(const char *, const char *);
    if (!real)
        real = (int (*)(const char *, const char *))dlsym(RTLD_NEXT, "rename");
    spy(AT_FDCWD, oldpath, AT_FDCWD, newpath);
    return real(oldpath, newpath);
}

int renameat(int olddirfd, const char *oldpath, int newdirfd, const char *newpath)
{
    static int (*real)(int, const char *, int, const char *);
    if (!real)
        real = (int (*)(int, const char *, int, const char *))dlsym(RTLD_NEXT, "renameat");
    spy(olddirfd, oldpath, newdirfd, newpath);
    return real(olddirfd, oldpath, newdirfd, newpath);
}

int renameat2(int olddirfd, const char *oldpath, int newdirfd, const char *newpath, unsigned int flags)
{
    static int (*real)(int, const char *, int, const char *, unsigned int);
    if (!real)
        real = (int (*)(int, const char *, int, const char *, unsigned int))dlsym(RTLD_NEXT, "renameat2");
    spy(olddirfd, oldpath, newdirfd, newpath);
    return real(olddirfd, oldpath, newdirfd, newpath, flags);
}
