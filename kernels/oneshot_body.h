/* One block's part of the intercepted one-shot call (oneshot.h has the layout). The kernel
 * (oneshot.cu) runs it in every block at once; the host stand-in
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
 *   RG_OS_LOAD_RELAXED(p)         a load of a 64-bit word others write, no ordering (nothing is read through it)
 *   RG_OS_STORE_RELEASE(p, v)     a store ordered after every earlier write of the block
 *   RG_OS_STORE_RELAXED(p, v)     a store of a 64-bit word others read, no ordering of its own (after RG_OS_FENCE_SYS: a release)
 *   RG_OS_NOW()                   nanoseconds of a clock that only goes forward
 *   RG_OS_RELAX()                 between two polls of a wait
 *   RG_OS_ARRIVE(p)               atomic add of 1 to a 32-bit counter in rg_os_dev, returning the old value
 *   RG_OS_FAIL(p, v)              atomic "keep the first nonzero" of a 32-bit word in rg_os_dev
 *   RG_OS_CAS64_ACQUIRE(p, old, new)  atomic compare-and-swap of a 64-bit word in rg_os_dev, returning the value it
 *                                 found; the thread's later loads and stores are ordered after it
 *   RG_OS_AND64_RELEASE(p, v)     atomic and of a 64-bit word in rg_os_dev with v, ordered after every earlier
 *                                 write of the thread; returns nothing, so the thread need not wait for it
 *   RG_OS_LAUNCH_ID(a)            this launch's id: nonzero, below 2^63, shared by its blocks, unique among launches
 *   rg_os_copy_out(dst, src, n)   the block copies n bytes to the host (staging)
 *   rg_os_copy_in(dst, src, n)    the block copies n bytes the peer wrote into host memory (volatile loads)
 *   rg_os_copy_dev(dst, src, n)   the block copies n bytes within device memory
 *   rg_os_reduce(dst, own, peer, n, rank, op, dtype)
 *                                 the block writes dst = op(x0, x1) element by element over n bytes
 *                                 (oneshot_reduce.h), x0 rank 0's operand: own where rank is 0, else
 *                                 peer (the peer's bytes: host memory the peer wrote, or device memory
 *                                 other blocks wrote); dst may be own */
#ifndef RG_KERNELS_ONESHOT_BODY_H
#define RG_KERNELS_ONESHOT_BODY_H

#include "oneshot.h"
#include "oneshot_reduce.h"

/* This launch's announcement of call seq. */
RG_OS_FN static void rg_os_my_call(const rg_os_args* a, rg_u64 seq, rg_os_announce* out) {
  out->seq = seq;
  out->bytes = a->bytes;
  out->chunk = a->chunk;
  out->nchunks = a->nchunks;
  out->coll = a->coll;
  out->call = a->call;
}

RG_OS_FN static void rg_os_store_announce(volatile rg_os_announce* dst, const rg_os_announce* v) {
  dst->seq = v->seq;
  dst->bytes = v->bytes;
  dst->chunk = v->chunk;
  dst->nchunks = v->nchunks;
  dst->coll = v->coll;
  dst->call = v->call;
}

/* Whether the peer's announcement of parity, which its lane 0 flag has just shown to be
 * whole, names this call; if not, it is kept for the report. Plain loads, not volatile ones:
 * the acquire load of that flag orders them after it, nothing rewrites the announcement until
 * this call is done, and the device may issue them at once instead of one round trip over
 * PCIe after another (the call waits on them). */
RG_OS_FN static int rg_os_peer_agrees(const rg_os_args* a, rg_u64 seq, rg_u32 parity) {
  rg_os_announce mine, peer = a->ctrl->announce[parity].a;
  rg_os_my_call(a, seq, &mine);
  if (rg_os_same_call(&mine, &peer)) return 1;
  rg_os_store_announce(&a->dev->peer_seen, &peer);
  return 0;
}

