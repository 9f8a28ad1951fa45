#include <stdlib.h>
#include <string.h>
#include "fakenic.h"

#define MAX_WRS 65536
#define MAX_CQES 65536

typedef struct ring {
  struct ibv_wc* wc;
  int head, tail;
} ring;

struct fake_nic {
  struct ibv_context ctx; /* first: a qp's or cq's context pointer leads back here */
  struct ibv_qp qp;
  struct ibv_cq scq;
  fake_wr* sends;
  int nsends, ncompleted;
  ring sring;
  int recvs;
  int post_err;
};

static void push(ring* r, struct ibv_wc wc) {
  if (r->tail < MAX_CQES) r->wc[r->tail++] = wc;
}

static int fake_poll_cq(struct ibv_cq* cq, int num, struct ibv_wc* wc) {
  fake_nic* n = (fake_nic*)cq->context;
  ring* r = &n->sring;
  int k = 0;
  while (k < num && r->head < r->tail) wc[k++] = r->wc[r->head++];
  return k;
}

static int fake_post_send(struct ibv_qp* qp, struct ibv_send_wr* wr, struct ibv_send_wr** bad) {
  fake_nic* n = (fake_nic*)qp->context;
  if (n->post_err != 0) {
    int err = n->post_err;
    n->post_err = 0;
    *bad = wr;
    return err;
  }
  for (; wr != NULL; wr = wr->next) {
    if (n->nsends == MAX_WRS) {
      *bad = wr;
      return 12; /* ENOMEM */
    }
    fake_wr* f = &n->sends[n->nsends++];
    memset(f, 0, sizeof(*f));
    f->wr_id = wr->wr_id;
    f->opcode = wr->opcode;
    f->send_flags = wr->send_flags;
    f->num_sge = wr->num_sge;
    if (wr->num_sge > 0) {
      f->addr = wr->sg_list[0].addr;
      f->len = wr->sg_list[0].length;
      f->lkey = wr->sg_list[0].lkey;
      if ((wr->send_flags & IBV_SEND_INLINE) && f->len <= sizeof(f->data))
        memcpy(f->data, (const void*)(uintptr_t)f->addr, f->len);
    }
    f->remote = wr->wr.rdma.remote_addr;
    f->rkey = wr->wr.rdma.rkey;
  }
  return 0;
}

static int fake_post_recv(struct ibv_qp* qp, struct ibv_recv_wr* wr, struct ibv_recv_wr** bad) {
  fake_nic* n = (fake_nic*)qp->context;
  (void)bad;
  for (; wr != NULL; wr = wr->next) n->recvs++;
  return 0;
}

fake_nic* fake_nic_new(uint32_t qpn) {
  fake_nic* n = calloc(1, sizeof(*n));
  n->sends = calloc(MAX_WRS, sizeof(*n->sends));
  n->sring.wc = calloc(MAX_CQES, sizeof(struct ibv_wc));
  n->ctx.ops.poll_cq = fake_poll_cq;
  n->ctx.ops.post_send = fake_post_send;
  n->ctx.ops.post_recv = fake_post_recv;
  n->qp.context = &n->ctx;
  n->qp.qp_num = qpn;
  n->scq.context = &n->ctx;
  return n;
}

void fake_nic_free(fake_nic* n) {
  free(n->sends);
  free(n->sring.wc);
  free(n);
}

struct ibv_qp* fake_nic_qp(fake_nic* n) { return &n->qp; }
struct ibv_cq* fake_nic_send_cq(fake_nic* n) { return &n->scq; }
int fake_nic_nsends(fake_nic* n) { return n->nsends; }
const fake_wr* fake_nic_send(fake_nic* n, int i) { return &n->sends[i]; }
int fake_nic_recvs_posted(fake_nic* n) { return n->recvs; }

int fake_nic_complete(fake_nic* n, int k) {
  int done = 0;
  for (; done < k && n->ncompleted < n->nsends; done++) {
    fake_wr* f = &n->sends[n->ncompleted++];
    if (f->send_flags & IBV_SEND_SIGNALED)
      push(&n->sring, (struct ibv_wc){.wr_id = f->wr_id, .status = IBV_WC_SUCCESS, .opcode = IBV_WC_RDMA_WRITE,
                                      .qp_num = n->qp.qp_num});
  }
  return done;
}

int fake_nic_fail(fake_nic* n, int status, uint32_t vendor_err) {
  int done = 0;
  for (; n->ncompleted < n->nsends; done++) {
    fake_wr* f = &n->sends[n->ncompleted++];
    push(&n->sring, (struct ibv_wc){.wr_id = f->wr_id,
                                    .status = done == 0 ? (enum ibv_wc_status)status : IBV_WC_WR_FLUSH_ERR,
                                    .vendor_err = done == 0 ? vendor_err : 0,
                                    .qp_num = n->qp.qp_num});
  }
  return done;
}

void fake_nic_fail_post(fake_nic* n, int err) { n->post_err = err; }
