/* Registered regions of the tcp fabric: the only memory a peer's write may land in. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "region.h"

rg_tcp_dev* rg_tcp_dev_new(uint64_t timeout_ns) {
  rg_tcp_dev* dev = calloc(1, sizeof(*dev));
  if (dev == NULL) return NULL;
  pthread_mutex_init(&dev->mu, NULL);
  dev->timeout_ns = timeout_ns;
  return dev;
}

void rg_tcp_dev_free(rg_tcp_dev* dev) {
  if (dev == NULL) return;
  for (uint32_t i = 0; i < dev->nslots; i++) free(dev->slots[i]);
  free(dev->slots);
  pthread_mutex_destroy(&dev->mu);
  free(dev);
}

static int find_free_slot(rg_tcp_dev* dev) {
  for (uint32_t i = 0; i < dev->nslots; i++)
    if (dev->slots[i] == NULL) return (int)i;
  uint32_t limit = 1u << RG_TCP_KEY_SLOT_BITS;
  if (dev->nslots >= limit) return -1;
  uint32_t grown = dev->nslots ? dev->nslots * 2 : 64;
  if (grown > limit) grown = limit;
  rg_tcp_region** s = realloc(dev->slots, grown * sizeof(*s));
  if (s == NULL) return -1;
  memset(s + dev->nslots, 0, (grown - dev->nslots) * sizeof(*s));
  int first = (int)dev->nslots;
  dev->slots = s;
  dev->nslots = grown;
  return first;
}

uint32_t rg_tcp_register(rg_tcp_dev* dev, uint64_t addr, uint64_t len, char* err, int errlen) {
  rg_tcp_region* reg = calloc(1, sizeof(*reg));
  if (reg == NULL) {
    snprintf(err, errlen, "out of memory");
    return 0;
  }
  reg->addr = addr;
  reg->len = len;
  pthread_mutex_lock(&dev->mu);
  int slot = find_free_slot(dev);
  if (slot < 0) {
    pthread_mutex_unlock(&dev->mu);
    free(reg);
    snprintf(err, errlen, "too many registered regions (limit %u)", 1u << RG_TCP_KEY_SLOT_BITS);
    return 0;
  }
  /* The generation makes a stale key (from a deregistered region) miss. */
  if (++dev->generation == (1u << (32 - RG_TCP_KEY_SLOT_BITS))) dev->generation = 1;
  reg->key = (dev->generation << RG_TCP_KEY_SLOT_BITS) | (uint32_t)slot;
  dev->slots[slot] = reg;
  pthread_mutex_unlock(&dev->mu);
  return reg->key;
}

int rg_tcp_deregister(rg_tcp_dev* dev, uint32_t key, char* err, int errlen) {
  uint32_t slot = key & RG_TCP_KEY_SLOT_MASK;
  pthread_mutex_lock(&dev->mu);
  rg_tcp_region* reg = slot < dev->nslots ? dev->slots[slot] : NULL;
  if (reg == NULL || reg->key != key) {
    pthread_mutex_unlock(&dev->mu);
    snprintf(err, errlen, "no region is registered under key 0x%x", key);
    return -1;
  }
  dev->slots[slot] = NULL;
  pthread_mutex_unlock(&dev->mu);
  /* A lane may still be placing bytes into it; wait for that to finish. One
   * stalled mid-write keeps it until its lane's own timeout ends the lane, so wait longer. */
  uint64_t start = rg_now_ns(), limit = 2 * dev->timeout_ns + 1000000000ull;
  while (atomic_load(&reg->refs) > 0) {
    if (rg_now_ns() - start > limit) {
      snprintf(err, errlen, "region 0x%llx+%llu still receiving a write after %llu ms; left in place",
               (unsigned long long)reg->addr, (unsigned long long)reg->len, (unsigned long long)(limit / 1000000));
      return -1;
    }
    struct timespec ts = {0, 100000};
    nanosleep(&ts, NULL);
  }
  free(reg);
  return 0;
}

rg_tcp_region* rg_tcp_region_acquire(rg_tcp_dev* dev, uint32_t key, uint64_t addr, uint64_t len, int* why) {
  uint32_t slot = key & RG_TCP_KEY_SLOT_MASK;
  pthread_mutex_lock(&dev->mu);
  rg_tcp_region* reg = slot < dev->nslots ? dev->slots[slot] : NULL;
  if (reg == NULL || reg->key != key) {
    pthread_mutex_unlock(&dev->mu);
    *why = RG_TCP_BAD_KEY;
    return NULL;
  }
  if (addr < reg->addr || len > reg->len || addr - reg->addr > reg->len - len) {
    pthread_mutex_unlock(&dev->mu);
    *why = RG_TCP_OUT_OF_BOUNDS;
    return NULL;
  }
  atomic_fetch_add(&reg->refs, 1);
  pthread_mutex_unlock(&dev->mu);
  return reg;
}

void rg_tcp_region_release(rg_tcp_region* reg) { atomic_fetch_sub(&reg->refs, 1); }
