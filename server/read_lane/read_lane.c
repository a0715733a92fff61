/* The read lane's native core: a directory of the blocks readable in DRAM, the lane's sessions,
 * instances and leases, and one thread that serves prefix queries and releases on a Unix socket
 * without ever taking the Python interpreter lock.
 *
 * Why native: a lookup served by the engine runs ~100 us of Python behind the one interpreter lock
 * that the save path, the GPU copies' bookkeeping and the metrics share; under their load its p50
 * tripled and its p99 grew 4-5x (bench/README.md, "Tail latency"). Here a query is a few hash
 * lookups and pin increments under this module's own mutex (a few microseconds), on a thread that
 * no Python work can stall.
 *
 * Who owns what. The engine (Python) stays the authority for every block: this directory mirrors
 * the set of blocks that are sealed, readable in DRAM and not corrupt (`publish` / `unpublish` /
 * `retire`, called by the block store at exactly those transitions, under the engine lock). What
 * this side owns is its leases' pins: a block it pinned cannot be unpublished (`unpublish` says
 * no and the store keeps it), so the store never frees a slot a lane lease still reads. A block
 * that must go while pinned (corrupt) is retired: hidden from queries at once, freed, and reported
 * to the Python side, when its last lane lease lets go. A session's lease quota is one count over
 * both lanes: the engine's leases charge it here too (`charge`).
 *
 * What a served call leaves for Python: its counts (`take_counts`, exact) and its signals - the
 * hashes it looked up and hit, for the eviction policy's recency, the lookup sketches and the SSD
 * placement; a release's bytes and age - appended to a buffer that a Python thread drains
 * (`drain`, woken through `signal_fd`). Signals are best effort: when the buffer is full they are
 * dropped and counted, never waited for (Caffeine's read buffers make the same trade).
 *
 * Anything this side cannot answer exactly as the engine would (an unknown session or instance, a
 * chain that continues beyond DRAM when the server has an SSD tier or peers, unusual arguments)
 * is answered NOT_EXECUTED: nothing was done, and the client sends the call to the engine.
 *
 * The wire format is common/wire/read_lane.py's (that docstring is the definition; this reader and
 * writer follow it field for field). Concurrency: one mutex guards everything below; Python calls
 * take it while holding the interpreter lock (short calls), the serving thread takes it per
 * request and never touches Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_KEY 64
#define MAX_ID 64
#define NO_ID 0u
#define CHUNK_ENTRIES 4096u

/* gRPC status numbers (common/wire/status.py). */
enum { ST_OK = 0, ST_INVALID_ARGUMENT = 3, ST_DEADLINE_EXCEEDED = 4, ST_NOT_FOUND = 5,
       ST_FAILED_PRECONDITION = 9, ST_RESOURCE_EXHAUSTED = 8 };
enum { OP_QUERY = 1, OP_RELEASE = 2 };
enum { FLAG_LEASE = 1, FLAG_PURPOSE_LOAD = 2, FLAG_NOT_EXECUTED = 1 };
enum { E_FREE = 0, E_LIVE = 1, E_DEAD = 2 };
enum { SIG_QUERY = 1, SIG_RELEASE = 2, SIG_DEAD_RELEASED = 3, SIG_CALL = 4 };
/* Counters handed to Python by take_counts, in this order. */
enum { C_LOOKUP_QUERIES, C_DRAM_HITS, C_MISSES, C_LOAD_QUERIES, C_LOAD_MISSED, C_LEASES, C_RELEASES,
       C_LOADED_BYTES, C_NOT_EXECUTED, C_SIGNALS_DROPPED, C_EXPIRED, C_COUNT };

