/* fusefault: a FUSE passthrough filesystem that injects faults, for kvtier's
 * reliability tests only (tests/test_faults.py). Not part of the package.
 *
 *   fusefault BACKING_DIR MOUNTPOINT [-f] [-s] [-o opts]
 *
 * Every path under MOUNTPOINT is BACKING_DIR's path. Every open file is
 * direct_io (no page cache, no readahead), so each read(2) by a test reaches
 * read() below and sees the faults. Attributes and entries are not cached.
 *
 * Faults are rules, set by writing lines to the virtual file
 * MOUNTPOINT/.fusefault (one rule per line, all fields required):
 *
 *     KIND GLOB ARG COUNT
 *
 *   KIND   eio       read() fails with EIO
 *          ebadmsg   read() fails with EBADMSG
 *          eagain    read() and write() fail with EAGAIN (a filesystem that says
 *                    "try again": io_uring must not turn it into a busy loop)
 *          flip      bit 0 of the byte at file offset ARG is flipped in the
 *                    data a read() returns (only reads covering that byte)
 *          short     the file reads as if cut at half its size: reads at or
 *                    past size/2 return 0 bytes (EOF), a read crossing it is
 *                    cut; stat still shows the full size
 *          getxattr  getxattr() of a "user.*" name fails with errno ARG
 *          setxattr  setxattr() of a "user.*" name fails with errno ARG
 *          stall_read, stall_write, stall_getxattr (a "user.*" name),
 *          stall_open (open and create), stall_rename (GLOB matches the old
 *          or the new name), stall_getattr (stat, and the lookup of a name):
 *                    the operation waits before it runs: ARG milliseconds,
 *                    or (ARG 0) until the line "clear"; then it runs
 *                    normally. A test sees it stalled once HITS counts it.
 *   GLOB   fnmatch(3) pattern (no flags: '*' matches '/') against the path
 *          as seen from the mount root, starting with '/'.
 *   ARG    byte offset (flip), errno number (getxattr/setxattr), else 0.
 *   COUNT  how many times the rule fires, then it is spent; -1: always.
 *
 * The line "clear" removes every rule and releases every stalled operation.
 * Reading .fusefault returns one line per
 * rule: "KIND GLOB ARG COUNT_LEFT HITS", so tests check a fault really fired.
 */
#define FUSE_USE_VERSION 31
#define _GNU_SOURCE

#include <fuse.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/time.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

#define CTL_PATH "/.fusefault"
#define MAX_RULES 64

enum kind {
    K_EIO, K_EBADMSG, K_FLIP, K_SHORT, K_GETXATTR, K_SETXATTR, K_EAGAIN,
    K_STALL_READ, K_STALL_WRITE, K_STALL_GETXATTR, K_STALL_OPEN, K_STALL_RENAME, K_STALL_GETATTR,
    K_NKINDS
};
static const char *const kind_names[K_NKINDS] = {
    "eio", "ebadmsg", "flip", "short", "getxattr", "setxattr", "eagain",
    "stall_read", "stall_write", "stall_getxattr", "stall_open", "stall_rename", "stall_getattr",
};

struct rule {
    enum kind kind;
    char glob[PATH_MAX];
    long long arg;
    long long left; /* -1: unlimited */
    long long hits;
};

static struct rule rules[MAX_RULES];
static int nrules;
static pthread_mutex_t rules_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t release_cond = PTHREAD_COND_INITIALIZER; /* with rules_lock */
static unsigned long long release_gen; /* bumped by "clear" */
static char backing[PATH_MAX];

static int full(char *out, const char *path)
{
    int n = snprintf(out, PATH_MAX, "%s%s", backing, path);
    return (n < 0 || n >= PATH_MAX) ? -ENAMETOOLONG : 0;
}

/* Take one firing of the first live rule of `kind` matching `path`; fills
 * *arg. Returns 1 if a rule fired. `want_arg_cover` (flip) requires the rule's
 * offset to be inside [off, off+len). */
