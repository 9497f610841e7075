/* Downstream tasks: fixed transformations of Fashion-MNIST that a model
 * pretrained on the plain images does badly on, so fine-tuning has a gap to
 * close.  Each transformation is a fixed function (its seeds are constants),
 * applied identically to the fine-tuning, calibration, validation and test
 * samples. */
#include <stdlib.h>
#include <string.h>

#include "demo.h"

static const char *const NAMES[DEMO_NTASKS] = {"rot90", "invert", "patches",
                                               "labels"};

const char *demo_task_name(int task) {
  return task >= 0 && task < DEMO_NTASKS ? NAMES[task] : "?";
}

int demo_task_apply(int task, const demo_data *d, demo_data *out) {
  if (demo_data_slice(d, 0, d->n, out) != 0) return -1;
  size_t n = d->n;
  switch (task) {
    case DEMO_TASK_ROT90: /* quarter turn clockwise: out(r, c) = in(27 - c, r) */
      for (size_t i = 0; i < n; i++) {
        const float *s = d->x + i * DEMO_PIX;
        float *t = out->x + i * DEMO_PIX;
        for (int r = 0; r < 28; r++)
          for (int c = 0; c < 28; c++) t[r * 28 + c] = s[(27 - c) * 28 + r];
      }
      break;
    case DEMO_TASK_INVERT: /* dark garments on a white ground */
      for (size_t i = 0; i < n * DEMO_PIX; i++) out->x[i] = 1.f - d->x[i];
      break;
    case DEMO_TASK_PATCHES: { /* the 7x7 grid of 4x4 patches, shuffled */
      size_t perm[49];
      demo_rng r = {0x5eed0003u};
      demo_rng_perm(&r, 49, perm);
      for (size_t i = 0; i < n; i++) {
        const float *s = d->x + i * DEMO_PIX;
        float *t = out->x + i * DEMO_PIX;
        for (int p = 0; p < 49; p++) {
          int sp = (int)perm[p];
          for (int r = 0; r < 4; r++)
            for (int c = 0; c < 4; c++)
              t[((p / 7) * 4 + r) * 28 + (p % 7) * 4 + c] =
                  s[((sp / 7) * 4 + r) * 28 + (sp % 7) * 4 + c];
        }
      }
      break;
    }
    case DEMO_TASK_LABELS: { /* a fixed derangement of the classes */
      size_t perm[DEMO_CLASSES];
      demo_rng r = {0x5eed0004u};
      for (;;) { /* redraw until no class keeps its label */
        demo_rng_perm(&r, DEMO_CLASSES, perm);
        int fixed = 0;
        for (int k = 0; k < DEMO_CLASSES; k++) fixed |= perm[k] == (size_t)k;
        if (!fixed) break;
      }
      for (size_t i = 0; i < n; i++) out->y[i] = (uint8_t)perm[d->y[i]];
      break;
    }
    default:
      demo_data_free(out);
      return -1;
  }
  return 0;
}
