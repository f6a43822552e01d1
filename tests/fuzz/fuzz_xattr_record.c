/* libFuzzer harness: the xattr record parsers of the load path,
 * kvt_xattr_parse() and kvt_id_parse() in csrc/block/records.c (contract in
 * csrc/block/records.h).
 *
 * Input layout: [mode:1][errno:1][record bytes...]
 *   mode bit 0 clear: fgetxattr "returned" the record length (the remaining
 *              bytes, at most KVT_XATTR_BUF, copied to an exact-size heap
 *              block so ASan catches any read past what fgetxattr filled)
 *   mode bit 0 set: fgetxattr "failed" (r = -1) with errno from the 2nd byte
 *   mode bit 1: the identity record parser (else the CRC record parser);
 *   mode bit 2: the record starts with the expected identity (else as given)
 *   mode bit 3 (with bit 2): then (mode >> 4) & 7 distinct bits of that
 *              identity flipped, at positions (errno byte * 11 + k * 29) % 64
 *              (a damaged record, or one near another identity)
 * Checked against an independent statement of the contract (design.md):
 * CRC record (user.vllm.kv_crc32c):
 *   r == 4          -> KVT_REC_OK, crc = big-endian value of the 4 bytes
 *   r >= 0, r != 4  -> KVT_REC_MALFORMED (a checksum failure)
 *   r < 0: ENODATA  -> KVT_REC_ABSENT (legacy block, accepted)
 *          ERANGE   -> KVT_REC_MALFORMED (record longer than the buffer)
 *          other    -> KVT_REC_ERROR (the filesystem's error, block kept)
 * identity record (user.kvtier.id), against the expected identity ID:
 *   r == 12, starts with ID -> KVT_ID_CRC, crc = big-endian bytes 8..11
 *   r == 12, first 8 bytes within KVT_ID_DAMAGED_BITS bits of ID -> KVT_ID_DAMAGED
 *   r == 12, further        -> KVT_ID_MISMATCH (a well-formed record of another block)
 *   other r >= 0            -> KVT_ID_DAMAGED (the record itself damaged, issue #24)
 *   r < 0: ENODATA -> KVT_ID_ABSENT, ERANGE -> KVT_ID_DAMAGED, other -> KVT_ID_ERROR
 * A *crc written on anything but KVT_REC_OK / KVT_ID_CRC is also a failure.
 *
 * Built and run by tests/test_fuzz.py with csrc/block/records.c.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "records.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2)
        return 0;
    int failed = data[0] & 1, idrec = data[0] & 2, own = data[0] & 4;
    int flips = (data[0] & 8) ? (data[0] >> 4) & 7 : 0;
    int err = data[1];
    data += 2;
    size -= 2;
    if (size > KVT_XATTR_BUF)
        size = KVT_XATTR_BUF;
    static const uint8_t ID[KVT_ID_LEN] = {0x6b, 0x76, 0x74, 0x69, 0x65, 0x72, 0x69, 0x64};
    uint8_t *rec = malloc(size ? size : 1);
    if (!rec)
        abort();
    memcpy(rec, data, size);
    if (own) {
        memcpy(rec, ID, size < KVT_ID_LEN ? size : KVT_ID_LEN);
        for (int k = 0; k < flips; k++) {
            int bit = (err * 11 + k * 29) % 64;
            if ((size_t)(bit / 8) < size)
                rec[bit / 8] ^= (uint8_t)(1u << (bit % 8));
        }
    }

    long r = failed ? -1 : (long)size;
    const uint32_t sentinel = 0xA5A5A5A5u;
    uint32_t crc = sentinel;
    int got = idrec ? kvt_id_parse(rec, r, failed ? err : 0, ID, &crc) : kvt_xattr_parse(rec, r, failed ? err : 0, &crc);

    int want;
    uint32_t want_crc = sentinel;
    const uint8_t *v = rec;
    if (!idrec) {
        if (failed)
            want = err == ENODATA ? KVT_REC_ABSENT : err == ERANGE ? KVT_REC_MALFORMED : KVT_REC_ERROR;
        else if (size == 4) {
            want = KVT_REC_OK;
            want_crc = ((uint32_t)v[0] << 24) | ((uint32_t)v[1] << 16) | ((uint32_t)v[2] << 8) | v[3];
        } else
            want = KVT_REC_MALFORMED;
    } else {
        int same = size >= KVT_ID_LEN && memcmp(rec, ID, KVT_ID_LEN) == 0;
        if (failed)
            want = err == ENODATA ? KVT_ID_ABSENT : err == ERANGE ? KVT_ID_DAMAGED : KVT_ID_ERROR;
        else if (size == 12 && same) {
            want = KVT_ID_CRC;
            want_crc = ((uint32_t)v[8] << 24) | ((uint32_t)v[9] << 16) | ((uint32_t)v[10] << 8) | v[11];
        } else if (size == 12) {
            int bits = 0; /* bit by bit, not as the parser counts them */
            for (int i = 0; i < 64; i++)
                bits += ((rec[i / 8] >> (i % 8)) & 1) != ((ID[i / 8] >> (i % 8)) & 1);
            want = bits <= KVT_ID_DAMAGED_BITS ? KVT_ID_DAMAGED : KVT_ID_MISMATCH;
        } else
            want = KVT_ID_DAMAGED;
    }

    if (got != want || crc != want_crc) {
        fprintf(stderr, "%s(r=%ld, err=%d): got %d crc=0x%08x, want %d crc=0x%08x\n",
                idrec ? "kvt_id_parse" : "kvt_xattr_parse", r, failed ? err : 0, got, crc, want, want_crc);
        abort();
    }
    free(rec);
    return 0;
}
