/* The demo's report: a table per target (methods x tasks) of test accuracy
 * and of the share of the zero-shot -> fine-tuned gap each method closes,
 * as text or Markdown, and a hand-written SVG bar chart. */
#include <string.h>

#include "demo.h"

/* Share (percent) of the zero-shot -> fine-tuned gap closed; the gap is
 * undefined when fine-tuning did not beat zero-shot. */
static int gap(const demo_result *r, int t, int k, int m, double *out) {
  double z = r->acc[t][k][DEMO_M_ZERO], f = r->acc[t][k][DEMO_M_FT];
  double a = r->acc[t][k][m];
  if (a < 0 || f - z < 1e-9) return 0;
  *out = 100.0 * (a - z) / (f - z);
  return 1;
}

/* Mean accuracy and mean gap share over the tasks; 0 if any is missing. */
static int average(const demo_result *r, int t, int m, double *acc,
                   double *share, int *share_ok) {
  double sa = 0, sg = 0;
  int ng = 0;
  for (int k = 0; k < r->ntasks; k++) {
    double g;
    if (r->acc[t][k][m] < 0) return 0;
    sa += r->acc[t][k][m];
    if (gap(r, t, k, m, &g)) {
      sg += g;
      ng++;
    }
  }
  *acc = sa / r->ntasks;
  *share_ok = ng == r->ntasks;
  *share = ng ? sg / ng : 0;
  return 1;
}

static void cell(char *buf, size_t cap, int ok, double acc, int gok,
                 double share) {
  if (!ok) snprintf(buf, cap, "-");
  else if (gok) snprintf(buf, cap, "%.1f (%+.0f%%)", acc, share);
  else snprintf(buf, cap, "%.1f", acc);
}

void demo_report_text(FILE *f, const demo_result *r, int md) {
  char buf[64];
  for (int t = 0; t < r->ntargets; t++) {
    if (md)
      fprintf(f, "\n### %s (%s), source A (%s)\n\n| method |", r->target_names[t],
              r->target_shapes[t], r->source_shape);
    else
      fprintf(f, "\n%s (%s), source A (%s): test accuracy %% (share of the "
                 "zero-shot -> fine-tuned gap closed)\n%-11s",
              r->target_names[t], r->target_shapes[t], r->source_shape, "method");
    for (int k = 0; k < r->ntasks; k++)
      fprintf(f, md ? " %s |" : " %15s", demo_task_name(r->tasks[k]));
    fprintf(f, md ? " average |\n|---|" : " %15s\n", "average");
    if (md) {
      for (int k = 0; k <= r->ntasks; k++) fprintf(f, "---:|");
      fprintf(f, "\n");
    }
    for (int m = 0; m < DEMO_NMETHODS; m++) {
      fprintf(f, md ? "| %s |" : "%-11s", demo_method_name(m));
      for (int k = 0; k < r->ntasks; k++) {
        double g = 0;
        int gok = gap(r, t, k, m, &g);
        cell(buf, sizeof buf, r->acc[t][k][m] >= 0, r->acc[t][k][m], gok, g);
        fprintf(f, md ? " %s |" : " %15s", buf);
      }
      double aa = 0, ag = 0;
      int gok = 0, ok = average(r, t, m, &aa, &ag, &gok);
      cell(buf, sizeof buf, ok, aa, gok, ag);
      fprintf(f, md ? " %s |\n" : " %15s\n", buf);
    }
    /* the alpha each method got on the validation split */
    fprintf(f, md ? "\nalpha chosen on the validation split:" : "alpha:");
    int first = 1;
    for (int m = DEMO_M_NAIVE; m < DEMO_M_FT; m++) {
      if (r->acc[t][0][m] < 0 || m == DEMO_M_DISTILL) continue;
      fprintf(f, "%s %s", first ? "" : ";", demo_method_name(m));
      for (int k = 0; k < r->ntasks; k++)
        fprintf(f, "%s%g", k ? "/" : " ", r->alpha[t][k][m]);
      first = 0;
    }
    fprintf(f, md ? "\n\n" : "\n");
    /* the distillation has no alpha: its state is chosen label-free */
    fprintf(f, "distill: epoch kept by the held-out KL");
    for (int k = 0; k < r->ntasks; k++)
      fprintf(f, "%s%d", k ? "/" : " ", r->distill_epoch[t][k]);
    fprintf(f, "; teacher softmax(z_B + z_A_ft - z_A)");
    for (int k = 0; k < r->ntasks; k++)
      fprintf(f, "%s%.1f", k ? "/" : " ", r->teacher[t][k]);
    fprintf(f, "\n");
  }
  fprintf(f, md ? "\nSource A fine-tuned on each task (the task vectors):" :
                  "\nsource A fine-tuned:");
  for (int k = 0; k < r->ntasks; k++)
    fprintf(f, " %s %.1f", demo_task_name(r->tasks[k]), r->source_ft[k]);
  fprintf(f, "\n");
}

