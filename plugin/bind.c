/* The interceptor's binding (bind.h): finds NCCL, resolves its functions from its own
 * handle, and hooks their entries (hook.c) so that every caller reaches this library's
 * wrappers, however it got NCCL's addresses; says what it did, and which callers are still
 * not reached.
 *
 * Locks: publish_mu is never requested while the dynamic linker's lock is held (nothing here
 * runs inside a dl_iterate_phdr walk or a constructor it did not start), and nothing calls
 * dlopen, dlsym, dladdr or dlclose while holding it. */
#define _GNU_SOURCE
#include "bind.h"
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <link.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "../internal/nlog/nlog.h"
#include "hook.h"
#include "intercept.h"
#include "objects.h"

#define LOG_PREFIX "interceptor: "

/* ---------------------------------------------------------------- the report */

/* Appends one JSON line to ROCE_GATHER_BIND_REPORT (%p: pid, %h: host name), if set. */
typedef struct jline {
  char buf[4096];
  size_t n;
} jline;

static void jraw(jline* j, const char* s) {
  for (; *s && j->n + 1 < sizeof(j->buf); s++) j->buf[j->n++] = *s;
}

static void jstr(jline* j, const char* s) {
  jraw(j, "\"");
  for (; *s && j->n + 8 < sizeof(j->buf); s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') {
      j->buf[j->n++] = '\\';
      j->buf[j->n++] = (char)c;
    } else if (c < 0x20) {
      j->n += (size_t)snprintf(j->buf + j->n, sizeof(j->buf) - j->n, "\\u%04x", c);
    } else {
      j->buf[j->n++] = (char)c;
    }
  }
  jraw(j, "\"");
}

static void jkey(jline* j, const char* key) {
  jraw(j, ",");
  jstr(j, key);
  jraw(j, ":");
}

/* Starts the line of event, with the string fields given as key, value, ..., NULL. */
static void jstart(jline* j, const char* event, ...) {
  j->n = 0;
  char pid[32];
  snprintf(pid, sizeof(pid), "{\"pid\":%d", (int)getpid());
  jraw(j, pid);
  jkey(j, "event");
  jstr(j, event);
  va_list ap;
  va_start(ap, event);
  for (const char* key; (key = va_arg(ap, const char*)) != NULL;) {
    jkey(j, key);
    jstr(j, va_arg(ap, const char*));
  }
  va_end(ap);
}

static void jint(jline* j, const char* key, long v) {
  char s[32];
  snprintf(s, sizeof(s), "%ld", v);
  jkey(j, key);
  jraw(j, s);
}

static int report_path(char* out, size_t size) {
  const char* p = getenv("ROCE_GATHER_BIND_REPORT");
  if (p == NULL || *p == '\0') return -1;
  char host[256] = "";
  gethostname(host, sizeof(host) - 1);
  size_t n = 0;
  for (; *p && n + 1 < size; p++) {
    if (p[0] == '%' && (p[1] == 'p' || p[1] == 'h')) {
      n += (size_t)snprintf(out + n, size - n, "%s", p[1] == 'h' ? host : "");
      if (p[1] == 'p') n += (size_t)snprintf(out + n, size - n, "%d", (int)getpid());
      if (n >= size) return -1;
      p++;
      continue;
    }
    out[n++] = *p;
  }
  out[n] = '\0';
  return 0;
}

static void jend(jline* j) {
  jraw(j, "}\n");
  char path[4096];
  if (report_path(path, sizeof(path)) != 0) return;
  int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    static atomic_int warned;
    if (atomic_exchange(&warned, 1) == 0)
      RG_WARN("ROCE_GATHER_BIND_REPORT=%s: cannot open %s (%s); the binding report is not written",
              getenv("ROCE_GATHER_BIND_REPORT"), path, strerror(errno));
    return;
  }
  /* One write a line: lines of processes sharing a file do not mix. */
  ssize_t w = write(fd, j->buf, j->n);
  (void)w;
  close(fd);
}

