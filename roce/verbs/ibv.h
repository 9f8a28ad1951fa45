/* The verbs fabric's C side: libibverbs opened at run time, and the lane operations.
 *
 * Nothing here links against libibverbs. Exported functions are reached through pointers
 * resolved with dlvsym (verbs.h renames several of them with macros, so the wrappers
 * below carry their own names); ibv_post_send, ibv_post_recv and ibv_poll_cq are
 * static inline in verbs.h and go through the context's ops table, needing no symbol. */
#ifndef RG_VERBS_IBV_H
#define RG_VERBS_IBV_H

#include <infiniband/verbs.h>
#include <stddef.h>
#include <stdint.h>
#include "../fabric/fabric.h"

/* ------------------------------------------------------------------ library */

/* Opens libibverbs.so.1 once. Returns 0, or -1 with rg_ibv_error() saying why. */
int rg_ibv_load(void);
const char* rg_ibv_error(void);
/* Optional entry points: ibv_reg_dmabuf_mr (rdma-core 34+), _ibv_query_gid_table (32+). */
int rg_ibv_have_dmabuf(void);
int rg_ibv_have_gid_table(void);

/* Each wrapper sets errno as the verb does; the Go side reads it. */
struct ibv_device** rg_ibv_get_devices(int* n);
void rg_ibv_free_devices(struct ibv_device** list);
const char* rg_ibv_device_name(struct ibv_device* dev);
struct ibv_context* rg_ibv_open(struct ibv_device* dev);
int rg_ibv_close(struct ibv_context* ctx);
int rg_ibv_query_device(struct ibv_context* ctx, struct ibv_device_attr* attr);
int rg_ibv_query_port(struct ibv_context* ctx, uint8_t port, struct ibv_port_attr* attr);
int rg_ibv_query_gid(struct ibv_context* ctx, uint8_t port, int index, uint8_t gid[16]);
/* Valid GID entries of every port; a negative errno when the table query is unsupported. */
long rg_ibv_query_gid_table(struct ibv_context* ctx, struct ibv_gid_entry* entries, size_t max);
struct ibv_pd* rg_ibv_alloc_pd(struct ibv_context* ctx);
int rg_ibv_dealloc_pd(struct ibv_pd* pd);
struct ibv_mr* rg_ibv_reg_mr(struct ibv_pd* pd, uint64_t addr, uint64_t len, int access);
int rg_ibv_dereg_mr(struct ibv_mr* mr);
/* 1 when the kernel and provider accept dma-buf registrations on pd's device. */
int rg_ibv_dmabuf_works(struct ibv_pd* pd);
int rg_ibv_modify_qp(struct ibv_qp* qp, struct ibv_qp_attr* attr, int mask);
int rg_ibv_query_qp(struct ibv_qp* qp, struct ibv_qp_attr* attr, int mask);
const char* rg_ibv_wc_status_str(int status);
struct ibv_cq* rg_ibv_create_cq(struct ibv_context* ctx, int cqe);
int rg_ibv_destroy_cq(struct ibv_cq* cq);
struct ibv_qp* rg_ibv_create_qp(struct ibv_pd* pd, struct ibv_qp_init_attr* attr);
int rg_ibv_destroy_qp(struct ibv_qp* qp);

/* ------------------------------------------------------------------ lanes */

/* One RC queue pair with its own completion queue, for sends (no receive is posted). */
typedef struct rg_vlane rg_vlane;

/* Creates the CQ and the QP (in RESET). Returns NULL with err filled. */
rg_vlane* rg_vlane_create(struct ibv_context* ctx, struct ibv_pd* pd, int hca, const char* hca_name,
                          uint32_t sq_depth, uint64_t timeout_ns, char* err, int errlen);
/* Builds a lane around existing verbs objects it does not own (tests use a fake NIC). */
rg_vlane* rg_vlane_wrap(struct ibv_qp* qp, struct ibv_cq* scq, int hca, const char* hca_name, uint32_t sq_depth,
                        uint64_t timeout_ns);
/* Destroys what the lane owns and frees it. */
void rg_vlane_destroy(rg_vlane* l);
struct ibv_qp* rg_vlane_qp(rg_vlane* l);
uint32_t rg_vlane_qpn(rg_vlane* l);
/* Arms the lane for traffic: the peer's name for messages and its probe word. */
void rg_vlane_start(rg_vlane* l, const char* peer, uint64_t probe_addr, uint32_t probe_rkey, uint64_t now_ns);
extern const rg_lane_ops rg_vlane_ops;

/* Most work requests one post accepts. */
#define RG_VLANE_MAX_POST 32

#endif
