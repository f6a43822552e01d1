/* The one parser of the KVTIER_* switches the C core reads with getenv(3):
 * on/off words, choices, unsigned numbers, each described once in env.c's
 * table (name, kind, valid values, default). A reader gets "unset" (or
 * empty: the default), the value, or "not valid" (it keeps its default);
 * kvt_env_problem() says why a value is not valid, which the binding's
 * env_check() hands to kvtier/_blockio/env.py to report at import.
 * Plain C11, no Python. */
#ifndef KVTIER_ENV_H
#define KVTIER_ENV_H

#include <stddef.h>
#include <stdint.h>

enum { KVT_ENV_UNSET = -1, KVT_ENV_BAD = -2 };

/* An on/off word (KVTIER_CRC_COPY, KVTIER_IO_URING), any case: 1 for
 * 1/true/yes/on, 0 for 0/false/no/off, KVT_ENV_UNSET or KVT_ENV_BAD. */
int kvt_env_switch(const char *name);
/* One of the setting's words (KVTIER_DSA: model, off; KVTIER_DSA_WAIT: spin,
 * yield, sleep), compared exactly: its index, KVT_ENV_UNSET or KVT_ENV_BAD. */
int kvt_env_choice(const char *name);
/* An unsigned integer in the setting's range, ASCII digits only (decimal, or
 * where the setting says so 0x hex; never octal): 1 with *out, KVT_ENV_UNSET
 * or KVT_ENV_BAD (*out untouched). */
int kvt_env_uint(const char *name, uint64_t *out);

/* The settings of `group` ("io" or "dsa"), in order: their names. */
size_t kvt_env_names(const char *group, const char **names, size_t max);
/* NULL when `name` is unset, empty or valid; else why not, as the tail of
 * "<name>=<value> is not valid<tail>" ("; valid values: ..." or ": ..., an
 * integer lo..hi"), written into buf. */
const char *kvt_env_problem(const char *name, char *buf, size_t n);

#endif
