/*
 * The least a conventional TCPStore server pays on this machine: the yardstick the store
 * benchmark measures elastix-store and torch's server against (benches/store_bench.py).
 *
 * One thread, one level-triggered epoll loop. Per wake-up of a connection: one read() into its
 * buffer, every complete request in it parsed and answered into its output buffer, one write()
 * of all the replies. The table is open addressing (FNV-1a, linear probing) over one arena;
 * nothing is allocated per request (a key's first SET takes its slot and arena bytes, a value
 * that outgrows its slot moves to the arena's end once).
 *
 * What it leaves out, on purpose (a floor does only what the benchmark's load needs, torch's
 * wire protocol for it: tcpstore-wire-protocol.md): VALIDATE, PING, SET, GET, ADD only (any
 * other opcode closes the connection); GET of a missing key answers an empty value instead of
 * waiting; no WAIT, CHECK, DELETE, authentication, connection limits, table growth past
 * TABLE_SLOTS keys or arena bytes past ARENA_BYTES (the server exits saying so), no freeing
 * of overwritten values, and a client that sends more than a buffer's worth of requests
 * without reading the replies is closed. Not for use as a store.
 *
 *   cc -O2 -o epoll_store epoll_store.c && ./epoll_store   # prints its port
 */
#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

enum { VALIDATE = 0, SET = 1, GET = 3, ADD = 4, PING = 13 };
#define MAX_CONNS 65536
#define BUF_BYTES (64 * 1024)
#define TABLE_SLOTS (1u << 20)
#define ARENA_BYTES ((size_t)1 << 30)

struct entry { uint64_t hash; uint32_t key_at, key_len, value_at, value_len, value_cap; int used; };
struct conn { uint32_t in_len, out_len; uint8_t in[BUF_BYTES], out[BUF_BYTES]; };

static struct entry *table;
static uint8_t *arena;
static size_t arena_used;
static struct conn *conns[MAX_CONNS];

static void die(const char *what) { perror(what); exit(1); }

static uint32_t arena_put(const uint8_t *bytes, uint32_t len, uint32_t room) {
    if (arena_used + room > ARENA_BYTES) { fprintf(stderr, "epoll_store: arena full\n"); exit(1); }
    uint32_t at = (uint32_t)arena_used;
    memcpy(arena + at, bytes, len);
    arena_used += room;
    return at;
}