/* Waits until every lane's flag of parity shows chunks [0, n) of call seq; returns RG_OS_OK,
 * or why it stopped. The peer's announcement is checked at the first sight of lane 0's flag
 * at seq (*checked then holds), and a flag of a later sequence is never taken for this one.
 * The abort word, the gate, the peer's closing word and the clock are read one poll in 16:
 * each read of host memory is a round trip over PCIe, and the flags are what the wait is for. */
RG_OS_FN static rg_u32 rg_os_wait(const rg_os_args* a, rg_u64 seq, rg_u32 parity, rg_u64 n, rg_u64 deadline, int* checked) {
  for (rg_u32 polls = 0;; polls++) {
    rg_u32 seen = 0;
    for (rg_u32 l = 0; l < a->lanes; l++) {
      const rg_u64 level = RG_OS_LOAD_ACQUIRE(&a->ctrl->flag[parity][l].word);
      const rg_u64 s = rg_os_level_seq(level);
      if (s > seq) { /* the peer is two calls ahead: its sequence is not this rank's */
        rg_os_announce peer;
        rg_os_load_announce(&a->ctrl->announce[parity].a, &peer);
        peer.seq = s;
        rg_os_store_announce(&a->dev->peer_seen, &peer);
        return RG_OS_MISMATCH;
      }
      if (s != seq) continue;
      if (l == 0 && !*checked) {
        if (!rg_os_peer_agrees(a, seq, parity)) return RG_OS_MISMATCH;
        *checked = 1;
      }
      seen += rg_os_level_chunks(level) >= n;
    }
    if (seen == a->lanes) return RG_OS_OK; /* the peer's data is whole: an abort now changes nothing */
    if ((polls & 15) == 15) {
      /* All three loads issued before any is used: one round trip, not three. */
      const rg_u64 aborted = RG_OS_LOAD_RELAXED(&a->ctrl->abort.word);
      const rg_u64 gate = RG_OS_LOAD_RELAXED(&a->dev->gate);
      const rg_u64 closed = RG_OS_LOAD_RELAXED(&a->ctrl->closed.word);
      if (aborted != 0) return RG_OS_ABORTED;
      if (gate & RG_OS_GATE_POISON) return RG_OS_OVERLAP;
      if (closed != 0 && (closed >> RG_OS_CLOSED_SHIFT) < seq) return RG_OS_PEER_CLOSED;
      if (RG_OS_NOW() > deadline) return RG_OS_TIMED_OUT;
    }
    RG_OS_RELAX();
  }
}

/* Takes the engine for launch me, or finds it held by another launch: then this launch
 * fails, and the poison bit it sets fails the other one and every launch after. Its acquire
 * pairs with the release of the launch that let go of the gate last (rg_os_release): what
 * that launch wrote to rg_os_dev is seen after it. */
RG_OS_FN static int rg_os_claim(const rg_os_args* a, rg_u64 me) {
  rg_u64 g = 0;
  for (;;) {
    const rg_u64 owner = g & RG_OS_GATE_OWNER;
    if (owner == me) return 1; /* another block of this launch took it */
    if (owner != 0 && (g & RG_OS_GATE_POISON)) return 0;
    const rg_u64 found = RG_OS_CAS64_ACQUIRE(&a->dev->gate, g, owner == 0 ? g | me : g | RG_OS_GATE_POISON);
    if (found == g) return owner == 0;
    g = found;
  }
}

/* Lets go of the gate this launch holds, keeping a poison bit another launch set. */
RG_OS_FN static void rg_os_release(const rg_os_args* a) { RG_OS_AND64_RELEASE(&a->dev->gate, RG_OS_GATE_POISON); }

RG_OS_FN static void rg_os_store_failure(volatile rg_os_failure* dst, const rg_os_failure* v) {
  rg_os_store_announce(&dst->mine, &v->mine);
  rg_os_store_announce(&dst->peer, &v->peer);
  dst->status = v->status;
}

