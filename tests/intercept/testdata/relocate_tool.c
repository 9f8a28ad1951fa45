/* The entry hook's relocators (plugin/relocate_x86.c, relocate_a64.c) as a filter, so that
 * the tests (relocate_test.go) drive them with byte sequences and check every answer. One
 * request a line on stdin, one answer a line on stdout:
 *
 *   x86 FROM TO NEED HEX        ok CONSUMED OUTHEX | refused WHY
 *   x86len HEX                  ok LEN | refused WHY
 *   x86prefix HEX               ok LEN
 *   x86store SITE N CX16        ok KIND (1 word8, 2 word16, 3 spin, 4 bytes)
 *   a64 FROM TO WORD            ok WORD... | refused WHY
 *   a64prefix WORD...           ok COUNT AUTH
 *   a64b FROM TO                ok WORD | refused
 *   a64stub AUTH WRAPPER        ok WORD...
 *   bti HEX                     ok 0|1
 *
 * Numbers are hex (FROM, TO, SITE, WORD, AUTH, WRAPPER) or decimal (NEED, N, CX16). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "../../../plugin/relocate.h"

static size_t unhex(const char* s, uint8_t* out, size_t cap) {
  size_t n = 0;
  while (*s && n < cap) {
    while (*s == ' ' || *s == ':') s++;
    if (!s[0] || !s[1]) break;
    char b[3] = {s[0], s[1], 0};
    out[n++] = (uint8_t)strtoul(b, NULL, 16);
    s += 2;
  }
  return n;
}

static void put_hex(const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; i++) printf("%02x", p[i]);
}

int main(void) {
  char line[8192];
  while (fgets(line, sizeof(line), stdin)) {
    line[strcspn(line, "\n")] = '\0';
    char op[16] = "";
    int at = 0;
    if (sscanf(line, "%15s %n", op, &at) < 1) continue;
    const char* rest = line + at;
    char why[256] = "";
    if (strcmp(op, "x86") == 0) {
      uint64_t from, to;
      size_t need;
      int k = 0;
      if (sscanf(rest, "%" SCNx64 " %" SCNx64 " %zu %n", &from, &to, &need, &k) < 3) goto bad;
      uint8_t code[256], out[256];
      size_t n = unhex(rest + k, code, sizeof(code)), consumed = 0, len = 0;
      if (rg_x86_relocate(code, n, from, need, to, out, sizeof(out), &consumed, &len, why, sizeof(why)) != 0) {
        printf("refused %s\n", why);
      } else {
        printf("ok %zu ", consumed);
        put_hex(out, len);
        printf("\n");
      }
    } else if (strcmp(op, "x86len") == 0) {
      uint8_t code[64];
      size_t n = unhex(rest, code, sizeof(code));
      int len = rg_x86_insn_length(code, n, why, sizeof(why));
      if (len < 0) printf("refused %s\n", why);
      else printf("ok %d\n", len);
    } else if (strcmp(op, "x86prefix") == 0) {
      uint8_t code[64];
      size_t n = unhex(rest, code, sizeof(code));
      printf("ok %zu\n", rg_x86_entry_prefix(code, n));
    } else if (strcmp(op, "x86store") == 0) {
      uint64_t site;
      size_t n;
      int cx16;
      if (sscanf(rest, "%" SCNx64 " %zu %d", &site, &n, &cx16) != 3) goto bad;
      printf("ok %d\n", (int)rg_x86_store_kind(site, n, cx16));
    } else if (strcmp(op, "a64") == 0) {
      uint64_t from, to;
      uint32_t word, out[16];
      if (sscanf(rest, "%" SCNx64 " %" SCNx64 " %" SCNx32, &from, &to, &word) != 3) goto bad;
      int n = rg_a64_relocate(word, from, to, out, 16, why, sizeof(why));
      if (n < 0) {
        printf("refused %s\n", why);
      } else {
        printf("ok");
        for (int i = 0; i < n; i++) printf(" %08" PRIx32, out[i]);
        printf("\n");
      }
    } else if (strcmp(op, "a64prefix") == 0) {
      uint32_t w[8], auth;
      size_t n = 0;
      int k = 0;
      const char* p = rest;
      while (n < 8 && sscanf(p, "%" SCNx32 "%n", &w[n], &k) == 1) n++, p += k;
      int c = rg_a64_entry_prefix(w, n, &auth);
      printf("ok %d %08" PRIx32 "\n", c, auth);
    } else if (strcmp(op, "a64b") == 0) {
      uint64_t from, to;
      uint32_t w;
      if (sscanf(rest, "%" SCNx64 " %" SCNx64, &from, &to) != 2) goto bad;
      if (rg_a64_b(from, to, &w) != 0) printf("refused\n");
      else printf("ok %08" PRIx32 "\n", w);
    } else if (strcmp(op, "a64stub") == 0) {
      uint32_t auth, out[8];
      uint64_t wrapper;
      if (sscanf(rest, "%" SCNx32 " %" SCNx64, &auth, &wrapper) != 2) goto bad;
      int n = rg_a64_stub(auth, wrapper, out);
      printf("ok");
      for (int i = 0; i < n; i++) printf(" %08" PRIx32, out[i]);
      printf("\n");
    } else if (strcmp(op, "bti") == 0) {
      uint8_t note[512];
      size_t n = unhex(rest, note, sizeof(note));
      printf("ok %d\n", rg_elf_note_has_bti(note, n));
    } else {
      goto bad;
    }
    fflush(stdout);
    continue;
  bad:
    printf("bad request: %s\n", line);
    fflush(stdout);
  }
  return 0;
}
