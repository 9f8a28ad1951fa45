/* What both of plugincheck's C programs (the ABI driver and the rank program) use. */
#ifndef RG_CHECK_UTIL_H
#define RG_CHECK_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* CLOCK_MONOTONIC in nanoseconds. */
uint64_t now_ns(void);
/* s as a JSON string (with quotes) in dst of n bytes, cut to fit; returns dst. */
const char* json_quote(char* dst, size_t n, const char* s);
/* Writes a JSON string (with quotes) to f. */
void json_string(FILE* f, const char* s);

#endif
