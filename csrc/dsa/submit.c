/* DSA portals for a real WQ.
 *
 * The WQ's character device is opened read-write and its 4 KiB portal is
 * mmap'd (MAP_SHARED, PROT_WRITE). Descriptors go in with
 *   MOVDIR64B  dedicated WQ (posted 64-byte write; the caller keeps the number
 *              in flight <= WQ size, an overflowing descriptor is dropped)
 *   ENQCMD     shared WQ (non-posted; ZF=1 means "WQ full, retry")
 * both emitted as .byte encodings only after CPUID says the CPU has them
 * (CPUID.(EAX=7,ECX=0):ECX bit 28 MOVDIR64B, bit 29 ENQCMD).
 * Where mmap is refused, or the CPU lacks the instruction, write(fd, desc, 64)
 * hands the descriptor to the kernel driver. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "dsa.h"

#if defined(__x86_64__)
#include <cpuid.h>

static unsigned cpuid7_ecx(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d))
        return 0;
    return c;
}

int kvt_dsa_cpu_has_movdir64b(void) { return (cpuid7_ecx() >> 28) & 1; }
int kvt_dsa_cpu_has_enqcmd(void) { return (cpuid7_ecx() >> 29) & 1; }

/* MOVDIR64B (%rdx) -> [%rax]: 66 0F 38 F8 /r, modrm 0x02. */
static inline void movdir64b(void *portal, const void *desc)
{
    __asm__ volatile("sfence\n\t"
                     ".byte 0x66, 0x0f, 0x38, 0xf8, 0x02"
                     :
                     : "a"(portal), "d"(desc), "m"(*(const char(*)[64])desc)
                     : "memory");
}

/* ENQCMD (%rdx) -> [%rax]: F2 0F 38 F8 /r. Returns ZF (1 = not accepted). */
static inline int enqcmd(void *portal, const void *desc)
{
    unsigned char zf;
    __asm__ volatile("sfence\n\t"
                     ".byte 0xf2, 0x0f, 0x38, 0xf8, 0x02\n\t"
                     "setz %0"
                     : "=q"(zf)
                     : "a"(portal), "d"(desc), "m"(*(const char(*)[64])desc)
                     : "memory", "cc");
    return zf;
}
#else
int kvt_dsa_cpu_has_movdir64b(void) { return 0; }
int kvt_dsa_cpu_has_enqcmd(void) { return 0; }
#endif

typedef struct dev_portal {
    kvt_dsa_portal base;
    int fd;
    void *portal;  /* mmap'd WQ portal, or NULL for the write() path */
} dev_portal;

#if defined(__x86_64__)
static int submit_movdir64b(kvt_dsa_portal *p, const struct dsa_hw_desc *desc)
{
    movdir64b(((dev_portal *)p)->portal, desc);
    return KVT_DSA_SUBMIT_OK;
}

static int submit_enqcmd(kvt_dsa_portal *p, const struct dsa_hw_desc *desc)
{
    return enqcmd(((dev_portal *)p)->portal, desc) ? KVT_DSA_SUBMIT_RETRY : KVT_DSA_SUBMIT_OK;
}
#endif

static int submit_write(kvt_dsa_portal *p, const struct dsa_hw_desc *desc)
{
    dev_portal *d = (dev_portal *)p;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    ssize_t r = write(d->fd, desc, sizeof *desc);
    if (r == (ssize_t)sizeof *desc)
        return KVT_DSA_SUBMIT_OK;
    if (r < 0 && (errno == EAGAIN || errno == EBUSY || errno == EINTR))
        return KVT_DSA_SUBMIT_RETRY;
    if (r >= 0)
        errno = EIO;
    return KVT_DSA_SUBMIT_ERROR;
}

static void dev_close(kvt_dsa_portal *p)
{
    dev_portal *d = (dev_portal *)p;
    if (d->portal)
        munmap(d->portal, KVT_DSA_PORTAL_SIZE);
    close(d->fd);
    free(d);
}

#if defined(__x86_64__)
static const kvt_dsa_portal_ops MOVDIR64B_OPS = {submit_movdir64b, dev_close};
static const kvt_dsa_portal_ops ENQCMD_OPS = {submit_enqcmd, dev_close};
#endif
static const kvt_dsa_portal_ops WRITE_OPS = {submit_write, dev_close};

kvt_dsa_portal *kvt_dsa_portal_open(const kvt_dsa_wq_info *wq)
{
    int fd = open(wq->path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    dev_portal *d = calloc(1, sizeof *d);
    if (!d) {
        close(fd);
        errno = ENOMEM;
        return NULL;
    }
    d->fd = fd;
    d->base.ops = &WRITE_OPS;
    d->base.kind = "write";
#if defined(__x86_64__)
    int have = wq->dedicated ? kvt_dsa_cpu_has_movdir64b() : kvt_dsa_cpu_has_enqcmd();
    if (have) {
        void *p = mmap(NULL, KVT_DSA_PORTAL_SIZE, PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
        if (p != MAP_FAILED) {
            d->portal = p;
            d->base.ops = wq->dedicated ? &MOVDIR64B_OPS : &ENQCMD_OPS;
            d->base.kind = wq->dedicated ? "movdir64b" : "enqcmd";
        }
    }
#endif
    return &d->base;
}