/* ---------------------------------------------------------------- state */

/* The functions of rg_nccl_api in field order, by NCCL's names for them (ncclX, pncclX); and
 * the wrapped ones' names as the hook looks them up, ncclX then pncclX. */
#define NAME(f) "nccl" #f,
#define PNAME(f) "pnccl" #f,
static const char* const api_names[] = {RG_WRAPPED(NAME) RG_API_OTHERS(NAME)};
static const char* const api_pnames[] = {RG_WRAPPED(PNAME) RG_API_OTHERS(PNAME)};
static const char* const hook_names[2 * RG_WRAP_N] = {RG_WRAPPED(NAME) RG_WRAPPED(PNAME)};
#define N_API (sizeof(api_names) / sizeof(api_names[0]))
_Static_assert(N_API * sizeof(void*) == offsetof(rg_nccl_api, path), "one name a field, in field order");

static void* api_field(const rg_nccl_api* a, size_t i) {
  void* f;
  memcpy(&f, (const char*)a + i * sizeof(void*), sizeof(f));
  return f;
}

static void set_api_field(rg_nccl_api* a, size_t i, uintptr_t f) { memcpy((char*)a + i * sizeof(void*), &f, sizeof(f)); }

/* Written once, before g_api is published (the release store orders them). */
static rg_nccl_api g_api_store;
static uintptr_t g_nccl_base;
static _Atomic(const rg_nccl_api*) g_api;
static pthread_mutex_t publish_mu = PTHREAD_MUTEX_INITIALIZER;

enum way { WAY_PENDING, WAY_NO_NCCL, WAY_HOOKED, WAY_PREEMPTING, WAY_REFUSED };
static const char* const way_names[] = {"pending", "no_nccl", "hooked", "preempting", "refused"};
static atomic_int g_way;

/* What was said once a process, and the objects named as not reached. Under state_mu. */
static pthread_mutex_t state_mu = PTHREAD_MUTEX_INITIALIZER;
static int said_no_nccl;
static char** g_said_unreached;
static size_t g_nsaid;

const char* rg_bind_way_in(void) { return way_names[atomic_load(&g_way)]; }

static void set_way(enum way w) {
  int old = atomic_exchange(&g_way, (int)w);
  if (old == (int)w) return;
  jline j;
  jstart(&j, "way", "way", way_names[w], NULL);
  jend(&j);
}

/* ---------------------------------------------------------------- finding NCCL */

/* The link map that holds addr, or NULL. */
static struct link_map* map_of(const void* addr) {
  Dl_info info;
  struct link_map* lm = NULL;
  if (addr == NULL || dladdr1(addr, &info, (void**)&lm, RTLD_DL_LINKMAP) == 0) return NULL;
  return lm;
}

/* Opens the object loaded as name at base without loading anything: NULL if it is not
 * that object. */
static void* pin(const char* name, uintptr_t base) {
  void* h = dlopen(name, RTLD_NOLOAD | RTLD_LAZY);
  if (h == NULL) return NULL;
  struct link_map* lm = NULL;
  if (dlinfo(h, RTLD_DI_LINKMAP, &lm) != 0 || lm == NULL || lm->l_addr != base) {
    dlclose(h);
    return NULL;
  }
  return h;
}

/* An object's name for people: the main program's is read from /proc. */
static const char* display_name(const char* name, char* buf, size_t size) {
  if (name[0] != '\0') return name;
  ssize_t n = readlink("/proc/self/exe", buf, size - 1);
  if (n <= 0) return "(the main program)";
  buf[n] = '\0';
  return buf;
}

/* Whether the process's global scope resolves ncclAllGather to this library (LD_PRELOAD).
 * Asked once, by the thread that publishes NCCL; the main program's handle is never closed. */
static int preempting(void) {
  void* g = dlopen(NULL, RTLD_LAZY);
  void* f = g ? dlsym(g, "ncclAllGather") : NULL;
  dlerror();
  return f != NULL && f == rg_wrapper(RG_WRAP_AllGather);
}