static int take(enum kind kind, const char *path, long long *arg, int cover, off_t off, size_t len)
{
    int fired = 0;
    if (path == NULL)
        return 0;
    pthread_mutex_lock(&rules_lock);
    for (int i = 0; i < nrules; i++) {
        struct rule *r = &rules[i];
        if (r->kind != kind || r->left == 0 || fnmatch(r->glob, path, 0) != 0)
            continue;
        if (cover && (r->arg < (long long)off || r->arg >= (long long)off + (long long)len))
            continue;
        if (r->left > 0)
            r->left--;
        r->hits++;
        *arg = r->arg;
        fired = 1;
        break;
    }
    pthread_mutex_unlock(&rules_lock);
    return fired;
}

static int peek(enum kind kind, const char *path)
{
    int found = 0;
    if (path == NULL)
        return 0;
    pthread_mutex_lock(&rules_lock);
    for (int i = 0; i < nrules && !found; i++)
        found = rules[i].kind == kind && rules[i].left != 0 && fnmatch(rules[i].glob, path, 0) == 0;
    pthread_mutex_unlock(&rules_lock);
    return found;
}

/* If a live stall rule of `kind` matches `path`, wait (ARG ms, or until
 * "clear" when ARG is 0) before the operation runs. */
static void stall(enum kind kind, const char *path)
{
    long long ms;
    if (!take(kind, path, &ms, 0, 0, 0))
        return;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += (time_t)(ms / 1000);
    until.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&rules_lock);
    unsigned long long gen = release_gen;
    while (gen == release_gen) {
        if (ms > 0) {
            if (pthread_cond_timedwait(&release_cond, &rules_lock, &until) == ETIMEDOUT)
                break;
        } else {
            pthread_cond_wait(&release_cond, &rules_lock);
        }
    }
    pthread_mutex_unlock(&rules_lock);
}

static void release_all(void)
{
    pthread_mutex_lock(&rules_lock);
    release_gen++;
    pthread_cond_broadcast(&release_cond);
    pthread_mutex_unlock(&rules_lock);
}

/* Status text of the control file; caller frees. */
static char *ctl_text(size_t *len)
{
    size_t cap = 256 + (size_t)MAX_RULES * (PATH_MAX + 96);
    char *s = malloc(cap);
    size_t n = 0;
    if (!s)
        return NULL;
    s[0] = '\0';
    pthread_mutex_lock(&rules_lock);
    for (int i = 0; i < nrules; i++)
        n += (size_t)snprintf(s + n, cap - n, "%s %s %lld %lld %lld\n", kind_names[rules[i].kind],
                              rules[i].glob, rules[i].arg, rules[i].left, rules[i].hits);
    pthread_mutex_unlock(&rules_lock);
    *len = n;
    return s;
}

static int ctl_line(char *line)
{
    char kind[32], glob[PATH_MAX];
    long long arg, count;
    while (*line == ' ' || *line == '\t')
        line++;
    if (*line == '\0')
        return 0;
    if (strcmp(line, "clear") == 0) {
        pthread_mutex_lock(&rules_lock);
        nrules = 0;
        pthread_mutex_unlock(&rules_lock);
        release_all();
        return 0;
    }
    if (sscanf(line, "%31s %4095s %lld %lld", kind, glob, &arg, &count) != 4)
        return -EINVAL;
    int k;
    for (k = 0; k < K_NKINDS; k++)
        if (strcmp(kind, kind_names[k]) == 0)
            break;
    if (k == K_NKINDS || count < -1)
        return -EINVAL;
    pthread_mutex_lock(&rules_lock);
    int rc = 0;
    if (nrules == MAX_RULES) {
        rc = -ENOSPC;
    } else {
        struct rule *r = &rules[nrules++];
        r->kind = (enum kind)k;
        strcpy(r->glob, glob);
        r->arg = arg;
        r->left = count;
        r->hits = 0;
    }
    pthread_mutex_unlock(&rules_lock);
    return rc;
}

/* ------------------------------------------------------------------ */