static const uint8_t MAGIC[4] = {'P', 'G', 'R', '1'};

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline uint64_t mix64(uint64_t h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

static uint64_t hash_bytes(uint64_t seed, const uint8_t *p, size_t n) {
    uint64_t h = mix64(seed ^ ((uint64_t)n * 0x9e3779b97f4a7c15ULL));
    while (n >= 8) {
        uint64_t k;
        memcpy(&k, p, 8);
        h = mix64(h ^ k) + 0x9e3779b97f4a7c15ULL;
        p += 8;
        n -= 8;
    }
    uint64_t k = 0;
    memcpy(&k, p, n);
    return mix64(h ^ k ^ 0x5bd1e9955bd1e995ULL);
}

/* ------------------------------------------------------------------ directory
 * Chained hashing over entries that never move (chunks of CHUNK_ENTRIES), so a lease can hold
 * entry ids across the bucket array's growth. Id 0 is "none". */

typedef struct {
    uint32_t next;   /* bucket chain; the free list while FREE */
    uint32_t ns;
    uint64_t slot;   /* absolute pool offset */
    uint64_t checksum;
    uint32_t length;
    uint32_t pins;   /* lane leases holding it */
    uint8_t state;
    uint8_t klen;
    uint8_t key[MAX_KEY];
} Entry;

typedef struct {
    Entry **chunks;
    uint32_t nchunks, cap_chunks;
    uint32_t fresh;      /* next never-used id */
    uint32_t free_head;  /* reusable ids */
    uint32_t *buckets;
    uint64_t mask;       /* buckets - 1 */
    uint64_t live, dead;
} Directory;

static inline Entry *entry_at(Directory *d, uint32_t id) {
    return &d->chunks[id / CHUNK_ENTRIES][id % CHUNK_ENTRIES];
}

static inline uint64_t key_hash(uint32_t ns, const uint8_t *key, uint32_t klen) {
    return hash_bytes(0x70656761666c6f77ULL ^ ns, key, klen);
}

static int dir_init(Directory *d) {
    memset(d, 0, sizeof *d);
    d->mask = 1023;
    d->buckets = calloc(d->mask + 1, sizeof(uint32_t));
    d->fresh = 1;
    return d->buckets ? 0 : -1;
}

static void dir_free(Directory *d) {
    for (uint32_t i = 0; i < d->nchunks; i++) free(d->chunks[i]);
    free(d->chunks);
    free(d->buckets);
    memset(d, 0, sizeof *d);
}

static uint32_t dir_new_id(Directory *d) {
    if (d->free_head) {
        uint32_t id = d->free_head;
        d->free_head = entry_at(d, id)->next;
        return id;
    }
    uint32_t id = d->fresh;
    if (id / CHUNK_ENTRIES >= d->nchunks) {
        if (d->nchunks == d->cap_chunks) {
            uint32_t cap = d->cap_chunks ? d->cap_chunks * 2 : 16;
            Entry **c = realloc(d->chunks, cap * sizeof(Entry *));
            if (!c) return NO_ID;
            d->chunks = c;
            d->cap_chunks = cap;
        }
        Entry *chunk = calloc(CHUNK_ENTRIES, sizeof(Entry));
        if (!chunk) return NO_ID;
        d->chunks[d->nchunks++] = chunk;
    }
    d->fresh++;
    return id;
}

static void dir_release_id(Directory *d, uint32_t id) {
    Entry *e = entry_at(d, id);
    e->state = E_FREE;
    e->pins = 0;
    e->next = d->free_head;
    d->free_head = id;
}

static uint32_t dir_find(Directory *d, uint32_t ns, const uint8_t *key, uint32_t klen) {
    uint32_t id = d->buckets[key_hash(ns, key, klen) & d->mask];
    while (id) {
        Entry *e = entry_at(d, id);
        if (e->ns == ns && e->klen == klen && memcmp(e->key, key, klen) == 0) return id;
        id = e->next;
    }
    return NO_ID;
}

static void dir_unlink(Directory *d, uint32_t id) {
    Entry *e = entry_at(d, id);
    uint32_t *link = &d->buckets[key_hash(e->ns, e->key, e->klen) & d->mask];
    while (*link && *link != id) link = &entry_at(d, *link)->next;
    if (*link == id) *link = e->next;
    e->next = 0;
}

static void dir_grow(Directory *d) {
    uint64_t nb = (d->mask + 1) * 2;
    uint32_t *b = calloc(nb, sizeof(uint32_t));
    if (!b) return; /* keep the longer chains: still correct */
    for (uint64_t i = 0; i <= d->mask; i++) {
        uint32_t id = d->buckets[i];
        while (id) {
            Entry *e = entry_at(d, id);
            uint32_t next = e->next;
            uint64_t at = key_hash(e->ns, e->key, e->klen) & (nb - 1);
            e->next = b[at];
            b[at] = id;
            id = next;
        }
    }
    free(d->buckets);
    d->buckets = b;
    d->mask = nb - 1;
}

/* ------------------------------------------------------------------ small maps
 * Open addressing (linear probing, tombstones) from an id string or a u64 to a u32 value. */

typedef struct {
    uint64_t hash;
    uint32_t value;
    uint8_t state; /* 0 empty, 1 used, 2 tombstone */
    uint8_t klen;
    char key[MAX_ID];
} StrSlot;

typedef struct {
    StrSlot *slots;
    uint64_t mask, used, filled;
} StrMap;

static int strmap_init(StrMap *m) {
    m->mask = 63;
    m->used = m->filled = 0;
    m->slots = calloc(m->mask + 1, sizeof(StrSlot));
    return m->slots ? 0 : -1;
}

static StrSlot *strmap_probe(StrMap *m, const char *key, uint32_t klen, uint64_t h, int for_insert) {
    StrSlot *tomb = NULL;
    for (uint64_t i = h & m->mask;; i = (i + 1) & m->mask) {
        StrSlot *s = &m->slots[i];
        if (s->state == 0) return for_insert ? (tomb ? tomb : s) : NULL;
        if (s->state == 2) {
            if (!tomb) tomb = s;
            continue;
        }
        if (s->hash == h && s->klen == klen && memcmp(s->key, key, klen) == 0) return s;
    }
}

/* Rehashes into a table sized by what it holds (at most half full after), dropping the tombstones:
   ids come and go (sessions, leases), so growing by doubling alone would grow without bound. */
static uint64_t rehash_capacity(uint64_t used) {
    uint64_t cap = 64;
    while (cap < (used + 1) * 2) cap *= 2;
    return cap;
}

static int strmap_grow(StrMap *m) {
    uint64_t cap = rehash_capacity(m->used);
    StrMap n = {calloc(cap, sizeof(StrSlot)), cap - 1, 0, 0};
    if (!n.slots) return -1;
    for (uint64_t i = 0; i <= m->mask; i++) {
        StrSlot *s = &m->slots[i];
        if (s->state != 1) continue;
        StrSlot *t = strmap_probe(&n, s->key, s->klen, s->hash, 1);
        *t = *s;
        n.used++;
        n.filled++;
    }
    free(m->slots);
    *m = n;
    return 0;
}

static int strmap_get(StrMap *m, const char *key, uint32_t klen, uint32_t *value) {
    if (klen > MAX_ID) return 0;
    StrSlot *s = strmap_probe(m, key, klen, hash_bytes(1, (const uint8_t *)key, klen), 0);
    if (!s) return 0;
    *value = s->value;
    return 1;
}

static int strmap_put(StrMap *m, const char *key, uint32_t klen, uint32_t value) {
    if (klen > MAX_ID) return -1;
    if ((m->filled + 1) * 4 > (m->mask + 1) * 3 && strmap_grow(m)) return -1;
    uint64_t h = hash_bytes(1, (const uint8_t *)key, klen);
    StrSlot *s = strmap_probe(m, key, klen, h, 1);
    if (s->state != 1) {
        if (s->state == 0) m->filled++;
        m->used++;
    }
    s->hash = h;
    s->value = value;
    s->state = 1;
    s->klen = (uint8_t)klen;
    memcpy(s->key, key, klen);
    return 0;
}

static int strmap_del(StrMap *m, const char *key, uint32_t klen) {
    if (klen > MAX_ID) return 0;
    StrSlot *s = strmap_probe(m, key, klen, hash_bytes(1, (const uint8_t *)key, klen), 0);
    if (!s) return 0;
    s->state = 2;
    m->used--;
    return 1;
}

typedef struct {
    uint64_t key;   /* 0 = empty, 1 = tombstone (lease ids are never 0 or 1) */
    uint64_t value; /* a Lease pointer, or a tombstone's expiry */
} U64Slot;

typedef struct {
    U64Slot *slots;
    uint64_t mask, used, filled;
} U64Map;

static int u64map_init(U64Map *m) {
    m->mask = 63;
    m->used = m->filled = 0;
    m->slots = calloc(m->mask + 1, sizeof(U64Slot));
    return m->slots ? 0 : -1;
}

static U64Slot *u64map_probe(U64Map *m, uint64_t key, int for_insert) {
    U64Slot *tomb = NULL;
    for (uint64_t i = mix64(key) & m->mask;; i = (i + 1) & m->mask) {
        U64Slot *s = &m->slots[i];
        if (s->key == 0) return for_insert ? (tomb ? tomb : s) : NULL;
        if (s->key == 1) {
            if (!tomb) tomb = s;
            continue;
        }
        if (s->key == key) return s;
    }
}

static int u64map_grow(U64Map *m) {
    uint64_t cap = rehash_capacity(m->used);
    U64Map n = {calloc(cap, sizeof(U64Slot)), cap - 1, 0, 0};
    if (!n.slots) return -1;
    for (uint64_t i = 0; i <= m->mask; i++) {
        U64Slot *s = &m->slots[i];
        if (s->key <= 1) continue;
        *u64map_probe(&n, s->key, 1) = *s;
        n.used++;
        n.filled++;
    }
    free(m->slots);
    *m = n;
    return 0;
}

static int u64map_put(U64Map *m, uint64_t key, uint64_t value) {
    if ((m->filled + 1) * 4 > (m->mask + 1) * 3 && u64map_grow(m)) return -1;
    U64Slot *s = u64map_probe(m, key, 1);
    if (s->key != key) {
        if (s->key == 0) m->filled++;
        m->used++;
    }
    s->key = key;
    s->value = value;
    return 0;
}

static U64Slot *u64map_get(U64Map *m, uint64_t key) { return key > 1 ? u64map_probe(m, key, 0) : NULL; }

static void u64map_del_slot(U64Map *m, U64Slot *s) {
    s->key = 1;
    s->value = 0;
    m->used--;
}

/* ------------------------------------------------------------------ the lane */

typedef struct {
    uint8_t used, lane_ok, idlen;
    char id[MAX_ID];
    uint64_t part_base;    /* offsets are answered relative to the memory this session maps */
    uint64_t limit_bytes;  /* lease quota over both lanes */
    uint32_t max_leases;
    uint64_t lane_bytes, py_bytes;
    uint32_t lane_leases, py_leases;
} Session;

typedef struct {
    uint8_t used, idlen;
    char id[MAX_ID];
    uint32_t session;
    uint32_t ns;
    uint32_t block_bytes;
} Instance;

typedef struct {
    uint64_t id;
    uint32_t session, ns, n;
    uint64_t bytes, created, expires;
    uint32_t entries[];
} Lease;

typedef struct Conn {
    struct Conn *next_dead; /* closed in this pass of the loop: freed after it (events may still name it) */
    int fd;                 /* -1 once closed */
    uint8_t *rbuf, *wbuf;
    size_t rlen, rcap, wlen, woff, wcap;
    uint64_t last_ns, frame_since_ns;
    int polling_out;
    /* Leases whose answers are not out yet (end offset in wbuf): a connection that closes before they
       are ends them, as a call whose caller hung up is undone (server/endpoints/unix_socket.py). */
    uint64_t *undelivered;
    size_t *undelivered_end;
    uint32_t nundelivered, cap_undelivered;
} Conn;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    Directory dir;
    StrMap session_ids, instance_ids;
    Session *sessions;
    uint32_t nsessions, cap_sessions;
    Instance *instances;
    uint32_t ninstances, cap_instances;
    U64Map leases, tombstones;
    uint64_t lane_pinned_entries;
    /* limits */
    uint32_t max_hash_bytes, max_batch;
    uint64_t default_ttl_ns, max_ttl_ns, tombstone_ttl_ns;
    int fallback_on_miss;
    /* counts and signals for Python */
    uint64_t counts[C_COUNT];
    uint8_t *sig;
    size_t sig_len, sig_cap;
    int signal_fd;
    /* the serving thread */
    pthread_t thread;
    int serving, stop_fd, listen_fd, epoll_fd;
    uint8_t hello[4 + 2 + 255];
    size_t hello_len;
    uint32_t max_conns, max_frame;
    uint64_t idle_timeout_ns, frame_timeout_ns, buffered_limit, buffered;
    Conn **conns;
    uint32_t nconns, cap_conns;
    Conn *dead; /* closed during the current batch of events */
    uint64_t evicted, idle_closed, refused, protocol_errors, undone_leases;
} Lane;

/* Scratch for one request (the serving thread's only). */
typedef struct {
    uint32_t ids[65536];
} Scan;

static void signal_python(Lane *l) {
    uint64_t one = 1;
    ssize_t rc = write(l->signal_fd, &one, sizeof one);
    (void)rc;
}

/* Appends one signal record (u32 length + body) or counts it dropped. */
static uint8_t *sig_reserve(Lane *l, size_t body) {
    if (l->sig_len + 4 + body > l->sig_cap) {
        l->counts[C_SIGNALS_DROPPED]++;
        return NULL;
    }
    int was_empty = l->sig_len == 0;
    uint8_t *p = l->sig + l->sig_len;
    uint32_t n = (uint32_t)body;
    memcpy(p, &n, 4);
    l->sig_len += 4 + body;
    if (was_empty) signal_python(l);
    return p + 4;
}

static void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }
static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static uint16_t get16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* SIG_CALL: u8 kind | u8 op | u8 code | u8 0 | u64 duration_ns (for the RPC metrics). */
static void sig_call(Lane *l, int op, int code, uint64_t duration_ns) {
    uint8_t *p = sig_reserve(l, 12);
    if (!p) return;
    p[0] = SIG_CALL;
    p[1] = (uint8_t)op;
    p[2] = (uint8_t)code;
    p[3] = 0;
    put64(p + 4, duration_ns);
}

static void unpin_entry(Lane *l, uint32_t id) {
    Entry *e = entry_at(&l->dir, id);
    if (e->pins == 0) return;
    if (--e->pins) return;
    l->lane_pinned_entries--;
    if (e->state != E_DEAD) return;
    /* A retired block's last lane lease let go: the store may drop it now. SIG_DEAD_RELEASED:
       u8 kind | u8 klen | u16 0 | u32 ns | key. */
    uint8_t *p = sig_reserve(l, 8 + e->klen);
    if (p) {
        p[0] = SIG_DEAD_RELEASED;
        p[1] = e->klen;
        put16(p + 2, 0);
        put32(p + 4, e->ns);
        memcpy(p + 8, e->key, e->klen);
    }
    l->dir.dead--;
    dir_release_id(&l->dir, id);
}