static void name_list(jline* j, const char* key, const char* const* names, size_t n, char* text, size_t size) {
  size_t k = 0;
  text[0] = '\0';
  jkey(j, key);
  jraw(j, "[");
  for (size_t i = 0; i < n; i++) {
    if (k < size) k += (size_t)snprintf(text + k, size - k, "%s%s", k ? ", " : "", names[i]);
    if (i) jraw(j, ",");
    jstr(j, names[i]);
  }
  jraw(j, "]");
}

/* Says what the hook did: hooked (every function) or refused (which, its bytes, why). */
static void say_hook(const rg_nccl_api* a, const char* at, const rg_hook_fn* fns, size_t nf,
                     const rg_hook_refusal* refusal, int preempts) {
  char text[1024];
  jline j;
  if (a->hooked) {
    const char* names[RG_WRAP_N];
    for (size_t k = 0; k < nf; k++) names[k] = fns[k].name;
    jstart(&j, "hooked", "at", at, NULL);
    name_list(&j, "functions", names, nf, text, sizeof(text));
    jend(&j);
    RG_INFO(NCCL_INIT, LOG_PREFIX "hooked the entries of %s's %s: every caller of that NCCL reaches this library, "
                                  "however it got the address",
            a->path, text);
    return;
  }
  const char* fn = refusal->fn < nf ? fns[refusal->fn].name : "";
  jstart(&j, "refused", "at", at, "function", fn, "bytes", refusal->bytes, "why", refusal->why, NULL);
  jend(&j);
  RG_INFO(NCCL_INIT,
          LOG_PREFIX "not hooking %s's entries, none is patched: %s%s%s%s%s: %s; callers that took NCCL's addresses "
                     "(dlsym, ctypes, function pointers) are not reached and their calls go to NCCL unchanged%s",
          a->path, fn[0] ? fn : "", fn[0] ? " " : "", refusal->bytes[0] ? "(first bytes " : "", refusal->bytes,
          refusal->bytes[0] ? ")" : "", refusal->why,
          preempts ? "; LD_PRELOAD still brings the calls of callers that link NCCL (relocations) to this library"
                   : "; nothing else brings calls to this library here: every call goes to NCCL unchanged");
}

/* Takes the object at (name, base) as NCCL if it defines pncclAllGather itself, and hooks
 * its entries before it is published. Returns 1 if it is NCCL (or one was published meanwhile). */
