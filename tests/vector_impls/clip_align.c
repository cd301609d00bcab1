/* Two kvspec reference functions in C, answering kvspec test vectors (CLIP-1, ALIGN-1, NULL-1).
 *
 * The contract of `kvspec vectors check`: one vector (a JSON object) on stdin,
 * one answer on stdout: {"output": ...}, {"error": {"class": "..."}} or
 * {"unsupported": true}. This file implements get_exchange_clipped_blocks and
 * compute_block_pairs and answers "unsupported" for every other function. Its JSON
 * reading is just enough for these two inputs (lists of lists of integers).
 *
 *   cc -O2 -o clip_align clip_align.c
 *   kvspec vectors check DIR --command ./clip_align
 */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUPS 32
#define MAX_IDS 4096

typedef struct {
    int n;
    long ids[MAX_IDS];
} group_t;

typedef struct {
    int n;
    group_t g[MAX_GROUPS];
} lists_t;

static lists_t first, second, out_p, out_c;
static long budgets[MAX_GROUPS];

static const char *skip(const char *s) {
    while (*s && isspace((unsigned char)*s)) s++;
    return s;
}

/* The value after "key": at or after `from`, or NULL. */
static const char *find_key(const char *from, const char *key) {
    char pattern[64];
    snprintf(pattern, sizeof pattern, "\"%s\"", key);
    const char *p = strstr(from, pattern);
    if (!p) return NULL;
    p = skip(p + strlen(pattern));
    return *p == ':' ? skip(p + 1) : NULL;
}

/* [1, 2, 3] -> out; returns the position after ']' or NULL. */
static const char *parse_ints(const char *s, long *out, int *n, int cap) {
    *n = 0;
    s = skip(s);
    if (*s != '[') return NULL;
    s = skip(s + 1);
    if (*s == ']') return s + 1;
    for (;;) {
        char *end;
        long value = strtol(s, &end, 10);
        if (end == s || *n >= cap) return NULL;
        out[(*n)++] = value;
        s = skip(end);
        if (*s == ',') { s = skip(s + 1); continue; }
        return *s == ']' ? s + 1 : NULL;
    }
}

/* [[1, 2], [3]] -> lists; returns the position after the outer ']' or NULL. */
static const char *parse_lists(const char *s, lists_t *lists) {
    lists->n = 0;
    s = skip(s);
    if (*s != '[') return NULL;
    s = skip(s + 1);
    if (*s == ']') return s + 1;
    for (;;) {
        if (lists->n >= MAX_GROUPS) return NULL;
        group_t *g = &lists->g[lists->n++];
        s = parse_ints(s, g->ids, &g->n, MAX_IDS);
        if (!s) return NULL;
        s = skip(s);
        if (*s == ',') { s = skip(s + 1); continue; }
        return *s == ']' ? s + 1 : NULL;
    }
}

static void print_lists(const lists_t *lists) {
    putchar('[');
    for (int g = 0; g < lists->n; g++) {
        printf(g ? ", [" : "[");
        for (int i = 0; i < lists->g[g].n; i++) printf(i ? ", %ld" : "%ld", lists->g[g].ids[i]);
        putchar(']');
    }
    putchar(']');
}

static int error(const char *cls) {
    printf("{\"error\": {\"class\": \"%s\"}}\n", cls);
    return 0;
}

/* Keep each budgeted group's last n ids; others unchanged; zero groups stay zero (CLIP-1). */
static int clip(const char *input) {
    const char *ids = find_key(input, "block_ids"), *budget = find_key(input, "budgets");
    int n_budgets = 0;
    if (!ids || !budget || !parse_lists(ids, &first) || !parse_ints(budget, budgets, &n_budgets, MAX_GROUPS)) {
        return error("ConfigError");
    }
    if (first.n == 0) return printf("{\"output\": []}\n"), 0;  /* full prefix hit */
    if (first.n != n_budgets) return error("GroupCountError");
    for (int g = 0; g < n_budgets; g++) {
        if (budgets[g] < 0) return error("ConfigError");
    }
    for (int g = 0; g < first.n; g++) {
        group_t *group = &first.g[g];
        long keep = budgets[g];
        if (keep > 0 && group->n > keep) {  /* n > 0 only: a zero budget keeps everything */
            memmove(group->ids, group->ids + (group->n - keep), (size_t)keep * sizeof(long));
            group->n = (int)keep;
        }
    }
    printf("{\"output\": ");
    print_lists(&first);
    printf("}\n");
    return 0;
}

/* Pair C's i-th id with P's id at len(P) - len(C) + i; drop pairs with a null side (ALIGN-1, NULL-1). */
static int align(const char *input) {
    const char *p = find_key(input, "producer_block_ids"), *c = find_key(input, "consumer_block_ids");
    if (!p || !c || !parse_lists(p, &first) || !parse_lists(c, &second)) return error("ConfigError");
    out_p.n = out_c.n = 0;
    if (second.n != 0) {
        if (first.n != second.n) return error("GroupCountError");
        for (int g = 0; g < second.n; g++) {
            group_t *pg = &first.g[g], *cg = &second.g[g];
            if (cg->n > pg->n) return error("BlockAlignmentError");
            int offset = pg->n - cg->n;  /* tail alignment: never front-trim */
            group_t *op = &out_p.g[out_p.n++], *oc = &out_c.g[out_c.n++];
            op->n = oc->n = 0;
            for (int i = 0; i < cg->n; i++) {
                long pid = pg->ids[offset + i], cid = cg->ids[i];
                if (pid == 0 || cid == 0) continue;  /* the null block never moves */
                op->ids[op->n++] = pid;
                oc->ids[oc->n++] = cid;
            }
        }
    }
    printf("{\"output\": {\"consumer_block_ids\": ");
    print_lists(&out_c);
    printf(", \"producer_block_ids\": ");
    print_lists(&out_p);
    printf("}}\n");
    return 0;
}

int main(void) {
    static char text[1 << 22];
    size_t n = fread(text, 1, sizeof text - 1, stdin);
    text[n] = '\0';
    const char *function = find_key(text, "function"), *input = find_key(text, "input");
    if (function && input && strncmp(function, "\"get_exchange_clipped_blocks\"", 29) == 0) return clip(input);
    if (function && input && strncmp(function, "\"compute_block_pairs\"", 21) == 0) return align(input);
    printf("{\"unsupported\": true}\n");
    return 0;
}