static void *ff_init(struct fuse_conn_info *conn, struct fuse_config *cfg)
{
    (void)conn;
    cfg->use_ino = 1;
    cfg->nullpath_ok = 0;
    cfg->hard_remove = 1;
    cfg->direct_io = 1;
    cfg->kernel_cache = 0;
    cfg->entry_timeout = 0;
    cfg->attr_timeout = 0;
    cfg->negative_timeout = 0;
    return NULL;
}

static int ff_getattr(const char *path, struct stat *st, struct fuse_file_info *fi)
{
    char p[PATH_MAX];
    int rc;
    if (path && strcmp(path, CTL_PATH) == 0) {
        size_t len = 0;
        free(ctl_text(&len));
        memset(st, 0, sizeof *st);
        st->st_mode = S_IFREG | 0666;
        st->st_nlink = 1;
        st->st_size = (off_t)len;
        return 0;
    }
    stall(K_STALL_GETATTR, path);
    if (fi)
        rc = fstat((int)fi->fh, st);
    else if ((rc = full(p, path)) == 0)
        rc = lstat(p, st);
    else
        return rc;
    return rc == -1 ? -errno : 0;
}

static int ff_access(const char *path, int mask)
{
    char p[PATH_MAX];
    if (strcmp(path, CTL_PATH) == 0)
        return 0;
    int rc = full(p, path);
    if (rc)
        return rc;
    return access(p, mask) == -1 ? -errno : 0;
}

static int ff_readlink(const char *path, char *buf, size_t size)
{
    char p[PATH_MAX];
    int rc = full(p, path);
    if (rc)
        return rc;
    ssize_t n = readlink(p, buf, size - 1);
    if (n == -1)
        return -errno;
    buf[n] = '\0';
    return 0;
}

static int ff_readdir(const char *path, void *buf, fuse_fill_dir_t filler, off_t off,
                      struct fuse_file_info *fi, enum fuse_readdir_flags flags)
{
    (void)off;
    (void)fi;
    (void)flags;
    char p[PATH_MAX];
    int rc = full(p, path);
    if (rc)
        return rc;
    DIR *d = opendir(p);
    if (!d)
        return -errno;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        struct stat st;
        memset(&st, 0, sizeof st);
        st.st_ino = de->d_ino;
        st.st_mode = (mode_t)de->d_type << 12;
        if (filler(buf, de->d_name, &st, 0, 0))
            break;
    }
    closedir(d);
    return 0;
}

#define PATHOP(name, call)                   \
    static int name                          \
    {                                        \
        char p[PATH_MAX];                    \
        int rc = full(p, path);              \
        if (rc)                              \
            return rc;                       \
        return (call) == -1 ? -errno : 0;    \
    }

PATHOP(ff_mkdir(const char *path, mode_t mode), mkdir(p, mode))
PATHOP(ff_unlink(const char *path), unlink(p))
PATHOP(ff_rmdir(const char *path), rmdir(p))
PATHOP(ff_chmod(const char *path, mode_t mode, struct fuse_file_info *fi),
       fi ? fchmod((int)fi->fh, mode) : chmod(p, mode))
PATHOP(ff_chown(const char *path, uid_t uid, gid_t gid, struct fuse_file_info *fi),
       fi ? fchown((int)fi->fh, uid, gid) : lchown(p, uid, gid))
PATHOP(ff_utimens(const char *path, const struct timespec ts[2], struct fuse_file_info *fi),
       fi ? futimens((int)fi->fh, ts) : utimensat(AT_FDCWD, p, ts, AT_SYMLINK_NOFOLLOW))
PATHOP(ff_removexattr(const char *path, const char *name), lremovexattr(p, name))

static int ff_truncate(const char *path, off_t size, struct fuse_file_info *fi)
{
    if (path && strcmp(path, CTL_PATH) == 0)
        return 0;
    if (fi)
        return ftruncate((int)fi->fh, size) == -1 ? -errno : 0;
    char p[PATH_MAX];
    int rc = full(p, path);
    if (rc)
        return rc;
    return truncate(p, size) == -1 ? -errno : 0;
}

static int ff_symlink(const char *target, const char *path)
{
    char p[PATH_MAX];
    int rc = full(p, path);
    if (rc)
        return rc;
    return symlink(target, p) == -1 ? -errno : 0;
}

