/* The xattr record parsers of the load path (fs_io.h kvt_xattr_parse,
 * kvt_id_parse): pure functions, fuzzed on their own by
 * tests/fuzz/fuzz_xattr_record.c. */
#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "fs_io.h"

static uint32_t get_be32(const uint8_t in[4])
{
    return ((uint32_t)in[0] << 24) | ((uint32_t)in[1] << 16) | ((uint32_t)in[2] << 8) | (uint32_t)in[3];
}

/* See fs_io.h. */
int kvt_xattr_parse(const void *rec, long r, int err, uint32_t *crc)
{
    if (r < 0) {
        if (err == ENODATA)
            return KVT_REC_ABSENT;
        if (err == ERANGE)
            return KVT_REC_MALFORMED;
        return KVT_REC_ERROR;
    }
    if (r != KVT_XATTR_LEN)
        return KVT_REC_MALFORMED;
    *crc = get_be32((const uint8_t *)rec);
    return KVT_REC_OK;
}

/* See fs_io.h. */
int kvt_id_parse(const void *rec, long r, int err, const uint8_t id[KVT_ID_LEN], uint32_t *crc)
{
    if (r < 0) {
        if (err == ENODATA)
            return KVT_ID_ABSENT;
        if (err == ERANGE)
            return KVT_ID_MISMATCH;
        return KVT_ID_ERROR;
    }
    if ((r != KVT_ID_LEN && r != KVT_ID_REC_LEN) || memcmp(rec, id, KVT_ID_LEN) != 0)
        return KVT_ID_MISMATCH;
    if (r == KVT_ID_LEN)
        return KVT_ID_ONLY;
    *crc = get_be32((const uint8_t *)rec + KVT_ID_LEN);
    return KVT_ID_CRC;
}