static int try_nccl(const char* name, uintptr_t base, const char* found_by, const char* at) {
  if (name[0] == '\0') return 0;
  void* h = pin(name, base);
  if (h == NULL) return 0;
  struct link_map* self = NULL;
  dlinfo(h, RTLD_DI_LINKMAP, &self);
  void* ag = dlsym(h, "pncclAllGather");
  if (ag == NULL || map_of(ag) != self) {
    dlclose(h);
    dlerror();
    return 0;
  }
  rg_nccl_api a;
  memset(&a, 0, sizeof(a));
  uintptr_t own[N_API] = {0}, strong[N_API] = {0};
  for (size_t i = 0; i < N_API; i++) {
    void* f = dlsym(h, api_pnames[i]);
    if (f != NULL && map_of(f) == self) strong[i] = (uintptr_t)f;
    f = dlsym(h, api_names[i]);
    if (f != NULL && map_of(f) == self) own[i] = (uintptr_t)f;
    set_api_field(&a, i, strong[i] ? strong[i] : own[i]);
  }
  dlerror();
  a.path = strdup(name);
  if (a.path == NULL) {
    dlclose(h);
    return 0;
  }
  if (a.GetVersion != NULL && a.GetVersion(&a.version) != ncclSuccess) a.version = 0;

  /* Each wrapped function's entry: NCCL's ncclX, which its callers call (pncclX shares it). */
  rg_objects t;
  int collected = rg_objects_collect(&t, hook_names, 2 * RG_WRAP_N) == 0;
  const rg_obj* o = NULL;
  for (size_t i = 0; collected && i < t.n && o == NULL; i++)
    if (t.obj[i].base == base && !t.obj[i].bad_dynamic && t.obj[i].pnccl_def == (uintptr_t)ag) o = &t.obj[i];
  rg_hook_fn fns[RG_WRAP_N];
  int fn_of[RG_WRAP_N];
  size_t nf = 0;
  for (int w = 0; w < RG_WRAP_N; w++) {
    const uintptr_t entry = own[w] ? own[w] : strong[w];
    if (entry == 0) continue;
    size_t size = 0;
    if (o != NULL && o->defs[w] == entry) size = o->sizes[w];
    else if (o != NULL && o->defs[RG_WRAP_N + w] == entry) size = o->sizes[RG_WRAP_N + w];
    fns[nf] = (rg_hook_fn){.name = rg_wrapped_names[w], .entry = entry, .size = size,
                           .wrapper = (uintptr_t)rg_wrapper((enum rg_wrapped)w)};
    fn_of[nf++] = w;
  }
  rg_hook_refusal refusal;
  memset(&refusal, 0, sizeof(refusal));
  int won = 0;
  pthread_mutex_lock(&publish_mu);
  if (atomic_load(&g_api) == NULL) {
    if (o == NULL) {
      refusal.fn = SIZE_MAX;
      snprintf(refusal.why, sizeof(refusal.why), "its segments could not be read");
    } else if (rg_hook_install(o, fns, nf, &refusal) == 0) {
      /* The wrappers call NCCL's original code through the trampolines from the start. */
      for (size_t k = 0; k < nf; k++) set_api_field(&a, (size_t)fn_of[k], fns[k].trampoline);
      a.hooked = 1;
    }
    g_api_store = a;
    g_nccl_base = base;
    atomic_store_explicit(&g_api, &g_api_store, memory_order_release);
    won = 1;
  }
  pthread_mutex_unlock(&publish_mu);
  rg_objects_free(&t);
  if (!won) {
    free((void*)a.path);
    dlclose(h); /* another thread published first */
    return 1;
  }
  /* The handle stays open: NCCL is never unloaded under the wrappers. */
  const char* missing[N_API];
  size_t nmissing = 0;
  for (size_t i = 0; i < N_API; i++)
    if (api_field(&a, i) == NULL) missing[nmissing++] = api_names[i];
  char text[512];
  jline j;
  jstart(&j, "nccl", "path", a.path, "found_by", found_by, NULL);
  jint(&j, "version", a.version);
  name_list(&j, "missing", missing, nmissing, text, sizeof(text));
  jend(&j);
  RG_INFO(NCCL_INIT, LOG_PREFIX "NCCL is %s (version %d), %s%s%s", a.path, a.version, found_by,
          nmissing ? "; it has no " : "", text);
  const int preempts = !a.hooked && preempting();
  pthread_mutex_lock(&state_mu);
  say_hook(&a, at, fns, nf, &refusal, preempts);
  set_way(a.hooked ? WAY_HOOKED : preempts ? WAY_PREEMPTING : WAY_REFUSED);
  pthread_mutex_unlock(&state_mu);
  return 1;
}

static int read_adds(struct dl_phdr_info* info, size_t size, void* arg) {
  if (size >= offsetof(struct dl_phdr_info, dlpi_subs)) *(uintptr_t*)arg = (uintptr_t)info->dlpi_adds;
  return 1;
}

/* How many objects the process has loaded so far (glibc's dlpi_adds). */
static uintptr_t loads_so_far(void) {
  uintptr_t adds = 0;
  dl_iterate_phdr(read_adds, &adds);
  return adds;
}

