/* The argument orders docs/api.md promises, checked by the compiler: each
 * function is assigned to a pointer of the promised type, which fails to
 * compile (-Werror, C99 and C++11) when a declaration drifts.
 *  - BLIS order: context, sizes (source side first), scalars, each input
 *    with its row stride, outputs (bico_lora_transport);
 *  - a count follows the buffer it sizes, readers and writers alike
 *    (bico_stfile_read_f32_range as bico_stwriter_write_f32_range);
 *  - one way to close: bico_X_free (bico_stfile_free);
 *  - the option grammar of params.h (bico_lora_set_param);
 *  - the depth map is a function of the two block counts;
 *  - one way to report a count: a status and an out-pointer,
 *    bico_X_count(const bico_X *, size_t *n). */
#include <bico/bico.h>

typedef bico_status (*lora_transport_fn)(bico_ctx *, size_t, size_t, size_t,
                                         size_t, size_t, size_t, float,
                                         const float *, const float *,
                                         float *const *, size_t,
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
typedef bico_status (*stfile_count_fn)(const bico_stfile *, size_t *);
typedef bico_status (*model_count_fn)(const bico_model *, size_t *);
typedef bico_status (*lora_count_fn)(const bico_lora *, size_t *);
typedef bico_status (*transfer_count_fn)(const bico_transfer *, size_t *);

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
  stfile_count_fn i = bico_stfile_count, j = bico_stfile_metadata_count;
  model_count_fn k = bico_model_tensor_count, l = bico_model_module_count;
  lora_count_fn m = bico_lora_module_count, n = bico_lora_saved_count;
  transfer_count_fn o = bico_transfer_explain_count;
  return a != 0 && b != 0 && c != 0 && d != 0 && e != 0 && f != 0 &&
         g != 0 && h != 0 && i != 0 && j != 0 && k != 0 && l != 0 &&
         m != 0 && n != 0 && o != 0;
}