/* Ends a lease: unpins, uncharges its session, forgets it. */
static void end_lease(Lane *l, U64Slot *slot) {
    Lease *lease = (Lease *)(uintptr_t)slot->value;
    for (uint32_t i = 0; i < lease->n; i++) unpin_entry(l, lease->entries[i]);
    Session *s = &l->sessions[lease->session];
    s->lane_bytes -= lease->bytes;
    s->lane_leases--;
    u64map_del_slot(&l->leases, slot);
    free(lease);
}

static Session *find_session(Lane *l, const char *id, uint32_t len, uint32_t *index) {
    uint32_t i;
    if (!strmap_get(&l->session_ids, id, len, &i)) return NULL;
    if (index) *index = i;
    return &l->sessions[i];
}

static void tombstone(Lane *l, uint64_t lease_id, uint64_t now) {
    if (l->tombstones.used > 65536) return; /* bounded: beyond it a late query simply gets its lease */
    u64map_put(&l->tombstones, lease_id, now + l->tombstone_ttl_ns);
}

/* ------------------------------------------------------------------ requests */

typedef struct {
    uint8_t *p;
    size_t len, cap;
} Out;

static int out_room(Out *o, size_t more) {
    if (o->len + more <= o->cap) return 0;
    size_t cap = o->cap ? o->cap : 256;
    while (cap < o->len + more) cap *= 2;
    uint8_t *p = realloc(o->p, cap);
    if (!p) return -1;
    o->p = p;
    o->cap = cap;
    return 0;
}

/* An answer frame with no blocks: `code`, `message`, the not-found kind. */
static int answer_status(Out *o, int code, int not_executed, const char *message, const char *kind) {
    size_t mlen = strlen(message), klen = strlen(kind);
    if (mlen > 4000) mlen = 4000;
    size_t body = 14 + mlen + 1 + klen;
    if (out_room(o, 4 + body)) return -1;
    uint8_t *p = o->p + o->len;
    put32(p, (uint32_t)body);
    memcpy(p + 4, MAGIC, 4);
    p[8] = (uint8_t)code;
    p[9] = not_executed ? FLAG_NOT_EXECUTED : 0;
    put16(p + 10, 0);
    put32(p + 12, 0);
    put16(p + 16, (uint16_t)mlen);
    memcpy(p + 18, message, mlen);
    p[18 + mlen] = (uint8_t)klen;
    memcpy(p + 19 + mlen, kind, klen);
    o->len += 4 + body;
    return 0;
}

static int not_executed(Lane *l, Out *o, const char *why) {
    l->counts[C_NOT_EXECUTED]++;
    return answer_status(o, ST_OK, 1, why, "");
}

typedef struct {
    int op, flags;
    uint32_t n, timeout_ms, ttl_ms;
    const char *sid, *iid;
    uint32_t sid_len, iid_len;
    uint64_t lease_id, loaded;
    const uint8_t *lengths, *hashes;
    size_t hash_total; /* bytes of all hashes */
    uint64_t created;  /* out: the lease a query took (0: none) */
} Req;

/* 0: parsed; -1: not this protocol (close the connection); 1: malformed (answer INVALID_ARGUMENT). */
static int parse(const uint8_t *b, size_t len, Req *r) {
    if (len < 12 || memcmp(b, MAGIC, 4) != 0) return -1;
    r->op = b[4];
    r->flags = b[5];
    r->n = get16(b + 6);
    r->timeout_ms = get32(b + 8);
    size_t at = 12;
    if (at + 1 > len) return 1;
    r->sid_len = b[at];
    r->sid = (const char *)b + at + 1;
    at += 1 + r->sid_len;
    if (at + 1 > len) return 1;
    r->iid_len = b[at];
    r->iid = (const char *)b + at + 1;
    at += 1 + r->iid_len;
    if (at + 20 > len) return 1;
    r->ttl_ms = get32(b + at);
    r->lease_id = get64(b + at + 4);
    r->loaded = get64(b + at + 12);
    at += 20;
    if (at + r->n > len) return 1;
    r->lengths = b + at;
    at += r->n;
    size_t total = 0;
    for (uint32_t i = 0; i < r->n; i++) total += r->lengths[i];
    if (at + total != len) return 1;
    r->hashes = b + at;
    r->hash_total = total;
    if (r->op != OP_QUERY && r->op != OP_RELEASE) return 1;
    return 0;
}

static void lease_name(char *buf, size_t size, uint64_t id) { snprintf(buf, size, "r-%016llx", (unsigned long long)id); }

static int handle_query(Lane *l, Req *r, Out *o, Scan *scan, uint64_t now) {
    uint32_t si;
    Session *s = find_session(l, r->sid, r->sid_len, &si);
    if (!s || !s->lane_ok) return not_executed(l, o, "session not served by the read lane");
    uint32_t ii;
    if (!strmap_get(&l->instance_ids, r->iid, r->iid_len, &ii)) return not_executed(l, o, "unknown instance");
    Instance *inst = &l->instances[ii];
    if (inst->session != si) return not_executed(l, o, "instance of another session");
    if (r->n == 0 || r->n > l->max_batch) return not_executed(l, o, "batch size");
    int lease = r->flags & FLAG_LEASE;
    uint64_t ttl = l->default_ttl_ns;
    if (lease) {
        if (r->lease_id <= 1) return not_executed(l, o, "lease id");
        if (r->ttl_ms) {
            ttl = (uint64_t)r->ttl_ms * 1000000ull;
            if (ttl > l->max_ttl_ns) return not_executed(l, o, "lease ttl");
        }
        char name[24], msg[96];
        lease_name(name, sizeof name, r->lease_id);
        U64Slot *t = u64map_get(&l->tombstones, r->lease_id);
        if (t && t->value > now) {
            snprintf(msg, sizeof msg, "lease %s was already given up by its caller", name);
            return answer_status(o, ST_DEADLINE_EXCEEDED, 0, msg, "");
        }
        if (u64map_get(&l->leases, r->lease_id)) {
            snprintf(msg, sizeof msg, "lease id %s is already in use", name);
            return answer_status(o, ST_FAILED_PRECONDITION, 0, msg, "");
        }
    }
    /* The leading hashes readable in DRAM. */
    const uint8_t *h = r->hashes;
    uint32_t found = 0;
    for (uint32_t i = 0; i < r->n; i++) {
        uint32_t klen = r->lengths[i];
        if (klen == 0 || klen > l->max_hash_bytes) return not_executed(l, o, "hash length");
        uint32_t id = dir_find(&l->dir, inst->ns, h, klen);
        h += klen;
        if (!id) break;
        scan->ids[found++] = id;
    }
    if (found < r->n && l->fallback_on_miss) return not_executed(l, o, "the chain continues beyond DRAM");
    /* The rest of the hashes must still be well formed (the engine would refuse them). */
    for (uint32_t i = found; i < r->n; i++)
        if (r->lengths[i] == 0 || r->lengths[i] > l->max_hash_bytes) return not_executed(l, o, "hash length");
    int load = r->flags & FLAG_PURPOSE_LOAD;
    if (lease && found) {
        /* At the session's lease quota (count or bytes over both lanes) the engine decides: a release
           of one of its leases that the client sent just before, on its own socket, may not have run
           yet, and the engine's socket runs a client's calls in order. */
        if (s->lane_leases + s->py_leases >= s->max_leases) return not_executed(l, o, "lease count");
        uint64_t held = s->lane_bytes + s->py_bytes;
        uint64_t room = s->limit_bytes > held ? s->limit_bytes - held : 0;
        if ((uint64_t)found * inst->block_bytes > room) return not_executed(l, o, "lease quota");
    }
    /* Counted as the engine counts: every block the scan found. */
    if (load) {
        l->counts[C_LOAD_QUERIES]++;
        l->counts[C_LOAD_MISSED] += r->n - found;
    } else {
        l->counts[C_LOOKUP_QUERIES]++;
        l->counts[C_DRAM_HITS] += found;
        l->counts[C_MISSES] += r->n - found;
    }
    if (lease && found) {
        Lease *ls = malloc(sizeof(Lease) + found * sizeof(uint32_t));
        if (!ls || u64map_put(&l->leases, r->lease_id, (uint64_t)(uintptr_t)ls)) {
            free(ls);
            return answer_status(o, ST_RESOURCE_EXHAUSTED, 0, "the read lane is out of memory", "");
        }
        ls->id = r->lease_id;
        ls->session = si;
        ls->ns = inst->ns;
        ls->n = found;
        ls->bytes = 0;
        ls->created = now;
        ls->expires = now + ttl;
        for (uint32_t i = 0; i < found; i++) {
            Entry *e = entry_at(&l->dir, scan->ids[i]);
            if (e->pins++ == 0) l->lane_pinned_entries++;
            ls->entries[i] = scan->ids[i];
            ls->bytes += e->length;
        }
        s->lane_bytes += ls->bytes;
        s->lane_leases++;
        l->counts[C_LEASES]++;
        r->created = r->lease_id;
    }
    /* SIG_QUERY: u8 kind | u8 purpose | u16 n | u16 found | u16 served | u32 ns | lengths | hashes. */
    uint8_t *p = sig_reserve(l, 12 + r->n + r->hash_total);
    if (p) {
        p[0] = SIG_QUERY;
        p[1] = load ? 1 : 0;
        put16(p + 2, (uint16_t)r->n);
        put16(p + 4, (uint16_t)found);
        put16(p + 6, (uint16_t)found); /* served: all found (a lease past the quota is the engine's) */
        put32(p + 8, inst->ns);
        memcpy(p + 12, r->lengths, r->n);
        memcpy(p + 12 + r->n, r->hashes, r->hash_total);
    }
    /* The answer. */
    size_t body = 14 + 1 + 16 * (size_t)found;
    if (out_room(o, 4 + body)) return -1;
    uint8_t *q = o->p + o->len;
    put32(q, (uint32_t)body);
    memcpy(q + 4, MAGIC, 4);
    q[8] = ST_OK;
    q[9] = 0;
    put16(q + 10, (uint16_t)found);
    put32(q + 12, inst->block_bytes);
    put16(q + 16, 0);
    q[18] = 0;
    uint8_t *offs = q + 19, *sums = q + 19 + 8 * (size_t)found;
    for (uint32_t i = 0; i < found; i++) {
        Entry *e = entry_at(&l->dir, scan->ids[i]);
        put64(offs + 8 * (size_t)i, e->slot - s->part_base);
        put64(sums + 8 * (size_t)i, e->checksum);
    }
    o->len += 4 + body;
    return 0;
}