/* Runs block `block` of nblocks; returns the call's status in the block that finished it,
 * this block's own otherwise. */
RG_OS_FN static rg_u32 rg_os_block(const rg_os_args* a, rg_u32 block, rg_u32 nblocks) {
  RG_OS_SHARED rg_u32 verdict;
  RG_OS_SHARED rg_u32 owned;
  RG_OS_SHARED rg_u32 last;
  RG_OS_SHARED rg_u64 seq_shared;
  RG_OS_SHARED rg_u64 arrived_at;
  const rg_u64 me = RG_OS_LAUNCH_ID(a);
  rg_u64 aborted = 0;
  if (RG_OS_LEADER) {
    owned = (rg_u32)rg_os_claim(a, me);
    verdict = RG_OS_OK;
    if (!owned) {
      RG_OS_STORE_RELEASE(&a->ctrl->overlap.word, 1); /* the proxy fails the engine on both ranks */
    } else {
      /* Every load issued before any is used: their round trips overlap. The abort word's is
       * used after the staging's fence, which waits for it anyway. */
      aborted = RG_OS_LOAD_RELAXED(&a->ctrl->abort.word);
      const rg_u64 seq = *(volatile rg_u64*)&a->dev->seq + 1;
      const rg_u64 failed_before = *(volatile rg_u64*)&a->dev->failure.status;
      const rg_u64 gate = RG_OS_LOAD_RELAXED(&a->dev->gate);
      seq_shared = seq;
      RG_OS_STORE_RELAXED(&a->ctrl->running.word, seq);
      if (failed_before != RG_OS_OK)
        verdict = RG_OS_ABORTED; /* an earlier call failed: no later one runs */
      else if (gate & RG_OS_GATE_POISON)
        verdict = RG_OS_OVERLAP;
      if (block == 0) a->dev->t_start = RG_OS_NOW();
    }
  }
  RG_OS_SYNC();
  if (!owned) return RG_OS_OVERLAP; /* nothing of the engine is this launch's to touch */
  const rg_u64 seq = seq_shared;
  const rg_u32 parity = (rg_u32)(seq & 1);
  unsigned char* send_slot = a->send_slots + parity * a->slot_bytes;
  const unsigned char* recv_slot = a->recv_slots + parity * a->slot_bytes;
  rg_u32 failed = verdict;

  /* Stage each of this block's chunks and ring its doorbell; chunk 0's carries the announcement. */
  for (rg_u32 c = block; c < a->nchunks && failed == RG_OS_OK; c += nblocks) {
    rg_u64 off = c * a->chunk, n = a->bytes - off < a->chunk ? a->bytes - off : a->chunk;
    rg_os_copy_out(send_slot + off, a->send + off, n);
    if (RG_OS_LEADER && c == 0) { /* the proxy reads it only after the doorbell below */
      rg_os_announce mine;
      rg_os_my_call(a, seq, &mine);
      rg_os_store_announce(&a->ctrl->mine[parity].a, &mine);
    }
    RG_OS_SYNC();
    if (RG_OS_LEADER) {
      /* One fence for the block's chunk, the announcement and the abort word's load: their
       * round trips to host memory overlap. It orders the relaxed doorbell after them. */
      RG_OS_FENCE_SYS();
      if (aborted != 0) {
        verdict = RG_OS_ABORTED; /* a closing engine's queued calls ship nothing */
      } else {
        RG_OS_STORE_RELAXED(&a->ctrl->ready[parity][c], seq);
        if (c == 0) a->dev->t_staged = RG_OS_NOW();
      }
    }
    RG_OS_SYNC();
    failed = verdict;
  }

  /* Wait for the peer's chunks; with several, each goes to scratch as it arrives, so that
   * no output is written before all of them are here. */
  const rg_u64 deadline = RG_OS_NOW() + a->timeout_ns;
  int checked = 0;
  for (rg_u32 c = block; c < a->nchunks && failed == RG_OS_OK; c += nblocks) {
    if (RG_OS_LEADER) verdict = rg_os_wait(a, seq, parity, c + 1, deadline, &checked);
    RG_OS_SYNC();
    failed = verdict;
    if (failed == RG_OS_OK && a->nchunks > 1) {
      rg_u64 off = c * a->chunk, n = a->bytes - off < a->chunk ? a->bytes - off : a->chunk;
      rg_os_copy_in(a->scratch + off, recv_slot + off, n);
    }
    RG_OS_SYNC();
  }

  /* The last block to finish writes the output (a gather's rows, an all-reduce's combine), or
   * none if any block failed: a failed call leaves recv as it was (in place: the input). */
  if (RG_OS_LEADER) {
    arrived_at = RG_OS_NOW();
    if (nblocks == 1) {
      last = 1;
    } else {
      if (failed != RG_OS_OK) RG_OS_FAIL(&a->dev->failed, failed);
      RG_OS_FENCE_GPU(); /* this block's scratch and peer_seen before its arrival */
      last = RG_OS_ARRIVE(&a->dev->arrived) == nblocks - 1;
      if (last) RG_OS_FENCE_GPU();
    }
  }
  RG_OS_SYNC();
  if (!last) return failed;
  const rg_u32 status = nblocks == 1 ? failed : *(volatile rg_u32*)&a->dev->failed;
  const int allreduce = rg_os_coll_kind(a->coll) == RG_OS_ALLREDUCE;
  if (status == RG_OS_OK && allreduce) {
    /* The peer's operand is whole: in the receive slot (one chunk, after this block's acquire
     * of the flags) or in scratch, which every block wrote before its fence and arrival, and
     * this, the last block, reads after its own fence (as the gather's copy from scratch).
     * Rank 0's operand first on both ranks: the same bits. */
    rg_os_reduce(a->recv, a->send, a->nchunks == 1 ? recv_slot : a->scratch, a->bytes, a->rank, rg_os_coll_op(a->coll),
                 rg_os_coll_dtype(a->coll));
  } else if (status == RG_OS_OK) {
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
    rg_os_failure first;
    rg_os_load_failure(&a->dev->failure, &first);
    if (status == RG_OS_OK && allreduce) {
      a->dev->total_allreduces += 1;
      a->dev->total_allreduce_bytes += a->bytes;
    } else if (status == RG_OS_OK) {
      a->dev->total_gathers += 1;
      a->dev->total_bytes += a->bytes;
    } else if (first.status == RG_OS_OK) { /* this engine's first failed call: every report from now on names it */
      first.status = status;
      rg_os_my_call(a, seq, &first.mine);
      if (status == RG_OS_MISMATCH)
        rg_os_load_announce(&a->dev->peer_seen, &first.peer);
      else
        first.peer.seq = first.peer.bytes = first.peer.chunk = first.peer.nchunks = first.peer.coll = first.peer.call = 0;
      rg_os_store_failure(&a->dev->failure, &first);
    }
    rg_os_store_failure(&r->failure, &first);
    r->total_gathers = a->dev->total_gathers;
    r->total_bytes = a->dev->total_bytes;
    r->total_allreduces = a->dev->total_allreduces;
    r->total_allreduce_bytes = a->dev->total_allreduce_bytes;
    r->coll = a->coll;
    r->status = status;
    r->t_start = a->dev->t_start;
    r->t_staged = a->dev->t_staged;
    r->t_arrived = arrived_at;
    r->t_end = RG_OS_NOW();
    a->dev->failed = 0;
    a->dev->arrived = 0;
    RG_OS_STORE_RELEASE(&r->seq, seq);
    *(volatile rg_u64*)&a->dev->seq = seq;
    rg_os_release(a); /* a release: the sequence before the gate lets the next launch in */
  }
  return status;
}

#endif