static const char *const COLORS[DEMO_NMETHODS] = {
    "#9e9e9e", "#8d6e63", "#ffb300", "#7cb342", "#1e88e5", "#64b5f6",
    "#3949ab", "#8e24aa", "#00897b", "#e53935"};

int demo_report_svg(const demo_result *r, const char *path) {
  FILE *f = fopen(path, "w");
  if (f == NULL) {
    fprintf(stderr, "demo: cannot write %s\n", path);
    return -1;
  }
  const int panel_h = 230, top = 50, left = 50, bar_w = 16;
  const int group_w = DEMO_NMETHODS * bar_w + 16, legend_w = 88;
  int groups = r->ntasks + 1;
  int width = left + groups * group_w + 20;
  if (width < left + DEMO_NMETHODS * legend_w + 20)
    width = left + DEMO_NMETHODS * legend_w + 20;
  int height = top + r->ntargets * (panel_h + 40) + 20;
  fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" "
             "height=\"%d\" font-family=\"sans-serif\" font-size=\"12\">\n"
             "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
             "<text x=\"%d\" y=\"18\" font-size=\"15\">libbico demo: "
             "test accuracy (%%) on Fashion-MNIST tasks, source A %s</text>\n",
          width, height, left, r->source_shape);
  for (int m = 0; m < DEMO_NMETHODS; m++) /* legend */
    fprintf(f, "<rect x=\"%d\" y=\"28\" width=\"10\" height=\"10\" "
               "fill=\"%s\"/><text x=\"%d\" y=\"37\">%s</text>\n",
            left + m * legend_w, COLORS[m], left + m * legend_w + 14,
            demo_method_name(m));
  for (int t = 0; t < r->ntargets; t++) {
    int y0 = top + t * (panel_h + 40) + 30; /* panel top */
    int yb = y0 + panel_h - 20;             /* axis */
    double scale = (panel_h - 30) / 100.0;
    fprintf(f, "<text x=\"%d\" y=\"%d\" font-weight=\"bold\">%s (%s)</text>\n",
            left, y0 - 6, r->target_names[t], r->target_shapes[t]);
    for (int v = 0; v <= 100; v += 25) {
      double y = yb - v * scale;
      fprintf(f, "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" "
                 "stroke=\"#ddd\"/><text x=\"%d\" y=\"%.1f\" "
                 "text-anchor=\"end\">%d</text>\n",
              left, y, width - 20, y, left - 4, y + 4, v);
    }
    for (int k = 0; k < groups; k++) {
      int gx = left + k * group_w + 8;
      for (int m = 0; m < DEMO_NMETHODS; m++) {
        double acc = -1, share;
        int gok;
        if (k < r->ntasks) acc = r->acc[t][k][m];
        else if (!average(r, t, m, &acc, &share, &gok)) acc = -1;
        if (acc < 0) continue;
        double h = acc * scale;
        fprintf(f, "<rect x=\"%d\" y=\"%.1f\" width=\"%d\" height=\"%.1f\" "
                   "fill=\"%s\"><title>%s %s: %.1f%%</title></rect>\n",
                gx + m * bar_w, yb - h, bar_w - 2, h, COLORS[m],
                demo_method_name(m),
                k < r->ntasks ? demo_task_name(r->tasks[k]) : "average", acc);
      }
      fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">%s</text>\n",
              gx + DEMO_NMETHODS * bar_w / 2, yb + 15,
              k < r->ntasks ? demo_task_name(r->tasks[k]) : "average");
    }
    fprintf(f, "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"black\"/>\n",
            left, yb, width - 20, yb);
  }
  fprintf(f, "</svg>\n");
  if (fclose(f) != 0) {
    fprintf(stderr, "demo: writing %s failed\n", path);
    return -1;
  }
  return 0;
}
