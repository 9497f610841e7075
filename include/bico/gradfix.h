/* libbico: GradFix masks.
 *
 * For a source and target of identical shapes.  From the sign votes of a
 * target tensor (bico_votes, votes.h), the mask keeps the
 * coordinates of the task vector whose sign equals the estimated descent
 * sign:  m_i = 1 if sign(tau_i) == sign(v_i) != 0, else 0 (ties and zero
 * entries of tau are masked out).  Mode BICO_GRADFIX_MEAN uses the sign of
 * the summed descent direction instead of the vote. */
#ifndef BICO_GRADFIX_H
#define BICO_GRADFIX_H

#include <stddef.h>
#include <stdint.h>
#include "ctx.h"
#include "votes.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 0 asks for the default, MAJORITY. */
typedef enum bico_gradfix_mode {
  BICO_GRADFIX_MAJORITY = 1,
  BICO_GRADFIX_MEAN = 2
} bico_gradfix_mode;

/* Names of the modes: "majority", "mean". */
BICO_API const char *bico_gradfix_mode_name(int mode);
BICO_API bico_status bico_gradfix_mode_from_name(const char *name, int *mode);

/* mask[i] = 1 where tau's sign agrees with the estimated descent sign, else
 * 0; *kept (may be NULL) gets the number of ones. */
BICO_API bico_status bico_gradfix_mask(const bico_votes *v, int mode,
                                       const float *tau, uint8_t *mask,
                                       size_t *kept);

/* out = alpha (m * tau) + beta out, element-wise, with the mask above
 * (beta = 0: out is not read). */
BICO_API bico_status bico_gradfix_apply(const bico_votes *v, int mode,
                                        float alpha, const float *tau,
                                        float beta, float *out, size_t *kept);

#ifdef __cplusplus
}
#endif
#endif