/* The first loaded object that defines pncclAllGather itself, in load order. */
static void find_nccl_by_walk(const char* at) {
  static _Atomic uintptr_t failed_at; /* loads_so_far() of the last walk that found none, +1 */
  uintptr_t adds = loads_so_far();
  if (atomic_load(&failed_at) == adds + 1) return;
  rg_objects t;
  if (rg_objects_collect(&t, NULL, 0) == 0) {
    for (size_t i = 0; i < t.n && atomic_load(&g_api) == NULL; i++)
      if (t.obj[i].pnccl_def != 0 &&
          try_nccl(t.obj[i].name, t.obj[i].base, "the first loaded object that defines pncclAllGather", at))
        break;
  }
  rg_objects_free(&t);
  if (atomic_load(&g_api) == NULL) atomic_store(&failed_at, adds + 1);
}

/* ---------------------------------------------------------------- callers not reached */

/* Says once an object that its callers are not reached, and why. Under state_mu. */
static void say_unreached(const char* object, const char* why) {
  for (size_t i = 0; i < g_nsaid; i++)
    if (strcmp(g_said_unreached[i], object) == 0) return;
  char** grown = realloc(g_said_unreached, (g_nsaid + 1) * sizeof(char*));
  if (grown == NULL) return;
  g_said_unreached = grown;
  if ((g_said_unreached[g_nsaid] = strdup(object)) == NULL) return;
  g_nsaid++;
  jline j;
  jstart(&j, "unreached", "object", object, "why", why, NULL);
  jend(&j);
  RG_INFO(NCCL_INIT, LOG_PREFIX "%s: %s; its callers are not reached and their calls go to it unchanged", object, why);
}

/* Names the objects whose NCCL calls the wrappers cannot reach: another NCCL copy, and the
 * object that holds the NCCL that loaded this library when it does not export its API. */
static void find_unreached(const struct link_map* from) {
  rg_objects t;
  if (rg_objects_collect(&t, NULL, 0) != 0) {
    rg_objects_free(&t);
    return;
  }
  pthread_mutex_lock(&state_mu);
  for (size_t i = 0; i < t.n; i++) {
    const rg_obj* o = &t.obj[i];
    char buf[4096];
    const char* oname = display_name(o->name, buf, sizeof(buf));
    if (o->pnccl_def != 0 && o->base != g_nccl_base)
      say_unreached(oname, "another NCCL (it defines pncclAllGather), not the one this library hooks");
    else if (from != NULL && o->base == from->l_addr && o->pnccl_def == 0 && o->base != g_nccl_base)
      say_unreached(oname, "the NCCL that loaded this library lives inside it without exporting pncclAllGather "
                           "(NCCL linked statically)");
  }
  pthread_mutex_unlock(&state_mu);
  rg_objects_free(&t);
}

/* ---------------------------------------------------------------- entry points */

/* Finds NCCL (preferring the caller's object) and hooks it; errno is as it found it. */
static const rg_nccl_api* bind_now(const void* caller, const char* at) {
  const int saved = errno;
  struct link_map* from = caller ? map_of(caller) : NULL;
  if (atomic_load(&g_api) == NULL && from != NULL)
    try_nccl(from->l_name, from->l_addr, "the NCCL that loaded this library", at);
  if (atomic_load(&g_api) == NULL) find_nccl_by_walk(at);
  const rg_nccl_api* api = atomic_load_explicit(&g_api, memory_order_acquire);
  if (api == NULL) {
    pthread_mutex_lock(&state_mu);
    if (!said_no_nccl) {
      said_no_nccl = 1;
      jline j;
      jstart(&j, "no_nccl", NULL);
      jend(&j);
      RG_INFO(NCCL_INIT, LOG_PREFIX "no loaded object defines pncclAllGather (NCCL's own name for "
                                    "ncclAllGather): nothing to forward to, nothing hooked");
    }
    if (atomic_load(&g_way) == WAY_PENDING) set_way(WAY_NO_NCCL);
    pthread_mutex_unlock(&state_mu);
  } else {
    find_unreached(from);
  }
  dlerror();
  errno = saved;
  return api;
}

