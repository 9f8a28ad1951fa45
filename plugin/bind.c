/* The interceptor's binding (bind.h): finds NCCL, resolves its pnccl* names from its own
 * handle, and makes callers' calls reach this library's wrappers, either because the
 * process's global scope already resolves them here (LD_PRELOAD) or by rebinding the
 * relocation slots of the loaded objects that import them (got.c). Objects opened later
 * are bound by a hook on dlopen and by the rescan at every NCCL init.
 *
 * Locks: the dynamic linker's lock (taken by dlopen, dlsym, dladdr, dlclose) is never
 * requested while `state_mu` is held, and none of those is called inside a walk of
 * dl_iterate_phdr, whose own lock is the one under which slots are written. */
#define _GNU_SOURCE
#include "bind.h"
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <link.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "../internal/nlog/nlog.h"
#include "got.h"
#include "intercept.h"

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

static void jstart(jline* j, const char* event) {
  j->n = 0;
  char pid[32];
  snprintf(pid, sizeof(pid), "{\"pid\":%d", (int)getpid());
  jraw(j, pid);
  jkey(j, "event");
  jstr(j, event);
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

static const char* const forwarded_names[] = {
    "pncclAllGather",        "pncclCommInitRank",     "pncclCommInitRankConfig", "pncclCommInitAll",
    "pncclCommSplit",        "pncclCommFinalize",     "pncclCommDestroy",        "pncclCommAbort",
    "pncclCommGetAsyncError", "pncclCommCount",       "pncclCommUserRank",       "pncclCommCuDevice",
    "pncclGroupStart",       "pncclGroupEnd",         "pncclGetVersion",         "pncclGetErrorString",
};
#define N_FORWARDED (sizeof(forwarded_names) / sizeof(forwarded_names[0]))
_Static_assert(N_FORWARDED * sizeof(void*) == offsetof(rg_nccl_api, path), "one name a field, in field order");

/* Written once, before g_api is published (the release store orders them). */
static rg_nccl_api g_api_store;
static uintptr_t g_nccl_public[RG_WRAP_N]; /* NCCL's own ncclX (its weak name), 0 if not its */
static uintptr_t g_nccl_base;
static _Atomic(const rg_nccl_api*) g_api;
static pthread_mutex_t publish_mu = PTHREAD_MUTEX_INITIALIZER;

enum way { WAY_PENDING, WAY_NO_NCCL, WAY_PREEMPTING, WAY_REBOUND, WAY_NONE, WAY_UNSUPPORTED, WAY_LOOKED_UP };
static const char* const way_names[] = {"pending", "no_nccl", "preempting", "rebound", "none", "unsupported", "looked_up"};
static atomic_int g_way;

/* Said once a process; and what was said of each object. Under state_mu. */
static pthread_mutex_t state_mu = PTHREAD_MUTEX_INITIALIZER;
static int said_no_nccl, said_preempting;
#if RG_GOT_REBINDS
static int said_none, said_no_dlopen_hook, said_no_dlsym_hook;
#else
static int said_unsupported;
#endif
static char** g_other_nccl; /* other NCCLs that loaded this library, said */
static size_t g_nother;

/* The thread is inside the binding's own work: a dlopen it causes is not scanned. */
static __thread int in_binding __attribute__((tls_model("initial-exec")));

const char* rg_bind_way_in(void) { return way_names[atomic_load(&g_way)]; }

static void set_way(enum way w) {
  int old = atomic_exchange(&g_way, (int)w);
  if (old == (int)w) return;
  jline j;
  jstart(&j, "way");
  jkey(&j, "way");
  jstr(&j, way_names[w]);
  jend(&j);
}

/* ---------------------------------------------------------------- finding NCCL */

static void* global_handle(void) {
  static void* h;
  void* g = __atomic_load_n(&h, __ATOMIC_ACQUIRE);
  if (g == NULL) {
    g = dlopen(NULL, RTLD_LAZY);
    __atomic_store_n(&h, g, __ATOMIC_RELEASE);
  }
  return g;
}

/* The link map that holds addr, or NULL. */
static struct link_map* map_of(const void* addr) {
  Dl_info info;
  struct link_map* lm = NULL;
  if (addr == NULL || dladdr1(addr, &info, (void**)&lm, RTLD_DL_LINKMAP) == 0) return NULL;
  return lm;
}

/* Opens the object loaded as name at base without loading anything: NULL if it is not
 * that object. The main program is the global handle. */
static void* pin(const char* name, uintptr_t base) {
  void* h = name[0] == '\0' ? dlopen(NULL, RTLD_LAZY) : dlopen(name, RTLD_NOLOAD | RTLD_LAZY);
  if (h == NULL) return NULL;
  struct link_map* lm = NULL;
  if (dlinfo(h, RTLD_DI_LINKMAP, &lm) != 0 || lm == NULL || lm->l_addr != base) {
    if (name[0] != '\0') dlclose(h);
    return NULL;
  }
  return h;
}

static void unpin(const char* name, void* h) {
  if (h != NULL && name[0] != '\0') dlclose(h);
}

/* Whether the object of lm defines pncclAllGather itself. */
static int defines_pnccl(struct link_map* lm) {
  void* h = pin(lm->l_name, lm->l_addr);
  if (h == NULL) return 0;
  void* f = dlsym(h, "pncclAllGather");
  int yes = f != NULL && map_of(f) == lm;
  unpin(lm->l_name, h);
  dlerror();
  return yes;
}

/* Takes the object at (name, base) as NCCL if it defines pncclAllGather itself. */
static int try_nccl(const char* name, uintptr_t base, const char* found_by) {
  if (name[0] == '\0') return 0;
  void* h = pin(name, base);
  if (h == NULL) return 0;
  struct link_map* self = NULL;
  dlinfo(h, RTLD_DI_LINKMAP, &self);
  void* ag = dlsym(h, "pncclAllGather");
  if (ag == NULL || map_of(ag) != self) {
    dlclose(h);
    return 0;
  }
  rg_nccl_api a;
  memset(&a, 0, sizeof(a));
  uintptr_t pub[RG_WRAP_N] = {0};
  for (size_t i = 0; i < N_FORWARDED; i++) {
    void* f = dlsym(h, forwarded_names[i]);
    if (f != NULL && map_of(f) == self) memcpy((char*)&a + i * sizeof(void*), &f, sizeof(f));
  }
  for (int w = 0; w < RG_WRAP_N; w++) {
    void* f = dlsym(h, rg_wrapped_names[w]);
    if (f != NULL && map_of(f) == self) pub[w] = (uintptr_t)f;
  }
  a.path = strdup(name);
  if (a.path == NULL) {
    dlclose(h);
    return 0;
  }
  if (a.GetVersion != NULL && a.GetVersion(&a.version) != ncclSuccess) a.version = 0;
  dlerror();
  int won = 0;
  pthread_mutex_lock(&publish_mu);
  if (atomic_load(&g_api) == NULL) {
    g_api_store = a;
    memcpy(g_nccl_public, pub, sizeof(pub));
    g_nccl_base = base;
    atomic_store_explicit(&g_api, &g_api_store, memory_order_release);
    won = 1;
  }
  pthread_mutex_unlock(&publish_mu);
  if (!won) {
    free((void*)a.path);
    dlclose(h); /* another thread published first */
    return 1;
  }
  /* The handle stays open: NCCL is never unloaded under the wrappers. */
  char missing[512] = "";
  size_t n = 0;
  jline j;
  jstart(&j, "nccl");
  jkey(&j, "path");
  jstr(&j, a.path);
  jint(&j, "version", a.version);
  jkey(&j, "found_by");
  jstr(&j, found_by);
  jkey(&j, "missing");
  jraw(&j, "[");
  for (size_t i = 0; i < N_FORWARDED; i++) {
    void* f;
    memcpy(&f, (const char*)&a + i * sizeof(void*), sizeof(f));
    if (f != NULL) continue;
    if (n < sizeof(missing))
      n += (size_t)snprintf(missing + n, sizeof(missing) - n, "%s%s", n ? ", " : "", forwarded_names[i]);
    if (j.buf[j.n - 1] != '[') jraw(&j, ",");
    jstr(&j, forwarded_names[i]);
  }
  jraw(&j, "]");
  jend(&j);
  RG_INFO(NCCL_INIT, LOG_PREFIX "NCCL is %s (version %d), %s%s%s", a.path, a.version, found_by,
          missing[0] ? "; it lacks " : "", missing);
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

static int keep_none(const rg_obj* o, void* arg) {
  (void)o, (void)arg;
  return 0;
}

/* The first loaded object that defines pncclAllGather itself, in load order. */
static void find_nccl_by_walk(void) {
  static _Atomic uintptr_t failed_at; /* loads_so_far() of the last walk that found none, +1 */
  uintptr_t adds = loads_so_far();
  if (atomic_load(&failed_at) == adds + 1) return;
  rg_objects t;
  if (rg_objects_collect(&t, NULL, 0, keep_none, NULL) == 0) {
    for (size_t i = 0; i < t.n && atomic_load(&g_api) == NULL; i++)
      if (t.obj[i].pnccl_def != 0 && try_nccl(t.obj[i].name, t.obj[i].base, "the first loaded object that defines pncclAllGather"))
        break;
  }
  rg_objects_free(&t);
  if (atomic_load(&g_api) == NULL) atomic_store(&failed_at, adds + 1);
}

/* ---------------------------------------------------------------- the way in */

static int preempting(void) {
  void* g = global_handle();
  void* f = g ? dlsym(g, "ncclAllGather") : NULL;
  dlerror();
  return f != NULL && f == rg_wrapper(RG_WRAP_AllGather);
}

#if RG_GOT_REBINDS

/* The frame both hooks keep around their C call: the caller's first two arguments saved,
 * the stack 16-byte aligned at the call; restored before they answer or jump on. */
#define HOOK_BEGIN(name)                                                                          \
  ".pushsection .text\n.p2align 4\n.globl " #name "\n.hidden " #name "\n.type " #name ", @function\n" #name \
  ":\n.cfi_startproc\n  endbr64\n  push %rdi\n.cfi_adjust_cfa_offset 8\n  push %rsi\n"                  \
  ".cfi_adjust_cfa_offset 8\n  sub $8, %rsp\n.cfi_adjust_cfa_offset 8\n"
#define HOOK_RESTORE                                                                          \
  "  add $8, %rsp\n.cfi_adjust_cfa_offset -8\n  pop %rsi\n.cfi_adjust_cfa_offset -8\n  pop %rdi\n" \
  ".cfi_adjust_cfa_offset -8\n"
#define HOOK_END(name) ".cfi_endproc\n.size " #name ", .-" #name "\n.popsection\n"

/* Forwarded to by the dlopen hook: the dlopen this library itself resolves to. */
__attribute__((visibility("hidden"), used)) void* (*rg_real_dlopen)(const char*, int);

__attribute__((visibility("hidden"))) void rg_dlopen_hook(void);
__attribute__((visibility("hidden"), used)) int rg_dlopen_caller_free(const char* file);
__attribute__((visibility("hidden"), used)) void* rg_dlopen_and_scan(const char* file, int mode);

/* The hook a rebound dlopen slot points to. dlopen takes its caller from its return
 * address: the search path of a bare name (the caller's RPATH and RUNPATH), $ORIGIN and
 * the namespace all depend on it. Only a name with a slash and no '$' is the same from
 * any caller: those go through rg_dlopen_and_scan, which opens and then binds what was
 * added. Every other call jumps to dlopen with the stack as the caller left it, so dlopen
 * sees the caller's own return address; what it adds is bound at the next NCCL init. */
__asm__(HOOK_BEGIN(rg_dlopen_hook)
        "  call rg_dlopen_caller_free\n"
        HOOK_RESTORE
        "  test %eax, %eax\n"
        "  jnz rg_dlopen_and_scan\n"
        "  jmp *rg_real_dlopen(%rip)\n"
        HOOK_END(rg_dlopen_hook));

/* Forwarded to by the dlsym hook: the dlsym this library itself resolves to. */
__attribute__((visibility("hidden"), used)) void* (*rg_real_dlsym)(void*, const char*);

__attribute__((visibility("hidden"))) void rg_dlsym_hook(void);
__attribute__((visibility("hidden"), used)) void* rg_dlsym_answer(void* handle, const char* name, const void* caller);

/* The hook a rebound dlsym slot points to. dlsym also takes its caller from its return
 * address (RTLD_NEXT searches the objects after the caller's), so the hook answers only
 * what rg_dlsym_answer returns (a wrapper, for a lookup of a wrapped name in NCCL's handle)
 * and jumps to dlsym with the stack as the caller left it for everything else. The
 * caller's return address goes to rg_dlsym_answer as its third argument. */
__asm__(HOOK_BEGIN(rg_dlsym_hook)
        "  mov 24(%rsp), %rdx\n" /* the caller's return address, above the three slots */
        "  call rg_dlsym_answer\n"
        HOOK_RESTORE
        "  test %rax, %rax\n"
        "  jz 1f\n"
        "  ret\n"
        "1:\n"
        "  jmp *rg_real_dlsym(%rip)\n"
        HOOK_END(rg_dlsym_hook));

int rg_dlopen_caller_free(const char* file) {
  return file != NULL && strchr(file, '/') != NULL && strchr(file, '$') == NULL;
}

/* Objects a dlopen hook may be installed in: not the loader, libc or libdl (they define
 * dlopen themselves or are its implementation), not this library. */
static int dlopen_hookable(const rg_obj* o) {
  const char* b = rg_base_name(o->name);
  if (o->dlopen_def != 0) return 0;
  return strncmp(b, "ld-linux", 8) != 0 && strncmp(b, "ld64.so", 7) != 0 && strncmp(b, "libc.so", 7) != 0 &&
         strncmp(b, "libdl.so", 8) != 0 && strncmp(b, "linux-vdso", 10) != 0;
}

/* Objects a dlsym hook may be installed in: those a dlopen hook may be, less the ones that
 * define dlsym and NCCL's own (whose lookups of its plugins stay untouched). */
static int dlsym_hookable(const rg_obj* o, int dlsym_name) {
  return dlopen_hookable(o) && o->defs[dlsym_name] == 0 && o->pnccl_def == 0;
}

/* ---------------------------------------------------------------- the scan */

/* The scan looks for the wrapped names, dlopen and dlsym (the hooks). */
#define SCAN_DLOPEN RG_WRAP_N
#define SCAN_DLSYM (RG_WRAP_N + 1)
#define N_SCAN (RG_WRAP_N + 2)
static const char* scan_name(int i) {
  return i < RG_WRAP_N ? rg_wrapped_names[i] : i == SCAN_DLOPEN ? "dlopen" : "dlsym";
}
static int is_hook(int name) { return name >= RG_WRAP_N; }

/* The scan names in mask: a "functions" array of j, and "a, b" in text. */
static void name_list(jline* j, unsigned mask, char* text, size_t size) {
  size_t n = 0;
  text[0] = '\0';
  jkey(j, "functions");
  jraw(j, "[");
  for (int name = 0; name < N_SCAN; name++) {
    if (!(mask & (1u << name))) continue;
    if (n < size) n += (size_t)snprintf(text + n, size - n, "%s%s", n ? ", " : "", scan_name(name));
    if (j->buf[j->n - 1] != '[') jraw(j, ",");
    jstr(j, scan_name(name));
  }
  jraw(j, "]");
}

/* Fields of rg_nccl_api by wrapped function. */
static const size_t wrapped_field[RG_WRAP_N] = {
    offsetof(rg_nccl_api, AllGather),      offsetof(rg_nccl_api, CommInitRank),
    offsetof(rg_nccl_api, CommInitRankConfig), offsetof(rg_nccl_api, CommInitAll),
    offsetof(rg_nccl_api, CommSplit),      offsetof(rg_nccl_api, CommFinalize),
    offsetof(rg_nccl_api, CommDestroy),    offsetof(rg_nccl_api, CommAbort),
    offsetof(rg_nccl_api, CommGetAsyncError), offsetof(rg_nccl_api, GroupStart),
    offsetof(rg_nccl_api, GroupEnd),
};

static void* api_field(const rg_nccl_api* a, size_t off) {
  void* f;
  memcpy(&f, (const char*)a + off, sizeof(f));
  return f;
}

typedef struct said_obj {
  char* path;
  unsigned bound;  /* bit per scan name: bound in this object, said */
  int left;        /* its left-alone line was said */
} said_obj;
static said_obj* g_said;
static size_t g_nsaid;
static said_obj* said_of(const char* path) {
  for (size_t i = 0; i < g_nsaid; i++)
    if (strcmp(g_said[i].path, path) == 0) return &g_said[i];
  said_obj* grown = realloc(g_said, (g_nsaid + 1) * sizeof(*g_said));
  if (grown == NULL) return NULL;
  g_said = grown;
  said_obj* s = &g_said[g_nsaid];
  s->path = strdup(path);
  if (s->path == NULL) return NULL;
  s->bound = 0;
  s->left = 0;
  g_nsaid++;
  return s;
}

/* An object's name for people: the main program's is read from /proc. */
static const char* display_name(const char* name, char* buf, size_t size) {
  if (name[0] != '\0') return name;
  ssize_t n = readlink("/proc/self/exe", buf, size - 1);
  if (n <= 0) return "(the main program)";
  buf[n] = '\0';
  return buf;
}

static uintptr_t self_base(void) {
  static uintptr_t base;
  static int known;
  if (!__atomic_load_n(&known, __ATOMIC_ACQUIRE)) {
    struct link_map* lm = map_of((const void*)rg_bind_way_in);
    base = lm ? lm->l_addr : 0;
    __atomic_store_n(&known, 1, __ATOMIC_RELEASE);
  }
  return base;
}

typedef struct keep_ctx {
  const uintptr_t* skip; /* bases of objects loaded before (the dlopen hook's scan) */
  size_t nskip;
  uintptr_t self;
} keep_ctx;

static int keep_for_scan(const rg_obj* o, void* arg) {
  const keep_ctx* k = arg;
  if (o->bad_dynamic || o->base == k->self) return 0;
  for (size_t i = 0; i < k->nskip; i++)
    if (k->skip[i] == o->base) return 0;
  return 1;
}

enum decision { D_NONE, D_BIND, D_ALREADY, D_LAZY, D_LEAVE };

typedef struct slot_plan {
  enum decision d;
  uintptr_t want[2]; /* the targets that may be replaced */
  uintptr_t wrapper;
  uintptr_t target; /* D_LEAVE: where it goes */
  const char* why;  /* D_LEAVE */
} slot_plan;

static void leave(slot_plan* p, const rg_objects* t, uintptr_t target) {
  const rg_obj* owner = target ? rg_objects_owner(t, target) : NULL;
  p->d = D_LEAVE;
  p->target = target;
  if (target == 0)
    p->why = "does not resolve in its scope";
  else if (owner != NULL && owner->pnccl_def != 0 && owner->base != g_nccl_base)
    p->why = "goes to another NCCL";
  else
    p->why = "goes to another definition";
}

/* Decides a slot from the target it holds or will resolve to. */
static void decide(slot_plan* p, const rg_objects* t, uintptr_t target) {
  if (target == p->wrapper)
    p->d = D_ALREADY;
  else if (target != 0 && (target == p->want[0] || target == p->want[1]))
    p->d = D_BIND;
  else
    leave(p, t, target);
}

/* Plans a slot from the value it holds: a lazy PLT slot still points into its own object
 * (not at a definition of its own), and its target is what the loader will resolve it to. */
static void plan_slot(slot_plan* p, const rg_objects* t, const rg_obj* o, const rg_slot* sl, uintptr_t value) {
  if (sl->jump_slot && value >= o->lo && value < o->hi && value != o->defs[sl->name] && value != p->wrapper)
    p->d = D_LAZY;
  else
    decide(p, t, value);
}

static void say_left(const rg_objects* t, const rg_obj* o, const slot_plan* plan) {
  char text[1024] = "";
  size_t n = 0;
  jline j;
  jstart(&j, "left");
  char buf[4096];
  const char* oname = display_name(o->name, buf, sizeof(buf));
  jkey(&j, "object");
  jstr(&j, oname);
  jkey(&j, "slots");
  jraw(&j, "[");
  int first = 1;
  for (size_t s = 0; s < o->nslots; s++) {
    const slot_plan* p = &plan[o->first_slot + s];
    if (p->d != D_LEAVE || is_hook(t->slot[o->first_slot + s].name)) continue;
    const char* fn = scan_name(t->slot[o->first_slot + s].name);
    const rg_obj* owner = p->target ? rg_objects_owner(t, p->target) : NULL;
    char obuf[4096];
    const char* where = owner ? display_name(owner->name, obuf, sizeof(obuf)) : "";
    if (n < sizeof(text))
      n += (size_t)snprintf(text + n, sizeof(text) - n, "%s%s %s%s%s%s", n ? "; " : "", fn, p->why,
                            where[0] ? " (" : "", where, where[0] ? ")" : "");
    if (!first) jraw(&j, ",");
    first = 0;
    jraw(&j, "{\"function\":");
    jstr(&j, fn);
    jkey(&j, "why");
    jstr(&j, p->why);
    jkey(&j, "target");
    jstr(&j, where);
    jraw(&j, "}");
  }
  jraw(&j, "]");
  if (first) return;
  jend(&j);
  RG_INFO(NCCL_INIT, LOG_PREFIX "left %s alone: %s", oname, text);
}

/* Binds the slots of every object not in skip, and says what it did. at: what started it.
 * hooks_only, or no NCCL yet: only the dlopen and dlsym hooks are installed. */
static void scan(const uintptr_t* skip, size_t nskip, const char* at, int hooks_only) {
  const rg_nccl_api* api = atomic_load_explicit(&g_api, memory_order_acquire);
  if (api == NULL) hooks_only = 1;
  keep_ctx k = {skip, nskip, self_base()};
  const char* names[N_SCAN];
  for (int i = 0; i < N_SCAN; i++) names[i] = scan_name(i);
  rg_objects t;
  if (rg_objects_collect(&t, names, N_SCAN, keep_for_scan, &k) != 0) {
    rg_objects_free(&t);
    RG_INFO(NCCL_INIT, LOG_PREFIX "out of memory reading the loaded objects: nothing rebound this time");
    return;
  }
  /* dlopen is hooked only where it goes to a real definition of it (an object's own). */
  uintptr_t real_dlopen = (uintptr_t)(void*)dlopen;
  const rg_obj* dl_owner = rg_objects_owner(&t, real_dlopen);
  int hook_dlopen = dl_owner != NULL && dl_owner->dlopen_def == real_dlopen;
  if (hook_dlopen) __atomic_store_n(&rg_real_dlopen, (void* (*)(const char*, int))(void*)real_dlopen, __ATOMIC_RELEASE);
  uintptr_t real_dlsym = (uintptr_t)(void*)dlsym;
  const rg_obj* ds_owner = rg_objects_owner(&t, real_dlsym);
  int hook_dlsym = ds_owner != NULL && ds_owner->defs[SCAN_DLSYM] == real_dlsym;
  if (hook_dlsym) __atomic_store_n(&rg_real_dlsym, (void* (*)(void*, const char*))(void*)real_dlsym, __ATOMIC_RELEASE);

  slot_plan* plan = calloc(t.nslots ? t.nslots : 1, sizeof(*plan));
  void** pins = calloc(t.n ? t.n : 1, sizeof(*pins));
  rg_write* writes = calloc(t.nslots ? t.nslots : 1, sizeof(*writes));
  if (plan == NULL || pins == NULL || writes == NULL) {
    free(plan), free(pins), free(writes);
    rg_objects_free(&t);
    return;
  }
  for (size_t i = 0; i < t.n; i++) {
    const rg_obj* o = &t.obj[i];
    int is_nccl = o->pnccl_def != 0;
    int recheck = 0;
    for (size_t s = o->first_slot; s < o->first_slot + o->nslots; s++) {
      const rg_slot* sl = &t.slot[s];
      slot_plan* p = &plan[s];
      if (sl->name == SCAN_DLOPEN) {
        if (!hook_dlopen || !dlopen_hookable(o)) continue;
        p->want[0] = real_dlopen;
        p->wrapper = (uintptr_t)(void*)rg_dlopen_hook;
      } else if (sl->name == SCAN_DLSYM) {
        if (!hook_dlsym || !dlsym_hookable(o, SCAN_DLSYM)) continue;
        p->want[0] = real_dlsym;
        p->wrapper = (uintptr_t)(void*)rg_dlsym_hook;
      } else {
        if (is_nccl || hooks_only) continue; /* a NCCL's calls to its own names stay its own */
        void* forward = api_field(api, wrapped_field[sl->name]);
        p->want[0] = g_nccl_public[sl->name];
        p->want[1] = (uintptr_t)forward;
        p->wrapper = (uintptr_t)rg_wrapper((enum rg_wrapped)sl->name);
        if (forward == NULL) {
          p->d = D_LEAVE;
          p->why = "has no pnccl name in NCCL to forward to";
          continue;
        }
      }
      plan_slot(p, &t, o, sl, sl->value);
      recheck |= p->d == D_LAZY || (p->d == D_LEAVE && !is_hook(sl->name));
    }
    if (!recheck) continue;
    /* Pinning takes the loader's lock, so an object another thread was still loading when
     * it was read is relocated by now: its slots are read again before anything is said. */
    pins[i] = pin(o->name, o->base);
    void* g = global_handle();
    for (size_t s = o->first_slot; s < o->first_slot + o->nslots; s++) {
      rg_slot* sl = &t.slot[s];
      slot_plan* p = &plan[s];
      /* (A slot left for want of a pnccl name, want[1] == 0, stays left.) */
      if (p->d != D_LAZY && (p->d != D_LEAVE || is_hook(sl->name) || p->want[1] == 0)) continue;
      if (pins[i] == NULL) {
        p->d = D_NONE; /* unloaded meanwhile, or not the object read */
        continue;
      }
      sl->value = __atomic_load_n((const uintptr_t*)sl->addr, __ATOMIC_ACQUIRE);
      plan_slot(p, &t, o, sl, sl->value);
      if (p->d != D_LAZY) continue;
      /* The loader resolves a lazy slot in the global scope first, then in the object's own. */
      const char* name = scan_name(sl->name);
      void* target = g ? dlsym(g, name) : NULL;
      if (target == NULL) target = dlsym(pins[i], name);
      decide(p, &t, (uintptr_t)target);
      /* The loader has not written it: it may hold the PLT address or, by now, the target. */
      if (p->d == D_BIND) p->want[0] = sl->value, p->want[1] = (uintptr_t)target;
    }
    dlerror();
  }
  size_t nw = 0;
  for (size_t s = 0; s < t.nslots; s++) {
    if (plan[s].d != D_BIND) continue;
    size_t obj = 0;
    while (!(s >= t.obj[obj].first_slot && s < t.obj[obj].first_slot + t.obj[obj].nslots)) obj++;
    writes[nw] = (rg_write){.obj = obj, .slot = s, .value = plan[s].wrapper};
    writes[nw].accept[0] = plan[s].want[0];
    writes[nw].accept[1] = plan[s].want[1];
    nw++;
  }
  rg_objects_write(&t, writes, nw);
  for (size_t i = 0; i < t.n; i++) unpin(t.obj[i].name, pins[i]);

  /* Say what changed. */
  int reached = 0;
  for (size_t s = 0; s < t.nslots; s++)
    if (t.slot[s].name == RG_WRAP_AllGather && plan[s].d == D_ALREADY) reached = 1;
  pthread_mutex_lock(&state_mu);
  for (size_t i = 0; i < t.n; i++) {
    const rg_obj* o = &t.obj[i];
    char names[512];
    jline j;
    jstart(&j, "bound");
    char buf[4096];
    const char* oname = display_name(o->name, buf, sizeof(buf));
    jkey(&j, "object");
    jstr(&j, oname);
    jkey(&j, "at");
    jstr(&j, at);
    unsigned mask = 0;
    for (size_t w = 0; w < nw; w++) {
      if (writes[w].obj != i) continue;
      int name = t.slot[writes[w].slot].name;
      if (writes[w].done == 1 || writes[w].done == 2) {
        if (name == RG_WRAP_AllGather) reached = 1;
        mask |= 1u << name;
      } else if (writes[w].done < 0) {
        RG_INFO(NCCL_INIT, LOG_PREFIX "could not rebind %s in %s: %s", scan_name(name), oname, strerror(writes[w].err));
      }
    }
    name_list(&j, mask, names, sizeof(names));
    int leaves = 0;
    for (size_t s = o->first_slot; s < o->first_slot + o->nslots; s++)
      leaves |= plan[s].d == D_LEAVE && !is_hook(t.slot[s].name);
    if (mask == 0 && !leaves) continue;
    said_obj* said = said_of(o->name[0] ? o->name : oname);
    if (mask != 0 && said != NULL && (mask & ~said->bound) != 0) {
      said->bound |= mask;
      jend(&j);
      /* The hooks alone change nothing a user sees until NCCL is there: the report has them. */
      if (!hooks_only) RG_INFO(NCCL_INIT, LOG_PREFIX "rebound %s: %s", oname, names);
    }
    if (leaves && said != NULL && !said->left) {
      said->left = 1;
      say_left(&t, o, plan);
    }
  }
  if (!hook_dlopen && !said_no_dlopen_hook) {
    said_no_dlopen_hook = 1;
    RG_INFO(NCCL_INIT, LOG_PREFIX "dlopen is not hooked (this library's dlopen is no object's own definition): "
                                  "objects opened later are bound at the next NCCL init");
  }
  if (!hook_dlsym && !said_no_dlsym_hook) {
    said_no_dlsym_hook = 1;
    RG_INFO(NCCL_INIT, LOG_PREFIX "dlsym is not hooked (this library's dlsym is no object's own definition): "
                                  "callers that look NCCL's functions up at run time are not reached");
  }
  if (hooks_only) {
    /* the way in is taken when NCCL is there */
  } else if (reached) {
    set_way(WAY_REBOUND);
  } else if (skip == NULL && atomic_load(&g_way) != WAY_REBOUND && atomic_load(&g_way) != WAY_LOOKED_UP) {
    set_way(WAY_NONE);
    if (!said_none) {
      said_none = 1;
      jline j;
      jstart(&j, "unreached");
      jkey(&j, "why");
      jstr(&j, "no loaded object calls ncclAllGather through a relocation that reaches NCCL");
      jend(&j);
      RG_INFO(NCCL_INIT,
              LOG_PREFIX "no loaded object calls ncclAllGather through a relocation that reaches %s; a caller that "
                         "looks it up with dlsym (as XLA does) is reached if it looked up ncclGroupStart here "
                         "first, and is said when it looks",
              api->path);
    }
  }
  pthread_mutex_unlock(&state_mu);
  free(plan), free(pins), free(writes);
  rg_objects_free(&t);
}

/* ---------------------------------------------------------------- objects opened later */

typedef struct snapshot {
  uintptr_t* base;
  size_t n, cap;
  uintptr_t adds;
  int oom;
} snapshot;

static int snap_one(struct dl_phdr_info* info, size_t size, void* arg) {
  snapshot* s = arg;
  if (s->n == 0 && size >= offsetof(struct dl_phdr_info, dlpi_subs)) s->adds = (uintptr_t)info->dlpi_adds;
  if (s->n == s->cap) {
    size_t cap = s->cap ? s->cap * 2 : 256;
    uintptr_t* b = realloc(s->base, cap * sizeof(*b));
    if (b == NULL) {
      s->oom = 1;
      return 1;
    }
    s->base = b, s->cap = cap;
  }
  s->base[s->n++] = info->dlpi_addr;
  return 0;
}

void* rg_dlopen_and_scan(const char* file, int mode) {
  void* (*real)(const char*, int) = __atomic_load_n(&rg_real_dlopen, __ATOMIC_ACQUIRE);
  if (in_binding || (mode & RTLD_NOLOAD)) return real(file, mode);
  /* Only what this call adds is scanned: those objects are relocated and initialised when
   * it returns, even when it runs inside another dlopen's constructors. */
  snapshot before = {0};
  dl_iterate_phdr(snap_one, &before);
  void* h = real(file, mode);
  int err = errno;
  if (h != NULL && !before.oom && loads_so_far() != before.adds) {
    in_binding = 1;
    /* Preempting, every relocation caller already reaches the wrappers: only the hooks go in. */
    int hooks_only = atomic_load(&g_way) == WAY_PREEMPTING || (atomic_load(&g_api) != NULL && preempting());
    scan(before.base, before.n, "dlopen", hooks_only);
    in_binding = 0;
    dlerror(); /* the caller's dlerror() reports its dlopen, which succeeded */
  }
  free(before.base);
  errno = err;
  return h;
}

/* ---------------------------------------------------------------- callers that look NCCL up */

/* A caller that looks NCCL's functions up with dlsym gets a wrapper for ncclAllGather only
 * if it took ncclGroupStart from the hook first: the one-shot agreement cannot run inside a
 * group, and only the wrappers can tell that a group is open. (A group end the wrappers miss
 * leaves the depth above 0, which keeps the path off: safe.) XLA resolves each function at
 * its first call, and its first ncclGroupStart comes after the communicator's creation that
 * loads the library. Callers are kept by object; under state_mu. */
typedef struct lookup_caller {
  const struct link_map* lm;
  uintptr_t base;
  unsigned answered; /* bit per wrapped function */
  int said;
} lookup_caller;
#define MAX_LOOKUP_CALLERS 64
static lookup_caller g_lookup[MAX_LOOKUP_CALLERS];
static size_t g_nlookup;

static lookup_caller* lookup_caller_of(const struct link_map* lm) {
  for (size_t i = 0; i < g_nlookup; i++)
    if (g_lookup[i].lm == lm && g_lookup[i].base == lm->l_addr) return &g_lookup[i];
  if (g_nlookup == MAX_LOOKUP_CALLERS) return NULL;
  lookup_caller* c = &g_lookup[g_nlookup++];
  *c = (lookup_caller){.lm = lm, .base = lm->l_addr};
  return c;
}

static int wrapped_index(const char* name) {
  for (int w = 0; w < RG_WRAP_N; w++)
    if (strcmp(name, rg_wrapped_names[w]) == 0) return w;
  return -1;
}

static void say_lookup(const char* oname, const lookup_caller* c, int answered) {
  char names[512];
  jline j;
  jstart(&j, "looked_up");
  jkey(&j, "object");
  jstr(&j, oname);
  jkey(&j, "answered");
  jraw(&j, answered ? "true" : "false");
  name_list(&j, c->answered, names, sizeof(names)); /* wrapped names are the first scan names */
  jend(&j);
  if (answered)
    RG_INFO(NCCL_INIT, LOG_PREFIX "%s looked up ncclAllGather with dlsym and got this library's (it took %s here)",
            oname, names);
  else
    RG_INFO(NCCL_INIT, LOG_PREFIX "%s looked up ncclAllGather with dlsym but took ncclGroupStart before this "
                       "library was loaded, or not yet (here: %s): the interceptor cannot see its groups, so its "
                       "gathers take NCCL's path; LD_PRELOAD=<this library> reaches it from the start",
            oname, names[0] ? names : "nothing");
}

/* One report line a lookup of a wrapped name: who looked it up and what the hook did. */
static void report_lookup(const char* oname, int w, const char* what) {
  jline j;
  jstart(&j, "lookup");
  jkey(&j, "object");
  jstr(&j, oname);
  jkey(&j, "function");
  jstr(&j, rg_wrapped_names[w]);
  jkey(&j, "outcome");
  jstr(&j, what);
  jend(&j);
}

/* The answer to a lookup of wrapped function w, given the target dlsym found. */
static void* answer_lookup(void* target, int w, const void* caller) {
  if (atomic_load(&g_api) == NULL) {
    struct link_map* owner = map_of(target);
    if (owner != NULL && owner->l_name[0] != '\0')
      try_nccl(owner->l_name, owner->l_addr, "the NCCL a caller looked up with dlsym");
  }
  struct link_map* from = map_of(caller);
  char buf[4096];
  const char* oname = from != NULL ? display_name(from->l_name, buf, sizeof(buf)) : "(no object)";
  const rg_nccl_api* api = atomic_load_explicit(&g_api, memory_order_acquire);
  if (api == NULL || (uintptr_t)target != g_nccl_public[w]) {
    report_lookup(oname, w, "forwarded: not the NCCL this library forwards to");
    return NULL;
  }
  if (api_field(api, wrapped_field[w]) == NULL) {
    report_lookup(oname, w, "forwarded: that NCCL has no pnccl name for it to forward to");
    return NULL; /* its wrapper could only refuse it, where NCCL's own works */
  }
  if (from == NULL) {
    report_lookup(oname, w, "forwarded: the caller is in no loaded object");
    return NULL;
  }
  void* answer = NULL;
  pthread_mutex_lock(&state_mu);
  lookup_caller* c = lookup_caller_of(from);
  if (c != NULL && (w != RG_WRAP_AllGather || (c->answered & (1u << RG_WRAP_GroupStart)))) {
    answer = rg_wrapper((enum rg_wrapped)w);
    c->answered |= 1u << w;
  }
  report_lookup(oname, w, answer != NULL ? "answered" : c == NULL ? "forwarded: too many callers" :
                                                   "forwarded: its ncclGroupStart was not answered first");
  if (c != NULL && w == RG_WRAP_AllGather && !c->said) {
    c->said = 1;
    say_lookup(oname, c, answer != NULL);
  }
  int way = atomic_load(&g_way);
  if (answer != NULL && w == RG_WRAP_AllGather && way != WAY_PREEMPTING && way != WAY_REBOUND) set_way(WAY_LOOKED_UP);
  pthread_mutex_unlock(&state_mu);
  return answer;
}

void* rg_dlsym_answer(void* handle, const char* name, const void* caller) {
  if (name == NULL || strncmp(name, "nccl", 4) != 0 || handle == RTLD_DEFAULT || handle == RTLD_NEXT) return NULL;
  int w = wrapped_index(name);
  if (w < 0) return NULL;
  if (in_binding) {
    report_lookup("(inside the binding)", w, "forwarded: made while the library was binding");
    return NULL;
  }
  int saved = errno;
  in_binding++;
  void* answer = NULL;
  void* target = dlsym(handle, name); /* this library's own dlsym: no hook */
  if (target != NULL) answer = answer_lookup(target, w, caller);
  dlerror(); /* what the caller's dlerror() reports is its own lookup's */
  in_binding--;
  errno = saved;
  return answer;
}

/* Whether LD_PRELOAD names this library (by path or by base name). */
static int preloaded(void) {
  const char* list = getenv("LD_PRELOAD");
  Dl_info self;
  if (list == NULL || dladdr((const void*)rg_bind_way_in, &self) == 0 || self.dli_fname == NULL) return 0;
  const char* base = rg_base_name(self.dli_fname);
  char item[4096];
  for (const char* p = list; *p;) {
    size_t n = strcspn(p, ": ");
    if (n > 0 && n < sizeof(item)) {
      memcpy(item, p, n);
      item[n] = '\0';
      if (strcmp(item, self.dli_fname) == 0 || strcmp(rg_base_name(item), base) == 0) return 1;
    }
    p += n;
    p += strspn(p, ": ");
  }
  return 0;
}

/* Preloaded with no NCCL loaded yet: the hooks go in now, so that the objects opened later are
 * followed from their start and their lookups of NCCL's functions are answered. */
__attribute__((constructor)) static void bind_at_load(void) {
  if (!preloaded()) return;
  int saved = errno;
  rg_objects t;
  int any_nccl = 0;
  if (rg_objects_collect(&t, NULL, 0, keep_none, NULL) == 0)
    for (size_t i = 0; i < t.n; i++) any_nccl |= t.obj[i].pnccl_def != 0;
  rg_objects_free(&t);
  in_binding++;
  if (!any_nccl) scan(NULL, 0, "load", 1);
  in_binding--;
  errno = saved;
}

#endif /* RG_GOT_REBINDS */

/* ---------------------------------------------------------------- entry points */

/* Finds NCCL (preferring the caller's object), then takes the way in. */
static const rg_nccl_api* bind_now(const void* caller, const char* at, int rescan) {
  int was_published = atomic_load(&g_api) != NULL;
  struct link_map* from = caller ? map_of(caller) : NULL;
  if (!was_published && from != NULL)
    try_nccl(from->l_name, from->l_addr, "the NCCL that loaded this library");
  if (atomic_load(&g_api) == NULL) find_nccl_by_walk();
  const rg_nccl_api* api = atomic_load_explicit(&g_api, memory_order_acquire);
  if (api == NULL) {
    pthread_mutex_lock(&state_mu);
    if (!said_no_nccl) {
      said_no_nccl = 1;
      jline j;
      jstart(&j, "no_nccl");
      jend(&j);
      RG_INFO(NCCL_INIT, LOG_PREFIX "no loaded object defines pncclAllGather (NCCL's own name for "
                                    "ncclAllGather): nothing to forward to, nothing bound");
    }
    if (atomic_load(&g_way) == WAY_PENDING) set_way(WAY_NO_NCCL);
    pthread_mutex_unlock(&state_mu);
    return NULL;
  }
  /* Another NCCL that loads this library keeps its own callers: say so once. */
  if (from != NULL && from->l_addr != g_nccl_base && defines_pnccl(from)) {
    pthread_mutex_lock(&state_mu);
    int said = 0;
    for (size_t i = 0; i < g_nother; i++) said |= strcmp(g_other_nccl[i], from->l_name) == 0;
    char** grown = said ? NULL : realloc(g_other_nccl, (g_nother + 1) * sizeof(char*));
    if (grown != NULL) {
      g_other_nccl = grown;
      g_other_nccl[g_nother] = strdup(from->l_name);
      if (g_other_nccl[g_nother] != NULL) g_nother++;
      jline j;
      jstart(&j, "left");
      jkey(&j, "object");
      jstr(&j, from->l_name);
      jkey(&j, "why");
      jstr(&j, "another NCCL loaded this library; the interceptor forwards to the first one");
      jend(&j);
      RG_INFO(NCCL_INIT, LOG_PREFIX "%s also loaded this library; the wrappers forward to %s, and the callers "
                                    "of %s are left alone",
              from->l_name, api->path, from->l_name);
    }
    pthread_mutex_unlock(&state_mu);
  }
  dlerror();
  if (preempting()) {
    pthread_mutex_lock(&state_mu);
    if (!said_preempting) {
      said_preempting = 1;
      RG_INFO(NCCL_INIT, LOG_PREFIX "preempting: the process's global scope resolves ncclAllGather to this "
                                    "library (LD_PRELOAD), so every caller that links NCCL reaches it; nothing "
                                    "to rebind");
    }
    set_way(WAY_PREEMPTING);
    pthread_mutex_unlock(&state_mu);
#if RG_GOT_REBINDS
    /* Callers that look NCCL up at run time are not preempted: they still need the hooks. */
    if (rescan || !was_published) {
      in_binding++;
      scan(NULL, 0, at, 1);
      in_binding--;
    }
#endif
    return api;
  }
#if RG_GOT_REBINDS
  if (rescan || !was_published) {
    in_binding++;
    scan(NULL, 0, at, 0);
    in_binding--;
  }
#else
  (void)at, (void)rescan;
  pthread_mutex_lock(&state_mu);
  if (!said_unsupported) {
    said_unsupported = 1;
    RG_INFO(NCCL_INIT, LOG_PREFIX "relocation rebinding is implemented for x86-64 Linux only: nothing rebound "
                                  "(LD_PRELOAD=libroce_gather.so still takes the calls)");
  }
  set_way(WAY_UNSUPPORTED);
  pthread_mutex_unlock(&state_mu);
#endif
  return api;
}

const rg_nccl_api* rg_nccl(void) {
  const rg_nccl_api* api = atomic_load_explicit(&g_api, memory_order_acquire);
  if (api != NULL) return api;
  int saved = errno;
  in_binding++;
  api = bind_now(NULL, "first call", 0);
  in_binding--;
  errno = saved;
  return api;
}

void rg_bind_from_nccl(const void* caller, ncclDebugLogger_t logger) {
  if (logger != NULL) rg_log_set_logger(logger);
  int saved = errno;
  in_binding++;
  bind_now(caller, "NCCL init", 1);
  in_binding--;
  errno = saved;
}