static int handle_release(Lane *l, const Req *r, Out *o, uint64_t now) {
    uint32_t si;
    Session *s = find_session(l, r->sid, r->sid_len, &si);
    if (!s || !s->lane_ok) return not_executed(l, o, "session not served by the read lane");
    U64Slot *slot = u64map_get(&l->leases, r->lease_id);
    if (!slot || ((Lease *)(uintptr_t)slot->value)->session != si) {
        char name[24], msg[64];
        lease_name(name, sizeof name, r->lease_id);
        if (!slot && r->lease_id > 1) tombstone(l, r->lease_id, now);
        snprintf(msg, sizeof msg, "unknown or expired lease '%s'", name);
        return answer_status(o, ST_NOT_FOUND, 0, msg, "lease");
    }
    Lease *lease = (Lease *)(uintptr_t)slot->value;
    uint64_t loaded = r->loaded < lease->bytes ? r->loaded : lease->bytes;
    uint64_t age = now - lease->created;
    uint32_t ns = lease->ns;
    end_lease(l, slot);
    l->counts[C_RELEASES]++;
    l->counts[C_LOADED_BYTES] += loaded;
    if (loaded) {
        /* SIG_RELEASE: u8 kind | u8 0 | u16 0 | u32 ns | u64 loaded | u64 age_ns. */
        uint8_t *p = sig_reserve(l, 24);
        if (p) {
            p[0] = SIG_RELEASE;
            p[1] = 0;
            put16(p + 2, 0);
            put32(p + 4, ns);
            put64(p + 8, loaded);
            put64(p + 16, age);
        }
    }
    return answer_status(o, ST_OK, 0, "", "");
}

/* One request -> one answer appended to `o`. -1: close the connection (not this protocol).
   `created`: the lease the request took (0: none). */
static int handle(Lane *l, const uint8_t *body, size_t len, Out *o, Scan *scan, uint64_t *created) {
    uint64_t t0 = now_ns();
    Req r;
    memset(&r, 0, sizeof r);
    int rc = parse(body, len, &r);
    if (rc < 0) return -1;
    size_t before = o->len;
    pthread_mutex_lock(&l->mu);
    if (rc > 0) {
        rc = answer_status(o, ST_INVALID_ARGUMENT, 0, "malformed read lane request", "");
    } else if (r.timeout_ms == 0) {
        rc = answer_status(o, ST_DEADLINE_EXCEEDED, 0, "Deadline Exceeded", "");
    } else {
        rc = r.op == OP_QUERY ? handle_query(l, &r, o, scan, t0) : handle_release(l, &r, o, t0);
    }
    if (rc == 0 && o->len > before && !(o->p[before + 9] & FLAG_NOT_EXECUTED))
        sig_call(l, r.op, o->p[before + 8], now_ns() - t0);
    pthread_mutex_unlock(&l->mu);
    *created = r.created;
    return rc < 0 ? -1 : 0;
}

/* ------------------------------------------------------------------ the serving thread */

static void conn_free(Lane *l, Conn *c) {
    if (c->nundelivered) {
        pthread_mutex_lock(&l->mu);
        for (uint32_t i = 0; i < c->nundelivered; i++) {
            U64Slot *slot = u64map_get(&l->leases, c->undelivered[i]);
            if (slot) {
                end_lease(l, slot);
                l->undone_leases++;
            }
        }
        pthread_mutex_unlock(&l->mu);
    }
    l->buffered -= c->rcap;
    free(c->undelivered);
    free(c->undelivered_end);
    free(c->rbuf);
    free(c->wbuf);
    free(c);
}

static void note_undelivered(Conn *c, uint64_t lease_id) {
    if (c->nundelivered == c->cap_undelivered) {
        uint32_t cap = c->cap_undelivered ? c->cap_undelivered * 2 : 8;
        uint64_t *a = realloc(c->undelivered, cap * sizeof(uint64_t));
        if (a) c->undelivered = a;
        size_t *b = realloc(c->undelivered_end, cap * sizeof(size_t));
        if (b) c->undelivered_end = b;
        if (!a || !b) return; /* out of memory: that lease ends at its TTL */
        c->cap_undelivered = cap;
    }
    c->undelivered[c->nundelivered] = lease_id;
    c->undelivered_end[c->nundelivered++] = c->wlen;
}

/* The answers now fully out: their leases are the client's. */
static void note_delivered(Conn *c) {
    uint32_t keep = 0;
    for (uint32_t i = 0; i < c->nundelivered; i++) {
        if (c->undelivered_end[i] > c->woff) {
            c->undelivered[keep] = c->undelivered[i];
            c->undelivered_end[keep++] = c->undelivered_end[i];
        }
    }
    c->nundelivered = keep;
}

static void conn_close(Lane *l, Conn *c, int goodbye) {
    if (goodbye && c->wlen == c->woff) {
        static const uint8_t bye[4] = {0, 0, 0, 0};
        ssize_t rc = send(c->fd, bye, 4, MSG_NOSIGNAL | MSG_DONTWAIT);
        (void)rc;
    }
    epoll_ctl(l->epoll_fd, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    c->fd = -1;
    for (uint32_t i = 0; i < l->nconns; i++)
        if (l->conns[i] == c) {
            l->conns[i] = l->conns[--l->nconns];
            break;
        }
    /* Not freed yet: a later event of this epoll_wait batch may still point at it. */
    c->next_dead = l->dead;
    l->dead = c;
}

static void free_dead(Lane *l) {
    while (l->dead) {
        Conn *c = l->dead;
        l->dead = c->next_dead;
        conn_free(l, c);
    }
}

/* Writes what is pending; 0 = all out, 1 = some left (EPOLLOUT armed), -1 = the connection failed. */
static int conn_flush(Lane *l, Conn *c) {
    while (c->woff < c->wlen) {
        ssize_t n = send(c->fd, c->wbuf + c->woff, c->wlen - c->woff, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            c->woff += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            note_delivered(c);
            if (!c->polling_out) {
                struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT, .data.ptr = c};
                epoll_ctl(l->epoll_fd, EPOLL_CTL_MOD, c->fd, &ev);
                c->polling_out = 1;
            }
            return 1;
        }
        return -1;
    }
    c->nundelivered = 0; /* every answer is out */
    c->wlen = c->woff = 0;
    if (c->polling_out) {
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
        epoll_ctl(l->epoll_fd, EPOLL_CTL_MOD, c->fd, &ev);
        c->polling_out = 0;
    }
    return 0;
}

/* Reads what arrived and answers every whole frame; -1: close it. */
static int conn_read(Lane *l, Conn *c, Scan *scan) {
    for (;;) {
        if (c->rlen == c->rcap) {
            size_t want = c->rcap ? c->rcap * 2 : 4096;
            size_t limit = (size_t)l->max_frame + 4;
            if (want > limit) want = limit;
            if (want <= c->rcap || l->buffered + (want - c->rcap) > l->buffered_limit) {
                /* A frame longer than the limit, or over the lane's memory cap: refused unread. */
                Out o = {c->wbuf, c->wlen, c->wcap};
                answer_status(&o, ST_RESOURCE_EXHAUSTED, 1, "frame refused: too long or over the memory cap", "");
                c->wbuf = o.p, c->wlen = o.len, c->wcap = o.cap;
                conn_flush(l, c);
                l->refused++;
                return -1;
            }
            uint8_t *p = realloc(c->rbuf, want);
            if (!p) return -1;
            l->buffered += want - c->rcap;
            c->rbuf = p;
            c->rcap = want;
        }
        ssize_t n = recv(c->fd, c->rbuf + c->rlen, c->rcap - c->rlen, MSG_DONTWAIT);
        if (n == 0) return -1;
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) break;
            return -1;
        }
        c->rlen += (size_t)n;
        /* Whole frames. */
        size_t at = 0;
        while (c->rlen - at >= 4) {
            uint32_t size = get32(c->rbuf + at);
            if (size == 0 || size > l->max_frame) {
                l->protocol_errors++;
                Out o = {c->wbuf, c->wlen, c->wcap};
                answer_status(&o, ST_RESOURCE_EXHAUSTED, 1, "frame refused: empty or too long", "");
                c->wbuf = o.p, c->wlen = o.len, c->wcap = o.cap;
                conn_flush(l, c);
                return -1;
            }
            if (c->rlen - at - 4 < size) break;
            Out o = {c->wbuf, c->wlen, c->wcap};
            uint64_t created = 0;
            int rc = handle(l, c->rbuf + at + 4, size, &o, scan, &created);
            c->wbuf = o.p, c->wlen = o.len, c->wcap = o.cap;
            if (rc < 0) {
                l->protocol_errors++;
                return -1;
            }
            if (created) note_undelivered(c, created);
            at += 4 + (size_t)size;
        }
        if (at) {
            memmove(c->rbuf, c->rbuf + at, c->rlen - at);
            c->rlen -= at;
        }
        c->frame_since_ns = c->rlen ? (c->frame_since_ns ? c->frame_since_ns : now_ns()) : 0;
        if (c->wlen - c->woff > (4u << 20)) return -1; /* a client that never reads its answers */
    }
    c->last_ns = now_ns();
    return conn_flush(l, c) < 0 ? -1 : 0;
}

