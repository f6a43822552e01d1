/* kvtier block I/O core: store/load/lookup of KV blocks as files, with the
 * block's CRC32C in xattr "user.vllm.kv_crc32c" (4 bytes, big-endian).
 *
 * On-disk contract and the load outcome table: ../shared/design.md
 * ("On-disk contract"), compatible with vLLM's FS offload tier.
 *
 * Plain C11 (gnu11) + POSIX/Linux, no Python: a whole batch runs without the
 * GIL and the C test programs under tests/c/ call it directly.
 *
 * Checksum cost. The CRC is computed chunk by chunk (KVT_IO_CHUNK bytes) right
 * next to the I/O of that chunk: a load reads a chunk into the caller's buffer
 * and checksums it while it is still in the CPU cache; a store checksums a
 * chunk and then writes it, so the kernel's copy into the page cache reads
 * cache-hot data. There is never a second full pass over cold memory.
 * All CRC work goes through crc_begin/crc_chunk/crc_end below: the one place
 * where an offload engine (Intel DSA: submit before the write, collect after;
 * verify on the device) plugs in.
 */
#define _GNU_SOURCE
#include "fs_io.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/xattr.h>
#include <unistd.h>

#include "crc32c.h"

/* ------------------------------------------------------------------ */
/* CRC hook                                                            */
/* ------------------------------------------------------------------ */

/* Running CRC of one block. `crc` is the standard-presentation CRC32C of the
 * bytes seen so far (0 for none), so chunks chain with kvt_crc32c(). */
typedef struct kvt_crc_ctx {
    uint32_t crc;
} kvt_crc_ctx;

static inline void crc_begin(kvt_crc_ctx *c) { c->crc = 0; }

/* Account for the next `len` bytes of the block at `p` (just read or about to
 * be written, so cache-hot). */
static inline void crc_chunk(kvt_crc_ctx *c, const void *p, size_t len)
{
    c->crc = kvt_crc32c(c->crc, p, len);
}

static inline uint32_t crc_end(kvt_crc_ctx *c) { return c->crc; }

/* ------------------------------------------------------------------ */
/* Small helpers                                                       */
/* ------------------------------------------------------------------ */

static size_t chunk_size(void)
{
    return KVT_IO_CHUNK;
}

static void put_be32(uint8_t out[4], uint32_t v)
{
    out[0] = (uint8_t)(v >> 24);
    out[1] = (uint8_t)(v >> 16);
    out[2] = (uint8_t)(v >> 8);
    out[3] = (uint8_t)v;
}

static uint32_t get_be32(const uint8_t in[4])
{
    return ((uint32_t)in[0] << 24) | ((uint32_t)in[1] << 16) | ((uint32_t)in[2] << 8) | (uint32_t)in[3];
}

static void set_fail(kvt_batch_result *res, int err, size_t index, int checksum_failed)
{
    res->err = err ? err : EIO;
    res->index = index;
    res->checksum_failed = checksum_failed;
}

/* Size and O_DIRECT alignment of an open file.
 * Returns 0 and fills *size, *mem_align, *off_align. *mem_align == 0 means the
 * filesystem reported that it does not support O_DIRECT for this file
 * (statx STATX_DIOALIGN with stx_dio_mem_align == 0). Without STATX_DIOALIGN
 * (kernel < 6.1 or a filesystem that does not report it, e.g. tmpfs) the
 * conservative KVT_DIO_FALLBACK_ALIGN is used for both memory and offset. */
static int file_info(int fd, uint64_t *size, size_t *mem_align, size_t *off_align)
{
#if defined(STATX_DIOALIGN)
    struct statx sx;
    if (statx(fd, "", AT_EMPTY_PATH, STATX_SIZE | STATX_DIOALIGN, &sx) == 0) {
        *size = sx.stx_size;
        if (sx.stx_mask & STATX_DIOALIGN) {
            *mem_align = sx.stx_dio_mem_align;
            *off_align = sx.stx_dio_offset_align;
            if (*mem_align == 0 || *off_align == 0)
                *mem_align = *off_align = 0;
        } else {
            *mem_align = *off_align = KVT_DIO_FALLBACK_ALIGN;
        }
        return 0;
    }
    if (errno != ENOSYS && errno != EINVAL)
        return -1;
#endif
    struct stat st;
    if (fstat(fd, &st) != 0)
        return -1;
    *size = (uint64_t)st.st_size;
    *mem_align = *off_align = KVT_DIO_FALLBACK_ALIGN;
    return 0;
}

