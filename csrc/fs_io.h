/* kvtier block I/O core: store/load/lookup of KV blocks as files, with the
 * block's CRC32C in xattr "user.vllm.kv_crc32c" (4 bytes, big-endian).
 * On-disk contract and error table: ../shared/design.md ("On-disk contract").
 * Plain C11 + POSIX, no Python: the whole batch runs without the GIL.
 */
#ifndef KVTIER_FS_IO_H
#define KVTIER_FS_IO_H

#include <stddef.h>
#include <stdint.h>

#define KVT_XATTR_NAME "user.vllm.kv_crc32c"
#define KVT_XATTR_LEN 4

/* Outcome of a batch. On failure: err = errno value (EBADMSG, EIO, ENOENT...),
 * index = index of the failing block (== number of blocks that succeeded),
 * checksum_failed = 1 only for a CRC mismatch or malformed xattr record
 * (never for EBADMSG returned by the filesystem itself). */
typedef struct kvt_batch_result {
    int err;              /* 0 on success */
    size_t index;         /* failing block; n on success */
    int checksum_failed;
} kvt_batch_result;

/* Returns 0 on success, -1 on failure with *res filled. */
int kvt_batch_store(const char *const *tmp_paths, const char *const *dest_paths,
                    const void *const *bufs, const size_t *lens, size_t n,
                    int use_o_direct, int checksum, kvt_batch_result *res);
int kvt_batch_load(const char *const *src_paths, void *const *bufs,
                   const size_t *lens, size_t n, int use_o_direct, int checksum,
                   kvt_batch_result *res);
/* out[i] = 1 if paths[i] exists (stat succeeds), else 0. */
void kvt_batch_lookup(const char *const *paths, size_t n, uint8_t *out);

#endif
