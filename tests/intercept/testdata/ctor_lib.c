/* Linked into a caller library (with caller.c -DCALLER_LIBRARY): its constructor opens the
 * library CTOR_DLOPEN names through caller_dlopen, a function of the executable, so that
 * the inner dlopen goes through the executable's (hooked) dlopen slot while the outer
 * dlopen, the one opening this library, is still running its constructors. */
#include <stdio.h>
#include <stdlib.h>

void* caller_dlopen(const char* path) __attribute__((weak));

__attribute__((constructor)) static void open_in_constructor(void) {
  const char* path = getenv("CTOR_DLOPEN");
  if (path == NULL || caller_dlopen == NULL) return;
  if (caller_dlopen(path) == NULL) fprintf(stderr, "ctor_lib: could not open %s\n", path);
}