static Conn *least_recently_used_idle(Lane *l) {
    Conn *best = NULL;
    for (uint32_t i = 0; i < l->nconns; i++) {
        Conn *c = l->conns[i];
        if (c->rlen || c->wlen != c->woff) continue;
        if (!best || c->last_ns < best->last_ns) best = c;
    }
    return best;
}

static void accept_all(Lane *l, uint64_t *paused_until) {
    for (;;) {
        int fd = accept4(l->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR) continue;
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                /* No fd for another connection now: pause accepting instead of spinning. */
                epoll_ctl(l->epoll_fd, EPOLL_CTL_DEL, l->listen_fd, NULL);
                *paused_until = now_ns() + 100000000ull;
            }
            return;
        }
        if (l->nconns >= l->max_conns) {
            Conn *victim = least_recently_used_idle(l);
            if (!victim) {
                close(fd); /* before the greeting: nothing ran, the client uses the engine */
                l->refused++;
                continue;
            }
            conn_close(l, victim, 1);
            l->evicted++;
        }
        if (send(fd, l->hello, l->hello_len, MSG_NOSIGNAL | MSG_DONTWAIT) != (ssize_t)l->hello_len) {
            close(fd);
            continue;
        }
        Conn *c = calloc(1, sizeof *c);
        if (!c || (l->nconns == l->cap_conns &&
                   !(l->conns = realloc(l->conns, (l->cap_conns = l->cap_conns ? l->cap_conns * 2 : 64) *
                                                      sizeof(Conn *))))) {
            free(c);
            close(fd);
            continue;
        }
        c->fd = fd;
        c->last_ns = now_ns();
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
        if (epoll_ctl(l->epoll_fd, EPOLL_CTL_ADD, fd, &ev)) {
            free(c);
            close(fd);
            continue;
        }
        l->conns[l->nconns++] = c;
    }
}

static void *serve_loop(void *arg) {
    Lane *l = arg;
    Scan *scan = malloc(sizeof(Scan));
    struct epoll_event evs[64];
    uint64_t paused_until = 0, next_sweep = now_ns() + 1000000000ull;
    int stopping = 0;
    while (!stopping && scan) {
        int n = epoll_wait(l->epoll_fd, evs, 64, 250);
        for (int i = 0; i < n; i++) {
            void *ptr = evs[i].data.ptr;
            if (ptr == (void *)&l->stop_fd) {
                stopping = 1;
            } else if (ptr == (void *)&l->listen_fd) {
                accept_all(l, &paused_until);
            } else {
                Conn *c = ptr;
                if (c->fd < 0) continue; /* closed earlier in this batch (evicted at the cap) */
                int rc = 0;
                if (evs[i].events & EPOLLOUT) rc = conn_flush(l, c) < 0 ? -1 : 0;
                if (rc == 0 && evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) rc = conn_read(l, c, scan);
                if (rc < 0) conn_close(l, c, 0);
            }
        }
        free_dead(l);
        uint64_t now = now_ns();
        if (paused_until && now >= paused_until) {
            struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &l->listen_fd};
            epoll_ctl(l->epoll_fd, EPOLL_CTL_ADD, l->listen_fd, &ev);
            paused_until = 0;
        }
        if (now >= next_sweep) {
            next_sweep = now + 1000000000ull;
            for (uint32_t i = 0; i < l->nconns;) {
                Conn *c = l->conns[i];
                int idle = !c->rlen && c->wlen == c->woff && now - c->last_ns > l->idle_timeout_ns;
                int stalled = c->frame_since_ns && now - c->frame_since_ns > l->frame_timeout_ns;
                if (idle || stalled) {
                    l->idle_closed += idle;
                    conn_close(l, c, idle); /* conn_close moves the last connection into slot i */
                } else {
                    i++;
                }
            }
        }
    }
    while (l->nconns) conn_close(l, l->conns[0], 1);
    free_dead(l);
    free(scan);
    return NULL;
}

/* ------------------------------------------------------------------ Python face */

#define LOCK(l) pthread_mutex_lock(&(l)->mu)
#define UNLOCK(l) pthread_mutex_unlock(&(l)->mu)

static void Lane_dealloc(Lane *l) {
    if (l->serving) {
        uint64_t one = 1;
        ssize_t rc = write(l->stop_fd, &one, sizeof one);
        (void)rc;
        Py_BEGIN_ALLOW_THREADS pthread_join(l->thread, NULL);
        Py_END_ALLOW_THREADS l->serving = 0;
    }
    if (l->leases.slots)
        for (uint64_t i = 0; i <= l->leases.mask; i++)
            if (l->leases.slots[i].key > 1) free((void *)(uintptr_t)l->leases.slots[i].value);
    free(l->leases.slots);
    free(l->tombstones.slots);
    free(l->session_ids.slots);
    free(l->instance_ids.slots);
    free(l->sessions);
    free(l->instances);
    free(l->conns);
    free(l->sig);
    dir_free(&l->dir);
    if (l->signal_fd > 0) close(l->signal_fd);
    if (l->stop_fd > 0) close(l->stop_fd);
    if (l->epoll_fd > 0) close(l->epoll_fd);
    if (l->listen_fd > 0) close(l->listen_fd);
    pthread_mutex_destroy(&l->mu);
    Py_TYPE(l)->tp_free((PyObject *)l);
}

static int Lane_init(Lane *l, PyObject *args, PyObject *kw) {
    static char *names[] = {"max_hash_bytes", "max_batch", "default_ttl_s", "max_ttl_s", "fallback_on_miss",
                            "signal_bytes", "tombstone_ttl_s", NULL};
    unsigned int max_hash = 64, max_batch = 4096;
    double default_ttl = 30.0, max_ttl = 600.0, tomb_ttl = 60.0;
    int fallback = 0;
    Py_ssize_t signal_bytes = 8 << 20;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|IIddpnd", names, &max_hash, &max_batch, &default_ttl, &max_ttl,
                                     &fallback, &signal_bytes, &tomb_ttl))
        return -1;
    if (max_hash < 1 || max_hash > MAX_KEY || max_batch < 1 || max_batch > 65535 || signal_bytes < 4096) {
        PyErr_SetString(PyExc_ValueError, "read lane limits out of range");
        return -1;
    }
    pthread_mutex_init(&l->mu, NULL);
    l->max_hash_bytes = max_hash;
    l->max_batch = max_batch;
    l->default_ttl_ns = (uint64_t)(default_ttl * 1e9);
    l->max_ttl_ns = (uint64_t)(max_ttl * 1e9);
    l->tombstone_ttl_ns = (uint64_t)(tomb_ttl * 1e9);
    l->fallback_on_miss = fallback;
    l->sig_cap = (size_t)signal_bytes;
    l->sig = malloc(l->sig_cap);
    l->signal_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    l->stop_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    l->listen_fd = -1;
    l->epoll_fd = -1;
    if (!l->sig || l->signal_fd < 0 || l->stop_fd < 0 || dir_init(&l->dir) ||
        strmap_init(&l->session_ids) || strmap_init(&l->instance_ids) || u64map_init(&l->leases) ||
        u64map_init(&l->tombstones)) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static int key_arg(PyObject *obj, const uint8_t **key, Py_ssize_t *klen) {
    char *p;
    if (PyBytes_AsStringAndSize(obj, &p, klen) < 0) return -1;
    if (*klen < 1 || *klen > MAX_KEY) {
        PyErr_SetString(PyExc_ValueError, "block hash length out of the read lane's range");
        return -1;
    }
    *key = (const uint8_t *)p;
    return 0;
}

/* (ns, key) positional arguments, the key checked as a block hash the lane keeps. */
static int ns_key_args(PyObject *args, uint32_t *ns, const uint8_t **key, Py_ssize_t *klen) {
    unsigned int n;
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "IO", &n, &obj) || key_arg(obj, key, klen) < 0) return -1;
    *ns = n;
    return 0;
}

/* Takes a published block out of the directory unless a lane lease pins it: 1 when it is no longer
   published (taken out, or not there), 0 when it stays. Under the lock. */
static int dir_try_unpublish(Lane *l, uint32_t ns, const uint8_t *key, uint32_t klen) {
    uint32_t id = dir_find(&l->dir, ns, key, klen);
    if (!id) return 1;
    if (entry_at(&l->dir, id)->pins) return 0;
    dir_unlink(&l->dir, id);
    l->dir.live--;
    dir_release_id(&l->dir, id);
    return 1;
}

