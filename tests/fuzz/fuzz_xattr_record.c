/* libFuzzer harness: the xattr record parser of the load path,
 * kvt_xattr_parse() in csrc/fs_io.c (contract in csrc/fs_io.h).
 *
 * Input layout: [mode:1][errno:1][record bytes...]
 *   mode even: fgetxattr "returned" the record length (the remaining bytes,
 *              at most KVT_XATTR_BUF, copied to an exact-size heap block so
 *              ASan catches any read past what fgetxattr would have filled)
 *   mode odd:  fgetxattr "failed" (r = -1) with errno from the second byte
 * Checked against an independent statement of the contract (design.md):
 *   r == 4          -> KVT_REC_OK, crc = big-endian value of the 4 bytes
 *   r >= 0, r != 4  -> KVT_REC_MALFORMED (a checksum failure)
 *   r < 0: ENODATA  -> KVT_REC_ABSENT (legacy block, accepted)
 *          ERANGE   -> KVT_REC_MALFORMED (record longer than the buffer)
 *          other    -> KVT_REC_ERROR (the filesystem's error, block kept)
 * A *crc written on anything but KVT_REC_OK is also a failure.
 *
 * Built and run by tests/test_fuzz.py with csrc/fs_io.c, csrc/crc32c and
 * csrc/dsa linked (fs_io.c's other dependencies).
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fs_io.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2)
        return 0;
    int failed = data[0] & 1;
    int err = data[1];
    data += 2;
    size -= 2;
    if (size > KVT_XATTR_BUF)
        size = KVT_XATTR_BUF;
    uint8_t *rec = malloc(size ? size : 1);
    if (!rec)
        abort();
    memcpy(rec, data, size);

    long r = failed ? -1 : (long)size;
    const uint32_t sentinel = 0xA5A5A5A5u;
    uint32_t crc = sentinel;
    int got = kvt_xattr_parse(rec, r, failed ? err : 0, &crc);

    int want;
    uint32_t want_crc = sentinel;
    if (failed)
        want = err == ENODATA ? KVT_REC_ABSENT : err == ERANGE ? KVT_REC_MALFORMED : KVT_REC_ERROR;
    else if (size == 4) {
        want = KVT_REC_OK;
        want_crc = ((uint32_t)rec[0] << 24) | ((uint32_t)rec[1] << 16) | ((uint32_t)rec[2] << 8) | rec[3];
    } else
        want = KVT_REC_MALFORMED;

    if (got != want || crc != want_crc) {
        fprintf(stderr, "kvt_xattr_parse(r=%ld, err=%d): got %d crc=0x%08x, want %d crc=0x%08x\n", r,
                failed ? err : 0, got, crc, want, want_crc);
        abort();
    }
    free(rec);
    return 0;
}
