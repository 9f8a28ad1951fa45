/* libibverbs, opened at run time so the library loads on hosts without rdma-core. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include "ibv.h"

/* Field names avoid the ibv_ prefix: verbs.h defines function-like macros for some of them. */
static struct {
  struct ibv_device** (*get_device_list)(int*);
  void (*free_device_list)(struct ibv_device**);
  const char* (*get_device_name)(struct ibv_device*);
  struct ibv_context* (*open_device)(struct ibv_device*);
  int (*close_device)(struct ibv_context*);
  int (*query_device)(struct ibv_context*, struct ibv_device_attr*);
  int (*query_port)(struct ibv_context*, uint8_t, struct _compat_ibv_port_attr*);
  int (*query_gid)(struct ibv_context*, uint8_t, int, union ibv_gid*);
  ssize_t (*query_gid_table)(struct ibv_context*, struct ibv_gid_entry*, size_t, uint32_t, size_t);
  struct ibv_pd* (*alloc_pd)(struct ibv_context*);
  int (*dealloc_pd)(struct ibv_pd*);
  struct ibv_mr* (*reg_mr)(struct ibv_pd*, void*, size_t, int);
  struct ibv_mr* (*reg_dmabuf_mr)(struct ibv_pd*, uint64_t, size_t, uint64_t, int, int);
  int (*dereg_mr)(struct ibv_mr*);
  struct ibv_cq* (*create_cq)(struct ibv_context*, int, void*, struct ibv_comp_channel*, int);
  int (*destroy_cq)(struct ibv_cq*);
  struct ibv_qp* (*create_qp)(struct ibv_pd*, struct ibv_qp_init_attr*);
  int (*modify_qp)(struct ibv_qp*, struct ibv_qp_attr*, int);
  int (*query_qp)(struct ibv_qp*, struct ibv_qp_attr*, int, struct ibv_qp_init_attr*);
  int (*destroy_qp)(struct ibv_qp*);
  const char* (*wc_status_str)(enum ibv_wc_status);
} api;

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static int load_rc = -1;
static char load_err[512];

/* The versioned symbol this header describes; plain dlsym for unversioned builds. */
static void* sym(void* lib, const char* name, const char* version) {
  void* p = dlvsym(lib, name, version);
  return p != NULL ? p : dlsym(lib, name);
}