/* publish(ns, keys, slots, length, checksums) -> None: blocks sealed, readable in DRAM. */
static PyObject *Lane_publish(Lane *l, PyObject *args) {
    unsigned int ns, length;
    PyObject *keys, *slots, *sums;
    if (!PyArg_ParseTuple(args, "IOOIO", &ns, &keys, &slots, &length, &sums)) return NULL;
    PyObject *kf = PySequence_Fast(keys, "keys must be a sequence");
    if (!kf) return NULL;
    PyObject *sf = PySequence_Fast(slots, "slots must be a sequence");
    if (!sf) {
        Py_DECREF(kf);
        return NULL;
    }
    PyObject *cf = sums == Py_None ? NULL : PySequence_Fast(sums, "checksums must be a sequence");
    Py_ssize_t n = PySequence_Fast_GET_SIZE(kf);
    if ((sums != Py_None && !cf) || PySequence_Fast_GET_SIZE(sf) != n || (cf && PySequence_Fast_GET_SIZE(cf) != n)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "keys, slots and checksums differ in length");
        Py_DECREF(kf);
        Py_DECREF(sf);
        Py_XDECREF(cf);
        return NULL;
    }
    /* Arguments converted before the lock is taken: no Python error can happen under it. */
    uint64_t *vals = PyMem_Malloc(sizeof(uint64_t) * 2 * (size_t)(n ? n : 1));
    if (!vals) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *k;
        Py_ssize_t kl;
        if (key_arg(PySequence_Fast_GET_ITEM(kf, i), &k, &kl) < 0) goto fail;
        vals[2 * i] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(sf, i));
        vals[2 * i + 1] = cf ? PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(cf, i)) : 0;
        if (PyErr_Occurred()) goto fail;
    }
    LOCK(l);
    for (Py_ssize_t i = 0; i < n; i++) {
        char *k;
        Py_ssize_t kl;
        PyBytes_AsStringAndSize(PySequence_Fast_GET_ITEM(kf, i), &k, &kl);
        uint32_t id = dir_find(&l->dir, ns, (uint8_t *)k, (uint32_t)kl);
        if (id) {
            Entry *e = entry_at(&l->dir, id);
            if (e->pins && e->slot != vals[2 * i]) {
                /* Cannot happen while the store unpublishes before it moves a block; if it did, the
                   readers of the old slot keep it (retired) and the new one is published. */
                dir_unlink(&l->dir, id);
                e->state = E_DEAD;
                l->dir.live--;
                l->dir.dead++;
                id = NO_ID;
            } else {
                e->slot = vals[2 * i];
                e->length = length;
                e->checksum = vals[2 * i + 1];
                continue;
            }
        }
        id = dir_new_id(&l->dir);
        if (!id) continue; /* out of memory: the block is simply not served here (a lane miss) */
        Entry *e = entry_at(&l->dir, id);
        e->ns = ns;
        e->klen = (uint8_t)kl;
        memcpy(e->key, k, (size_t)kl);
        e->slot = vals[2 * i];
        e->checksum = vals[2 * i + 1];
        e->length = length;
        e->pins = 0;
        e->state = E_LIVE;
        uint64_t at = key_hash(ns, e->key, e->klen) & l->dir.mask;
        e->next = l->dir.buckets[at];
        l->dir.buckets[at] = id;
        if (++l->dir.live > l->dir.mask + 1) dir_grow(&l->dir);
    }
    UNLOCK(l);
    PyMem_Free(vals);
    Py_DECREF(kf);
    Py_DECREF(sf);
    Py_XDECREF(cf);
    Py_RETURN_NONE;
fail:
    PyMem_Free(vals);
    Py_DECREF(kf);
    Py_DECREF(sf);
    Py_XDECREF(cf);
    return NULL;
}

/* unpublish(ns, key) -> bool: False when a lane lease pins it (it stays published). */
static PyObject *Lane_unpublish(Lane *l, PyObject *args) {
    uint32_t ns;
    const uint8_t *k;
    Py_ssize_t kl;
    if (ns_key_args(args, &ns, &k, &kl) < 0) return NULL;
    LOCK(l);
    int ok = dir_try_unpublish(l, ns, k, (uint32_t)kl);
    UNLOCK(l);
    return PyBool_FromLong(ok);
}

/* unpublish_many(keys: [(ns, key), ...]) -> bytes: per key 1 when it is no longer published (taken out
   now, or it was not there), 0 when a lane lease pins it (it stays). One lock for an eviction batch. */
static PyObject *Lane_unpublish_many(Lane *l, PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "keys must be a sequence of (ns, key)");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    uint32_t *nss = PyMem_Malloc(sizeof(uint32_t) * (size_t)(n ? n : 1));
    const uint8_t **ks = PyMem_Malloc(sizeof(uint8_t *) * (size_t)(n ? n : 1));
    Py_ssize_t *lens = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n ? n : 1));
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (!nss || !ks || !lens || !out) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
            PyErr_SetString(PyExc_TypeError, "keys must be (ns, key) tuples");
            goto fail;
        }
        unsigned long ns = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(item, 0));
        if (PyErr_Occurred() || key_arg(PyTuple_GET_ITEM(item, 1), &ks[i], &lens[i]) < 0) goto fail;
        nss[i] = (uint32_t)ns;
    }
    uint8_t *mask = (uint8_t *)PyBytes_AS_STRING(out);
    LOCK(l);
    for (Py_ssize_t i = 0; i < n; i++) mask[i] = (uint8_t)dir_try_unpublish(l, nss[i], ks[i], (uint32_t)lens[i]);
    UNLOCK(l);
    PyMem_Free(nss);
    PyMem_Free(ks);
    PyMem_Free(lens);
    Py_DECREF(seq);
    return out;
fail:
    PyMem_Free(nss);
    PyMem_Free(ks);
    PyMem_Free(lens);
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

/* retire(ns, key) -> int: hidden from queries now; the lane leases still holding it (0: forgotten). */
static PyObject *Lane_retire(Lane *l, PyObject *args) {
    uint32_t ns;
    const uint8_t *k;
    Py_ssize_t kl;
    if (ns_key_args(args, &ns, &k, &kl) < 0) return NULL;
    uint32_t pins = 0;
    LOCK(l);
    uint32_t id = dir_find(&l->dir, ns, k, (uint32_t)kl);
    if (id) {
        Entry *e = entry_at(&l->dir, id);
        dir_unlink(&l->dir, id);
        l->dir.live--;
        pins = e->pins;
        if (pins) {
            e->state = E_DEAD;
            l->dir.dead++;
        } else {
            dir_release_id(&l->dir, id);
        }
    }
    UNLOCK(l);
    return PyLong_FromUnsignedLong(pins);
}

static PyObject *Lane_set_checksum(Lane *l, PyObject *args) {
    unsigned int ns;
    PyObject *key;
    unsigned long long sum;
    const uint8_t *k;
    Py_ssize_t kl;
    if (!PyArg_ParseTuple(args, "IOK", &ns, &key, &sum) || key_arg(key, &k, &kl) < 0) return NULL;
    LOCK(l);
    uint32_t id = dir_find(&l->dir, ns, k, (uint32_t)kl);
    if (id) entry_at(&l->dir, id)->checksum = sum;
    UNLOCK(l);
    return PyBool_FromLong(id != NO_ID);
}

/* pins(ns, key) -> int: the lane leases pinning a published block; -1 when it is not published. */
static PyObject *Lane_pins(Lane *l, PyObject *args) {
    uint32_t ns;
    const uint8_t *k;
    Py_ssize_t kl;
    if (ns_key_args(args, &ns, &k, &kl) < 0) return NULL;
    LOCK(l);
    uint32_t id = dir_find(&l->dir, ns, k, (uint32_t)kl);
    long pins = id ? (long)entry_at(&l->dir, id)->pins : -1;
    UNLOCK(l);
    return PyLong_FromLong(pins);
}

static int id_arg(PyObject *obj, const char **p, Py_ssize_t *len) {
    *p = PyUnicode_AsUTF8AndSize(obj, len);
    return *p ? 0 : -1;
}

/* add_session(session_id, part_base, limit_bytes, max_leases, lane_ok) -> bool (False: id too long). */
static PyObject *Lane_add_session(Lane *l, PyObject *args) {
    PyObject *sid;
    unsigned long long base, limit;
    unsigned int max_leases;
    int ok;
    const char *p;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OKKIp", &sid, &base, &limit, &max_leases, &ok) || id_arg(sid, &p, &n) < 0)
        return NULL;
    if (n > MAX_ID) Py_RETURN_FALSE;
    LOCK(l);
    uint32_t index;
    if (!strmap_get(&l->session_ids, p, (uint32_t)n, &index)) {
        for (index = 0; index < l->nsessions && l->sessions[index].used; index++) {
        }
        if (index == l->nsessions) {
            if (l->nsessions == l->cap_sessions) {
                uint32_t cap = l->cap_sessions ? l->cap_sessions * 2 : 64;
                Session *s = realloc(l->sessions, cap * sizeof(Session));
                if (!s) {
                    UNLOCK(l);
                    return PyErr_NoMemory();
                }
                l->sessions = s;
                l->cap_sessions = cap;
            }
            l->nsessions++;
        }
        memset(&l->sessions[index], 0, sizeof(Session));
        if (strmap_put(&l->session_ids, p, (uint32_t)n, index)) {
            UNLOCK(l);
            return PyErr_NoMemory();
        }
    }
    Session *s = &l->sessions[index];
    s->used = 1;
    s->lane_ok = (uint8_t)ok;
    s->idlen = (uint8_t)n;
    memcpy(s->id, p, (size_t)n);
    s->part_base = base;
    s->limit_bytes = limit;
    s->max_leases = max_leases;
    UNLOCK(l);
    Py_RETURN_TRUE;
}