/* 1 if an O_DIRECT transfer of `len` bytes at `buf` (file offset 0) meets the
 * alignment; every chunk we issue starts at a multiple of chunk_size(), which
 * is a multiple of any realistic alignment (checked here too). */
static int dio_usable(const void *buf, size_t len, size_t mem_align, size_t off_align)
{
    if (mem_align == 0 || off_align == 0)
        return 0;
    size_t a = mem_align > off_align ? mem_align : off_align;
    if (chunk_size() % a != 0)
        return 0;
    return ((uintptr_t)buf % mem_align) == 0 && (len % off_align) == 0 && len > 0;
}

/* Switch O_DIRECT on or off on an open fd. Returns 0 or -1 (errno set; EINVAL
 * when the filesystem refuses O_DIRECT). */
static int set_direct(int fd, int on)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0)
        return -1;
    fl = on ? (fl | O_DIRECT) : (fl & ~O_DIRECT);
    return fcntl(fd, F_SETFL, fl);
}

/* mkdir -p of the directory part of `path`. Returns 0 or -1 with errno. */
static int make_parents(const char *path)
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

/* ------------------------------------------------------------------ */
/* Full-length I/O with EINTR / short transfers / O_DIRECT refusal     */
/* ------------------------------------------------------------------ */

/* pwrite `len` bytes at offset `off`. On EINVAL with O_DIRECT (filesystem
 * refusing O_DIRECT at the first I/O, or a short write leaving an unaligned
 * offset) drop O_DIRECT for the rest of the file and retry buffered.
 * Returns 0 or -1 with errno. */
static int write_full(int fd, const uint8_t *p, size_t len, uint64_t off, int *direct)
{
    while (len > 0) {
        ssize_t w = pwrite(fd, p, len, (off_t)off);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EINVAL && *direct) {
                if (set_direct(fd, 0) != 0)
                    return -1;
                *direct = 0;
                continue;
            }
            return -1;
        }
        if (w == 0) {
            errno = EIO;
            return -1;
        }
        p += w;
        off += (uint64_t)w;
        len -= (size_t)w;
    }
    return 0;
}

/* pread up to `len` bytes at `off`; retries EINTR and short reads. Returns the
 * number of bytes read (< len only at end of file) or -1 with errno. */
static ssize_t read_full(int fd, uint8_t *p, size_t len, uint64_t off, int *direct)
{
    size_t got = 0;
    while (got < len) {
        ssize_t r = pread(fd, p + got, len - got, (off_t)(off + got));
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EINVAL && *direct) {
                if (set_direct(fd, 0) != 0)
                    return -1;
                *direct = 0;
                continue;
            }
            return -1;
        }
        if (r == 0)
            break;
        got += (size_t)r;
    }
    return (ssize_t)got;
}

/* ------------------------------------------------------------------ */
/* Store                                                               */
/* ------------------------------------------------------------------ */