static int ff_rename(const char *from, const char *to, unsigned int flags)
{
    char a[PATH_MAX], b[PATH_MAX];
    int rc = full(a, from);
    if (rc || (rc = full(b, to)))
        return rc;
    if (peek(K_STALL_RENAME, from))
        stall(K_STALL_RENAME, from);
    else
        stall(K_STALL_RENAME, to);
    return renameat2(AT_FDCWD, a, AT_FDCWD, b, flags) == -1 ? -errno : 0;
}

static int ff_link(const char *from, const char *to)
{
    char a[PATH_MAX], b[PATH_MAX];
    int rc = full(a, from);
    if (rc || (rc = full(b, to)))
        return rc;
    return link(a, b) == -1 ? -errno : 0;
}

static int ff_open_common(const char *path, struct fuse_file_info *fi, mode_t mode, int create)
{
    if (strcmp(path, CTL_PATH) == 0) {
        fi->fh = (uint64_t)-1;
        fi->direct_io = 1;
        return 0;
    }
    char p[PATH_MAX];
    int rc = full(p, path);
    if (rc)
        return rc;
    stall(K_STALL_OPEN, path);
    /* The backing file needs no alignment: drop O_DIRECT there. */
    int flags = fi->flags & ~O_DIRECT;
    int fd = create ? open(p, flags, mode) : open(p, flags);
    if (fd == -1)
        return -errno;
    fi->fh = (uint64_t)fd;
    fi->direct_io = 1;
    fi->keep_cache = 0;
    return 0;
}

static int ff_create(const char *path, mode_t mode, struct fuse_file_info *fi)
{
    return ff_open_common(path, fi, mode, 1);
}

static int ff_open(const char *path, struct fuse_file_info *fi)
{
    return ff_open_common(path, fi, 0, 0);
}

static int ff_read(const char *path, char *buf, size_t size, off_t off, struct fuse_file_info *fi)
{
    long long arg;
    if (fi->fh == (uint64_t)-1) {
        size_t len = 0;
        char *s = ctl_text(&len);
        if (!s)
            return -ENOMEM;
        size_t n = 0;
        if ((size_t)off < len) {
            n = len - (size_t)off < size ? len - (size_t)off : size;
            memcpy(buf, s + off, n);
        }
        free(s);
        return (int)n;
    }
    int fd = (int)fi->fh;
    stall(K_STALL_READ, path);
    if (take(K_EIO, path, &arg, 0, 0, 0))
        return -EIO;
    if (take(K_EBADMSG, path, &arg, 0, 0, 0))
        return -EBADMSG;
    if (take(K_EAGAIN, path, &arg, 0, 0, 0))
        return -EAGAIN;
    if (peek(K_SHORT, path)) {
        struct stat st;
        if (fstat(fd, &st) == -1)
            return -errno;
        off_t cut = st.st_size / 2;
        if (off + (off_t)size > cut && take(K_SHORT, path, &arg, 0, 0, 0))
            size = off >= cut ? 0 : (size_t)(cut - off);
    }
    ssize_t n = pread(fd, buf, size, off);
    if (n == -1)
        return -errno;
    if (n > 0 && take(K_FLIP, path, &arg, 1, off, (size_t)n))
        buf[arg - off] ^= 1;
    return (int)n;
}

static int ff_write(const char *path, const char *buf, size_t size, off_t off, struct fuse_file_info *fi)
{
    if (fi->fh == (uint64_t)-1) {
        char *copy = strndup(buf, size);
        if (!copy)
            return -ENOMEM;
        int rc = 0;
        char *save = NULL;
        for (char *line = strtok_r(copy, "\n", &save); line && rc == 0; line = strtok_r(NULL, "\n", &save))
            rc = ctl_line(line);
        free(copy);
        return rc ? rc : (int)size;
    }
    stall(K_STALL_WRITE, path);
    long long arg;
    if (take(K_EAGAIN, path, &arg, 0, 0, 0))
        return -EAGAIN;
    ssize_t n = pwrite((int)fi->fh, buf, size, off);
    return n == -1 ? -errno : (int)n;
}