static void drop_instances_of(Lane *l, uint32_t session) {
    for (uint32_t i = 0; i < l->ninstances; i++) {
        Instance *in = &l->instances[i];
        if (in->used && in->session == session) {
            strmap_del(&l->instance_ids, in->id, in->idlen);
            in->used = 0;
        }
    }
}

/* remove_session(session_id) -> int: the lane leases it still held, now released. */
static PyObject *Lane_remove_session(Lane *l, PyObject *args) {
    PyObject *sid;
    const char *p;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "O", &sid) || id_arg(sid, &p, &n) < 0) return NULL;
    long released = 0;
    LOCK(l);
    uint32_t index;
    if (n <= MAX_ID && strmap_get(&l->session_ids, p, (uint32_t)n, &index)) {
        for (uint64_t i = 0; i <= l->leases.mask; i++) {
            U64Slot *slot = &l->leases.slots[i];
            if (slot->key > 1 && ((Lease *)(uintptr_t)slot->value)->session == index) {
                end_lease(l, slot);
                released++;
            }
        }
        drop_instances_of(l, index);
        strmap_del(&l->session_ids, p, (uint32_t)n);
        l->sessions[index].used = 0;
    }
    UNLOCK(l);
    return PyLong_FromLong(released);
}

/* add_instance(instance_id, session_id, ns, block_bytes) -> bool (False: unknown session, long id). */
static PyObject *Lane_add_instance(Lane *l, PyObject *args) {
    PyObject *iid, *sid;
    unsigned int ns, block_bytes;
    const char *ip, *sp;
    Py_ssize_t in, sn;
    if (!PyArg_ParseTuple(args, "OOII", &iid, &sid, &ns, &block_bytes) || id_arg(iid, &ip, &in) < 0 ||
        id_arg(sid, &sp, &sn) < 0)
        return NULL;
    if (in > MAX_ID || sn > MAX_ID) Py_RETURN_FALSE;
    LOCK(l);
    uint32_t session, index;
    if (!strmap_get(&l->session_ids, sp, (uint32_t)sn, &session)) {
        UNLOCK(l);
        Py_RETURN_FALSE;
    }
    if (!strmap_get(&l->instance_ids, ip, (uint32_t)in, &index)) {
        for (index = 0; index < l->ninstances && l->instances[index].used; index++) {
        }
        if (index == l->ninstances) {
            if (l->ninstances == l->cap_instances) {
                uint32_t cap = l->cap_instances ? l->cap_instances * 2 : 64;
                Instance *a = realloc(l->instances, cap * sizeof(Instance));
                if (!a) {
                    UNLOCK(l);
                    return PyErr_NoMemory();
                }
                l->instances = a;
                l->cap_instances = cap;
            }
            l->ninstances++;
        }
        if (strmap_put(&l->instance_ids, ip, (uint32_t)in, index)) {
            UNLOCK(l);
            return PyErr_NoMemory();
        }
    }
    Instance *inst = &l->instances[index];
    inst->used = 1;
    inst->idlen = (uint8_t)in;
    memcpy(inst->id, ip, (size_t)in);
    inst->session = session;
    inst->ns = ns;
    inst->block_bytes = block_bytes;
    UNLOCK(l);
    Py_RETURN_TRUE;
}

static PyObject *Lane_remove_instance(Lane *l, PyObject *args) {
    PyObject *iid;
    const char *p;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "O", &iid) || id_arg(iid, &p, &n) < 0) return NULL;
    int removed = 0;
    LOCK(l);
    uint32_t index;
    if (n <= MAX_ID && strmap_get(&l->instance_ids, p, (uint32_t)n, &index)) {
        strmap_del(&l->instance_ids, p, (uint32_t)n);
        l->instances[index].used = 0;
        removed = 1;
    }
    UNLOCK(l);
    return PyBool_FromLong(removed);
}

/* charge(session_id, want_bytes, unit_bytes) -> granted bytes (a whole number of units), or -1 at the
   lease count limit, or None for a session the lane does not know (the engine's own quota applies).
   The engine's leases are charged here so that one quota covers both lanes exactly. */
static PyObject *Lane_charge(Lane *l, PyObject *args) {
    PyObject *sid;
    unsigned long long want, unit;
    const char *p;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OKK", &sid, &want, &unit) || id_arg(sid, &p, &n) < 0) return NULL;
    LOCK(l);
    Session *s = n <= MAX_ID ? find_session(l, p, (uint32_t)n, NULL) : NULL;
    if (!s) {
        UNLOCK(l);
        Py_RETURN_NONE;
    }
    long long granted;
    if (s->lane_leases + s->py_leases >= s->max_leases) {
        granted = -1;
    } else {
        uint64_t held = s->lane_bytes + s->py_bytes;
        uint64_t room = s->limit_bytes > held ? s->limit_bytes - held : 0;
        uint64_t g = want < room ? want : room;
        if (unit) g -= g % unit;
        if (g) {
            s->py_bytes += g;
            s->py_leases++;
        }
        granted = (long long)g;
    }
    UNLOCK(l);
    return PyLong_FromLongLong(granted);
}

/* uncharge(session_id, bytes): an engine lease that charge() granted has ended. */
static PyObject *Lane_uncharge(Lane *l, PyObject *args) {
    PyObject *sid;
    unsigned long long bytes;
    const char *p;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OK", &sid, &bytes) || id_arg(sid, &p, &n) < 0) return NULL;
    LOCK(l);
    Session *s = n <= MAX_ID ? find_session(l, p, (uint32_t)n, NULL) : NULL;
    if (s && bytes) {
        s->py_bytes = s->py_bytes > bytes ? s->py_bytes - bytes : 0;
        if (s->py_leases) s->py_leases--;
    }
    UNLOCK(l);
    Py_RETURN_NONE;
}

/* release(session_id, lease_id, loaded_bytes) -> (bytes, age_s) or None (unknown: tombstoned). For a
   lane lease released through the engine (a release that reports corrupt blocks, or sent there). */
static PyObject *Lane_release(Lane *l, PyObject *args) {
    PyObject *sid;
    unsigned long long lease_id, loaded;
    const char *p;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OKK", &sid, &lease_id, &loaded) || id_arg(sid, &p, &n) < 0) return NULL;
    uint64_t now = now_ns();
    LOCK(l);
    uint32_t si;
    Session *s = n <= MAX_ID ? find_session(l, p, (uint32_t)n, &si) : NULL;
    U64Slot *slot = s ? u64map_get(&l->leases, lease_id) : NULL;
    if (!slot || ((Lease *)(uintptr_t)slot->value)->session != si) {
        if (!slot && lease_id > 1) tombstone(l, lease_id, now);
        UNLOCK(l);
        Py_RETURN_NONE;
    }
    Lease *lease = (Lease *)(uintptr_t)slot->value;
    uint64_t bytes = lease->bytes, age = now - lease->created;
    end_lease(l, slot);
    l->counts[C_RELEASES]++;
    l->counts[C_LOADED_BYTES] += loaded < bytes ? loaded : bytes;
    UNLOCK(l);
    return Py_BuildValue("(Kd)", (unsigned long long)bytes, (double)age / 1e9);
}

/* lease_keys(session_id, lease_id) -> [(ns, key), ...] or None: what a lane lease pins. */
static PyObject *Lane_lease_keys(Lane *l, PyObject *args) {
    PyObject *sid;
    unsigned long long lease_id;
    const char *p;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OK", &sid, &lease_id) || id_arg(sid, &p, &n) < 0) return NULL;
    LOCK(l);
    uint32_t si;
    Session *s = n <= MAX_ID ? find_session(l, p, (uint32_t)n, &si) : NULL;
    U64Slot *slot = s ? u64map_get(&l->leases, lease_id) : NULL;
    if (!slot || ((Lease *)(uintptr_t)slot->value)->session != si) {
        UNLOCK(l);
        Py_RETURN_NONE;
    }
    Lease *lease = (Lease *)(uintptr_t)slot->value;
    /* Copied under the lock into a plain buffer; Python objects are made after it. */
    uint32_t count = lease->n;
    uint8_t *copy = malloc((size_t)count * (MAX_KEY + 5) + 1);
    if (!copy) {
        UNLOCK(l);
        return PyErr_NoMemory();
    }
    for (uint32_t i = 0; i < count; i++) {
        Entry *e = entry_at(&l->dir, lease->entries[i]);
        uint8_t *q = copy + (size_t)i * (MAX_KEY + 5);
        put32(q, e->ns);
        q[4] = e->klen;
        memcpy(q + 5, e->key, e->klen);
    }
    UNLOCK(l);
    PyObject *out = PyList_New(count);
    for (uint32_t i = 0; out && i < count; i++) {
        uint8_t *q = copy + (size_t)i * (MAX_KEY + 5);
        PyObject *item = Py_BuildValue("(Iy#)", get32(q), (const char *)q + 5, (Py_ssize_t)q[4]);
        if (!item) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, item);
    }
    free(copy);
    return out;
}

/* expire(now_s=None) -> int: lane leases past their TTL released; stale tombstones dropped. */
static PyObject *Lane_expire(Lane *l, PyObject *args) {
    double at = -1.0;
    if (!PyArg_ParseTuple(args, "|d", &at)) return NULL;
    uint64_t now = at < 0 ? now_ns() : (uint64_t)(at * 1e9);
    long expired = 0;
    LOCK(l);
    for (uint64_t i = 0; i <= l->leases.mask; i++) {
        U64Slot *slot = &l->leases.slots[i];
        if (slot->key > 1 && ((Lease *)(uintptr_t)slot->value)->expires <= now) {
            end_lease(l, slot);
            expired++;
        }
    }
    for (uint64_t i = 0; i <= l->tombstones.mask; i++) {
        U64Slot *slot = &l->tombstones.slots[i];
        if (slot->key > 1 && slot->value <= now) u64map_del_slot(&l->tombstones, slot);
    }
    l->counts[C_EXPIRED] += (uint64_t)expired;
    UNLOCK(l);
    return PyLong_FromLong(expired);
}

