/* One block's part of the intercepted one-shot gather (oneshot.h has the layout). The
 * kernel (oneshot.cu) runs it in every block at once; the host stand-in
 * (roce/gather/oneshot_host.c) runs the blocks one after another on one thread, which the
 * protocol allows: block b waits only for the peer's chunks that the peer's block b
 * staged before it waited. The includer defines:
 *   RG_OS_FN                      the function qualifier
 *   RG_OS_SHARED                  a variable the whole block sees
 *   RG_OS_LEADER                  true in the one thread of a block that polls and rings
 *   RG_OS_SYNC()                  a barrier of the block
 *   RG_OS_FENCE_SYS()             orders this thread's writes before later ones, for the host and NIC too
 *   RG_OS_FENCE_GPU()             the same for the other blocks of this launch only
 *   RG_OS_LOAD_ACQUIRE(p)         a load of a 64-bit word others write, ordered before later loads
 *   RG_OS_STORE_RELEASE(p, v)     a store ordered after every earlier write of the block
 *   RG_OS_NOW()                   nanoseconds of a clock that only goes forward
 *   RG_OS_RELAX()                 between two polls of a wait
 *   RG_OS_ARRIVE(p)               atomic add of 1 to a 32-bit counter in rg_os_dev, returning the old value
 *   RG_OS_FAIL(p, v)              atomic "keep the first nonzero" of a 32-bit word in rg_os_dev
 *   rg_os_copy_out(dst, src, n)   the block copies n bytes to the host (staging)
 *   rg_os_copy_in(dst, src, n)    the block copies n bytes the peer wrote into host memory (volatile loads)
 *   rg_os_copy_dev(dst, src, n)   the block copies n bytes within device memory */
#ifndef RG_KERNELS_ONESHOT_BODY_H
#define RG_KERNELS_ONESHOT_BODY_H

#include "oneshot.h"

/* Waits until every lane's flag reaches level; returns RG_OS_OK, or why it stopped. The
 * abort word and the clock are read one poll in 16: each read of host memory is a round
 * trip over PCIe, and the flags are what the wait is for. */
RG_OS_FN static rg_u32 rg_os_wait(const rg_os_args* a, rg_u64 level, rg_u64 deadline) {
  for (rg_u32 polls = 0;; polls++) {
    rg_u32 seen = 0;
    for (rg_u32 l = 0; l < a->lanes; l++) seen += RG_OS_LOAD_ACQUIRE(&a->ctrl->flag[l].word) >= level;
    if (seen == a->lanes) return RG_OS_OK; /* the peer's data is whole: an abort now changes nothing */
    if ((polls & 15) == 15) {
      if (a->ctrl->abort.word != 0) return RG_OS_ABORTED;
      if (RG_OS_NOW() > deadline) return RG_OS_TIMED_OUT;
    }
    RG_OS_RELAX();
  }
}

RG_OS_FN static void rg_os_block(const rg_os_args* a, rg_u32 block, rg_u32 nblocks) {
  RG_OS_SHARED rg_u32 verdict;
  RG_OS_SHARED rg_u32 last;
  RG_OS_SHARED rg_u64 arrived_at;
  const rg_u64 seq = *(volatile rg_u64*)&a->dev->seq + 1; /* the previous gather's kernel ended before this one began */
  const rg_u32 parity = (rg_u32)(seq & 1);
  unsigned char* send_slot = a->send_slots + parity * a->slot_bytes;
  const unsigned char* recv_slot = a->recv_slots + parity * a->slot_bytes;
  if (RG_OS_LEADER && block == 0) a->dev->t_start = RG_OS_NOW();

  /* Stage each of this block's chunks and ring its doorbell. */
  for (rg_u32 c = block; c < a->nchunks; c += nblocks) {
    rg_u64 off = c * a->chunk, n = a->bytes - off < a->chunk ? a->bytes - off : a->chunk;
    rg_os_copy_out(send_slot + off, a->send + off, n);
    RG_OS_SYNC();
    if (RG_OS_LEADER) {
      RG_OS_FENCE_SYS();
      if (c == 0) {
        a->ctrl->report[parity].bytes = a->bytes;
        a->ctrl->report[parity].chunk = a->chunk;
      }
      RG_OS_STORE_RELEASE(&a->ctrl->ready[parity][c], seq);
      if (c == 0) a->dev->t_staged = RG_OS_NOW();
    }
  }

  /* Wait for the peer's chunks; with several, each goes to scratch as it arrives, so that
   * no row is written before all of them are here. */
  rg_u32 failed = RG_OS_OK;
  const rg_u64 deadline = RG_OS_NOW() + a->timeout_ns;
  for (rg_u32 c = block; c < a->nchunks && failed == RG_OS_OK; c += nblocks) {
    if (RG_OS_LEADER) verdict = rg_os_wait(a, rg_os_level(seq, c + 1), deadline);
    RG_OS_SYNC();
    failed = verdict;
    if (failed == RG_OS_OK && a->nchunks > 1) {
      rg_u64 off = c * a->chunk, n = a->bytes - off < a->chunk ? a->bytes - off : a->chunk;
      rg_os_copy_in(a->scratch + off, recv_slot + off, n);
    }
    RG_OS_SYNC();
  }

  /* The last block to finish writes the rows, or none if any block failed. */
  if (RG_OS_LEADER) {
    arrived_at = RG_OS_NOW();
    if (nblocks == 1) {
      last = 1;
    } else {
      if (failed != RG_OS_OK) RG_OS_FAIL(&a->dev->failed, failed);
      RG_OS_FENCE_GPU(); /* this block's scratch before its arrival */
      last = RG_OS_ARRIVE(&a->dev->arrived) == nblocks - 1;
      if (last) RG_OS_FENCE_GPU();
    }
  }
  RG_OS_SYNC();
  if (!last) return;
  const rg_u32 status = nblocks == 1 ? failed : *(volatile rg_u32*)&a->dev->failed;
  if (status == RG_OS_OK) {
    const rg_u32 peer = 1 - a->rank;
    unsigned char* peer_row = a->recv + peer * a->bytes;
    unsigned char* own_row = a->recv + a->rank * a->bytes;
    if (a->nchunks == 1)
      rg_os_copy_in(peer_row, recv_slot, a->bytes);
    else
      rg_os_copy_dev(peer_row, a->scratch, a->bytes);
    if (own_row != a->send) rg_os_copy_dev(own_row, a->send, a->bytes);
  }
  RG_OS_SYNC();
  if (RG_OS_LEADER) {
    rg_os_report* r = &a->ctrl->report[parity];
    if (status == RG_OS_OK) {
      a->dev->total_gathers += 1;
      a->dev->total_bytes += a->bytes;
    }
    r->total_gathers = a->dev->total_gathers;
    r->total_bytes = a->dev->total_bytes;
    r->status = status;
    r->t_start = a->dev->t_start;
    r->t_staged = a->dev->t_staged;
    r->t_arrived = arrived_at;
    r->t_end = RG_OS_NOW();
    a->dev->failed = 0;
    a->dev->arrived = 0;
    RG_OS_STORE_RELEASE(&r->seq, seq);
    *(volatile rg_u64*)&a->dev->seq = seq;
  }
}

#endif
