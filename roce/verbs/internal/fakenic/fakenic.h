/* A fake NIC for the verbs lane tests: a queue pair and a completion queue whose
 * context's ops table records what is posted and returns completions the test makes.
 * Nothing here touches libibverbs or hardware. */
#ifndef RG_FAKENIC_H
#define RG_FAKENIC_H

#include <infiniband/verbs.h>

typedef struct fake_wr {
  uint64_t wr_id;
  int opcode;
  unsigned int send_flags;
  uint64_t addr;
  uint32_t len, lkey;
  uint64_t remote;
  uint32_t rkey;
  int num_sge;
  uint8_t data[64]; /* the payload of an inline request, copied at post */
} fake_wr;

typedef struct fake_nic fake_nic;

fake_nic* fake_nic_new(uint32_t qpn);
void fake_nic_free(fake_nic* n);
struct ibv_qp* fake_nic_qp(fake_nic* n);
struct ibv_cq* fake_nic_send_cq(fake_nic* n);
int fake_nic_nsends(fake_nic* n);
const fake_wr* fake_nic_send(fake_nic* n, int i);
int fake_nic_recvs_posted(fake_nic* n);
/* Completes the next k posted requests: signaled ones produce a completion. Returns how many. */
int fake_nic_complete(fake_nic* n, int k);
/* Completes the next request with status (even if unsignaled) and flushes the rest. */
int fake_nic_fail(fake_nic* n, int status, uint32_t vendor_err);
/* The next ibv_post_send returns err. */
void fake_nic_fail_post(fake_nic* n, int err);

#endif
