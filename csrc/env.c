/* KVTIER_* switch words (env.h): each setting described once. */
#include "env.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

enum { SWITCH, CHOICE, UINT };

typedef struct setting {
    const char *name;
    const char *group;          /* "io": kvtier.io checks it; "dsa": kvtier does */
    int kind;
    const char *const *words;   /* SWITCH: on words then off words; CHOICE: the words */
    int nwords;
    int hex;                    /* UINT: 0x hex accepted too */
    uint64_t lo, hi;            /* UINT */
    const char *what;           /* SWITCH / CHOICE: the default; UINT: unit and default */
} setting;

static const char *const SWITCH_WORDS[] = {"1", "true", "yes", "on", "0", "false", "no", "off"};
static const char *const DSA_MODES[] = {"model", "off"};
static const char *const DSA_WAITS[] = {"spin", "yield", "sleep"}; /* KVT_DSA_WAIT_* order */

static const setting SETTINGS[] = {
    {"KVTIER_CRC_COPY", "io", SWITCH, SWITCH_WORDS, 8, 0, 0, 0, "unset: on where the CPU has a fused kernel"},
    {"KVTIER_IO_URING", "io", SWITCH, SWITCH_WORDS, 8, 0, 0, 0,
     "unset: io_uring where built with liburing and the kernel allows it"},
    {"KVTIER_DSA", "dsa", CHOICE, DSA_MODES, 2, 0, 0, 0, "unset: probe the device when asked"},
    {"KVTIER_DSA_WAIT", "dsa", CHOICE, DSA_WAITS, 3, 0, 0, 0, "unset: yield"},
    {"KVTIER_DSA_MIN_SIZE", "dsa", UINT, NULL, 0, 1, 0, UINT64_MAX, "bytes, decimal or 0x hex (default 16384)"},
    /* kept in ns as uint64 */
    {"KVTIER_DSA_TIMEOUT_MS", "dsa", UINT, NULL, 0, 0, 1, UINT64_MAX / 1000000u - 1,
     "milliseconds, decimal (default 1000)"},
    {"KVTIER_DSA_SELFCHECK_TIMEOUT_MS", "dsa", UINT, NULL, 0, 0, 1, UINT64_MAX / 1000000u,
     "milliseconds, decimal (default 2000)"},
    {"KVTIER_DSA_MODEL_LATENCY_NS", "dsa", UINT, NULL, 0, 0, 0, 999999999u, "nanoseconds, decimal (default 0)"},
};
#define N_SETTINGS (sizeof SETTINGS / sizeof SETTINGS[0])

static const setting *find(const char *name)
{
    for (size_t i = 0; i < N_SETTINGS; i++)
        if (strcmp(SETTINGS[i].name, name) == 0)
            return &SETTINGS[i];
    abort(); /* a name not in the table: a bug in the caller */
}

static const char *value(const char *name)
{
    const char *v = getenv(name);
    return v != NULL && v[0] != '\0' ? v : NULL;
}

/* The index of v among s's words (SWITCH: any case), or -1. */
static int word(const setting *s, const char *v)
{
    for (int i = 0; i < s->nwords; i++)
        if (s->kind == SWITCH ? strcasecmp(v, s->words[i]) == 0 : strcmp(v, s->words[i]) == 0)
            return i;
    return -1;
}

static int digit(char c, int base)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (base == 16 && c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (base == 16 && c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* ASCII digits (or 0x hex with `hex`; a leading 0 then means octal to
 * strtoull: refused), no sign, no space, no overflow. 0 or -1. */
static int parse_uint(const char *v, int hex, uint64_t *out)
{
    int base = 10;
    if (hex && v[0] == '0' && (v[1] == 'x' || v[1] == 'X')) {
        base = 16;
        v += 2;
    } else if (hex && v[0] == '0' && v[1] != '\0') {
        return -1;
    }
    if (*v == '\0')
        return -1;
    uint64_t x = 0;
    for (; *v; v++) {
        int d = digit(*v, base);
        if (d < 0 || x > (UINT64_MAX - (uint64_t)d) / (uint64_t)base)
            return -1;
        x = x * (uint64_t)base + (uint64_t)d;
    }
    *out = x;
    return 0;
}

int kvt_env_switch(const char *name)
{
    const char *v = value(name);
    if (v == NULL)
        return KVT_ENV_UNSET;
    int i = word(find(name), v);
    return i < 0 ? KVT_ENV_BAD : i < 4;
}

int kvt_env_choice(const char *name)
{
    const char *v = value(name);
    if (v == NULL)
        return KVT_ENV_UNSET;
    int i = word(find(name), v);
    return i < 0 ? KVT_ENV_BAD : i;
}

int kvt_env_uint(const char *name, uint64_t *out)
{
    const char *v = value(name);
    if (v == NULL)
        return KVT_ENV_UNSET;
    const setting *s = find(name);
    uint64_t x;
    if (parse_uint(v, s->hex, &x) != 0 || x < s->lo || x > s->hi)
        return KVT_ENV_BAD;
    *out = x;
    return 1;
}

size_t kvt_env_names(const char *group, const char **names, size_t max)
{
    size_t k = 0;
    for (size_t i = 0; i < N_SETTINGS; i++)
        if (strcmp(SETTINGS[i].group, group) == 0 && k < max)
            names[k++] = SETTINGS[i].name;
    return k;
}

const char *kvt_env_problem(const char *name, char *buf, size_t n)
{
    const setting *s = find(name);
    uint64_t x;
    int bad = s->kind == UINT ? kvt_env_uint(name, &x) == KVT_ENV_BAD
                              : (s->kind == SWITCH ? kvt_env_switch(name) : kvt_env_choice(name)) == KVT_ENV_BAD;
    if (!bad)
        return NULL;
    if (s->kind == UINT) {
        snprintf(buf, n, ": %s, an integer %" PRIu64 "..%" PRIu64, s->what, s->lo, s->hi);
        return buf;
    }
    size_t used = (size_t)snprintf(buf, n, "; valid values: ");
    for (int i = 0; i < s->nwords && used < n; i++)
        used += (size_t)snprintf(buf + used, n - used, "%s%s", i ? ", " : "", s->words[i]);
    if (used < n)
        snprintf(buf + used, n - used, " (%s)", s->what);
    return buf;
}