/* The required entry ibv_<field>, of the library's first version. */
#define REQUIRE(field)                                                                                    \
  do {                                                                                                    \
    if ((*(void**)&api.field = sym(lib, "ibv_" #field, "IBVERBS_1.1")) == NULL) {                         \
      snprintf(load_err, sizeof(load_err), "libibverbs.so.1 has no ibv_" #field " (rdma-core too old?)"); \
      return;                                                                                             \
    }                                                                                                     \
  } while (0)

static void load(void) {
  void* lib = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    snprintf(load_err, sizeof(load_err), "cannot load libibverbs.so.1 (is rdma-core installed?): %s", dlerror());
    return;
  }
  REQUIRE(get_device_list);
  REQUIRE(free_device_list);
  REQUIRE(get_device_name);
  REQUIRE(open_device);
  REQUIRE(close_device);
  REQUIRE(query_device);
  REQUIRE(query_port);
  REQUIRE(query_gid);
  REQUIRE(alloc_pd);
  REQUIRE(dealloc_pd);
  REQUIRE(reg_mr);
  REQUIRE(dereg_mr);
  REQUIRE(create_cq);
  REQUIRE(destroy_cq);
  REQUIRE(create_qp);
  REQUIRE(modify_qp);
  REQUIRE(query_qp);
  REQUIRE(destroy_qp);
  REQUIRE(wc_status_str);
  *(void**)&api.query_gid_table = sym(lib, "_ibv_query_gid_table", "IBVERBS_1.11");
  *(void**)&api.reg_dmabuf_mr = sym(lib, "ibv_reg_dmabuf_mr", "IBVERBS_1.12");
  load_rc = 0; /* the library stays loaded for the life of the process */
}

int rg_ibv_load(void) {
  pthread_once(&load_once, load);
  return load_rc;
}

const char* rg_ibv_error(void) { return load_err; }
int rg_ibv_have_dmabuf(void) { return load_rc == 0 && api.reg_dmabuf_mr != NULL; }
int rg_ibv_have_gid_table(void) { return load_rc == 0 && api.query_gid_table != NULL; }

struct ibv_device** rg_ibv_get_devices(int* n) { return api.get_device_list(n); }
void rg_ibv_free_devices(struct ibv_device** list) { api.free_device_list(list); }
const char* rg_ibv_device_name(struct ibv_device* dev) { return api.get_device_name(dev); }
struct ibv_context* rg_ibv_open(struct ibv_device* dev) { return api.open_device(dev); }
int rg_ibv_close(struct ibv_context* ctx) { return api.close_device(ctx); }
int rg_ibv_query_device(struct ibv_context* ctx, struct ibv_device_attr* attr) { return api.query_device(ctx, attr); }

/* The exported ibv_query_port fills only the older, shorter attribute struct; providers
 * with the extended context answer with the full one (what verbs.h's inline does). */
int rg_ibv_query_port(struct ibv_context* ctx, uint8_t port, struct ibv_port_attr* attr) {
  struct verbs_context* vctx = verbs_get_ctx_op(ctx, query_port);
  memset(attr, 0, sizeof(*attr));
  if (vctx != NULL) return vctx->query_port(ctx, port, attr, sizeof(*attr));
  return api.query_port(ctx, port, (struct _compat_ibv_port_attr*)attr);
}

int rg_ibv_query_gid(struct ibv_context* ctx, uint8_t port, int index, uint8_t gid[16]) {
  union ibv_gid g;
  int rc = api.query_gid(ctx, port, index, &g);
  if (rc == 0) memcpy(gid, g.raw, 16);
  return rc;
}

long rg_ibv_query_gid_table(struct ibv_context* ctx, struct ibv_gid_entry* entries, size_t max) {
  if (api.query_gid_table == NULL) return -ENOSYS;
  return (long)api.query_gid_table(ctx, entries, max, 0, sizeof(*entries));
}

struct ibv_pd* rg_ibv_alloc_pd(struct ibv_context* ctx) { return api.alloc_pd(ctx); }
int rg_ibv_dealloc_pd(struct ibv_pd* pd) { return api.dealloc_pd(pd); }

struct ibv_mr* rg_ibv_reg_mr(struct ibv_pd* pd, uint64_t addr, uint64_t len, int access) {
  return api.reg_mr(pd, (void*)(uintptr_t)addr, (size_t)len, access);
}

int rg_ibv_dereg_mr(struct ibv_mr* mr) { return api.dereg_mr(mr); }

/* A registration with fd -1 fails with EBADF where the kernel path exists, and with
 * EOPNOTSUPP or EPROTONOSUPPORT where it does not. */
int rg_ibv_dmabuf_works(struct ibv_pd* pd) {
  if (api.reg_dmabuf_mr == NULL) return 0;
  errno = 0;
  struct ibv_mr* mr = api.reg_dmabuf_mr(pd, 0, 0, 0, -1, 0);
  if (mr != NULL) {
    api.dereg_mr(mr);
    return 1;
  }
  return errno != EOPNOTSUPP && errno != EPROTONOSUPPORT;
}

int rg_ibv_modify_qp(struct ibv_qp* qp, struct ibv_qp_attr* attr, int mask) { return api.modify_qp(qp, attr, mask); }

int rg_ibv_query_qp(struct ibv_qp* qp, struct ibv_qp_attr* attr, int mask) {
  struct ibv_qp_init_attr init;
  return api.query_qp(qp, attr, mask, &init);
}

const char* rg_ibv_wc_status_str(int status) { return api.wc_status_str((enum ibv_wc_status)status); }

struct ibv_cq* rg_ibv_create_cq(struct ibv_context* ctx, int cqe) { return api.create_cq(ctx, cqe, NULL, NULL, 0); }
int rg_ibv_destroy_cq(struct ibv_cq* cq) { return api.destroy_cq(cq); }
struct ibv_qp* rg_ibv_create_qp(struct ibv_pd* pd, struct ibv_qp_init_attr* attr) { return api.create_qp(pd, attr); }
int rg_ibv_destroy_qp(struct ibv_qp* qp) { return api.destroy_qp(qp); }