/* drain() -> bytes: the signal records appended since the last drain (u32 length + body each). */
static PyObject *Lane_drain(Lane *l, PyObject *noargs) {
    uint64_t junk;
    ssize_t rc = read(l->signal_fd, &junk, sizeof junk);
    (void)rc;
    /* Copied under the lock (a few KB between two passes, typically), so any thread may drain. */
    LOCK(l);
    PyObject *out = PyBytes_FromStringAndSize((const char *)l->sig, (Py_ssize_t)l->sig_len);
    if (out) l->sig_len = 0;
    UNLOCK(l);
    return out;
}

/* take_counts() -> tuple of the counters since the last call (C_* order). */
static PyObject *Lane_take_counts(Lane *l, PyObject *noargs) {
    uint64_t c[C_COUNT];
    LOCK(l);
    memcpy(c, l->counts, sizeof c);
    memset(l->counts, 0, sizeof l->counts);
    UNLOCK(l);
    PyObject *t = PyTuple_New(C_COUNT);
    for (int i = 0; t && i < C_COUNT; i++) PyTuple_SET_ITEM(t, i, PyLong_FromUnsignedLongLong(c[i]));
    return t;
}

static PyObject *Lane_stats(Lane *l, PyObject *noargs) {
    LOCK(l);
    unsigned long long live = l->dir.live, dead = l->dir.dead, pinned = l->lane_pinned_entries,
                       leases = l->leases.used, tombs = l->tombstones.used, conns = l->nconns,
                       evicted = l->evicted, idle = l->idle_closed, refused = l->refused,
                       perr = l->protocol_errors, sig = l->sig_len, undone = l->undone_leases,
                       lease_slots = l->leases.mask + 1, session_slots = l->session_ids.mask + 1;
    unsigned long long leased = 0, sessions = 0;
    for (uint32_t i = 0; i < l->nsessions; i++)
        if (l->sessions[i].used) {
            sessions++;
            leased += l->sessions[i].lane_bytes;
        }
    UNLOCK(l);
    return Py_BuildValue("{sKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsK}", "published", live, "retired_pinned", dead,
                         "pinned_blocks", pinned, "leases", leases, "leased_bytes", leased, "tombstones", tombs,
                         "sessions", sessions, "connections", conns, "evicted_connections", evicted,
                         "idle_closed_connections", idle, "refused_connections", refused, "protocol_errors", perr,
                         "signal_bytes_pending", sig, "undone_leases", undone, "lease_slots", lease_slots,
                         "session_slots", session_slots);
}

/* serve(listen_fd, hello, max_connections, idle_timeout_s, max_frame_bytes, frame_timeout_s,
   buffered_limit_bytes): starts the serving thread on a listening socket (a dup of it is kept). */
static PyObject *Lane_serve(Lane *l, PyObject *args) {
    int fd;
    Py_buffer hello;
    unsigned int max_conns, max_frame;
    double idle_s, frame_s;
    unsigned long long buffered_limit;
    if (!PyArg_ParseTuple(args, "iy*IdIdK", &fd, &hello, &max_conns, &idle_s, &max_frame, &frame_s,
                          &buffered_limit))
        return NULL;
    if (l->serving || hello.len > (Py_ssize_t)sizeof l->hello || max_conns < 1) {
        PyBuffer_Release(&hello);
        PyErr_SetString(PyExc_RuntimeError, "the read lane serves once, with a short greeting");
        return NULL;
    }
    memcpy(l->hello, hello.buf, (size_t)hello.len);
    l->hello_len = (size_t)hello.len;
    PyBuffer_Release(&hello);
    l->max_conns = max_conns;
    l->idle_timeout_ns = (uint64_t)(idle_s * 1e9);
    l->frame_timeout_ns = (uint64_t)(frame_s * 1e9);
    l->max_frame = max_frame;
    l->buffered_limit = buffered_limit;
    l->listen_fd = fcntl(fd, F_DUPFD_CLOEXEC, 3);
    l->epoll_fd = epoll_create1(EPOLL_CLOEXEC);
    if (l->listen_fd < 0 || l->epoll_fd < 0) return PyErr_SetFromErrno(PyExc_OSError);
    int flags = fcntl(l->listen_fd, F_GETFL);
    fcntl(l->listen_fd, F_SETFL, flags | O_NONBLOCK);
    struct epoll_event a = {.events = EPOLLIN, .data.ptr = &l->listen_fd};
    struct epoll_event b = {.events = EPOLLIN, .data.ptr = &l->stop_fd};
    if (epoll_ctl(l->epoll_fd, EPOLL_CTL_ADD, l->listen_fd, &a) || epoll_ctl(l->epoll_fd, EPOLL_CTL_ADD, l->stop_fd, &b))
        return PyErr_SetFromErrno(PyExc_OSError);
    int rc = pthread_create(&l->thread, NULL, serve_loop, l);
    if (rc) {
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    l->serving = 1;
    Py_RETURN_NONE;
}

/* stop(): says GOODBYE to every connection and ends the serving thread (idempotent). */
static PyObject *Lane_stop(Lane *l, PyObject *noargs) {
    if (l->serving) {
        uint64_t one = 1;
        ssize_t rc = write(l->stop_fd, &one, sizeof one);
        (void)rc;
        Py_BEGIN_ALLOW_THREADS pthread_join(l->thread, NULL);
        Py_END_ALLOW_THREADS l->serving = 0;
        close(l->listen_fd);
        l->listen_fd = -1;
    }
    Py_RETURN_NONE;
}

static PyObject *Lane_set_fallback_on_miss(Lane *l, PyObject *args) {
    int value;
    if (!PyArg_ParseTuple(args, "p", &value)) return NULL;
    LOCK(l);
    l->fallback_on_miss = value;
    UNLOCK(l);
    Py_RETURN_NONE;
}

static PyObject *Lane_get_signal_fd(Lane *l, void *closure) { return PyLong_FromLong(l->signal_fd); }

static PyMethodDef Lane_methods[] = {
    {"publish", (PyCFunction)Lane_publish, METH_VARARGS, "publish(ns, keys, slots, length, checksums)"},
    {"unpublish", (PyCFunction)Lane_unpublish, METH_VARARGS, "unpublish(ns, key) -> bool"},
    {"unpublish_many", (PyCFunction)Lane_unpublish_many, METH_O, "unpublish_many([(ns, key)]) -> mask"},
    {"retire", (PyCFunction)Lane_retire, METH_VARARGS, "retire(ns, key) -> lane pins left"},
    {"set_checksum", (PyCFunction)Lane_set_checksum, METH_VARARGS, "set_checksum(ns, key, checksum)"},
    {"pins", (PyCFunction)Lane_pins, METH_VARARGS, "pins(ns, key) -> int (-1: not published)"},
    {"add_session", (PyCFunction)Lane_add_session, METH_VARARGS, NULL},
    {"remove_session", (PyCFunction)Lane_remove_session, METH_VARARGS, NULL},
    {"add_instance", (PyCFunction)Lane_add_instance, METH_VARARGS, NULL},
    {"remove_instance", (PyCFunction)Lane_remove_instance, METH_VARARGS, NULL},
    {"charge", (PyCFunction)Lane_charge, METH_VARARGS, NULL},
    {"uncharge", (PyCFunction)Lane_uncharge, METH_VARARGS, NULL},
    {"release", (PyCFunction)Lane_release, METH_VARARGS, NULL},
    {"lease_keys", (PyCFunction)Lane_lease_keys, METH_VARARGS, NULL},
    {"expire", (PyCFunction)Lane_expire, METH_VARARGS, NULL},
    {"drain", (PyCFunction)Lane_drain, METH_NOARGS, NULL},
    {"take_counts", (PyCFunction)Lane_take_counts, METH_NOARGS, NULL},
    {"stats", (PyCFunction)Lane_stats, METH_NOARGS, NULL},
    {"serve", (PyCFunction)Lane_serve, METH_VARARGS, NULL},
    {"stop", (PyCFunction)Lane_stop, METH_NOARGS, NULL},
    {"set_fallback_on_miss", (PyCFunction)Lane_set_fallback_on_miss, METH_VARARGS, NULL},
    {NULL}};

static PyGetSetDef Lane_getset[] = {{"signal_fd", (getter)Lane_get_signal_fd, NULL, NULL, NULL}, {NULL}};

static PyTypeObject LaneType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_pegaflow_read_lane.Lane",
    .tp_basicsize = sizeof(Lane),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Lane_init,
    .tp_dealloc = (destructor)Lane_dealloc,
    .tp_methods = Lane_methods,
    .tp_getset = Lane_getset,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, MODULE_NAME, "pegaflow's read lane (native)", -1, NULL};

#define CONCAT2(a, b) a##b
#define CONCAT(a, b) CONCAT2(a, b)
PyMODINIT_FUNC CONCAT(PyInit_, MODULE_SYMBOL)(void) {
    if (PyType_Ready(&LaneType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&LaneType);
    if (PyModule_AddObject(m, "Lane", (PyObject *)&LaneType) < 0) {
        Py_DECREF(&LaneType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "COUNTERS", C_COUNT);
    return m;
}
