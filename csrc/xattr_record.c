/* The xattr record parser of the load path (fs_io.h kvt_xattr_parse): a pure
 * function, fuzzed on its own by tests/fuzz/fuzz_xattr_record.c. */
#include <errno.h>
#include <stdint.h>

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