static uint64_t fnv1a(const uint8_t *p, uint64_t n) {
    uint64_t h = 1469598103934665603ull;
    for (uint64_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

/* The key's entry, made (with an empty value) when `make` and it is missing. */
static struct entry *find(const uint8_t *key, uint32_t len, int make) {
    uint64_t h = fnv1a(key, len);
    for (uint32_t i = (uint32_t)h & (TABLE_SLOTS - 1), probes = 0; probes < TABLE_SLOTS;
         i = (i + 1) & (TABLE_SLOTS - 1), probes++) {
        struct entry *e = &table[i];
        if (!e->used) {
            if (!make) return NULL;
            *e = (struct entry){.hash = h, .key_at = arena_put(key, len, len), .key_len = len, .used = 1};
            return e;
        }
        if (e->hash == h && e->key_len == len && memcmp(arena + e->key_at, key, len) == 0) return e;
    }
    fprintf(stderr, "epoll_store: table full\n");
    exit(1);
}

static void set_value(struct entry *e, const uint8_t *value, uint32_t len) {
    if (len <= e->value_cap) memcpy(arena + e->value_at, value, len);
    else e->value_at = arena_put(value, len, e->value_cap = len < 64 ? 64 : len);
    e->value_len = len;
}

static uint64_t u64_at(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

static void reply(struct conn *c, const void *bytes, uint32_t len) {
    memcpy(c->out + c->out_len, bytes, len);
    c->out_len += len;
}

/* Handles the request at `p` (`avail` bytes): its length, 0 if incomplete, -1 to close. */
static long handle(struct conn *c, const uint8_t *p, uint64_t avail) {
    if (avail < 1) return 0;
    uint64_t klen, vlen;
    switch (p[0]) {
    case VALIDATE:
        return avail < 5 ? 0 : 5; /* the magic is not checked: a floor trusts its one client */
    case PING:
        if (avail < 5) return 0;
        if (c->out_len + 4 > BUF_BYTES) return -1;
        reply(c, p + 1, 4);
        return 5;
    case SET:
        if (avail < 9 || avail < 17 + (klen = u64_at(p + 1))) return 0;
        vlen = u64_at(p + 9 + klen);
        if (avail < 17 + klen + vlen) return 0;
        set_value(find(p + 9, (uint32_t)klen, 1), p + 17 + klen, (uint32_t)vlen);
        return (long)(17 + klen + vlen);
    case GET: {
        if (avail < 9 || avail < 9 + (klen = u64_at(p + 1))) return 0;
        struct entry *e = find(p + 9, (uint32_t)klen, 0);
        uint64_t len = e ? e->value_len : 0;
        if (c->out_len + 8 + len > BUF_BYTES) return -1;
        reply(c, &len, 8);
        if (e) reply(c, arena + e->value_at, e->value_len);
        return (long)(9 + klen);
    }
    case ADD: {
        if (avail < 9 || avail < 17 + (klen = u64_at(p + 1))) return 0;
        if (c->out_len + 8 > BUF_BYTES) return -1;
        int64_t delta;
        memcpy(&delta, p + 9 + klen, 8);
        struct entry *e = find(p + 9, (uint32_t)klen, 1);
        char text[24]; /* the value is its decimal text, as torch's servers keep it */
        uint32_t n = e->value_len < 23 ? e->value_len : 23;
        memcpy(text, arena + e->value_at, n);
        text[n] = 0;
        int64_t value = strtoll(text, NULL, 10) + delta;
        set_value(e, (uint8_t *)text, (uint32_t)snprintf(text, sizeof text, "%lld", (long long)value));
        reply(c, &value, 8);
        return (long)(17 + klen);
    }
    default:
        return -1;
    }
}

static void drop(int epoll, int fd) {
    epoll_ctl(epoll, EPOLL_CTL_DEL, fd, NULL);
    close(fd);
    free(conns[fd]);
    conns[fd] = NULL;
}

/* One wake-up of a connection: one read, every complete request, one write. */
static void serve(int epoll, int fd) {
    struct conn *c = conns[fd];
    ssize_t got = read(fd, c->in + c->in_len, BUF_BYTES - c->in_len);
    if (got <= 0) {
        if (got < 0 && errno == EAGAIN) return;
        drop(epoll, fd);
        return;
    }
    c->in_len += (uint32_t)got;
    uint32_t at = 0;
    long used;
    while ((used = handle(c, c->in + at, c->in_len - at)) > 0) at += (uint32_t)used;
    if (used < 0 || (at == 0 && c->in_len == BUF_BYTES)) { drop(epoll, fd); return; }
    memmove(c->in, c->in + at, c->in_len - at);
    c->in_len -= at;
    if (c->out_len) {
        /* the closed-loop client reads its replies: a short write is not expected here */
        if (write(fd, c->out, c->out_len) != (ssize_t)c->out_len) { drop(epoll, fd); return; }
        c->out_len = 0;
    }
}

int main(void) {
    table = calloc(TABLE_SLOTS, sizeof *table);
    arena = malloc(ARENA_BYTES);
    if (!table || !arena) die("malloc");
    int listener = socket(AF_INET6, SOCK_STREAM | SOCK_NONBLOCK, 0), off = 0, on = 1;
    if (listener < 0) die("socket");
    setsockopt(listener, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof off);
    struct sockaddr_in6 addr = {.sin6_family = AF_INET6, .sin6_addr = in6addr_any};
    socklen_t addr_len = sizeof addr;
    if (bind(listener, (struct sockaddr *)&addr, addr_len) || listen(listener, 4096)) die("listen");
    getsockname(listener, (struct sockaddr *)&addr, &addr_len);
    printf("%d\n", ntohs(addr.sin6_port));
    fflush(stdout);
    int epoll = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = listener}, events[256];
    epoll_ctl(epoll, EPOLL_CTL_ADD, listener, &ev);
    for (;;) {
        int n = epoll_wait(epoll, events, 256, -1);
        for (int i = 0; i < n; i++) {
            int fd = events[i].data.fd;
            if (fd != listener) { serve(epoll, fd); continue; }
            int client;
            while ((client = accept4(listener, NULL, NULL, SOCK_NONBLOCK)) >= 0) {
                if (client >= MAX_CONNS || !(conns[client] = calloc(1, sizeof(struct conn)))) { close(client); continue; }
                setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
                ev = (struct epoll_event){.events = EPOLLIN, .data.fd = client};
                epoll_ctl(epoll, EPOLL_CTL_ADD, client, &ev);
            }
        }
    }
}
