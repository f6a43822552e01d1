/* DSA work queue discovery from sysfs.
 *
 * The idxd driver exposes each WQ as <sysfs>/bus/dsa/devices/wqN.M with
 * attribute files state, type, mode, size, max_transfer_size and
 * block_on_fault; its parent device dsaN has gen_cap (hex). A user WQ has
 * the character device <dev>/dsa/wqN.M. Roots are overridable so tests can
 * build fake trees. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dsa.h"

static int read_attr(const char *dir, const char *name, char *out, size_t n)
{
    char path[600];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "re");
    if (!f)
        return -1;
    if (!fgets(out, (int)n, f)) {
        fclose(f);
        out[0] = '\0';
        return -1;
    }
    fclose(f);
    size_t l = strlen(out);
    while (l > 0 && (out[l - 1] == '\n' || out[l - 1] == ' ' || out[l - 1] == '\t'))
        out[--l] = '\0';
    return 0;
}

static int read_u64(const char *dir, const char *name, int base, uint64_t *v)
{
    char buf[64], *end;
    if (read_attr(dir, name, buf, sizeof buf) < 0 || buf[0] == '\0')
        return -1;
    errno = 0;
    unsigned long long x = strtoull(buf, &end, base);
    if (errno || *end != '\0')
        return -1;
    *v = x;
    return 0;
}

/* "wq3.1" -> device "dsa3". Returns 0 when the name has that shape. */
static int parse_wq_name(const char *name, char *device, size_t n)
{
    unsigned dev, q;
    char tail;
    if (sscanf(name, "wq%u.%u%c", &dev, &q, &tail) != 2)
        return -1;
    snprintf(device, n, "dsa%u", dev);
    return 0;
}

static void add_reason(kvt_dsa_wq_info *w, const char *fmt, const char *a)
{
    size_t l = strlen(w->reason);
    if (l + 3 >= sizeof w->reason)
        return;
    if (l) {
        strcat(w->reason, "; ");
        l += 2;
    }
    snprintf(w->reason + l, sizeof w->reason - l, fmt, a);
}

static void probe_wq(const char *devices_dir, const char *dev_dir, const char *name,
                     const char *want, kvt_dsa_wq_info *w)
{
    char dir[600], devdir[600];
    memset(w, 0, sizeof *w);
    if (strlen(name) >= sizeof w->name) {
        memcpy(w->name, name, sizeof w->name - 1);
        add_reason(w, "%sname too long", "");
        return;
    }
    memcpy(w->name, name, strlen(name) + 1);
    parse_wq_name(name, w->device, sizeof w->device);
    snprintf(dir, sizeof dir, "%s/%s", devices_dir, name);
    if ((size_t)snprintf(w->path, sizeof w->path, "%s/%s", dev_dir, name) >= sizeof w->path)
        add_reason(w, "%sdevice path too long", "");

    if (read_attr(dir, "state", w->state, sizeof w->state) < 0)
        add_reason(w, "%sno state attribute", "");
    else if (strcmp(w->state, "enabled") != 0)
        add_reason(w, "state=%s (not enabled)", w->state);
    if (read_attr(dir, "type", w->type, sizeof w->type) < 0)
        add_reason(w, "%sno type attribute", "");
    else if (strcmp(w->type, "user") != 0)
        add_reason(w, "type=%s (not a user WQ)", w->type);
    if (read_attr(dir, "mode", w->mode, sizeof w->mode) < 0) {
        add_reason(w, "%sno mode attribute", "");
    } else if (strcmp(w->mode, "dedicated") == 0) {
        w->dedicated = 1;
    } else if (strcmp(w->mode, "shared") != 0) {
        add_reason(w, "mode=%s (neither dedicated nor shared)", w->mode);
    }
    uint64_t v;
    if (read_u64(dir, "size", 0, &v) < 0 || v == 0 || v > 0xFFFFFFFFu) {
        add_reason(w, "%ssize missing or 0", "");
    } else {
        w->size = (unsigned)v;
    }
    if (read_u64(dir, "max_transfer_size", 0, &v) < 0 || v == 0) {
        add_reason(w, "%smax_transfer_size missing or 0", "");
    } else {
        w->max_transfer_size = v;
    }
    if (read_u64(dir, "block_on_fault", 0, &v) == 0)
        w->block_on_fault = v != 0;
    /* Parent device's gen_cap: sysfs prints it in hex ("0x40915f0107"). */
    if (w->device[0]) {
        snprintf(devdir, sizeof devdir, "%s/%s", devices_dir, w->device);
        if (read_u64(devdir, "gen_cap", 16, &v) == 0)
            w->gen_cap = v;
        else
            add_reason(w, "no gen_cap for parent device %s", w->device);
    } else {
        add_reason(w, "name %s is not wqN.M", name);
    }
    if (want && want[0] && strcmp(want, name) != 0)
        add_reason(w, "not the WQ named by KVTIER_DSA_WQ=%s", want);
    if (w->reason[0] == '\0') {
        if (access(w->path, F_OK) != 0) {
            add_reason(w, "device node %s missing", w->path);
        } else if (access(w->path, R_OK | W_OK) != 0) {
            add_reason(w, "device node %s not read-write for this user", w->path);
        }
    }
    w->usable = w->reason[0] == '\0';
}

