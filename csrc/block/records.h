/* kvtier's on-disk records of a block file: their names and lengths, the
 * identity hash, the pure parsers of the load path (fuzzed on their own by
 * tests/fuzz/fuzz_xattr_record.c) and the big-endian helpers. A leaf: plain
 * C11, no other kvtier header. */
#ifndef KVTIER_RECORDS_H
#define KVTIER_RECORDS_H

#include <stddef.h>
#include <stdint.h>

/* vLLM's record: the block's CRC32C, 4 bytes big-endian. */
#define KVT_XATTR_NAME "user.vllm.kv_crc32c"
#define KVT_XATTR_LEN 4

/* Second xattr, the identity record: binds a block to its name (key, rank,
 * layout digest) and size, and carries its CRC32C, so that a load of a block
 * kvtier stored reads one xattr: 12 bytes, the identity (8 bytes big-endian,
 * kvt_block_identity()) then the CRC32C (4 bytes big-endian, the value of
 * user.vllm.kv_crc32c, which a store still sets for vLLM's reader). Only a
 * well-formed record (12 bytes) of another identity is an identity failure (a
 * block copied or renamed under this name); a damaged one (another length,
 * ERANGE, a few bits of its identity flipped) is no proof against the bytes:
 * the load judges the block by user.vllm.kv_crc32c (kvt_id_parse
 * KVT_ID_DAMAGED, issue #24). vLLM ignores this xattr. */
#define KVT_ID_XATTR_NAME "user.kvtier.id"
#define KVT_ID_LEN 8
#define KVT_ID_REC_LEN 12

/* The identity record of a block at `path` of `len` bytes: FNV-1a 64 of
 * "kvtier.id.v1", NUL, the last four components of the path
 * ("<model>_<digest>_r<rank>/<h[:3]>/<h[3:5]>_g<group>/<h>.bin": layout,
 * rank, key) after lexical normalisation ("//" and "." dropped, ".." pops, a
 * relative path against getcwd() when it has fewer than four components;
 * fewer than four in all: '/' and all of them), joined by '/', NUL, len in
 * decimal; as 8 bytes big-endian in out. A clean absolute path hashes its
 * bytes after its fourth-last '/' (the whole path if shorter): no syscall,
 * no allocation. Symlinks are not resolved. */
void kvt_block_identity(const char *path, uint64_t len, uint8_t out[KVT_ID_LEN]);

/* The xattr record parser of the load path, a pure function
 * (fuzzed by tests/fuzz/fuzz_xattr_record.c). `r` is what
 * fgetxattr(fd, KVT_XATTR_NAME, rec, KVT_XATTR_BUF) returned and `err` the
 * errno when r < 0. Returns KVT_REC_OK with *crc = the big-endian 4-byte
 * value; KVT_REC_ABSENT (ENODATA: a legacy block stored without checksum);
 * KVT_REC_MALFORMED (length != 4, or ERANGE: longer than the buffer): a
 * checksum failure; KVT_REC_ERROR (any other errno: the filesystem's fault,
 * the block is kept). Reads at most min(r, KVT_XATTR_BUF) bytes of rec. */
#define KVT_XATTR_BUF 16
enum { KVT_REC_OK = 0, KVT_REC_ABSENT = 1, KVT_REC_MALFORMED = 2, KVT_REC_ERROR = 3 };
int kvt_xattr_parse(const void *rec, long r, int err, uint32_t *crc);

/* The identity record parser (policy.h KVT_ID_XATTR_NAME), a pure function
 * fuzzed with kvt_xattr_parse. `r` is what fgetxattr(fd, KVT_ID_XATTR_NAME,
 * rec, KVT_XATTR_BUF) returned and `err` the errno when r < 0; `id` the
 * identity of the block being loaded. Returns KVT_ID_CRC (12 bytes, the
 * identity `id`: *crc = the CRC32C it carries), KVT_ID_ABSENT (ENODATA:
 * stored by vLLM), KVT_ID_MISMATCH (12 bytes of another identity: more than
 * KVT_ID_DAMAGED_BITS of its 64 bits differ from `id`, a block copied or
 * renamed under this name), KVT_ID_DAMAGED (the record itself is damaged: a
 * length other than 12, ERANGE (longer than the buffer, after the retry
 * with the largest one), or 12 bytes whose identity differs from `id` in 1
 * to KVT_ID_DAMAGED_BITS bits; a misplaced block carries a well-formed
 * record of another identity, an FNV-1a hash that differs in about 32 bits:
 * the load judges a damaged one's block by user.vllm.kv_crc32c, issue #24),
 * KVT_ID_ERROR (any other errno: the filesystem's, the block is kept). *crc
 * is written only for KVT_ID_CRC. Reads at most min(r, KVT_XATTR_BUF) bytes
 * of rec. */
#define KVT_ID_DAMAGED_BITS 4
enum { KVT_ID_CRC = 0, KVT_ID_ABSENT = 2, KVT_ID_MISMATCH = 3, KVT_ID_ERROR = 4, KVT_ID_DAMAGED = 5 };
int kvt_id_parse(const void *rec, long r, int err, const uint8_t id[KVT_ID_LEN], uint32_t *crc);

static inline uint32_t kvt_get_be32(const uint8_t in[4])
{
    return ((uint32_t)in[0] << 24) | ((uint32_t)in[1] << 16) | ((uint32_t)in[2] << 8) | (uint32_t)in[3];
}

static inline void kvt_put_be32(uint8_t out[4], uint32_t v)
{
    out[0] = (uint8_t)(v >> 24);
    out[1] = (uint8_t)(v >> 16);
    out[2] = (uint8_t)(v >> 8);
    out[3] = (uint8_t)v;
}

#endif
