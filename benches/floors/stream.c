/*
 * Memory bandwidth a core gets on this machine, as STREAM measures it: the copy (b = a) and
 * the add (c = a + b, float32: what a reduction does) kernels over arrays far larger than the
 * caches, best of several passes, with 1..N cores running the kernel at once (each its own
 * arrays, as ranks of a collective each work on their own part). Bytes counted as STREAM
 * counts them: copy moves 2 bytes per byte copied (read + write), add 3.
 *
 * Prints one JSON line per kernel and core count, which benches/collectives_bench.py reads
 * for its roofline (the bandwidth one core gets while the others work too).
 *
 *   cc -O2 -pthread -o stream stream.c && ./stream [MiB per array, default 256] [max cores]
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define PASSES 5

struct worker { size_t n; float *a, *b, *c; int add; double best_s; pthread_barrier_t *start; };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *run(void *arg) {
    struct worker *w = arg;
    w->best_s = 1e30;
    for (int pass = 0; pass < PASSES; pass++) {
        pthread_barrier_wait(w->start); /* every core starts each pass together */
        double began = now();
        if (w->add)
            for (size_t i = 0; i < w->n; i++) w->c[i] = w->a[i] + w->b[i];
        else
            memcpy(w->b, w->a, w->n * sizeof(float));
        double taken = now() - began;
        if (taken < w->best_s) w->best_s = taken;
    }
    return NULL;
}

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 256;
    long cores = argc > 2 ? strtol(argv[2], NULL, 10) : sysconf(_SC_NPROCESSORS_ONLN);
    size_t n = mib * 1024 * 1024 / sizeof(float);
    for (int add = 0; add <= 1; add++) {
        for (long k = 1; k <= cores; k++) {
            struct worker w[k];
            pthread_t threads[k];
            pthread_barrier_t start;
            pthread_barrier_init(&start, NULL, (unsigned)k);
            for (long i = 0; i < k; i++) {
                w[i] = (struct worker){.n = n, .add = add, .start = &start};
                w[i].a = malloc(n * sizeof(float));
                w[i].b = malloc(n * sizeof(float));
                w[i].c = add ? malloc(n * sizeof(float)) : NULL;
                if (!w[i].a || !w[i].b || (add && !w[i].c)) { perror("malloc"); return 1; }
                for (size_t j = 0; j < n; j++) w[i].a[j] = w[i].b[j] = (float)j; /* touched: no page faults timed */
                if (add) memset(w[i].c, 0, n * sizeof(float));
            }
            for (long i = 0; i < k; i++) pthread_create(&threads[i], NULL, run, &w[i]);
            double worst = 0;
            for (long i = 0; i < k; i++) {
                pthread_join(threads[i], NULL);
                if (w[i].best_s > worst) worst = w[i].best_s;
                free(w[i].a), free(w[i].b), free(w[i].c);
            }
            double moved = (add ? 3.0 : 2.0) * n * sizeof(float);
            printf("{\"kernel\": \"%s\", \"cores\": %ld, \"mib\": %zu, \"per_core_gbs\": %.2f, \"total_gbs\": %.2f}\n",
                   add ? "add" : "copy", k, mib, moved / worst / 1e9, k * moved / worst / 1e9);
            pthread_barrier_destroy(&start);
        }
    }
    return 0;
}
