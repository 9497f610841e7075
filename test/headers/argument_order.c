/* The argument orders docs/api.md promises, checked by the compiler: each
 * function is assigned to a pointer of the promised type, which fails to
 * compile (-Werror, C99 and C++11) when a declaration drifts.
 *  - BLIS order: context, sizes (source side first), scalars, each input
 *    with its row stride, outputs (bico_lora_transport);
 *  - a count follows the buffer it sizes, readers and writers alike
 *    (bico_stfile_read_f32_range as bico_stwriter_write_f32_range);
 *  - one way to close: bico_X_free (bico_stfile_free);
 *  - the option grammar of params.h (bico_lora_set_param);
 *  - the depth map is a function of the two block counts. */
#include <bico/bico.h>

typedef bico_status (*lora_transport_fn)(bico_ctx *, size_t, size_t, size_t,
                                         size_t, size_t, size_t, float,
                                         const float *, const float *,
                                         const float *const *, size_t,
                                         const float *, size_t, float *,
                                         float *);
typedef bico_status (*read_f32_range_fn)(const bico_stfile *, size_t, size_t,
                                         float *, size_t);
typedef bico_status (*read_f64_range_fn)(const bico_stfile *, size_t, size_t,
                                         double *, size_t);
typedef bico_status (*write_f32_range_fn)(bico_stwriter *, const char *,
                                          size_t, const float *, size_t);
typedef void (*stfile_free_fn)(bico_stfile *);
typedef bico_status (*lora_set_param_fn)(bico_lora *, int, double);
typedef bico_status (*lora_get_param_fn)(const bico_lora *, int, double *);
typedef bico_status (*depthmap_source_fn)(size_t, size_t, size_t, size_t *);

int bico_argument_order_check(void);
int bico_argument_order_check(void) {
  lora_transport_fn a = bico_lora_transport;
  read_f32_range_fn b = bico_stfile_read_f32_range;
  read_f64_range_fn c = bico_stfile_read_f64_range;
  write_f32_range_fn d = bico_stwriter_write_f32_range;
  stfile_free_fn e = bico_stfile_free;
  lora_set_param_fn f = bico_lora_set_param;
  lora_get_param_fn g = bico_lora_get_param;
  depthmap_source_fn h = bico_depthmap_source;
  return a != 0 && b != 0 && c != 0 && d != 0 && e != 0 && f != 0 &&
         g != 0 && h != 0;
}