/* Preference: shared > dedicated, bof=1 > bof=0, larger size, name order. */
static int better(const kvt_dsa_wq_info *a, const kvt_dsa_wq_info *b)
{
    if (a->dedicated != b->dedicated)
        return !a->dedicated;
    if (a->block_on_fault != b->block_on_fault)
        return a->block_on_fault;
    if (a->size != b->size)
        return a->size > b->size;
    return strcmp(a->name, b->name) < 0;
}

size_t kvt_dsa_candidates(const kvt_dsa_discovery *d, int *idx, size_t max)
{
    size_t k = 0;
    for (size_t i = 0; i < d->n && k < max; i++)
        if (d->wqs[i].usable)
            idx[k++] = (int)i;
    /* insertion sort by preference */
    for (size_t i = 1; i < k; i++) {
        int x = idx[i];
        size_t j = i;
        while (j > 0 && better(&d->wqs[x], &d->wqs[idx[j - 1]])) {
            idx[j] = idx[j - 1];
            j--;
        }
        idx[j] = x;
    }
    return k;
}

static int name_cmp(const void *a, const void *b)
{
    return strcmp(((const kvt_dsa_wq_info *)a)->name, ((const kvt_dsa_wq_info *)b)->name);
}

int kvt_dsa_discover(const char *sysfs_root, const char *dev_root, const char *want,
                     kvt_dsa_discovery *out)
{
    memset(out, 0, sizeof *out);
    out->chosen = -1;
    if (!sysfs_root || !sysfs_root[0])
        sysfs_root = getenv("KVTIER_DSA_SYSFS");
    if (!sysfs_root || !sysfs_root[0])
        sysfs_root = "/sys";
    if (!dev_root || !dev_root[0])
        dev_root = getenv("KVTIER_DSA_DEV");
    if (!dev_root || !dev_root[0])
        dev_root = "/dev";
    if (!want)
        want = getenv("KVTIER_DSA_WQ");
    snprintf(out->devices_dir, sizeof out->devices_dir, "%s/bus/dsa/devices", sysfs_root);
    snprintf(out->dev_dir, sizeof out->dev_dir, "%s/dsa", dev_root);

    DIR *d = opendir(out->devices_dir);
    if (!d)
        return 0;
    out->devices_dir_present = 1;
    struct dirent *de;
    while ((de = readdir(d)) != NULL && out->n < KVT_DSA_MAX_WQS) {
        if (strncmp(de->d_name, "wq", 2) != 0)
            continue;
        probe_wq(out->devices_dir, out->dev_dir, de->d_name, want, &out->wqs[out->n++]);
    }
    closedir(d);
    qsort(out->wqs, out->n, sizeof out->wqs[0], name_cmp);
    int idx[KVT_DSA_MAX_WQS];
    if (kvt_dsa_candidates(out, idx, KVT_DSA_MAX_WQS) > 0)
        out->chosen = idx[0];
    return 0;
}
