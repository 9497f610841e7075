/* bico transfer's progress display: the driver's structured progress
 * (bico_transfer_set_progress) drawn as a bar redrawn in place on a
 * terminal, or as plain lines (at most one per 5 seconds) otherwise. */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"

/* "1:02:03" or "2:03" for s seconds. */
static void hms(double s, char *buf, size_t cap) {
  if (!(s >= 0)) s = 0;
  unsigned long t = (unsigned long)(s + 0.5);
  if (t >= 3600)
    snprintf(buf, cap, "%lu:%02lu:%02lu", t / 3600, t / 60 % 60, t % 60);
  else
    snprintf(buf, cap, "%lu:%02lu", t / 60, t % 60);
}

void cli_progress_text(const bico_progress *p, int bar, const char *unit,
                       char *buf, size_t cap) {
  double frac = p->total > 0 ? p->done / p->total : 1;
  if (frac > 1) frac = 1;
  if (frac < 0) frac = 0;
  char el[32], left[32];
  hms(p->elapsed, el, sizeof el);
  /* What is left at the pace so far (work units per second); unknown
   * until some work is done. */
  if (frac > 0 && frac < 1)
    hms(p->elapsed * (1 - frac) / frac, left, sizeof left);
  else
    snprintf(left, sizeof left, frac >= 1 ? "0:00" : "?");
  size_t n = 0;
  if (bar) {
    enum { W = 30 };
    int fill = (int)(frac * W + 0.5);
    n += (size_t)snprintf(buf + n, cap - n, "[");
    for (int k = 0; k < W && n + 1 < cap; k++) buf[n++] = k < fill ? '#' : '.';
    buf[n] = '\0';
    n += (size_t)snprintf(buf + n, cap > n ? cap - n : 0, "] ");
  }
  if (n < cap)
    snprintf(buf + n, cap - n,
             "bico: %3.0f%% (%zu/%zu %s), %s elapsed, ~%s left",
             100 * frac, p->tensors_done, p->tensors_total, unit, el, left);
}

typedef struct {
  const char *unit; /* what tensors_done counts: "tensors", "modules" */
  int tty;
  double last; /* elapsed at the last line printed */
  int drawn;   /* a bar is on the line */
} pstate;

static pstate PS;

static void on_progress(void *opaque, const bico_progress *p) {
  pstate *s = opaque;
  char line[256];
  int end = p->done >= p->total;
  if (s->tty) {
    /* redraw at most ten times a second, and at the end */
    if (!end && s->drawn && p->elapsed - s->last < 0.1) return;
    cli_progress_text(p, 1, s->unit, line, sizeof line);
    fprintf(stderr, "\r%s\033[K%s", line, end ? "\n" : "");
    fflush(stderr);
    s->drawn = !end;
  } else {
    if (!end && p->elapsed - s->last < 5) return;
    if (end && p->elapsed < 5) return; /* short runs: the summary says it */
    cli_progress_text(p, 0, s->unit, line, sizeof line);
    fprintf(stderr, "%s\n", line);
  }
  s->last = p->elapsed;
}

void cli_progress_clear(void) {
  if (PS.tty && PS.drawn) {
    fputs("\r\033[K", stderr);
    PS.drawn = 0;
  }
}

void cli_progress_finish(void) {
  if (PS.tty && PS.drawn) {
    fputs("\n", stderr);
    PS.drawn = 0;
  }
}

bico_status cli_progress_install(bico_transfer *t, int lora) {
  memset(&PS, 0, sizeof PS);
  PS.tty = isatty(2) == 1;
  PS.unit = lora ? "modules" : "tensors"; /* the LoRA branch counts modules */
  return bico_transfer_set_progress(t, on_progress, &PS);
}

bico_status cli_progress_install_merge(bico_merge *m) {
  memset(&PS, 0, sizeof PS);
  PS.tty = isatty(2) == 1;
  PS.unit = "tensors";
  return bico_merge_set_progress(m, on_progress, &PS);
}