const rg_nccl_api* rg_nccl(void) {
  const rg_nccl_api* api = atomic_load_explicit(&g_api, memory_order_acquire);
  return api != NULL ? api : bind_now(NULL, "first call");
}

void rg_bind_from_nccl(const void* caller, ncclDebugLogger_t logger) {
  if (logger != NULL) rg_log_set_logger(logger);
  bind_now(caller, "NCCL init");
}

/* ---------------------------------------------------------------- preloaded */

/* This library's own path, as the loader opened it. */
static const char* self_path(void) {
  Dl_info self;
  return dladdr((const void*)rg_bind_way_in, &self) != 0 && self.dli_fname != NULL ? self.dli_fname : NULL;
}

/* Whether LD_PRELOAD names this library (by path or by base name). */
static int preloaded(void) {
  const char* list = getenv("LD_PRELOAD");
  const char* me = self_path();
  if (list == NULL || me == NULL) return 0;
  const char* base = rg_base_name(me);
  char item[4096];
  for (const char* p = list; *p;) {
    size_t n = strcspn(p, ": ");
    if (n > 0 && n < sizeof(item)) {
      memcpy(item, p, n);
      item[n] = '\0';
      if (strcmp(item, me) == 0 || strcmp(rg_base_name(item), base) == 0) return 1;
    }
    p += n;
    p += strspn(p, ": ");
  }
  return 0;
}

/* Whether dlopen(name) finds this very library, loaded already (a bare name is searched as
 * NCCL searches it; the loader matches the file, not the name). */
static int opens_this_library(const char* name) {
  const struct link_map* me = map_of((const void*)rg_bind_way_in);
  void* h = me != NULL ? pin(name, me->l_addr) : NULL;
  if (h != NULL) dlclose(h);
  dlerror();
  return h != NULL;
}

/* NCCL_NET_PLUGIN as NCCL reads it names this library: the value, or libnccl-net-VALUE.so. */
static int names_this_library(const char* value) {
  char alt[PATH_MAX];
  snprintf(alt, sizeof(alt), "libnccl-net-%s.so", value);
  return opens_this_library(value) || (strchr(value, '/') == NULL && opens_this_library(alt));
}

/* Preloaded: with NCCL_NET_PLUGIN unset, NCCL is told to initialise this library at its first
 * communicator, so that the hook goes in then even when no caller reaches an export first (a
 * process that looks NCCL up with dlsym only). */
static void name_net_plugin(void) {
  const char* me = self_path();
  const char* cur = getenv("NCCL_NET_PLUGIN");
  char real[PATH_MAX];
  if (me == NULL) return;
  if (realpath(me, real) != NULL) me = real; /* absolute: NCCL opens it later, from any directory */
  if (cur == NULL || cur[0] == '\0') {
    if (setenv("NCCL_NET_PLUGIN", me, 1) == 0)
      RG_INFO(NCCL_INIT, LOG_PREFIX "LD_PRELOAD names this library and NCCL_NET_PLUGIN is unset: set "
                                    "NCCL_NET_PLUGIN=%s, so that NCCL initialises it at its first communicator",
              me);
    return;
  }
  if (!names_this_library(cur))
    RG_INFO(NCCL_INIT, LOG_PREFIX "NCCL_NET_PLUGIN=%s names another file than this preloaded library (%s): left as "
                                  "it is, and NCCL is hooked at the first call that reaches this library",
            cur, me);
}

/* Preloaded: NCCL_NET_PLUGIN named, and NCCL hooked now if it is loaded already (a program
 * linked with it). */
__attribute__((constructor)) static void bind_at_load(void) {
  if (!preloaded()) return;
  int saved = errno;
  name_net_plugin();
  rg_objects t;
  int any_nccl = 0;
  if (rg_objects_collect(&t, NULL, 0) == 0)
    for (size_t i = 0; i < t.n; i++) any_nccl |= t.obj[i].pnccl_def != 0;
  rg_objects_free(&t);
  if (any_nccl) bind_now(NULL, "load");
  errno = saved;
}