static int ff_statfs(const char *path, struct statvfs *st)
{
    return statvfs(backing, st) == -1 ? -errno : 0;
}

static int ff_flush(const char *path, struct fuse_file_info *fi)
{
    if (fi->fh == (uint64_t)-1)
        return 0;
    /* close(dup()) reports delayed write errors of the backing FS. */
    int fd = dup((int)fi->fh);
    if (fd == -1)
        return -errno;
    return close(fd) == -1 ? -errno : 0;
}

static int ff_release(const char *path, struct fuse_file_info *fi)
{
    if (fi->fh != (uint64_t)-1)
        close((int)fi->fh);
    return 0;
}

static int ff_fsync(const char *path, int datasync, struct fuse_file_info *fi)
{
    if (fi->fh == (uint64_t)-1)
        return 0;
    int rc = datasync ? fdatasync((int)fi->fh) : fsync((int)fi->fh);
    return rc == -1 ? -errno : 0;
}

static int ff_fallocate(const char *path, int mode, off_t off, off_t len, struct fuse_file_info *fi)
{
    if (fi->fh == (uint64_t)-1)
        return -EOPNOTSUPP;
    return fallocate((int)fi->fh, mode, off, len) == -1 ? -errno : 0;
}

static int is_user(const char *name) { return strncmp(name, "user.", 5) == 0; }

static int ff_setxattr(const char *path, const char *name, const char *value, size_t size, int flags)
{
    long long arg;
    if (is_user(name) && take(K_SETXATTR, path, &arg, 0, 0, 0))
        return -(int)arg;
    char p[PATH_MAX];
    int rc = full(p, path);
    if (rc)
        return rc;
    return lsetxattr(p, name, value, size, flags) == -1 ? -errno : 0;
}

static int ff_getxattr(const char *path, const char *name, char *value, size_t size)
{
    long long arg;
    if (is_user(name))
        stall(K_STALL_GETXATTR, path);
    if (is_user(name) && take(K_GETXATTR, path, &arg, 0, 0, 0))
        return -(int)arg;
    char p[PATH_MAX];
    int rc = full(p, path);
    if (rc)
        return rc;
    ssize_t n = lgetxattr(p, name, value, size);
    return n == -1 ? -errno : (int)n;
}

static int ff_listxattr(const char *path, char *list, size_t size)
{
    char p[PATH_MAX];
    int rc = full(p, path);
    if (rc)
        return rc;
    ssize_t n = llistxattr(p, list, size);
    return n == -1 ? -errno : (int)n;
}

static const struct fuse_operations ff_ops = {
    .init = ff_init,
    .getattr = ff_getattr,
    .access = ff_access,
    .readlink = ff_readlink,
    .readdir = ff_readdir,
    .mkdir = ff_mkdir,
    .symlink = ff_symlink,
    .unlink = ff_unlink,
    .rmdir = ff_rmdir,
    .rename = ff_rename,
    .link = ff_link,
    .chmod = ff_chmod,
    .chown = ff_chown,
    .truncate = ff_truncate,
    .utimens = ff_utimens,
    .create = ff_create,
    .open = ff_open,
    .read = ff_read,
    .write = ff_write,
    .statfs = ff_statfs,
    .flush = ff_flush,
    .release = ff_release,
    .fsync = ff_fsync,
    .fallocate = ff_fallocate,
    .setxattr = ff_setxattr,
    .getxattr = ff_getxattr,
    .listxattr = ff_listxattr,
    .removexattr = ff_removexattr,
};

int main(int argc, char *argv[])
{
    if (argc < 3) {
        fprintf(stderr, "usage: %s BACKING_DIR MOUNTPOINT [-f] [-s] [-o opts]\n", argv[0]);
        return 2;
    }
    if (realpath(argv[1], backing) == NULL) {
        perror(argv[1]);
        return 2;
    }
    if (strcmp(backing, "/") == 0)
        backing[0] = '\0';
    umask(0);
    argv[1] = argv[0];
    return fuse_main(argc - 1, argv + 1, &ff_ops, NULL);
}