/* Store one block. Returns 0, or an errno value (the temp is removed). */
static int store_one(const char *tmp, const char *dest, const uint8_t *buf, size_t len, int use_o_direct,
                     int checksum)
{
    struct stat st;
    if (stat(dest, &st) == 0)
        return 0; /* already stored (by us or a peer): nothing to do */

    int fd = open(tmp, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
    if (fd < 0 && errno == ENOENT) {
        if (make_parents(tmp) != 0)
            return errno;
        fd = open(tmp, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
    }
    if (fd < 0)
        return errno;

    int err = 0;
    int direct = 0;
    if (use_o_direct) {
        uint64_t size;
        size_t mem_align, off_align;
        /* Opened buffered, then O_DIRECT via fcntl: a filesystem that refuses
         * O_DIRECT says EINVAL here instead of at open(2), where the temp
         * would already have been created (ramfs does that). */
        if (file_info(fd, &size, &mem_align, &off_align) == 0 && dio_usable(buf, len, mem_align, off_align))
            direct = set_direct(fd, 1) == 0;
    }

    kvt_crc_ctx crc;
    crc_begin(&crc);
    size_t chunk = chunk_size();
    for (size_t off = 0; off < len;) {
        size_t n = len - off < chunk ? len - off : chunk;
        if (checksum)
            crc_chunk(&crc, buf + off, n);
        if (write_full(fd, buf + off, n, off, &direct) != 0) {
            err = errno;
            break;
        }
        off += n;
    }

    if (!err && checksum) {
        uint8_t rec[KVT_XATTR_LEN];
        put_be32(rec, crc_end(&crc));
        if (fsetxattr(fd, KVT_XATTR_NAME, rec, sizeof rec, 0) != 0)
            err = errno;
    }
    if (close(fd) != 0 && !err)
        err = errno;
    if (!err && rename(tmp, dest) != 0)
        err = errno;
    if (err)
        unlink(tmp);
    return err;
}

int kvt_batch_store(const char *const *tmp_paths, const char *const *dest_paths, const void *const *bufs,
                    const size_t *lens, size_t n, int use_o_direct, int checksum, kvt_batch_result *res)
{
    res->err = 0;
    res->index = n;
    res->checksum_failed = 0;
    for (size_t i = 0; i < n; i++) {
        int e = store_one(tmp_paths[i], dest_paths[i], (const uint8_t *)bufs[i], lens[i], use_o_direct, checksum);
        if (e) {
            set_fail(res, e, i, 0);
            return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ */
/* Load                                                                */
/* ------------------------------------------------------------------ */

/* Load one block. Returns 0, or an errno value with *checksum_failed set for
 * a CRC mismatch / malformed record. Removes the file for a mismatch,
 * malformed record, or wrong size (the table in design.md). */
static int load_one(const char *src, uint8_t *buf, size_t len, int use_o_direct, int checksum, int *checksum_failed)
{
    *checksum_failed = 0;
    int fd = open(src, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno;

    int err = 0;
    int remove = 0;
    uint64_t size;
    size_t mem_align, off_align;
    if (file_info(fd, &size, &mem_align, &off_align) != 0) {
        err = errno;
        goto out;
    }
    if (size != (uint64_t)len) {
        err = EIO; /* truncated, empty or longer: corrupt */
        remove = 1;
        goto out;
    }

    /* Record first: a legacy block (ENODATA) needs no CRC at all, and a
     * malformed record fails without reading the data. */
    int have_rec = 0;
    uint32_t want = 0;
    if (checksum) {
        uint8_t rec[16];
        ssize_t r = fgetxattr(fd, KVT_XATTR_NAME, rec, sizeof rec);
        if (r < 0) {
            if (errno == ENODATA) {
                have_rec = 0; /* legacy block stored without checksum: accept */
            } else if (errno == ERANGE) {
                *checksum_failed = 1; /* record longer than 16 bytes: malformed */
                err = EBADMSG;
                remove = 1;
                goto out;
            } else {
                err = errno; /* EOPNOTSUPP, EIO, ... : not the block's fault, keep */
                goto out;
            }
        } else if (r != KVT_XATTR_LEN) {
            *checksum_failed = 1;
            err = EBADMSG;
            remove = 1;
            goto out;
        } else {
            have_rec = 1;
            want = get_be32(rec);
        }
    }

    int direct = 0;
    if (use_o_direct && dio_usable(buf, len, mem_align, off_align))
        direct = set_direct(fd, 1) == 0;

    kvt_crc_ctx crc;
    crc_begin(&crc);
    size_t chunk = chunk_size();
    for (size_t off = 0; off < len;) {
        size_t n = len - off < chunk ? len - off : chunk;
        ssize_t r = read_full(fd, buf + off, n, off, &direct);
        if (r < 0) {
            err = errno;
            goto out;
        }
        if ((size_t)r < n) {
            err = EIO; /* shrank after fstat: short read */
            remove = 1;
            goto out;
        }
        if (have_rec)
            crc_chunk(&crc, buf + off, n);
        off += n;
    }
    if (have_rec && crc_end(&crc) != want) {
        *checksum_failed = 1;
        err = EBADMSG;
        remove = 1;
    }

out:
    close(fd);
    if (remove)
        unlink(src);
    return err;
}

int kvt_batch_load(const char *const *src_paths, void *const *bufs, const size_t *lens, size_t n, int use_o_direct,
                   int checksum, kvt_batch_result *res)
{
    res->err = 0;
    res->index = n;
    res->checksum_failed = 0;
    for (size_t i = 0; i < n; i++) {
        int cf = 0;
        int e = load_one(src_paths[i], (uint8_t *)bufs[i], lens[i], use_o_direct, checksum, &cf);
        if (e) {
            set_fail(res, e, i, cf);
            return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ */
/* Lookup                                                              */
/* ------------------------------------------------------------------ */

void kvt_batch_lookup(const char *const *paths, size_t n, uint8_t *out)
{
    struct stat st;
    for (size_t i = 0; i < n; i++)
        out[i] = stat(paths[i], &st) == 0;
}
